"""Offline ShareGPT through the scheduler in one process (no HTTP, no tokenizer process),
with a per-step trace: where the wall time of a throughput run goes.

The same N prompts as ``radixlm bench serving --dataset-name sharegpt --num-prompts N
--seed S`` (and gpu_serving.py's offline run) are tokenized here and handed to a real
``Scheduler`` + ``ModelRunner`` at once, each with ``max_new_tokens`` = its dataset reply's
length and ``ignore_eos``, streamed. The loop is the scheduler process's own
(``handle`` / ``_safe_step`` / encoding the step's outputs as ``_flush`` does), so the run
differs from the served one only by the IPC send, the tokenizer process and the client.

Each step records: wall seconds, items, new tokens, whether it only decodes, the
scheduler's busy seconds (host work) and the seconds it waited for the device. The
summary splits the wall time into prefill-carrying steps and decode steps by batch
bucket, with host and wait shares; ``steps.csv`` holds every step.

    . bench/gpu_env.sh && python3 bench/serving/offline_trace.py --tokenizer-dir .gpu_tok \\
        --dataset-path .gpu_data/sharegpt_subset.jsonl --server-args "--max-running-requests 1024 \\
        --max-prefill-tokens 16384" --out $OUT

``--variant TAG=FLAGS`` (repeatable) runs the prompts once per variant, in order, each with
a fresh ``Scheduler`` (its own KV allocator and radix tree: nothing cached from the run
before) over the same ``ModelRunner``; FLAGS are added to ``--server-args`` and may only
change the scheduler's flags (``--schedule-policy``, ``--max-prefill-tokens``, ...): the
runner (CUDA graphs, pool) is built once from ``--server-args``, except that
``--piecewise-cuda-graph-max-tokens 0`` in FLAGS runs that variant without the runner's
piecewise graphs. A variant may repeat (a
warm-up, a rerun). Without ``--variant`` one run of ``--server-args``.

``--dataset-name gsp``: the generated shared prefix instead (``--gsp-*``: 64 groups x 16
questions, a 2048-token system prompt, 128-token questions, 256 new tokens, as
side_by_side.py's ``gsp``), token-id prompts. Every run records each request's time to
its first token in the scheduler's outbox (TTFT without HTTP) and each step's prompt
tokens computed, so a slow median TTFT at request rate inf can be traced to its steps.

On the CPU (``GPU_E2E_DEVICE=cpu``) use a tiny shape and few prompts (a dry run).
"""

from __future__ import annotations

import argparse
import csv
import gc
import itertools
import json
import logging
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("e2e",)]
from gpu_e2e import DEVICE, build_checkpoint  # noqa: E402

from radixlm.runtime import messages as m  # noqa: E402
from radixlm.runtime.bench.datasets import shared_prefix_requests, sharegpt_requests  # noqa: E402
from radixlm.runtime.bench.sharegpt import iter_records  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.scheduler.scheduler import Scheduler, freeze_startup_objects  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 1 << 30)
# Timed per step ("owner.method"): the planner, the launch and its parts, the results.
# model.compute_logits: eager and extend steps only (the decode graphs include the LM head).
PHASES = ("planner.plan", "runner.launch", "runner._sampling_batch", "model.compute_logits",
          "graphs.replay", "scheduler._advance", "scheduler._process_results")


def timed(fn, acc: dict, name: str):
    """``fn`` wrapped to add each call's wall seconds to ``acc[name]``."""
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t0
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    ap.add_argument("--dataset-path", help="ShareGPT records (--dataset-name sharegpt)")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--server-args", default="", help="launch_server flags (after --model-path)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--dataset-name", choices=("sharegpt", "gsp"), default="sharegpt")
    ap.add_argument("--gsp", type=int, nargs=5, default=[64, 16, 2048, 128, 256],
                    metavar=("GROUPS", "PER_GROUP", "SYSTEM", "QUESTION", "OUTPUT"))
    ap.add_argument("--seed", type=int, default=1, help="as gpu_serving.py's (the same prompts)")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="skip the scheduler's start-up gc.freeze (freeze_startup_objects), for an A/B")
    ap.add_argument("--variant", action="append", default=[], metavar="TAG=FLAGS",
                    help="a run with --server-args + FLAGS (scheduler flags only; module docstring)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "offline_trace",
                    help="output directory (default: bench/results/offline_trace/)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the runner's start-up lines

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    if args.dataset_name == "gsp":
        requests = shared_prefix_requests(*args.gsp, seed=args.seed)
        args.num_prompts = len(requests)
    else:
        requests = sharegpt_requests(list(iter_records(args.dataset_path)), tokenizer, args.num_prompts, args.seed)
    model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir, args.models_root / "bfloat16")
    del model
    base = ["--model-path", str(model_dir), "--device", DEVICE, *args.server_args.split()]
    runner = ModelRunner(ServerArgs.parse(base))
    prompts = [tokenizer.encode(r.prompt) if isinstance(r.prompt, str) else list(r.prompt) for r in requests]
    variants = [v.partition("=")[::2] for v in args.variant] or [("", "")]
    args.out.mkdir(parents=True, exist_ok=True)
    for i, (tag, flags) in enumerate(variants):
        server = ServerArgs.parse([*base, *flags.split()])
        msgs = [m.GenerateReq(rid=f"r{k}", input_ids=ids, stream=True,
                              sampling=m.SamplingParams(max_new_tokens=r.output_len, ignore_eos=True))
                for k, (ids, r) in enumerate(zip(prompts, requests, strict=True))]
        pieces = runner.piecewise
        if not server.piecewise_cuda_graph_max_tokens:  # this run without the runner's piecewise graphs
            runner.piecewise = None
        try:
            summary, rows = trace(Scheduler(server, runner), msgs, args.no_gc_freeze)
        finally:
            runner.piecewise = pieces
        summary = {"device": DEVICE, "shape": args.shape, "server_args": " ".join(base[4:]) + " " + flags,
                   "dataset": args.dataset_name, "variant": tag, "order": i, "num_prompts": args.num_prompts, **summary}
        name = (tag or "_".join(args.server_args.replace("--", "").split()) or "default") + (
            "_nogcfreeze" if args.no_gc_freeze else "")
        if tag and [t for t, _ in variants[:i]].count(tag):
            name += f"_run{[t for t, _ in variants[:i]].count(tag) + 1}"
        (args.out / f"offline_trace_{name}.json").write_text(json.dumps(summary, indent=1))
        with open(args.out / f"offline_trace_{name}_steps.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(json.dumps(summary, indent=1) if len(variants) == 1 else
              f"{name}: {summary['duration_s']} s, {summary['output_throughput']} tok/s, "
              f"{summary['prefill_steps']['steps']} prefill-carrying + {summary['decode_steps']['steps']} decode steps",
              flush=True)


def trace(sched: Scheduler, msgs: list, no_gc_freeze: bool) -> tuple[dict, list[dict]]:
    """Hand ``msgs`` to ``sched`` at once and step it to the end, timing every step:
    (the summary's timing part, the per-step rows)."""
    runner = sched.runner
    input_tokens = sum(len(g.input_ids) for g in msgs)

    rows, counters = [], sched.counters
    wrapped = []
    phase_s = {name: 0.0 for name in PHASES}
    for name in PHASES:  # host seconds per step in each phase (no device sync added)
        owner = {"planner": sched.planner, "runner": runner, "model": runner.model,
                 "graphs": runner.graph_runner, "scheduler": sched}[name.split(".")[0]]
        if owner is not None:
            attr = name.split(".")[1]
            wrapped.append((owner, attr, owner.__dict__.get(attr)))
            setattr(owner, attr, timed(getattr(owner, attr), phase_s, name))
    gc_s, gc_n, gc_t0 = [0.0, 0.0, 0.0], [0, 0, 0], [0.0]

    def on_gc(phase: str, info: dict) -> None:  # time every collection, by generation
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_s[info["generation"]] += time.perf_counter() - gc_t0[0]
            gc_n[info["generation"]] += 1

    gc.callbacks.append(on_gc)
    if not no_gc_freeze:
        freeze_startup_objects()  # as serve_scheduler does
    mem0 = torch.cuda.memory_stats() if DEVICE == "cuda" else {}
    start = time.perf_counter()
    for g in msgs:
        sched.handle(g)
    out_tokens = 0
    first: dict[str, float] = {}  # rid -> seconds to its first token in the outbox
    while sched.has_work:
        t0, busy0, steps0, decode0, computed0, first0 = (
            time.perf_counter(), counters["busy_s"], counters["steps"], counters["decode_steps"],
            counters["prefill_computed"], len(first))
        batch = len(sched.planner.running)
        gc_before = sum(gc_s)
        for name in phase_s:
            phase_s[name] = 0.0
        sched._safe_step()
        batch_out = sched.take_outputs()
        if batch_out is not None:  # what _flush sends, without the socket
            m.encode(batch_out)
            out_tokens += len(batch_out.token_ids) + sum(len(o.new_token_ids) for o in batch_out.outputs)
        t1 = time.perf_counter()
        if batch_out is not None:  # a request's first output is never in the columns
            for o in batch_out.outputs:
                if o.new_token_ids and o.rid not in first:
                    first[o.rid] = t1 - start
        if counters["steps"] > steps0:
            rows.append({"t": t0 - start, "wall_s": t1 - t0, "running_before": batch,
                         "decode": counters["decode_steps"] > decode0, "busy_s": counters["busy_s"] - busy0,
                         "wait_s": sched._waited, "running_after": len(sched.planner.running),
                         "prompt_tokens": counters["prefill_computed"] - computed0,
                         "first_tokens": len(first) - first0,
                         "gc_s": sum(gc_s) - gc_before, **phase_s})
    total = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    for owner, attr, own in wrapped:  # the runner outlives this scheduler: unwrap
        if own is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)
    mem1 = torch.cuda.memory_stats() if DEVICE == "cuda" else {}
    mem = {k: mem1.get(k, 0) - mem0.get(k, 0) for k in ("num_alloc_retries", "num_sync_all_streams",
                                                      "num_device_alloc", "num_device_free")}

    def part(sel: list[dict]) -> dict:
        wall = sum(r["wall_s"] for r in sel)
        return {"steps": len(sel), "wall_s": round(wall, 3),
                **{k: round(sum(r[k] for r in sel), 3) for k in ("busy_s", "wait_s", "gc_s", *PHASES)},
                "ms_per_step": round(wall / len(sel) * 1e3, 3) if sel else None}

    decode = [r for r in rows if r["decode"]]
    buckets = {}
    for lo, hi in itertools.pairwise(BUCKETS):
        sel = [r for r in decode if lo <= r["running_before"] < hi]
        if sel:
            buckets[f"{lo}-{hi - 1}"] = part(sel)
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "duration_s": round(total, 3),
        "input_tokens": input_tokens, "output_tokens": out_tokens,
        "output_throughput": round(out_tokens / total, 1),
        "prefill_steps": part([r for r in rows if not r["decode"]]), "decode_steps": part(decode),
        "decode_by_running": buckets, "outside_steps_s": round(total - sum(r["wall_s"] for r in rows), 3),
        "ttft_s": _percentiles(sorted(first.values())),
        "gc": {"collections": gc_n, "seconds": [round(x, 3) for x in gc_s], "frozen": gc.get_freeze_count(),
               "tracked_objects_at_end": len(gc.get_objects())},
        "cuda_allocator": mem,
    }
    return summary, rows


def _percentiles(values: list[float]) -> dict:
    """Median, p90, p99 and max of sorted ``values`` (seconds, rounded to ms)."""
    if not values:
        return {}
    pick = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    out = {k: round(values[min(len(values) - 1, int(q * len(values)))], 3) for k, q in pick.items()}
    return {"n": len(values), **out, "max": round(values[-1], 3)}


if __name__ == "__main__":
    main()
