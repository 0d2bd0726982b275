"""Triton paged decode attention: split-KV ("flash decoding") with a log-sum-exp merge.

What: one query token per request attends to the request's whole cached sequence
(``seq_lens[b]`` keys, the new token's own K/V already stored), reading K/V pages straight
through the page table. Same result as ``reference.paged_attention`` with extend_len 1.

Dimension letters: B requests, H query heads, K kv heads, G = H // K query heads per kv
head, D head dim, P pages, S page size, Pmax pages per request, N splits per request.

Layout::

    q               [B, H, D]     any strides, last dim contiguous
    k_pool, v_pool  [P, S, K, D]  last dim contiguous (FP8 V: or channel-major, below)
    page_table      [B, Pmax]     int32; key t of request b is in page page_table[b, t // S]
    seq_lens        [B]           int32, >= 1
    out             [B, H, D]     q's dtype

    keys of request b:  0 ........................................ seq_len-1
    splits:             |  split 0  |  split 1  | ... | split N-1 |   (each a multiple of
                                                                        BLOCK_N keys; the
                                                                        tail ones may be empty)

Algorithm:
  1. ``_decode_split_kernel``, grid (B, K, N): program (b, kv head, split) loads the G
     query heads that share one kv head as a [BLOCK_H, D] tile (GQA: each K/V tile is read
     once for the whole group), walks its key range in BLOCK_N tiles, looks each key's page
     up in the page table (no per-token index array in memory), and keeps an online
     softmax (running max, sum, accumulator; FlashAttention-2). It writes the normalised
     partial output [BLOCK_H, D] and its log2-sum-exp.
  2. ``_decode_merge_kernel``, grid (B, H): out = sum_i w_i o_i / sum_i w_i with
     w_i = 2^(lse_i - max lse) (Flash-Decoding's reduction). With N = 1 step 1 writes the
     output directly and step 2 is skipped.
Sources: FlashAttention-2 (Dao, 2023), Flash-Decoding (Dao et al., 2023), PagedAttention
(Kwon et al., SOSP 2023), RadixAttention (Zheng et al., 2024).

Limits: D a power of two (16..256); G <= 64; fp16/bf16 (fp32 for tests, with IEEE fp32
dots). Keys past seq_len, and the rest of the last page, are never read (masked), so stale
or NaN slots are harmless.

Caveats: N is chosen on the host (``decode_num_splits``) from an upper bound on the sequence
length, so one launch shape serves a whole batch (and a CUDA graph); each request then
splits its own length into N parts. An eager call costs 90-130 us of host time on the H200
host (two Triton launches plus checks; 4a7db11:bench/KERNELS.md), far more than
the GPU time of a small batch: replay decode steps from a CUDA graph. Short contexts are
limited by a fixed cost per call, not by the split count: on the H200, batch 32 streams K/V
at ~4.5 TB/s (29.6 us per 1K keys) on top of ~15-22 us per call (one launch from a graph,
the first dependent page-table -> K/V loads, the ~3 us merge kernel, write-back of dirty L2
lines), so 32 x 2K reaches 0.77 of the copy bandwidth and 32 x 8K 0.96
(BENCHMARKS.md "Decode attention").

FP8 pools (float8_e4m3fn pages, per-kv-head float32 ``k_scale``/``v_scale`` [K]): a
program serves one kv head, so its two scales are scalars. K tiles are converted to q's
dtype in registers and the K scale is folded into the softmax scale
(q . (k8 * s_k) = s_k (q . k8)); V is used unscaled in the accumulator and the output is
multiplied by s_v once (sum_j p_j v8_j s_v = s_v sum_j p_j v8_j). Half the bytes of bf16
per key; the dequantisation costs one convert per element, to fp16 by default
(``DecodeConfig.fp8_compute``: the dots then run in fp16 whatever q's dtype). The convert
is not what held FP8 back (bench/kv_cache/fp8_decode_probe.py: a bit-operation convert
was slower, QK^T on FP8 tensor cores no faster). First it was K/V loads left waiting on each
tile's page-table load: FP8 launches load the page-table entries one tile ahead
(``DecodeConfig.pages_ahead``) with 3 stages and small tiles on 1-2 warps. Then it was
instruction issue (ncu: 71% of DRAM bandwidth, 12.5% occupancy, 337M instructions against
bf16's 260M): the P @ V dot takes V as its B operand with the keys as the reduction dim,
and row-major 8-bit V has them strided, so each thread gathered its operand bytes one by
one from shared memory (128 ``LDS.U8`` per thread per 32-key tile in the sm_90a build).
FP8 V pools are therefore stored channel-major (``reference.channel_major``: [P, K, D, S] in
memory, which ``KVPool`` allocates): ``_channel_major_v`` loads a V tile as whole pages
[NP, S, D] with a page's keys contiguous, 16-byte copies whose shared-memory tile the dot
reads as vectors. The slots past the last key of a request's last page are read and
weighted 0, so they must hold finite values: the pool is zero-filled and stores clamp. H200,
32 x 32K keys: 535 us against bf16 pages' 995 (1.86x; row-major FP8 pages 1.52x; bf16 pages
of half the head dim, the same bytes, 582).

Tiered pools (int4 / mixed, ``TieredPages``; docs/KV_CACHE.md "Quantised KV cache"):
the k/v pools are the FP8 slots [F, S, K, D] and each logical page is either in the slot
``fp8_slot[page]`` or INT4 (KIVI, Liu et al. 2024: codes [P, S, K, D/2] uint8, key
scale/zero per channel of the page, value scale/zero per group of G channels of a token,
fp16). ``_decode_tiered_kernel`` (same grid, splits and merge as above):

  * Head-dim halves: q, the K/V tiles and the accumulator are pairs of [., D/2] tensors,
    channels 2j and 2j+1 (q . k = q_lo . k_lo + q_hi . k_hi; p @ v = [p @ v_lo, p @ v_hi]),
    so a [Nb, D/2] byte tile unpacks into its low and high nibbles (code & 15, code >> 4)
    with each byte loaded once and no interleave.
  * Tiles of whole pages (power-of-two S): while loaded, a tile is [NP, SP, D/2] (NP pages
    of SP = min(S, BLOCK_N) keys), so the key statistics are loaded once per page
    ([NP, 1, D/2]) and broadcast; the dequantised tile is reshaped to [BLOCK_N, D/2].
    Other page sizes look every key's page up (statistics per key).
  * Uniform branches per tile on a scalar count of the tile's FP8 and INT4 pages
    (``_tile_tally``): if it holds INT4 pages, one online-softmax update over its INT4 keys
    (codes and statistics loaded only: ``_tiered_kv`` KIND 4); if it holds FP8 pages, one
    over its FP8 keys (the slots only, times the per-kv-head scale: KIND 8). All-INT4 and
    all-FP8 tiles (nearly all) take one branch; a tile across a boundary between the kinds
    takes both, each key masked out of the other (``_tile_kinds``). Only one kind's tiles
    are live at a time: a single branch holding both kinds' loads had the sm_90 build spill
    (ptxas -v, bench/kernels/ptxas_usage.py).
  * The page-table entries and FP8 slots of the tiles are loaded ahead (pages two tiles,
    slots one), so only the K/V loads wait in a tile (page -> slot -> K/V is a chain of
    dependent loads).
  * Values are code * scale + zero (or fp8 * scale) in float32, rounded to q's dtype for
    the dots (fp32 accumulation). Launch parameters: ``TIERED_DECODE_CONFIG``.
0.30 of bf16's bytes per key (page 16, G 64: K 0.5 + 4/16, V 0.5 + 4/64 bytes per element).
The extend kernel reads tiered pools with the same helpers (``_tile_pages``,
``_tile_slots``, ``_tiered_kv``). Speed (bench/kv_cache/kv_speed_gpu.py): the comment of
``TIERED_DECODE_CONFIG`` and BENCHMARKS.md "Quantised KV cache: speed".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from radixlm.kernels.launch import jit_unspecialised, launch
from radixlm.kernels.reference import Sink, channel_major

__all__ = ["FP8_DECODE_CONFIG", "FP8_LARGE_BATCH_DECODE_CONFIG", "PREFIX_CONFIG", "TIERED_DECODE_CONFIG",
           "DecodeConfig", "DecodeWorkspace", "SharedPrefixes", "TieredPages", "decode_attention", "decode_num_splits",
           "default_decode_config", "merge_variants", "plan_shared_prefixes", "shared_prefix_bound", "warm_up_decode_path"]

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split kernel (the merge kernel is fixed)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Split heuristic: at most one wave of programs_per_sm programs per SM (B * K * N <=
    # programs_per_sm * SMs), and no split shorter than min_split_keys keys.
    programs_per_sm: int = 4
    min_split_keys: int = 128
    # FP8 pools: the dtype the K/V tiles are converted to for the two dots. "fp16": one
    # hardware convert per two elements on sm_89+ (cvt.rn.f16x2.e4m3x2), q cast to fp16
    # (clamped to +-65504) and p rounded to fp16 (finer than bf16 on [0, 1]); "q": q's
    # dtype (for bf16 queries the convert goes e4m3 -> f16 -> f32 -> bf16).
    fp8_compute: str = "fp16"
    # Split kernel: load each tile's page-table entries (and compute its K/V offsets) one
    # tile ahead, so the software pipeliner's K/V prefetch does not first wait on a
    # page-table load. Worth 15-20% on FP8 pages with 3 stages (below); bf16 pages are at
    # the copy bandwidth already and stay without (within +-5% either way on the H200).
    pages_ahead: bool = False
    # Split kernel: a cap on registers per thread (ptxas ``.maxnreg``; None: the compiler's
    # choice), so more programs fit on an SM at once.
    max_registers: int | None = None


# FP8 pages (fp16 dots, channel-major V). H200, 8 kv heads, D 128, 2026-12-04
# (bench/kv_cache/fp8_decode_probe.py, production kernel on channel-major V). From batch 8
# (FP8_LARGE_BATCH): 64-key tiles on 1 warp, 3 stages, 8 programs per SM: 32 x 32K keys
# 535 us (bf16 pages 995 us, 1.86x; 32-key tiles 582, 128-key tiles on 2 warps 535, 64 keys
# on 2 warps / 4 programs 629); 64 x 16K 535 (bf16 989), 128 x 8K 525 (bf16 987), 32 x 8K
# 152 (bf16 265), 24 x 16K 223 (2 warps 303, bf16 400), 16 x 32K 279 (323, bf16 506),
# 16 x 8K 86 (95, bf16 142), 8 x 32K 152 (171, bf16 263), 8 x 8K 54 with 4 stages (56, bf16 81). Below
# it 64-key tiles on 2 warps: 4 x 8K 36.1 (1 warp 36.7), 2 x 4K 18.3 (20.1), 1 x 2K 13.9
# (16.1; bf16 15.3). Row-major V pages (the layout before 2026-12-04) took 649 us at
# 32 x 32K with 32-key tiles on 1 warp, and 1022 us with the 1-warp config above.
FP8_DECODE_CONFIG = DecodeConfig(block_n=64, num_warps=2, num_stages=3, pages_ahead=True)
FP8_LARGE_BATCH_DECODE_CONFIG = DecodeConfig(
    block_n=64, num_warps=1, num_stages=3, programs_per_sm=8, pages_ahead=True
)
FP8_LARGE_BATCH = 8  # requests per decode step from which FP8_LARGE_BATCH_DECODE_CONFIG is used
# Tiered pools (int4 / mixed; ``_decode_tiered_kernel``). H200, batch 32, 8 kv heads, D 128
# (bench/kv_cache/kv_speed_gpu.py, 2026-11-30): 32K keys 4724 us (bf16 pages 994 us), 8K
# 1204 us (263); of its DECODE_VARIANTS only block_n 32 / 2 warps is faster (4293 / 1092
# us, with 10 bytes of spills); the others take 4.6-6.7 ms at 32K: the kernel is bound by the
# dequantisation instructions (~300 GB/s of INT4 bytes), not by memory.
TIERED_DECODE_CONFIG = DecodeConfig(block_n=64, num_warps=4, num_stages=2)


def default_decode_config(pool_dtype: torch.dtype, tiered: bool = False, batch: int = 1) -> DecodeConfig:
    """The launch parameters used when the caller passes none: ``TIERED_DECODE_CONFIG`` for
    tiered pools; for float8_e4m3fn pools ``FP8_LARGE_BATCH_DECODE_CONFIG`` from
    ``FP8_LARGE_BATCH`` requests, else ``FP8_DECODE_CONFIG``; else ``DecodeConfig()``.
    Depends on the batch size only (not the context), so a CUDA graph captured for a batch
    bucket and the eager path pick the same kernel."""
    if tiered:
        return TIERED_DECODE_CONFIG
    if pool_dtype == torch.float8_e4m3fn:
        return FP8_LARGE_BATCH_DECODE_CONFIG if batch >= FP8_LARGE_BATCH else FP8_DECODE_CONFIG
    return DecodeConfig()


class TieredPages(NamedTuple):
    """The INT4 side of one layer of an int4 / mixed pool (``KVPool``; contiguous tensors).

    fp8_slot [P] int32 (logical page -> FP8 slot of the k/v pools passed beside it, -1 =
    INT4); k_codes, v_codes [P, S, K, D/2] uint8 (two codes per byte, low nibble first);
    k_stat [P, 2, K, D] fp16 (scale, zero per channel of a page); v_stat [P, S, K, 2, D/G]
    fp16 (scale, zero per group of G channels of a token). Value = code * scale + zero."""

    fp8_slot: torch.Tensor
    k_codes: torch.Tensor
    k_stat: torch.Tensor
    v_codes: torch.Tensor
    v_stat: torch.Tensor


@triton.jit
def _tile_pages(
    page_row, n0, key_end, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, STEP: tl.constexpr
):  # fmt: skip
    """The logical pages of the tile of keys n0 .. n0 + BLOCK_N (n0 a multiple of BLOCK_N)
    of a tiered pool, one entry per STEP keys, [BLOCK_N // STEP] int64 (``_tiled_step``: one
    per page of the tile for power-of-two page sizes, else one per key); 0 past key_end."""
    first = n0 + tl.arange(0, BLOCK_N // STEP) * STEP  # first key of each entry
    return tl.load(page_row + first // PAGE_SIZE, mask=first < key_end, other=0).to(tl.int64)


@triton.jit
def _tile_slots(FSlot, pages, n0, key_end, BLOCK_N: tl.constexpr, STEP: tl.constexpr):
    """The FP8 slots of ``_tile_pages``' entries, int64: >= 0 a slot, -1 INT4, -2 past
    key_end. The kernels load both ahead (pages two tiles, slots one tile): page table ->
    slot -> K/V is a chain of dependent loads."""
    first = n0 + tl.arange(0, BLOCK_N // STEP) * STEP
    return tl.load(FSlot + pages, mask=first < key_end, other=-2).to(tl.int64)


@triton.jit
def _channel_major_v(
    v_base, page_row, n0, key_end, stride_vp,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """The V tile [BLOCK_N, D] of keys n0 .. n0 + BLOCK_N (n0 a multiple of BLOCK_N) of a
    channel-major FP8 pool (``channel_major``; ``v_base`` = pool + kv head offset). Loaded as
    [NP, STEP, D] (``_tile_pages``: STEP = min(S, BLOCK_N) keys per page of the tile), the keys
    of a page contiguous, then reshaped. Whole pages past key_end read 0; the slots past
    key_end inside the last page are read (finite: the pool is zero-filled and stores clamp),
    so the caller's probabilities for them must be 0."""
    pages = _tile_pages(page_row, n0, key_end, BLOCK_N, PAGE_SIZE, STEP)  # [NP]
    offs = tl.arange(0, STEP)
    if STEP < PAGE_SIZE:  # the tile is part of one page
        offs = tl.multiple_of(n0 % PAGE_SIZE, STEP) + offs
    first = n0 + tl.arange(0, BLOCK_N // STEP) * STEP
    dims = tl.arange(0, HEAD_DIM)
    ptr = v_base + pages[:, None, None] * stride_vp + offs[None, :, None] + dims[None, None, :] * PAGE_SIZE
    v = tl.load(ptr, mask=(first < key_end)[:, None, None], other=0.0)  # [NP, STEP, D]
    return tl.reshape(v, (BLOCK_N, HEAD_DIM))


@triton.jit
def _int4_halves(
    Codes, Stat, token, page, mask, page_mask, kv_head, half, like,
    IS_KEY: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    VGROUP: tl.constexpr,
):  # fmt: skip
    """INT4 K (IS_KEY) or V as two halves, channels 2j (low nibbles) and 2j+1 (high
    nibbles) for j = ``half`` [1, .., D/2], in ``like``'s dtype; each code byte is loaded
    once. ``token`` [.., 1] int64 rows of the codes ((page * S + slot) * K + kv head),
    ``page`` the logical page of each row (or of a block of rows: [NP, 1, 1] beside
    [NP, S, 1] tokens, then each key statistic is loaded once per page), ``mask`` the rows
    to read, ``page_mask`` (``page``'s shape) the pages. Value = code * scale + zero, in
    float32."""
    byte = tl.load(Codes + token * (HEAD_DIM // 2) + half, mask=mask, other=0)
    lo = (byte & 15).to(tl.float32)
    hi = (byte >> 4).to(tl.float32)
    if IS_KEY:  # [P, 2, K, D]: scale, zero per channel of the page
        zero_off = NUM_KV_HEADS * HEAD_DIM
        st = Stat + (page * 2 * NUM_KV_HEADS + kv_head) * HEAD_DIM + 2 * half
        s_lo = tl.load(st, mask=page_mask, other=0.0).to(tl.float32)
        s_hi = tl.load(st + 1, mask=page_mask, other=0.0).to(tl.float32)
        z_lo = tl.load(st + zero_off, mask=page_mask, other=0.0).to(tl.float32)
        z_hi = tl.load(st + zero_off + 1, mask=page_mask, other=0.0).to(tl.float32)
    else:  # [P, S, K, 2, D/G]: scale, zero per group of G channels of the token
        zero_off = HEAD_DIM // VGROUP
        row = token * 2 * (HEAD_DIM // VGROUP)
        st_lo = Stat + row + (2 * half) // VGROUP
        s_lo = tl.load(st_lo, mask=mask, other=0.0).to(tl.float32)
        z_lo = tl.load(st_lo + zero_off, mask=mask, other=0.0).to(tl.float32)
        if VGROUP % 2 == 0:  # channels 2j and 2j+1 share a group
            s_hi = s_lo
            z_hi = z_lo
        else:
            st_hi = Stat + row + (2 * half + 1) // VGROUP
            s_hi = tl.load(st_hi, mask=mask, other=0.0).to(tl.float32)
            z_hi = tl.load(st_hi + zero_off, mask=mask, other=0.0).to(tl.float32)
    return (lo * s_lo + z_lo).to(like.dtype), (hi * s_hi + z_hi).to(like.dtype)


@triton.jit
def _fp8_halves(base8, stride_8p, stride_8s, fslot, slot, mask, half, scale8, like):
    """FP8-slot K or V times the per-head scale as two halves (channels 2j, 2j+1; j =
    ``half`` [1, .., D/2]) in ``like``'s dtype. ``base8`` = the slot pool + the kv head
    offset, ``fslot`` int64 FP8 slots and ``slot`` offsets in the page (broadcastable)."""
    ptr = base8 + fslot * stride_8p + slot * stride_8s + 2 * half
    lo = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * scale8
    hi = tl.load(ptr + 1, mask=mask, other=0.0).to(tl.float32) * scale8
    return lo.to(like.dtype), hi.to(like.dtype)


@triton.jit
def _tile_kinds(page_row, FSlot, keys, valid, tally, PAGE_SIZE: tl.constexpr):
    """Per-key masks [Nb] of a tile's INT4 and FP8 keys (``tally`` from ``_tile_tally``):
    ``valid`` for both when the tile holds one kind; in a tile across a boundary between the
    kinds each key's page and slot are looked up (L1/L2 hits: loaded for the tile already)."""
    kind4 = valid
    kind8 = valid
    if tally % 65536 != 0:
        if tally >= 65536:  # both kinds
            page = tl.load(page_row + keys // PAGE_SIZE, mask=valid, other=0)
            fs = tl.load(FSlot + page, mask=valid, other=-2)
            kind4 = fs == -1
            kind8 = fs >= 0
    return kind4, kind8


@triton.jit
def _tile_tally(fslot):
    """65536 x (FP8 entries) + (INT4 entries) of a tile's ``_tile_slots`` (entries past
    key_end count for neither): a scalar the kernels branch on, uniformly per program."""
    return tl.sum(tl.where(fslot >= 0, 65536, tl.where(fslot == -1, 1, 0)), 0)


@triton.jit
def _tiered_kv(
    k_base, v_base, stride_kp, stride_ks, stride_vp, stride_vs,
    KCodes, KStat, VCodes, VStat, pages, fslot, n0, key_end, kv_head, k_scale8, v_scale8, like,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, VGROUP: tl.constexpr, ALIGNED: tl.constexpr, STEP: tl.constexpr,
    KIND: tl.constexpr,
):  # fmt: skip
    """K and V of one kind of keys of the tile n0 .. n0 + BLOCK_N of a tiered pool: KIND 4
    the INT4 pages' keys (codes and statistics loaded), 8 the FP8 slots' (slots loaded,
    times the per-kv-head scale); other keys and keys past key_end read as 0. ``pages`` /
    ``fslot`` from ``_tile_pages`` / ``_tile_slots``. Returns four [BLOCK_N, D/2] tiles in
    ``like``'s dtype: k_lo, k_hi, v_lo, v_hi (channels 2j and 2j+1).

    ALIGNED (power-of-two page sizes, STEP = min(PAGE_SIZE, BLOCK_N) keys per page of the
    tile): the tile is [NP, SP, D/2] (NP pages of SP keys) while it is loaded, so each key
    statistic is loaded once per page ([NP, 1, D/2]) and broadcast over its keys, then
    reshaped to [BLOCK_N, D/2]; otherwise every key looks its page up."""
    half = tl.arange(0, HEAD_DIM // 2)
    if ALIGNED:
        offs = tl.arange(0, STEP)  # [SP] keys of a page in the tile (SP = STEP)
        key = n0 + tl.arange(0, BLOCK_N // STEP)[:, None] * STEP + offs[None, :]  # [NP, SP]
        valid = (key < key_end)[:, :, None]  # [NP, SP, 1]
        page = pages[:, None, None]  # [NP, 1, 1]
        slot = (n0 % PAGE_SIZE + offs)[None, :, None]  # [1, SP, 1]
        fs = fslot[:, None, None]
        half = half[None, None, :]  # [1, 1, D/2]
    else:
        key = n0 + tl.arange(0, BLOCK_N)
        valid = (key < key_end)[:, None]  # [Nb, 1]
        page = pages[:, None]
        slot = (key % PAGE_SIZE)[:, None]
        fs = fslot[:, None]
        half = half[None, :]  # [1, D/2]
    if KIND == 4:
        token = (page * PAGE_SIZE + slot) * NUM_KV_HEADS + kv_head  # rows of the codes
        mask = valid & (fs == -1)
        k_lo, k_hi = _int4_halves(KCodes, KStat, token, page, mask, fs == -1, kv_head, half, like,
                                  True, NUM_KV_HEADS, HEAD_DIM, VGROUP)  # fmt: skip
        v_lo, v_hi = _int4_halves(VCodes, VStat, token, page, mask, fs == -1, kv_head, half, like,
                                  False, NUM_KV_HEADS, HEAD_DIM, VGROUP)  # fmt: skip
    else:
        mask = valid & (fs >= 0)
        k_lo, k_hi = _fp8_halves(k_base, stride_kp, stride_ks, fs, slot, mask, half, k_scale8, like)
        v_lo, v_hi = _fp8_halves(v_base, stride_vp, stride_vs, fs, slot, mask, half, v_scale8, like)
    if ALIGNED:
        k_lo = tl.reshape(k_lo, (BLOCK_N, HEAD_DIM // 2))
        k_hi = tl.reshape(k_hi, (BLOCK_N, HEAD_DIM // 2))
        v_lo = tl.reshape(v_lo, (BLOCK_N, HEAD_DIM // 2))
        v_hi = tl.reshape(v_hi, (BLOCK_N, HEAD_DIM // 2))
    return k_lo, k_hi, v_lo, v_hi


@triton.jit
def _decode_tiered_update(
    acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, key_mask, qk_scale_log2,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of (acc_lo, acc_hi [Hb, D/2], m_i, l_i [Hb]) with the keys
    ``key_mask`` [Nb] of one K/V tile (at least one: every row sees a key, no -inf max)."""
    s = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PRECISION)
    s = tl.dot(q_hi, tl.trans(k_hi), acc=s, input_precision=DOT_PRECISION)
    s = tl.where(key_mask[None, :], s * qk_scale_log2, float("-inf"))  # [Hb, Nb], log2 domain
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [Hb, Nb]
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(q_lo.dtype)
    acc_lo = tl.dot(p, v_lo, acc=acc_lo * alpha[:, None], input_precision=DOT_PRECISION)
    acc_hi = tl.dot(p, v_hi, acc=acc_hi * alpha[:, None], input_precision=DOT_PRECISION)
    return acc_lo, acc_hi, m_new, l_i


@dataclass
class DecodeWorkspace:
    """Scratch of the split-KV path: partial outputs [B, H, N, D] fp32, lse [B, H, N] fp32.

    Allocate once per forward pass (``DecodeWorkspace.allocate``) and reuse for every layer.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @classmethod
    def allocate(
        cls, batch: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> DecodeWorkspace:
        shape = (batch, num_heads, num_splits)
        return cls(
            partial_out=torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
            partial_lse=torch.empty(shape, dtype=torch.float32, device=device),
        )


# The prefix kernel (cascade decode): [MEMBERS * GROUP_PAD = 64, D] query tiles, 64-key tiles.
PREFIX_CONFIG = DecodeConfig(block_n=64, num_warps=4, num_stages=2)
PREFIX_ROWS = 64  # query rows per prefix-kernel program: MEMBERS = PREFIX_ROWS // next_power_of_2(G)


@dataclass(frozen=True)
class SharedPrefixes:
    """A cascade decode plan of one batch (``plan_shared_prefixes``; ``decode_attention(shared=)``).

    chunk_rows [C, MEMBERS] int32: the batch rows of each chunk (requests whose page tables
    share their first ``chunk_keys[c]`` keys), -1 padded; chunk_keys [C] int32, a multiple
    of the page size; skip_lens [B] int32, the keys of request b that its chunk covers (0
    outside every chunk); ``num_splits``: the prefix kernel's splits per chunk (set by the
    caller, ``decode_num_splits`` over C chunks); ``saved_keys``: key reads saved per kv
    head and layer (sum over chunks of (members - 1) x shared keys)."""

    chunk_rows: torch.Tensor
    chunk_keys: torch.Tensor
    skip_lens: torch.Tensor
    saved_keys: int
    num_splits: int = 1

    def to(self, device: torch.device | str, num_splits: int) -> SharedPrefixes:
        """The plan on ``device`` (one pinned host-to-device copy on CUDA, no host wait),
        with the prefix kernel's split count."""
        device = torch.device(device)
        rows, c = self.chunk_rows, self.chunk_rows.shape[0]
        flat = torch.cat([rows.reshape(-1), self.chunk_keys, self.skip_lens])
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        n = rows.numel()
        return SharedPrefixes(flat[:n].view(c, rows.shape[1]), flat[n:n + c], flat[n + c:],
                              self.saved_keys, num_splits)


def plan_shared_prefixes(page_table: np.ndarray, seq_lens: np.ndarray, page_size: int, group: int,
                         min_shared_pages: int = 4) -> SharedPrefixes | None:
    """Chunks of decode requests that share a prefix of pages (the radix cache hands every
    request matching a cached prefix the same pages), for cascade decode: each chunk's
    shared keys are read once, for all its members' queries (FlashInfer's cascade /
    Hydragen's shared-prefix batching: Ye et al. 2024, Juravsky et al. 2024).

    ``page_table`` [B, Pmax] int32 host array (rows padded with page 0), ``seq_lens`` [B]
    keys per request (the new token's included), ``group`` = G query heads per kv head.
    Requests are grouped by their page at index ``min_shared_pages - 1`` (not the first: a
    chat template's opening page is common to every conversation, so a group by the first
    page would put unrelated prompts together); within a group each one's shared pages are
    the leading pages equal to those of the group's longest request, counting only pages
    wholly before its last key; requests sharing fewer than ``min_shared_pages`` stay out.
    A group is cut into balanced chunks of at most ``PREFIX_ROWS // next_power_of_2(G)``
    members, the longest-sharing together, and a chunk shares its members' least. Returns
    the plan on the host (tensors from numpy), or None when no chunk has two members.
    Vectorised: ~0.1-1 ms for a few hundred requests."""
    table = np.asarray(page_table)
    lens = np.asarray(seq_lens, dtype=np.int64)
    batch, width = table.shape
    members = max(1, PREFIX_ROWS // triton.next_power_of_2(group))
    full = np.minimum((lens - 1) // page_size, width)  # pages wholly before each last key
    cand = np.flatnonzero(full >= min_shared_pages)
    if len(cand) < 2:
        return None
    key = min_shared_pages - 1
    order = cand[np.lexsort((-full[cand], table[cand, key]))]  # by the key page, longest first
    first = table[order, key]
    starts = np.r_[True, first[1:] != first[:-1]]
    leader = order[np.flatnonzero(starts)[np.cumsum(starts) - 1]]
    most = int(full[order].max())
    eq = table[order, :most] == table[leader, :most]
    common = np.where(eq.all(1), most, eq.argmin(1))
    common = np.minimum(common, np.minimum(full[order], full[leader]))
    keep = common >= min_shared_pages
    rows, common, grp = order[keep], common[keep], (np.cumsum(starts) - 1)[keep]
    if len(rows) < 2:
        return None
    o = np.lexsort((-common, grp))  # by group, most shared first
    rows, common, grp = rows[o], common[o], grp[o]
    g_start = np.r_[True, grp[1:] != grp[:-1]]
    g_first = np.flatnonzero(g_start)
    g_size = np.diff(np.r_[g_first, len(rows)])
    gi = np.cumsum(g_start) - 1
    rank = np.arange(len(rows)) - g_first[gi]
    n_chunks = -(-g_size // members)
    local = rank * n_chunks[gi] // g_size[gi]  # balanced: sizes differ by at most one
    c_start = g_start | np.r_[False, local[1:] != local[:-1]]
    chunk = np.cumsum(c_start) - 1
    c_first = np.flatnonzero(c_start)
    c_size = np.diff(np.r_[c_first, len(rows)])
    c_pages = np.minimum.reduceat(common, c_first)
    good = c_size >= 2
    if not good.any():
        return None
    renum = np.cumsum(good) - 1
    in_good = good[chunk]
    rows, chunk, pos = rows[in_good], renum[chunk[in_good]], (np.arange(len(chunk)) - c_first[chunk])[in_good]
    c_keys = (c_pages[good] * page_size).astype(np.int32)
    chunk_rows = np.full((int(good.sum()), members), -1, dtype=np.int32)
    chunk_rows[chunk, pos] = rows
    skip = np.zeros(batch, dtype=np.int32)
    skip[rows] = c_keys[chunk]
    saved = int(((c_size[good] - 1) * c_keys).sum())
    return SharedPrefixes(torch.from_numpy(chunk_rows), torch.from_numpy(c_keys), torch.from_numpy(skip), saved)


def shared_prefix_bound(page_tables: list[list[int]], page_size: int, min_shared_pages: int = 4) -> int:
    """An upper bound on ``plan_shared_prefixes(..., min_shared_pages).saved_keys`` for decode
    requests with these page tables (each covering its sequence): per page at index
    ``min_shared_pages - 1``, the sum of its tables' pages - 1 less the largest, times
    ``page_size`` (a chunk of m members sharing k pages saves (m - 1) k, and every member
    has at least k pages before its last). A dict pass."""
    key = min_shared_pages - 1
    groups: dict[int, list[int]] = {}
    for pages in page_tables:
        if len(pages) > min_shared_pages:
            n = len(pages) - 1
            seen = groups.get(pages[key])
            if seen is None:
                groups[pages[key]] = [n, n]
            else:
                seen[0] += n
                seen[1] = max(seen[1], n)
    return sum(total - most for total, most in groups.values()) * page_size


@triton.jit
def _sink_start(q, m_i, l_i, acc, SinkK, SinkV, SinkSlots, b, kv_head, num_kv_heads, holds_key_0,
                qk_scale_log2, HEAD_DIM: tl.constexpr):
    """Exact attention sink (``KVPool`` doc): when request ``b`` has a sink slot, the online
    softmax of the program holding key 0 starts from that key's exact score and value
    (slots [C, K, D] float32 in the pages' units) instead of its FP8 page. ``q`` [rows, D];
    ``qk_scale_log2`` the factor from q . k to the log2-domain score (1.0 when q carries
    it). Returns (m_i, l_i, acc, lo): the tiles mask keys < lo (1 with a slot, else 0)."""
    slot = tl.load(SinkSlots + b)
    lo = (slot >= 0).to(tl.int32)
    on = (slot >= 0) & holds_key_0
    dims = tl.arange(0, HEAD_DIM)
    base = (tl.maximum(slot, 0).to(tl.int64) * num_kv_heads + kv_head) * HEAD_DIM
    k0 = tl.load(SinkK + base + dims)  # [D]
    v0 = tl.load(SinkV + base + dims)
    s0 = tl.sum(q.to(tl.float32) * k0[None, :], 1) * qk_scale_log2  # [rows], log2 domain
    m_i = tl.where(on, s0, m_i)
    l_i = tl.where(on, 1.0, l_i)
    acc = acc + tl.where(on, v0, 0.0)[None, :]
    return m_i, l_i, acc, lo


# The split count, the page-table width and the alignment of the batch's vectors (a mixed
# step's slices; the placeholders passed for absent scales and sinks) vary from step to step:
# unspecialised (kernels/launch.py), one binary that warm_up_decode_path compiles at start-up
# instead of a JIT of seconds in the middle of serving.
@jit_unspecialised("num_splits", "num_slots", "stride_ptb", "PageTable", "SeqLens", "SkipLens", "KScale", "VScale",
                   "VMean", "SinkK", "SinkV", "SinkSlots")
def _decode_split_kernel(
    Q, KPool, VPool, PageTable, SeqLens, SkipLens, Out, PartOut, PartLse, KScale, VScale, VMean,
    SinkK, SinkV, SinkSlots,
    qk_scale_log2, num_splits, num_slots,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kk, stride_vp, stride_vs, stride_vk,
    stride_ptb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, F16_DOT: tl.constexpr,
    CENTER: tl.constexpr, PAGES_AHEAD: tl.constexpr, SAME_STRIDES: tl.constexpr,
    HAS_SINK: tl.constexpr, V_CHANNEL_MAJOR: tl.constexpr, VSTEP: tl.constexpr, HAS_SKIP: tl.constexpr,
):  # fmt: skip
    """Grid (B, K, N). HAS_SKIP (cascade, ``SharedPrefixes``): request b's keys below
    ``SkipLens[b]`` are the prefix kernel's; the N splits cover the rest, and the partials
    are ``num_slots`` per (request, head) row (the prefix kernel's after the N here; a
    request outside every chunk marks those empty)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if QUANT == 1:  # FP8 pages: the K scale joins the softmax scale, V's scales the output
        qk_scale_log2 = qk_scale_log2 * tl.load(KScale + kv_head)
    seq_len = tl.load(SeqLens + b)
    begin = 0
    if HAS_SKIP:
        begin = tl.load(SkipLens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len - begin, num_splits), BLOCK_N) * BLOCK_N
    start = begin + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)  # [Hb] query heads of this kv head (padded)
    dims = tl.arange(0, HEAD_DIM)  # [D]
    heads = kv_head * GROUP + rows
    head_mask = rows < GROUP
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None],
        other=0.0,
    )  # [Hb, D]
    if F16_DOT:  # FP8 pages, fp16 dots (DecodeConfig.fp8_compute)
        q = _fp16_operand(q)
    page_row = PageTable + b * stride_ptb
    k_base = KPool + kv_head * stride_kk
    v_base = VPool + kv_head * stride_vk

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    if HAS_SINK:  # exact attention sink: key 0 from its slot, masked in the tiles
        m_i, l_i, acc, lo = _sink_start(q, m_i, l_i, acc, SinkK, SinkV, SinkSlots, b, kv_head,
                                        tl.num_programs(1), split == 0, qk_scale_log2, HEAD_DIM)  # fmt: skip
    if PAGES_AHEAD:  # page-table entries and K/V offsets one tile ahead: only the K/V loads wait in a tile
        keys = start + tl.arange(0, BLOCK_N)
        page = tl.load(page_row + keys // PAGE_SIZE, mask=keys < end, other=0).to(tl.int64)
        k_off_next = page * stride_kp + (keys % PAGE_SIZE) * stride_ks
        v_off_next = page * stride_vp + (keys % PAGE_SIZE) * stride_vs
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)  # [Nb]
        valid = keys < end
        if HAS_SINK:
            valid = valid & (keys >= lo)
        if PAGES_AHEAD:
            k_off = k_off_next
            ahead = keys + BLOCK_N
            page = tl.load(page_row + ahead // PAGE_SIZE, mask=ahead < end, other=0).to(tl.int64)
            k_off_next = page * stride_kp + (ahead % PAGE_SIZE) * stride_ks
            if SAME_STRIDES or V_CHANNEL_MAJOR:  # one offset vector for both pools (fewer live registers)
                v_off = k_off
            else:
                v_off = v_off_next
                v_off_next = page * stride_vp + (ahead % PAGE_SIZE) * stride_vs
        else:
            page = tl.load(page_row + keys // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            k_off = page * stride_kp + (keys % PAGE_SIZE) * stride_ks  # [Nb]
            v_off = page * stride_vp + (keys % PAGE_SIZE) * stride_vs
        k = tl.load(k_base + k_off[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if QUANT == 1:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [Hb, Nb]
        s = s * qk_scale_log2  # log2 domain
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [Hb, Nb]
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_CHANNEL_MAJOR:
            v = _channel_major_v(v_base, page_row, n0, end, stride_vp, BLOCK_N, HEAD_DIM, PAGE_SIZE, VSTEP)
        else:
            v = tl.load(v_base + v_off[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if QUANT == 1:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if QUANT == 1:
        out = out * tl.load(VScale + kv_head)
    if DIRECT:
        if CENTER:  # centred values: + the kv head's channel means (the merge adds them otherwise)
            out = out + tl.load(VMean + kv_head * HEAD_DIM + dims)[None, :]
        o_ptr = Out + b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=head_mask[:, None])
    else:
        # PartOut [B, H, num_slots, D] and PartLse [B, H, num_slots], contiguous.
        row = (b * GROUP * tl.num_programs(1) + heads) * num_slots + split  # [Hb]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        # An empty split (past a short sequence: graphs size N for the longest) writes only
        # its lse of -inf; the merge does not read its PartOut row.
        tl.store(PartOut + row[:, None] * HEAD_DIM + dims[None, :], out, mask=(head_mask & nonempty)[:, None])
        tl.store(PartLse + row, lse, mask=head_mask)
        if HAS_SKIP:
            if (split == 0) & (begin == 0):  # in no chunk: the prefix kernel's slots are empty
                for extra in range(num_splits, num_slots):
                    tl.store(PartLse + row - split + extra, float("-inf"), mask=head_mask)


# Cascade decode (shared prefixes): the chunk count and the batch's vectors vary per step.
@jit_unspecialised("num_splits", "num_slots", "first_slot", "stride_ptb", "PageTable", "ChunkRows", "ChunkKeys")
def _decode_prefix_kernel(
    Q, KPool, VPool, PageTable, ChunkRows, ChunkKeys, PartOut, PartLse,
    qk_scale_log2, num_splits, num_slots, first_slot,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kk, stride_vp, stride_vs, stride_vk,
    stride_ptb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (C, K, N): program (chunk c, kv head, split) attends the queries of up to
    MEMBERS requests (``ChunkRows[c]``, -1 padded) x their GROUP query heads, one
    [MEMBERS * GROUP_PAD, D] tile, over the ``ChunkKeys[c]`` keys their page tables share
    (read from the first member's row): each K/V tile is loaded once for the whole chunk.
    Writes normalised partials and log2-sum-exps into slot ``first_slot + split`` of
    PartOut [B, H, num_slots, D] / PartLse [B, H, num_slots]."""
    c = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    shared = tl.load(ChunkKeys + c)
    split_len = tl.cdiv(tl.cdiv(shared, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, shared)

    r = tl.arange(0, MEMBERS * GROUP_PAD)  # [M] rows: member r // GROUP_PAD, head r % GROUP_PAD
    g = r % GROUP_PAD
    b = tl.load(ChunkRows + c * MEMBERS + r // GROUP_PAD)  # [M]
    row_mask = (b >= 0) & (g < GROUP)
    b = tl.maximum(b, 0).to(tl.int64)
    heads = kv_head * GROUP + g
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b[:, None] * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)  # [M, D]
    page_row = PageTable + tl.load(ChunkRows + c * MEMBERS).to(tl.int64) * stride_ptb
    k_base = KPool + kv_head * stride_kk
    v_base = VPool + kv_head * stride_vk

    m_i = tl.full([MEMBERS * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([MEMBERS * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([MEMBERS * GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)  # [Nb]
        valid = keys < end
        page = tl.load(page_row + keys // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        k = tl.load(k_base + (page * stride_kp + (keys % PAGE_SIZE) * stride_ks)[:, None] + dims[None, :],
                    mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [M, Nb], log2 domain
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (page * stride_vp + (keys % PAGE_SIZE) * stride_vs)[:, None] + dims[None, :],
                    mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    row = (b * GROUP * tl.num_programs(1) + heads) * num_slots + first_slot + split  # [M]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(PartOut + row[:, None] * HEAD_DIM + dims[None, :], out, mask=(row_mask & nonempty)[:, None])
    tl.store(PartLse + row, lse, mask=row_mask)


@jit_unspecialised("num_splits", "stride_ptb", "PageTable", "SeqLens", "KScale", "VScale", "VMean")
def _decode_tiered_kernel(
    Q, KPool, VPool, PageTable, SeqLens, Out, PartOut, PartLse, KScale, VScale, VMean,
    FSlot, KCodes, KStat, VCodes, VStat,
    qk_scale_log2, num_splits,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kk, stride_vp, stride_vs, stride_vk,
    stride_ptb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_KV_HEADS: tl.constexpr, VGROUP: tl.constexpr,
    ALIGNED: tl.constexpr, STEP: tl.constexpr, CENTER: tl.constexpr,
):  # fmt: skip
    """``_decode_split_kernel`` over a tiered pool (same grid, outputs and splits). The
    head dim is handled as two halves, channels 2j and 2j+1 (j < D/2): q, the K/V tiles
    and the accumulator are [., D/2] pairs, so INT4 bytes unpack into their two nibbles
    without an interleave (q . k = q_lo . k_lo + q_hi . k_hi; p @ v = [p @ v_lo, p @ v_hi]).
    Per tile, one update per kind of page it holds (``_tiered_kv`` KIND 4 / 8, dequantised
    in float32 and rounded to q's dtype for the dots)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    k_scale8 = tl.load(KScale + kv_head)
    v_scale8 = tl.load(VScale + kv_head)
    seq_len = tl.load(SeqLens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)  # [Hb] query heads of this kv head (padded)
    half = tl.arange(0, HEAD_DIM // 2)  # [D/2]
    heads = kv_head * GROUP + rows
    head_mask = rows < GROUP
    q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + 2 * half[None, :]
    q_lo = tl.load(q_ptr, mask=head_mask[:, None], other=0.0)  # [Hb, D/2] channels 2j
    q_hi = tl.load(q_ptr + 1, mask=head_mask[:, None], other=0.0)  # channels 2j+1
    page_row = PageTable + b * stride_ptb
    k_base = KPool + kv_head * stride_kk
    v_base = VPool + kv_head * stride_vk

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_H, HEAD_DIM // 2], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HEAD_DIM // 2], dtype=tl.float32)
    # The tiles' pages and FP8 slots are loaded ahead: pages two tiles, slots one tile.
    pages = _tile_pages(page_row, start, end, BLOCK_N, PAGE_SIZE, STEP)
    fslot = _tile_slots(FSlot, pages, start, end, BLOCK_N, STEP)
    pages_next = _tile_pages(page_row, start + BLOCK_N, end, BLOCK_N, PAGE_SIZE, STEP)
    for n0 in range(start, end, BLOCK_N):
        fslot_next = _tile_slots(FSlot, pages_next, n0 + BLOCK_N, end, BLOCK_N, STEP)
        pages_after = _tile_pages(page_row, n0 + 2 * BLOCK_N, end, BLOCK_N, PAGE_SIZE, STEP)
        keys = n0 + tl.arange(0, BLOCK_N)  # [Nb]
        valid = keys < end
        # One branch per kind present (uniform per program): a tile across a boundary between
        # FP8 and INT4 pages is two updates, one per kind, each with the lean loads.
        tally = _tile_tally(fslot)
        kind4, kind8 = _tile_kinds(page_row, FSlot, keys, valid, tally, PAGE_SIZE)
        if tally % 65536 != 0:  # INT4 keys (the common case: every key of the tile)
            k_lo, k_hi, v_lo, v_hi = _tiered_kv(
                k_base, v_base, stride_kp, stride_ks, stride_vp, stride_vs,
                KCodes, KStat, VCodes, VStat, pages, fslot, n0, end, kv_head, k_scale8, v_scale8, q_lo,
                BLOCK_N, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, VGROUP, ALIGNED, STEP, 4,
            )  # fmt: skip
            acc_lo, acc_hi, m_i, l_i = _decode_tiered_update(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_lo, k_hi,
                                                             v_lo, v_hi, kind4, qk_scale_log2,
                                                             DOT_PRECISION)  # fmt: skip
        if tally >= 65536:  # FP8 keys (sink and recent pages)
            k_lo, k_hi, v_lo, v_hi = _tiered_kv(
                k_base, v_base, stride_kp, stride_ks, stride_vp, stride_vs,
                KCodes, KStat, VCodes, VStat, pages, fslot, n0, end, kv_head, k_scale8, v_scale8, q_lo,
                BLOCK_N, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, VGROUP, ALIGNED, STEP, 8,
            )  # fmt: skip
            acc_lo, acc_hi, m_i, l_i = _decode_tiered_update(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, k_lo, k_hi,
                                                             v_lo, v_hi, kind8, qk_scale_log2,
                                                             DOT_PRECISION)  # fmt: skip
        pages, fslot, pages_next = pages_next, fslot_next, pages_after

    nonempty = l_i > 0.0
    inv_l = 1.0 / tl.where(nonempty, l_i, 1.0)
    out_lo = acc_lo * inv_l[:, None]
    out_hi = acc_hi * inv_l[:, None]
    if DIRECT:
        if CENTER:  # centred values: + the kv head's channel means
            out_lo = out_lo + tl.load(VMean + kv_head * HEAD_DIM + 2 * half)[None, :]
            out_hi = out_hi + tl.load(VMean + kv_head * HEAD_DIM + 2 * half + 1)[None, :]
        o_ptr = Out + b * stride_ob + heads[:, None] * stride_oh + 2 * half[None, :]
        tl.store(o_ptr, out_lo.to(Out.dtype.element_ty), mask=head_mask[:, None])
        tl.store(o_ptr + 1, out_hi.to(Out.dtype.element_ty), mask=head_mask[:, None])
    else:
        # PartOut [B, H, N, D] and PartLse [B, H, N], contiguous.
        row = (b * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [Hb]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        part_ptr = PartOut + row[:, None] * HEAD_DIM + 2 * half[None, :]
        tl.store(part_ptr, out_lo, mask=head_mask[:, None])
        tl.store(part_ptr + 1, out_hi, mask=head_mask[:, None])
        tl.store(PartLse + row, lse, mask=head_mask)


@jit_unspecialised("num_splits", "VMean")
def _decode_merge_kernel(
    PartOut, PartLse, Out, VMean, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, GROUP: tl.constexpr, CENTER: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)  # [Nb]
    dims = tl.arange(0, HEAD_DIM)  # [D]
    smask = splits < num_splits
    row = (b * tl.num_programs(1) + h) * num_splits + splits  # [Nb]
    lse = tl.load(PartLse + row, mask=smask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # empty splits: 2^-inf = 0
    part_ptr = PartOut + row[:, None] * HEAD_DIM + dims[None, :]
    part = tl.load(part_ptr, mask=(smask & (lse > float("-inf")))[:, None], other=0.0)  # [Nb, D]; empty splits unread
    out = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)  # [D]
    if CENTER:  # centred values: + the channel means of the head's kv head
        out = out + tl.load(VMean + (h // GROUP) * HEAD_DIM + dims)
    tl.store(Out + b * stride_ob + h * stride_oh + dims, out.to(Out.dtype.element_ty))


def decode_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    device: torch.device | str | int,
    config: DecodeConfig | None = None,
) -> int:
    """Splits per request N: the most programs (B * K * N) that still run as one wave of
    ``programs_per_sm`` per SM (rounded down: a second, partial wave of equal-length
    programs costs more than fewer, longer splits), but no split shorter than
    ``min_split_keys``. ``device`` may also be an SM count (int).

    Measured on an H200 (132 SMs, block_n 64, 4 warps, 2 stages;
    4a7db11:bench/KERNELS.md): batch 32 x 8K keys takes 258 us with N = 2
    (512 programs) but 336 us with N = 3 (768).
    """
    config = config or DecodeConfig()
    num_sms = device if isinstance(device, int) else _num_sms(torch.device(device))
    wanted = config.programs_per_sm * num_sms // max(batch * num_kv_heads, 1)
    most = math.ceil(max_seq_len / max(config.min_split_keys, config.block_n))
    return max(1, min(wanted, most, 256))


def _merge_warps(head_dim: int, num_splits: int) -> int:
    return 4 if head_dim * num_splits >= 4096 else 2


def merge_variants(most: int, head_dim: int) -> list[int]:
    """The smallest split count N of each merge-kernel binary among N = 2 .. ``most``: one
    binary per (next_power_of_2(N), warps), ``num_splits`` itself being unspecialised.
    Example: ``merge_variants(40, 128)`` is [2, 3, 5, 9, 17, 32, 33] (N 32 is where 4 warps
    start, N 33 where BLOCK_S becomes 64)."""
    seen: dict[tuple[int, int], int] = {}
    for n in range(2, most + 1):
        seen.setdefault((triton.next_power_of_2(n), _merge_warps(head_dim, n)), n)
    return sorted(seen.values())


def warm_up_decode_path(k_pool: torch.Tensor, num_heads: int, q_dtype: torch.dtype, max_seq_len: int,
                        cascade: bool = False) -> list[int]:
    """Compile the eager decode path of a float pool ([P, S, K, D], the model's dtype)
    before serving. A mixed step (decodes beside prefill chunks, ``TritonAttentionBackend``)
    runs ``decode_attention`` eagerly with the split count ``decode_num_splits`` gives its
    decodes, anywhere from 1 to its batch-1 value: without this, the first step with a new
    merge binary pays Triton's JIT (seconds) in the ITL of every running request.

    Runs one decode of one key over page 0 (results discarded; no pool slot written) with
    N = 1 (the direct kernel) and each N of ``merge_variants`` up to the batch-1 split count
    for ``max_seq_len`` keys. ``cascade``: also cascade decode (``shared=``) of two requests
    sharing page 0, with merges of up to twice that many slots (suffix and prefix splits).
    Returns the slot counts run.
    """
    device = k_pool.device
    page_size, num_kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    most = decode_num_splits(1, num_kv_heads, max_seq_len, device)
    splits = [1, *merge_variants(most, head_dim)]
    q = torch.zeros(1, num_heads, head_dim, dtype=q_dtype, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    for n in splits:
        decode_attention(q, k_pool, k_pool, table, seq_lens, head_dim**-0.5, num_splits=n)
    if cascade:
        q2 = torch.zeros(2, num_heads, head_dim, dtype=q_dtype, device=device)
        table2 = np.zeros((2, 2), dtype=np.int32)
        lens2 = np.full(2, page_size + 1)
        plan = plan_shared_prefixes(table2, lens2, page_size, num_heads // num_kv_heads, min_shared_pages=1)
        table2_d = torch.zeros(2, 2, dtype=torch.int32, device=device)
        lens2_d = torch.full((2,), page_size + 1, dtype=torch.int32, device=device)
        cascade_slots = merge_variants(2 * most, head_dim)
        for n in cascade_slots:  # n - 1 suffix splits + 1 prefix split
            decode_attention(q2, k_pool, k_pool, table2_d, lens2_d, head_dim**-0.5, num_splits=n - 1,
                             shared=plan.to(device, 1))  # fmt: skip
        splits += [-n for n in cascade_slots]
    return splits


def _f16_dot(q_dtype: torch.dtype, k_scale: torch.Tensor | None, fp8_compute: str) -> bool:
    """Whether a kernel over FP8 pages runs its dots in fp16 (``fp8_compute`` "fp16" and
    16-bit queries; float32 queries keep float32 dots)."""
    assert fp8_compute in ("fp16", "q"), fp8_compute
    return k_scale is not None and fp8_compute == "fp16" and q_dtype != torch.float32


@triton.jit
def _fp16_operand(x):
    """``x`` clamped to +-65504 and rounded to fp16 (an operand of the fp16 dots over FP8
    pages: e4m3 -> f16 is one hardware convert per two values on sm_89+)."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 pools (tests) get exact IEEE dots; fp16/bf16 ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: any small number keeps the split path exercised


def _check_inputs(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    assert q.dim() == 3 and q.stride(-1) == 1, (q.shape, q.stride())
    assert k_pool.dim() == 4 and k_pool.shape == v_pool.shape, (k_pool.shape, v_pool.shape)
    assert k_pool.stride(-1) == 1, "k pool: last dim contiguous"
    assert v_pool.stride(-1) == 1 or channel_major(v_pool), "v pool: last dim contiguous, or channel-major FP8"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert k_pool.dtype == v_pool.dtype, (k_pool.dtype, v_pool.dtype)
    assert k_pool.dtype in (q.dtype, torch.float8_e4m3fn), (q.dtype, k_pool.dtype)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    assert k_pool.shape[3] == head_dim, (k_pool.shape, q.shape)
    assert num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64, (
        num_heads,
        num_kv_heads,
    )
    assert head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256, head_dim
    assert page_table.dim() == 2 and page_table.shape[0] == batch, (page_table.shape, batch)
    assert page_table.dtype == torch.int32 and page_table.stride(1) == 1, page_table.dtype
    assert seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32, seq_lens.dtype
    assert seq_lens.is_contiguous()
    assert q.device == k_pool.device == page_table.device == seq_lens.device


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    config: DecodeConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiered: TieredPages | None = None,
    v_mean: torch.Tensor | None = None,
    sink: Sink | None = None,
    shared: SharedPrefixes | None = None,
) -> torch.Tensor:
    """Paged decode attention: q [B, H, D] over each request's ``seq_lens[b]`` keys -> [B, H, D].

    Args:
        q: [B, H, D] one query token per request (fp16/bf16/fp32, same dtype as float
            pools; any of them with FP8 pools).
        k_pool, v_pool: [P, S, K, D] pools of one layer, already holding the new tokens.
        page_table: [B, Pmax] int32 page ids; must cover ``seq_lens[b]`` tokens.
        seq_lens: [B] int32 keys per request (>= 1).
        scale: softmax scale, usually D ** -0.5.
        num_splits: splits per request N; default ``decode_num_splits`` on the bound
            Pmax * S (no device sync).
        out: optional [B, H, D] output buffer (q's dtype, last dim contiguous).
        workspace: optional scratch for N > 1, exactly ``DecodeWorkspace.allocate(B, H, N, D)``
            (allocated per call when omitted).
        config: launch parameters (block size, warps, stages, split heuristic); default
            ``default_decode_config`` (``DecodeConfig()``, ``FP8_DECODE_CONFIG`` /
            ``FP8_LARGE_BATCH_DECODE_CONFIG`` by batch size for FP8 pools,
            ``TIERED_DECODE_CONFIG`` with ``tiered``; block_n >= 16 there).
        k_scale, v_scale: [K] float32 per-kv-head scales, required for (and only for)
            float8_e4m3fn pools (value = stored * scale).
        tiered: int4 / mixed pools: the INT4 pages and the page -> FP8 slot map
            (``TieredPages``); ``k_pool``/``v_pool`` are then the [F, S, K, D] FP8 slots
            and the page table holds logical pages. Each key is read from its page's FP8
            slot or dequantised from INT4 in registers (``_decode_tiered_kernel``; D >= 32).
        v_mean: [K, D] float32 contiguous channel means of an FP8 pool that stores centred
            values (``radixlm.runtime.executor.kv_calibration``): added to the output in the
            epilogue (the attention weights sum to one), or None.
        sink: exact attention sink of an FP8 pool (``radixlm.kernels.reference.Sink``:
            [C, K, D] float32 contiguous slots, [B] int32 slot per request, -1 none); not
            with ``tiered``.
        shared: cascade decode (``plan_shared_prefixes``, on q's device): the keys that
            chunks of requests share are read once per chunk by ``_decode_prefix_kernel``
            (``shared.num_splits`` splits), each member's other keys by the split kernel,
            and the merge combines both. Float pools only (no scales, tiers or sink); the
            workspace then has N + ``shared.num_splits`` slots per row.
    """
    _check_inputs(q, k_pool, v_pool, page_table, seq_lens)
    _check_sink(sink, k_pool, k_scale, q.shape[0])
    assert sink is None or tiered is None, "the exact sink is for FP8 pools, not tiered ones"
    _check_scales(k_pool, k_scale, v_scale)
    if v_mean is not None:
        assert k_scale is not None, "v_mean goes with an FP8 pool"
        assert v_mean.shape == (k_pool.shape[2], q.shape[2]) and v_mean.is_contiguous(), v_mean.shape
        assert v_mean.dtype == torch.float32 and v_mean.device == q.device, v_mean.dtype
    _check_tiered(k_pool, v_pool, tiered)
    config = config or default_decode_config(k_pool.dtype, tiered is not None, q.shape[0])
    assert tiered is None or config.block_n >= 16, config  # the tiered dots need >= 16 keys
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    if num_splits is None:
        bound = page_table.shape[1] * page_size
        num_splits = decode_num_splits(batch, num_kv_heads, bound, q.device, config)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out
    slots = num_splits
    if shared is not None:
        assert k_scale is None and tiered is None and sink is None, "cascade decode: float pools only"
        assert shared.skip_lens.shape == (batch,) and shared.chunk_rows.device == q.device, shared.skip_lens.shape
        slots += shared.num_splits
    if slots == 1:
        part_out = part_lse = out  # unused
    else:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(batch, num_heads, slots, head_dim, q.device)
        part_out, part_lse = workspace.partial_out, workspace.partial_lse
        assert part_out.shape == (batch, num_heads, slots, head_dim), part_out.shape
        assert part_lse.shape == (batch, num_heads, slots) and part_out.is_contiguous()
    _launch(q, k_pool, v_pool, page_table, seq_lens, out, part_out, part_lse, scale,
            num_splits, config, k_scale, v_scale, tiered, v_mean, sink, shared)  # fmt: skip
    return out


def _check_sink(sink: Sink | None, k_pool: torch.Tensor, k_scale: torch.Tensor | None, batch: int) -> None:
    """An exact sink goes with an FP8 pool: float32 contiguous [C, K, D] slots, [B] int32."""
    if sink is None:
        return
    assert k_scale is not None, "an exact sink goes with an FP8 pool"
    shape = (k_pool.shape[2], k_pool.shape[3])
    for t in (sink.k, sink.v):
        assert t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape[1:]) == shape, t.shape
    assert sink.slots.dtype == torch.int32 and tuple(sink.slots.shape) == (batch,), sink.slots.shape


def _check_tiered(k_pool: torch.Tensor, v_pool: torch.Tensor, tiered: TieredPages | None) -> None:
    """A tiered pool's INT4 tensors: contiguous, shapes matching the FP8 slots' [F, S, K, D]
    (row-major V slots)."""
    if tiered is None:
        return
    assert v_pool.stride(-1) == 1, "tiered pools: V slots row-major"
    _, page_size, num_kv_heads, head_dim = k_pool.shape
    assert k_pool.dtype == torch.float8_e4m3fn, k_pool.dtype
    assert head_dim >= 32, head_dim  # the kernels' dots run on halves of the head dim
    num_pages = tiered.fp8_slot.shape[0]
    assert tiered.fp8_slot.dtype == torch.int32, tiered.fp8_slot.dtype
    for codes in (tiered.k_codes, tiered.v_codes):
        assert codes.shape == (num_pages, page_size, num_kv_heads, head_dim // 2), codes.shape
        assert codes.dtype == torch.uint8 and codes.is_contiguous()
    assert tiered.k_stat.shape == (num_pages, 2, num_kv_heads, head_dim), tiered.k_stat.shape
    num_groups = tiered.v_stat.shape[-1]
    assert tiered.v_stat.shape == (num_pages, page_size, num_kv_heads, 2, num_groups)
    assert head_dim % num_groups == 0, (head_dim, num_groups)
    for stat in (tiered.k_stat, tiered.v_stat):
        assert stat.dtype == torch.float16 and stat.is_contiguous()


def _tiled_step(page_size: int, block_n: int) -> tuple[bool, int]:
    """(ALIGNED, STEP) of the tiered kernels: power-of-two page sizes tile by page (STEP =
    min(page_size, block_n) keys per page of a tile); others look every key's page up."""
    aligned = page_size & (page_size - 1) == 0
    return aligned, min(page_size, block_n) if aligned else 1


def _value_group(tiered: TieredPages, head_dim: int) -> int:
    """Channels per value statistic group G (``v_stat`` holds D / G groups)."""
    return head_dim // tiered.v_stat.shape[-1]


def _check_scales(
    k_pool: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """FP8 pools need [K] float32 scales on the pool's device; float pools take none."""
    quant = k_pool.dtype == torch.float8_e4m3fn
    assert quant == (k_scale is not None) == (v_scale is not None), (k_pool.dtype, k_scale is None)
    if quant:
        assert k_scale.shape == v_scale.shape == (k_pool.shape[2],), (k_scale.shape, v_scale.shape)
        assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.device == k_pool.device


def _launch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    scale: float,
    num_splits: int,
    config: DecodeConfig,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiered: TieredPages | None = None,
    v_mean: torch.Tensor | None = None,
    sink: Sink | None = None,
    shared: SharedPrefixes | None = None,
) -> tuple:
    """Launch the split kernel (and the merge kernel when num_splits > 1, and the prefix
    kernel with ``shared``); returns Triton's compiled kernels (registers, shared memory;
    the merge entry is None when skipped)."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = num_heads // num_kv_heads
    slots = num_splits + (0 if shared is None else shared.num_splits)
    direct = slots == 1
    grid = (batch, num_kv_heads, num_splits)
    scales = (seq_lens if k_scale is None else k_scale, seq_lens if v_scale is None else v_scale,
              seq_lens if v_mean is None else v_mean)  # fmt: skip
    strides = (q.stride(0), q.stride(1),
               k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
               v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
               page_table.stride(0), out.stride(0), out.stride(1))  # fmt: skip
    common = dict(
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=config.block_n,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, DIRECT=direct, DOT_PRECISION=_dot_precision(q.dtype),
        CENTER=v_mean is not None, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if config.max_registers is not None:
        common["maxnreg"] = config.max_registers
    if tiered is not None:
        aligned, step = _tiled_step(page_size, config.block_n)
        split = launch(_decode_tiered_kernel, grid,
            q, k_pool, v_pool, page_table, seq_lens, out, part_out, part_lse, *scales, *tiered,
            scale * LOG2E, num_splits, *strides,
            NUM_KV_HEADS=num_kv_heads, VGROUP=_value_group(tiered, head_dim),
            ALIGNED=aligned, STEP=step, **common,
        )  # fmt: skip
    else:
        sink_args = (seq_lens, seq_lens, seq_lens) if sink is None else sink
        split = launch(_decode_split_kernel, grid,
            q, k_pool, v_pool, page_table, seq_lens, seq_lens if shared is None else shared.skip_lens,
            out, part_out, part_lse, *scales, *sink_args,
            scale * LOG2E, num_splits, slots, *strides, HAS_SINK=sink is not None,
            V_CHANNEL_MAJOR=channel_major(v_pool), VSTEP=min(page_size, config.block_n),
            QUANT=int(k_scale is not None),
            F16_DOT=_f16_dot(q.dtype, k_scale, config.fp8_compute),
            PAGES_AHEAD=config.pages_ahead, SAME_STRIDES=k_pool.stride() == v_pool.stride(),
            HAS_SKIP=shared is not None, **common,
        )  # fmt: skip
    if shared is not None:
        members = shared.chunk_rows.shape[1]
        launch(_decode_prefix_kernel, (shared.chunk_rows.shape[0], num_kv_heads, shared.num_splits),
            q, k_pool, v_pool, page_table, shared.chunk_rows, shared.chunk_keys, part_out, part_lse,
            scale * LOG2E, shared.num_splits, slots, num_splits, *strides[:9],
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), MEMBERS=members,
            BLOCK_N=PREFIX_CONFIG.block_n, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=PREFIX_CONFIG.num_warps,
            num_stages=PREFIX_CONFIG.num_stages,
        )  # fmt: skip
    merge = None
    if not direct:
        merge = launch(_decode_merge_kernel, (batch, num_heads),
            part_out, part_lse, out, scales[2], slots, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(slots),
            GROUP=group, CENTER=v_mean is not None,
            num_warps=_merge_warps(head_dim, slots),
        )  # fmt: skip
    return split, merge
