"""Fit eviction-policy parameters on the first part of a timestamped trace, report every
policy on the rest (held out), next to Belady and LRU.

The Mooncake conversation trace replayed by ``radixlm bench cache-sim``'s timed model
(requests overlap; running requests lock their pages). The fit replays only the requests
arriving before ``--split-s`` and keeps, per parametrised policy, the grid point with the
best mean share of the LRU -> Belady gap closed over ``--capacities`` (those where Belady
beats LRU by a point or more) that coordinate ascent finds; the report replays the whole trace and scores
the requests arriving from ``--split-s`` on (the earlier ones warm the cache). Grids:

* ``reuse-gap`` (``radix.eviction.ReuseGap``): scale, offset, unknown gap, first-turn
  log-odds;
* ``importance``: ``last_access - w_memory log2(prefix_len) + w_reuse log2(1 + hits)``
  (``radix.eviction.importance``'s form, weights in seconds);
* ``continuation-odds``: its think time tau;
* ``liveness`` (``radix.eviction.Liveness``): not a grid but a logistic regression. The
  first half is replayed once with no eviction (a pool of the whole working set); each new
  leaf's ``Liveness.features`` is a row, labelled by whether its last block id (which names
  its whole prefix) is in a later request's matchable prompt within
  ``LIVENESS_HORIZON_S`` and before ``--split-s``; rows from the last horizon before the
  split are left out (their future is cut). Gradient descent on the standardised
  features, weights mapped back to raw features (``LIVENESS_WEIGHTS``, ``LIVENESS_BIAS``).
  ``ReuseGap``'s constants are kept.

Fitted variants are registered in ``EVICTION_POLICIES`` for this process only. Usage:

    .venv/bin/python bench/cache/fit_eviction.py --out bench/cache/figures/fit_eviction.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from radixlm.radix import EVICTION_POLICIES
from radixlm.radix.eviction import ContinuationOdds, Liveness, ReuseGap
from radixlm.runtime.bench.cache_model import ServiceModel
from radixlm.runtime.bench.cache_sim import Workload, gap_closed, percent
from radixlm.runtime.bench.cache_traces import MooncakeConfig, TraceRequest, mooncake

GRIDS: dict[str, dict[str, list[float]]] = {
    "reuse-gap": {
        "scale": [0.5, 1.0, 2.0],
        "offset_s": [10.0, 30.0, 90.0, 270.0],
        "unknown_s": [150.0, 300.0, 600.0, 1200.0, 2400.0],
        "first_log_odds": [-3.0, -1.5, -0.55, 0.0],
    },
    "importance": {
        "w_memory_s": [0.0, 10.0, 30.0, 100.0, 300.0],
        "w_reuse_s": [0.0, 10.0, 30.0, 100.0, 300.0],
    },
    "continuation-odds": {"think_s": [10.0, 30.0, 60.0, 120.0, 300.0]},
}


def variant(name: str, params: dict[str, float]) -> Callable | type:
    """The policy ``name`` with ``params`` (an ``EVICTION_POLICIES`` value)."""
    if name == "reuse-gap":
        return type("ReuseGapFit", (ReuseGap,), {"__init__": lambda s: ReuseGap.__init__(s, **params)})
    if name == "continuation-odds":
        return type(
            "ContinuationOddsFit",
            (ContinuationOdds,),
            {"__init__": lambda s: ContinuationOdds.__init__(s, params["think_s"])},
        )
    wm, wr = params["w_memory_s"], params["w_reuse_s"]
    return lambda n: n.last_access - wm * math.log2(n.prefix_len) + wr * math.log2(1 + n.hit_count)


MIN_GAP = 0.01  # sizes where Belady beats LRU by less (a cold cache) are not scored


def baselines(work: Workload, fractions: list[float]) -> dict[float, tuple[float, float]]:
    """(LRU, Belady) hit rates per size whose gap is at least ``MIN_GAP``."""
    out = {}
    for f in fractions:
        c = work.pages(f)
        lru, best = work.replay(c, "lru").hit_rate, work.belady(c).hit_rate
        if best - lru >= MIN_GAP:
            out[f] = (lru, best)
    return out


def mean_gap_closed(work: Workload, base: dict[float, tuple[float, float]], policy: str) -> float:
    """The share of the LRU -> Belady gap ``policy`` closes, averaged over the sizes."""
    rates = {f: work.replay(work.pages(f), policy).hit_rate for f in base}
    return sum(gap_closed(rates[f], *base[f]) for f in base) / len(base)


def coordinate_ascent(
    grid: dict[str, list[float]], score: Callable[[dict[str, float]], float], rounds: int
) -> dict[str, float]:
    """From each parameter's middle grid value, ``rounds`` passes that set one parameter
    at a time to its best grid value with the others fixed."""
    best = {k: v[len(v) // 2] for k, v in grid.items()}
    for _ in range(rounds if len(grid) > 1 else 1):
        for k, values in grid.items():
            best[k] = max(values, key=lambda v, k=k: score({**best, k: v}))
    return best


def fit(work: Workload, fractions: list[float], rounds: int, bar: tqdm) -> dict[str, dict]:
    """Per policy, ``coordinate_ascent`` of the mean gap closed over ``fractions`` (those
    with a gap of ``MIN_GAP`` or more): every point tried and the best."""
    base = baselines(work, fractions)
    out = {"scored_sizes": sorted(base)}
    for name, grid in GRIDS.items():
        tried: dict[tuple, float] = {}

        def score(params: dict[str, float], name: str = name, tried: dict = tried) -> float:
            key = tuple(params.values())
            if key not in tried:
                EVICTION_POLICIES["fit"] = variant(name, params)
                tried[key] = mean_gap_closed(work, base, "fit")
                bar.update(1)
            return tried[key]

        best = coordinate_ascent(grid, score, rounds)
        points = [
            {"params": dict(zip(grid, key, strict=True)), "mean_gap_closed": rate}
            for key, rate in tried.items()
        ]
        out[name] = {"best": best, "best_mean_gap_closed": score(best), "tried": points}
    del EVICTION_POLICIES["fit"]
    return out


LIVENESS_HORIZON_S = 300.0  # "used again" means within this many seconds


class _LivenessRecorder(Liveness):
    """``Liveness`` that also records each new sequence's (last id, time, features)."""

    rows: list[tuple[int, float, tuple[float, ...]]]

    def features(self, node: Any) -> tuple[float, float, float, float]:
        f = super().features(node)
        if node.hit_count == 0:
            self.rows.append((node.key[-1], node.last_access, f))
        return f


def liveness_rows(trace: list[TraceRequest], work: Workload, start_s: float, end_s: float, horizon_s: float):
    """Features and labels of the new leaves of ``work`` (replayed without eviction)
    created from ``start_s`` to ``end_s - horizon_s``: used again within ``horizon_s`` and
    before ``end_s`` (a request's prompt but its last id holds the leaf's last id)."""
    import numpy as np

    uses: dict[int, list[float]] = defaultdict(list)
    for req in trace:
        if req.arrival_s < end_s:
            for block in req.prompt[:-1]:
                uses[block].append(req.arrival_s)
    rows: list = []
    EVICTION_POLICIES["liveness-recorder"] = type(
        "Recorder", (_LivenessRecorder,), {"rows": rows, "__init__": lambda s: Liveness.__init__(s)}
    )
    work.replay(work.pt.working_set_pages, "liveness-recorder")
    del EVICTION_POLICIES["liveness-recorder"]
    x, y = [], []
    for last, t, f in rows:
        if start_s <= t < end_s - horizon_s:
            later = uses.get(last, [])
            i = bisect.bisect_right(later, t)
            x.append(f)
            y.append(i < len(later) and later[i] - t <= horizon_s)
    return np.asarray(x, float), np.asarray(y, float)


def logistic(x, y, steps: int = 3000, rate: float = 0.5, l2: float = 1e-3) -> tuple[list[float], float]:
    """Logistic regression by gradient descent on standardised features; returns the
    weights and bias of the raw features."""
    import numpy as np

    mu, sd = x.mean(0), x.std(0) + 1e-9
    z = np.c_[(x - mu) / sd, np.ones(len(x))]
    w = np.zeros(z.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-z @ w))
        w -= rate * (z.T @ (p - y) / len(y) + l2 * np.r_[w[:-1], 0])
    weights = w[:-1] / sd
    return [float(v) for v in weights], float(w[-1] - (mu / sd) @ w[:-1])


def auc(score, truth) -> float:
    """Area under the ROC curve (ties in ``score`` broken by order)."""
    import numpy as np

    ranks = np.empty(len(score))
    ranks[np.argsort(score, kind="stable")] = np.arange(len(score))
    pos = truth == 1
    return float((ranks[pos].mean() - (pos.sum() - 1) / 2) / (len(truth) - pos.sum()))


def fit_liveness(trace: list[TraceRequest], train: Workload, whole: Workload, split_s: float) -> dict:
    """``Liveness``'s logistic weights from the requests before ``split_s`` (``train``,
    module docstring), and their AUC there and on the sequences of ``whole`` from
    ``split_s`` on (held out)."""
    horizon = LIVENESS_HORIZON_S
    x, y = liveness_rows(trace, train, 0.0, split_s, horizon)
    weights, bias = logistic(x, y)
    x_out, y_out = liveness_rows(trace, whole, split_s, trace[-1].arrival_s + 1.0, horizon)
    return {
        "weights": weights,
        "bias": bias,
        "rows": len(y),
        "used_again": float(y.mean()),
        "train_auc": auc(x @ weights, y),
        "held_out_rows": len(y_out),
        "held_out_used_again": float(y_out.mean()),
        "held_out_auc": auc(x_out @ weights, y_out),
        "horizon_s": horizon,
    }


def report(work: Workload, fractions: list[float], policies: list[str], bar: tqdm) -> list[dict]:
    rows = []
    for f in fractions:
        c = work.pages(f)
        best, lru = work.belady(c).hit_rate, work.replay(c, "lru").hit_rate
        for policy in policies:
            r = work.replay(c, policy)
            rows.append(
                {
                    "capacity_fraction": f,
                    "capacity_pages": c,
                    "policy": policy,
                    "hit_rate": r.hit_rate,
                    "belady_hit_rate": best,
                    "lru_hit_rate": lru,
                    "gap_closed": gap_closed(r.hit_rate, lru, best),
                    "overflow_pages": r.overflow_pages,
                }
            )
            bar.update(1)
    return rows


def table(rows: list[dict], policies: list[str]) -> str:
    lines = ["| capacity | " + " | ".join(policies) + " | Belady |", "|" + "---|" * (len(policies) + 2)]
    for f in sorted({r["capacity_fraction"] for r in rows}):
        by = {r["policy"]: r for r in rows if r["capacity_fraction"] == f}
        cells = [
            f"{by[p]['hit_rate']:.1%}" + ("" if p == "lru" else f" ({by[p]['gap_closed']:+.0%})")
            for p in policies
        ]
        lines.append(f"| {percent(f)} | " + " | ".join(cells) + f" | {by['lru']['belady_hit_rate']:.1%} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--mooncake-path", default=MooncakeConfig.path)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    p.add_argument("--decode-step-ms", type=float, default=20.0)
    p.add_argument("--split-s", type=float, default=1800.0, help="fit before, report from")
    p.add_argument("--capacities", nargs="+", type=float, default=[0.005, 0.01, 0.02, 0.04, 0.08])
    p.add_argument("--rounds", type=int, default=2, help="coordinate-ascent passes per policy")
    p.add_argument("--out", default="bench/results/fit_eviction.json")
    args = p.parse_args()
    service = ServiceModel(args.prefill_tokens_per_s, args.decode_step_ms / 1000)
    trace = mooncake(args.mooncake_path)
    first = [r for r in trace if r.arrival_s < args.split_s]
    train = Workload.build("mooncake-first", first, args.page_size, service)
    held_out = Workload.build("mooncake", trace, args.page_size, service, warmup_s=args.split_s)
    start = time.time()
    with tqdm(unit="point", desc="fit") as bar:
        fitted = fit(train, args.capacities, args.rounds, bar)
    print(f"scored sizes: {fitted['scored_sizes']}")
    for name in GRIDS:
        result = fitted[name]
        EVICTION_POLICIES[f"{name} (fitted)"] = variant(name, result["best"])
        print(f"{name}: best {result['best']} (mean gap closed {result['best_mean_gap_closed']:+.1%})")
    whole = Workload.build("mooncake-all", trace, args.page_size, service)
    live = fitted["liveness"] = fit_liveness(trace, train, whole, args.split_s)
    EVICTION_POLICIES["liveness (fitted)"] = type(
        "LivenessFit", (Liveness,), {"__init__": lambda s: Liveness.__init__(s, live["weights"], live["bias"])}
    )
    print(
        f"liveness: weights {[round(w, 3) for w in live['weights']]}, bias {live['bias']:.3f} "
        f"({live['rows']} sequences, {live['used_again']:.1%} used again within {live['horizon_s']:g} s, "
        f"AUC {live['train_auc']:.3f}; held out: {live['held_out_rows']}, {live['held_out_used_again']:.1%}, "
        f"AUC {live['held_out_auc']:.3f})"
    )
    fitted_names = [*GRIDS, "liveness"]
    policies = [*[n for n in EVICTION_POLICIES if "(fitted)" not in n], *[f"{n} (fitted)" for n in fitted_names]]
    with tqdm(total=len(policies) * len(args.capacities), unit="run", desc="held out") as bar:
        rows = report(held_out, args.capacities, policies, bar)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    env = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit.stdout.strip(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "seconds": round(time.time() - start),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "args": vars(args), "fit": fitted, "held_out": rows}, indent=1))
    print(f"\nheld out (from {args.split_s:g} s), hit rate (LRU -> Belady gap closed):\n")
    print(table(rows, policies))
    print(f"\n{env}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
