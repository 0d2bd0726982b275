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

Split-KV path (short extends over a long cached prefix; Flash-Decoding, Dao et al. 2023,
applied to extend as in ``decode_attention``). With the grid above, 128 new tokens over a
3968-token prefix on the 8B shape are 32 heads x 1 request x 1 query block of 128 = 32
programs on 132 SMs, each walking all ~4K keys, and each K/V tile is read once per query
head (G = 4 times). ``extend_num_splits`` (host-side bounds, no device sync) then picks
N > 1 and two kernels run instead:

  1. ``_extend_split_kernel``, grid (M blocks, N, B * K): a program holds BLOCK_M new
     tokens x the G query heads of one kv head as one [BLOCK_M * G', D] tile (GQA: every
     K/V tile is read once for the group; G' = G rounded up to a power of two, padded
     rows masked; BLOCK_M = block_rows // G'). Its keys are split n of the block's keys
     [0, prefix_len + min(m0 + BLOCK_M, E)), cut into N BLOCK_N-aligned splits::

         keys:  0 ...... prefix_len + m0 ......... key_end
                | split 0 | split 1 | ... | split N-1 |   (tail splits may be empty)
                |<-- unmasked tiles -->|<- causal ->|

     Online softmax as above; a row can see no key of its split (a split inside the
     diagonal): its partial has l = 0 and log-sum-exp -inf. Writes the normalised partial
     output and its log2-sum-exp: ``DecodeWorkspace`` partial_out [T, H, N, D], partial_lse
     [T, H, N], fp32.
  2. decode's ``_decode_merge_kernel`` over the [T, H] rows: out = sum_i w_i o_i / sum_i
     w_i, w_i = 2^(lse_i - max lse) (split 0 always holds key 0, so the sum is > 0).

N (a power of two; the kernels are compiled at server start by ``warm_up_split_path``) is
chosen so that B * K * M blocks * N programs make about one wave of ``programs_per_sm`` per
SM, splits are >= ``min_split_keys`` keys, and only when max_extend_len <=
``ExtendSplitConfig.max_extend_len`` (512; 256 on Hopper) and the keys are at least twice
the new tokens; otherwise (plain prefill, long extends, a full wave already) the long-extend
kernel runs. Cost: the fp32 partials (T * H * N * D * 4 bytes, written and read once;
bounded because the program count is capped at one wave: ~17 MB for the Hopper config on 132
SMs) and a second launch. FP8 pages as below (a program serves one kv head, so both scales
are scalars). ``HOPPER_SPLIT_CONFIG`` (tiles, warps, the 256-token limit) is set from
bench/kernels/bench_extend_split.py on an H200 (BENCHMARKS.md "Split-KV extend"); the other
heuristic constants (2 programs per SM, 128-key splits) were not varied there.

Limits: D a power of two (16..256); fp16/bf16 (fp32 for tests, with IEEE fp32 dots).
``max_extend_len`` (host int) sizes the grid; blocks past a request's extend_len exit at
once. Launch parameters come from ``default_extend_config``: on sm_90 one of two tile
configs by shape bucket (128 x 128 tiles when the cached prefix is at least as long as the
extend, 64 x 64 for plain / short-prefix prefill), measured there
(BENCHMARKS.md "Extend attention").

Caveats: on an H200 (BENCHMARKS.md "Extend attention") a plain causal prefill (prefix 0, 4 x
2K tokens) reaches 0.44 of the bf16 matmul rate, 1.7x slower than PyTorch SDPA on contiguous
KV, while 2K-token extends on a cached prefix of >= 2K reach 0.51-0.54 and beat SDPA.
Measured costs at prefix 0: the page-table lookup (the K/V addresses depend on a load: 13%
with 128 x 128 tiles, 5% with 64 x 64), the diagonal mask (6% with 64 x 64 tiles) and, with
128 x 128 tiles (one program per SM), short causal programs (~8%).

FP8 pools (float8_e4m3fn pages, per-kv-head float32 ``k_scale``/``v_scale`` [K]): as in
the decode kernel, the dots run in fp16 whatever the dtype of 16-bit queries
(``ExtendConfig.fp8_compute``: q clamped to +-65504 and rounded to fp16 once per program,
K/V tiles converted e4m3 -> f16 in registers, one hardware convert per two values; for
bf16 q the "q" setting's e4m3 -> f16 -> f32 -> bf16 costs three), the K scale is folded
into the softmax scale and the V scale multiplies the output once (a program serves one
query head, hence one kv head: both scales are scalars). Channel-major FP8 V pools
(``reference.channel_major``, what ``KVPool`` allocates; decode's reason) are read as whole
pages with ``_channel_major_v``; the causal tiles then read V slots a row does not see,
weighted 0. That costs the Hopper (wgmma) build here: the tile's 8-bit shared-memory copy
is read back with 8-way bank conflicts (the warp spans 8 pages 2 KB apart). H200, 4 x
2048 new tokens over 8K cached: 4.74 ms against 4.10 ms with row-major V (+16%; bf16 3.32
ms), 8 x 256 over 2K: 322 vs 280 us; a plain prefill (4 x 2048) is unchanged, 553 vs 554 us
(bench/kv_cache/kv_speed_gpu.py --row-major-fp8-v, 2026-12-04).

Tiered pools (int4 / mixed, ``TieredPages``): ``_extend_tiered_kernel``, the same grid and
key walk (unmasked tiles, then causal diagonal tiles) on head-dim halves, with decode's
tile helpers (a branch per kind of page in the tile: INT4 keys, FP8 keys; key statistics
once per page; pages and slots loaded ahead; see decode_attention's docstring). A row may
see no key of a kind in a tile (the FP8 sink key beside INT4 keys): it then subtracts 0
instead of -inf and keeps l = 0. Always one pass:
the split-KV path does not read INT4 pages (its grid groups the G query heads of a kv
head, which would need a third tiered kernel); the one-pass grid (H x B x M blocks)
already fills the GPU for long extends and batches, short extends over a long prefix at
small batch get fewer programs than SMs. Each query head dequantises its K/V tiles itself
(the G heads of a kv head run side by side, the bytes come from L2). Launch parameters on
Hopper, and their timing (bench/kv_cache/kv_speed_gpu.py, EXTEND_VARIANTS): the comment of
``HOPPER_TIERED_EXTEND_CONFIG``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.kernels.decode_attention import (
    DecodeWorkspace,
    TieredPages,
    _channel_major_v,
    _check_scales,
    _check_sink,
    _check_tiered,
    _decode_merge_kernel,
    _dot_precision,
    _f16_dot,
    _fp16_operand,
    _merge_warps,
    _num_sms,
    _sink_start,
    _tiered_kv,
    _tile_kinds,
    _tile_pages,
    _tile_slots,
    _tile_tally,
    _tiled_step,
    _value_group,
)
from radixlm.kernels.launch import jit_unspecialised, launch
from radixlm.kernels.reference import Sink, channel_major

__all__ = [
    "ExtendConfig",
    "ExtendSplitConfig",
    "default_extend_config",
    "default_split_config",
    "extend_attention",
    "extend_num_splits",
    "warm_up_extend_path",
    "warm_up_split_path",
]

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
    # FP8 pools: the dtype of the two dots, as ``DecodeConfig.fp8_compute``: "fp16" (one
    # hardware convert per two K/V values, q clamped to +-65504, p rounded to fp16) or "q"
    # (q's dtype: for bf16 queries e4m3 -> f16 -> f32 -> bf16, three converts per value).
    fp8_compute: str = "fp16"


# Hopper (sm_90, 227 KB shared memory per block), measured on an H200 (batch 4, 32/8 heads,
# D 128, bf16, "fma" scale in both; BENCHMARKS.md "Extend attention", the tile sweep in
# 4a7db11:bench/KERNELS.md):
#  * long cached prefix: 128 x 128 tiles, 8 warps, 3 stages: 8K + 2K new in 3.31-3.33 ms
#    (0.54 of the bf16 matmul rate), 2K + 2K in 1.18-1.19 ms (0.50-0.51), vs 3.6-3.8 / 1.25
#    ms for 64 x 64 tiles;
#  * plain or short-prefix prefill: 64 x 64 tiles, 4 warps, 2 stages (80 KB of shared
#    memory: 2 programs per SM): 0 + 2K in 455 us, 0 + 512 in 50 us, vs 467 / 61 us for the
#    128 x 128 tiles (one 161 KB program per SM).
HOPPER_EXTEND_CONFIG = ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
HOPPER_PREFILL_CONFIG = ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
# Tiered pools (``_extend_tiered_kernel``) on Hopper, every shape. H200, 4 x 2048 new tokens
# over 8K cached (bench/kv_cache/kv_speed_gpu.py, 2026-11-30): 14.5 ms vs 3.33 ms on bf16
# pages; EXTEND_VARIANTS 14.5-28.8 ms. Chosen from ptxas -v of the sm_90a build with triton
# 3.6 (bench/kernels/ptxas_usage.py; Llama-3-8B head shape, page 16): 128 x 64 tiles, 8
# warps, 2 stages spill 12 bytes per thread; 128 x 128 / 8 warps / 3 stages 104 bytes (the
# bf16 kernel's HOPPER_EXTEND_CONFIG: ~1 KB), 64 x 64 / 4 warps 208 bytes.
HOPPER_TIERED_EXTEND_CONFIG = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


@dataclass(frozen=True)
class ExtendSplitConfig:
    """Launch parameters and split heuristic of the split-KV extend path.

    A program holds ``block_rows`` query rows: block_rows // G' new tokens times the G'
    query heads of one kv head (G' = G rounded up to a power of two; at least one token).
    """

    block_rows: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Split heuristic (``extend_num_splits``): at most programs_per_sm programs per SM in
    # all (B * K * M blocks * N), no split shorter than min_split_keys keys, and only for
    # extends of at most max_extend_len tokens whose keys are at least twice the new tokens.
    programs_per_sm: int = 2
    min_split_keys: int = 128
    max_extend_len: int = 512
    fp8_compute: str = "fp16"  # FP8 pools: as ``ExtendConfig.fp8_compute``


# H200, 8B head shape, bf16, page 16 (bench/kernels/bench_extend_split.py, 2026-12-04 14:13
# UTC, 4a7db11:BENCHMARKS.md; the current run: BENCHMARKS.md "Split-KV extend"):
# 128 rows (32 tokens x 4 heads), 64-key tiles, 4 warps, 2 stages. 1 x (4K cached + 128
# new): 45.6 us with N = 8 against 58.1 us on 8 warps (the earlier, untuned config; 32
# layers: 1.46 vs 1.86 ms of a cached-prefix TTFT); 1 x (16K + 128) 111 vs 155 us, 1 x (16K
# + 32) 53 vs 64, 8 x (4K + 32) 79 vs 101; slower only at 1 x (1K + 32), 21.9 vs 18.8 us. 64
# rows on 4 warps (N / 2 for the same programs) is as fast at 4K + 128 and faster for
# 32-token extends, slower at 16K + 128 (127 us) and at batch 8. Split only up to 256 new
# tokens: with this config (14:16 UTC run) one request's 256-token extend is 1.05 / 1.53 /
# 1.87x the long-extend kernel over 1K / 4K / 16K cached, a 512-token one 0.73 / 0.91 /
# 1.02x.
HOPPER_SPLIT_CONFIG = ExtendSplitConfig(block_rows=128, block_n=64, num_warps=4, num_stages=2, max_extend_len=256)


@functools.lru_cache(maxsize=16)
def _is_hopper_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def default_extend_config(
    device: torch.device,
    max_extend_len: int | None = None,
    max_seq_len: int | None = None,
    tiered: bool = False,
) -> ExtendConfig:
    """The launch parameters used when the caller passes none.

    Below compute capability 9.0: ``ExtendConfig()`` (fits ~100 KB of shared memory). On
    Hopper and newer: ``HOPPER_TIERED_EXTEND_CONFIG`` for tiered pools (``tiered``), else by
    shape bucket (host-side bounds; no device sync): ``HOPPER_EXTEND_CONFIG`` when the keys
    per request (bound ``max_seq_len``) are at least twice the new tokens
    (``max_extend_len`` >= 128), i.e. the cached prefix is at least as long as the extend;
    ``HOPPER_PREFILL_CONFIG`` otherwise (plain or short-prefix prefill, and extends under
    128 tokens). With no bounds given: ``HOPPER_EXTEND_CONFIG``."""
    if not _is_hopper_or_newer(device):
        return ExtendConfig()
    if tiered:
        return HOPPER_TIERED_EXTEND_CONFIG
    if max_extend_len is None or max_seq_len is None:
        return HOPPER_EXTEND_CONFIG
    if max_extend_len >= 128 and max_seq_len >= 2 * max_extend_len:
        return HOPPER_EXTEND_CONFIG
    return HOPPER_PREFILL_CONFIG


def default_split_config(device: torch.device) -> ExtendSplitConfig:
    """``HOPPER_SPLIT_CONFIG`` on compute capability >= 9.0, else ``ExtendSplitConfig()``."""
    return HOPPER_SPLIT_CONFIG if _is_hopper_or_newer(device) else ExtendSplitConfig()


def _split_block_m(num_heads: int, num_kv_heads: int, config: ExtendSplitConfig) -> tuple[int, int]:
    """(new tokens per split program BLOCK_M, padded group G'); BLOCK_M * G' >= 16 rows."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(1, max(config.block_rows, 16) // group_pad), group_pad


def extend_num_splits(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    max_extend_len: int,
    max_seq_len: int,
    device: torch.device | str | int,
    config: ExtendSplitConfig | None = None,
) -> int:
    """Key splits per query block N for an extend batch; 1 selects the long-extend kernel.

    From host-side bounds only (no device sync): ``max_extend_len`` >= every extend length,
    ``max_seq_len`` >= every prefix + extend length. N > 1 only for short extends
    (<= ``config.max_extend_len``) over keys at least twice as many as the new tokens, and
    only when one wave of ``programs_per_sm`` programs per SM has room for more than one
    split per (request, kv head, query block); no split shorter than ``min_split_keys``.
    N is rounded down to a power of two, so the merge kernel (one binary per
    next_power_of_2(N)) has at most 9 variants, all compiled by ``warm_up_split_path``.
    ``device`` may also be an SM count (int). Example, 8B shape on 132 SMs, one request of
    128 new tokens over 4K cached (Hopper config: 32 tokens x 4 heads per program): 4
    query blocks x 8 kv heads = 32 programs unsplit, N = 264 // 32 = 8.
    """
    config = config or default_split_config(
        torch.device("cpu") if isinstance(device, int) else torch.device(device)
    )
    if max_extend_len > config.max_extend_len or max_seq_len < 2 * max_extend_len:
        return 1
    num_sms = device if isinstance(device, int) else _num_sms(torch.device(device))
    block_m, _ = _split_block_m(num_heads, num_kv_heads, config)
    base = max(batch * num_kv_heads * triton.cdiv(max_extend_len, block_m), 1)
    wanted = config.programs_per_sm * num_sms // base
    most = math.ceil(max_seq_len / max(config.min_split_keys, config.block_n))
    n = max(1, min(wanted, most, 256))
    return 1 << (n.bit_length() - 1)  # a power of two: one merge binary per N (warm_up_split_path)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_base, v_base, page_row, n0, key_end, rows_pos,
    stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, page_base, key_lo,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    SCALE_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, NO_LOOKUP: tl.constexpr,
    QUANT: tl.constexpr, SAFE: tl.constexpr, V_CHANNEL_MAJOR: tl.constexpr, VSTEP: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N tile of keys starting at n0: online-softmax update of (acc, m_i, l_i).

    SCALE_MODE 0: scores times qk_scale_log2, then minus the max; 1: max of the raw scores,
    then one fused multiply-add per score; 2: q already carries the scale.
    NO_LOOKUP (measurement probe): page = page_base + key // PAGE_SIZE, no page-table load.
    SAFE: a row may have seen no key yet (m_i and the tile's max both -inf, as in a key
    split that starts past the row's position): subtract 0 instead of -inf (no NaN); the
    row keeps l_i = 0. MASKED tiles also hide keys < key_lo (1: key 0 is the exact sink's).
    V_CHANNEL_MAJOR: V from a channel-major FP8 pool (``_channel_major_v``, VSTEP keys per
    page of the tile)."""
    keys = n0 + tl.arange(0, BLOCK_N)  # [Nb]
    dims = tl.arange(0, HEAD_DIM)
    if NO_LOOKUP:
        valid = keys < key_end
        page = (page_base + keys // PAGE_SIZE).to(tl.int64)
    elif MASKED:
        valid = (keys < key_end) & (keys >= key_lo)
        page = tl.load(page_row + keys // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        page = tl.load(page_row + keys // PAGE_SIZE).to(tl.int64)
    slot = keys % PAGE_SIZE
    k_ptr = k_base + (page * stride_kp + slot * stride_ks)[:, None] + dims[None, :]
    v_ptr = v_base + (page * stride_vp + slot * stride_vs)[:, None] + dims[None, :]
    if MASKED:
        k = tl.load(k_ptr, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptr)
    if QUANT:  # FP8 page -> q's dtype; the scale is in qk_scale_log2
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [Mb, Nb]
    if SCALE_MODE == 0:
        s = s * qk_scale_log2  # log2 domain
    if MASKED:
        causal = (keys[None, :] <= rows_pos[:, None]) & valid[None, :]
        s = tl.where(causal, s, float("-inf"))
    if SCALE_MODE == 1:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = m_new
    if SAFE:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    if SCALE_MODE == 1:
        p = tl.exp2(s * qk_scale_log2 - m_sub[:, None])
    else:
        p = tl.exp2(s - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_CHANNEL_MAJOR:  # whole pages: the probabilities of keys past key_end are 0
        v = _channel_major_v(v_base, page_row, n0, key_end, stride_vp, BLOCK_N, HEAD_DIM, PAGE_SIZE, VSTEP)
    elif MASKED:
        v = tl.load(v_ptr, mask=valid[:, None], other=0.0)
    else:
        v = tl.load(v_ptr)
    if QUANT:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# The page-table width varies per step, and a mixed step passes the extend rows' slices of the
# page table and prefix lengths (also the placeholders of absent scales and sinks), whose
# alignment varies: unspecialised, one binary per config (warm_up_extend_path).
@jit_unspecialised("stride_ptb", "PageTable", "PrefixLens", "KScale", "VScale", "SinkK", "SinkV", "SinkSlots")
def _extend_kernel(
    Q, KPool, VPool, PageTable, CuExtend, PrefixLens, Out, KScale, VScale, SinkK, SinkV, SinkSlots,
    qk_scale_log2,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kk, stride_vp, stride_vs, stride_vk,
    stride_ptb, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    REVERSE_M: tl.constexpr, SCALE_MODE: tl.constexpr, WARP_SPEC: tl.constexpr,
    PROBE: tl.constexpr, QUANT: tl.constexpr, F16_DOT: tl.constexpr, HAS_SINK: tl.constexpr,
    V_CHANNEL_MAJOR: tl.constexpr, VSTEP: tl.constexpr,
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
    if QUANT:  # FP8 pages: the K scale joins the softmax scale
        qk_scale_log2 = qk_scale_log2 * tl.load(KScale + kv_head)

    rows = m0 + tl.arange(0, BLOCK_M)  # [Mb] query index within the request
    dims = tl.arange(0, HEAD_DIM)
    row_mask = rows < extend_len
    q_ptr = Q + (row0 + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + dims[None, :], mask=row_mask[:, None], other=0.0)  # [Mb, D]
    if SCALE_MODE == 2:
        q = q * qk_scale_log2
        if not F16_DOT:
            q = q.to(Q.dtype.element_ty)
    if F16_DOT:  # FP8 pages, fp16 dots (ExtendConfig.fp8_compute): K/V tiles convert to q's dtype
        q = _fp16_operand(q)
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
    first = 0
    if HAS_SINK:  # exact attention sink: key 0 from its slot, the first tile masked
        if SCALE_MODE == 2:
            sink_factor = 1.0
        else:
            sink_factor = qk_scale_log2
        m_i, l_i, acc, lo = _sink_start(q, m_i, l_i, acc, SinkK, SinkV, SinkSlots, b, kv_head,
                                        tl.num_programs(0) // GROUP, True, sink_factor, HEAD_DIM)  # fmt: skip
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, page_row, 0, key_end, rows_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, page_base, lo,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, True, SCALE_MODE, DOT_PRECISION, False, QUANT, False, V_CHANNEL_MAJOR, VSTEP,
        )  # fmt: skip
        first = BLOCK_N
    for n0 in tl.range(first, full_end, BLOCK_N, warp_specialize=WARP_SPEC):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, page_row, n0, key_end, rows_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, page_base, 0,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, False, SCALE_MODE, DOT_PRECISION, PROBE == 3, QUANT, False, V_CHANNEL_MAJOR, VSTEP,
        )  # fmt: skip
    # Diagonal tiles, masked (PROBE 1, a measurement probe with a wrong result: unmasked).
    for n0 in range(tl.maximum(full_end, first), key_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, page_row, n0, key_end, rows_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, page_base, 0,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, PROBE != 1, SCALE_MODE, DOT_PRECISION, PROBE == 3, QUANT,
            False, V_CHANNEL_MAJOR, VSTEP,
        )  # fmt: skip

    out = acc / l_i[:, None]  # every row sees key 0, so l_i > 0
    if QUANT:
        out = out * tl.load(VScale + kv_head)
    o_ptr = Out + (row0 + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh
    tl.store(o_ptr + dims[None, :], out.to(Out.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def _attend_kind_tiered(
    acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, visible, qk_scale_log2,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online-softmax update ("fma" scale) of (acc_lo, acc_hi [Mb, D/2], m_i, l_i [Mb]) with
    one kind of keys of a tile, ``visible`` [Mb, Nb] (causal and kind mask). A row may see
    none of them yet (m_i and the tile's max -inf: the FP8 sink key beside INT4 keys): it
    subtracts 0 instead of -inf and keeps l_i = 0."""
    s = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PRECISION)  # [Mb, Nb]
    s = tl.dot(q_hi, tl.trans(k_hi), acc=s, input_precision=DOT_PRECISION)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * qk_scale_log2 - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(q_lo.dtype)
    acc_lo = tl.dot(p, v_lo, acc=acc_lo * alpha[:, None], input_precision=DOT_PRECISION)
    acc_hi = tl.dot(p, v_hi, acc=acc_hi * alpha[:, None], input_precision=DOT_PRECISION)
    return acc_lo, acc_hi, m_new, l_i


@triton.jit
def _attend_tile_tiered(
    acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_base, v_base, page_row, pages, fslot, n0, key_end,
    rows_pos, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2,
    FSlot, KCodes, KStat, VCodes, VStat, kv_head, k_scale8, v_scale8,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_KV_HEADS: tl.constexpr, VGROUP: tl.constexpr,
    ALIGNED: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """``_attend_tile`` over a tiered pool, on head-dim halves (channels 2j and 2j+1:
    q_lo/q_hi [Mb, D/2], acc_lo/acc_hi [Mb, D/2] fp32), given the tile's ``pages``/``fslot``
    (``_tile_pages``, ``_tile_slots``). As in decode, one branch per kind of page present,
    uniform per program: the INT4 keys (decode's ``_tiered_kv`` KIND 4), then the FP8 keys
    (KIND 8); a tile holding both is two updates."""
    keys = n0 + tl.arange(0, BLOCK_N)  # [Nb]
    valid = keys < key_end
    tally = _tile_tally(fslot)
    kind4, kind8 = _tile_kinds(page_row, FSlot, keys, valid, tally, PAGE_SIZE)
    causal = valid[None, :]
    if MASKED:
        causal = (keys[None, :] <= rows_pos[:, None]) & valid[None, :]  # [Mb, Nb]
    if tally % 65536 != 0:  # INT4 keys
        k_lo, k_hi, v_lo, v_hi = _tiered_kv(
            k_base, v_base, stride_kp, stride_ks, stride_vp, stride_vs,
            KCodes, KStat, VCodes, VStat, pages, fslot, n0, key_end, kv_head, k_scale8, v_scale8, q_lo,
            BLOCK_N, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, VGROUP, ALIGNED, STEP, 4,
        )  # fmt: skip
        acc_lo, acc_hi, m_i, l_i = _attend_kind_tiered(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_lo, k_hi, v_lo,
                                                       v_hi, causal & kind4[None, :], qk_scale_log2,
                                                       DOT_PRECISION)  # fmt: skip
    if tally >= 65536:  # FP8 keys
        k_lo, k_hi, v_lo, v_hi = _tiered_kv(
            k_base, v_base, stride_kp, stride_ks, stride_vp, stride_vs,
            KCodes, KStat, VCodes, VStat, pages, fslot, n0, key_end, kv_head, k_scale8, v_scale8, q_lo,
            BLOCK_N, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, VGROUP, ALIGNED, STEP, 8,
        )  # fmt: skip
        acc_lo, acc_hi, m_i, l_i = _attend_kind_tiered(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_lo, k_hi, v_lo,
                                                       v_hi, causal & kind8[None, :], qk_scale_log2,
                                                       DOT_PRECISION)  # fmt: skip
    return acc_lo, acc_hi, m_i, l_i


@triton.jit
def _tiered_key_loop(
    acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_base, v_base, page_row, first, last, key_end,
    rows_pos, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2,
    FSlot, KCodes, KStat, VCodes, VStat, kv_head, k_scale8, v_scale8,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_KV_HEADS: tl.constexpr, VGROUP: tl.constexpr,
    ALIGNED: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """Tiles first, first + BLOCK_N, .. < last (keys < key_end read) through
    ``_attend_tile_tiered``, with the pages loaded two tiles ahead and the slots one."""
    pages = _tile_pages(page_row, first, key_end, BLOCK_N, PAGE_SIZE, STEP)
    fslot = _tile_slots(FSlot, pages, first, key_end, BLOCK_N, STEP)
    pages_next = _tile_pages(page_row, first + BLOCK_N, key_end, BLOCK_N, PAGE_SIZE, STEP)
    for n0 in range(first, last, BLOCK_N):
        fslot_next = _tile_slots(FSlot, pages_next, n0 + BLOCK_N, key_end, BLOCK_N, STEP)
        pages_after = _tile_pages(page_row, n0 + 2 * BLOCK_N, key_end, BLOCK_N, PAGE_SIZE, STEP)
        acc_lo, acc_hi, m_i, l_i = _attend_tile_tiered(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_base, v_base, page_row, pages, fslot, n0, key_end,
            rows_pos, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2,
            FSlot, KCodes, KStat, VCodes, VStat, kv_head, k_scale8, v_scale8,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, MASKED, DOT_PRECISION, NUM_KV_HEADS, VGROUP, ALIGNED, STEP,
        )  # fmt: skip
        pages, fslot, pages_next = pages_next, fslot_next, pages_after
    return acc_lo, acc_hi, m_i, l_i


@jit_unspecialised("stride_ptb", "PageTable", "PrefixLens", "KScale", "VScale")
def _extend_tiered_kernel(
    Q, KPool, VPool, PageTable, CuExtend, PrefixLens, Out, KScale, VScale,
    FSlot, KCodes, KStat, VCodes, VStat,
    qk_scale_log2,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kk, stride_vp, stride_vs, stride_vk,
    stride_ptb, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    REVERSE_M: tl.constexpr, NUM_KV_HEADS: tl.constexpr, VGROUP: tl.constexpr,
    ALIGNED: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """``_extend_kernel`` (same grid and key walk) over a tiered pool: K/V tiles from
    ``_tiered_kv``, the head dim as two halves (channels 2j, 2j+1) as in decode's
    ``_decode_tiered_kernel``; float32 K/V rounded to q's dtype for the dots."""
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
    k_scale8 = tl.load(KScale + kv_head)
    v_scale8 = tl.load(VScale + kv_head)

    rows = m0 + tl.arange(0, BLOCK_M)  # [Mb] query index within the request
    half = tl.arange(0, HEAD_DIM // 2)
    row_mask = rows < extend_len
    q_ptr = Q + (row0 + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh + 2 * half[None, :]
    q_lo = tl.load(q_ptr, mask=row_mask[:, None], other=0.0)  # [Mb, D/2] channels 2j
    q_hi = tl.load(q_ptr + 1, mask=row_mask[:, None], other=0.0)  # channels 2j+1
    rows_pos = prefix_len + rows  # [Mb] absolute position = last key each row sees
    page_row = PageTable + b * stride_ptb
    k_base = KPool + kv_head * stride_kk
    v_base = VPool + kv_head * stride_vk

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HEAD_DIM // 2], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HEAD_DIM // 2], dtype=tl.float32)
    # Keys [0, prefix_len + m0] are visible to every row: whole tiles of them need no mask.
    full_end = (prefix_len + m0 + 1) // BLOCK_N * BLOCK_N
    key_end = prefix_len + tl.minimum(m0 + BLOCK_M, extend_len)
    acc_lo, acc_hi, m_i, l_i = _tiered_key_loop(
        acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_base, v_base, page_row, 0, full_end, key_end,
        rows_pos, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2,
        FSlot, KCodes, KStat, VCodes, VStat, kv_head, k_scale8, v_scale8,
        BLOCK_N, HEAD_DIM, PAGE_SIZE, False, DOT_PRECISION, NUM_KV_HEADS, VGROUP, ALIGNED, STEP,
    )  # fmt: skip
    acc_lo, acc_hi, m_i, l_i = _tiered_key_loop(  # diagonal tiles: causal mask
        acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_base, v_base, page_row, full_end, key_end, key_end,
        rows_pos, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2,
        FSlot, KCodes, KStat, VCodes, VStat, kv_head, k_scale8, v_scale8,
        BLOCK_N, HEAD_DIM, PAGE_SIZE, True, DOT_PRECISION, NUM_KV_HEADS, VGROUP, ALIGNED, STEP,
    )  # fmt: skip

    inv_l = 1.0 / l_i  # every row sees key 0, so l_i > 0
    o_ptr = Out + (row0 + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh + 2 * half[None, :]
    tl.store(o_ptr, (acc_lo * inv_l[:, None]).to(Out.dtype.element_ty), mask=row_mask[:, None])
    tl.store(o_ptr + 1, (acc_hi * inv_l[:, None]).to(Out.dtype.element_ty), mask=row_mask[:, None])


# One binary for every N, page-table width and batch slice (warm_up_split_path compiles it once).
@jit_unspecialised("num_splits", "stride_ptb", "PageTable", "PrefixLens", "KScale", "VScale", "SinkK", "SinkV",
                   "SinkSlots")
def _extend_split_kernel(
    Q, KPool, VPool, PageTable, CuExtend, PrefixLens, PartOut, PartLse, KScale, VScale,
    SinkK, SinkV, SinkSlots,
    qk_scale_log2, num_splits, num_kv_heads,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kk, stride_vp, stride_vs, stride_vk,
    stride_ptb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr, F16_DOT: tl.constexpr, HAS_SINK: tl.constexpr,
    V_CHANNEL_MAJOR: tl.constexpr, VSTEP: tl.constexpr,
):  # fmt: skip
    """Grid (M blocks, N splits, B * K). Program: BLOCK_M new tokens x the G query heads of
    one kv head (rows r = token * GROUP_PAD + head), keys [start, end) of one split of the
    block's keys [0, prefix_len + min(m0 + BLOCK_M, E)). Writes normalised partial outputs
    and log2-sum-exps to PartOut [T, H, N, D] / PartLse [T, H, N] (fp32, contiguous)."""
    m_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2) // num_kv_heads
    kv_head = tl.program_id(2) % num_kv_heads
    row0 = tl.load(CuExtend + b)
    extend_len = tl.load(CuExtend + b + 1) - row0
    m0 = m_block * BLOCK_M
    if m0 >= extend_len:
        return
    prefix_len = tl.load(PrefixLens + b)
    if QUANT:  # FP8 pages: the K scale joins the softmax scale, V's scales the output
        qk_scale_log2 = qk_scale_log2 * tl.load(KScale + kv_head)

    r = tl.arange(0, BLOCK_M * GROUP_PAD)  # [R] rows: (new token, query head of the group)
    tok = m0 + r // GROUP_PAD  # query index within the request
    g = r % GROUP_PAD
    dims = tl.arange(0, HEAD_DIM)
    row_mask = (tok < extend_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    t_idx = (row0 + tok).to(tl.int64)
    q_ptr = Q + t_idx[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr, mask=row_mask[:, None], other=0.0)  # [R, D]
    if F16_DOT:  # FP8 pages, fp16 dots (ExtendSplitConfig.fp8_compute)
        q = _fp16_operand(q)
    rows_pos = prefix_len + tok  # [R] last key each row sees
    page_row = PageTable + b * stride_ptb
    k_base = KPool + kv_head * stride_kk
    v_base = VPool + kv_head * stride_vk

    key_end = prefix_len + tl.minimum(m0 + BLOCK_M, extend_len)
    split_len = tl.cdiv(tl.cdiv(key_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, key_end)
    # Keys [0, prefix_len + m0] are visible to every row: whole tiles of them need no mask.
    full_end = (prefix_len + m0 + 1) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    if HAS_SINK:  # exact attention sink: key 0 from its slot (split 0), each split's first tile masked
        m_i, l_i, acc, lo = _sink_start(q, m_i, l_i, acc, SinkK, SinkV, SinkSlots, b, kv_head,
                                        num_kv_heads, split == 0, qk_scale_log2, HEAD_DIM)  # fmt: skip
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, page_row, start, end, rows_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, 0, lo,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, True, 1, DOT_PRECISION, False, QUANT, True, V_CHANNEL_MAJOR, VSTEP,
        )  # fmt: skip
        start = start + BLOCK_N
    for n0 in range(start, tl.minimum(end, full_end), BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, page_row, n0, end, rows_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, 0, 0,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, False, 1, DOT_PRECISION, False, QUANT, False, V_CHANNEL_MAJOR, VSTEP,
        )  # fmt: skip
    # Diagonal tiles (and the split's partial last tile): causal mask; a row may see none.
    for n0 in range(tl.maximum(start, full_end), end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_base, v_base, page_row, n0, end, rows_pos,
            stride_kp, stride_ks, stride_vp, stride_vs, qk_scale_log2, 0, 0,
            BLOCK_N, HEAD_DIM, PAGE_SIZE, True, 1, DOT_PRECISION, False, QUANT, True, V_CHANNEL_MAJOR, VSTEP,
        )  # fmt: skip

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if QUANT:
        out = out * tl.load(VScale + kv_head)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    part = (t_idx * (num_kv_heads * GROUP) + heads) * num_splits + split  # [R]
    # Empty splits write only lse = -inf; the merge does not read their PartOut rows.
    tl.store(PartOut + part[:, None] * HEAD_DIM + dims[None, :], out, mask=(row_mask & nonempty)[:, None])
    tl.store(PartLse + part, lse, mask=row_mask)


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
    assert k_pool.stride(-1) == 1, "k pool: last dim contiguous"
    assert v_pool.stride(-1) == 1 or channel_major(v_pool), "v pool: last dim contiguous, or channel-major FP8"
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
    num_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    split_config: ExtendSplitConfig | None = None,
    tiered: TieredPages | None = None,
    sink: Sink | None = None,
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
            ``default_extend_config(q.device, max_extend_len, Pmax * S, tiered is not None)``.
        k_scale, v_scale: [K] float32 per-kv-head scales, required for (and only for)
            float8_e4m3fn pools (value = stored * scale).
        num_splits: key splits N of the split-KV path; 1 = the long-extend kernel; default
            ``extend_num_splits`` on the bounds ``max_extend_len`` and Pmax * S (ignored,
            i.e. 1, with ``tiered``: the split path does not read INT4 pages).
        workspace: optional scratch for N > 1, exactly
            ``DecodeWorkspace.allocate(T, H, N, D)`` (allocated per call when omitted).
        split_config: launch parameters of the split-KV path; default
            ``default_split_config(q.device)``.
        tiered: int4 / mixed pools (``decode_attention.TieredPages``): ``k_pool``/``v_pool``
            are the FP8 slots, pages without one are read as INT4 (``_extend_tiered_kernel``;
            D >= 32, ``config.block_n`` >= 16).
        sink: exact attention sink of an FP8 pool (``decode_attention``'s argument of that
            name); not with ``tiered``.
    """
    _check_inputs(q, k_pool, v_pool, page_table, cu_extend, prefix_lens)
    _check_scales(k_pool, k_scale, v_scale)
    _check_sink(sink, k_pool, k_scale, page_table.shape[0])
    assert sink is None or tiered is None, "the exact sink is for FP8 pools, not tiered ones"
    _check_tiered(k_pool, v_pool, tiered)
    max_seq_len = page_table.shape[1] * k_pool.shape[1]  # bound on keys per request
    split_config = split_config or default_split_config(q.device)
    if tiered is not None:
        num_splits = 1
    elif num_splits is None:
        num_splits = extend_num_splits(page_table.shape[0], q.shape[1], k_pool.shape[2],
                                       max_extend_len, max_seq_len, q.device, split_config)  # fmt: skip
    assert num_splits >= 1, num_splits
    if config is None:
        config = default_extend_config(q.device, max_extend_len, max_seq_len, tiered is not None)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    batch = page_table.shape[0]
    if batch == 0 or q.shape[0] == 0:
        return out
    if num_splits > 1:
        num_tokens, num_heads, head_dim = q.shape
        if workspace is None:
            workspace = DecodeWorkspace.allocate(num_tokens, num_heads, num_splits, head_dim, q.device)
        shape = (num_tokens, num_heads, num_splits)
        assert tuple(workspace.partial_lse.shape) == shape, (workspace.partial_lse.shape, shape)
        assert workspace.partial_out.shape == (*shape, head_dim) and workspace.partial_out.is_contiguous()
        _launch_split(q, k_pool, v_pool, page_table, cu_extend, prefix_lens, out, workspace,
                      scale, max_extend_len, num_splits, split_config, k_scale, v_scale, sink)  # fmt: skip
        return out
    _launch(q, k_pool, v_pool, page_table, cu_extend, prefix_lens, out, scale,
            max_extend_len, config, k_scale=k_scale, v_scale=v_scale, tiered=tiered, sink=sink)  # fmt: skip
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
    sink: Sink | None = None,
):
    """Launch ``_extend_kernel``; returns Triton's compiled kernel (registers, shared memory).

    ``probe`` is for measurements only (bench/kernels/bench_kernels.py): 1 = diagonal tiles
    without the causal mask, 2 = every query block reads all keys unmasked (uniform program
    lengths); both give wrong results and assume prefix and extend lengths that are
    multiples of ``block_n``. 3 = no page-table loads: request b's pages are taken to be
    b * 1024 + 1, + 2, ... (right only for such a table, fewer than 1024 pages each)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pool.shape[2]
    grid = (num_heads, page_table.shape[0], triton.cdiv(max_extend_len, config.block_m))
    scales = (prefix_lens if k_scale is None else k_scale, prefix_lens if v_scale is None else v_scale)
    strides = (q.stride(0), q.stride(1),
               k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
               v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
               page_table.stride(0), out.stride(0), out.stride(1))  # fmt: skip
    common = dict(
        GROUP=num_heads // num_kv_heads, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HEAD_DIM=head_dim, PAGE_SIZE=k_pool.shape[1], DOT_PRECISION=_dot_precision(q.dtype),
        REVERSE_M=config.reverse_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if tiered is not None:  # probes and scale modes are for the bf16 / FP8 kernel only
        assert probe == 0, probe
        aligned, step = _tiled_step(k_pool.shape[1], config.block_n)
        return launch(_extend_tiered_kernel, grid,
            q, k_pool, v_pool, page_table, cu_extend, prefix_lens, out, *scales, *tiered,
            scale * LOG2E, *strides,
            NUM_KV_HEADS=num_kv_heads, VGROUP=_value_group(tiered, head_dim),
            ALIGNED=aligned, STEP=step, **common,
        )  # fmt: skip
    return launch(_extend_kernel, grid,
        q, k_pool, v_pool, page_table, cu_extend, prefix_lens, out, *scales,
        *((prefix_lens,) * 3 if sink is None else sink), scale * LOG2E, *strides, HAS_SINK=sink is not None,
        SCALE_MODE=_SCALE_MODES[config.scale_mode], WARP_SPEC=config.warp_specialize, PROBE=probe,
        QUANT=int(k_scale is not None), F16_DOT=_f16_dot(q.dtype, k_scale, config.fp8_compute),
        V_CHANNEL_MAJOR=channel_major(v_pool), VSTEP=min(k_pool.shape[1], config.block_n), **common,
    )  # fmt: skip

def _launch_split(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    cu_extend: torch.Tensor,
    prefix_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: DecodeWorkspace,
    scale: float,
    max_extend_len: int,
    num_splits: int,
    config: ExtendSplitConfig,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sink: Sink | None = None,
) -> tuple:
    """Launch ``_extend_split_kernel`` then the log-sum-exp merge (decode's
    ``_decode_merge_kernel`` over [T, H] rows); returns both compiled kernels."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    block_m, group_pad = _split_block_m(num_heads, num_kv_heads, config)
    grid = (triton.cdiv(max_extend_len, block_m), num_splits, page_table.shape[0] * num_kv_heads)
    part_out, part_lse = workspace.partial_out, workspace.partial_lse
    split = launch(_extend_split_kernel, grid,
        q, k_pool, v_pool, page_table, cu_extend, prefix_lens, part_out, part_lse,
        prefix_lens if k_scale is None else k_scale, prefix_lens if v_scale is None else v_scale,
        *((prefix_lens,) * 3 if sink is None else sink), scale * LOG2E, num_splits, num_kv_heads,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        page_table.stride(0),
        GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad, BLOCK_M=block_m,
        BLOCK_N=config.block_n, HEAD_DIM=head_dim, PAGE_SIZE=k_pool.shape[1],
        DOT_PRECISION=_dot_precision(q.dtype), QUANT=int(k_scale is not None),
        F16_DOT=_f16_dot(q.dtype, k_scale, config.fp8_compute), HAS_SINK=sink is not None,
        V_CHANNEL_MAJOR=channel_major(v_pool), VSTEP=min(k_pool.shape[1], config.block_n),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    merge = launch(_decode_merge_kernel, (num_tokens, num_heads),
        part_out, part_lse, out, part_lse, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), GROUP=1, CENTER=False,
        num_warps=_merge_warps(head_dim, num_splits),
    )  # fmt: skip
    return split, merge


def warm_up_split_path(
    k_pool: torch.Tensor,
    num_heads: int,
    q_dtype: torch.dtype,
    max_seq_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sink_k: torch.Tensor | None = None,
    v_pool: torch.Tensor | None = None,
) -> list[int]:
    """Compile the split-KV path for one layer's pool ([P, S, K, D]) before serving, so the
    first cached-prefix request does not pay Triton's JIT (seconds per binary) in its TTFT.

    Runs one tiny extend (one token over page 0, results discarded) for every split count
    ``extend_num_splits`` can return for sequences up to ``max_seq_len`` (the powers of two
    up to its batch-1 value; the split kernel is one binary, the merge one per N). Reads
    slot 0 of page 0, writes no pool slot. Returns the split counts compiled ([] if the path
    can never be taken). The kernel specialises on none of the arguments that vary between
    layers or steps (FP8 scale rows ``k_scale[layer]`` alternate in 16-byte alignment when
    K is not a multiple of 4), so one binary serves them all.
    ``sink_k`` [C, K, D]: the pool keeps an exact sink (compiles that variant; slot -1).
    ``v_pool``: the layer's V pool (default ``k_pool``; pass it where V's layout differs,
    e.g. channel-major FP8 V).
    """
    num_kv_heads = k_pool.shape[2]
    most = extend_num_splits(1, num_heads, num_kv_heads, 1, max_seq_len, k_pool.device)
    splits = [1 << i for i in range(1, most.bit_length())]
    for n in splits:
        _one_token_extend(k_pool, v_pool, num_heads, q_dtype, k_scale, v_scale, sink_k, num_splits=n)
    return splits


def warm_up_extend_path(
    k_pool: torch.Tensor,
    num_heads: int,
    q_dtype: torch.dtype,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sink_k: torch.Tensor | None = None,
    v_pool: torch.Tensor | None = None,
) -> list[ExtendConfig]:
    """Compile the long-extend kernel (``num_splits`` 1) for each config
    ``default_extend_config`` picks on this device (on Hopper: ``HOPPER_PREFILL_CONFIG``
    for prefills, ``HOPPER_EXTEND_CONFIG`` for extends over a cached prefix), so the first
    step of each kind, e.g. the first cached-prefix hit after a run of plain prefills, does
    not pay Triton's JIT while other requests wait. One token over page 0, results
    discarded, no pool slot written. Returns the configs compiled. Arguments as
    ``warm_up_split_path``."""
    device = k_pool.device
    configs = list(dict.fromkeys((default_extend_config(device, 1, 1), default_extend_config(device, 128, 256))))
    for config in configs:
        _one_token_extend(k_pool, v_pool, num_heads, q_dtype, k_scale, v_scale, sink_k, num_splits=1, config=config)
    return configs


def _one_token_extend(k_pool: torch.Tensor, v_pool: torch.Tensor | None, num_heads: int, q_dtype: torch.dtype,
                      k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, sink_k: torch.Tensor | None,
                      **kwargs) -> None:
    """One extend of one token over page 0 (the warm-ups' launch; output discarded, no
    pool slot written); ``kwargs`` go to ``extend_attention``."""
    device, head_dim = k_pool.device, k_pool.shape[3]
    q = torch.zeros(1, num_heads, head_dim, dtype=q_dtype, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    prefix = torch.zeros(1, dtype=torch.int32, device=device)
    sink = None
    if sink_k is not None:
        sink = Sink(sink_k, sink_k, torch.full((1,), -1, dtype=torch.int32, device=device))
    extend_attention(q, k_pool, k_pool if v_pool is None else v_pool, table, cu, prefix, head_dim**-0.5, 1,
                     k_scale=k_scale, v_scale=v_scale, sink=sink, **kwargs)  # fmt: skip
