"""Benchmark: split-KV extend path vs the long-extend kernel for short extends over long
cached prefixes (the cached-prefix TTFT case of PERFORMANCE.md).

Shapes: Llama-3-8B attention (32 query heads, 8 kv heads, D 128), bf16, page size 16,
pages scattered over a 2 GB pool; batch {1, 8} x cached prefix {1K, 4K, 16K} x new tokens
{32, 128, 512}. Per shape, one process, same inputs:
  * ``old``: ``extend_attention(num_splits=1)`` (the long-extend kernel, default tiles);
  * ``split``: the split path; ``default_*``: the default (``extend_num_splits`` picks N; N = 1 means the default is the
    old kernel for that shape), workspace preallocated as the runtime does;
  * ``variants``: the split path with other ``ExtendSplitConfig`` tiles and N x 0.5 / x 2,
    for tuning (``--no-variants`` skips them).
GPU times: median of CUDA-graph replays between CUDA events, L2 flushed (256 MB write)
before each (bench_kernels.Timer); ``eager_us``: mean time per eager call issued back to
back (the extend path runs eagerly in the server, so launch cost counts). Each new output
is compared with the old one (relative error), and batch 1 x 4K + 128 also with the fp32
reference; one FP8-pool row (batch 1, 4K + 128). Reported: us, TFLOP/s (causal FLOPs),
K/V bytes read / time, speed-up old / new, and the 32-layer attention time of the TTFT case.

Usage (GPU, < 3 minutes):  . bench/gpu_env.sh && python3 bench/kernels/bench_extend_split.py --out $OUT
Smoke (CPU):  python bench/kernels/bench_extend_split.py --smoke --out /tmp/x
Writes extend_split_bench.json and extend_split_bench.md under --out.

Dimension letters: B batch, H query heads, K kv heads, D head dim, E new tokens per
request, L keys per request, N key splits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import Pool, Setup, Timer, extend_flops, rel_err  # noqa: E402

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import DecodeWorkspace  # noqa: E402
from radixlm.kernels.extend_attention import (  # noqa: E402
    ExtendSplitConfig,
    default_extend_config,
    default_split_config,
    extend_attention,
    extend_num_splits,
)

KB = 1024


def split_variants(base: ExtendSplitConfig, smoke: bool) -> list[ExtendSplitConfig]:
    """Tile variants of the split path timed next to the default (tuning; one in --smoke)."""
    cands = [
        ExtendSplitConfig(block_rows=64, block_n=64, num_warps=4, num_stages=2),
        ExtendSplitConfig(block_rows=128, block_n=64, num_warps=8, num_stages=2),
        ExtendSplitConfig(block_rows=128, block_n=64, num_warps=4, num_stages=2),
        ExtendSplitConfig(block_rows=128, block_n=32, num_warps=4, num_stages=3),
        ExtendSplitConfig(block_rows=64, block_n=128, num_warps=4, num_stages=2),
    ]
    cands = [replace(c, programs_per_sm=base.programs_per_sm) for c in cands if c != base]
    return cands[:1] if smoke else cands


def case_inputs(s: Setup, pool: Pool, batch: int, prefix: int, new: int) -> dict:
    q = torch.randn(batch * new, s.heads, s.head_dim, dtype=s.dtype, device=s.device)
    return {
        "q": q,
        "table": pool.page_table(batch, prefix + new),
        "cu": torch.arange(batch + 1, dtype=torch.int32, device=s.device) * new,
        "prefix_lens": torch.full((batch,), prefix, dtype=torch.int32, device=s.device),
    }


def call(s: Setup, c: dict, k_pool, v_pool, new: int, num_splits: int,
         split_config: ExtendSplitConfig | None, scales: dict):  # fmt: skip
    """A zero-argument extend call with its output and split scratch preallocated."""
    out = torch.empty_like(c["q"])
    work = None
    if num_splits > 1:
        work = DecodeWorkspace.allocate(c["q"].shape[0], s.heads, num_splits, s.head_dim, s.device)
    return lambda: extend_attention(
        c["q"], k_pool, v_pool, c["table"], c["cu"], c["prefix_lens"], s.head_dim**-0.5, new,
        out=out, num_splits=num_splits, workspace=work, split_config=split_config, **scales,
    )  # fmt: skip


def kv_bytes(s: Setup, batch: int, seq: int, elem: int) -> int:
    return 2 * batch * seq * s.kv_heads * s.head_dim * elem


def time_point(timer: Timer, fn, flops: int, nbytes: int, eager: bool) -> dict:
    us = timer.median_us(fn, graph=True)
    point = {"us": us, "timing": timer.last_mode, "tflops": flops / us / 1e6,
             "kv_tb_per_s": nbytes / us / 1e6}  # fmt: skip
    if eager:
        point["eager_us"] = timer.back_to_back_us(fn)
    return point


def bench_shape(s: Setup, pool: Pool, timer: Timer, batch: int, prefix: int, new: int,
                variants: list[ExtendSplitConfig], k_pool=None, v_pool=None, scales=None) -> dict:  # fmt: skip
    """One shape: old kernel, split path, and (if ``variants``) the split path with the
    default tiles at other N and with each variant's tiles."""
    k_pool = pool.k if k_pool is None else k_pool
    v_pool = pool.v if v_pool is None else v_pool
    scales = scales or {}
    c = case_inputs(s, pool, batch, prefix, new)
    bound = c["table"].shape[1] * s.page_size
    split_cfg = default_split_config(s.device)
    n_default = extend_num_splits(batch, s.heads, s.kv_heads, new, bound, s.device, split_cfg)
    flops = extend_flops(s, batch, prefix, new)
    nbytes = kv_bytes(s, batch, prefix + new, k_pool.element_size())
    row = {"batch": batch, "prefix": prefix, "new": new, "default_num_splits": n_default,
           "old_tiles": asdict(default_extend_config(s.device, new, bound)),
           "split_config": asdict(split_cfg), "flops": flops, "kv_bytes": nbytes}  # fmt: skip
    old_fn = call(s, c, k_pool, v_pool, new, 1, split_cfg, scales)
    row["old"] = time_point(timer, old_fn, flops, nbytes, eager=True)
    ref = old_fn().float()
    # The split path at the default N, or, where the default keeps the old kernel, at the
    # N the heuristic would give with no occupancy limit (so every shape has a new time).
    n_new = n_default if n_default > 1 else max(2, min(8, bound // 512))
    new_fn = call(s, c, k_pool, v_pool, new, n_new, split_cfg, scales)
    row["split"] = time_point(timer, new_fn, flops, nbytes, eager=True) | {"num_splits": n_new}
    out = new_fn()
    row["split"]["rel_err_vs_old"] = rel_err(out, ref)
    assert not out.isnan().any(), row
    row["default_us"] = row["split"]["us"] if n_default > 1 else row["old"]["us"]
    row["speedup_default"] = row["old"]["us"] / row["default_us"]
    row["speedup_split"] = row["old"]["us"] / row["split"]["us"]
    if batch == 1 and prefix == 4 * KB and new == 128 and not scales:
        exact = reference.paged_attention(c["q"].float(), k_pool.float(), v_pool.float(),
                                          c["table"], [prefix], [new], s.head_dim**-0.5)  # fmt: skip
        row["split"]["rel_err_vs_fp32_ref"] = rel_err(out, exact)
        row["old"]["rel_err_vs_fp32_ref"] = rel_err(ref, exact)
    if variants:
        row["variants"] = []
        for cfg in [split_cfg, *variants]:
            for n in sorted({max(2, n_new // 2), n_new, 2 * n_new}):
                if cfg == split_cfg and n == n_new:
                    continue
                fn = call(s, c, k_pool, v_pool, new, n, cfg, scales)
                point = time_point(timer, fn, flops, nbytes, eager=False)
                point |= {"config": asdict(cfg), "num_splits": n, "rel_err_vs_old": rel_err(fn(), ref)}
                row["variants"].append(point)
        best = min(row["variants"], key=lambda p: p["us"])
        row["best_variant"] = {k: best[k] for k in ("us", "config", "num_splits")}
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Split-KV extend vs long-extend kernel ({meta['gpu']}, {meta['date']}, commit {meta['commit']})",
             "", "8B shape (32/8 heads, D 128), bf16 unless noted, page 16, scattered pages; "
             "GPU us = median CUDA-graph replay after an L2 flush; eager us = back-to-back eager calls.", "",
             "| B | prefix | new | old us (eager) | split N | split us (eager) | old/split | default N | "
             "default speed-up | split TB/s of K/V | best variant us (rows/n/warps/stages, N) | err vs old |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    for r in rows:
        o, n = r["old"], r["split"]
        best = r.get("best_variant")
        best_s = "-"
        if best:
            c = best["config"]
            best_s = (f"{best['us']:.1f} ({c['block_rows']}/{c['block_n']}/{c['num_warps']}/"
                      f"{c['num_stages']}, {best['num_splits']})")  # fmt: skip
        tag = " fp8" if r.get("fp8") else ""
        lines.append(
            f"| {r['batch']} | {r['prefix']}{tag} | {r['new']} | {o['us']:.1f} ({o['eager_us']:.1f}) | "
            f"{n['num_splits']} | {n['us']:.1f} ({n['eager_us']:.1f}) | {r['speedup_split']:.2f} | "
            f"{r['default_num_splits']} | {r['speedup_default']:.2f} | {n['kv_tb_per_s']:.2f} | {best_s} | "
            f"{n['rel_err_vs_old']:.1e} |"
        )
    ttft = meta.get("ttft_case")
    if ttft:
        lines += ["", f"TTFT-like case (1 x {ttft['prefix']} cached + {ttft['new']} new, 32 layers): "
                  f"old {ttft['old_32_layers_ms']:.2f} ms, "
                  f"default {ttft['default_32_layers_ms']:.2f} ms of attention GPU time."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "bench_extend_split",
                    help="output directory (default: bench/results/bench_extend_split/)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--no-variants", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = Setup(device)
    if args.smoke:
        s = Setup(device, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32)
        s.pool_tokens = 4096
        batches, prefixes, news, budget = (1,), (200,), (8,), 0.01
    else:
        s.pool_tokens = 256 * KB  # 1 GB each for K and V: batch 8 x (16K + 512) fits
        batches, prefixes, news, budget = (1, 8), (KB, 4 * KB, 16 * KB), (32, 128, 256, 512), 0.05
    torch.manual_seed(0)
    pool = Pool(s)
    timer = Timer(device, budget)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    meta = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": __import__("triton").__version__, "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count if device.type == "cuda" else None}  # fmt: skip
    variants = [] if args.no_variants else split_variants(default_split_config(device), args.smoke)
    rows = []
    for batch in batches:
        for prefix in prefixes:
            for new in news:
                row = bench_shape(s, pool, timer, batch, prefix, new, variants)
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("batch", "prefix", "new", "default_num_splits",
                                                      "speedup_default", "speedup_split")}), flush=True)  # fmt: skip
    # FP8 pages (e4m3, per-kv-head scales), the TTFT shape.
    scale = torch.full((s.kv_heads,), 4.0 / 448, device=device)
    k8, v8 = reference.quantize_fp8(pool.k, scale), reference.quantize_fp8(pool.v, scale)
    prefix, new = prefixes[min(1, len(prefixes) - 1)], news[min(1, len(news) - 1)]
    fp8 = bench_shape(s, pool, timer, 1, prefix, new, [], k8, v8, {"k_scale": scale, "v_scale": scale})
    fp8["fp8"] = True
    rows.append(fp8)
    del k8, v8
    ttft = next((r for r in rows if (r["batch"], r["prefix"], r["new"]) == (1, prefix, new)), None)
    if ttft:
        meta["ttft_case"] = {"prefix": prefix, "new": new, "old_32_layers_ms": 32 * ttft["old"]["us"] / 1e3,
                             "default_32_layers_ms": 32 * ttft["default_us"] / 1e3}  # fmt: skip
    meta["seconds"] = time.perf_counter() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "extend_split_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = markdown(rows, meta)
    (args.out / "extend_split_bench.md").write_text(md)
    print(md)
    print(f"done in {meta['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
