"""Prefix-cache trace replay: token hit rate per eviction policy vs the offline optimum.

``radixlm bench cache-sim`` replays request traces (``radixlm.runtime.bench.cache_traces``)
against a ``RadixTree`` in a pool of C KV pages, without running a model, for every
eviction policy in ``EVICTION_POLICIES`` and C = fractions of the trace's working set, and
reports the token hit rate next to Belady's offline optimum (``cache_min``) on the same
requests. With ``--tiers`` it replays a device tier and a host tier instead
(``cache_sim_tiers``).

Requests follow ``cache_model``: *instant* (each request happens at its arrival; the whole
pool is cache) or, with ``--prefill-tokens-per-s`` / ``--decode-step-ms``, *timed*
(requests overlap by their timestamps; a running request's prompt pages stay locked and
its private pages take room until it finishes). ``cache_model.PoolReplay`` is the replay,
step by step as the server does it.

Token hit rate = cached prompt tokens / prompt tokens, over the requests arriving at or
after ``--warmup-s`` (the earlier ones only warm the cache). Working set W = distinct KV
pages of all inserted keys (in the instant model a pool of W pages never evicts).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from radixlm.radix import EVICTION_POLICIES, MatchResult
from radixlm.runtime.bench.cache_min import BELADY, MinResult, PageTrace, belady
from radixlm.runtime.bench.cache_model import Geometry, PoolReplay, ServiceModel
from radixlm.runtime.bench.cache_sim_tiers import (
    WRITE_POLICIES,
    TierResult,
    format_tier_policies,
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
    mooncake,
    scan_mix,
    shared_prefix,
    sharegpt_multiturn,
    trace_summary,
)

__all__ = [
    "SimResult",
    "Workload",
    "replay",
    "capacity_sweep",
    "tier_sweep",
    "format_table",
    "main",
]


@dataclass(frozen=True)
class SimResult:
    """Totals of one replay. Tokens are scored prompt tokens; pages are KV pages."""

    policy: str
    capacity_pages: int
    prompt_tokens: int
    cached_tokens: int
    evicted_pages: int
    overflow_pages: int = 0  # pages running requests needed beyond the pool (timed model)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


# ----------------------------------------------------------------------------- online
class _SingleTier(PoolReplay):
    """The replay of ``cache_model.PoolReplay`` counting device hits."""

    cached_tokens = 0

    def _score(self, match: MatchResult, num_pages: int) -> None:
        self.cached_tokens += match.num_tokens * self.geo.id_tokens


def replay(
    trace: Sequence[TraceRequest],
    page_size: int,
    capacity_pages: int,
    policy: str,
    service: ServiceModel | None = None,
    warmup_s: float = 0.0,
) -> SimResult:
    """Replay ``trace`` on a ``RadixTree`` with ``policy`` in a pool of ``capacity_pages``
    KV pages of ``page_size`` tokens: instant, or timed with ``service``
    (``cache_model``); requests arriving before ``warmup_s`` are not scored."""
    sim = _SingleTier(Geometry.of(trace, page_size), capacity_pages, policy, service is not None)
    sim.run(trace, service, warmup_s)
    return SimResult(
        policy,
        capacity_pages,
        sim.prompt_tokens,
        sim.cached_tokens,
        sim.evicted_pages,
        sim.overflow_pages,
    )


# ----------------------------------------------------------------------------- sweep
@dataclass(frozen=True)
class Workload:
    """One trace ready to replay: its requests, their page paths (for Belady), the page
    size in tokens, the request model (``service`` None: instant) and the warm-up."""

    name: str
    requests: Sequence[TraceRequest]
    pt: PageTrace
    page_size: int
    service: ServiceModel | None = None
    warmup_s: float = 0.0

    @classmethod
    def build(
        cls,
        name: str,
        requests: Sequence[TraceRequest],
        page_size: int,
        service: ServiceModel | None = None,
        warmup_s: float = 0.0,
    ) -> Workload:
        pt = PageTrace.build(requests, page_size, service, warmup_s)
        return cls(name, requests, pt, page_size, service, warmup_s)

    def pages(self, fraction: float) -> int:
        """``round(fraction x W)`` KV pages, W the working set."""
        return round(fraction * self.pt.working_set_pages)

    def replay(self, capacity: int, policy: str) -> SimResult:
        return replay(self.requests, self.page_size, capacity, policy, self.service, self.warmup_s)

    def belady(self, capacity: int, device: int | None = None) -> MinResult:
        return belady(self.pt, capacity, device)

    def replay_tiered(
        self, c1: int, c2: int, policy: str, write_policy: str, host_policy: str | None = None
    ) -> TierResult:
        return replay_tiered(
            self.requests,
            self.page_size,
            c1,
            c2,
            policy,
            write_policy,
            self.service,
            self.warmup_s,
            host_policy,
        )


def capacity_sweep(
    work: Workload,
    fractions: Sequence[float],
    policies: Sequence[str],
    on_result: Callable[[float, SimResult], None],
) -> None:
    """Belady and every policy at ``Workload.pages(f)`` (at least one tree page) for
    each fraction f of the working set; ``on_result(f, result)`` after each run."""
    for fraction in fractions:
        capacity = max(work.pt.geo.kv_per_page, work.pages(fraction))
        on_result(fraction, work.belady(capacity))
        for policy in policies:
            on_result(fraction, work.replay(capacity, policy))


def tier_sweep(
    work: Workload,
    device_fractions: Sequence[float],
    host_fractions: Sequence[float],
    policies: Sequence[str],
    write_policy: str,
    host_policy: str | None = None,
) -> Iterator[dict]:
    """Two tiers (``cache_sim_tiers``): one JSON line per device fraction f1, host
    fraction f2 and policy (the host's: ``host_policy``, default the same), C1 = ``Workload.pages(f1)`` KV pages (at least one tree page)
    and C2 = ``Workload.pages(f2)``: the replay's totals and hit rates, and Belady at C1
    and at C1 + C2 with the locks of a C1 pool (bounds on the device and the total hit
    rate)."""
    optimum: dict[tuple[int, int], float] = {}

    def belady_rate(capacity: int, device: int) -> float:
        if (capacity, device) not in optimum:
            optimum[capacity, device] = work.belady(capacity, device).hit_rate
        return optimum[capacity, device]

    for f1, f2 in itertools.product(device_fractions, host_fractions):
        c1, c2 = max(work.pt.geo.kv_per_page, work.pages(f1)), work.pages(f2)
        bounds = {
            "belady_device_hit_rate": belady_rate(c1, c1),
            "belady_total_hit_rate": belady_rate(c1 + c2, c1),
        }
        for policy in policies:
            r = work.replay_tiered(c1, c2, policy, write_policy, host_policy)
            yield {
                "kind": "tier_result",
                "trace": work.name,
                "policy": policy,
                "host_policy": host_policy or policy,
                "write_policy": write_policy,
                "device_fraction": f1,
                "host_fraction": f2,
                "device_pages": c1,
                "host_pages": c2,
                "working_set_pages": work.pt.working_set_pages,
                "prompt_tokens": r.prompt_tokens,
                "device_hit_tokens": r.device_hit_tokens,
                "host_hit_tokens": r.host_hit_tokens,
                "device_hit_rate": r.device_hit_rate,
                "host_hit_rate": r.host_hit_rate,
                "hit_rate": r.hit_rate,
                "evicted_pages": r.evicted_pages,
                "copied_pages": r.copied_pages,
                "released_pages": r.released_pages,
                "overflow_pages": r.overflow_pages,
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
        "overflow_pages": getattr(result, "overflow_pages", 0),
    }


def gap_closed(best: float, lru: float, optimum: float) -> float:
    """Share of the LRU -> optimum gap that ``best`` closes (nan when there is none)."""
    return (best - lru) / (optimum - lru) if optimum - lru > 1e-9 else float("nan")


def percent(fraction: float) -> str:
    """0.005 -> "0.5%", 0.3 -> "30%"."""
    return f"{100 * fraction:.3g}%"


def format_table(trace: str, rows: list[dict], policies: Sequence[str]) -> str:
    """Markdown: hit rate per capacity (rows) and policy (columns), each with the share
    of the LRU -> optimum gap it closes, and the optimum."""
    by = {(r["capacity_fraction"], r["policy"]): r["hit_rate"] for r in rows if r["trace"] == trace}
    fractions = sorted({f for f, _ in by})
    head = f"| {trace}: capacity | " + " | ".join(policies) + f" | {BELADY} (optimum) |"
    lines = [head, "|" + "---|" * (len(policies) + 2)]
    for f in fractions:
        lru, best = by.get((f, "lru"), float("nan")), by[f, BELADY]
        cells = []
        for p in policies:
            closed = gap_closed(by[f, p], lru, best)
            gap = "" if p == "lru" or closed != closed else f" ({closed:+.0%})"
            cells.append(f"{by[f, p]:.1%}{gap}")
        lines.append(f"| {percent(f)} | {' | '.join(cells)} | {best:.1%} |")
    return "\n".join(lines)


def plot(rows: list[dict], traces: Sequence[str], policies: Sequence[str], path: Path) -> None:
    """Hit rate vs capacity per policy, one panel per trace, the optimum dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

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
        xs = [r["capacity_fraction"] for r in rows if r["trace"] == trace]
        if xs and max(xs) >= 8 * min(xs):  # small pools: a log axis
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
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
        help="tokens per KV page (mooncake: each 512-token block is 512 / page size pages)",
    )
    timed = p.add_argument_group(
        "timed model (requests overlap by their arrival times; cache_model.ServiceModel)"
    )
    timed.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=0.0,
        help="a request runs input tokens / this (prefill of its whole prompt) plus output "
        "tokens x --decode-step-ms, its prompt pages locked and its other KV held meanwhile "
        "(0 with --decode-step-ms 0: the instant model, no overlap)",
    )
    timed.add_argument(
        "--decode-step-ms",
        type=float,
        default=0.0,
        help="milliseconds per output token of a running request (timed model)",
    )
    timed.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="requests arriving earlier (trace seconds) warm the cache and are not scored",
    )
    timed.add_argument(
        "--until-s",
        type=float,
        default=float("inf"),
        help="replay only the requests arriving earlier (trace seconds)",
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
        "--host-policy",
        choices=tuple(EVICTION_POLICIES),
        help="the host tier's eviction policy (default: each --policies one, as the server "
        "orders every tier by its --radix-eviction-policy)",
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


def service_from_args(args: argparse.Namespace) -> ServiceModel | None:
    """The timed model of ``--prefill-tokens-per-s`` / ``--decode-step-ms``; None (the
    instant model) when both are 0."""
    if args.prefill_tokens_per_s <= 0 and args.decode_step_ms <= 0:
        return None
    return ServiceModel(args.prefill_tokens_per_s, args.decode_step_ms / 1000)


def load_trace(trace: str, args: argparse.Namespace) -> tuple[Workload, dict]:
    """Build one trace (cut at ``--until-s``) as a ``Workload``, and its JSON line (with
    the infinite cache's hit rate, ``max_hit_rate``)."""
    cfg = _config_from_args(args, trace)
    requests = [
        r for r in build_trace(trace, cfg, args.seed, args.tokenizer_path) if r.arrival_s < args.until_s
    ]
    service = service_from_args(args)
    work = Workload.build(trace, requests, args.page_size, service, args.warmup_s)
    unbounded = work.pt.working_set_pages + sum(p.private for p in work.pt.pages)
    row = {
        "kind": "trace",
        "trace": trace,
        "seed": args.seed,
        "page_size": args.page_size,
        "working_set_pages": work.pt.working_set_pages,
        "max_hit_rate": work.belady(unbounded).hit_rate,
        "service": dataclasses.asdict(service) if service else None,
        "warmup_s": args.warmup_s,
        "until_s": args.until_s,
        **trace_summary(requests),
        "config": dataclasses.asdict(cfg),
    }
    return work, row


def _sweep_trace(trace: str, args: argparse.Namespace, bar: tqdm) -> list[dict]:
    """Build one trace, then run Belady and every policy at every capacity."""
    bar.set_postfix_str(f"building {trace}")
    work, info = load_trace(trace, args)
    rows = [info]

    def record(fraction: float, result: SimResult) -> None:
        rows.append(
            {"kind": "result", **result_row(trace, fraction, work.pt.working_set_pages, result)}
        )
        bar.set_postfix_str(f"{trace} {percent(fraction)} {result.policy}")
        bar.update(1)

    capacity_sweep(work, args.capacities, args.policies, record)
    return rows


def trace_header(info: dict) -> str:
    """One line on a trace: requests, working set, the infinite cache's hit rate."""
    return (
        f"{info['trace']}: {info['requests']} requests, working set {info['working_set_pages']} "
        f"pages of {info['page_size']} tokens, best possible (infinite cache) token hit rate "
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
            work, info = load_trace(trace, args)
            rows.append(info)
            sweep = tier_sweep(
                work,
                args.device_capacities,
                args.host_capacities,
                args.policies,
                args.write_policy,
                args.host_policy,
            )
            for row in sweep:
                rows.append(row)
                bar.set_postfix_str(
                    f"{trace} {percent(row['device_fraction'])} + "
                    f"{percent(row['host_fraction'])} {row['policy']}"
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
        if len(args.policies) > 1 and "lru" in args.policies:
            print(format_tier_policies(trace, results, args.policies))
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
