"""Timeline of a cached-prefix first token in process (session 33, 2026-12-05): the
scenario of bench/profile_prefix_step.py (a 4096-token prompt, its first 3968 tokens
cached; control: a fresh 128-token prompt), with a wall-clock mark at the start and end of
each call on the way (plan, launch, the page-table sync, each CUDA graph replay, the LM
head, sampling, the wait for the device) and CUDA events around each graph replay (the
device time of the extend and decode graphs). No cProfile.

    . bench/gpu_env.sh && python3 bench/gpu_results/s33/first_token_timeline.py llama3-8b $OUT

Prints and writes first_token_timeline_<shape>.json: per kind of run, the median
milliseconds after ``handle`` at which each call began (>) and ended (<), its first two
calls in the run (the second as key2), and the median device milliseconds of each graph replay.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "bench")
from gpu_e2e import build_checkpoint  # noqa: E402
from profile_prefix_step import first_token_s  # noqa: E402

from radixlm.runtime.executor import model_runner as mr  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner, PendingStep  # noqa: E402
from radixlm.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

MARKS: list[tuple[str, float, float]] = []  # (call, start, end), perf_counter seconds
EVENTS: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
CUDA = torch.cuda.is_available()  # on the CPU (a check of this script): no events, no graphs


def mark(obj, name: str, key: str, events: bool = False) -> None:
    fn = getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        if events:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        try:
            return fn(*a, **k)
        finally:
            if events:
                e1.record()
                EVENTS.append((key, e0, e1))
            MARKS.append((key, t0, time.perf_counter()))

    setattr(obj, name, timed)


def main() -> None:
    shape, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    model_dir, model = build_checkpoint(shape, Path(".gpu_tok"), Path("/tmp/models/bfloat16"))
    del model
    server = ServerArgs(model_path=str(model_dir), device="cuda" if CUDA else "cpu",
                        max_total_tokens=4 * 4096 + 4096, dtype="bfloat16" if CUDA else "float32",
                        context_length=4096 + 256)
    runner = ModelRunner(server)
    sched = Scheduler(server, runner)
    rng = random.Random(7)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 40000) for _ in range(n)]

    prompt = ids(4096)
    first_token_s(sched, "warm", ids(4096), 2)
    first_token_s(sched, "warm-short", ids(128), 2)
    mark(sched.planner, "plan", "plan")
    mark(sched.cache, "match_and_lock", "match_and_lock")
    mark(runner, "launch", "launch")
    if CUDA:
        mark(runner.graph_runner, "_sync_tables", "sync_tables")
        mark(torch.cuda.CUDAGraph, "replay", "graph.replay", events=True)
    mark(runner.model, "compute_logits", "compute_logits")
    mark(runner, "_sampling_batch", "sampling_batch")
    mark(mr, "sample", "sample")
    mark(PendingStep, "collect", "collect")
    mark(torch.cuda.Event, "synchronize", "event.sync")
    runs: dict[str, list[dict]] = {"cached": [], "control": []}
    gpu: dict[str, list[float]] = {}
    for i in range(8):
        for kind in ("cached", "control"):
            assert sched.cache.flush()
            if kind == "cached":
                first_token_s(sched, f"seed{i}", prompt[:3968], 1)
            if CUDA:
                torch.cuda.synchronize()
            MARKS.clear()
            EVENTS.clear()
            t0 = time.perf_counter()
            ttft = first_token_s(sched, f"{kind}{i}", prompt if kind == "cached" else ids(128), 2)
            if CUDA:
                torch.cuda.synchronize()
            seen: dict[str, float] = {"ttft": ttft * 1e3}
            for key, s, e in MARKS:
                if s - t0 > ttft:
                    continue
                if f"{key}>" in seen:  # its second call: key2
                    key += "2"
                seen.setdefault(f"{key}>", (s - t0) * 1e3)
                seen.setdefault(f"{key}<", (e - t0) * 1e3)
            runs[kind].append(seen)
            for n, (_key, e0, e1) in enumerate(EVENTS[:3]):
                gpu.setdefault(f"{kind} replay{n}", []).append(e0.elapsed_time(e1))
    res: dict = {"shape": shape, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for kind, rows in runs.items():
        rows = rows[2:]
        keys = sorted({k for r in rows for k in r}, key=lambda k: statistics.median(r[k] for r in rows if k in r))
        res[kind] = {k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in keys}
    res["device_ms"] = {k: round(statistics.median(v[2:]), 3) for k, v in gpu.items()}
    (out / f"first_token_timeline_{shape}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
