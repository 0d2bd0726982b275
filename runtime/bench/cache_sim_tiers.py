"""Two-tier prefix-cache replay: hit rate per tier of the hierarchical KV cache.

``radixlm bench cache-sim --tiers`` (``cache_sim.tier_sweep``) replays request traces
(``cache_traces``) against a tiered ``RadixTree(tiers=("host",))`` (radix/tree.py, "Tiers"; the server's controller is
runtime/scheduler/hicache.py) with a device tier of C1 pages and a host tier of C2 pages,
without a model, and reports for every (C1, C2) the share of prompt tokens served from
each tier, next to Belady's offline optimum and the infinite cache.

One request, done instantly at its arrival (the tree's clock), as ``cache_sim.replay``:

1. ``match_prefix(prompt[:-1])``: the leading device run is a device hit; the matched
   nodes after it (``tail``, cached only on the host) are host hits, all loaded back as
   far as the device holds them (the key is cut to C1 pages). The match (device run and
   tail) is locked until the request is done.
2. Device pages for the rest of the inserted key (whole pages of prompt + output minus
   its last token): free ones first, then ``evict`` by the policy. An evicted node with
   a host copy keeps it and stays matchable; one without is copied down under
   write-back (``on_demote``; the host makes room with ``evict_tier``, by the same
   policy), and is dropped otherwise or when the host cannot take it.
3. ``insert`` the key: tail nodes get device pages back (promotion; they keep their host
   copy), the rest is new. Write-through then copies every node of the key's path that
   has no host copy down (room made as in 2; none left: not copied).

Write policies (the server's ``--hicache-write-policy``): ``write_back`` copies a page
down only when the device evicts it, so no copy is wasted work; ``write_through`` copies
every page when it is inserted. Host handles are fresh integers; the host holds at most
C2 pages at any time.

Hit rates: device (host) hit tokens / prompt tokens; total = their sum. Bounds, from
the single-tier model of ``cache_sim`` (a schedule of pages held after each request,
which contains the request's first pages and adds only pages of the request):

* Belady at C1 bounds the device hit rate: the device alone is such a schedule.
* Belady at C1 + C2, each request's resident pages cut to C1 (``belady(...,
  resident_pages=C1)``), bounds the total: after each request the two tiers hold at most
  C1 + C2 distinct pages, among them the request's first C1. (Equal to plain Belady at
  C1 + C2 when no request has more than C1 pages.)
* The infinite cache (Belady at the working set W) bounds both; a host tier of W pages
  reaches it when no request has more than C1 pages (nothing is ever dropped).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from radixlm.radix import RadixTree
from radixlm.radix.tree import TreeNode
from radixlm.runtime.bench.cache_traces import TraceRequest, inserted_pages

__all__ = [
    "WRITE_POLICIES",
    "TierResult",
    "TieredCache",
    "replay_tiered",
    "format_tier_table",
    "plot_tiers",
]

WRITE_POLICIES = ("write_back", "write_through")  # as the server's --hicache-write-policy
HOST = 0  # the host tier's index among the tree's lower tiers


@dataclass(frozen=True)
class TierResult:
    """Totals of one two-tier replay. Tokens are prompt tokens (token ids: blocks for
    the Mooncake trace); pages are KV pages."""

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

    @property
    def device_hit_rate(self) -> float:
        return self.device_hit_tokens / max(self.prompt_tokens, 1)

    @property
    def host_hit_rate(self) -> float:
        return self.host_hit_tokens / max(self.prompt_tokens, 1)

    @property
    def hit_rate(self) -> float:
        return self.device_hit_rate + self.host_hit_rate


class TieredCache:
    """A tiered radix tree of ``device_pages`` (C1 >= 1) device pages and ``host_pages``
    (C2 >= 0) host pages serving requests one at a time (module docstring); the tree's
    clock is the current request's arrival time in seconds. ``tree`` is open to checks."""

    def __init__(
        self,
        page_size: int,
        device_pages: int,
        host_pages: int,
        policy: str = "lru",
        write_policy: str = "write_back",
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; choose from {WRITE_POLICIES}")
        if device_pages < 1 or host_pages < 0:
            raise ValueError(
                f"need device_pages >= 1, host_pages >= 0: {device_pages}, {host_pages}"
            )
        self.page_size, self.device_pages, self.host_pages = page_size, device_pages, host_pages
        self.policy, self.write_policy = policy, write_policy
        self.now = 0.0
        self.tree = RadixTree(page_size, policy, clock=lambda: self.now, tiers=("host",))
        self.tree.on_release = self._release
        if write_policy == "write_back":
            self.tree.on_demote = self._copy_down
        self._page_ids = itertools.count()  # device pages
        self._handles = itertools.count()  # host pages
        self.prompt_tokens = self.device_hit_tokens = self.host_hit_tokens = 0
        self.evicted_pages = self.copied_pages = self.released_pages = 0

    def serve(self, req: TraceRequest) -> None:
        """Match, make the key's pages resident on the device, insert (steps 1-3)."""
        tree, size = self.tree, self.page_size
        self.now = req.arrival_s
        match = tree.match_prefix(req.prompt[:-1])
        end = match.tail[-1] if match.tail else match.node
        tree.inc_lock(end)
        want = min(inserted_pages(req, size), self.device_pages)
        need = want - len(match.pages)
        short = need - (self.device_pages - tree.cached_pages)
        if short > 0:
            self.evicted_pages += len(tree.evict(short))
        fits = min(need, self.device_pages - tree.cached_pages)
        pages = match.pages + [next(self._page_ids) for _ in range(fits)]
        seq = req.prompt + req.output
        node = tree.insert(seq[: len(pages) * size], pages).node
        if self.write_policy == "write_through":
            self._write_through(node)
        tree.dec_lock(end)
        self.prompt_tokens += len(req.prompt)
        self.device_hit_tokens += match.num_tokens
        # the tail tokens loaded back: those the key, cut to C1 pages, still holds
        self.host_hit_tokens += min(match.tail_tokens, len(pages) * size - match.num_tokens)

    def result(self) -> TierResult:
        return TierResult(
            self.policy,
            self.write_policy,
            self.device_pages,
            self.host_pages,
            self.prompt_tokens,
            self.device_hit_tokens,
            self.host_hit_tokens,
            self.evicted_pages,
            self.copied_pages,
            self.released_pages,
        )

    def _copy_down(self, node: TreeNode) -> bool:
        """Give ``node`` a host copy, evicting host pages first if the host is full;
        False when there is no room for it (more pages than C2, or the rest is locked)."""
        tree, n = self.tree, node.npages
        if n > self.host_pages:
            return False
        short = n - (self.host_pages - tree.tier_pages(HOST))
        if short > 0:
            tree.evict_tier(HOST, short)
            if tree.tier_pages(HOST) + n > self.host_pages:  # the rest is locked
                return False
        tree.set_copy(node, HOST, [next(self._handles) for _ in range(n)])
        self.copied_pages += n
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
        self.released_pages += len(handles)


def replay_tiered(
    trace: Sequence[TraceRequest],
    page_size: int,
    device_pages: int,
    host_pages: int,
    policy: str = "lru",
    write_policy: str = "write_back",
) -> TierResult:
    """Replay ``trace`` on a ``TieredCache`` of C1 = ``device_pages``, C2 = ``host_pages``."""
    cache = TieredCache(page_size, device_pages, host_pages, policy, write_policy)
    for req in trace:
        cache.serve(req)
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


def plot_tiers(rows: list[dict], traces: dict[str, dict], path: Path) -> None:
    """Total hit rate vs device size (log axis), one line per host size with Belady at
    device + host dashed in its colour, the infinite cache dotted; one panel per trace and
    policy. ``traces``: each trace's JSON line (``max_hit_rate``, ``hit_unit``)."""
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
            ylabel=f"{traces[trace]['hit_unit']} hit rate, device + host (%)",
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
