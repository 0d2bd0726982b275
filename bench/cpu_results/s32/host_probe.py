"""The CPU proxy's decode step (``profile_step.py --shape tiny --vocab 512 --stub-model
--churn 256 --batch 64``) with a wall-clock timer around each part of a step instead of
cProfile (which doubles Python-heavy parts): per part, the mean microseconds per call and
the calls per decode step. Run from the checkout root:

    GPU_E2E_DEVICE=cpu .venv/bin/python bench/cpu_results/s32/host_probe.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = ["bench", "bench/gpu_results/s31"]
from gpu_e2e import build_checkpoint  # noqa: E402
from launch_probe import CALLS, wrap  # noqa: E402  (a timer around each call, session 31)
from profile_step import HostOnlyGraphs, churn  # noqa: E402

from radixlm.runtime.executor.cuda_graph_runner import CudaGraphRunner, PageTableRows  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner, PendingStep  # noqa: E402
from radixlm.runtime.scheduler import planner as schedule_policy  # noqa: E402
from radixlm.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402


def main() -> None:
    model_dir, model = build_checkpoint("tiny", Path(".gpu_tok"), Path("/tmp/models/bfloat16"), vocab=512)
    vocab = model.config.vocab_size
    del model
    server = ServerArgs(model_path=str(model_dir), device="cpu", max_running_requests=64,
                        max_total_tokens=64 * 1024, dtype="float32")
    runner = ModelRunner(server)
    hidden = torch.zeros(4096, runner.config.hidden_size)
    logits = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0))
    runner.model.forward = lambda batch, pool: hidden[: batch.input_ids.shape[0]]
    runner.model.compute_logits = lambda h, out=None: logits[: h.shape[0]]
    runner.graph_runner = HostOnlyGraphs(runner, logits)
    for cls, name in [(Scheduler, "serve_once"), (Scheduler, "_process_results"), (Scheduler, "_advance"),
                      (schedule_policy.BatchPlanner, "_schedule_running"), (ModelRunner, "launch"),
                      (ModelRunner, "_replay_decode"), (CudaGraphRunner, "replay"),
                      (CudaGraphRunner, "_sync_tables"), (PageTableRows, "sync"), (ModelRunner, "_sample"),
                      (PendingStep, "collect"), (Scheduler, "_flush")]:
        wrap(cls, name, f"{cls.__name__}.{name}")
    sched = Scheduler(server, runner)
    args = argparse.Namespace(churn=256, batch=64, no_profile=True, out=Path("/tmp/host_probe"), shape="tiny")
    churn(sched, args, vocab, random.Random(0))
    steps = sched.counters["decode_steps"]
    for key, xs in CALLS.items():
        xs = xs[len(xs) // 10:]
        if xs:
            print(f"{key:40s} mean {statistics.mean(xs) * 1e6:7.1f} us  median {statistics.median(xs) * 1e6:7.1f}"
                  f"  calls/decode step {len(xs) / steps / 0.9:.2f}")


if __name__ == "__main__":
    main()
