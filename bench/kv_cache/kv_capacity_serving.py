"""Requests served at a fixed KV memory budget, per ``--kv-cache-dtype``.

For each dtype a server runs with ``--max-total-tokens`` = the budget in bytes / that
dtype's bytes per token (``radixlm.runtime.memory.kv_pool.kv_page_bytes``, per-page metadata included; the
FP8 slots of int4 / mixed pools come on top and are reported). The same workload (random
prompts, fixed output length via ``ignore_eos``, all sent at once) goes through
``radixlm bench serving`` against each; the record adds output throughput, the running
requests sampled from /metrics (mean and max: how many fit at once), KV usage and waste.

    . bench/gpu_env.sh && python3 bench/kv_cache/kv_capacity_serving.py --shape llama3-8b \\
        --tokenizer-dir tok/ --budget-gib 4 --dtypes bf16,fp8_e4m3 --out $OUT/kvcap

A CPU dry run of the script: ``GPU_E2E_DEVICE=cpu ... --shape tiny --budget-gib 0.001``.

Writes ``serving.jsonl`` (one ``bench serving`` record per dtype, tag = dtype) and
``summary.json`` (per dtype: pool tokens, bytes, throughput, running requests).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("e2e",)]
from gpu_e2e import DEVICE, build_checkpoint, server_flags  # noqa: E402

from radixlm.runtime.bench import serving as bench_serving  # noqa: E402
from radixlm.runtime.bench.server_process import ServerProcess  # noqa: E402
from radixlm.runtime.memory.kv_pool import kv_page_bytes  # noqa: E402

PAGE_SIZE = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", help="random-weight shape of bench/e2e/gpu_e2e.py")
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--budget-gib", type=float, default=4.0, help="KV bytes per server (GiB)")
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--server-args", default="--max-running-requests 256")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "kv_capacity_serving",
                    help="output directory (default: bench/results/kv_capacity_serving/)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir, args.models_root / "bfloat16")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    budget = int(args.budget_gib * 2**30)
    jsonl, rows = args.out / "serving.jsonl", {}
    for dtype in args.dtypes.split(","):
        page = kv_page_bytes(dtype, torch.bfloat16, cfg.num_hidden_layers, cfg.num_key_value_heads,
                             head_dim, PAGE_SIZE)  # fmt: skip
        tokens = budget // page * PAGE_SIZE
        flags = server_flags(model_dir, f"--dtype {'bfloat16' if DEVICE == 'cuda' else 'float32'} --kv-cache-dtype {dtype} --max-total-tokens {tokens} "
                                        f"--page-size {PAGE_SIZE} {args.server_args}")  # fmt: skip
        t0 = time.perf_counter()
        with open(args.out / f"server_{dtype}.log", "w") as log, \
                ServerProcess.launch(flags, log=log, startup_timeout=600) as srv:
            bench_serving.main([
                "--base-url", srv.url, "--tag", dtype, "--output-file", str(jsonl), "--disable-tqdm",
                "--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
                "--num-prompts", str(args.num_prompts), "--tokenizer", str(args.tokenizer_dir), "--seed", "1",
            ])  # fmt: skip
        record = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()][-1]
        rows[dtype] = {
            "pool_tokens": tokens, "page_bytes": page, "pool_bytes": tokens // PAGE_SIZE * page,
            "seconds": time.perf_counter() - t0,
            **{k: record.get(k) for k in ("completed", "failed", "duration_s", "output_throughput",
                                          "median_ttft_ms", "median_tpot_ms", "running_reqs_mean",
                                          "running_reqs_max", "kv_usage_mean", "kv_waste_mean", "kv_waste_max")},
        }  # fmt: skip
        print(dtype, json.dumps(rows[dtype]), flush=True)
        summary = {"shape": args.shape, "budget_gib": args.budget_gib, "workload": {
            "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len},
            "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "rows": rows}  # fmt: skip
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
