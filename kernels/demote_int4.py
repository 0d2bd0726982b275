"""Triton page demotion of tiered (int4 / mixed) KV pools: FP8 slots -> INT4 pages.

What: for each (logical page, FP8 slot) pair, read the slot's FP8 K and V of one layer,
dequantise them with the static per-kv-head scales and quantise them as KIVI INT4 (Liu et
al., 2024): keys per channel over the page's S tokens, values per token in groups of G
channels; asymmetric, zero = min, scale = (max - min) / 15 (fp16, 1 for a constant slice),
code = clamp(round((x - zero) / scale), 0, 15), two codes per byte (channel 2j in the low
nibble). Same result as ``reference.dequantize_fp8`` + ``reference.quantize_int4_pages``
(IEEE division; rounding half to even through the fp32 magic-number add).

Dimension letters: n pages demoted, S page size, K kv heads, D head dim, G value group,
F FP8 slots, P logical pages.

Layout (one layer, contiguous)::

    k8, v8    [F, S, K, D]     float8_e4m3fn      k_scale, v_scale [K] float32
    k_codes   [P, S, K, D/2]   uint8              k_stat [P, 2, K, D] fp16 (scale, zero)
    v_codes   [P, S, K, D/2]   uint8              v_stat [P, S, K, 2, D/G] fp16

Grid (n, K): one program per page and kv head; it holds the page's [S, D] tile as its
even and odd channels ([S, D/2] each, so codes pack without a shuffle). One launch per
layer replaces ~45 small PyTorch ops per layer.

Limits: D a power of two (16..256), G a power of two dividing D, S <= 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["demote_pages"]

_RNE = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + _RNE - _RNE rounds |x| < 2^22 to an integer, ties to even


@triton.jit
def _quantize(x, lo, hi):
    """fp16-rounded zero and scale of [lo, hi], and the 4-bit codes of x (float32)."""
    zero = lo.to(tl.float16)
    scale = tl.math.div_rn(hi - lo, 15.0).to(tl.float16)
    scale = tl.where(scale > 0, scale, 1.0)
    code = tl.math.div_rn(x - zero.to(tl.float32), scale.to(tl.float32))
    code = (code + _RNE) - _RNE
    code = tl.minimum(tl.maximum(code, 0.0), 15.0)
    return code.to(tl.uint8), scale, zero


@triton.jit
def _demote_kernel(
    Pages, Slots, K8, V8, KScale, VScale, KCodes, KStat, VCodes, VStat,
    PAGE_SIZE: tl.constexpr, BLOCK_S: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, VGROUP: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(Pages + i).to(tl.int64)
    slot = tl.load(Slots + i).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    NG: tl.constexpr = HEAD_DIM // VGROUP
    rows = tl.arange(0, BLOCK_S)  # [Sb] tokens of the page
    cols = tl.arange(0, HALF)  # [D/2] channel pairs
    row_ok = rows < PAGE_SIZE
    mask = row_ok[:, None]
    src = (slot * PAGE_SIZE + rows[:, None]) * NUM_KV_HEADS * HEAD_DIM + h * HEAD_DIM + 2 * cols[None, :]
    token = (page * PAGE_SIZE + rows) * NUM_KV_HEADS + h  # [Sb] row of the codes
    dst = token[:, None] * HALF + cols[None, :]

    # Keys: per channel over the page's tokens.
    k_scale8 = tl.load(KScale + h)
    ke = tl.load(K8 + src, mask=mask, other=0.0).to(tl.float32) * k_scale8  # [Sb, D/2]
    ko = tl.load(K8 + src + 1, mask=mask, other=0.0).to(tl.float32) * k_scale8
    ce, se, ze = _quantize(ke, tl.min(tl.where(mask, ke, float("inf")), 0)[None, :],
                           tl.max(tl.where(mask, ke, float("-inf")), 0)[None, :])  # fmt: skip
    co, so, zo = _quantize(ko, tl.min(tl.where(mask, ko, float("inf")), 0)[None, :],
                           tl.max(tl.where(mask, ko, float("-inf")), 0)[None, :])  # fmt: skip
    tl.store(KCodes + dst, ce | (co << 4), mask=mask)
    stat = KStat + (page * 2 * NUM_KV_HEADS + h) * HEAD_DIM + 2 * cols  # [D/2]
    tl.store(stat, tl.reshape(se, [HALF]))
    tl.store(stat + 1, tl.reshape(so, [HALF]))
    tl.store(stat + NUM_KV_HEADS * HEAD_DIM, tl.reshape(ze, [HALF]))
    tl.store(stat + NUM_KV_HEADS * HEAD_DIM + 1, tl.reshape(zo, [HALF]))

    # Values: per token, groups of VGROUP channels (VGROUP / 2 pairs).
    v_scale8 = tl.load(VScale + h)
    ve = tl.load(V8 + src, mask=mask, other=0.0).to(tl.float32) * v_scale8
    vo = tl.load(V8 + src + 1, mask=mask, other=0.0).to(tl.float32) * v_scale8
    ge = tl.reshape(ve, [BLOCK_S, NG, VGROUP // 2])
    go = tl.reshape(vo, [BLOCK_S, NG, VGROUP // 2])
    lo = tl.minimum(tl.min(ge, 2), tl.min(go, 2))[:, :, None]  # [Sb, NG, 1]
    hi = tl.maximum(tl.max(ge, 2), tl.max(go, 2))[:, :, None]
    ce, scale, zero = _quantize(ge, lo, hi)
    co, scale, zero = _quantize(go, lo, hi)
    packed = tl.reshape(ce | (co << 4), [BLOCK_S, HALF])
    tl.store(VCodes + dst, packed, mask=mask)
    groups = tl.arange(0, NG)
    vstat = VStat + token[:, None] * 2 * NG + groups[None, :]  # [Sb, NG]
    tl.store(vstat, tl.reshape(scale, [BLOCK_S, NG]), mask=mask)
    tl.store(vstat + NG, tl.reshape(zero, [BLOCK_S, NG]), mask=mask)


def demote_pages(
    pages: torch.Tensor,
    slots: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_codes: torch.Tensor,
    k_stat: torch.Tensor,
    v_codes: torch.Tensor,
    v_stat: torch.Tensor,
) -> None:
    """Quantise FP8 slots ``slots`` [n] into INT4 pages ``pages`` [n] (int64) of one layer,
    in place (layouts in the module doc; every tensor contiguous, on one device)."""
    num_slots, page_size, num_kv_heads, head_dim = k8.shape
    num_groups = v_stat.shape[-1]
    assert k8.dtype == v8.dtype == torch.float8_e4m3fn and v8.shape == k8.shape, (k8.dtype, v8.shape)
    assert k_codes.shape[1:] == (page_size, num_kv_heads, head_dim // 2) == v_codes.shape[1:]
    assert k_stat.shape[1:] == (2, num_kv_heads, head_dim), k_stat.shape
    assert v_stat.shape[1:] == (page_size, num_kv_heads, 2, num_groups), v_stat.shape
    for t in (k8, v8, k_codes, k_stat, v_codes, v_stat):
        assert t.is_contiguous()
    group = head_dim // num_groups
    assert head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256, head_dim
    assert group & (group - 1) == 0 and group >= 2 and page_size <= 256, (group, page_size)
    assert pages.shape == slots.shape and pages.dim() == 1, (pages.shape, slots.shape)
    if pages.numel() == 0:
        return
    _demote_kernel[(pages.numel(), num_kv_heads)](
        pages, slots, k8, v8, k_scale, v_scale, k_codes, k_stat, v_codes, v_stat,
        PAGE_SIZE=page_size, BLOCK_S=triton.next_power_of_2(page_size), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, VGROUP=group, num_warps=4 if page_size * head_dim >= 2048 else 2,
    )  # fmt: skip
