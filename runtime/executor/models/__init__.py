"""Model implementations, looked up by the ``architectures`` name in config.json.

One module per family, each a small subclass of the shared decoder (``decoder.py``):
``llama`` (Llama, Qwen2), ``qwen3`` (Qwen3, Qwen3-MoE), ``mistral`` (Mistral, Mixtral),
``gemma`` (Gemma, Gemma 2, Gemma 3 text), ``phi3`` (Phi-3). docs/MODELS.md lists what each adds.
"""

from __future__ import annotations

from radixlm.runtime.executor.models.decoder import CausalLM
from radixlm.runtime.executor.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GemmaForCausalLM,
)
from radixlm.runtime.executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from radixlm.runtime.executor.models.mistral import MistralForCausalLM, MixtralForCausalLM
from radixlm.runtime.executor.models.phi3 import Phi3ForCausalLM
from radixlm.runtime.executor.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM

__all__ = ["MODEL_REGISTRY", "CausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "UnsupportedArchitecture",
           "model_class"]

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    cls.__name__: cls
    for cls in (
        LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MistralForCausalLM,
        MixtralForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM,
    )
}  # fmt: skip


class UnsupportedArchitecture(ValueError):
    """config.json names no architecture radixlm serves (a user error: start-up reports
    the message alone, without a traceback)."""


def model_class(architectures: list[str]) -> type[CausalLM]:
    """The class of the first of config.json's ``architectures`` we support.

    Raises UnsupportedArchitecture (a ValueError) naming the architectures asked for and
    the supported ones.
    """
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedArchitecture(f"unsupported architecture {architectures}; radixlm supports: "
                     f"{', '.join(sorted(MODEL_REGISTRY))}")  # fmt: skip
