"""GPU serving benchmark: radixlm vs transformers ``generate_batch`` on the same GPU, same
weights, same ShareGPT prompts, with ``radixlm bench serving`` (runtime/bench/serving.py).

On a random-weight Llama-3-8B-shaped bf16 checkpoint (``gpu_e2e.build_checkpoint``):
1. start ``radixlm launch_server`` (``gpu_e2e.server_flags`` + ``--server-args``);
2. offline ShareGPT (``--num-prompts`` N, request rate inf, ``ignore_eos`` so every
   request produces its dataset reply's length), then the same first ``--hf-num-prompts``
   M prompts alone (the radixlm side of the baseline ratio);
3. generated shared prefix ``--gsp-num-groups`` x 16 (system 2048, question 128, output
   256), request rate inf, cache flushed first;
4. ShareGPT request-rate sweep (``--sweep-rates``, ``--sweep-num-prompts`` each): the TTFT /
   ITL versus request-rate curve;
5. stop the server, load the same checkpoint into transformers in this process and run
   ``hf-generate-batch`` (continuous batching) on the same M prompts.
(The sweep runs before the baseline so the server starts once.)

Writes under ``--out``: ``serving.jsonl`` (one record per run, ``tag`` names the step),
``plots/`` (TTFT / ITL CDFs per run, ``rate_curves.png``), ``summary.json`` (the
records' headline numbers, the throughput ratio on the M shared prompts, seconds per
step), ``server.log``.

The GPU host has no internet: pass ``--dataset-path`` a ShareGPT JSON-lines file made
here with
    python -c "from radixlm.runtime.bench.sharegpt import write_subset; \\
               write_subset('.gpu_data/sharegpt_subset.jsonl', 1400)"
(the packaged file's first 1400 records, 9 MB; 1000 pass the ShareGPT filter, the
1000-prompt runs of BENCHMARKS.md), and ``--tokenizer-dir`` the carried SmolLM2 tokenizer
files (as for gpu_e2e.py).

    . bench/gpu_env.sh && python3 bench/serving/gpu_serving.py --tokenizer-dir .gpu_tok \\
        --dataset-path .gpu_data/sharegpt_subset.jsonl --out $OUT

Streams: the benchmark client uses the native API; with ``--server-args "...
--stream-output"`` the server sends disjoint segments instead of the whole text so far in
every event (7 s of a 31 s 1000-prompt run went to the cumulative events, BENCHMARKS.md).

Time: set N, M, ``--gsp-num-groups`` and the sweep to fit the budget; a step that would
start after ``--budget-s`` (default 510) is skipped, ``summary.json`` is rewritten after
every step with each step's seconds (``--skip-gsp`` / ``--skip-sweep`` / ``--skip-hf``
drop steps). Rough guess at radixlm's current 8B speed (~1000 output tok/s at batch 32,
BENCHMARKS.md) and transformers' ~530: the defaults take ~8-9 min; ``--num-prompts 500
--hf-num-prompts 100 --gsp-num-groups 32 --sweep-rates 8 16 32 --sweep-num-prompts 64``
about half of that (not measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("e2e",)]
from gpu_e2e import DEVICE, build_checkpoint, server_flags, stream_generate  # noqa: E402

from radixlm.runtime.bench import serving as bench_serving  # noqa: E402
from radixlm.runtime.bench.server_process import ServerProcess  # noqa: E402

HEADLINE = ("tag", "backend", "dataset_name", "num_prompts", "request_rate", "completed",
            "failed", "duration_s", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms",
            "prefix_cache_hit_rate", "kv_usage_mean", "kv_usage_max")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "gpu_serving",
                    help="output directory (default: bench/results/gpu_serving/)")
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    ap.add_argument("--dataset-path", required=True, help="ShareGPT JSON / JSON lines")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--server-args", default="")
    ap.add_argument("--hf-args", default="", help="extra `bench serving` flags for the "
                    "baseline, e.g. '--hf-cb-num-blocks 64' (a CPU dry run needs a cap)")
    ap.add_argument("--num-prompts", type=int, default=1000, help="offline ShareGPT requests")
    ap.add_argument("--hf-num-prompts", type=int, default=200,
                    help="the first M of those for the transformers baseline (and radixlm alone)")
    ap.add_argument("--gsp-num-groups", type=int, default=64)
    ap.add_argument("--sweep-rates", type=float, nargs="+", default=[4.0, 8.0, 16.0, 32.0])
    ap.add_argument("--sweep-num-prompts", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=510.0,
                    help="a step that would start after this many seconds is skipped")
    ap.add_argument("--skip-gsp", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    return ap.parse_args()


class Runner:
    """Runs ``radixlm bench serving`` steps, appending to one JSONL and timing each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.jsonl = args.out / "serving.jsonl"
        self.plots = args.out / "plots"
        self.seconds: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self.extra: dict[str, dict] = {}  # results of steps that are not `bench serving` runs
        self.start = time.perf_counter()

    def random(self, n: int, concurrency: int) -> list[str]:
        """Random-token prompts of 512 tokens, 256 output tokens, at most ``concurrency``
        in flight: steady decode at that batch size (TPOT)."""
        return ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "256",
                "--random-range-ratio", "1.0", "--num-prompts", str(n), "--max-concurrency", str(concurrency),
                "--tokenizer", str(self.args.tokenizer_dir)]

    def timed(self, tag: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            self.extra[tag] = fn()
        except Exception as exc:
            traceback.print_exc()
            self.errors[tag] = f"{type(exc).__name__}: {exc}"
        self.seconds[tag] = time.perf_counter() - t0
        self.write_summary()

    def bench(self, tag: str, *flags: str, scrape: str | None = None) -> None:
        before = scheduler_counters(scrape) if scrape else None
        t0 = time.perf_counter()
        if t0 - self.start > self.args.budget_s:
            self.errors[tag] = f"skipped: {t0 - self.start:.0f} s > --budget-s"
            return
        argv = ["--tag", tag, "--seed", str(self.args.seed), "--output-file", str(self.jsonl),
                "--plot-dir", str(self.plots), "--disable-tqdm", *flags]
        print(f"\n### {tag}: radixlm bench serving {' '.join(argv)}", flush=True)
        try:  # one failed step must not cost the others' numbers
            bench_serving.main(argv)
        except (Exception, SystemExit) as exc:
            traceback.print_exc()
            self.errors[tag] = f"{type(exc).__name__}: {exc}"
        self.seconds[tag] = time.perf_counter() - t0
        if before is not None:
            after = scheduler_counters(scrape)
            delta = {k: after[k] - before[k] for k in after}
            steps = max(delta["radixlm:decode_steps_total"], 1)
            self.extra[f"{tag}-scheduler"] = dict(
                delta, busy_ms_per_forward_step=1e3 * delta["radixlm:scheduler_busy_seconds_total"]
                / max(delta["radixlm:forward_steps_total"], 1), decode_steps=steps,
                busy_ms_per_decode_step=1e3 * delta["radixlm:scheduler_decode_busy_seconds_total"] / steps)
        self.write_summary()  # after every step: a run killed later keeps what it measured

    def write_summary(self) -> dict:
        summary = summarize(self)
        (self.args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def sharegpt(self, n: int) -> list[str]:
        """ShareGPT flags: the same seed picks the first ``n`` of one shuffled order."""
        return ["--dataset-name", "sharegpt", "--dataset-path", self.args.dataset_path,
                "--num-prompts", str(n), "--tokenizer", str(self.args.tokenizer_dir)]


def serve_and_bench(run: Runner, model_dir: Path) -> None:
    args = run.args
    flags = server_flags(model_dir, f"--dtype bfloat16 {args.server_args}")
    with open(args.out / "server.log", "w") as log, \
            ServerProcess.launch(flags, log=log, startup_timeout=600) as srv:
        # the runs share prompts: the radix cache is flushed before each, or a warm cache
        # would inflate the later ones
        url = ["--base-url", srv.url, "--flush-cache"]
        run.bench("sharegpt-offline", *url, *run.sharegpt(args.num_prompts), scrape=srv.url)
        run.bench("sharegpt-offline-baseline-prompts", *url, *run.sharegpt(args.hf_num_prompts))
        if not args.skip_gsp:
            run.bench("gsp", *url, "--dataset-name", "generated-shared-prefix",
                      "--gsp-num-groups", str(args.gsp_num_groups), "--gsp-prompts-per-group",
                      "16", "--gsp-system-prompt-len", "2048", "--gsp-question-len", "128",
                      "--gsp-output-len", "256", "--tokenizer", str(args.tokenizer_dir))
        run.bench("decode-batch1", *url, *run.random(3, 1))
        run.bench("decode-batch64", *url, *run.random(128, 64), scrape=srv.url)
        for k in range(5):  # five cold / cached pairs: the ratio moves by ~0.01 between them
            run.timed(f"prefix-ttft-4k-{k}", lambda: prefix_ttft_4k(srv.url))
        if not args.skip_sweep:
            rates = [str(r) for r in args.sweep_rates]
            run.bench("sharegpt-rate-sweep", *url, *run.sharegpt(args.sweep_num_prompts),
                      "--request-rate", *rates)
        print(f"server exit code {srv.stop()}", flush=True)


def scheduler_counters(url: str) -> dict[str, float]:
    """The scheduler's cumulative step counters and busy time from /metrics."""
    import httpx

    keys = ("radixlm:forward_steps_total", "radixlm:decode_steps_total", "radixlm:scheduler_busy_seconds_total",
            "radixlm:scheduler_decode_busy_seconds_total")
    values = dict.fromkeys(keys, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


def prefix_ttft_4k(url: str, vocab: int = 49152, new_tokens: int = 8) -> dict:
    """TTFT of a 4096-token prompt cold vs with its first 3968 tokens cached, and whether
    the greedy outputs are identical. Kernels are warmed up on another 4K prompt first."""
    import random as rnd

    import httpx

    def generate(ids: list[int], n: int) -> tuple[float, list[int], int]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        t0, stamps, last = stream_generate(url, body)
        return stamps[0] - t0, last["output_ids"], last["meta_info"]["cached_tokens"]

    r = rnd.Random(7)
    prompt = [r.randrange(3, vocab) for _ in range(4096)]
    flush = lambda: httpx.post(f"{url}/flush_cache", timeout=60)  # noqa: E731
    generate([r.randrange(3, vocab) for _ in range(4096)], 2)  # warm-up: compile, allocate
    flush()
    cold, cold_out, cold_cached = generate(prompt, new_tokens)
    flush()
    generate(prompt[:3968], 1)  # caches exactly 248 pages
    warm, warm_out, warm_cached = generate(prompt, new_tokens)
    return {"cold_ttft_s": cold, "cached_ttft_s": warm, "ratio": warm / cold, "cold_cached_tokens": cold_cached,
            "cached_tokens": warm_cached, "identical_greedy": cold_out == warm_out, "cold_output": cold_out,
            "cached_output": warm_out}


def summarize(run: Runner) -> dict:
    text = run.jsonl.read_text() if run.jsonl.exists() else ""
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    by_tag = {}
    for rec in records:
        by_tag.setdefault(rec["tag"], []).append({k: rec.get(k) for k in HEADLINE})
    summary = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
               "args": {k: str(v) for k, v in vars(run.args).items()},
               "seconds": run.seconds, "errors": run.errors, "runs": by_tag, "extra": run.extra}
    ours = by_tag.get("sharegpt-offline-baseline-prompts")
    hf = by_tag.get("hf-generate-batch")
    if ours and hf and hf[0]["output_throughput"]:
        summary["output_throughput_ratio_vs_generate_batch"] = (
            ours[0]["output_throughput"] / hf[0]["output_throughput"])
    return summary


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run = Runner(args)
    t0 = time.perf_counter()
    model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir,
                                        args.models_root / "bfloat16")
    del model  # the server and the baseline load the saved checkpoint themselves
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    run.seconds["checkpoint"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    serve_and_bench(run, model_dir)
    run.seconds["server_total"] = time.perf_counter() - t0
    if not args.skip_hf:
        run.bench("hf-generate-batch", "--backend", "hf-generate-batch", "--model-path",
                  str(model_dir), "--device", DEVICE, "--dtype", "bfloat16",
                  *run.sharegpt(args.hf_num_prompts), *args.hf_args.split())
    print(json.dumps(run.write_summary(), indent=1))


if __name__ == "__main__":
    main()
