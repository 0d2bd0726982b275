"""Attention / KV-cache ops: plain-PyTorch references (``reference``) and Triton kernels."""

from __future__ import annotations

from radixlm.kernels.reference import gather_kv, paged_attention, store_kv

__all__ = ["gather_kv", "paged_attention", "store_kv"]
