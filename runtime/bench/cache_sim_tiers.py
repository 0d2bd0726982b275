"""Two-tier prefix-cache replay: hit rate per tier of the hierarchical KV cache.

``radixlm bench cache-sim --tiers`` (``cache_sim.tier_sweep``) replays request traces
(``cache_traces``) against a tiered ``RadixTree(tiers=("host",))`` (radix/tree.py,
"Tiers"; the server's controller is runtime/scheduler/hicache.py) with a device tier of C1
KV pages and a host tier of C2 KV pages, without a model, and reports for every (C1, C2)
the share of prompt tokens served from each tier, next to Belady's offline optimum and
the infinite cache.

One request as ``cache_model.PoolReplay`` (instant or timed; running requests lock their
pages and hold private pages on the device), with the host tier added:

1. ``match_prefix(prompt[:-1])``: the leading device run is a device hit; the matched
   nodes after it (``tail``, cached only on the host) are host hits, loaded back as far
   as the key cached at arrival reaches. The match (device run and tail) is locked while
   room is made.
2. Device pages for the rest of the key: free ones first, then ``evict`` by the policy.
   An evicted node with a host copy keeps it and stays matchable; one without is copied
   down under write-back (``on_demote``; the host makes room with ``evict_tier``, by the
   same policy), and is dropped otherwise or when the host cannot take it.
3. ``insert`` the key: tail nodes get device pages back (promotion; they keep their host
   copy), the rest is new. Write-through then copies every node of the key's path that
   has no host copy down (room made as in 2; none left: not copied). Likewise for the
   output's pages inserted when a timed request finishes.

Write policies (the server's ``--hicache-write-policy``): ``write_back`` copies a page
down only when the device evicts it, so no copy is wasted work; ``write_through`` copies
every page when it is inserted. Host handles are fresh integers; the host holds at most
C2 KV pages at any time.

Hit rates: device (host) hit tokens / prompt tokens; total = their sum. Bounds, from
the single-tier model of ``cache_min`` (a schedule of pages held after each event, which
contains the pages the event makes resident):

* Belady at C1 bounds the device hit rate: the device alone is such a schedule.
* Belady at C1 + C2, with the locks, private pages and resident cuts of a C1 pool
  (``belady(..., device_pages=C1)``), bounds the total: after each event the two tiers
  hold at most C1 + C2 distinct KV pages less the private ones, among them the pages the
  event makes resident.
* The infinite cache (Belady at the working set W) bounds both; a host tier of W pages
  reaches it when no request is cut (nothing is ever dropped).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from radixlm.radix import MatchResult
from radixlm.radix.tree import TreeNode
from radixlm.runtime.bench.cache_model import Geometry, PoolReplay, ServiceModel
from radixlm.runtime.bench.cache_traces import TraceRequest

__all__ = [
    "WRITE_POLICIES",
    "TierResult",
    "TieredCache",
    "replay_tiered",
    "format_tier_table",
    "format_tier_policies",
    "plot_tiers",
]

WRITE_POLICIES = ("write_back", "write_through")  # as the server's --hicache-write-policy
HOST = 0  # the host tier's index among the tree's lower tiers


@dataclass(frozen=True)
class TierResult:
    """Totals of one two-tier replay. Tokens are scored prompt tokens; pages are KV
    pages."""

    policy: str
    write_policy: str
    device_pages: int  # C1
    host_pages: int  # C2
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int  # loaded back from the host
    evicted_pages: int  # device pages freed by eviction
    copied_pages: int  # pages copied down to the host
    released_pages: int  # host pages freed (evicted there, or dropped with their node)
    overflow_pages: int = 0  # device pages running requests needed beyond C1 (timed model)

    @property
    def device_hit_rate(self) -> float:
        return self.device_hit_tokens / max(self.prompt_tokens, 1)

    @property
    def host_hit_rate(self) -> float:
        return self.host_hit_tokens / max(self.prompt_tokens, 1)

    @property
    def hit_rate(self) -> float:
        return self.device_hit_rate + self.host_hit_rate


class TieredCache(PoolReplay):
    """A tiered radix tree of ``device_pages`` (C1 >= 1) device KV pages and ``host_pages``
    (C2 >= 0) host KV pages replaying requests (module docstring; ``run``, or ``arrive`` /
    ``finish`` one by one); ``tree`` is open to checks."""

    def __init__(
        self,
        geo: Geometry,
        device_pages: int,
        host_pages: int,
        policy: str = "lru",
        write_policy: str = "write_back",
        timed: bool = False,
        host_policy: str | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; choose from {WRITE_POLICIES}")
        if device_pages < 1 or host_pages < 0:
            raise ValueError(
                f"need device_pages >= 1, host_pages >= 0: {device_pages}, {host_pages}"
            )
        super().__init__(geo, device_pages, policy, timed, ("host",), host_policy)
        self.host_pages, self.write_policy = host_pages, write_policy
        self.tree.on_release = self._release
        if write_policy == "write_back":
            self.tree.on_demote = self._copy_down
        self._handles = itertools.count()  # host pages
        self.device_hit_tokens = self.host_hit_tokens = 0
        self.copied_pages = self.released_pages = 0

    def host_used(self) -> int:
        """KV pages with a host copy."""
        return self.tree.tier_pages(HOST) * self.geo.kv_per_page

    def result(self) -> TierResult:
        return TierResult(
            self.policy,
            self.write_policy,
            self.capacity,
            self.host_pages,
            self.prompt_tokens,
            self.device_hit_tokens,
            self.host_hit_tokens,
            self.evicted_pages,
            self.copied_pages,
            self.released_pages,
            self.overflow_pages,
        )

    def _hold(self, match: MatchResult) -> TreeNode:
        return match.tail[-1] if match.tail else match.node

    def _inserted(self, node: TreeNode) -> None:
        if self.write_policy == "write_through":
            self._write_through(node)

    def _score(self, match: MatchResult, num_pages: int) -> None:
        # the tail tokens loaded back: those the key cached at arrival still holds
        cached_ids = num_pages * self.geo.ids_per_page
        loaded = min(match.tail_tokens, cached_ids - match.num_tokens)
        self.device_hit_tokens += match.num_tokens * self.geo.id_tokens
        self.host_hit_tokens += loaded * self.geo.id_tokens

    def _copy_down(self, node: TreeNode) -> bool:
        """Give ``node`` a host copy, evicting host pages first if the host is full;
        False when there is no room for it (more pages than C2, or the rest is locked)."""
        tree, k = self.tree, self.geo.kv_per_page
        n = node.npages
        if n * k > self.host_pages:
            return False
        short = n * k - (self.host_pages - self.host_used())
        if short > 0:
            tree.evict_tier(HOST, -(-short // k))
            if self.host_used() + n * k > self.host_pages:  # the rest is locked
                return False
        tree.set_copy(node, HOST, [next(self._handles) for _ in range(n)])
        self.copied_pages += n * k
        return True

    def _write_through(self, node: TreeNode) -> None:
        """Copy the path root -> ``node`` (all on the device) down where it has no host
        copy, parents first, the path locked so that making room keeps its copies."""
        path = []
        step = node
        while step is not self.tree.root:
            path.append(step)
            step = step.parent
        self.tree.inc_lock(node)
        for step in reversed(path):
            if step.copy_in(HOST) is None:
                self._copy_down(step)
        self.tree.dec_lock(node)

    def _release(self, tier: int, handles: list) -> None:
        self.released_pages += len(handles) * self.geo.kv_per_page


def replay_tiered(
    trace: Sequence[TraceRequest],
    page_size: int,
    device_pages: int,
    host_pages: int,
    policy: str = "lru",
    write_policy: str = "write_back",
    service: ServiceModel | None = None,
    warmup_s: float = 0.0,
    host_policy: str | None = None,
) -> TierResult:
    """Replay ``trace`` on a ``TieredCache`` of C1 = ``device_pages``, C2 = ``host_pages``
    KV pages of ``page_size`` tokens: instant, or timed with ``service``; requests
    arriving before ``warmup_s`` are not scored. ``host_policy``: the host tier's eviction
    policy (default: ``policy``, as the server's one policy for every tier)."""
    geo = Geometry.of(trace, page_size)
    timed = service is not None
    cache = TieredCache(geo, device_pages, host_pages, policy, write_policy, timed, host_policy)
    cache.run(trace, service, warmup_s)
    return cache.result()


# ----------------------------------------------------------------------------- report
def format_tier_table(trace: str, rows: list[dict], policy: str) -> str:
    """Markdown: per device and host size (fractions of the working set), the hit rate
    from each tier, their total, and Belady at the device size and at device + host."""
    mine = [r for r in rows if r["trace"] == trace and r["policy"] == policy]
    mine.sort(key=lambda r: (r["device_fraction"], r["host_fraction"]))
    write = mine[0]["write_policy"] if mine else ""
    lines = [
        f"| {trace} ({policy}, {write}): device | host | device hits | host hits | total "
        "| Belady (device) | Belady (device + host) |",
        "|" + "---|" * 7,
    ]
    for r in mine:
        lines.append(
            f"| {r['device_fraction']:.1%} | {r['host_fraction']:.0%} | {r['device_hit_rate']:.1%} "
            f"| {r['host_hit_rate']:.1%} | {r['hit_rate']:.1%} | {r['belady_device_hit_rate']:.1%} "
            f"| {r['belady_total_hit_rate']:.1%} |"
        )
    return "\n".join(lines)


def format_tier_policies(trace: str, rows: list[dict], policies: Sequence[str]) -> str:
    """Markdown: per device and host size, every policy's total hit rate with the share of
    the LRU -> Belady (device + host) gap it closes."""
    by = {(r["device_fraction"], r["host_fraction"], r["policy"]): r for r in rows if r["trace"] == trace}
    sizes = sorted({(d, h) for d, h, _ in by})
    lines = [
        f"| {trace}: device | host | " + " | ".join(policies) + " | Belady (device + host) |",
        "|" + "---|" * (len(policies) + 3),
    ]
    for d, h in sizes:
        lru, best = by[d, h, "lru"]["hit_rate"], by[d, h, policies[0]]["belady_total_hit_rate"]
        cells = []
        for p in policies:
            rate = by[d, h, p]["hit_rate"]
            gap = best - lru
            closed = "" if p == "lru" or gap < 1e-9 else f" ({(rate - lru) / gap:+.0%})"
            cells.append(f"{rate:.1%}{closed}")
        lines.append(f"| {100 * d:g}% | {100 * h:g}% | " + " | ".join(cells) + f" | {best:.1%} |")
    return "\n".join(lines)


def plot_tiers(rows: list[dict], traces: dict[str, dict], path: Path) -> None:
    """Total hit rate vs device size (log axis), one line per host size with Belady at
    device + host dashed in its colour, the infinite cache dotted; one panel per trace and
    policy. ``traces``: each trace's JSON line (``max_hit_rate``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    panels = list(dict.fromkeys((r["trace"], r["policy"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (trace, policy) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if r["trace"] == trace and r["policy"] == policy]
        hosts = sorted({r["host_fraction"] for r in mine})
        for color, host in zip(
            plt.cm.viridis([i / max(len(hosts), 1) for i in range(len(hosts))]), hosts, strict=True
        ):
            pts = sorted(
                (100 * r["device_fraction"], 100 * r["hit_rate"], 100 * r["belady_total_hit_rate"])
                for r in mine
                if r["host_fraction"] == host
            )
            xs = [x for x, _, _ in pts]
            ax.plot(
                xs,
                [y for _, y, _ in pts],
                color=color,
                marker="o",
                ms=3,
                label=f"host {100 * host:g}%",
            )
            ax.plot(xs, [b for _, _, b in pts], color=color, linestyle="--", lw=1)
        ax.axhline(100 * traces[trace]["max_hit_rate"], color="black", linestyle=":")
        ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set(
            title=f"{trace} ({policy}, {mine[0]['write_policy']})",
            xlabel="device size (% of working set)",
            ylabel="token hit rate, device + host (%)",
        )
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        handles += [
            Line2D([], [], color="gray", linestyle="--", lw=1, label="Belady (device + host)"),
            Line2D([], [], color="black", linestyle=":", label="infinite cache"),
        ]
        ax.legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
