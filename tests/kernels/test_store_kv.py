"""kernels/store_kv.py (Triton) against kernels/reference.py: slots anywhere inside pages
(partly filled last pages, mid-page chunk starts), strided k/v views, dtype casts, and
untouched slots left exactly as they were (NaN-poisoned pools).

Dimension letters: T new tokens, K kv heads, D head dim, P pages, S page size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.store_kv import store_kv  # noqa: E402

from .conftest import DEVICE  # noqa: E402


def _slots(num_pages: int, page_size: int, num_tokens: int, seed: int) -> torch.Tensor:
    """Distinct flat slots spread over shuffled pages (never page 0), any offset in a page."""
    gen = torch.Generator().manual_seed(seed)
    all_slots = torch.arange(page_size, num_pages * page_size)  # page 0 excluded
    return all_slots[torch.randperm(len(all_slots), generator=gen)[:num_tokens]]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 64), (2, 128)])
def test_store_kv_matches_reference(page_size: int, num_kv_heads: int, head_dim: int) -> None:
    num_pages, num_tokens = 9, 7
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pool = torch.full(shape, float("nan"), device=DEVICE)
    v_pool = torch.full(shape, float("nan"), device=DEVICE)
    slots = _slots(num_pages, page_size, min(num_tokens, (num_pages - 1) * page_size), 0)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(len(slots), 3 * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]  # strided views
    slots = slots.to(DEVICE)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    reference.store_kv(k_ref, v_ref, k, v, slots)
    store_kv(k_pool, v_pool, k, v, slots)
    torch.testing.assert_close(k_pool, k_ref, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_pool, v_ref, equal_nan=True, rtol=0, atol=0)


def test_store_kv_casts_to_pool_dtype() -> None:
    k_pool = torch.zeros(3, 4, 2, 64, dtype=torch.float16, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    k, v = torch.randn(2, 2, 64, device=DEVICE), torch.randn(2, 2, 64, device=DEVICE)
    slots = torch.tensor([6, 11], device=DEVICE)  # page 1 offset 2, page 2 offset 3
    store_kv(k_pool, v_pool, k, v, slots)
    torch.testing.assert_close(k_pool[1, 2], k[0].half(), rtol=0, atol=0)
    torch.testing.assert_close(v_pool[2, 3], v[1].half(), rtol=0, atol=0)
    assert k_pool.count_nonzero() == 2 * 2 * 64


def test_store_kv_rejects_bad_inputs() -> None:
    k_pool = torch.zeros(3, 4, 2, 64, device=DEVICE)
    k = torch.randn(2, 2, 64, device=DEVICE)
    with pytest.raises(AssertionError):
        store_kv(
            k_pool, k_pool.clone(), k, k, torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
        )
    with pytest.raises(AssertionError):  # scales belong to FP8 pools only
        store_kv(k_pool, k_pool.clone(), k, k, torch.tensor([1, 2], device=DEVICE), k_scale=k)
