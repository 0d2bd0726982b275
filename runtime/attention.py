"""Attention backends: how one layer stores new K/V into the paged pool and attends.

The model is generic over the backend: every attention layer calls
``backend.forward(q, k, v, layer_id, batch, pool)``. Backends are registered by name in
``ATTENTION_BACKENDS``; its keys (plus "auto") are the CLI choices of
``--attention-backend``.

Dimension letters: T new tokens in the pass, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixlm.kernels import reference
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory_pool import KVPool

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "TorchAttentionBackend",
    "attention_backend_choices",
    "create_attention_backend",
]


class AttentionBackend(ABC):
    """Paged attention for one forward pass, called once per layer.

    Contract of ``forward``:
      * write ``k``/``v`` of the new tokens into ``pool.k[layer_id]`` / ``pool.v[layer_id]``
        at ``batch.out_slots`` (flat slot = page * S + offset);
      * return, for every new token, causal attention over its request's whole sequence
        (cached prefix pages + the new tokens up to itself), softmax scale ``D ** -0.5``,
        GQA head mapping ``h -> h // (H // K)``;
      * inputs may be strided views (last dim contiguous); output is [T, H, D], q's dtype.

    ``prepare(batch, pool)`` is called once per forward pass before layer 0, so a backend
    can build per-batch metadata (split sizes, CUDA-graph buffers) once, not per layer.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:  # noqa: B027 - optional hook
        """Per-pass setup hook; the default does nothing."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, K, D] -> attention output [T, H, D]."""


class TorchAttentionBackend(AttentionBackend):
    """Reference backend in plain PyTorch (``radixlm.kernels.reference``); runs anywhere."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        k_pool, v_pool = pool.k[layer_id], pool.v[layer_id]
        reference.store_kv(k_pool, v_pool, k, v, batch.out_slots)
        return reference.paged_attention(
            q,
            k_pool,
            v_pool,
            batch.page_table,
            batch.prefix_lens_cpu,
            batch.extend_lens_cpu,
            scale=q.shape[-1] ** -0.5,
        )


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def attention_backend_choices() -> tuple[str, ...]:
    """Names accepted by ``create_attention_backend`` (for CLI ``choices``)."""
    return ("auto", *ATTENTION_BACKENDS)


def _auto_backend(device: torch.device) -> str:
    """The backend "auto" resolves to on ``device`` (only "torch" exists so far)."""
    return "torch"


def create_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Instantiate the backend registered as ``name`` ("auto" picks one for ``device``).

    Raises ValueError for an unknown name, listing the choices.
    """
    device = torch.device(device)
    if name == "auto":
        name = _auto_backend(device)
    if name not in ATTENTION_BACKENDS:
        choices = ", ".join(attention_backend_choices())
        raise ValueError(f"unknown attention backend {name!r}; choices: {choices}")
    return ATTENTION_BACKENDS[name](device)
