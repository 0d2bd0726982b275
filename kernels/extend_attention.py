"""Triton paged extend attention: new tokens attend to cached prefix pages + causally to
each other (RadixAttention's extend step; a plain prefill is prefix_len 0).

What: for every request b, its extend_len new queries (rows cu_extend[b]:cu_extend[b+1]
of q) attend to keys 0 .. prefix_len + i (query i sits at position prefix_len + i), all
read through the page table: the prefix pages (shared through the radix tree) and the
new tokens' own K/V, which store_kv has already written into their pages. Same result as
``reference.paged_attention``.

Dimension letters: B requests, T new tokens (sum of extend lengths), H query heads, K kv
heads, G = H // K, D head dim, P pages, S page size, Pmax pages per request.

Layout::

    q               [T, H, D]     any strides, last dim contiguous
    k_pool, v_pool  [P, S, K, D]  last dim contiguous
    page_table      [B, Pmax]     int32; key t of request b is in page page_table[b, t // S]
    cu_extend       [B+1] int32   cumulative extend lengths, cu_extend[0] = 0
    prefix_lens     [B]   int32   cached tokens per request (any value, mid-page is fine)
    out             [T, H, D]     q's dtype

One program = BLOCK_M queries of one head of one request. Its keys, in BLOCK_N tiles::

    keys:  0 ............... prefix_len + m0 ........ prefix_len + min(m0 + BLOCK_M, E)
           |<- visible to every row: no mask ->|<- diagonal tiles: causal mask ->|
    (m0 = first query row of the block, E = extend_len; padded rows are never stored)

Algorithm: FlashAttention-2 (Dao, 2023) forward with an online softmax in the log2 domain;
keys are gathered page by page through the page table (PagedAttention, Kwon et al., SOSP
2023) so a prefix shared in the radix tree (RadixAttention, Zheng et al., 2024) is read in
place. Grid (H, B, M blocks) with the M-block index reversed, so the longest (most causal
work) blocks start first and the G heads of one kv head run side by side (their K/V tiles
come from L2).

Limits: D a power of two (16..256); fp16/bf16 (fp32 for tests, with IEEE fp32 dots).
``max_extend_len`` (host int) sizes the grid; blocks past a request's extend_len exit at
once. Launch parameters come from ``default_extend_config``: on sm_90 one of two tile
configs by shape bucket (128 x 128 tiles when the cached prefix is at least as long as the
extend, 64 x 64 for plain / short-prefix prefill), measured there (bench/KERNELS.md).

Caveats: on an H200 (bench/KERNELS.md) a plain causal prefill (prefix 0, 4 x 2K tokens)
reaches 0.44 of the bf16 matmul rate, 1.7x slower than PyTorch SDPA on contiguous KV, while
2K-token extends on a cached prefix of >= 2K reach 0.51-0.54 and beat SDPA. Measured costs
at prefix 0: the page-table lookup (the K/V addresses depend on a load: 13% with 128 x 128
tiles, 5% with 64 x 64), the diagonal mask (6% with 64 x 64 tiles) and, with 128 x 128
tiles (one program per SM), short causal programs (~8%).

FP8 pools (float8_e4m3fn pages, per-kv-head float32 ``k_scale``/``v_scale`` [K]): as in
the decode kernel, K/V tiles are converted to q's dtype in registers, the K scale is
folded into the softmax scale and the V scale multiplies the output once (a program
serves one query head, hence one kv head: both scales are scalars).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.kernels.decode_attention import (
    TieredPages,
    _check_scales,
    _check_tiered,
    _tiered_args,
    _tiered_tile,
)

__all__ = ["ExtendConfig", "default_extend_config", "extend_attention"]

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ExtendConfig:
    """Launch parameters of the extend kernel (defaults: ``default_extend_config``)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Launch the query blocks of each request longest (last) first: the causal work per
    # block grows with its index, so this is longest-processing-time-first scheduling.
    reverse_m: bool = True
    # How the softmax scale (times log2 e) is applied: "mul" multiplies every score, then
    # subtracts the running max; "fma" takes the max of the raw scores and folds scale and
    # max into one fused multiply-add per score (as in Triton's attention tutorial);
    # "q" multiplies q by the scale once per program (q rounded to its dtype afterwards).
    scale_mode: str = "fma"
    # Triton warp specialisation of the unmasked key loop (tl.range(warp_specialize=...)).
    # Measured on an H200 with triton 3.6: no gain at 8 warps; fails to compile at 4.
    warp_specialize: bool = False


# Hopper (sm_90, 227 KB shared memory per block), measured on an H200 (bench/KERNELS.md,
# batch 4, 32/8 heads, D 128, bf16; "fma" scale in both):
#  * long cached prefix: 128 x 128 tiles, 8 warps, 3 stages: 8K + 2K new in 3.31-3.33 ms
#    (0.54 of the bf16 matmul rate), 2K + 2K in 1.18-1.19 ms (0.50-0.51), vs 3.6-3.8 / 1.25
#    ms for 64 x 64 tiles;
#  * plain or short-prefix prefill: 64 x 64 tiles, 4 warps, 2 stages (80 KB of shared
#    memory: 2 programs per SM): 0 + 2K in 455 us, 0 + 512 in 50 us, vs 467 / 61 us for the
#    128 x 128 tiles (one 161 KB program per SM).
HOPPER_EXTEND_CONFIG = ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
HOPPER_PREFILL_CONFIG = ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


@functools.lru_cache(maxsize=16)
def _is_hopper_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def default_extend_config(
    device: torch.device, max_extend_len: int | None = None, max_seq_len: int | None = None
) -> ExtendConfig:
    """The launch parameters used when the caller passes none.

    Below compute capability 9.0: ``ExtendConfig()`` (fits ~100 KB of shared memory). On
    Hopper and newer, by shape bucket (host-side bounds; no device sync):
    ``HOPPER_EXTEND_CONFIG`` when the keys per request (bound ``max_seq_len``) are at least
    twice the new tokens (``max_extend_len`` >= 128), i.e. the cached prefix is at least as
    long as the extend; ``HOPPER_PREFILL_CONFIG`` otherwise (plain or short-prefix prefill,
    and extends under 128 tokens). With no bounds given: ``HOPPER_EXTEND_CONFIG``."""
    if not _is_hopper_or_newer(device):
        return ExtendConfig()
    if max_extend_len is None or max_seq_len is None:
        return HOPPER_EXTEND_CONFIG
    if max_extend_len >= 128 and max_seq_len >= 2 * max_extend_len:
        return HOPPER_EXTEND_CONFIG
    return HOPPER_PREFILL_CONFIG


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_base, v_base, page_row, n0, key_end, rows_pos,
    stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, page_base,
    FSlot, KCodes, KStat, VCodes, VStat, kv_head, k_scale8, v_scale8,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    SCALE_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, NO_LOOKUP: tl.constexpr,
    QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr, VGROUP: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N tile of keys starting at n0: online-softmax update of (acc, m_i, l_i).

    SCALE_MODE 0: scores times qk_scale_log2, then minus the max; 1: max of the raw scores,
    then one fused multiply-add per score; 2: q already carries the scale.
    NO_LOOKUP (measurement probe): page = page_base + key // PAGE_SIZE, no page-table load."""
    keys = n0 + tl.arange(0, BLOCK_N)  # [Nb]
    dims = tl.arange(0, HEAD_DIM)
    if NO_LOOKUP:
        valid = keys < key_end
        page = (page_base + keys // PAGE_SIZE).to(tl.int64)
    elif MASKED:
        valid = keys < key_end
        page = tl.load(page_row + keys // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        page = tl.load(page_row + keys // PAGE_SIZE).to(tl.int64)
    slot = keys % PAGE_SIZE
    k_ptr = k_base + (page * stride_kp + slot * stride_ks)[:, None] + dims[None, :]
    v_ptr = v_base + (page * stride_vp + slot * stride_vs)[:, None] + dims[None, :]
    if not MASKED:
        valid = keys >= 0  # every key of the tile (tiered reads take a mask)
    if QUANT == 2:  # tiered: the page's FP8 slot or its INT4 codes, dequantised here
        k = _tiered_tile(k_base, stride_kp, stride_ks, KCodes, KStat, FSlot, page, slot, valid,
                         kv_head, dims, k_scale8, True, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM,
                         VGROUP).to(q.dtype)  # fmt: skip
    elif MASKED:
        k = tl.load(k_ptr, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptr)
    if QUANT == 1:  # FP8 page -> q's dtype; the scale is in qk_scale_log2
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [Mb, Nb]
    if SCALE_MODE == 0:
        s = s * qk_scale_log2  # log2 domain
    if MASKED:
        causal = (keys[None, :] <= rows_pos[:, None]) & valid[None, :]
        s = tl.where(causal, s, float("-inf"))
    if SCALE_MODE == 1:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
        p = tl.exp2(s * qk_scale_log2 - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT == 2:
        v = _tiered_tile(v_base, stride_vp, stride_vs, VCodes, VStat, FSlot, page, slot, valid,
                         kv_head, dims, v_scale8, False, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM,
                         VGROUP).to(q.dtype)  # fmt: skip
    elif MASKED:
        v = tl.load(v_ptr, mask=valid[:, None], other=0.0)
    else:
        v = tl.load(v_ptr)
    if QUANT == 1:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    Q, KPool, VPool, PageTable, CuExtend, PrefixLens, Out, KScale, VScale,
    FSlot, KCodes, KStat, VCodes, VStat,
    qk_scale_log2,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kk, stride_vp, stride_vs, stride_vk,
    stride_ptb, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    REVERSE_M: tl.constexpr, SCALE_MODE: tl.constexpr, WARP_SPEC: tl.constexpr,
    PROBE: tl.constexpr, QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr, VGROUP: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    b = tl.program_id(1)
    if REVERSE_M:
        m_block = tl.num_programs(2) - 1 - tl.program_id(2)  # longest blocks first
    else:
        m_block = tl.program_id(2)
    row0 = tl.load(CuExtend + b)
    extend_len = tl.load(CuExtend + b + 1) - row0
    m0 = m_block * BLOCK_M
    if m0 >= extend_len:
        return
    prefix_len = tl.load(PrefixLens + b)
    kv_head = head // GROUP
    if QUANT == 1:  # FP8 pages: the K scale joins the softmax scale
        qk_scale_log2 = qk_scale_log2 * tl.load(KScale + kv_head)
    k_scale8 = 1.0
    v_scale8 = 1.0
    if QUANT == 2:  # tiered pools: FP8 slots are dequantised per tile, with INT4 pages
        k_scale8 = tl.load(KScale + kv_head)
        v_scale8 = tl.load(VScale + kv_head)

    rows = m0 + tl.arange(0, BLOCK_M)  # [Mb] query index within the request
    dims = tl.arange(0, HEAD_DIM)
    row_mask = rows < extend_len
    q_ptr = Q + (row0 + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + dims[None, :], mask=row_mask[:, None], other=0.0)  # [Mb, D]
    if SCALE_MODE == 2:
        q = (q * qk_scale_log2).to(Q.dtype.element_ty)
    rows_pos = prefix_len + rows  # [Mb] absolute position = last key each row sees
    page_row = PageTable + b * stride_ptb
    page_base = 0
    if PROBE == 3:  # measurement probe: request b's pages are b * 1024 + 1, + 2, ...
        page_base = b * 1024 + 1
    k_base = KPool + kv_head * stride_kk
    v_base = VPool + kv_head * stride_vk

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Keys [0, prefix_len + m0] are visible to every row: whole tiles of them need no mask.
    full_end = (prefix_len + m0 + 1) // BLOCK_N * BLOCK_N
    key_end = prefix_len + tl.minimum(m0 + BLOCK_M, extend_len)
    if PROBE == 2:  # measurement probe (wrong result): every block reads every key, unmasked
        key_end = prefix_len + extend_len
        full_end = key_end // BLOCK_N * BLOCK_N
    for n0 in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPEC):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, page_row, n0, key_end, rows_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, page_base,
            FSlot, KCodes, KStat, VCodes, VStat, kv_head, k_scale8, v_scale8,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, False, SCALE_MODE, DOT_PRECISION, PROBE == 3, QUANT,
            NUM_KV_HEADS, VGROUP,
        )  # fmt: skip
    # Diagonal tiles, masked (PROBE 1, a measurement probe with a wrong result: unmasked).
    for n0 in range(full_end, key_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, page_row, n0, key_end, rows_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, page_base,
            FSlot, KCodes, KStat, VCodes, VStat, kv_head, k_scale8, v_scale8,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, PROBE != 1, SCALE_MODE, DOT_PRECISION, PROBE == 3, QUANT,
            NUM_KV_HEADS, VGROUP,
        )  # fmt: skip

    out = acc / l_i[:, None]  # every row sees key 0, so l_i > 0
    if QUANT == 1:
        out = out * tl.load(VScale + kv_head)
    o_ptr = Out + (row0 + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh
    tl.store(o_ptr + dims[None, :], out.to(Out.dtype.element_ty), mask=row_mask[:, None])


_SCALE_MODES = {"mul": 0, "fma": 1, "q": 2}


def _check_inputs(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    cu_extend: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> None:
    assert q.dim() == 3 and q.stride(-1) == 1, (q.shape, q.stride())
    assert k_pool.dim() == 4 and k_pool.shape == v_pool.shape, (k_pool.shape, v_pool.shape)
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1, "pools: last dim contiguous"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert k_pool.dtype == v_pool.dtype, (k_pool.dtype, v_pool.dtype)
    assert k_pool.dtype in (q.dtype, torch.float8_e4m3fn), (q.dtype, k_pool.dtype)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[2]
    assert k_pool.shape[3] == head_dim and num_heads % num_kv_heads == 0, (q.shape, k_pool.shape)
    assert head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256, head_dim
    batch = page_table.shape[0]
    assert page_table.dim() == 2 and page_table.dtype == torch.int32, page_table.dtype
    assert page_table.stride(1) == 1, page_table.stride()
    assert cu_extend.shape == (batch + 1,) and cu_extend.dtype == torch.int32, cu_extend.shape
    assert prefix_lens.shape == (batch,) and prefix_lens.dtype == torch.int32, prefix_lens.shape
    assert cu_extend.is_contiguous() and prefix_lens.is_contiguous()
    assert q.device == k_pool.device == page_table.device == cu_extend.device


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    cu_extend: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    max_extend_len: int,
    out: torch.Tensor | None = None,
    config: ExtendConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiered: TieredPages | None = None,
) -> torch.Tensor:
    """Paged causal attention of each request's new tokens -> [T, H, D] in q's dtype.

    Args:
        q: [T, H, D] queries of the new tokens, request b in rows cu_extend[b]:cu_extend[b+1].
        k_pool, v_pool: [P, S, K, D] pools of one layer, already holding the new tokens.
        page_table: [B, Pmax] int32; must cover prefix_lens[b] + extend_len[b] tokens.
        cu_extend: [B+1] int32 cumulative extend lengths.
        prefix_lens: [B] int32 cached tokens per request.
        scale: softmax scale, usually D ** -0.5.
        max_extend_len: host int >= every extend length (sizes the grid; no device sync).
        out: optional [T, H, D] output buffer (q's dtype, last dim contiguous).
        config: launch parameters (block sizes, warps, stages); default
            ``default_extend_config(q.device, max_extend_len, Pmax * S)``.
        k_scale, v_scale: [K] float32 per-kv-head scales, required for (and only for)
            float8_e4m3fn pools (value = stored * scale).
        tiered: int4 / mixed pools (``decode_attention.TieredPages``): ``k_pool``/``v_pool``
            are the FP8 slots, pages without one are read as INT4.
    """
    _check_inputs(q, k_pool, v_pool, page_table, cu_extend, prefix_lens)
    _check_scales(k_pool, k_scale, v_scale)
    _check_tiered(k_pool, tiered)
    if config is None:
        max_seq_len = page_table.shape[1] * k_pool.shape[1]  # bound on keys per request
        config = default_extend_config(q.device, max_extend_len, max_seq_len)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    batch = page_table.shape[0]
    if batch == 0 or q.shape[0] == 0:
        return out
    _launch(q, k_pool, v_pool, page_table, cu_extend, prefix_lens, out, scale,
            max_extend_len, config, k_scale=k_scale, v_scale=v_scale, tiered=tiered)  # fmt: skip
    return out


def _launch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    cu_extend: torch.Tensor,
    prefix_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    max_extend_len: int,
    config: ExtendConfig,
    probe: int = 0,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiered: TieredPages | None = None,
):
    """Launch ``_extend_kernel``; returns Triton's compiled kernel (registers, shared memory).

    ``probe`` is for measurements only (bench/bench_kernels.py): 1 = diagonal tiles without
    the causal mask, 2 = every query block reads all keys unmasked (uniform program
    lengths); both give wrong results and assume prefix and extend lengths that are
    multiples of ``block_n``. 3 = no page-table loads: request b's pages are taken to be
    b * 1024 + 1, + 2, ... (right only for such a table, fewer than 1024 pages each)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[2]
    grid = (num_heads, page_table.shape[0], triton.cdiv(max_extend_len, config.block_m))
    tiered_args, vgroup = _tiered_args(tiered, prefix_lens, head_dim)
    return _extend_kernel[grid](
        q, k_pool, v_pool, page_table, cu_extend, prefix_lens, out,
        prefix_lens if k_scale is None else k_scale, prefix_lens if v_scale is None else v_scale,
        *tiered_args,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        page_table.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HEAD_DIM=head_dim, PAGE_SIZE=k_pool.shape[1],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        REVERSE_M=config.reverse_m, SCALE_MODE=_SCALE_MODES[config.scale_mode],
        WARP_SPEC=config.warp_specialize, PROBE=probe,
        QUANT=0 if k_scale is None else (2 if tiered is not None else 1),
        NUM_KV_HEADS=num_kv_heads, VGROUP=vgroup,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
