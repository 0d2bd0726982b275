"""kernels/reference.py against a naive dense causal attention (float64 SDPA with an
explicit mask) over contiguous K/V, through shuffled, non-contiguous page tables.

Dimension letters: T new tokens, H query heads, K kv heads, D head dim, P pages, S page
size, L = prefix_len + extend_len.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels import reference
from radixlm.kernels.reference import gather_kv, paged_attention, paged_decode_attention, store_kv

HEAD_DIM = 8
# (prefix_len, extend_len) per request: prefill, decode rows, chunked extend, lengths that
# are not multiples of any page size, a zero-length prefix.
MIXED = [(0, 7), (5, 1), (13, 9), (0, 1), (30, 1), (17, 16)]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int
) -> torch.Tensor:
    """q [E, H, D], k/v [L, K, D] contiguous -> [E, H, D], float64, causal bottom-right."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    extend_len, seq_len = q.shape[0], k.shape[1]
    mask = torch.ones(extend_len, seq_len, dtype=torch.bool).tril(diagonal=prefix_len)  # [E, L]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)  # [H, E, D] -> [E, H, D]


def make_paged(
    lens: list[int], num_kv_heads: int, page_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Random K/V per request written into NaN-poisoned pools at shuffled page ids.

    Returns (k_pool [P,S,K,D], v_pool, page_table [B,Pmax] int32, dense k list, dense v list).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 3
    shape = (num_pages, page_size, num_kv_heads, HEAD_DIM)
    k_pool, v_pool = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # never page 0
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(lens):
        pages = [free.pop() for _ in range(need[b])]
        table[b, : need[b]] = torch.tensor(pages, dtype=torch.int32)
        k, v = (torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for _ in range(2))
        for t in range(n):
            k_pool[pages[t // page_size], t % page_size] = k[t]
            v_pool[pages[t // page_size], t % page_size] = v[t]
        ks.append(k)
        vs.append(v)
    return k_pool, v_pool, table, ks, vs


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2)])
def test_paged_attention_matches_dense(page_size: int, num_heads: int, num_kv_heads: int) -> None:
    prefix, extend = [p for p, _ in MIXED], [e for _, e in MIXED]
    lens = [p + e for p, e in MIXED]
    k_pool, v_pool, table, ks, vs = make_paged(lens, num_kv_heads, page_size)
    q = torch.randn(sum(extend), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    scale = HEAD_DIM**-0.5
    out = paged_attention(q, k_pool, v_pool, table, prefix, extend, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "read a poisoned slot outside a sequence"
    start = 0
    for b, (p_len, e_len) in enumerate(MIXED):
        ref = dense_attention(q[start : start + e_len], ks[b], vs[b], p_len)
        torch.testing.assert_close(out[start : start + e_len].double(), ref, atol=1e-5, rtol=1e-5)
        start += e_len


def test_paged_attention_accepts_tensor_lengths_and_bf16() -> None:
    prefix, extend = (
        torch.tensor([3, 0], dtype=torch.int32),
        torch.tensor([1, 5], dtype=torch.int32),
    )
    k_pool, v_pool, table, ks, vs = make_paged([4, 5], 2, 4)
    q = torch.randn(6, 4, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    out32 = paged_attention(q, k_pool, v_pool, table, prefix, extend, HEAD_DIM**-0.5)
    out16 = paged_attention(
        q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16(), table, [3, 0], [1, 5], HEAD_DIM**-0.5
    )
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, atol=3e-2, rtol=3e-2)
    ref = dense_attention(q[:1], ks[0], vs[0], 3)[0]  # float64
    torch.testing.assert_close(out32[0].double(), ref, atol=1e-5, rtol=1e-5)  # fp32 math


def test_first_query_of_prefill_sees_only_itself() -> None:
    k_pool, v_pool, table, _, vs = make_paged([5], 1, 4)
    out = paged_attention(torch.randn(5, 2, HEAD_DIM), k_pool, v_pool, table, [0], [5], 1.0)
    torch.testing.assert_close(out[0], vs[0][0].expand(2, HEAD_DIM))


def test_gather_kv_follows_page_table() -> None:
    k_pool, _, table, ks, _ = make_paged([9, 3], 2, 4)
    torch.testing.assert_close(gather_kv(k_pool, table[0], 9), ks[0])
    torch.testing.assert_close(gather_kv(k_pool, table[1], 3), ks[1])


def test_store_kv_writes_exactly_the_given_slots() -> None:
    pages, page_size, kv_heads = 6, 4, 2
    shape = (pages, page_size, kv_heads, HEAD_DIM)
    k_pool, v_pool = torch.full(shape, -7.0), torch.full(shape, -7.0)
    slots = torch.tensor([21, 5, 6, 13, 0], dtype=torch.int64)  # across pages, out of order
    kv = torch.randn(len(slots), 2 * kv_heads, HEAD_DIM)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]  # strided views, like the model passes them
    store_kv(k_pool, v_pool, k, v, slots)
    flat_k, flat_v = k_pool.view(-1, kv_heads, HEAD_DIM), v_pool.view(-1, kv_heads, HEAD_DIM)
    torch.testing.assert_close(flat_k[slots], k)
    torch.testing.assert_close(flat_v[slots], v)
    untouched = torch.ones(pages * page_size, dtype=torch.bool)
    untouched[slots] = False
    assert (flat_k[untouched] == -7.0).all() and (flat_v[untouched] == -7.0).all()


def test_store_kv_casts_to_pool_dtype() -> None:
    k_pool = torch.zeros(2, 4, 1, HEAD_DIM, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    k = torch.randn(1, 1, HEAD_DIM)
    store_kv(k_pool, v_pool, k, k, torch.tensor([6]))
    torch.testing.assert_close(k_pool[1, 2].float(), k[0].bfloat16().float())


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_paged_decode_attention_matches_dense(page_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Batched decode over NaN-poisoned pools (padding slots must not leak) equals the
    dense reference and the per-request paged_attention."""
    lens = [1, 5, 16, 17, 33]
    k_pool, v_pool, table, ks, vs = make_paged(lens, num_kv_heads, page_size, seed=3)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    scale = HEAD_DIM**-0.5
    out = paged_decode_attention(q, k_pool, v_pool, table, lens, scale)
    assert out.shape == q.shape and not out.isnan().any()
    for b, n in enumerate(lens):
        ref = dense_attention(q[b : b + 1], ks[b], vs[b], n - 1)
        torch.testing.assert_close(out[b : b + 1].double(), ref, atol=1e-5, rtol=1e-5)
    loop = paged_attention(q, k_pool, v_pool, table, [n - 1 for n in lens], [1] * len(lens), scale)
    torch.testing.assert_close(out, loop, atol=1e-6, rtol=1e-6)


def test_int4_keys_per_channel_within_a_page() -> None:
    """KIVI keys: statistics per (kv head, channel) over the page's tokens; error <= half
    a step (plus the fp16 rounding of the statistics); a constant channel is exact."""
    gen = torch.Generator().manual_seed(0)
    page = torch.randn(16, 2, 8, generator=gen) * torch.tensor([1.0, 10.0, 0.1, 1, 1, 1, 1, 1])
    page[:, 1, 3] = 2.5  # constant channel
    packed, scale, zero = reference.quantize_int4(page, dim=0)
    assert packed.shape == (16, 2, 4) and packed.dtype == torch.uint8
    assert scale.shape == zero.shape == (1, 2, 8) and scale.dtype == torch.float16
    back = reference.dequantize_int4(packed, scale, zero)
    assert float(back[:, 1, 3].sub(2.5).abs().max()) == 0.0
    step = scale.float()
    assert bool(((back - page).abs() <= step / 2 + 1e-3 * page.abs() + 1e-3).all())
    torch.testing.assert_close(back.amin(0), page.amin(0), atol=2e-3, rtol=2e-3)  # min is a code point
    # Nibble order: element 2i low, 2i + 1 high.
    codes = torch.round((page - zero.float()) / scale.float()).clamp(0, 15).to(torch.uint8)
    assert torch.equal(packed & 0xF, codes[..., 0::2]) and torch.equal(packed >> 4, codes[..., 1::2])


def test_int4_values_per_token_groups() -> None:
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(5, 2, 64, generator=gen)
    packed, scale, zero = reference.quantize_int4(v.view(5, 2, 2, 32), dim=-1)
    assert packed.shape == (5, 2, 2, 16) and scale.shape == (5, 2, 2, 1)
    back = reference.dequantize_int4(packed, scale, zero).view(5, 2, 64)
    err = (back - v).abs().view(5, 2, 2, 32)
    assert bool((err <= scale.float() / 2 + 2e-3).all())
    rel = float((back - v).norm() / v.norm())
    assert 0.02 < rel < 0.15, rel  # 16 levels over each group's range


def dense_windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float,
                   softcap: float | None, window: int | None) -> torch.Tensor:
    """The explicit float64 oracle: q [E, H, D], k/v [L, K, D] -> [E, H, D], soft-cap before
    the causal (bottom-right) mask, a window W keeping keys (p - W, p] of query position p."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))  # [L, H, D]
    scores = torch.einsum("ehd,lhd->hel", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(q.shape[0])[:, None] + prefix_len
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hel,lhd->ehd", probs, v)


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("window", [None, 6])
def test_window_and_softcap_match_the_dense_oracle(softcap: float | None, window: int | None) -> None:
    """The fused SDPA path (no soft-cap) and the einsum path (soft-cap) of extends and of
    batched decode, with and without a sliding window, over NaN-poisoned pages."""
    num_heads, num_kv_heads, scale = 6, 2, 0.7  # a large scale: the soft-cap bites
    k_pool, v_pool, table, ks, vs = make_paged([p + e for p, e in MIXED], num_kv_heads, 4, seed=5)
    q = torch.randn(sum(e for _, e in MIXED), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    out = paged_attention(q, k_pool, v_pool, table, [p for p, _ in MIXED], [e for _, e in MIXED], scale,
                          softcap=softcap, window=window)  # fmt: skip
    start = 0
    for b, (p_len, e_len) in enumerate(MIXED):
        ref = dense_windowed(q[start : start + e_len], ks[b], vs[b], p_len, scale, softcap, window)
        torch.testing.assert_close(out[start : start + e_len].double(), ref, atol=1e-5, rtol=1e-5)
        start += e_len
    lens = [1, 5, 16, 17, 33]
    k_pool, v_pool, table, ks, vs = make_paged(lens, num_kv_heads, 4, seed=7)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(8))
    out = paged_decode_attention(q, k_pool, v_pool, table, lens, scale, softcap=softcap, window=window)
    for b, n in enumerate(lens):
        ref = dense_windowed(q[b : b + 1], ks[b], vs[b], n - 1, scale, softcap, window)
        torch.testing.assert_close(out[b : b + 1].double(), ref, atol=1e-5, rtol=1e-5)
    one = paged_decode_attention(q[4:], k_pool, v_pool, table[4:], lens[4:], scale, softcap=softcap,
                                 window=window)  # batch 1: no padding, no mask  # fmt: skip
    torch.testing.assert_close(one, out[4:], atol=1e-6, rtol=1e-6)
