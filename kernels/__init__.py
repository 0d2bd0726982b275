"""Attention / KV-cache ops.

Submodules: ``reference`` (plain PyTorch; also the CPU attention backend), and the Triton
kernels ``store_kv``, ``decode_attention``, ``extend_attention`` (each imports triton, so
import them only where triton is wanted). The package re-exports only reference ops whose
names do not shadow a submodule.
"""

from __future__ import annotations

if "." not in __name__:  # imported as top-level ``kernels`` from a checkout's root: not us
    from radixlm_pkg import (
        _defer_to_top_level,  # the checkout's own copy: radixlm may not be installed
    )

    _defer_to_top_level(__name__, __file__)
else:
    from radixlm.kernels.reference import gather_kv, paged_attention

__all__ = ["gather_kv", "paged_attention"]
