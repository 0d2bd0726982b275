"""radixlm and vLLM served side by side on one GPU, driven by the same client.

Both servers load the same checkpoint (random bf16 weights of the Llama-3-8B shape,
``gpu_e2e.build_checkpoint``), get the same limits (1024 running requests, a 16,384-token
prefill budget, 85% of the GPU's memory: radixlm's default ``--mem-fraction-static``) and
run the same workloads through ``radixlm bench serving --backend openai`` (the
``/v1/completions`` route of each; same prompts, same seed, ``ignore_eos``, greedy):

* ``start-cold``: seconds from launching the server, with empty compile caches (Triton,
  TorchInductor, vLLM's), to the first served completion; ``start-warm``: the same with
  the caches the cold start filled (measured last, on a second launch);
* ``warmup``: 256 other ShareGPT prompts all at once, recorded but not compared (vLLM
  compiles at start-up, radixlm compiles its kernels during its first batches);
* ``sharegpt``: ShareGPT prompts all at once (``--num-prompts``, default 1000);
* ``gsp``: generated shared prefix, 64 groups x 16 questions (system 2048, question 128,
  output 256 tokens), all at once;
* ``multiturn``: ShareGPT conversations, each a client sending its next turn after a 1 s
  mean think time, the history re-sent as the prompt;
* ``sweep``: ShareGPT at several request rates (TTFT / ITL versus load);
* ``batch1``: one request at a time, 512-token prompt, 512 new tokens (time per output
  token);
* peak GPU memory used while the server ran (``nvidia-smi``, the whole device, minus what
  was in use before it started);
* binaries compiled during each step (cubin files that appeared in the engine's compile
  caches: Triton's, TorchInductor's, vLLM's), so a step slowed down by JIT compilation in
  the middle of serving shows it.

``--radixlm-variant NAME=FLAGS`` (repeatable) adds radixlm runs with extra launch_server
flags, recorded as engine ``radixlm:NAME``: settings compared against vLLM in one call.

The prefix cache is flushed before every workload (radixlm ``/flush_cache``, vLLM
``/reset_prefix_cache`` with ``VLLM_SERVER_DEV_MODE=1``). Each engine runs alone on the
GPU; ``--engines`` picks which (one per device call when a call's time limit is short: the
second call appends to the same ``--out``).

Writes ``--out``/``side_by_side.jsonl`` (``bench serving`` records; ``tag`` is
``<engine>/<workload>``), ``engines.json`` (start times, peak memory, versions, seconds per
step) and the servers' logs. ``python3 bench/serving/side_by_side.py report --out DIR``
prints the table (radixlm / vLLM per metric) and draws the figures from those files.

On the GPU host (vLLM from ``../shared/tools/peer_vllm.sh``, unpacked to /tmp/vsite):

    . bench/gpu_env.sh && python3 bench/serving/side_by_side.py run --engines radixlm vllm \\
        --tokenizer-dir .gpu_tok --dataset-path .gpu_data/sharegpt_subset.jsonl --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
WORKLOADS = ("warmup", "sharegpt", "gsp", "multiturn", "sweep", "batch1")
ENGINES = ("radixlm", "vllm")
SERVED_NAME = "default"
HEADLINE = ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "mean_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms",
            "prefix_cache_hit_rate", "kv_usage_max")


def engine_command(engine: str, model_dir: Path, port: int, args: argparse.Namespace) -> tuple[list[str], dict, str]:
    """(argv, environment, working directory) of one engine's OpenAI-compatible server;
    ``engine`` is "vllm", "radixlm" or "radixlm:NAME" (a ``--radixlm-variant``)."""
    env = dict(os.environ)
    if engine.startswith("radixlm"):
        variant = dict(args.radixlm_variant)[engine.partition(":")[2]] if ":" in engine else ""
        argv = [sys.executable, "-m", "radixlm.runtime.launch_server", "--model-path", str(model_dir),
                "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-running-requests", "1024",
                "--max-prefill-tokens", "16384", "--mem-fraction-static", str(args.mem_fraction),
                "--log-level", "warning", "--host", "127.0.0.1", "--port", str(port), *args.radixlm_args.split(),
                *variant.split()]
        return argv, env, str(REPO)
    # vLLM from its own site folder only, started outside the checkout: a top-level folder
    # of this repository (kernels/) would shadow a package of the same name
    env.update(PYTHONPATH=args.vllm_site, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_SERVER_DEV_MODE="1",
               VLLM_NO_USAGE_STATS="1")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-num-seqs", "1024",
            "--max-num-batched-tokens", "16384", "--gpu-memory-utilization", str(args.mem_fraction),
            "--host", "127.0.0.1", "--port", str(port), *args.vllm_args.split()]
    return argv, env, tempfile.gettempdir()


class GpuMemory:
    """Peak device memory used (MiB, ``nvidia-smi``) while ``with`` is open, minus the use
    when it opened. None without nvidia-smi."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s, self.peak, self.base = period_s, None, None
        self._stop = threading.Event()

    @staticmethod
    def used_mib() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", "0"], capture_output=True, text=True, timeout=10, check=True).stdout
            return float(out.strip().splitlines()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            used = self.used_mib()
            if used is not None:
                self.peak = used if self.peak is None else max(self.peak, used)

    def __enter__(self) -> GpuMemory:
        self.base = self.used_mib()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mib(self) -> float | None:
        return None if self.peak is None or self.base is None else self.peak - self.base


def compiled_binaries(caches: Path) -> int:
    """Compiled GPU binaries (``*.cubin``) under an engine's compile caches."""
    return sum(1 for _ in caches.rglob("*.cubin"))


def first_completion(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Poll ``/v1/completions`` (1 token) until it answers 200; returns the time it did
    (``time.perf_counter``). RuntimeError if the server exits or ``timeout_s`` passes."""
    import httpx

    deadline = time.perf_counter() + timeout_s
    body = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200:
                return time.perf_counter()
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"no completion after {timeout_s:.0f} s")


class Server:
    """One engine's server process; ``start_s`` = launch -> first served completion."""

    def __init__(self, engine: str, model_dir: Path, args: argparse.Namespace, log: Path, caches: Path) -> None:
        from radixlm.runtime.bench.server_process import free_port

        port = free_port()
        argv, env, cwd = engine_command(engine, model_dir, port, args)
        # compile caches of both engines live under ``caches``: empty = a cold start
        env.update(TRITON_CACHE_DIR=str(caches / "triton"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
                   VLLM_CACHE_ROOT=str(caches / "vllm"))
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "a")
        self.log.write(f"$ {' '.join(argv)}\n")
        self.log.flush()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self.start_s = first_completion(self.url, self.proc, args.startup_timeout) - t0
        except BaseException:
            self.stop()
            raise

    def stop(self) -> int:
        from radixlm.runtime.bench.server_process import ServerProcess

        code = ServerProcess(self.proc, self.url).stop()
        self.log.close()
        return code


def workload_flags(name: str, args: argparse.Namespace) -> list[str]:
    tok = ["--tokenizer", str(args.tokenizer_dir)]
    sharegpt = ["--dataset-name", "sharegpt", "--dataset-path", args.dataset_path, *tok]
    if name == "warmup":  # compiles what a first run would (radixlm compiles kernels lazily)
        return [*sharegpt, "--num-prompts", "256", "--seed", str(args.seed + 1)]
    if name == "sharegpt":
        return [*sharegpt, "--num-prompts", str(args.num_prompts)]
    if name == "gsp":
        return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "64", "--gsp-prompts-per-group",
                "16", "--gsp-system-prompt-len", "2048", "--gsp-question-len", "128", "--gsp-output-len", "256",
                *tok]
    if name == "multiturn":
        return ["--dataset-name", "sharegpt-multiturn", "--dataset-path", args.dataset_path, *tok,
                "--num-prompts", str(args.multiturn_conversations), "--multiturn-max-turns", "4",
                "--multiturn-think-time", "1.0", "--request-rate", str(args.multiturn_rate)]
    if name == "sweep":
        return [*sharegpt, "--num-prompts", str(args.sweep_num_prompts), "--request-rate",
                *map(str, args.sweep_rates)]
    if name == "batch1":
        return ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "512",
                "--random-range-ratio", "1.0", "--num-prompts", "3", "--max-concurrency", "1", *tok]
    raise ValueError(name)


def run_engine(engine: str, model_dir: Path, args: argparse.Namespace, info: dict, t_start: float) -> None:
    from radixlm.runtime.bench import serving as bench_serving

    slug = engine.replace(":", "-")  # radixlm:NAME -> radixlm-NAME in file names
    caches = Path(tempfile.mkdtemp(prefix=f"compile-caches-{slug}-"))
    rec = info.setdefault(engine, {"seconds": {}, "errors": {}})
    compiled = rec.setdefault("compiled", {})
    log = args.out / f"{slug}_server.log"
    with GpuMemory() as mem:
        t0 = time.perf_counter()
        server = Server(engine, model_dir, args, log, caches)
        rec["start_cold_s"] = server.start_s
        rec["seconds"]["start-cold"] = time.perf_counter() - t0
        compiled["start-cold"] = seen = compiled_binaries(caches)
        print(f"[{engine}] cold start: {server.start_s:.1f} s, {seen} binaries compiled", flush=True)
        try:
            for name in args.workloads:
                if time.perf_counter() - t_start > args.budget_s:
                    rec["errors"][name] = "skipped: over --budget-s"
                    continue
                t0 = time.perf_counter()
                argv = ["--backend", "openai", "--base-url", server.url, "--model", SERVED_NAME, "--flush-cache",
                        "--tag", f"{engine}/{name}", "--seed", str(args.seed), "--disable-tqdm",
                        "--output-file", str(args.out / "side_by_side.jsonl"), *workload_flags(name, args)]
                print(f"\n### {engine}/{name}: radixlm bench serving {' '.join(argv)}", flush=True)
                try:  # one failed step must not cost the others' numbers
                    bench_serving.main(argv)
                except (Exception, SystemExit) as exc:
                    traceback.print_exc()
                    rec["errors"][name] = f"{type(exc).__name__}: {exc}"
                rec["seconds"][name] = time.perf_counter() - t0
                now = compiled_binaries(caches)
                compiled[name], seen = now - seen, now
                save_info(args, info)
        finally:
            rec["exit_code"] = server.stop()
    rec["peak_gpu_memory_mib"] = mem.peak_mib
    if time.perf_counter() - t_start <= args.budget_s:
        t0 = time.perf_counter()
        try:
            server = Server(engine, model_dir, args, log, caches)
            rec["start_warm_s"] = server.start_s
            server.stop()
            compiled["start-warm"] = compiled_binaries(caches) - seen
            print(f"[{engine}] warm start: {rec['start_warm_s']:.1f} s", flush=True)
        except RuntimeError as exc:
            rec["errors"]["start-warm"] = str(exc)
        rec["seconds"]["start-warm"] = time.perf_counter() - t0
    shutil.rmtree(caches, ignore_errors=True)
    save_info(args, info)


def save_info(args: argparse.Namespace, info: dict) -> None:
    (args.out / "engines.json").write_text(json.dumps(info, indent=1))


def cmd_run(args: argparse.Namespace) -> None:
    import torch

    sys.path[:0] = [str(BENCH / "e2e")]
    from gpu_e2e import build_checkpoint

    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    path = args.out / "engines.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    info.setdefault("host", {}).update(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                       torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M"))
    model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir, args.models_root)
    del model
    torch.cuda.empty_cache()
    info["host"]["checkpoint_s"] = time.perf_counter() - t_start
    for engine in [*args.engines, *(f"radixlm:{name}" for name, _ in args.radixlm_variant)]:
        try:
            run_engine(engine, model_dir, args, info, t_start)
        except Exception as exc:  # the other engine still runs
            traceback.print_exc()
            info.setdefault(engine, {}).setdefault("errors", {})["start-cold"] = f"{type(exc).__name__}: {exc}"
            save_info(args, info)


def load(out: Path) -> tuple[dict, dict[str, dict[str, list[dict]]]]:
    info = json.loads((out / "engines.json").read_text())
    runs: dict[str, dict[str, list[dict]]] = {}
    for line in (out / "side_by_side.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            engine, _, workload = rec["tag"].partition("/")
            runs.setdefault(workload, {}).setdefault(engine, []).append(rec)
    return info, runs


def _fmt(v: object) -> str:
    return "n/a" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def cmd_report(args: argparse.Namespace) -> None:
    """Print each radixlm run (the default and any variants) beside vLLM per workload and
    metric, with radixlm / vLLM ratios; draw the rate-sweep figure."""
    info, runs = load(args.out)
    ours = [e for e in info if e.startswith("radixlm")]
    engines = [*ours, *(["vllm"] if "vllm" in info else [])]
    print("| metric | " + " | ".join(engines) + " | " + " | ".join(f"{e} / vLLM" for e in ours) + " |")
    print("|---" * (1 + len(engines) + len(ours)) + "|")

    def row(label: str, values: list) -> None:
        peer = values[-1] if "vllm" in info else None
        ratios = [_ratio(v, peer) for v in values[: len(ours)]]
        print(f"| {label} | " + " | ".join(map(_fmt, values)) + " | " + " | ".join(ratios) + " |")

    for label, key in (("start to first completion, cold (s)", "start_cold_s"),
                       ("start to first completion, warm (s)", "start_warm_s"),
                       ("peak GPU memory (MiB)", "peak_gpu_memory_mib")):
        row(label, [info[e].get(key) for e in engines])
    for step in ("start-cold", *WORKLOADS, "start-warm"):
        counts = [info[e].get("compiled", {}).get(step) for e in engines]
        if any(c is not None for c in counts):
            row(f"binaries compiled during {step}", counts)
    for workload in WORKLOADS:
        per_engine = [runs.get(workload, {}).get(e, []) for e in engines]
        for i in range(max(map(len, per_engine), default=0)):
            recs = [r[i] if i < len(r) else {} for r in per_engine]
            rate = next((r.get("request_rate") for r in recs if r), None) or "inf"
            for key in HEADLINE:
                row(f"{workload} rate {rate}: {key}", [r.get(key) for r in recs])
    sweep = [r for engine in engines for r in runs.get("sweep", {}).get(engine, [])]
    if sweep and args.plot:
        plot_sweep(sweep, engines, args.plot)
        print(f"wrote {args.plot}")


def plot_sweep(records: list[dict], engines: list[str], path: Path) -> None:
    """Median TTFT, median ITL and output throughput versus request rate, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (("median_ttft_ms", "median TTFT (ms)"), ("median_itl_ms", "median ITL (ms)"),
              ("output_throughput", "output tokens/s"))
    for engine in engines:
        recs = sorted((r for r in records if r["tag"].startswith(f"{engine}/")), key=lambda r: r["request_rate"])
        if not recs:
            continue
        rates = [r["request_rate"] for r in recs]
        for ax, (key, label) in zip(axes, panels, strict=True):
            ax.plot(rates, [r[key] for r in recs], marker="o", label=engine)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("ShareGPT served, same GPU, same client (bench serving --backend openai)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _variant(text: str) -> tuple[str, str]:
    name, sep, flags = text.partition("=")
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS with NAME of letters, digits, - and _, got {text!r}")
    return name, flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="start each engine and run the workloads")
    run.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    run.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    run.add_argument("--tokenizer-dir", type=Path, required=True)
    run.add_argument("--dataset-path", required=True, help="ShareGPT JSON / JSON lines")
    run.add_argument("--shape", default="llama3-8b")
    run.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    run.add_argument("--vllm-site", default="/tmp/vsite", help="PYTHONPATH of the vLLM server")
    run.add_argument("--mem-fraction", type=float, default=0.85, help="GPU memory fraction of both engines")
    run.add_argument("--radixlm-args", default="", help="extra launch_server flags")
    run.add_argument("--radixlm-variant", type=_variant, action="append", default=[], metavar="NAME=FLAGS",
                     help="also run radixlm with these extra flags, as engine radixlm:NAME (repeatable)")
    run.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    run.add_argument("--num-prompts", type=int, default=1000)
    run.add_argument("--multiturn-conversations", type=int, default=200)
    run.add_argument("--multiturn-rate", type=float, default=8.0, help="conversation starts per second")
    run.add_argument("--sweep-rates", type=float, nargs="+", default=[8.0, 16.0, 32.0])
    run.add_argument("--sweep-num-prompts", type=int, default=200)
    run.add_argument("--startup-timeout", type=float, default=400.0)
    run.add_argument("--budget-s", type=float, default=540.0, help="no step starts after this many seconds")
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("report", help="the radixlm (and variants) / vLLM table and the sweep figure")
    rep.add_argument("--out", type=Path, required=True)
    rep.add_argument("--plot", type=Path, help="PNG of the rate sweep")
    args = ap.parse_args()
    cmd_run(args) if args.cmd == "run" else cmd_report(args)


if __name__ == "__main__":
    main()
