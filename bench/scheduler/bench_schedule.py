"""Schedule policies (``--schedule-policy``) in a model-free scheduler simulation.

The real BatchPlanner, PrefixCache and RadixTree run; the model does not (each planned
chunk is taken as computed, one token is sampled at the end of a sequence, as the
planner tests do). Two measurements:

(1) Prefix-cache token hit rate per policy: SGLang's generated shared prefix workload
    (``--groups`` x ``--prompts-per-group``, system prompt, question, output lengths;
    runtime/bench/cache_traces.py), prompts in shuffled order, into a small KV pool
    (``--pool-tokens``) so that not every system prompt stays cached. ``burst``: all
    requests waiting at step 0; ``stream``: ``--arrivals-per-step`` join per step.
    Hit rate = cached prompt tokens at first admission / prompt tokens; also the
    prompt tokens computed (recomputation after preemption included) and the steps.
(2) plan() CPU time against queue length (10 .. 10,000 waiting requests), per policy:
    64 requests decoding, the queue topped up to its length after every step (half the
    requests share one of 64 cached system prompts, half match nothing), outputs of 4
    tokens so admissions happen at every step. Median and p90 of plan() over the steps
    (medians: on a shared machine a mean mostly measures preemption by other processes),
    plus the cost of ``add`` per request (the garbage collector is off while timing).

    .venv/bin/python bench/scheduler/bench_schedule.py [--out bench/results] [--skip-hit-rate]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

from radixlm.radix import RadixTree
from radixlm.runtime.bench.cache_traces import SharedPrefixConfig, shared_prefix
from radixlm.runtime.memory.page_allocator import PageAllocator
from radixlm.runtime.messages import SamplingParams
from radixlm.runtime.scheduler.planner import BatchPlanner
from radixlm.runtime.scheduler.prefix_cache import PrefixCache
from radixlm.runtime.scheduler.request import Req
from radixlm.runtime.scheduler.waiting_order import SCHEDULE_POLICIES

PAGE = 16


def make_planner(policy: str, pool_tokens: int, max_running: int, max_passes: int) -> BatchPlanner:
    cache = PrefixCache(PageAllocator(pool_tokens // PAGE + 1), RadixTree(PAGE), PAGE)
    return BatchPlanner(cache, max_prefill_tokens=8192, chunked_prefill_size=4096,
                        max_running_requests=max_running, schedule_policy=policy,
                        schedule_max_passes=max_passes)


def apply(p: BatchPlanner, decision, counters: dict) -> list[Req]:
    """Apply a decision as the scheduler would; returns the requests that finished."""
    finished = list(decision.out_of_memory)
    for req in decision.out_of_memory:
        req.finish("length")
        p.remove(req)
    for item in decision.items:
        req = item.req
        was_prefill = req.in_prefill
        if was_prefill:
            counters["prefill_computed"] += item.num_tokens
        req.num_computed += item.num_tokens
        if was_prefill and not req.in_prefill:
            p.cache.cache(req)
        if item.samples:
            req.output_ids.append(7)
            if len(req.output_ids) >= req.sampling.max_new_tokens:
                req.finish("length")
                p.remove(req)
                finished.append(req)
    return finished


def hit_rate_run(policy: str, args: argparse.Namespace, mode: str) -> dict:
    cfg = SharedPrefixConfig(args.groups, args.prompts_per_group, args.system_len, args.question_len,
                             args.output_len)
    trace = shared_prefix(cfg, seed=args.seed)
    reqs = [Req(rid=str(i), prompt_ids=list(t.prompt), sampling=SamplingParams(max_new_tokens=len(t.output)),
                arrival=float(i)) for i, t in enumerate(trace)]
    p = make_planner(policy, args.pool_tokens, args.max_running, args.max_passes)
    counters = {"prefill_computed": 0}
    pending, done, steps = list(reqs), 0, 0
    start = time.perf_counter()
    while done < len(reqs):
        take = len(pending) if mode == "burst" else args.arrivals_per_step
        for req in pending[:take]:
            p.add(req)
        pending = pending[take:]
        done += len(apply(p, p.plan(), counters))
        steps += 1
    prompt = sum(len(r.prompt_ids) for r in reqs)
    cached = sum(r.cached_tokens for r in reqs)
    return {"policy": policy, "mode": mode, "hit_rate": cached / prompt, "prompt_tokens": prompt,
            "prefill_computed": counters["prefill_computed"], "steps": steps,
            "preemptions": p.num_preemptions, "promoted": p.order.num_promoted,
            "wall_s": time.perf_counter() - start}


def plan_time_run(policy: str, queue_len: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    systems = [rng.choices(range(49152), k=512) for _ in range(64)]
    p = make_planner(policy, 1 << 21, 64, args.max_passes)
    for s in systems:  # cached system prompts
        p.cache.tree.insert(s, p.cache.alloc(len(s) // PAGE))
    serial = iter(range(1 << 62))

    def new_req() -> Req:
        i = next(serial)
        prompt = (systems[rng.randrange(64)] if i % 2 else rng.choices(range(49152), k=512))
        return Req(rid=str(i), prompt_ids=prompt + rng.choices(range(49152), k=128),
                   sampling=SamplingParams(max_new_tokens=4), arrival=float(i))

    counters = {"prefill_computed": 0}
    add_ns: list[float] = []
    plan_ns: list[float] = []
    for s in range(args.plan_steps + 20):
        batch = [new_req() for _ in range(queue_len - len(p.waiting))]
        gc.disable()  # time the code, not a collection of the bench's own garbage
        t0 = time.perf_counter_ns()
        for req in batch:
            p.add(req)
        if batch and s >= 20:
            add_ns.append((time.perf_counter_ns() - t0) / len(batch))
        t0 = time.perf_counter_ns()
        decision = p.plan()
        if s >= 20:  # warm-up: the running batch fills first
            plan_ns.append(time.perf_counter_ns() - t0)
        gc.enable()
        apply(p, decision, counters)
    plan_ns.sort()
    return {"policy": policy, "queue_len": queue_len, "plan_us_median": statistics.median(plan_ns) / 1e3,
            "plan_us_p90": plan_ns[int(0.9 * (len(plan_ns) - 1))] / 1e3,
            "add_us_median": statistics.median(add_ns) / 1e3 if add_ns else 0.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pool-tokens", type=int, default=65536, help="KV pool of the hit-rate runs")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--max-passes", type=int, default=256, help="starvation guard (--schedule-max-passes)")
    ap.add_argument("--arrivals-per-step", type=int, default=4)
    ap.add_argument("--queue-lengths", default="10,100,1000,10000")
    ap.add_argument("--plan-steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hit-rate", action="store_true")
    ap.add_argument("--skip-plan-time", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results",
                    help="write bench_schedule.json here (default: bench/results/)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    if not args.skip_hit_rate:
        rows = [hit_rate_run(policy, args, mode) for mode in ("burst", "stream") for policy in SCHEDULE_POLICIES]
        result["hit_rate"] = rows
        print("| arrivals | policy | token hit rate | prompt tokens computed | steps | preemptions | promoted |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['mode']} | {r['policy']} | {r['hit_rate']:.1%} | {r['prefill_computed']} | {r['steps']} "
                  f"| {r['preemptions']} | {r['promoted']} |", flush=True)
    if not args.skip_plan_time:
        lengths = [int(x) for x in args.queue_lengths.split(",")]
        rows = [plan_time_run(policy, n, args) for n in lengths for policy in SCHEDULE_POLICIES]
        result["plan_time"] = rows
        print("| waiting | policy | plan() median us | plan() p90 us | add() median us/request |")
        print("|---:|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['queue_len']} | {r['policy']} | {r['plan_us_median']:.0f} | {r['plan_us_p90']:.0f} "
                  f"| {r['add_us_median']:.1f} |", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_schedule.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
