"""GPU serving benchmark: radixlm vs transformers ``generate_batch`` on the same GPU, same
weights, same ShareGPT prompts, with ``radixlm bench serving`` (runtime/bench_serving.py).

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
    python -c "from radixlm.runtime.sharegpt import write_subset; \\
               write_subset('bench/sharegpt_subset.jsonl', 4000)"
(the packaged file's first 4000 records, 28 MB; 3451 pass the ShareGPT filter),
and ``--tokenizer-dir`` the carried SmolLM2 tokenizer files (as for gpu_e2e.py).

    . bench/gpu_env.sh && python3 bench/gpu_serving.py --tokenizer-dir .gpu_tok \\
        --dataset-path bench/sharegpt_subset.jsonl --out $OUT

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import DEVICE, build_checkpoint, server_flags  # noqa: E402

from radixlm.runtime import bench_serving  # noqa: E402
from radixlm.runtime.server_process import ServerProcess  # noqa: E402

HEADLINE = ("tag", "backend", "dataset_name", "num_prompts", "request_rate", "completed",
            "failed", "duration_s", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms",
            "prefix_cache_hit_rate", "kv_usage_mean", "kv_usage_max")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
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
        self.start = time.perf_counter()

    def bench(self, tag: str, *flags: str) -> None:
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
        run.bench("sharegpt-offline", *url, *run.sharegpt(args.num_prompts))
        run.bench("sharegpt-offline-baseline-prompts", *url, *run.sharegpt(args.hf_num_prompts))
        if not args.skip_gsp:
            run.bench("gsp", *url, "--dataset-name", "generated-shared-prefix",
                      "--gsp-num-groups", str(args.gsp_num_groups), "--gsp-prompts-per-group",
                      "16", "--gsp-system-prompt-len", "2048", "--gsp-question-len", "128",
                      "--gsp-output-len", "256", "--tokenizer", str(args.tokenizer_dir))
        if not args.skip_sweep:
            rates = [str(r) for r in args.sweep_rates]
            run.bench("sharegpt-rate-sweep", *url, *run.sharegpt(args.sweep_num_prompts),
                      "--request-rate", *rates)
        print(f"server exit code {srv.stop()}", flush=True)


def summarize(run: Runner) -> dict:
    text = run.jsonl.read_text() if run.jsonl.exists() else ""
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    by_tag = {}
    for rec in records:
        by_tag.setdefault(rec["tag"], []).append({k: rec.get(k) for k in HEADLINE})
    summary = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
               "args": {k: str(v) for k, v in vars(run.args).items()},
               "seconds": run.seconds, "errors": run.errors, "runs": by_tag}
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
