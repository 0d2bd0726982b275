"""Prefix-cache trace replay: token hit rate per eviction policy vs the offline optimum.

``radixlm bench cache-sim`` replays request traces (``radixlm.runtime.bench.cache_traces``)
against a ``RadixTree`` holding at most C pages, without running a model, for every
eviction policy in ``EVICTION_POLICIES`` and C = 10%..80% of the trace's working set, and
reports the token hit rate next to Belady's offline optimum on the same trace. With
``--tiers`` it replays a device tier and a host tier instead (``cache_sim_tiers``).

One request, as the server handles it (runtime/scheduler/prefix_cache.py), done instantly at its
arrival time (the tree's clock):

    prompt  [p0 ............................ pN-1]   output [o0 ..... oM-1]
    match   [ whole pages of p0..pN-2 ]                        (last prompt token recomputed)
    insert  [ whole pages of p0 .. pN-1 o0 .. oM-2 ]           (the last output token is
                                                                never run through the model)

1. ``match_prefix(prompt[:-1])`` -> cached tokens (page-aligned); lock the matched node.
2. Pages for the rest of the inserted key: free pages first, then ``evict`` unlocked
   leaves by the policy; a key longer than the whole budget is cut to fit.
3. ``insert`` the key, unlock. Requests never overlap in time (no running request holds
   pages while another arrives), so the budget C is all cache.

Token hit rate = cached prompt tokens / prompt tokens. Working set W = distinct pages of
all inserted keys (a cache of W pages never evicts: its hit rate is the trace's maximum).

Offline optimum (``belady``): Belady's MIN (Belady 1966, "A study of replacement
algorithms for a virtual-storage computer") at page granularity on the same requests:
a page is identified by its whole token prefix; when over budget it evicts the page
(not one of the current request's) whose next *counted* use -- the next request whose
matched part, ``prompt[:-1]``, contains it -- is farthest in the future, deeper pages
first on ties. A page that some request makes resident again before its next counted
use (its path holds the page but its matched part does not) counts as never used: that
request reloads it for free, so keeping it until then gains nothing.

* Exact optimum of this model (instant requests, unit-size pages, each request makes
  its inserted pages resident together, a hit counts the cached leading pages of
  ``prompt[:-1]``), by the usual exchange argument: a schedule that evicts q where MIN
  evicts p can evict p instead without losing a hit, since p is not needed before q.
  The free reloads can leave MIN's cache holding a page without its parent (the
  parent comes back before either is used), which no radix tree can do.
  ``tests/runtime/bench/test_cache_sim.py`` checks MIN against exhaustive search over every
  eviction choice on small traces.
* Upper bound for every radix-tree policy: evicting whole leaves is one of the page
  schedules MIN competes with. The best whole-leaf schedule (variable-size caching,
  NP-hard in general) may stay below MIN.
* Not the optimum of the real server, whose requests overlap and hold pages locked.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import importlib.util
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from radixlm.radix import EVICTION_POLICIES, RadixTree
from radixlm.runtime.bench.cache_sim_tiers import (
    WRITE_POLICIES,
    format_tier_table,
    plot_tiers,
    replay_tiered,
)
from radixlm.runtime.bench.cache_traces import (
    MooncakeConfig,
    MultiTurnConfig,
    ScanMixConfig,
    SharedPrefixConfig,
    TraceRequest,
    inserted_pages,
    mooncake,
    scan_mix,
    shared_prefix,
    sharegpt_multiturn,
    trace_summary,
)

__all__ = [
    "BELADY",
    "SimResult",
    "PageTrace",
    "replay",
    "belady",
    "capacity_sweep",
    "tier_sweep",
    "format_table",
    "main",
]

BELADY = "belady"  # the offline optimum's name in results


@dataclass(frozen=True)
class SimResult:
    """Totals of one replay. Tokens are prompt tokens; pages are KV pages."""

    policy: str
    capacity_pages: int
    prompt_tokens: int
    cached_tokens: int
    evicted_pages: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


# ----------------------------------------------------------------------------- online
def replay(
    trace: Sequence[TraceRequest], page_size: int, capacity_pages: int, policy: str
) -> SimResult:
    """Replay ``trace`` on a ``RadixTree(page_size, policy)`` of ``capacity_pages`` pages.

    The tree's clock is each request's arrival time (seconds); page ids are fresh integers.
    """
    now = 0.0
    tree = RadixTree(page_size, eviction_policy=policy, clock=lambda: now)
    page_ids = itertools.count()
    cached = prompt = evicted = 0
    for req in trace:
        now = req.arrival_s
        match = tree.match_prefix(req.prompt[:-1])
        tree.inc_lock(match.node)
        want = min(inserted_pages(req, page_size), capacity_pages)
        need = want - len(match.pages)
        short = need - (capacity_pages - tree.cached_pages)
        if short > 0:
            evicted += len(tree.evict(short))
        fits = min(need, capacity_pages - tree.cached_pages)
        pages = match.pages + [next(page_ids) for _ in range(fits)]
        seq = req.prompt + req.output
        tree.insert(seq[: len(pages) * page_size], pages)
        tree.dec_lock(match.node)
        cached += match.num_tokens
        prompt += len(req.prompt)
    return SimResult(policy, capacity_pages, prompt, cached, evicted)


# ----------------------------------------------------------------------------- offline
@dataclass
class PageTrace:
    """The trace as paths of page ids, a page id standing for a whole token prefix.

    ``paths[j]``: ids of request j's inserted pages (root first); ``counted[j]``: how
    many of them its match may reuse ((len(prompt) - 1) // page_size); ``uses[p]``:
    requests whose counted part contains page p, ascending; ``depth[p]``: p's index in
    its path. ``num_pages`` is the working set W.
    """

    paths: list[list[int]] = field(default_factory=list)
    counted: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    uses: list[list[int]] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return len(self.depth)

    @classmethod
    def build(cls, trace: Iterable[TraceRequest], page_size: int) -> PageTrace:
        pt, ids = cls(), {}
        for j, req in enumerate(trace):
            seq, parent, path = req.prompt + req.output, -1, []
            for k in range(inserted_pages(req, page_size)):
                key = (parent, seq[k * page_size : (k + 1) * page_size])
                parent = ids.get(key, -1)
                if parent < 0:
                    parent = ids[key] = len(ids)
                    pt.uses.append([])
                    pt.depth.append(k)
                path.append(parent)
            counted = (len(req.prompt) - 1) // page_size
            for page in path[:counted]:
                pt.uses[page].append(j)
            pt.paths.append(path)
            pt.counted.append(counted)
            pt.prompt_tokens.append(len(req.prompt))
        return pt


class _MinCache:
    """Page cache evicting the page with the farthest next counted use (Belady's MIN).

    Max-heap entries ``(-next_use, -depth, page)`` with lazy invalidation: an entry is
    current while the page is cached and its next use is unchanged.
    """

    def __init__(self, pt: PageTrace, capacity: int, resident: int) -> None:
        self.pt, self.capacity, self.resident = pt, capacity, resident
        self.never = len(pt.paths)  # next use of a page nobody reads again
        self.cached = bytearray(pt.num_pages)
        self.next_use = [self.never] * pt.num_pages
        self.cursor = [0] * pt.num_pages  # index into uses[p] of the next use
        # admits[p]: requests that make p resident (p in their path cut to ``resident``)
        self.admits: list[list[int]] = [[] for _ in range(pt.num_pages)]
        for j, path in enumerate(pt.paths):
            for page in path[:resident]:
                self.admits[page].append(j)
        self.admit_cursor = [0] * pt.num_pages
        self.size = self.evicted = 0
        self.heap: list[tuple[int, int, int]] = []

    def hits(self, j: int) -> int:
        """Leading counted pages of request j that are cached."""
        n = 0
        for page in self.pt.paths[j][: self.pt.counted[j]]:
            if not self.cached[page]:
                break
            n += 1
        return n

    def admit(self, j: int) -> None:
        """Make request j's pages (cut to ``resident``) resident, then evict down to the
        budget."""
        path = self.pt.paths[j][: self.resident]
        for page in path:
            self._advance(page, j)
            if not self.cached[page]:
                self.cached[page] = 1
                self.size += 1
            heapq.heappush(self.heap, (-self.next_use[page], -self.pt.depth[page], page))
        self._evict(set(path))

    def _advance(self, page: int, j: int) -> None:
        """Eviction key of ``page`` after request j: its next counted use, or ``never``
        when a request that does not count it makes it resident first (keeping it until
        then gains nothing: that request reloads it for free)."""
        use = self._next(self.pt.uses[page], self.cursor, page, j)
        admit = self._next(self.admits[page], self.admit_cursor, page, j)
        self.next_use[page] = use if use == admit else self.never

    def _next(self, requests: list[int], cursor: list[int], page: int, j: int) -> int:
        k = cursor[page]
        while k < len(requests) and requests[k] <= j:
            k += 1
        cursor[page] = k
        return requests[k] if k < len(requests) else self.never

    def _evict(self, locked: set[int]) -> None:
        held = []
        while self.size > self.capacity:
            entry = heapq.heappop(self.heap)
            page = entry[2]
            if not self.cached[page] or self.next_use[page] != -entry[0]:
                continue  # stale entry
            if page in locked:
                held.append(entry)
                continue
            self.cached[page] = 0
            self.size -= 1
            self.evicted += 1
        for entry in held:
            heapq.heappush(self.heap, entry)


def belady(
    pt: PageTrace, page_size: int, capacity_pages: int, resident_pages: int | None = None
) -> SimResult:
    """Belady's MIN on ``pt`` with ``capacity_pages`` pages (see the module docstring).

    ``resident_pages`` (default: ``capacity_pages``, at most that): a request makes only
    the first that many pages of its path resident, as a two-tier cache whose device
    holds fewer pages than both tiers together (``cache_sim_tiers``). The exchange
    argument is unchanged, and ``tests/runtime/bench/test_cache_sim_tiers.py`` checks
    this case against exhaustive search too."""
    resident = capacity_pages if resident_pages is None else min(resident_pages, capacity_pages)
    cache = _MinCache(pt, capacity_pages, resident)
    cached = 0
    for j in range(len(pt.paths)):
        cached += cache.hits(j) * page_size
        cache.admit(j)
    return SimResult(BELADY, capacity_pages, sum(pt.prompt_tokens), cached, cache.evicted)


# ----------------------------------------------------------------------------- sweep
def capacity_sweep(
    trace: Sequence[TraceRequest],
    pt: PageTrace,
    page_size: int,
    fractions: Sequence[float],
    policies: Sequence[str],
    on_result: Callable[[float, SimResult], None],
) -> None:
    """Belady and every policy at ``round(f * W)`` pages (at least 1) for each fraction
    f of the working set W = ``pt.num_pages``; ``on_result(f, result)`` after each run."""
    for fraction in fractions:
        capacity = max(1, round(fraction * pt.num_pages))
        on_result(fraction, belady(pt, page_size, capacity))
        for policy in policies:
            on_result(fraction, replay(trace, page_size, capacity, policy))


def tier_sweep(
    name: str,
    trace: Sequence[TraceRequest],
    pt: PageTrace,
    page_size: int,
    device_fractions: Sequence[float],
    host_fractions: Sequence[float],
    policies: Sequence[str],
    write_policy: str,
) -> Iterator[dict]:
    """Two tiers (``cache_sim_tiers``): one JSON line per device fraction f1, host
    fraction f2 and policy, C1 = round(f1 W) pages (at least 1) and C2 = round(f2 W) for
    the working set W = ``pt.num_pages``: the replay's totals and hit rates, and Belady
    at C1 and at C1 + C2 with resident pages cut to C1 (bounds on the device and the
    total hit rate)."""
    optimum: dict[tuple[int, int], float] = {}

    def belady_rate(capacity: int, resident: int) -> float:
        if (capacity, resident) not in optimum:
            optimum[capacity, resident] = belady(pt, page_size, capacity, resident).hit_rate
        return optimum[capacity, resident]

    for f1, f2 in itertools.product(device_fractions, host_fractions):
        c1, c2 = max(1, round(f1 * pt.num_pages)), round(f2 * pt.num_pages)
        bounds = {
            "belady_device_hit_rate": belady_rate(c1, c1),
            "belady_total_hit_rate": belady_rate(c1 + c2, c1),
        }
        for policy in policies:
            r = replay_tiered(trace, page_size, c1, c2, policy, write_policy)
            yield {
                "kind": "tier_result",
                "trace": name,
                "policy": policy,
                "write_policy": write_policy,
                "device_fraction": f1,
                "host_fraction": f2,
                "device_pages": c1,
                "host_pages": c2,
                "working_set_pages": pt.num_pages,
                "prompt_tokens": r.prompt_tokens,
                "device_hit_tokens": r.device_hit_tokens,
                "host_hit_tokens": r.host_hit_tokens,
                "device_hit_rate": r.device_hit_rate,
                "host_hit_rate": r.host_hit_rate,
                "hit_rate": r.hit_rate,
                "evicted_pages": r.evicted_pages,
                "copied_pages": r.copied_pages,
                "released_pages": r.released_pages,
                **bounds,
            }


# ----------------------------------------------------------------------------- report
TRACES = ("multiturn", "shared-prefix", "scan-mix", "mooncake")
CONFIGS = {
    "multiturn": MultiTurnConfig,
    "shared-prefix": SharedPrefixConfig,
    "scan-mix": ScanMixConfig,
    "mooncake": MooncakeConfig,
}
FLAG_PREFIX = {
    "multiturn": "mt",
    "shared-prefix": "gsp",
    "scan-mix": "scan",
    "mooncake": "mooncake",
}
DEFAULT_TRACES = ("multiturn", "shared-prefix", "scan-mix")  # mooncake needs its file
DEFAULT_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
# --tiers: device (C1) and host (C2) sizes as fractions of the working set
DEFAULT_TIER_TRACES = ("mooncake", "multiturn")
DEFAULT_DEVICE_FRACTIONS = (0.005, 0.01, 0.02, 0.04, 0.08)
DEFAULT_HOST_FRACTIONS = (0.0, 0.1, 0.25, 0.5)


def build_trace(name: str, cfg: Any, seed: int, tokenizer_dir: str | None) -> list[TraceRequest]:
    if name == "multiturn":
        return sharegpt_multiturn(cfg, seed, tokenizer_dir)
    if name == "mooncake":
        return mooncake(cfg.path, cfg.max_requests)
    return shared_prefix(cfg, seed) if name == "shared-prefix" else scan_mix(cfg, seed)


def trace_page_size(name: str, page_size: int) -> int:
    """Tokens per page for a trace: ``page_size``, but 1 for mooncake (one page per
    512-token block, its token ids being block ids)."""
    return 1 if name == "mooncake" else page_size


def result_row(trace: str, fraction: float, working_set: int, result: SimResult) -> dict:
    """One JSON line: a policy's totals at one capacity."""
    return {
        "trace": trace,
        "policy": result.policy,
        "capacity_fraction": fraction,
        "capacity_pages": result.capacity_pages,
        "working_set_pages": working_set,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "hit_rate": result.hit_rate,
        "evicted_pages": result.evicted_pages,
    }


def gap_closed(best: float, lru: float, optimum: float) -> float:
    """Share of the LRU -> optimum gap that ``best`` closes (nan when there is none)."""
    return (best - lru) / (optimum - lru) if optimum - lru > 1e-9 else float("nan")


def format_table(trace: str, rows: list[dict], policies: Sequence[str]) -> str:
    """Markdown: hit rate per capacity (rows) and policy (columns), the optimum, and the
    share of the LRU -> optimum gap that the best online policy closes."""
    by = {(r["capacity_fraction"], r["policy"]): r["hit_rate"] for r in rows if r["trace"] == trace}
    fractions = sorted({f for f, _ in by})
    head = (
        f"| {trace}: capacity | "
        + " | ".join(policies)
        + f" | {BELADY} (optimum) | best online: gap closed |"
    )
    lines = [head, "|" + "---|" * (len(policies) + 3)]
    for f in fractions:
        rates = [by[f, p] for p in policies]
        best = max(range(len(policies)), key=rates.__getitem__)
        closed = gap_closed(rates[best], by.get((f, "lru"), float("nan")), by[f, BELADY])
        closed_text = "no gap" if closed != closed else f"{closed:.0%}"
        cells = " | ".join(f"{r:.1%}" for r in rates)
        lines.append(
            f"| {f:.0%} | {cells} | {by[f, BELADY]:.1%} | {policies[best]}: {closed_text} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], traces: Sequence[str], policies: Sequence[str], path: Path) -> None:
    """Hit rate vs capacity per policy, one panel per trace, the optimum dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    for ax, trace in zip(axes[0], traces, strict=True):
        for policy in [*policies, BELADY]:
            pts = sorted(
                (r["capacity_fraction"], r["hit_rate"])
                for r in rows
                if r["trace"] == trace and r["policy"] == policy
            )
            style = (
                dict(color="black", linestyle="--") if policy == BELADY else dict(marker="o", ms=3)
            )
            label = "Belady (offline optimum)" if policy == BELADY else policy
            ax.plot([100 * x for x, _ in pts], [100 * y for _, y in pts], label=label, **style)
        ax.set(title=trace, xlabel="capacity (% of working set)", ylabel="token hit rate (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI
def _add_config_args(parser: argparse.ArgumentParser, trace: str) -> None:
    """``--<prefix>-<field>`` for every field of the trace's config dataclass."""
    group = parser.add_argument_group(f"{trace} trace")
    for f in dataclasses.fields(CONFIGS[trace]):
        flag = f"--{FLAG_PREFIX[trace]}-{f.name.replace('_', '-')}"
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if isinstance(f.default, bool):
            group.add_argument(flag, action="store_true", help=help_text)
        else:
            group.add_argument(flag, type=type(f.default), default=f.default, help=help_text)


def _config_from_args(args: argparse.Namespace, trace: str) -> Any:
    cls, prefix = CONFIGS[trace], FLAG_PREFIX[trace]
    return cls(**{f.name: getattr(args, f"{prefix}_{f.name}") for f in dataclasses.fields(cls)})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="radixlm bench cache-sim",
        description="Replay request traces against the radix tree at several page budgets; "
        "token hit rate per eviction policy next to Belady's offline optimum.",
    )
    p.add_argument(
        "--traces",
        nargs="+",
        choices=TRACES,
        help=f"default: {' '.join(DEFAULT_TRACES)}; with --tiers {' '.join(DEFAULT_TIER_TRACES)}",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        choices=tuple(EVICTION_POLICIES),
        help="eviction policies (default: all; with --tiers lru)",
    )
    p.add_argument(
        "--capacities",
        nargs="+",
        type=float,
        default=list(DEFAULT_FRACTIONS),
        help="page budgets as fractions of each trace's working set (without --tiers)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="tokens per KV page (mooncake: always 1, one page per 512-token block)",
    )
    tiers = p.add_argument_group("two-tier mode (hierarchical KV cache)")
    tiers.add_argument(
        "--tiers",
        action="store_true",
        help="replay against a device tier and a host tier under the radix tree "
        "(cache_sim_tiers): hit rate per tier for every device x host size, next to "
        "Belady and the infinite cache; writes cache_sim_tiers.{jsonl,png}",
    )
    tiers.add_argument(
        "--device-capacities",
        nargs="+",
        type=float,
        default=list(DEFAULT_DEVICE_FRACTIONS),
        help="device tier sizes as fractions of each trace's working set",
    )
    tiers.add_argument(
        "--host-capacities",
        nargs="+",
        type=float,
        default=list(DEFAULT_HOST_FRACTIONS),
        help="host tier sizes as fractions of each trace's working set (0: no host tier)",
    )
    tiers.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write_back",
        help="write_back: copy a page to the host when the device evicts it; "
        "write_through: when it is inserted",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every trace generator")
    p.add_argument(
        "--tokenizer-path",
        help="directory with tokenizer.json for the ShareGPT "
        "trace (default: the SmolLM2 model's, converted once; imports torch)",
    )
    p.add_argument(
        "--output-dir",
        default="cache_sim_results",
        help="where cache_sim.jsonl and cache_sim.png are written",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for trace in TRACES:
        _add_config_args(p, trace)
    args = p.parse_args(argv)
    args.traces = args.traces or list(DEFAULT_TIER_TRACES if args.tiers else DEFAULT_TRACES)
    args.policies = args.policies or (["lru"] if args.tiers else list(EVICTION_POLICIES))
    return args


def load_trace(trace: str, args: argparse.Namespace) -> tuple[list[TraceRequest], PageTrace, dict]:
    """Build one trace; its page paths; its JSON line (with the infinite cache's hit rate,
    ``max_hit_rate``, and ``hit_unit``: what the hit rates count, tokens or blocks)."""
    cfg = _config_from_args(args, trace)
    requests = build_trace(trace, cfg, args.seed, args.tokenizer_path)
    page_size = trace_page_size(trace, args.page_size)
    pt = PageTrace.build(requests, page_size)
    row = {
        "kind": "trace",
        "trace": trace,
        "seed": args.seed,
        "page_size": page_size,
        "hit_unit": "block" if trace == "mooncake" else "token",
        "working_set_pages": pt.num_pages,
        "max_hit_rate": belady(pt, page_size, pt.num_pages).hit_rate,
        **trace_summary(requests),
        "config": dataclasses.asdict(cfg),
    }
    return requests, pt, row


def _sweep_trace(trace: str, args: argparse.Namespace, bar: tqdm) -> list[dict]:
    """Build one trace, then run Belady and every policy at every capacity."""
    bar.set_postfix_str(f"building {trace}")
    requests, pt, info = load_trace(trace, args)
    rows = [info]

    def record(fraction: float, result: SimResult) -> None:
        rows.append({"kind": "result", **result_row(trace, fraction, pt.num_pages, result)})
        bar.set_postfix_str(f"{trace} {fraction:.0%} {result.policy}")
        bar.update(1)

    capacity_sweep(requests, pt, info["page_size"], args.capacities, args.policies, record)
    return rows


def trace_header(info: dict) -> str:
    """One line on a trace: requests, working set, the infinite cache's hit rate."""
    pages = " (one per 512-token block)" if info["hit_unit"] == "block" else ""
    return (
        f"{info['trace']}: {info['requests']} requests, working set {info['working_set_pages']} "
        f"pages{pages}, best possible (infinite cache) {info['hit_unit']} hit rate "
        f"{info['max_hit_rate']:.1%}"
    )


def _run_tiers(args: argparse.Namespace, out: Path) -> int:
    """``--tiers``: sweep every trace, write ``cache_sim_tiers.{jsonl,png}`` under ``out``,
    print one table per trace and policy."""
    rows: list[dict] = []
    runs = len(args.traces) * len(args.device_capacities) * len(args.host_capacities)
    runs *= len(args.policies)
    with tqdm(total=runs, unit="run", desc="cache-sim --tiers", disable=args.no_progress) as bar:
        for trace in args.traces:
            bar.set_postfix_str(f"building {trace}")
            requests, pt, info = load_trace(trace, args)
            rows.append(info)
            sweep = tier_sweep(
                trace,
                requests,
                pt,
                info["page_size"],
                args.device_capacities,
                args.host_capacities,
                args.policies,
                args.write_policy,
            )
            for row in sweep:
                rows.append(row)
                bar.set_postfix_str(
                    f"{trace} {row['device_fraction']:.1%} + {row['host_fraction']:.0%} "
                    f"{row['policy']}"
                )
                bar.update(1)
    with open(out / "cache_sim_tiers.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    traces = {r["trace"]: r for r in rows if r["kind"] == "trace"}
    results = [r for r in rows if r["kind"] == "tier_result"]
    plot_tiers(results, traces, out / "cache_sim_tiers.png")
    for trace, info in traces.items():
        print(f"\n{trace_header(info)}")
        for policy in args.policies:
            print(format_tier_table(trace, results, policy))
    print(f"\nwrote {out / 'cache_sim_tiers.jsonl'} and {out / 'cache_sim_tiers.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # fail before the long part
        raise SystemExit("radixlm bench cache-sim needs matplotlib: pip install 'radixlm[bench]'")
    if "mooncake" in args.traces and not Path(args.mooncake_path).is_file():
        raise SystemExit(
            f"radixlm bench cache-sim: no Mooncake trace at {Path(args.mooncake_path).resolve()}; "
            "pass --mooncake-path (conversation_trace.jsonl of kvcache-ai/Mooncake, "
            "FAST25-release/traces/)"
        )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiers:
        return _run_tiers(args, out)
    rows: list[dict] = []
    runs = len(args.traces) * len(args.capacities) * (len(args.policies) + 1)
    with tqdm(total=runs, unit="run", desc="cache-sim", disable=args.no_progress) as bar:
        for trace in args.traces:
            rows += _sweep_trace(trace, args, bar)
    with open(out / "cache_sim.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    results = [r for r in rows if r["kind"] == "result"]
    plot(results, args.traces, args.policies, out / "cache_sim.png")
    for trace in args.traces:
        info = next(r for r in rows if r["kind"] == "trace" and r["trace"] == trace)
        print(f"\n{trace_header(info)}")
        print(format_table(trace, results, args.policies))
    print(f"\nwrote {out / 'cache_sim.jsonl'} and {out / 'cache_sim.png'}")
    return 0
