"""radixlm: an LLM serving runtime built around RadixAttention.

Subpackages: ``radixlm.radix`` (torch-free radix tree), ``radixlm.kernels`` (attention ops),
``radixlm.runtime`` (server, scheduler, model runner), ``radixlm.frontend`` (DSL).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
