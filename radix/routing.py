"""Cache-aware routing over replicas (SGLang's router, ``sgl-router`` "cache_aware"): the
policy both data parallel routers use, the in-process one (runtime/server/dp_router.py)
and the Ray Serve one (runtime/deploy/router.py).

The router keeps, per replica, a radix tree of the prompts it sent there: an approximation
of that replica's prefix cache, trimmed to its KV capacity by LRU. For a prompt:

1. if the loads (requests in flight) are imbalanced, ``max - min > balance_abs`` and
   ``max > balance_rel * min``, the prefix does not matter: ``reason`` "imbalanced" and no
   replica (the caller balances: least loaded, or power of two choices);
2. else the replica whose cache matches the longest prefix (ties: the less loaded), when
   that covers more than ``cache_threshold`` of the prompt: "prefix";
3. else "room": the replica with the fewest cached pages (ties: the less loaded), or with
   ``room_by="load"`` the least loaded one (ties: fewer cached pages).

A caller that knows the replicas' caches exactly (KV events, runtime/kv_events.py) passes
its own ``matched`` and ``cached`` numbers instead of the trees'. Keys are any hashable
replica names. Torch-free, standard library only.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from radixlm.radix.tree import RadixTree

__all__ = ["BALANCE_ABS", "BALANCE_REL", "CACHE_THRESHOLD", "CacheAwarePolicy", "RoutingChoice"]

CACHE_THRESHOLD = 0.5  # sgl-router's defaults
BALANCE_ABS = 32
BALANCE_REL = 1.0001


@dataclass(frozen=True)
class RoutingChoice:
    """Where a prompt should go: ``replica`` (None when ``reason`` is "imbalanced"), why
    ("imbalanced", "prefix", "room"), and the tokens its cache matched."""

    replica: Hashable | None
    reason: str
    matched_tokens: int = 0


class CacheAwarePolicy:
    """Per-replica prompt trees and the choice above. ``page_size``: the servers' KV page
    (tokens); ``capacity_tokens``: one replica's KV capacity (its tree is trimmed to it)."""

    def __init__(self, page_size: int, capacity_tokens: int, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs: float = BALANCE_ABS, balance_rel: float = BALANCE_REL, room_by: str = "cached") -> None:
        if room_by not in ("cached", "load"):
            raise ValueError(f"room_by must be 'cached' or 'load', got {room_by!r}")
        self.room_by = room_by
        self.page_size = page_size
        self.capacity_pages = max(1, capacity_tokens // page_size)
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.trees: dict[Hashable, RadixTree] = {}
        self._page_ids = itertools.count(1)  # the trees' page ids: placeholders, never freed

    def add(self, replica: Hashable) -> None:
        """Start tracking ``replica`` (an empty cache). No-op if tracked."""
        self.trees.setdefault(replica, RadixTree(self.page_size))

    def drop(self, replica: Hashable) -> None:
        """Forget ``replica`` and what it cached (it is gone)."""
        self.trees.pop(replica, None)

    def is_imbalanced(self, loads: Mapping[Hashable, float]) -> bool:
        if not loads:
            return False
        high, low = max(loads.values()), min(loads.values())
        return high - low > self.balance_abs and high > self.balance_rel * low

    def matched(self, ids: Sequence[int]) -> dict[Hashable, int]:
        """Per tracked replica, the tokens of ``ids`` (whole pages) its tree matches."""
        return {replica: tree.peek_prefix(ids).num_tokens for replica, tree in self.trees.items()}

    def choose(self, ids: Sequence[int], loads: Mapping[Hashable, float],
               matched: Mapping[Hashable, int] | None = None,
               cached: Mapping[Hashable, float] | None = None) -> RoutingChoice:
        """The choice for a prompt of ``ids`` among the replicas of ``loads`` (in their
        order; ties go to the first). ``matched`` (tokens per replica, default the trees')
        and ``cached`` (pages per replica, default the trees') describe the caches.
        ValueError without replicas."""
        if not loads:
            raise ValueError("no replica to route to")
        if self.is_imbalanced(loads):
            return RoutingChoice(None, "imbalanced")
        if matched is None:
            matched = self.matched(ids)
        best = max(loads, key=lambda r: (matched.get(r, 0), -loads[r]))
        if matched.get(best, 0) > self.cache_threshold * len(ids):
            return RoutingChoice(best, "prefix", matched[best])
        if cached is None:
            cached = {r: tree.cached_pages for r, tree in self.trees.items()}
        if self.room_by == "load":
            room = min(loads, key=lambda r: (loads[r], cached.get(r, 0)))
        else:
            room = min(loads, key=lambda r: (cached.get(r, 0), loads[r]))
        return RoutingChoice(room, "room", matched.get(room, 0))

    def record(self, replica: Hashable, ids: Sequence[int]) -> None:
        """``ids`` went to ``replica``: its tree holds their whole pages from now on (LRU
        pages beyond the capacity are dropped). Tracks ``replica`` if it was not."""
        tree = self.trees.get(replica)
        if tree is None:
            tree = self.trees[replica] = RadixTree(self.page_size)
        pages = len(ids) // tree.page_size
        tree.insert(ids[: pages * tree.page_size], [next(self._page_ids) for _ in range(pages)])
        over = tree.cached_pages - self.capacity_pages
        if over > 0:
            tree.evict(over)
