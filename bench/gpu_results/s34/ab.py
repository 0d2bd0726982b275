"""Served A/B of ``--num-scheduler-steps`` (session 34, H200 host): one server per
configuration on the random-weight Llama-3-8B shape (``gpu_e2e.build_checkpoint``, the SmolLM2
tokenizer's 49152 ids), each running, with the radix cache flushed before every run:

* warm: random 512 in / 256 out, 64 concurrent, 64 requests (not reported);
* decode-batch64: the same, 128 requests (``gpu_serving.py``'s run of that name);
* decode-batch1: 3 requests, 1 at a time;
* sharegpt: the first N ShareGPT prompts of the carried subset, all at once (N = 0: skipped).

Every server also gets ``--max-running-requests 1024 --max-prefill-tokens 16384
--stream-output`` (the 200-prompt configuration of ``gpu_serving.py``). Per run: the
benchmark's headline figures and the scheduler's counters from /metrics (busy ms per
decode step = decode busy seconds / decode steps, the served figure of issue 4). With
``SPY`` (a py-spy binary) and ``SPY_TAGS`` naming configurations, py-spy records the
scheduler process for 6 s of their decode-batch64 run (raw collapsed stacks, ``$OUT/spy_TAG.txt``).

    . bench/gpu_env.sh && python3 bench/gpu_results/s34/ab.py $OUT/ab.json 200 \\
        "n1=--num-scheduler-steps 1" "n8=--num-scheduler-steps 8"
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, "bench")
from gpu_e2e import build_checkpoint, server_flags  # noqa: E402
from gpu_serving import scheduler_counters  # noqa: E402

from radixlm.runtime.bench import serving as bench_serving  # noqa: E402
from radixlm.runtime.bench.server_process import ServerProcess  # noqa: E402

FIGURES = ("output_throughput", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "mean_tpot_ms",
           "median_ttft_ms", "p99_ttft_ms", "completed", "failed", "duration_s")


def random_flags(n: int, concurrency: int) -> list[str]:
    return ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "256",
            "--random-range-ratio", "1.0", "--num-prompts", str(n), "--max-concurrency", str(concurrency)]


def spy(tag: str, result: dict) -> None:
    """py-spy the scheduler (the GPU process that is not this one) for 6 s, 3 s from now."""
    time.sleep(3)
    pids = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.split()
    pid = [p for p in pids if int(p) != os.getpid()][0]
    out = subprocess.run([os.environ["SPY"], "record", "--nonblocking", "-r", "500", "-d", "6", "-f", "raw",
                          "-o", f"{os.environ['OUT']}/spy_{tag}.txt", "-p", pid], capture_output=True, text=True)
    result["spy"], result["spy_pids"] = [out.returncode, out.stderr[-300:]], pids


def bench(url: str, tag: str, name: str, result: dict, *flags: str) -> None:
    profiled = name == "decode-batch64" and os.environ.get("SPY") and tag in os.environ.get("SPY_TAGS", "").split()
    thread = threading.Thread(target=spy, args=(tag, result)) if profiled else None
    if thread:
        thread.start()
    before = scheduler_counters(url)
    jsonl = f"/tmp/ab_{tag}.jsonl"
    bench_serving.main(["--tag", name, "--seed", "0", "--output-file", jsonl, "--disable-tqdm", "--base-url", url,
                        "--flush-cache", "--tokenizer", ".gpu_tok", *flags])
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


def main() -> None:
    out_path, n_sharegpt = Path(sys.argv[1]), int(sys.argv[2])
    configs = [arg.split("=", 1) for arg in sys.argv[3:]]
    model_dir, model = build_checkpoint("llama3-8b", Path(".gpu_tok"), Path("/tmp/models/bfloat16"))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    results: dict[str, dict] = {}
    for tag, extra in configs:
        t0 = time.time()
        flags = server_flags(model_dir, "--dtype bfloat16 --max-running-requests 1024 --max-prefill-tokens 16384 "
                                        f"--stream-output {extra}")
        result = results[tag] = {"flags": extra}
        try:
            with open(f"/tmp/server_{tag}.log", "w") as log, \
                    ServerProcess.launch(flags, log=log, startup_timeout=600) as srv:
                result["start_s"] = time.time() - t0
                bench(srv.url, tag, "warm", result, *random_flags(64, 64))
                bench(srv.url, tag, "decode-batch64", result, *random_flags(128, 64))
                bench(srv.url, tag, "decode-batch1", result, *random_flags(3, 1))
                if n_sharegpt:
                    bench(srv.url, tag, "sharegpt", result, "--dataset-name", "sharegpt", "--dataset-path",
                          ".gpu_data/sharegpt_subset.jsonl", "--num-prompts", str(n_sharegpt))
        except Exception as exc:  # keep the other configurations' figures
            result["error"] = repr(exc)
        result["total_s"] = time.time() - t0
        out_path.write_text(json.dumps(results, indent=1))
    print(json.dumps({tag: {name: (run.get("busy_ms_per_decode_step"), run.get("median_itl_ms"),
                                   run.get("output_throughput"))
                            for name, run in result.items() if isinstance(run, dict) and "counters" in run}
                      for tag, result in results.items()}))


if __name__ == "__main__":
    main()
