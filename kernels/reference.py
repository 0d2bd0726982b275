"""Plain-PyTorch reference ops for the paged KV cache (also the CPU attention backend).

Dimension letters: B requests, T new tokens in the pass (sum of extend lengths),
H query heads, K kv heads, D head dim, P pages, S page size, Pmax pages per request,
L = prefix_len + extend_len (keys one request attends to).

KV layout, one layer (see ``radixlm.runtime.memory.kv_pool``)::

    k_pool[P, S, K, D]   v_pool[P, S, K, D]
    logical position t of request b  ->  page page_table[b, t // S], slot t % S
    flat slot id                     ->  page * S + slot   (index into k_pool.view(-1, K, D))

An FP8 V pool is stored channel-major (``channel_major``): [P, K, D, S] in memory, the same
[P, S, K, D] tensor to index, with other strides.

Extend attention with a cached prefix (one request, causal, bottom-right aligned)::

    keys:     0 ........... prefix_len ................. L-1
              |<- cached pages ->|<--- extend tokens --->|
    query i (position prefix_len + i) attends to keys [0, prefix_len + i]

A decode step is the special case extend_len == 1; a plain prefill is prefix_len == 0.

Algorithms: PagedAttention (Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023) for the page-table indirection, and
RadixAttention (Zheng et al., "SGLang: Efficient Execution of Structured Language Model
Programs", 2024) for attending to prefix pages shared through a radix tree.

Caveats: this is the plain path: extends loop over requests in Python, every pass
gathers each request's K/V into a dense [L, K, D] copy, and the math is float32 (PyTorch's
fused ``scaled_dot_product_attention``, or einsum / softmax with a soft-cap). The Triton
kernels are tested against it, and it is tested against the einsum spelling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "Sink",
    "dequantize_fp8",
    "dequantize_int4",
    "dequantize_int4_pages",
    "dequantize_tiered_pages",
    "fused_moe",
    "moe_route",
    "quantize_int4",
    "quantize_int4_pages",
    "gather_kv",
    "paged_attention",
    "paged_decode_attention",
    "quantize_fp8",
    "store_kv",
]

IntList = Sequence[int] | torch.Tensor

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def channel_major(v_pool: torch.Tensor) -> bool:
    """Whether ``v_pool`` [P, S, K, D] is an FP8 V pool stored channel-major: [P, K, D, S] in
    memory (strides (K*D*S, 1, D*S, S); ``channel_major_pool`` makes one), with a page size
    that is a power of two >= 2."""
    _, page_size, _, head_dim = v_pool.shape
    return (v_pool.dtype == torch.float8_e4m3fn and page_size >= 2 and page_size & (page_size - 1) == 0
            and v_pool.stride()[1:] == (1, head_dim * page_size, page_size))


def channel_major_pool(shape: tuple[int, int, int, int], device: torch.device | str) -> torch.Tensor:
    """A zero-filled float8_e4m3fn V pool of logical shape [P, S, K, D] stored channel-major
    ([P, K, D, S] in memory; S a power of two >= 2): each page holds, per kv head and channel,
    its S values side by side. The decode and extend kernels then load a V tile's keys as
    contiguous bytes, so the P @ V dot's 8-bit operand needs no per-byte shared-memory loads
    (on the H200 at 32 x 32K keys: 1.86x bf16 pages against 1.52x row-major;
    BENCHMARKS.md "Quantised KV cache: speed" and its ``fp8_decode_probe_layouts.json``).
    Zero-filled because the kernels read whole pages of V: slots past a request's last key are
    weighted 0 and must hold finite values (``store_kv`` clamps to +-448)."""
    num_pages, page_size, num_kv_heads, head_dim = shape
    assert page_size >= 2 and page_size & (page_size - 1) == 0, page_size
    pool = torch.zeros((num_pages, num_kv_heads, head_dim, page_size), dtype=torch.float8_e4m3fn, device=device)
    return pool.permute(0, 3, 1, 2)


def quantize_fp8(
    x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K, D] float -> float8_e4m3fn [..., K, D]: ``clamp((x - mean[k]) / scale[k],
    +-448)`` rounded to nearest even. ``scale`` [K] float32 (one per kv head, > 0);
    ``mean`` [K, D] float32 channel means or None (zero)."""
    x = x.float() if mean is None else x.float() - mean.float()
    scaled = x / scale.float()[:, None]
    return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., K, D] -> float32 ``x * scale[k]`` (``scale`` [K] float32)."""
    return x.float() * scale.float()[:, None]


def quantize_int4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantisation with statistics over ``dim`` (KIVI, Liu et al. 2024).

    Keys: ``x`` a page [S, K, D] with ``dim=0`` (per channel within the page); values:
    ``x`` [T, K, D // G, G] with ``dim=-1`` (per token, groups of G along D). For every
    slice along ``dim``: zero = min, scale = (max - min) / 15, both rounded to fp16 first;
    code = clamp(round((x - zero) / scale), 0, 15) (a constant slice gets scale 1, code 0).

    Returns (packed, scale, zero): ``packed`` uint8 with the last dim halved, two codes
    per byte (element 2i in the low nibble, 2i + 1 in the high one); ``scale`` and
    ``zero`` fp16 with ``dim`` reduced to size 1. The last dim of ``x`` must be even.
    """
    x = x.float()
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    zero = lo.half()
    scale = ((hi - lo) / 15).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - zero.float()) / scale.float()).clamp(0, 15).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale, zero


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_int4``: float32 ``code * scale + zero``, last dim doubled."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # [..., D]
    return codes.float() * scale.float() + zero.float()


def quantize_int4_pages(
    k: torch.Tensor, v: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole pages to INT4 (KIVI): keys per channel within the page, values per token in
    groups of ``group`` along D (``quantize_int4``).

    Args:
        k, v: [n, S, K, D] float pages (D even, a multiple of ``group``).
        group: value group size G along D.

    Returns:
        (k_codes [n, S, K, D/2] uint8, k_stat [n, 2, K, D] fp16 (scale, zero per channel),
        v_codes [n, S, K, D/2] uint8, v_stat [n, S, K, 2, D/G] fp16 (scale, zero per group)).
    """
    n, page_size, num_kv_heads, head_dim = v.shape
    k_codes, k_scale, k_zero = quantize_int4(k, dim=1)  # stats [n, 1, K, D]
    k_stat = torch.cat((k_scale, k_zero), dim=1)  # [n, 2, K, D]
    grouped = v.reshape(n, page_size, num_kv_heads, head_dim // group, group)
    v_codes, v_scale, v_zero = quantize_int4(grouped, dim=-1)  # codes [n, S, K, D/G, G/2]
    v_stat = torch.stack((v_scale[..., 0], v_zero[..., 0]), dim=3)  # [n, S, K, 2, D/G]
    return k_codes, k_stat, v_codes.reshape(n, page_size, num_kv_heads, head_dim // 2), v_stat


def dequantize_int4_pages(
    k_codes: torch.Tensor, k_stat: torch.Tensor, v_codes: torch.Tensor, v_stat: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``quantize_int4_pages`` -> (k, v) float32 [n, S, K, D]."""
    k = dequantize_int4(k_codes, k_stat[:, 0:1], k_stat[:, 1:2])
    n, page_size, num_kv_heads, half = v_codes.shape
    num_groups = v_stat.shape[-1]
    codes = v_codes.reshape(n, page_size, num_kv_heads, num_groups, half // num_groups)
    v = dequantize_int4(codes, v_stat[:, :, :, 0, :, None], v_stat[:, :, :, 1, :, None])
    return k, v.reshape(n, page_size, num_kv_heads, 2 * half)


def dequantize_tiered_pages(
    pages: torch.Tensor,
    fp8_slot: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_codes: torch.Tensor,
    k_stat: torch.Tensor,
    v_codes: torch.Tensor,
    v_stat: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read pages of a tiered (INT4 + FP8-slot) pool of one layer as float32 (k, v) [n, S, K, D].

    A logical page ``p`` is in FP8 slot ``fp8_slot[p]`` of ``k8``/``v8`` ([F, S, K, D]
    float8_e4m3fn, static [K] scales) when that is >= 0, else INT4 in ``k_codes[p]`` etc.
    (layouts of ``quantize_int4_pages``, indexed by logical page). ``pages`` [n] int64.
    """
    slots = fp8_slot[pages].long()  # [n]
    in_fp8 = (slots >= 0)[:, None, None, None]
    safe = slots.clamp(min=0)
    k_fp8 = dequantize_fp8(k8.view(torch.uint8)[safe].view(torch.float8_e4m3fn), k_scale)
    v_fp8 = dequantize_fp8(v8.view(torch.uint8)[safe].view(torch.float8_e4m3fn), v_scale)
    k4, v4 = dequantize_int4_pages(k_codes[pages], k_stat[pages], v_codes[pages], v_stat[pages])
    return torch.where(in_fp8, k_fp8, k4), torch.where(in_fp8, v_fp8, v4)


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
) -> None:
    """Write new tokens' K/V into their page slots, in place.

    Args:
        k_pool, v_pool: [P, S, K, D] pools of one layer (any float dtype; k/v are cast),
            or float8_e4m3fn pools with ``k_scale``/``v_scale``.
        k, v: [T, K, D] keys / values of the new tokens (may be strided views).
        out_slots: [T] int64 flat slot ids (page * S + offset), one per token.
        k_scale, v_scale: [K] float32 per-kv-head scales of an FP8 pool
            (``quantize_fp8``); None for float pools.
        k_mean, v_mean: [K, D] float32 channel means an FP8 pool subtracts before
            quantising (``radixlm.runtime.executor.kv_calibration``), or None.
    """
    num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
    assert k.shape == v.shape and k.shape[1:] == (num_kv_heads, head_dim), (k.shape, k_pool.shape)
    assert out_slots.shape == (k.shape[0],), (out_slots.shape, k.shape)
    if k_scale is not None:
        assert k_pool.dtype == torch.float8_e4m3fn and v_scale is not None, k_pool.dtype
        k, v = quantize_fp8(k, k_scale, k_mean), quantize_fp8(v, v_scale, v_mean)
    else:
        assert k_mean is None and v_mean is None, "channel means go with FP8 scales"
    page_size = k_pool.shape[1]
    pages, offsets = out_slots // page_size, out_slots % page_size  # any pool strides (channel-major V)
    k_pool[pages, offsets] = k.to(k_pool.dtype)
    v_pool[pages, offsets] = v.to(v_pool.dtype)


def gather_kv(
    pool: torch.Tensor, pages: torch.Tensor, seq_len: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Dense copy of one request's first ``seq_len`` tokens from a [P, S, K, D] pool.

    ``pages`` is the request's page-table row ([>= ceil(seq_len / S)] ids). Returns [L, K, D]
    in the pool dtype, or dequantised to float32 when ``scale`` ([K], FP8 pool) is given.
    """
    page_size = pool.shape[1]
    num_pages = -(-seq_len // page_size)
    index = pages[:num_pages].to(device=pool.device, dtype=torch.long)
    dense = pool[index]  # [n, S, K, D]
    if scale is not None:
        dense = dequantize_fp8(dense, scale)
    return dense.reshape(-1, pool.shape[2], pool.shape[3])[:seq_len]  # [n*S, K, D] -> [L, K, D]


def _as_list(values: IntList) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _attend_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float,
    softcap: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """Causal attention of one request in float32. q [E, H, D], k/v [L, K, D] -> [E, H, D].
    ``softcap``: scores -> cap * tanh(scores / cap) before the mask; ``window`` W: the query
    at position p sees keys (p - W, p] only (``_visible``).

    Without a soft-cap, PyTorch's fused ``scaled_dot_product_attention`` (its CPU kernel is
    flash attention: no [H, E, L] score tensor, GQA without repeating K/V); with one, the
    explicit einsum / softmax (``_attend_einsum``, also the tests' oracle)."""
    if softcap is not None:
        return _attend_einsum(q, k, v, prefix_len, scale, softcap, window)
    extend_len, length = q.shape[0], k.shape[0]
    mask = None  # prefix_len 0 and no window: is_causal (top-left = bottom-right when E == L)
    if prefix_len or window is not None:
        q_pos = torch.arange(extend_len, device=q.device)[:, None] + prefix_len  # [E, 1]
        mask = _visible(q_pos, torch.arange(length, device=q.device)[None, :], window)  # [E, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),  # [H|K, E|L, D]
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)  # [H, E, D]
    return out.transpose(0, 1)


def _attend_einsum(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float,
    softcap: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """``_attend_one`` spelled out: scores, soft-cap, mask, softmax, all in float32."""
    extend_len, num_heads = q.shape[0], q.shape[1]
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [L, K, D] -> [L, H, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = _softcap(torch.einsum("ehd,lhd->hel", q.float(), k) * scale, softcap)  # [H, E, L]
    q_pos = torch.arange(extend_len, device=q.device)[:, None] + prefix_len  # [E, 1]
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]  # [1, L]
    scores = scores.masked_fill(~_visible(q_pos, k_pos, window), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hel,lhd->ehd", probs, v)  # [E, H, D]


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Attention-logit soft-capping (Gemma 2): ``cap * tanh(scores / cap)``; None: unchanged."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys a query sees: causal, and with a sliding window W only the last W
    positions including its own (Mistral, Gemma 2/3 local layers; Hugging Face's
    ``sliding_window_overlay``)::

        keys:   0 ... p-W | p-W+1 ... p | p+1 ...
                 hidden   |   visible   | future (hidden)
    """
    visible = k_pos <= q_pos
    return visible if window is None else visible & (k_pos > q_pos - window)


class Sink(NamedTuple):
    """Exact attention sink of an FP8 pool (``KVPool`` doc), one layer: ``k``/``v``
    [C, K, D] float32 slots in the pages' units ((x - mean) / scale), ``slots`` [B] int
    per request (-1: position 0 is read from its page)."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor

    def apply(self, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
              v_scale: torch.Tensor | None, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised K/V [B, L, K, D] (centred) of requests ``first ..`` with position 0
        replaced by the sink slot where one is set."""
        assert k_scale is not None and v_scale is not None, "an exact sink goes with an FP8 pool"
        slots = self.slots[first : first + k.shape[0]].long()
        has = slots >= 0
        if not bool(has.any()):
            return k, v
        safe = slots.clamp(min=0)
        k, v = k.clone(), v.clone()
        k[:, 0] = torch.where(has[:, None, None], self.k[safe] * k_scale[:, None], k[:, 0])
        v[:, 0] = torch.where(has[:, None, None], self.v[safe] * v_scale[:, None], v[:, 0])
        return k, v


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: IntList,
    extend_lens: IntList,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sink: Sink | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole sequence, via pages.

    Args:
        q: [T, H, D] queries; rows cu_extend[b]:cu_extend[b+1] belong to request b.
        k_pool, v_pool: [P, S, K, D] pools of one layer, already holding the new tokens.
        page_table: [B, Pmax] int32 page ids per request.
        prefix_lens: [B] tokens already cached per request (tensor or host list).
        extend_lens: [B] new tokens per request (tensor or host list).
        scale: softmax scale, usually D ** -0.5.
        k_scale, v_scale: [K] float32 scales of FP8 pools (None for float pools).
        sink: exact attention sink of an FP8 pool (``Sink``): request b reads position 0
            from ``sink.k[slots[b]]`` / ``sink.v[slots[b]]`` instead of its page when
            ``slots[b] >= 0``.
        softcap: attention-logit soft-capping value (Gemma 2) or None.
        window: sliding window W (a query at position p sees keys p - W + 1 .. p) or None.

    Returns:
        [T, H, D] attention output in q's dtype (computed in float32).
        Query head h reads kv head h // (H // K) (GQA).
    """
    num_heads, num_kv_heads = q.shape[1], k_pool.shape[2]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    prefix, extend = _as_list(prefix_lens), _as_list(extend_lens)
    assert sum(extend) == q.shape[0], (sum(extend), q.shape)
    out = torch.empty_like(q)
    start = 0
    for b, (p_len, e_len) in enumerate(zip(prefix, extend, strict=True)):
        seq_len = p_len + e_len
        k = gather_kv(k_pool, page_table[b], seq_len, k_scale)  # [L, K, D]
        v = gather_kv(v_pool, page_table[b], seq_len, v_scale)
        if sink is not None:
            k, v = sink.apply(k[None], v[None], k_scale, v_scale, b)
            k, v = k[0], v[0]
        rows = slice(start, start + e_len)
        out[rows] = _attend_one(q[rows], k, v, p_len, scale, softcap, window).to(q.dtype)
        start += e_len
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: IntList,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sink: Sink | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode step (one query token per request), batched: no Python loop over requests.

    Gathers every request's pages through the page table into a padded
    [B, Lmax, K, D] block, masks positions >= seq_len, and attends with GQA grouping
    (query heads of one kv head share its keys; no repeat of K/V). Same result as
    ``paged_attention`` with extend length 1 per request.

    Args:
        q: [B, H, D] the new token's query of each request.
        k_pool, v_pool: [P, S, K, D] pools of one layer, already holding the new tokens.
        page_table: [B, Pmax] int32.
        seq_lens: [B] tokens per request including the new one (tensor or host list).
        scale: softmax scale.
        k_scale, v_scale: [K] float32 scales of FP8 pools (None for float pools).
        sink: exact attention sink (as in ``paged_attention``).
        softcap, window: as in ``paged_attention``.

    Returns:
        [B, H, D] in q's dtype (computed in float32).
    """
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    lens = torch.as_tensor(_as_list(seq_lens), device=q.device)
    max_len = int(lens.max())
    pages = page_table[:, : -(-max_len // page_size)].to(torch.long)  # [B, n]

    def gather(pool: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        dense = pool[pages]  # [B, n, S, K, D]
        dense = dense.float() if scale is None else dequantize_fp8(dense, scale)
        return dense.reshape(batch, -1, num_kv_heads, head_dim)[:, :max_len]  # [B, L, K, D]

    k, v = gather(k_pool, k_scale), gather(v_pool, v_scale)
    if sink is not None:
        k, v = sink.apply(k, v, k_scale, v_scale)
    qg = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, K, G, D]
    pad = torch.arange(max_len, device=q.device)[None, :] >= lens[:, None]  # [B, L]
    if window is not None:  # keys at or before seq_len - 1 - W: outside the window
        pad |= torch.arange(max_len, device=q.device)[None, :] <= lens[:, None] - 1 - window
    padded = bool(pad.any()) if q.device.type == "cpu" else True  # no host sync on a device
    if padded:  # unwritten slots may hold NaN, and NaN * 0 or NaN - inf stays NaN
        k, v = k.masked_fill(pad[:, :, None, None], 0.0), v.masked_fill(pad[:, :, None, None], 0.0)
    if softcap is None:
        # The G query heads of a kv head are its "query rows": no repeat of K / V, no GQA flag.
        out = torch.nn.functional.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), scale=scale,
            attn_mask=~pad[:, None, None, :] if padded else None)  # [B, K, G, D]
    else:
        scores = _softcap(torch.einsum("bkgd,blkd->bkgl", qg, k) * scale, softcap)  # [B, K, G, L]
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), v)  # [B, K, G, D]
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert routing: softmax over the X experts in float32, the k largest, and with
    ``renormalize`` those k divided by their sum (Mixtral always, which equals a softmax over
    the top-k logits; Qwen3-MoE where ``norm_topk_prob``).

    router_logits [T, X] -> (weights [T, k] float32, expert ids [T, k] int64).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Sparse MoE MLP (Shazeer et al. 2017; Mixtral, Jiang et al. 2024): for each token t and
    each of its k experts e = topk_ids[t, j], ``topk_weights[t, j] * down_e(silu(gate_e(x_t)) *
    up_e(x_t))``, summed over j.

    Args:
        x: [T, E] hidden states.
        w13: [X, 2F, E] per-expert gate (rows :F) and up (rows F:) projections.
        w2: [X, E, F] per-expert down projections.
        topk_weights: [T, k] float routing weights (``moe_route``).
        topk_ids: [T, k] int expert ids (an expert may receive no token).

    Returns:
        [T, E] in x's dtype. Rounded where the Triton kernel (``kernels/fused_moe.py``)
        rounds: each GEMM and the activation in x's dtype, each weighted expert output
        rounded to it, the sum over the k experts in float32.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        rows, slot = torch.where(topk_ids == expert)  # [n] tokens routed to it, their k slot
        gate, up = (x[rows] @ w13[expert].t()).chunk(2, dim=-1)  # [n, F] each
        y = (torch.nn.functional.silu(gate) * up) @ w2[expert].t()  # [n, E]
        weighted = (y.float() * topk_weights[rows, slot, None].float()).to(x.dtype)
        out.index_add_(0, rows, weighted.float())
    return out.to(x.dtype)
