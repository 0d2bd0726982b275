"""Fixtures for the Triton kernel tests: interpreter mode on CPU and a paged-batch factory.

Without CUDA the Triton kernels run under the interpreter (``TRITON_INTERPRET=1`` must be
set before ``triton.jit`` decorates them, i.e. before the kernel modules are imported,
which happens when pytest imports the test modules of this folder, after this file).

Dimension letters: B requests, T new tokens, H query heads, K kv heads, D head dim,
P pages, S page size, Pmax pages per request.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedCase:
    """A batch whose K/V (prefix + new tokens) already sit in NaN-poisoned pools."""

    q: torch.Tensor  # [T, H, D] queries of the new tokens
    k_pool: torch.Tensor  # [P, S, K, D]; NaN outside every sequence (page 0 too)
    v_pool: torch.Tensor
    page_table: torch.Tensor  # [B, Pmax] int32, shuffled page ids, padded with 0
    prefix: list[int]
    extend: list[int]
    prefix_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_extend: torch.Tensor  # [B+1] int32

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    @property
    def max_extend(self) -> int:
        return max(self.extend)


def make_paged_case(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
    seed: int = 0,
    spare_pages: int = 3,
) -> PagedCase:
    """``specs[b] = (prefix_len, extend_len)``; pages are a random permutation of 1..P-1."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in specs]
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + spare_pages + 1
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pool = torch.full(shape, float("nan"), dtype=dtype)
    v_pool = torch.full(shape, float("nan"), dtype=dtype)
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(specs), max(need) + 1, dtype=torch.int32)  # one padding column
    for b, n in enumerate(lens):
        pages = torch.tensor([free.pop() for _ in range(need[b])], dtype=torch.int64)
        table[b, : need[b]] = pages.to(torch.int32)
        pos = torch.arange(n)
        page, slot = pages[pos // page_size], pos % page_size
        k_pool[page, slot] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_pool[page, slot] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_tokens = sum(e for _, e in specs)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    cu = list(itertools.accumulate((e for _, e in specs), initial=0))

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return PagedCase(
        q=q.to(device),
        k_pool=k_pool.to(device),
        v_pool=v_pool.to(device),
        page_table=table.to(device),
        prefix=[p for p, _ in specs],
        extend=[e for _, e in specs],
        prefix_lens=i32([p for p, _ in specs]),
        seq_lens=i32(lens),
        cu_extend=i32(cu),
    )


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has a NaN)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


@pytest.fixture
def paged_case() -> Callable[..., PagedCase]:
    return make_paged_case


@pytest.fixture
def relerr() -> Callable[[torch.Tensor, torch.Tensor], float]:
    return rel_error
