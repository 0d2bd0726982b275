"""Served A/B of server flags on the GPU host (e.g. ``--num-scheduler-steps``): one server
per configuration on a random-weight shape (``bench/e2e/gpu_e2e.py``'s ``build_checkpoint``,
the tokenizer's vocabulary), each running, with the radix cache flushed before every run:

* warm: random 512 in / 256 out, 64 concurrent, 64 requests (not reported);
* decode-batch64: the same, 128 requests (``gpu_serving.py``'s run of that name);
* decode-batch1: 3 requests, 1 at a time;
* sharegpt: the first N ShareGPT prompts of ``--dataset-path``, all at once (N = 0: skipped).

Every server gets ``--server-args`` (default: the 200-prompt configuration of
``gpu_serving.py``) plus its configuration's flags. Per run: the benchmark's headline figures
and the scheduler's counters from /metrics (busy ms per decode step = decode busy seconds /
decode steps). With ``--py-spy`` (a py-spy binary) and ``--spy-tags`` naming configurations,
py-spy records the scheduler process for 6 s of their decode-batch64 run (raw collapsed
stacks, ``spy_TAG.txt`` beside ``--out``).

    . bench/gpu_env.sh && python3 bench/serving/server_ab.py --out $OUT/ab.json \\
        "n8=--num-scheduler-steps 8" "n1=--num-scheduler-steps 1" "n16=--num-scheduler-steps 16"
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("e2e", "serving")]
from gpu_e2e import build_checkpoint, server_flags  # noqa: E402
from gpu_serving import scheduler_counters  # noqa: E402

from radixlm.runtime.bench import serving as bench_serving  # noqa: E402
from radixlm.runtime.bench.server_process import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("output_throughput", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "mean_tpot_ms",
           "median_ttft_ms", "p99_ttft_ms", "completed", "failed", "duration_s")


def random_flags(n: int, concurrency: int) -> list[str]:
    return ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "256",
            "--random-range-ratio", "1.0", "--num-prompts", str(n), "--max-concurrency", str(concurrency)]


def spy(tag: str, result: dict, args: argparse.Namespace) -> None:
    """py-spy the scheduler (the GPU process that is not this one) for 6 s, 3 s from now."""
    time.sleep(3)
    pids = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.split()
    pid = [p for p in pids if int(p) != os.getpid()][0]
    out = subprocess.run([args.py_spy, "record", "--nonblocking", "-r", "500", "-d", "6", "-f", "raw",
                          "-o", str(args.out.parent / f"spy_{tag}.txt"), "-p", pid], capture_output=True, text=True)
    result["spy"], result["spy_pids"] = [out.returncode, out.stderr[-300:]], pids


def bench(args: argparse.Namespace, url: str, tag: str, name: str, result: dict, *flags: str) -> None:
    profiled = name == "decode-batch64" and args.py_spy and tag in args.spy_tags
    thread = threading.Thread(target=spy, args=(tag, result, args)) if profiled else None
    if thread:
        thread.start()
    before = scheduler_counters(url)
    jsonl = str(args.out.parent / f"ab_{tag}.jsonl")
    bench_serving.main(["--tag", name, "--seed", "0", "--output-file", jsonl, "--disable-tqdm", "--base-url", url,
                        "--flush-cache", "--tokenizer", str(args.tokenizer_dir), *flags])
    after = scheduler_counters(url)
    if thread:
        thread.join()
    delta = {k.split(":")[1]: after[k] - before[k] for k in after}
    record = [json.loads(line) for line in open(jsonl)][-1]
    run = result[name] = {k: record.get(k) for k in FIGURES}
    run["busy_ms_per_decode_step"] = (1e3 * delta["scheduler_decode_busy_seconds_total"]
                                      / max(delta["decode_steps_total"], 1))
    run["counters"] = delta
    print(tag, name, json.dumps(run), flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", metavar="TAG=FLAGS",
                    help="one server per configuration: a tag and its extra launch_server flags")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "server_ab" / "ab.json",
                    help="the JSON summary (per-run JSONL records beside it)")
    ap.add_argument("--sharegpt-prompts", type=int, default=0,
                    help="also run the first N ShareGPT prompts at once (0: skip)")
    ap.add_argument("--tokenizer-dir", type=Path, default=Path(".gpu_tok"))
    ap.add_argument("--dataset-path", default=".gpu_data/sharegpt_subset.jsonl", help="ShareGPT JSON / JSON lines")
    ap.add_argument("--shape", default="llama3-8b", help="random-weight shape of bench/e2e/gpu_e2e.py")
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--server-args", default="--dtype bfloat16 --max-running-requests 1024 "
                    "--max-prefill-tokens 16384 --stream-output", help="flags every server gets")
    ap.add_argument("--py-spy", default=None, help="a py-spy binary: profile the scheduler of --spy-tags")
    ap.add_argument("--spy-tags", nargs="*", default=[], help="configurations to profile with --py-spy")
    args = ap.parse_args()
    if any("=" not in c for c in args.configs):
        ap.error("each configuration is TAG=FLAGS, e.g. 'n8=--num-scheduler-steps 8'")
    return args


def main() -> None:
    args = parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    configs = [arg.split("=", 1) for arg in args.configs]
    model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir, args.models_root / "bfloat16")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    results: dict[str, dict] = {}
    for tag, extra in configs:
        t0 = time.time()
        flags = server_flags(model_dir, f"{args.server_args} {extra}")
        result = results[tag] = {"flags": extra}
        try:
            with open(args.out.parent / f"server_{tag}.log", "w") as log, \
                    ServerProcess.launch(flags, log=log, startup_timeout=600) as srv:
                result["start_s"] = time.time() - t0
                bench(args, srv.url, tag, "warm", result, *random_flags(64, 64))
                bench(args, srv.url, tag, "decode-batch64", result, *random_flags(128, 64))
                bench(args, srv.url, tag, "decode-batch1", result, *random_flags(3, 1))
                if args.sharegpt_prompts:
                    bench(args, srv.url, tag, "sharegpt", result, "--dataset-name", "sharegpt", "--dataset-path",
                          args.dataset_path, "--num-prompts", str(args.sharegpt_prompts))
        except Exception as exc:  # keep the other configurations' figures
            result["error"] = repr(exc)
        result["total_s"] = time.time() - t0
        args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps({tag: {name: (run.get("busy_ms_per_decode_step"), run.get("median_itl_ms"),
                                   run.get("output_throughput"))
                            for name, run in result.items() if isinstance(run, dict) and "counters" in run}
                      for tag, result in results.items()}))


if __name__ == "__main__":
    main()
