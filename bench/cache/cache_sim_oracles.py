"""How much of the LRU -> Belady gap on the multi-turn trace can an online policy close?

Replays the multi-turn ShareGPT trace of ``radixlm bench cache-sim`` (same flags, same
seed, same trace) with two keys that cheat, registered for this process only:

* ``depth-prior``: ``last_access + think_time_s * logit(p)``, p = share of the turns
  whose sequence length (prompt + output, 512-token buckets) is followed by another turn
  of the same conversation, *measured on this very trace*: the most a sequence-length
  feature could add to recency (with exponential think times the posterior odds that a
  conversation is still alive after t idle seconds are p / (1 - p) * exp(-t / think)).
* ``turn-length-prior``: the same with p per (turns so far: 1, 2, 3, 4+) x (sequence
  length: 2048-token buckets), also measured on this very trace: the best prior from
  what a server sees (turn count, length) that we found.
* ``liveness-oracle``: ``(conversation has a later turn, last_access)``: LRU that also
  knows which conversations are over, but not when the others come back. A node is
  mapped to the conversations whose inserted sequences hold its first page at its
  position (shared prefixes count as alive while any of them is).
* ``liveness-90%``, ``liveness-80%``: the oracle with each conversation's label flipped
  with probability 10% / 20% (seeded): how good a predictor of "this conversation is
  over" would have to be.

None is a valid policy (all read the trace's future); they bound what recency plus a
predictor of "this conversation is over" could do. Usage:

    .venv/bin/python bench/cache/cache_sim_oracles.py --seed 1
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
from collections import defaultdict

from radixlm.radix import EVICTION_POLICIES
from radixlm.runtime.bench.cache_sim import PageTrace, belady, gap_closed, replay
from radixlm.runtime.bench.cache_traces import MultiTurnConfig, TraceRequest, sharegpt_multiturn

BUCKET = 512  # tokens per sequence-length bucket of the depth prior


def _has_next_turn(trace: list[TraceRequest]) -> list[bool]:
    last = {r.session: i for i, r in enumerate(trace)}
    return [last[r.session] != i for i, r in enumerate(trace)]


def depth_prior(trace: list[TraceRequest], think_time_s: float):
    """Key adding ``think_time_s * logit(P(next turn | sequence length))`` to recency."""
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for req, more in zip(trace, _has_next_turn(trace), strict=True):
        bucket = counts[(len(req.prompt) + len(req.output)) // BUCKET]
        bucket[0] += 1
        bucket[1] += more
    logit = {}
    for b, (n, more) in counts.items():
        p = min(max(more / n, 0.01), 0.99)
        logit[b] = math.log(p / (1 - p))
    return lambda node: node.last_access + think_time_s * logit.get(node.prefix_len // BUCKET, 0.0)


def _holders(trace: list[TraceRequest], page_size: int):
    """node -> the conversations whose sequences hold the node's first page there."""
    holders: dict[tuple[int, tuple[int, ...]], set[int]] = defaultdict(set)
    for req in trace:
        seq = req.prompt + req.output
        for start in range(0, len(seq) - page_size + 1, page_size):
            holders[start, seq[start : start + page_size]].add(req.session)
    return lambda node: holders[node.prefix_len - len(node.key), node.key[:page_size]]


def turn_length_prior(trace: list[TraceRequest], page_size: int, think_time_s: float):
    """``last_access + think_time_s * logit(P(next turn | turns so far, length))``."""
    arrivals: dict[int, list[float]] = defaultdict(list)
    for req in trace:
        arrivals[req.session].append(req.arrival_s)
    counts: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    seen: dict[int, int] = defaultdict(int)
    for req, more in zip(trace, _has_next_turn(trace), strict=True):
        seen[req.session] += 1
        cls = counts[min(seen[req.session], 4), (len(req.prompt) + len(req.output)) // 2048]
        cls[0] += 1
        cls[1] += more
    logit = {c: math.log(max(m, 1) / max(n - m, 1)) for c, (n, m) in counts.items()}
    holders = _holders(trace, page_size)

    def key(node) -> float:
        sessions = holders(node)
        if len(sessions) != 1:  # a shared prefix: keep it (it is matched by everyone)
            return node.last_access + 1e6
        (session,) = sessions
        turns = bisect.bisect_right(arrivals[session], node.last_access)
        cls = (min(max(turns, 1), 4), node.prefix_len // 2048)
        return node.last_access + think_time_s * logit.get(cls, 0.0)

    return key


def liveness_oracle(trace: list[TraceRequest], page_size: int, error: float = 0.0):
    """Key ``(a conversation holding this node has a turn after its last access, LRU)``;
    with ``error`` > 0 each conversation's answer is flipped with that probability."""
    last_arrival: dict[int, float] = {}
    for req in trace:
        last_arrival[req.session] = req.arrival_s
    rng = random.Random(0)
    flipped = {s for s in sorted(last_arrival) if rng.random() < error}
    holders = _holders(trace, page_size)

    def key(node) -> tuple[int, float]:
        alive = any((last_arrival[s] > node.last_access) != (s in flipped) for s in holders(node))
        return (int(alive), node.last_access)

    return key


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--capacities", nargs="+", type=float, default=[0.1, 0.2, 0.3, 0.4])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tokenizer-path")
    p.add_argument("--split-records", action="store_true")
    args = p.parse_args()
    cfg = MultiTurnConfig(split_records=args.split_records)
    trace = sharegpt_multiturn(cfg, args.seed, args.tokenizer_path)
    EVICTION_POLICIES["depth-prior"] = depth_prior(trace, cfg.think_time_s)
    EVICTION_POLICIES["turn-length-prior"] = turn_length_prior(
        trace, args.page_size, cfg.think_time_s
    )
    EVICTION_POLICIES["liveness-oracle"] = liveness_oracle(trace, args.page_size)
    EVICTION_POLICIES["liveness-90%"] = liveness_oracle(trace, args.page_size, 0.1)
    EVICTION_POLICIES["liveness-80%"] = liveness_oracle(trace, args.page_size, 0.2)
    policies = [
        "lru",
        "continuation-odds",
        "depth-prior",
        "turn-length-prior",
        "liveness-oracle",
        "liveness-90%",
        "liveness-80%",
    ]
    pt = PageTrace.build(trace, args.page_size)
    print(f"multi-turn, seed {args.seed}: {len(trace)} requests, working set {pt.num_pages} pages")
    print("| capacity | " + " | ".join(policies) + " | belady |")
    print("|---|" + "---|" * (len(policies) + 1))
    for fraction in args.capacities:
        capacity = round(fraction * pt.num_pages)
        best = belady(pt, args.page_size, capacity).hit_rate
        rates = [replay(trace, args.page_size, capacity, name).hit_rate for name in policies]
        cells = [f"{r:.1%} ({gap_closed(r, rates[0], best):+.0%})" for r in rates]
        print(f"| {fraction:.0%} | " + " | ".join(cells) + f" | {best:.1%} |", flush=True)


if __name__ == "__main__":
    main()
