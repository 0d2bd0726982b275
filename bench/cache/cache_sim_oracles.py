"""How much of the LRU -> Belady gap can an online policy close? Oracle keys (they read
the trace's future) on two traces: ``--trace multiturn`` (default) and ``--trace mooncake``.

**mooncake** (``mooncake_main``): the Mooncake trace in ``radixlm bench cache-sim``'s timed
model (prefill 20,000 tokens/s, 20 ms decode steps), scored from 1800 s on: ``reuse-gap``
and ``liveness`` with and without the tree's ghost records (real policies), and keys that
read the future:

* ``alive``: ``(the sequence is used again, last_access)``: LRU that knows which cached
  sequences have a future, not when; ``alive, E% flipped``: each sequence's answer
  flipped with probability E (seeded): a liveness predictor that is right 1 - E of the
  time, independently of everything else;
* ``next use``: the leaf whose next use is farthest goes first (Belady on whole leaves);
  ``x e^(s N)``: that time multiplied by a log-normal error of s (dead ones known);
* and the liveness the trace's own features predict: the held-out AUC of a logistic
  regression (fitted on the first half of the requests) of "this request's last whole
  block is used again" on log prompt length, log new blocks, log matched blocks, the log
  gap since the conversation's previous turn, first turn or not, turn number, log output
  length, log conversation age and whether others arrived at the same millisecond.

**multiturn**: replays the multi-turn ShareGPT trace of ``radixlm bench cache-sim`` (same
flags, same seed, same trace) with two keys that cheat, registered for this process only:

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
    .venv/bin/python bench/cache/cache_sim_oracles.py --trace mooncake
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
from collections import defaultdict

from radixlm.radix import EVICTION_POLICIES
from radixlm.runtime.bench.cache_min import PageTrace, belady
from radixlm.runtime.bench.cache_sim import gap_closed, replay
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


def _next_uses(trace: list[TraceRequest]):
    """node -> arrival of the next request whose matched part holds the node's first id
    after its last use (inf: none). Block traces: an id names its whole prefix."""
    uses: dict[int, list[float]] = defaultdict(list)
    for req in trace:
        for block in req.prompt[:-1]:
            uses[block].append(req.arrival_s)

    def next_use(node) -> float:
        times = uses.get(node.key[0], [])
        i = bisect.bisect_right(times, node.last_access)
        return times[i] if i < len(times) else math.inf

    return next_use


def _seeded(draw) -> dict:
    """A per-block draw, made once (seeded) the first time a block is asked about."""
    rng, made = random.Random(0), {}

    def get(block: int):
        if block not in made:
            made[block] = draw(rng)
        return made[block]

    return get


def alive_oracle(next_use, error: float):
    flipped = _seeded(lambda rng: rng.random() < error)
    return lambda n: ((next_use(n) < math.inf) != flipped(n.key[0]), n.last_access)


def next_use_oracle(next_use, sigma: float):
    noise = _seeded(lambda rng: math.exp(sigma * rng.gauss(0, 1)))

    def key(n) -> float:
        t = next_use(n)
        return -math.inf if t == math.inf else -(n.last_access + (t - n.last_access) * noise(n.key[0]))

    return key


def liveness_auc(trace: list[TraceRequest]) -> tuple[float, dict[str, float]]:
    """Held-out AUC of the logistic liveness predictor (module docstring), and each
    feature's own AUC (max of it and its reverse), on requests more than 15 min before
    the trace's end (the later ones have too little future to say)."""
    import numpy as np

    uses: dict[int, list[float]] = defaultdict(list)
    for req in trace:
        for block in req.prompt[:-1]:
            uses[block].append(req.arrival_s)
    seen: dict[int, float] = {}
    turn: dict[int, int] = {}
    first: dict[int, float] = {}
    same_ms = defaultdict(int)
    for req in trace:
        same_ms[req.arrival_s] += 1
    rows, labels, end = [], [], trace[-1].arrival_s - 900
    for req in trace:
        ids, now, m = req.prompt, req.arrival_s, 0
        while m < len(ids) - 1 and ids[m] in seen:
            m += 1
        gap = now - seen[ids[m - 1]] if m > 1 else -1.0
        t, start = (turn.get(ids[m - 1], 0) + 1, first.get(ids[m - 1], now)) if m > 1 else (1, now)
        for block in ids:
            turn.setdefault(block, t)
            first.setdefault(block, start)
            seen[block] = now
        whole = ids if req.output else ids[:-1]
        if not whole or now > end:
            continue
        later = uses.get(whole[-1], [])
        labels.append(bisect.bisect_right(later, now) < len(later))
        rows.append([math.log2(len(ids)), math.log2(1 + len(whole) - m), math.log2(1 + m),
                     math.log2(1 + max(gap, 0)), gap < 0, t, math.log2(1 + req.output_tokens),
                     math.log2(1 + now - start), same_ms[now] > 1])  # fmt: skip
    x, y = np.asarray(rows, float), np.asarray(labels, float)

    def auc(score, truth) -> float:
        ranks = np.empty(len(score))
        ranks[np.argsort(score, kind="stable")] = np.arange(len(score))
        pos = truth == 1
        return float((ranks[pos].mean() - (pos.sum() - 1) / 2) / (len(truth) - pos.sum()))

    names = ["log prompt", "log new blocks", "log matched", "log gap", "first turn", "turn",
             "log output", "log conversation age", "same ms"]  # fmt: skip
    single = {n: max(auc(x[:, i], y), 1 - auc(x[:, i], y)) for i, n in enumerate(names)}
    half = len(y) // 2
    mu, sd = x[:half].mean(0), x[:half].std(0) + 1e-9
    z = np.c_[(x - mu) / sd, np.ones(len(x))]
    w = np.zeros(z.shape[1])
    for _ in range(3000):  # logistic regression, gradient descent
        p = 1 / (1 + np.exp(-z[:half] @ w))
        w -= 0.5 * z[:half].T @ (p - y[:half]) / half
    return auc(z[half:] @ w, y[half:]), single


def mooncake_main(args: argparse.Namespace) -> None:
    from radixlm.radix.eviction import Liveness, ReuseGap
    from radixlm.runtime.bench.cache_model import ServiceModel
    from radixlm.runtime.bench.cache_sim import Workload
    from radixlm.runtime.bench.cache_traces import mooncake

    trace = mooncake(args.mooncake_path)
    work = Workload.build("mooncake", trace, 16, ServiceModel(20000.0, 0.02), warmup_s=1800.0)
    next_use = _next_uses(trace)
    no_ghosts = type("ReuseGapNoGhosts", (ReuseGap,), {"uses_ghosts": False})
    live_no_ghosts = type("LivenessNoGhosts", (Liveness,), {"uses_ghosts": False})
    oracles = {
        "reuse-gap": None,
        "reuse-gap without ghosts": no_ghosts,
        "liveness": None,
        "liveness without ghosts": live_no_ghosts,
    }
    for error in (0.0, 0.1, 0.2, 0.3):
        oracles[f"alive, {error:.0%} flipped"] = alive_oracle(next_use, error)
    for sigma in (0.0, 1.0, 2.0):
        oracles[f"next use x e^({sigma:g} N)"] = next_use_oracle(next_use, sigma)
    for name, key in oracles.items():
        if key is not None:
            EVICTION_POLICIES[name] = key
    fractions = (0.005, 0.01, 0.02, 0.04, 0.08)
    print("| key | " + " | ".join(f"{100 * f:g}%" for f in fractions) + " |")
    print("|---|" + "---|" * len(fractions))
    base = {}
    for f in fractions:
        c = work.pages(f)
        base[f] = (c, work.belady(c).hit_rate, work.replay(c, "lru").hit_rate)
    print("| LRU | " + " | ".join(f"{base[f][2]:.1%}" for f in fractions) + " |")
    print("| Belady | " + " | ".join(f"{base[f][1]:.1%}" for f in fractions) + " |")
    for name in oracles:
        cells = []
        for f in fractions:
            c, best, lru = base[f]
            rate = work.replay(c, name).hit_rate
            cells.append(f"{rate:.1%} ({gap_closed(rate, lru, best):+.0%})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    held_out, single = liveness_auc(trace)
    print(f"\nliveness AUC, logistic on 9 features, held out: {held_out:.3f}")
    print("one feature: " + ", ".join(f"{n} {a:.3f}" for n, a in single.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--trace", choices=["multiturn", "mooncake"], default="multiturn")
    p.add_argument("--mooncake-path", default="../shared/data/traces/mooncake_conversation_trace.jsonl")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--capacities", nargs="+", type=float, default=[0.1, 0.2, 0.3, 0.4])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tokenizer-path")
    p.add_argument("--split-records", action="store_true")
    args = p.parse_args()
    if args.trace == "mooncake":
        mooncake_main(args)
        return
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
        best = belady(pt, capacity).hit_rate
        rates = [replay(trace, args.page_size, capacity, name).hit_rate for name in policies]
        cells = [f"{r:.1%} ({gap_closed(r, rates[0], best):+.0%})" for r in rates]
        print(f"| {fraction:.0%} | " + " | ".join(cells) + f" | {best:.1%} |", flush=True)


if __name__ == "__main__":
    main()
