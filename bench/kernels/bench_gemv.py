"""Batch-1..4 linear layers of a decode step on one GPU: cuBLAS (``F.linear``, ``torch.mv``)
against the Triton skinny GEMM of kernels/gemv.py over a grid of launch configs.

Shapes: Llama-3-8B's projections (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 ->
28672, down 14336 -> 4096), bf16 random weights. Times are GPU times from
bench_kernels.Timer (CUDA-graph replay, L2 cleared by reading a 256 MB buffer before
every repeat, median); the fraction is weight bytes / time over the measured copy
bandwidth (read + write of a 4 GiB copy). Each Triton result is checked against
``F.linear`` (relative error).

    . bench/gpu_env.sh && python3 bench/kernels/bench_gemv.py --out $OUT     # H200: ~1-2 min
    .venv/bin/python bench/kernels/bench_gemv.py --smoke --out /tmp/gemv      # CPU interpreter

Writes bench_gemv.json under --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("kernels", "e2e")]
from bench_kernels import Timer, rel_err  # noqa: E402
from decode_step import copy_bandwidth  # noqa: E402

from radixlm.kernels.fused_ops import fused_add_rmsnorm, silu_and_mul  # noqa: E402
from radixlm.kernels.gemv import GemvConfig, gemv, rmsnorm_gemv, silu_mul_gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CONFIGS = [
    GemvConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
    for bn, bk, w, st in itertools.product((8, 16, 32), (256, 512), (4, 8), (2, 4))
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=Path(__file__).resolve().parents[2] / "bench" / "results" / "bench_gemv",
                    help="output directory (default: bench/results/bench_gemv/)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="batch sizes M")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float16 if args.smoke else torch.bfloat16
    shapes, configs = SHAPES, CONFIGS
    if args.smoke:
        shapes = {"tiny": (40, 512)}
        configs = [GemvConfig(block_n=8, block_k=256, num_stages=1)]
    timer = Timer(device, budget_s=0.15)
    timer.flush_mode = "read"
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "copy_bandwidth_Bps": bandwidth, "rows": []}  # fmt: skip
    t0 = time.time()
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        weight_bytes = w.numel() * w.element_size()
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            ref = F.linear(x, w)
            row = {"shape": name, "n": n, "k": k, "m": m, "weight_bytes": weight_bytes}
            row["linear_us"] = timer.median_us(lambda x=x, w=w: F.linear(x, w), graph=True)
            if m == 1:
                row["mv_us"] = timer.median_us(lambda x=x, w=w: torch.mv(w, x[0]), graph=True)
            tried = {}
            for c in configs:
                key = f"n{c.block_n}_k{c.block_k}_w{c.num_warps}_s{c.num_stages}"
                try:
                    res = gemv(x, w, config=c)
                    err = rel_err(res, ref)
                    us = timer.median_us(lambda x=x, w=w, c=c: gemv(x, w, config=c), graph=True)
                    tried[key] = {"us": us, "rel_err": err}
                except Exception as exc:  # noqa: BLE001 - a config that does not compile
                    tried[key] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            ok = {key: v for key, v in tried.items() if "us" in v and v["rel_err"] < 1e-2}
            best = min(ok, key=lambda key: ok[key]["us"]) if ok else None
            row["triton"] = tried
            row["best_triton"] = best
            row["best_triton_us"] = ok[best]["us"] if best else None
            for col in ("linear_us", "mv_us", "best_triton_us"):
                if row.get(col):
                    row[col.replace("_us", "_bw_frac")] = weight_bytes / (row[col] * 1e-6) / bandwidth
            print(json.dumps({k2: v for k2, v in row.items() if k2 != "triton"}), flush=True)
            report["rows"].append(row)
    report["fused"] = fused_rows(shapes, configs, device, dtype, timer, bandwidth)
    report["seconds"] = round(time.time() - t0, 1)
    (out / "bench_gemv.json").write_text(json.dumps(report, indent=1))


def fused_rows(shapes: dict, configs: list, device: torch.device, dtype: torch.dtype, timer: Timer,
               bandwidth: float) -> list:  # fmt: skip
    """Batch 1: the norm / activation fused into the GEMV (one launch; default config and
    the best of ``configs``) against the separate fused_ops kernel + gemv (two launches),
    as the model ran them before. qkv and gate_up take add + RMSNorm, down SiLU-and-mul."""
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        if name == "down" or name == "tiny":
            gate_up = torch.randn(1, 2 * k, device=device, dtype=dtype)
            ref = gemv(silu_and_mul(gate_up), w)
            fused = lambda c=None, gu=gate_up, w=w: silu_mul_gemv(gu, w, config=c)  # noqa: E731
            separate = lambda gu=gate_up, w=w: gemv(silu_and_mul(gu), w)  # noqa: E731
        elif name in ("qkv", "gate_up"):
            x, res = torch.randn(2, 1, k, device=device, dtype=dtype)
            norm_w = torch.rand(k, device=device, dtype=dtype) + 0.5
            ref = gemv(fused_add_rmsnorm(x, res, norm_w, 1e-5)[0], w)
            fused = lambda c=None, x=x, r=res, nw=norm_w, w=w: rmsnorm_gemv(x, r, nw, 1e-5, w, config=c)[0]  # noqa: E731
            separate = lambda x=x, r=res, nw=norm_w, w=w: gemv(fused_add_rmsnorm(x, r, nw, 1e-5)[0], w)  # noqa: E731
        else:
            continue
        row = {"shape": name, "n": n, "k": k, "rel_err": rel_err(fused(), ref),
               "separate_us": timer.median_us(separate, graph=True), "fused_us": timer.median_us(fused, graph=True)}
        tried = {}
        for c in configs:
            if k % c.block_k == 0 and rel_err(fused(c), ref) < 1e-2:
                tried[f"n{c.block_n}_k{c.block_k}_w{c.num_warps}_s{c.num_stages}"] = timer.median_us(
                    lambda c=c, f=fused: f(c), graph=True)
        row["best_fused"] = min(tried, key=tried.get) if tried else None
        row["best_fused_us"] = tried[row["best_fused"]] if tried else None
        row["fused_bw_frac"] = w.numel() * w.element_size() / (row["fused_us"] * 1e-6) / bandwidth
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
