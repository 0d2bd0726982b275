"""Host time of one decode CUDA-graph replay: the ``replay()`` call alone, with the GPU idle
(synchronised first) and with earlier replays still queued (back to back, as the overlap
scheduler launches a step while the previous one runs), against the graph's GPU time.

    . bench/gpu_env.sh && python3 bench/scheduler/graph_launch_cost.py --shape smollm2 --tokenizer-dir .gpu_tok

Random weights of the shape (``gpu_e2e.build_checkpoint``), the server's ModelRunner with
its CUDA graphs; prints microseconds per call (median over ``--reps``) per batch bucket.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("e2e",)]
from gpu_e2e import build_checkpoint  # noqa: E402

from radixlm.runtime.executor.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir, args.models_root / "bfloat16")
    del model
    runner = ModelRunner(ServerArgs(model_path=str(model_dir), device="cuda", dtype="bfloat16",
                                    max_running_requests=max(args.batch), max_total_tokens=max(args.batch) * 1024))
    graphs = runner.graph_runner.graphs
    for bs in args.batch:
        graph = graphs[bs]
        idle, queued = [], []
        for _ in range(args.reps):  # GPU idle at each call
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            idle.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):  # back to back: earlier replays still queued
            t0 = time.perf_counter()
            graph.replay()
            queued.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        gpu_us = start.elapsed_time(end) * 1e3 / args.reps
        print(f"{args.shape} bucket {bs}: replay() host time, GPU idle {statistics.median(idle) * 1e6:.1f} us, "
              f"back to back {statistics.median(queued) * 1e6:.1f} us (max {max(queued) * 1e6:.1f}); "
              f"GPU time per replay {gpu_us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
