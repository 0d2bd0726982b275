"""Where the GPU host's decode-step host time goes (session 31, 2026-12-05): the churn loop of
bench/profile_step.py (256 requests, 64 in flight, 8B shape) with a wall-clock timer around
each CUDA-facing call of a decode launch (no cProfile: it made ``CUDAGraph.replay`` look 10x
dearer), then ``CUDAGraph.replay`` of the bucket-64 graph alone in eight settings (back to
back, synchronised each time, the server's overlap order, after a 2 ms sleep or spin ...).

    . bench/gpu_env.sh && python3 bench/gpu_results/s31/launch_probe.py llama3-8b $OUT

Writes launch_probe_<shape>.json: per call median / p90 / mean microseconds (first 10% of
the calls dropped) and each experiment's replay() host time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "bench")
from gpu_e2e import build_checkpoint  # noqa: E402
from profile_step import churn  # noqa: E402

from radixlm.runtime.executor import model_runner as mr  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

CALLS: dict[str, list[float]] = {}


def wrap(obj, name: str, key: str) -> None:
    """Replace ``obj.name`` by a wrapper appending each call's seconds to CALLS[key]."""
    fn, seconds = getattr(obj, name), CALLS.setdefault(key, [])

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(obj, name, timed)


def summary(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"n": len(us), "median_us": statistics.median(us), "p90_us": us[int(len(us) * 0.9)],
            "max_us": us[-1], "mean_us": sum(us) / len(us)}


def main() -> None:
    shape, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    model_dir, model = build_checkpoint(shape, Path(".gpu_tok"), Path("/tmp/models/bfloat16"))
    vocab = model.config.vocab_size
    del model
    server = ServerArgs(model_path=str(model_dir), device="cuda", max_running_requests=64,
                        max_total_tokens=64 * 1024, dtype="bfloat16")
    runner = ModelRunner(server)
    sched = Scheduler(server, runner)
    wrap(torch.cuda.CUDAGraph, "replay", "graph.replay")
    wrap(runner.model, "compute_logits", "compute_logits")
    wrap(mr, "sample", "sample")
    wrap(runner.graph_runner, "_sync_tables", "_sync_tables")
    wrap(runner, "launch", "runner.launch")
    wrap(torch.cuda.Event, "record", "event.record")
    wrap(runner, "_replay_decode", "_replay_decode")
    args = argparse.Namespace(churn=256, batch=64, no_profile=True, out=Path("/tmp/probe_churn"), shape=shape)
    churn(sched, args, vocab, random.Random(0))
    res = {"shape": shape}
    for key, seconds in CALLS.items():
        res[key] = summary(seconds[len(seconds) // 10:])
        print(key, res[key], flush=True)

    graphs = runner.graph_runner.graphs
    g64 = graphs[64]
    g56 = graphs.get(56) or graphs[min(graphs)]
    hidden = runner.graph_runner.outputs[64]
    state: dict[str, torch.cuda.Event] = {}

    def step_ops() -> torch.cuda.Event:  # the ops a decode launch queues after the replay
        ids = runner.model.compute_logits(hidden).argmax(-1) if hidden.shape[-1] != vocab else hidden.argmax(-1)
        ids.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return event

    def overlap(i: int) -> None:  # the server's order: launch k + 1, then wait for k
        g64.replay()
        event = step_ops()
        if "prev" in state:
            state["prev"].synchronize()
        state["prev"] = event

    def sync_then_launch(i: int) -> None:
        if "prev" in state:
            state["prev"].synchronize()
        g64.replay()
        state["prev"] = step_ops()

    def staging_copy(i: int) -> None:
        runner.graph_runner.inputs.copy_(runner.graph_runner._staging[i % 2], non_blocking=True)
        g64.replay()
        torch.cuda.synchronize()

    def spin(i: int) -> None:
        g64.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        while time.perf_counter() - t < 0.002:
            pass

    experiments = {
        "back_to_back": lambda i: g64.replay(),
        "sync_each": lambda i: (g64.replay(), torch.cuda.synchronize()),
        "overlap_like_server": overlap,
        "sync_then_launch": sync_then_launch,
        "alternate_buckets_sync": lambda i: ((g64 if i % 2 else g56).replay(), torch.cuda.synchronize()),
        "staging_copy_then_replay_sync": staging_copy,
        "sync_sleep2ms": lambda i: (g64.replay(), torch.cuda.synchronize(), time.sleep(0.002)),
        "sync_spin2ms": spin,
    }
    for name, body in experiments.items():
        state.clear()
        CALLS["graph.replay"].clear()
        torch.cuda.synchronize()
        for i in range(60):
            body(i)
        torch.cuda.synchronize()
        res["exp_" + name] = summary(CALLS["graph.replay"][5:])
        print(name, res["exp_" + name], flush=True)
    (out / f"launch_probe_{shape}.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
