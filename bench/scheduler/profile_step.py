"""Where the scheduler process's host time goes: the real Scheduler + ModelRunner in one
process (no HTTP), B streaming requests decoding, a cProfile of N steps.

    python bench/scheduler/profile_step.py --shape smollm2 --tokenizer-dir tok/ --batch 64 --out $OUT [--json-schema]

Prints ms per step (wall) and the top functions by own time and by cumulative time; on a
GPU the device work is queued asynchronously, so the profile is the host's share.

``--stub-model`` replaces the forward pass and the LM head with fixed outputs, so on the
CPU (``GPU_E2E_DEVICE=cpu``) the step time is the scheduler's and the model runner's host
work alone (plus sampling over ``--vocab`` logits). Decode steps then run the CUDA-graph
path's host code with nothing replayed (``HostOnlyGraphs``), as the GPU server's do;
``--eager`` takes the eager path (a ForwardBatch per step) instead::

    GPU_E2E_DEVICE=cpu python bench/scheduler/profile_step.py --shape tiny --vocab 512 --stub-model \
        --tokenizer-dir tok/ --batch 64 --no-profile --out /tmp/prof

``--no-profile`` also splits the step's host time into plan / launch / _advance /
_collect (collect includes waiting for the device). ``--churn N`` runs N requests through
``--batch`` slots, each finished one replaced at once (the serving benchmark's random
run at ``--max-concurrency``: the batch changes every few steps), each step as a turn of
the server loop (``Scheduler.serve_once``: the outputs encoded as for the socket), and
reports the scheduler's busy time per pure decode step, the figure the server exports.
``--num-scheduler-steps`` is the server flag (multi-step decode windows).
"""

from __future__ import annotations

import argparse
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
sys.path[:0] = [str(BENCH / d) for d in ("e2e", "serving", "structured")]
from bench_structured import SCHEMA  # noqa: E402
from gpu_e2e import DEVICE, build_checkpoint  # noqa: E402
from offline_trace import timed  # noqa: E402

from radixlm.runtime import messages as m  # noqa: E402
from radixlm.runtime.executor.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402


class HostOnlyGraphs(CudaGraphRunner):
    """``--stub-model`` on the CPU: a CudaGraphRunner whose replay runs its host code (slots,
    the incremental page-table rows, staging and the input copy) and "replays" nothing, so
    the step's host time follows the GPU server's decode path, not the eager one's."""

    def __init__(self, runner: ModelRunner, logits: torch.Tensor) -> None:  # no super(): nothing captured
        n, pages = runner.args.max_running_requests, -(-runner.context_length // runner.page_size)
        self._buffers(runner.model, runner.pool, n, pages, runner._prev_ids, 0, runner.max_decode_window)
        self.graphs = {bs: type("NoGraph", (), {"replay": lambda self: None})() for bs in self.batch_sizes}
        self.outputs = {bs: logits[:bs] for bs in self.batch_sizes}  # a decode graph's output: logits


def churn(sched: Scheduler, args: argparse.Namespace, vocab: int, rng: random.Random) -> None:
    """``--churn N``: N requests (512 random prompt tokens, 256 output tokens, greedy,
    ``ignore_eos``), ``--batch`` in flight, a finished one replaced at once (like the serving
    benchmark's random run at ``--max-concurrency``); prints the scheduler's busy time per
    pure decode step (the served counter) and, without ``--no-profile``, a cProfile."""
    sent = done = 0
    pending: list[m.GenerateReq] = []  # handled in the next loop turn, as the server does

    def send() -> None:
        nonlocal sent
        pending.append(m.GenerateReq(
            rid=f"c{sent}", input_ids=[rng.randrange(3, min(vocab, 40000)) for _ in range(512)], stream=True,
            sampling=m.SamplingParams(max_new_tokens=256, ignore_eos=True, temperature=0.0)))
        sent += 1

    class Sink:  # the loop's output socket without ZeroMQ: the message is encoded, then read here
        def send(self, msg) -> None:
            m.encode(msg)
            finished.extend(out.finish_reason is not None for out in getattr(msg, "outputs", ()))

    sink, finished = Sink(), []
    for _ in range(args.batch):
        send()
    prof = cProfile.Profile()
    if not args.no_profile:
        prof.enable()
    while done < args.churn:
        msgs, pending[:] = list(pending), []
        sched.serve_once(msgs, sink)  # a turn of the server loop: handle, step, encode and send
        for _ in range(sum(finished)):
            done += 1
            if sent < args.churn:
                send()
        finished.clear()
    prof.disable()
    c = sched.counters
    text = io.StringIO()
    if not args.no_profile:
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(50)
        args.out.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(args.out / f"churn_{args.shape}_b{args.batch}.prof")  # pstats.Stats(path)
    report = (f"churn {args.churn} at {args.batch}: {c['decode_steps']} decode steps, busy "
              f"{c['decode_busy_s'] / max(c['decode_steps'], 1) * 1e3:.3f} ms per decode step, "
              f"{c['busy_s'] / max(c['steps'], 1) * 1e3:.3f} ms per step\n{text.getvalue()}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"churn_{args.shape}_b{args.batch}{'_noprof' if args.no_profile else ''}.txt").write_text(report)
    print(report[:6000])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json-schema", action="store_true",
                    help="every request under bench_structured.py's JSON schema (no ignore_eos)")
    ap.add_argument("--no-profile", action="store_true", help="time the steps without cProfile")
    ap.add_argument("--disable-overlap-schedule", action="store_true",
                    help="read each step's tokens before planning the next (the server flag)")
    ap.add_argument("--vocab", type=int, help="override the shape's vocabulary size")
    ap.add_argument("--stub-model", action="store_true",
                    help="fixed hidden states and logits instead of the model (host work alone)")
    ap.add_argument("--churn", type=int, default=0,
                    help="N requests through --batch slots, finished ones replaced (see churn())")
    ap.add_argument("--eager", action="store_true",
                    help="--stub-model on the CPU: the eager path (ForwardBatch) instead of the graph path's host code")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="the server flag: multi-step decode windows of this many steps")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "profile_step",
                    help="output directory (default: bench/results/profile_step/)")
    args = ap.parse_args()
    model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir, args.models_root / "bfloat16",
                                        vocab=args.vocab)
    vocab = model.config.vocab_size
    del model
    server = ServerArgs(model_path=str(model_dir), device=DEVICE, max_running_requests=args.batch,
                        max_total_tokens=args.batch * 1024,
                        disable_overlap_schedule=args.disable_overlap_schedule,
                        num_scheduler_steps=args.num_scheduler_steps,
                        dtype="bfloat16" if DEVICE == "cuda" else "float32")
    runner = ModelRunner(server)
    if args.stub_model:
        hidden = torch.zeros(4096, runner.config.hidden_size, device=DEVICE)
        logits = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        runner.model.forward = lambda batch, pool: hidden[: batch.input_ids.shape[0]]
        runner.model.compute_logits = lambda h, out=None: logits[: h.shape[0]]
        if DEVICE == "cpu" and not args.eager:  # decode steps take the CUDA-graph path's host code
            runner.graph_runner = HostOnlyGraphs(runner, logits)
    sched = Scheduler(server, runner)
    rng = random.Random(0)
    if args.churn:
        churn(sched, args, vocab, rng)
        return
    schema = json.dumps(SCHEMA) if args.json_schema else None
    for i in range(args.batch):
        sched.handle(m.GenerateReq(
            rid=f"r{i}", input_ids=[rng.randrange(3, min(vocab, 40000)) for _ in range(300)], stream=True,
            sampling=m.SamplingParams(max_new_tokens=args.steps + 50, ignore_eos=not args.json_schema,
                                      temperature=0.0, json_schema=schema)))
    for _ in range(10):  # grammar compile, prefill, warm-up
        sched._safe_step()
        sched.take_outputs()
        while sched.grammar_waiting:
            time.sleep(0.01)
            sched._safe_step()
    parts = {"plan": (sched.planner, "plan"), "launch": (runner, "launch"), "advance": (sched, "_advance"),
             "collect": (sched, "_collect")}
    spent = dict.fromkeys(parts, 0.0)
    if args.no_profile:  # host time per part of a step (plan, launch, _advance, _collect)
        for name, (obj, attr) in parts.items():
            setattr(obj, attr, timed(getattr(obj, attr), spent, name))
    prof = cProfile.Profile()
    steps = []
    if not args.no_profile:
        prof.enable()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        sched._safe_step()
        sched.take_outputs()
        steps.append(time.perf_counter() - t0)
    prof.disable()
    wall_ms = sum(steps) / args.steps * 1e3
    median_ms = sorted(steps)[len(steps) // 2] * 1e3
    text = io.StringIO()
    if not args.no_profile:
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(35)
    tag = ("_json" if args.json_schema else "") + ("_nooverlap" if args.disable_overlap_schedule else "") + (
        "_noprof" if args.no_profile else "") + ("_stub" if args.stub_model else "")
    how = "not profiled" if args.no_profile else "profiled"
    split = ", ".join(f"{k} {v / args.steps * 1e3:.3f}" for k, v in spent.items()) if args.no_profile else ""
    report = (f"batch {args.batch}{tag}: {wall_ms:.2f} ms per step, median {median_ms:.2f} ({how})"
              f"{'; ms per step: ' + split if split else ''}\n{text.getvalue()}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_step_{args.shape}_b{args.batch}{tag}.txt").write_text(report)
    print(report[:6000])


if __name__ == "__main__":
    main()
