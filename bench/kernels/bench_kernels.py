"""Benchmark of the Triton paged attention kernels against PyTorch SDPA (and FlexAttention)
on contiguous KV.

Measures, in one process on one GPU:
  * ceilings: device-to-device copy bandwidth (bytes read + written) and the dense bf16
    matmul rate (8192^3), both on random data;
  * decode: batch {1, 8, 32, 128} x context {512, 2K, 8K, 32K};
  * extend: batch 4, prefix {0, 2K, 8K} x new tokens {128, 512, 2K};
  * with --flex: torch.compile(flex_attention) on a few of those shapes (compile time and
    failures reported);
  * optionally (--sweep) block sizes / warps / stages / split counts on a few shapes;
    (--explore) the launch-variant study of BENCHMARKS.md, "Attention kernels" (tile configs,
    scale modes, query-block order, warp specialisation, and measurement probes of extend_attention
    ``_launch``; decode configs x split counts; the merge kernel alone), one JSON line per
    point in explore.jsonl; (--buckets) both sm_90 extend tile configs on every extend
    shape, the page-table probes and the decode fixed cost.
Rows use the launch parameters the kernels pick themselves (``decode_num_splits``,
``default_extend_config``). Llama-3-8B head shape (32 query heads, 8 kv heads, D 128), bf16,
page size 16, pages at a random permutation of a 17 GB pool (scattered). Triton times are
GPU times: L2 flushed (256 MB write) before each repeat, CUDA graph replay between CUDA
events, warm-up, median; decode rows are also timed after a read-only flush (L2 left
clean). SDPA runs on KV already gathered into contiguous [B, K, L, D]; the gather is timed
separately. Each Triton output is checked against SDPA's (relative error).

Usage (GPU):  python bench/kernels/bench_kernels.py --out $OUT --commit $(git rev-parse --short HEAD) [--flex] [--sweep] [--explore] [--buckets]
Smoke (CPU):  TRITON_INTERPRET=1 python bench/kernels/bench_kernels.py --smoke
Writes kernels_bench.json and kernels_bench.md (and explore.jsonl) under --out
(default bench/results/bench_kernels/).

Dimension letters: B batch, H query heads, K kv heads, G = H // K, D head dim, L keys per
request, E new tokens per request, P pages, S page size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from radixlm.kernels import decode_attention as decode_mod  # noqa: E402
from radixlm.kernels import extend_attention as extend_mod  # noqa: E402
from radixlm.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    decode_attention,
    decode_num_splits,
)
from radixlm.kernels.extend_attention import (  # noqa: E402
    ExtendConfig,
    default_extend_config,
    extend_attention,
)
from radixlm.kernels.store_kv import store_kv  # noqa: E402

KB = 1024


@dataclass
class Setup:
    device: torch.device
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    decode_batches: tuple[int, ...] = (1, 8, 32, 128)
    decode_contexts: tuple[int, ...] = (512, 2 * KB, 8 * KB, 32 * KB)
    extend_batch: int = 4
    extend_prefixes: tuple[int, ...] = (0, 2 * KB, 8 * KB)
    extend_news: tuple[int, ...] = (128, 512, 2 * KB)
    pool_tokens: int = 128 * 32 * KB
    budget_s: float = 0.25  # timed seconds per measurement (upper bound)
    decode_sweep_shapes: tuple[tuple[int, int], ...] = (
        (1, 512), (1, 2 * KB), (8, 32 * KB), (32, 8 * KB), (128, 2 * KB),
    )  # fmt: skip
    extend_sweep_shapes: tuple[tuple[int, int], ...] = (
        (0, 2 * KB),
        (8 * KB, 2 * KB),
        (2 * KB, 512),
    )
    decode_configs: list[DecodeConfig] = field(default_factory=list)
    extend_configs: list[ExtendConfig] = field(default_factory=list)
    split_choices: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # --explore: (shapes, tile configs, knob variants) for extend; (shape, configs, split
    # counts, check shapes) for decode; timed seconds per point
    explore_extend: tuple = ()
    explore_decode: tuple = ()
    explore_budget_s: float = 0.1
    bucket_decode_shapes: tuple[tuple[int, int], ...] = ((32, 128), (32, 2 * KB))  # --buckets
    read_flush: bool = True  # decode rows: also time after a read-only L2 flush
    # FlexAttention (torch.compile) columns, on these shapes only (--flex; compiles per shape).
    flex: bool = False
    flex_decode_shapes: tuple[tuple[int, int], ...] = (
        (1, 8 * KB), (32, 2 * KB), (32, 8 * KB), (128, 2 * KB),
    )  # fmt: skip
    flex_extend_shapes: tuple[tuple[int, int], ...] = (
        (0, 2 * KB),
        (2 * KB, 2 * KB),
        (8 * KB, 2 * KB),
    )

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def gpu_setup() -> Setup:
    s = Setup(torch.device("cuda"))
    s.decode_configs = [
        DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
        for bn in (32, 64, 128)
        for w in (4, 8)
        for st in (2, 3)
    ] + [DecodeConfig(block_n=64, num_warps=4, num_stages=st) for st in (1, 4)]
    s.extend_configs = [
        ExtendConfig(bm, bn, w, st)
        for bm, bn, w, st in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                              (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3),
                              (128, 32, 4, 3))
    ]  # fmt: skip
    s.explore_extend = (
        [(0, 512), (0, 2 * KB), (2 * KB, 2 * KB), (8 * KB, 2 * KB)],
        [ExtendConfig(bm, bn, w, st)
         for bm, bn, w, st in ((128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 4, 2),
                               (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3))],
        EXTEND_VARIANTS,
        [(0, 2 * KB), (8 * KB, 2 * KB)],
    )  # fmt: skip
    s.explore_decode = (
        (32, 2 * KB),
        [DecodeConfig(bn, w, st)
         for bn, w, st in ((64, 4, 2), (64, 4, 3), (32, 4, 2), (128, 4, 2), (128, 8, 3), (64, 8, 2))],
        (1, 2, 3, 4, 6, 8),
        [(32, 8 * KB), (32, 32 * KB), (8, 2 * KB), (16, 2 * KB), (64, 2 * KB), (128, 2 * KB)],
    )  # fmt: skip
    return s


# (tag, ExtendConfig overrides, probe): see ExtendConfig and extend_attention._launch.
EXTEND_VARIANTS = [
    ("fma", {"scale_mode": "fma"}, 0),
    ("q", {"scale_mode": "q"}, 0),
    ("forward", {"reverse_m": False}, 0),
    ("ws", {"warp_specialize": True}, 0),
    ("probe-nomask", {}, 1),
    ("probe-uniform", {}, 2),
]


def smoke_setup() -> Setup:
    """Tiny shapes for a CPU run under the Triton interpreter (checks the script, not speed)."""
    s = Setup(torch.device("cpu"), heads=8, kv_heads=2, head_dim=64, page_size=4)
    s.dtype = torch.float16  # the interpreter's bf16 dot is wrong; fp16 is right
    s.decode_batches, s.decode_contexts = (1, 3), (40, 70)
    s.extend_batch, s.extend_prefixes, s.extend_news = 2, (0, 20), (16, 33)
    s.pool_tokens, s.budget_s = 1024, 0.01
    s.decode_sweep_shapes, s.extend_sweep_shapes = ((3, 70),), ((20, 33),)
    s.decode_configs = [DecodeConfig(block_n=16, num_warps=2, num_stages=1)]
    s.extend_configs = [ExtendConfig(16, 16, 2, 1)]
    s.split_choices = (1, 2)
    s.explore_extend = ([(0, 32), (16, 32)], [ExtendConfig(16, 16, 2, 1), ExtendConfig(32, 16, 2, 1)],
                        EXTEND_VARIANTS, [(0, 32)])  # fmt: skip
    s.explore_decode = ((3, 64), [DecodeConfig(16, 2, 1), DecodeConfig(32, 2, 1)], (1, 2),
                        [(1, 64)])  # fmt: skip
    s.flex_decode_shapes, s.flex_extend_shapes = ((3, 70),), ((20, 33),)
    s.bucket_decode_shapes = ((3, 16), (3, 64))
    return s


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median GPU time of ``fn`` in microseconds (L2 flushed before every repeat).

    With ``graph=True`` (CUDA) ``fn`` is captured once into a CUDA graph and the replays are
    timed, so the Python launch cost (tens of microseconds per Triton launch) cannot leak
    into the GPU time of a short kernel; if capture fails the eager call is timed and
    ``last_mode`` says so.
    """

    def __init__(self, device: torch.device, budget_s: float) -> None:
        self.cuda = device.type == "cuda"
        self.budget_s = budget_s
        self.flush_buf = torch.empty(
            256 * KB * KB if self.cuda else KB, dtype=torch.int8, device=device
        )
        self.last_mode = "eager"
        # "write": zero the 256 MB buffer (L2 left full of dirty lines, written back to HBM
        # while the timed call runs); "read": sum it (L2 left holding clean lines).
        self.flush_mode = "write"

    def _flush(self) -> None:
        if self.flush_mode == "write":
            self.flush_buf.zero_()
        else:
            self.flush_buf.sum(dtype=torch.int32)

    def _capture(self, fn: Callable[[], object]) -> Callable[[], object]:
        self.last_mode = "eager"
        if not self.cuda:
            return fn
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - fall back to eager timing
            print(f"graph capture failed ({type(exc).__name__}: {exc}); timing eager", flush=True)
            torch.cuda.synchronize()
            return fn
        self.last_mode = "graph"
        return graph.replay

    def _once(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        self._flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def median_us(
        self,
        fn: Callable[[], object],
        min_reps: int = 10,
        max_reps: int = 200,
        graph: bool = False,
    ) -> float:
        for _ in range(3):  # warm-up (compilation, autotuning caches, allocator)
            fn()
        fn = self._capture(fn) if graph else fn
        if not graph:
            self.last_mode = "eager"
        estimate = self._once(fn)
        reps = int(min(max_reps, max(min_reps, self.budget_s * 1e6 / max(estimate, 1.0))))
        if not self.cuda:
            return statistics.median(self._once(fn) for _ in range(reps))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            self._flush()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))

    def back_to_back_us(self, fn: Callable[[], object], reps: int = 100) -> float:
        """Mean time per call issued back to back (includes CPU launch cost if it dominates)."""
        for _ in range(3):
            fn()
        if not self.cuda:
            return self._once(fn)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm())


def measure_ceilings(s: Setup, timer: Timer) -> dict[str, float]:
    n = (512 * KB * KB) if s.device.type == "cuda" else KB * KB  # 1 GiB of bf16
    src = torch.randn(n, dtype=torch.bfloat16, device=s.device)
    dst = torch.empty_like(src)
    copy_us = timer.median_us(lambda: dst.copy_(src))
    size = 8192 if s.device.type == "cuda" else 256
    a = torch.randn(size, size, dtype=torch.bfloat16, device=s.device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=s.device)
    mm_us = timer.median_us(lambda: a @ b)
    return {
        "copy_bytes_per_s": 2 * n * 2 / (copy_us * 1e-6),
        "matmul_flop_per_s": 2 * size**3 / (mm_us * 1e-6),
        "copy_us": copy_us,
        "matmul_us": mm_us,
    }


# ----------------------------------------------------------------------------- inputs


class Pool:
    """One [P, S, K, D] K and V pool, random data; hands out scattered page tables."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.num_pages = s.pool_tokens // s.page_size + 1
        shape = (self.num_pages, s.page_size, s.kv_heads, s.head_dim)
        self.k = torch.randn(shape, dtype=s.dtype, device=s.device)
        self.v = torch.randn(shape, dtype=s.dtype, device=s.device)
        self.gen = torch.Generator(device=s.device).manual_seed(0)

    def page_table(self, batch: int, tokens: int) -> torch.Tensor:
        """[B, ceil(tokens / S)] int32, a random selection of distinct pages (never 0)."""
        need = -(-tokens // self.s.page_size)
        assert batch * need < self.num_pages, "pool too small"
        perm = torch.randperm(self.num_pages - 1, generator=self.gen, device=self.s.device)
        return (perm[: batch * need] + 1).view(batch, need).to(torch.int32)

    def gather(self, pool: torch.Tensor, table: torch.Tensor, tokens: int) -> torch.Tensor:
        """Contiguous [B, K, L, D] copy of each request's first ``tokens`` keys."""
        batch = table.shape[0]
        dense = pool[table.long()]  # [B, n, S, K, D]
        dense = dense.view(batch, -1, self.s.kv_heads, self.s.head_dim)[:, :tokens]  # [B, L, K, D]
        return dense.permute(0, 2, 1, 3).contiguous()  # [B, K, L, D]


# ----------------------------------------------------------------------------- decode


def decode_case(s: Setup, pool: Pool, batch: int, ctx: int) -> dict:
    """Inputs of one decode shape: q [B, H, D], table [B, L/S], seq_lens [B]."""
    q = torch.randn(batch, s.heads, s.head_dim, dtype=s.dtype, device=s.device)
    table = pool.page_table(batch, ctx)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=s.device)
    return {"q": q, "table": table, "seq_lens": seq_lens}


def run_decode(
    s: Setup, pool: Pool, c: dict, config: DecodeConfig | None, splits: int | None
) -> Callable:
    scale = s.head_dim**-0.5
    return lambda: decode_attention(
        c["q"], pool.k, pool.v, c["table"], c["seq_lens"], scale, num_splits=splits, config=config
    )


def decode_bytes(s: Setup, batch: int, ctx: int) -> int:
    elem = torch.empty((), dtype=s.dtype).element_size()
    kv = 2 * batch * ctx * s.kv_heads * s.head_dim * elem
    return kv + 2 * batch * s.heads * s.head_dim * elem + batch * (ctx // s.page_size) * 4


def bench_decode_row(s: Setup, pool: Pool, timer: Timer, ceil: dict, batch: int, ctx: int) -> dict:
    c = decode_case(s, pool, batch, ctx)
    splits = decode_num_splits(batch, s.kv_heads, ctx, s.device)
    fn = run_decode(s, pool, c, None, None)  # the defaults decode_attention picks itself
    row = {"batch": batch, "context": ctx, "splits": splits}
    row["triton_us"] = timer.median_us(fn, graph=True)
    row["timing"] = timer.last_mode
    row["triton_back_to_back_us"] = timer.back_to_back_us(fn)
    out = fn()
    nbytes = decode_bytes(s, batch, ctx)
    row["bytes"] = nbytes
    row["triton_bw_frac"] = nbytes / (row["triton_us"] * 1e-6) / ceil["copy_bytes_per_s"]
    # SDPA baselines on contiguous KV [B, K, L, D]; the faster of two forms is the baseline:
    # "gqa" = q [B, H, 1, D] with enable_gqa; "fold" = the G query heads of a kv head as
    # G query rows of one head (q [B, K, G, D]), no mask.
    gather = lambda: (pool.gather(pool.k, c["table"], ctx), pool.gather(pool.v, c["table"], ctx))  # noqa: E731
    row["gather_us"] = timer.median_us(gather)
    k_c, v_c = gather()
    q_fold = c["q"].view(batch, s.kv_heads, s.group, s.head_dim)  # [B, K, G, D]
    q_gqa = c["q"].unsqueeze(2)  # [B, H, 1, D]
    forms = {
        "fold": lambda: F.scaled_dot_product_attention(q_fold, k_c, v_c),
        "gqa": lambda: F.scaled_dot_product_attention(q_gqa, k_c, v_c, enable_gqa=True),
    }
    for name, sdpa in forms.items():
        try:
            row[f"sdpa_{name}_us"] = timer.median_us(sdpa, graph=True)
            row[f"sdpa_{name}_timing"] = timer.last_mode
        except Exception as exc:  # noqa: BLE001 - a baseline form may be unsupported
            row[f"sdpa_{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    best = min((n for n in forms if f"sdpa_{n}_us" in row), key=lambda n: row[f"sdpa_{n}_us"])
    row["sdpa_form"], row["sdpa_us"] = best, row[f"sdpa_{best}_us"]
    row["sdpa_timing"] = row[f"sdpa_{best}_timing"]
    row["sdpa_back_to_back_us"] = timer.back_to_back_us(forms[best])
    row["sdpa_bw_frac"] = nbytes / (row["sdpa_us"] * 1e-6) / ceil["copy_bytes_per_s"]
    if s.read_flush:  # the same two calls after a read-only L2 flush (no dirty lines)
        timer.flush_mode = "read"
        try:
            row["triton_us_rf"] = timer.median_us(fn, graph=True)
            row["sdpa_us_rf"] = timer.median_us(forms[best], graph=True)
        finally:
            timer.flush_mode = "write"
    ref = forms["fold"]().reshape(batch, s.heads, s.head_dim)  # [B, K, G, D] -> [B, H, D]
    row["rel_err_vs_sdpa"] = rel_err(out, ref)
    if s.flex and (batch, ctx) in s.flex_decode_shapes:
        flex_decode(s, timer, row, c["q"], k_c, v_c, ref, ceil)
    return row


def sweep_decode(s: Setup, pool: Pool, timer: Timer) -> list[dict]:
    rows = []
    for batch, ctx in s.decode_sweep_shapes:
        c = decode_case(s, pool, batch, ctx)
        default_splits = decode_num_splits(batch, s.kv_heads, ctx, s.device)
        for cfg in s.decode_configs:
            rows.append(_sweep_point(timer, run_decode(s, pool, c, cfg, default_splits),
                                     {"batch": batch, "context": ctx, "splits": default_splits,
                                      **asdict(cfg)}))  # fmt: skip
        for splits in s.split_choices:
            if splits * 64 > ctx * 2:
                continue
            rows.append(_sweep_point(timer, run_decode(s, pool, c, DecodeConfig(), splits),
                                     {"batch": batch, "context": ctx, "splits": splits,
                                      **asdict(DecodeConfig()), "split_sweep": True}))  # fmt: skip
    return rows


def _sweep_point(timer: Timer, fn: Callable, info: dict) -> dict:
    try:
        info["us"] = timer.median_us(fn, min_reps=5, max_reps=30, graph=True)
        info["timing"] = timer.last_mode
    except Exception as exc:  # noqa: BLE001 - a config may not fit (shared memory) or compile
        info["error"] = f"{type(exc).__name__}: {exc}"[:300]
    print("sweep", info, flush=True)
    return info


# ----------------------------------------------------------------------------- extend


def extend_case(s: Setup, pool: Pool, prefix: int, new: int) -> dict:
    batch = s.extend_batch
    q = torch.randn(batch * new, s.heads, s.head_dim, dtype=s.dtype, device=s.device)
    table = pool.page_table(batch, prefix + new)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=s.device) * new
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=s.device)
    return {"q": q, "table": table, "cu": cu, "prefix_lens": prefix_lens, "new": new}


def run_extend(s: Setup, pool: Pool, c: dict, config: ExtendConfig | None) -> Callable:
    scale = s.head_dim**-0.5
    return lambda: extend_attention(
        c["q"], pool.k, pool.v, c["table"], c["cu"], c["prefix_lens"], scale, c["new"],
        config=config,
    )  # fmt: skip


def extend_flops(s: Setup, batch: int, prefix: int, new: int) -> int:
    keys = new * prefix + new * (new + 1) // 2  # sum over queries of keys attended
    return 4 * batch * s.heads * s.head_dim * keys


def bench_extend_row(s: Setup, pool: Pool, timer: Timer, ceil: dict, prefix: int, new: int) -> dict:
    batch = s.extend_batch
    c = extend_case(s, pool, prefix, new)
    fn = run_extend(s, pool, c, None)  # the defaults extend_attention picks itself
    cfg = default_extend_config(s.device, new, c["table"].shape[1] * s.page_size)
    row = {"batch": batch, "prefix": prefix, "new": new, "config": asdict(cfg)}
    row["triton_us"] = timer.median_us(fn, graph=True)
    row["timing"] = timer.last_mode
    row["triton_back_to_back_us"] = timer.back_to_back_us(fn)
    out = fn()
    flops = extend_flops(s, batch, prefix, new)
    row["flops"] = flops
    row["triton_mm_frac"] = flops / (row["triton_us"] * 1e-6) / ceil["matmul_flop_per_s"]
    # SDPA on contiguous KV with every query head's K/V (expanded), bottom-right causal.
    seq = prefix + new

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        k_c = pool.gather(pool.k, c["table"], seq).repeat_interleave(s.group, dim=1)  # [B, H, L, D]
        v_c = pool.gather(pool.v, c["table"], seq).repeat_interleave(s.group, dim=1)
        return k_c, v_c

    row["gather_us"] = timer.median_us(gather)
    k_c, v_c = gather()
    q_c = c["q"].view(batch, new, s.heads, s.head_dim).transpose(1, 2).contiguous()  # [B, H, E, D]
    if prefix == 0:
        sdpa = lambda: F.scaled_dot_product_attention(q_c, k_c, v_c, is_causal=True)  # noqa: E731
    else:
        mask = causal_lower_right(new, seq)
        sdpa = lambda: F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=mask)  # noqa: E731
    row["sdpa_us"] = timer.median_us(sdpa, graph=True)
    row["sdpa_timing"] = timer.last_mode
    row["sdpa_mm_frac"] = flops / (row["sdpa_us"] * 1e-6) / ceil["matmul_flop_per_s"]
    ref4 = sdpa()  # [B, H, E, D]
    ref = ref4.transpose(1, 2).reshape(batch * new, s.heads, s.head_dim)
    row["rel_err_vs_sdpa"] = rel_err(out, ref)
    if s.flex and (prefix, new) in s.flex_extend_shapes:
        del k_c, v_c
        k_g = pool.gather(pool.k, c["table"], seq)  # [B, K, L, D], not expanded
        v_g = pool.gather(pool.v, c["table"], seq)
        flex_extend(s, timer, row, q_c, k_g, v_g, ref4, prefix, ceil)
    # store_kv of the new tokens (not part of the attention time above;
    # last, since it overwrites pool slots the check above read).
    slots = c["table"].long()[:, :, None] * s.page_size + torch.arange(s.page_size, device=s.device)
    slots = slots.view(batch, -1)[:, prefix : prefix + new].reshape(-1)  # [T]
    kv_new = torch.randn(batch * new, 2, s.kv_heads, s.head_dim, dtype=s.dtype, device=s.device)
    row["store_kv_us"] = timer.median_us(
        lambda: store_kv(pool.k, pool.v, kv_new[:, 0], kv_new[:, 1], slots), graph=True
    )
    return row


def sweep_extend(s: Setup, pool: Pool, timer: Timer) -> list[dict]:
    rows = []
    for prefix, new in s.extend_sweep_shapes:
        c = extend_case(s, pool, prefix, new)
        flops = extend_flops(s, s.extend_batch, prefix, new)
        for cfg in s.extend_configs:
            info = {"prefix": prefix, "new": new, **asdict(cfg)}
            info = _sweep_point(timer, run_extend(s, pool, c, cfg), info)
            if "us" in info:
                info["tflops"] = flops / info["us"] * 1e-6
            rows.append(info)
    return rows


# ----------------------------------------------------------------------------- explore


EXPLORE_LOG: Path | None = None  # explore.jsonl under --out, one line per point


def _kernel_info(kernel: object) -> dict:
    """Registers, spills and shared memory of a compiled Triton kernel (if exposed)."""
    info = {}
    for key in ("n_regs", "n_spills"):
        if hasattr(kernel, key):
            info[key] = getattr(kernel, key)
    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
    if shared is not None:
        info["shared_bytes"] = shared
    return info


def _explore_point(timer: Timer, fn: Callable, info: dict, log: list, budget_s: float) -> dict:
    saved, timer.budget_s = timer.budget_s, budget_s
    try:
        kernel = fn()
        if isinstance(kernel, tuple):
            kernel = kernel[0]
        info.update(_kernel_info(kernel))
        info["us"] = timer.median_us(fn, min_reps=5, max_reps=100, graph=True)
        info["timing"] = timer.last_mode
    except Exception as exc:  # noqa: BLE001 - a config may not fit or not compile
        info["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        timer.budget_s = saved
    print("explore", info, flush=True)
    log.append(info)
    if EXPLORE_LOG is not None:
        with EXPLORE_LOG.open("a") as f:
            f.write(json.dumps(info) + "\n")
    return info


def explore_extend(s: Setup, pool: Pool, timer: Timer, ceil: dict, log: list,
                   shapes: list[tuple[int, int]], configs: list[ExtendConfig],
                   variants: list[tuple[str, dict, int]],
                   top_shapes: list[tuple[int, int]]) -> None:  # fmt: skip
    """Extend launch variants: phase 1 the tile configs (scale 'mul'), phase 2 the knob
    variants and probes on the configs that were best on ``top_shapes``, phase 3 the best
    scale mode on the other configs."""
    cases = {sh: extend_case(s, pool, *sh) for sh in shapes}
    outs = {sh: torch.empty_like(c["q"]) for sh, c in cases.items()}
    scale = s.head_dim**-0.5

    def point(sh: tuple[int, int], cfg: ExtendConfig, probe: int, tag: str) -> dict:
        c = cases[sh]
        fn = lambda: extend_mod._launch(  # noqa: E731
            c["q"], pool.k, pool.v, c["table"], c["cu"], c["prefix_lens"], outs[sh], scale,
            c["new"], cfg, probe=probe,
        )  # fmt: skip
        info = {"kind": "extend", "tag": tag, "prefix": sh[0], "new": sh[1], "probe": probe,
                **asdict(cfg)}  # fmt: skip
        info = _explore_point(timer, fn, info, log, s.explore_budget_s)
        if "us" in info:
            flops = extend_flops(s, s.extend_batch, *sh)
            info["frac"] = flops / (info["us"] * 1e-6) / ceil["matmul_flop_per_s"]
        return info

    def best(rows: list[dict], sh: tuple[int, int]) -> ExtendConfig:
        ok = [r for r in rows if "us" in r and (r["prefix"], r["new"]) == sh]
        r = min(ok, key=lambda r: r["us"])
        return ExtendConfig(r["block_m"], r["block_n"], r["num_warps"], r["num_stages"],
                            r["reverse_m"], r["scale_mode"], r["warp_specialize"])  # fmt: skip

    phase1 = [point(sh, cfg, 0, "tiles") for cfg in configs for sh in shapes]
    tops = []
    for sh in top_shapes:
        cfg = best(phase1, sh)
        if cfg not in tops:
            tops.append(cfg)
    for cfg in tops:
        for name, knobs, probe in variants:
            vcfg = ExtendConfig(**{**asdict(cfg), **knobs})
            for sh in shapes:
                point(sh, vcfg, probe, name)

    # phase 3: the scale mode with the best geometric-mean gain over 'mul' in phase 2 (if
    # any), on the other tile configs
    def us(cfg: ExtendConfig, sh: tuple[int, int], tag: str) -> float | None:
        for r in log:
            if (
                r.get("tag") == tag
                and "us" in r
                and (r["prefix"], r["new"]) == sh
                and r["block_m"] == cfg.block_m
                and r["block_n"] == cfg.block_n
                and r["num_warps"] == cfg.num_warps
                and r["num_stages"] == cfg.num_stages
            ):
                return r["us"]
        return None

    gains = {}
    for mode in ("fma", "q"):
        ratios = [us(t, sh, mode) / us(t, sh, "tiles") for t in tops for sh in shapes
                  if us(t, sh, mode) and us(t, sh, "tiles")]  # fmt: skip
        if ratios:
            gains[mode] = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    print("scale-mode gains (time ratio vs mul)", gains, flush=True)
    if not gains or min(gains.values()) > 0.99:
        return
    mode = min(gains, key=gains.get)
    for cfg in configs:
        if cfg in tops:
            continue
        for sh in shapes:
            point(sh, ExtendConfig(**{**asdict(cfg), "scale_mode": mode}), 0, "tiles-" + mode)


def explore_decode(s: Setup, pool: Pool, timer: Timer, ceil: dict, log: list,
                   shape: tuple[int, int], configs: list[DecodeConfig],
                   splits: tuple[int, ...], check_shapes: list[tuple[int, int]]) -> None:  # fmt: skip
    """Decode: every (config, split count) on ``shape``; then split counts on the other
    shapes with the best two configs and the default; then the merge kernel alone."""
    scale = s.head_dim**-0.5
    works: dict = {}

    def point(sh: tuple[int, int], cfg: DecodeConfig, n: int, tag: str) -> dict:
        c = cases.setdefault(sh, decode_case(s, pool, *sh))
        if (sh, n) not in works:
            works[(sh, n)] = decode_mod.DecodeWorkspace.allocate(
                sh[0], s.heads, n, s.head_dim, s.device
            )
        w = works[(sh, n)]
        out = torch.empty_like(c["q"])
        fn = lambda: decode_mod._launch(  # noqa: E731
            c["q"], pool.k, pool.v, c["table"], c["seq_lens"], out,
            w.partial_out if n > 1 else out, w.partial_lse if n > 1 else out, scale, n, cfg,
        )  # fmt: skip
        info = {"kind": "decode", "tag": tag, "batch": sh[0], "context": sh[1], "splits": n,
                **asdict(cfg)}  # fmt: skip
        info = _explore_point(timer, fn, info, log, s.explore_budget_s)
        if "us" in info:
            info["frac"] = decode_bytes(s, *sh) / (info["us"] * 1e-6) / ceil["copy_bytes_per_s"]
        return info

    cases: dict = {}
    rows = [point(shape, cfg, n, "grid") for cfg in configs for n in splits]
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    keep = [DecodeConfig()]
    for r in ok:
        cfg = DecodeConfig(r["block_n"], r["num_warps"], r["num_stages"])
        if cfg not in keep:
            keep.append(cfg)
        if len(keep) == 3:
            break
    for sh in check_shapes:
        for cfg in keep:
            for n in splits:
                if n * cfg.block_n <= sh[1]:
                    point(sh, cfg, n, "check")
    # merge kernel alone, on the main shape
    for n in splits:
        if n == 1:
            continue
        w = works.get((shape, n)) or decode_mod.DecodeWorkspace.allocate(
            shape[0], s.heads, n, s.head_dim, s.device
        )
        w.partial_out.normal_()
        w.partial_lse.normal_()
        out = torch.empty(shape[0], s.heads, s.head_dim, dtype=s.dtype, device=s.device)
        fn = lambda w=w, n=n, out=out: decode_mod._decode_merge_kernel[(shape[0], s.heads)](  # noqa: E731
            w.partial_out, w.partial_lse, out, w.partial_lse, n, out.stride(0), out.stride(1),
            HEAD_DIM=s.head_dim, BLOCK_S=triton.next_power_of_2(n), GROUP=1, CENTER=False,
            num_warps=4 if s.head_dim * n >= 4096 else 2,
        )  # fmt: skip
        _explore_point(timer, fn, {"kind": "merge", "batch": shape[0], "splits": n}, log,
                       s.explore_budget_s)  # fmt: skip


def explore(s: Setup, pool: Pool, timer: Timer, ceil: dict, out_dir: Path) -> list[dict]:
    """Measurement-only variant sweep (``--explore``): see explore_extend / explore_decode."""
    global EXPLORE_LOG
    EXPLORE_LOG = out_dir / "explore.jsonl"
    log: list[dict] = []
    t0 = time.time()
    explore_extend(s, pool, timer, ceil, log, *s.explore_extend)
    print(f"explore extend done {time.time() - t0:.0f} s", flush=True)
    explore_decode(s, pool, timer, ceil, log, *s.explore_decode)
    print(f"explore decode done {time.time() - t0:.0f} s", flush=True)
    return log


def explore_buckets(s: Setup, pool: Pool, timer: Timer, ceil: dict, out_dir: Path) -> None:
    """``--buckets``: both Hopper extend configs on every extend row shape (which the default
    rule picks is recorded), the page-table probes, and the decode fixed cost."""
    global EXPLORE_LOG
    EXPLORE_LOG = out_dir / "explore.jsonl"
    log: list[dict] = []
    scale = s.head_dim**-0.5
    configs = {"long": extend_mod.HOPPER_EXTEND_CONFIG, "prefill": extend_mod.HOPPER_PREFILL_CONFIG}
    probe_shapes = [(0, 2 * KB), (8 * KB, 2 * KB)]
    for prefix in s.extend_prefixes:
        for new in s.extend_news:
            c = extend_case(s, pool, prefix, new)
            out = torch.empty_like(c["q"])
            seq_bound = c["table"].shape[1] * s.page_size
            picked = default_extend_config(s.device, new, seq_bound)
            tables = {"scattered": c["table"]}
            if (prefix, new) in probe_shapes:  # request b in pages b * 1024 + 1, + 2, ...
                cols = torch.arange(c["table"].shape[1], device=s.device, dtype=torch.int32)
                rows = torch.arange(s.extend_batch, device=s.device, dtype=torch.int32)
                tables["contiguous"] = rows[:, None] * 1024 + 1 + cols[None, :]
            for name, cfg in configs.items():
                for tname, table in tables.items():
                    for probe in (0, 3) if tname == "contiguous" else (0,):
                        fn = lambda c=c, out=out, new=new, cfg=cfg, table=table, probe=probe: (  # noqa: E731
                            extend_mod._launch(
                                c["q"], pool.k, pool.v, table, c["cu"], c["prefix_lens"], out,
                                scale, new, cfg, probe=probe,
                            )
                        )  # fmt: skip
                        info = {"kind": "extend", "tag": f"bucket-{name}", "table": tname,
                                "picked": cfg == picked, "prefix": prefix, "new": new,
                                "probe": probe, **asdict(cfg)}  # fmt: skip
                        info = _explore_point(timer, fn, info, log, s.explore_budget_s)
    for batch, ctx in s.bucket_decode_shapes:
        c = decode_case(s, pool, batch, ctx)
        for n, cfg in ((1, DecodeConfig(128, 4, 2)), (1, DecodeConfig()), (2, DecodeConfig())):
            w = decode_mod.DecodeWorkspace.allocate(batch, s.heads, n, s.head_dim, s.device)
            out = torch.empty_like(c["q"])
            fn = lambda c=c, w=w, n=n, cfg=cfg, out=out: decode_mod._launch(  # noqa: E731
                c["q"], pool.k, pool.v, c["table"], c["seq_lens"], out,
                w.partial_out if n > 1 else out, w.partial_lse if n > 1 else out, scale, n, cfg,
            )  # fmt: skip
            for mode in ("write", "read"):
                timer.flush_mode = mode
                info = {"kind": "decode", "tag": f"flush-{mode}", "batch": batch, "context": ctx,
                        "splits": n, **asdict(cfg)}  # fmt: skip
                _explore_point(timer, fn, info, log, s.explore_budget_s)
            timer.flush_mode = "write"


# ----------------------------------------------------------------------------- FlexAttention

_FLEX: dict = {}


def _flex() -> tuple[Callable, Callable]:
    """(torch.compile'd flex_attention, create_block_mask), built once per process."""
    if not _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        _FLEX["mask"] = create_block_mask
    return _FLEX["fn"], _FLEX["mask"]


def _flex_time(timer: Timer, fn: Callable, ref: torch.Tensor, row: dict, work: float,
               ceil_key: str, ceil: dict) -> None:  # fmt: skip
    """Compile (timed once, wall clock), check against ``ref`` and time ``fn`` into row."""
    try:
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize() if timer.cuda else None
        row["flex_compile_s"] = time.perf_counter() - t0
        row["flex_rel_err_vs_sdpa"] = rel_err(out, ref)
        row["flex_us"] = timer.median_us(fn, graph=True)
        row["flex_timing"] = timer.last_mode
        row["flex_frac"] = work / (row["flex_us"] * 1e-6) / ceil[ceil_key]
    except Exception as exc:  # noqa: BLE001 - report, keep the run going
        row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print("flex", {k: v for k, v in row.items() if k.startswith("flex")}, flush=True)


def flex_decode(s: Setup, timer: Timer, row: dict, q: torch.Tensor, k_c: torch.Tensor,
                v_c: torch.Tensor, ref: torch.Tensor, ceil: dict) -> None:  # fmt: skip
    """FlexAttention decode on contiguous KV: q [B, H, 1, D], k/v [B, K, L, D], GQA, no mask."""
    flex, _ = _flex()
    scale = s.head_dim**-0.5
    q4 = q.unsqueeze(2)
    fn = lambda: flex(q4, k_c, v_c, scale=scale, enable_gqa=True)  # noqa: E731
    _flex_time(timer, fn, ref.unsqueeze(2), row, row["bytes"], "copy_bytes_per_s", ceil)


def flex_extend(s: Setup, timer: Timer, row: dict, q_c: torch.Tensor, k_c: torch.Tensor,
                v_c: torch.Tensor, ref: torch.Tensor, prefix: int, ceil: dict) -> None:  # fmt: skip
    """FlexAttention extend on contiguous KV: q [B, H, E, D], k/v [B, K, L, D] (not
    expanded, enable_gqa), causal bottom-right block mask (built outside the timing)."""
    flex, create_block_mask = _flex()
    new, seq = q_c.shape[2], k_c.shape[2]

    def causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex mask_mod signature
        return kv_idx <= q_idx + prefix

    try:
        mask = create_block_mask(causal, None, None, new, seq, device=s.device)
    except Exception as exc:  # noqa: BLE001
        row["flex_error"] = f"block mask: {type(exc).__name__}: {str(exc)[:300]}"
        return
    scale = s.head_dim**-0.5
    fn = lambda: flex(q_c, k_c, v_c, block_mask=mask, scale=scale, enable_gqa=True)  # noqa: E731
    _flex_time(timer, fn, ref, row, row["flops"], "matmul_flop_per_s", ceil)


# ----------------------------------------------------------------------------- report


def _fmt_us(x: object) -> str:
    return f"{x:.1f}" if isinstance(x, float) else str(x)


def markdown(res: dict) -> str:
    ceil = res["ceilings"]
    lines = [
        f"Date {res['date']}, commit {res['commit']}, {res['device']}, torch {res['torch']}, "
        f"triton {res['triton']}. Command: `{res['command']}`",
        "",
        f"Ceilings measured in this run: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s "
        f"(read + write), bf16 matmul 8192^3 {ceil['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s.",
        "",
        "Times: median GPU time, L2 flushed before each repeat; 'timing' says whether the "
        "Triton/SDPA call was replayed from a CUDA graph (no launch cost) or called eagerly.",
        "",
        "Decode (Llama-3-8B heads 32/8, D 128, bf16, page 16, scattered pages):",
        "",
        "| batch | context | splits | triton us | eager back-to-back us | frac copy BW | SDPA us "
        "(contiguous, faster form) | SDPA frac | triton / SDPA | gather us | rel err | timing "
        "| read-flush triton us (frac) | read-flush SDPA us (frac) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def rf(r: dict, key: str) -> str:
        if key not in r:
            return "-"
        return f"{r[key]:.1f} ({r['bytes'] / (r[key] * 1e-6) / ceil['copy_bytes_per_s']:.2f})"

    for r in res["decode"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['context']} | error: {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['splits']} | {r['triton_us']:.1f} | "
            f"{r['triton_back_to_back_us']:.1f} | {r['triton_bw_frac']:.2f} | "
            f"{r['sdpa_us']:.1f} ({r['sdpa_form']}) | "
            f"{r['sdpa_bw_frac']:.2f} | {r['triton_us'] / r['sdpa_us']:.2f} | "
            f"{r['gather_us']:.1f} | {r['rel_err_vs_sdpa']:.1e} | "
            f"{r.get('timing', '?')}/{r.get('sdpa_timing', '?')} | "
            f"{rf(r, 'triton_us_rf')} | {rf(r, 'sdpa_us_rf')} |"
        )
    lines += [
        "",
        f"Extend (batch {res['extend'][0]['batch'] if res['extend'] else '?'}, same heads):",
        "",
        "| prefix | new | tiles (m/n/warps/stages) | triton us | TFLOP/s | frac matmul | SDPA us "
        "(contiguous, causal bottom-right) | SDPA frac | triton / SDPA | gather us | store_kv us "
        "| rel err | timing |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["extend"]:
        if "error" in r:
            lines.append(f"| {r['prefix']} | {r['new']} | error: {r['error'][:80]} |")
            continue
        t = r.get("config", {})
        tiles = "/".join(
            str(t.get(k, "?")) for k in ("block_m", "block_n", "num_warps", "num_stages")
        )
        lines.append(
            f"| {r['prefix']} | {r['new']} | {tiles} | {r['triton_us']:.1f} | "
            f"{r['flops'] / r['triton_us'] * 1e-6:.0f} | {r['triton_mm_frac']:.2f} | "
            f"{r['sdpa_us']:.1f} | {r['sdpa_mm_frac']:.2f} | {r['triton_us'] / r['sdpa_us']:.2f} | "
            f"{r['gather_us']:.1f} | {r['store_kv_us']:.1f} | {r['rel_err_vs_sdpa']:.1e} | "
            f"{r.get('timing', '?')}/{r.get('sdpa_timing', '?')} |"
        )
    flex_rows = [r for r in res["decode"] + res["extend"] if "flex_us" in r or "flex_error" in r]
    if flex_rows:
        lines += [
            "",
            "FlexAttention (torch.compile(flex_attention), dynamic=False) on the same contiguous "
            "KV as SDPA, GQA through enable_gqa (K/V not expanded); extend with a causal "
            "bottom-right block mask. frac = copy BW (decode) or matmul rate (extend):",
            "",
            "| shape | triton us | SDPA us | flex us | flex frac | triton / flex | flex rel err "
            "vs SDPA | first call (compile) s | timing |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in flex_rows:
            shape = (f"decode {r['batch']} x {r['context']}" if "context" in r
                     else f"extend {r['prefix']} + {r['new']}")  # fmt: skip
            if "flex_us" not in r:
                lines.append(f"| {shape} | {_fmt_us(r.get('triton_us'))} | "
                             f"{_fmt_us(r.get('sdpa_us'))} | error: {r['flex_error'][:120]} |")  # fmt: skip
                continue
            lines.append(
                f"| {shape} | {r['triton_us']:.1f} | {r['sdpa_us']:.1f} | {r['flex_us']:.1f} | "
                f"{r['flex_frac']:.2f} | {r['triton_us'] / r['flex_us']:.2f} | "
                f"{r['flex_rel_err_vs_sdpa']:.1e} | {r['flex_compile_s']:.1f} | {r['flex_timing']} |"
            )
    return "\n".join(lines) + "\n"


def _guarded(fn: Callable[[], dict], info: dict) -> dict:
    try:
        row = fn()
    except Exception as exc:  # noqa: BLE001 - keep the rest of the run
        row = {**info, "error": f"{type(exc).__name__}: {exc}"[:300]}
    print(row, flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def _parse_shapes(text: str, sep: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split(sep)) for item in text.split(",") if item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=Path(__file__).resolve().parents[2] / "bench" / "results" / "bench_kernels",
                        help="output directory (default: bench/results/bench_kernels/)")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (interpreter)")
    parser.add_argument("--flex", action="store_true", help="FlexAttention on a few shapes")
    parser.add_argument("--explore", action="store_true", help="variant sweep (explore.jsonl)")
    parser.add_argument("--buckets", action="store_true", help="extend buckets and probes")
    parser.add_argument("--decode-shapes", help="only these decode rows, e.g. 32x2048,1x8192")
    parser.add_argument("--extend-shapes", help="only these extend rows, e.g. 0+2048,8192+2048")
    args = parser.parse_args()
    s = smoke_setup() if args.smoke or not torch.cuda.is_available() else gpu_setup()
    s.flex = args.flex
    timer = Timer(s.device, s.budget_s)
    res: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": args.commit,
        "device": torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(["python", *sys.argv]),
        "defaults": {
            "decode": asdict(DecodeConfig()),
            "extend_long_prefix": asdict(extend_mod.HOPPER_EXTEND_CONFIG),
            "extend_prefill": asdict(extend_mod.HOPPER_PREFILL_CONFIG),
            "extend_fallback": asdict(ExtendConfig()),
        },
    }
    t0 = time.time()
    res["ceilings"] = measure_ceilings(s, timer)
    print("ceilings", res["ceilings"], flush=True)
    pool = Pool(s)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.explore:
        explore(s, pool, timer, res["ceilings"], out_dir)
    if args.buckets:
        explore_buckets(s, pool, timer, res["ceilings"], out_dir)
    decode_shapes = [(b, c) for b in s.decode_batches for c in s.decode_contexts
                     if b * c <= s.pool_tokens]  # fmt: skip
    extend_shapes = [(p, n) for p in s.extend_prefixes for n in s.extend_news]
    if args.decode_shapes is not None:
        decode_shapes = _parse_shapes(args.decode_shapes, "x")
    if args.extend_shapes is not None:
        extend_shapes = _parse_shapes(args.extend_shapes, "+")
    res["decode"] = [
        _guarded(lambda b=b, c=c: bench_decode_row(s, pool, timer, res["ceilings"], b, c),
                 {"batch": b, "context": c})
        for b, c in decode_shapes
    ]  # fmt: skip
    res["extend"] = [
        _guarded(lambda p=p, n=n: bench_extend_row(s, pool, timer, res["ceilings"], p, n),
                 {"prefix": p, "new": n})
        for p, n in extend_shapes
    ]  # fmt: skip
    (out_dir / "kernels_bench.md").write_text(markdown(res))
    (out_dir / "kernels_bench.json").write_text(json.dumps(res, indent=1))
    if args.sweep:
        res["decode_sweep"] = sweep_decode(s, pool, timer)
        res["extend_sweep"] = sweep_extend(s, pool, timer)
    res["wall_s"] = time.time() - t0
    (out_dir / "kernels_bench.json").write_text(json.dumps(res, indent=1))
    print(markdown(res))
    print(f"total {res['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
