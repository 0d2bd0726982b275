"""Data parallelism on the CPU: the multi-turn ShareGPT replay (``radixlm bench serving
--dataset-name sharegpt-multiturn``) against one replica and against ``--dp-size 2`` with
cache-aware and round-robin routing, the default SmolLM2 on each. The cores are split
between the replicas (``OMP_NUM_THREADS`` = cores / replicas), so the ratio measures what
two half-size replicas give against one that uses every core. Per configuration: output
and total token throughput, the prefix-cache hit rate over the run, TTFT.

    .venv/bin/python bench/serving/dp_cpu.py --conversations 24 --out bench/results/dp_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from radixlm.runtime.bench import serving as bench_serving
from radixlm.runtime.bench.server_process import ServerProcess
from radixlm.runtime.executor.model_loader import usable_cores

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {  # name -> (dp size, routing)
    "dp1": (1, "cache_aware"),
    "dp2-cache-aware": (2, "cache_aware"),
    "dp2-round-robin": (2, "round_robin"),
}
FIGURES = ("output_throughput", "input_throughput", "prefix_cache_hit_rate", "median_ttft_ms", "median_tpot_ms",
           "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens")


def run(name: str, args: argparse.Namespace, cores: int) -> dict:
    dp, routing = CONFIGS[name]
    threads = args.threads_per_replica or max(1, cores // dp)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the servers' processes inherit it
    flags = ["--dp-size", str(dp), "--dp-routing", routing, "--max-running-requests", str(args.concurrency),
             "--log-level", "warning"]
    jsonl = args.out.with_name(f"{args.out.stem}_{name}_{threads}t.jsonl")
    with ServerProcess.launch(flags) as srv:
        bench_serving.main(["--base-url", srv.url, "--backend", "radixlm", "--dataset-name", "sharegpt-multiturn",
                            "--num-prompts", str(args.conversations), "--multiturn-max-turns", str(args.turns),
                            "--multiturn-output-len", str(args.output_len), "--multiturn-think-time", "0",
                            "--request-rate", "inf", "--max-concurrency", str(args.concurrency), "--seed", "0",
                            "--disable-tqdm", "--output-file", str(jsonl), "--tag", name])
    record = [json.loads(line) for line in open(jsonl)][-1]
    return {"threads_per_replica": threads, **{k: record.get(k) for k in FIGURES}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=4, help="turns per conversation at most")
    p.add_argument("--output-len", type=int, default=32, help="reply tokens per turn")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--threads-per-replica", type=int, default=0,
                   help="torch threads of each replica (default: the cores / replicas)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dp_cpu.json")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cores = usable_cores()
    result = {"cores": cores, "load_average_at_start": os.getloadavg(), "started": time.strftime("%Y-%m-%d %H:%M"),
              "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for name in args.configs:
        result["runs"][name] = run(name, args, cores)
        print(name, json.dumps(result["runs"][name]), flush=True)
    runs = result["runs"]
    if "dp1" in runs and "dp2-cache-aware" in runs:
        result["dp2_over_dp1_output_throughput"] = (runs["dp2-cache-aware"]["output_throughput"]
                                                    / runs["dp1"]["output_throughput"])
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
