"""KV cache formats by name (``--kv-cache-dtype``) and their constants. Torch-free, so the
config (``radixlm.runtime.server_args``) can list the choices without importing torch.
The layouts themselves are described in ``kv_pool``."""

from __future__ import annotations

__all__ = ["DEFAULT_KV_SINK_SLOTS", "INT4_VALUE_GROUP", "KV_CACHE_DTYPES", "KV_ROTATIONS", "TIERED_KV"]

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8_e4m3", "int4", "mixed")
TIERED_KV = ("int4", "mixed")  # INT4 pages + FP8 slots for the pages not demoted yet
DEFAULT_KV_SINK_SLOTS = 64  # fp8_e4m3: exact attention sink slots (distinct first tokens), --kv-sink-slots
INT4_VALUE_GROUP = 64  # values: one scale + zero-point per 64 channels of a token (min with D)
KV_ROTATIONS = ("hadamard",)  # key rotations of quantised pools (module doc; None: keys as they are)
