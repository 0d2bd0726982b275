"""Belady's MIN for the prefix-cache simulators: the offline optimum of a trace's hit rate.

MIN (Belady 1966, "A study of replacement algorithms for a virtual-storage computer") at
KV-page granularity on the same requests and events as the online replay
(``cache_model``): a page is identified by its whole prefix; whenever the pool is over
budget it evicts, among the pages no running request locks, the one whose next *counted*
use -- the next arrival whose matched part, ``prompt[:-1]``, contains it -- is farthest
in the future, deeper pages first on ties. A page that some event makes resident again
before its next counted use counts as never used: that event reloads it for free, so
keeping it until then gains nothing.

Locks (the timed model). A running request's cached prompt pages stay resident until it
finishes and its private pages take room; which pages it caches when the pool is short
(``lock_schedule``) depends only on the trace, the pool size and the locks of the other
running requests, never on what the policy evicted, so every policy and MIN see the same
locked sets and the same budget over time. A locked page is never a candidate; MIN picks
among the others. The exchange argument is unchanged (a schedule that evicts q where MIN
evicts p, both unlocked, can evict p instead without losing a hit, since p is not needed
before q), so MIN is the exact optimum of this model:

* unit pages (each radix-tree page of a block trace is ``kv_per_page`` KV pages, which
  MIN may keep in part: the first ones of a block, as a tree of 16-token pages could);
* each event makes a fixed set of pages resident: an arrival its first ``resident`` pages
  (locked until it finishes), a finish the pages of its output;
* a hit counts the cached leading pages of ``prompt[:-1]``.

``tests/runtime/bench/test_cache_sim.py`` checks MIN against exhaustive search over every
eviction choice on small traces, with and without overlapping requests. The free reloads
can leave MIN's cache holding a page without its parent, which no radix tree can do.

Upper bound for every radix-tree policy: evicting whole leaves is one of the schedules MIN
competes with. The best whole-leaf schedule (variable-size caching, NP-hard in general)
may stay below MIN. Not the optimum of the real server, which would also choose *when* to
run requests (the model fixes the arrival times and durations).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from radixlm.runtime.bench.cache_model import (
    Geometry,
    ServiceModel,
    event_order,
    request_pages,
)
from radixlm.runtime.bench.cache_traces import TraceRequest

__all__ = ["BELADY", "MinResult", "PageTrace", "Schedule", "lock_schedule", "belady"]

BELADY = "belady"  # the offline optimum's name in results


@dataclass(frozen=True)
class MinResult:
    """Totals of one MIN run (the fields of ``cache_sim.SimResult`` that MIN has)."""

    policy: str
    capacity_pages: int
    prompt_tokens: int
    cached_tokens: int
    evicted_pages: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


@dataclass
class PageTrace:
    """The trace as paths of radix-tree page ids, an id standing for a whole prefix.

    ``paths[j]``: ids of request j's inserted pages (root first); ``pages[j]``: its
    ``RequestPages`` (counted, arrival, inserted, private); ``uses[p]``: event indices of
    the scored arrivals whose counted part contains page p, ascending; ``depth[p]``: p's
    index in its path. ``events``: ``cache_model.event_order`` without the times.
    ``scored[j]``: request j counts towards the hit rate (it arrived at or after the
    warm-up). Sizes: ``num_pages`` tree pages of ``geo.kv_per_page`` KV pages each;
    ``working_set_pages`` in KV pages.
    """

    geo: Geometry
    events: list[int] = field(default_factory=list)
    paths: list[list[int]] = field(default_factory=list)
    pages: list = field(default_factory=list)  # RequestPages per request
    scored: list[bool] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    uses: list[list[int]] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return len(self.depth)

    @property
    def working_set_pages(self) -> int:
        """Distinct KV pages of all inserted keys: a pool of that many never evicts."""
        return self.num_pages * self.geo.kv_per_page

    @classmethod
    def build(
        cls,
        trace: Sequence[TraceRequest],
        page_size: int,
        service: ServiceModel | None = None,
        warmup_s: float = 0.0,
    ) -> PageTrace:
        """Paths of ``trace`` in KV pages of ``page_size`` tokens; ``service``: the timed
        model (None: instant); requests arriving before ``warmup_s`` are not scored."""
        pt, ids = cls(Geometry.of(trace, page_size)), {}
        per = pt.geo.ids_per_page
        pt.events = [e for _, e in event_order(trace, service)]
        arrival_event = {e: i for i, e in enumerate(pt.events) if e >= 0}
        for j, req in enumerate(trace):
            seq, parent, path = req.prompt + req.output, -1, []
            rp = request_pages(req, pt.geo, service is not None)
            for k in range(rp.inserted):
                key = (parent, seq[k * per : (k + 1) * per])
                parent = ids.get(key, -1)
                if parent < 0:
                    parent = ids[key] = len(ids)
                    pt.uses.append([])
                    pt.depth.append(k)
                path.append(parent)
            scored = req.arrival_s >= warmup_s
            if scored:
                for page in path[: rp.counted]:
                    pt.uses[page].append(arrival_event[j])
            pt.paths.append(path)
            pt.pages.append(rp)
            pt.scored.append(scored)
            pt.prompt_tokens.append(req.input_tokens if scored else 0)
        return pt


@dataclass(frozen=True)
class Schedule:
    """Per request, what it makes resident (tree pages) and holds (KV pages) in a pool of
    ``device_pages`` KV pages: ``resident`` pages cached and locked at arrival,
    ``granted`` private KV pages, ``final`` pages cached once it finishes."""

    device_pages: int
    resident: list[int]
    granted: list[int]
    final: list[int]


def lock_schedule(pt: PageTrace, device_pages: int) -> Schedule:
    """Which pages each request caches in a pool of ``device_pages`` KV pages, as the
    online replay finds them (``cache_sim``): at arrival, with L the tree pages locked
    by running requests, P their private KV pages, o the leading pages of the request's
    counted part in L, k = KV pages per tree page, and F = device_pages - P - k |L|:

        resident = min(arrival pages, device_pages // k, o + F // k)
        granted  = min(private pages, F - k (resident - o))

    (all of F is free once every unlocked page is evicted); when it finishes it adds its
    output pages, ``final = resident + min(inserted - arrival, granted // k)`` if its
    whole prompt was cached, else ``resident``."""
    k, n = pt.geo.kv_per_page, len(pt.paths)
    resident, granted, final = [0] * n, [0] * n, [0] * n
    locks = [0] * pt.num_pages
    locked = private = 0
    for e in pt.events:
        j = e if e >= 0 else ~e
        path, rp = pt.paths[j], pt.pages[j]
        if e >= 0:
            o = 0
            while o < rp.counted and locks[path[o]]:
                o += 1
            free = device_pages - private - locked * k
            resident[j] = min(rp.arrival, device_pages // k, o + free // k)
            granted[j] = min(rp.private, free - (resident[j] - o) * k)
            private += granted[j]
            for page in path[: resident[j]]:
                locked += not locks[page]
                locks[page] += 1
        else:
            whole = resident[j] == rp.arrival
            final[j] = resident[j] + (
                min(rp.inserted - rp.arrival, granted[j] // k) if whole else 0
            )
            private -= granted[j]
            for page in path[: resident[j]]:
                locks[page] -= 1
                locked -= not locks[page]
    return Schedule(device_pages, resident, granted, final)


class _MinCache:
    """KV-page cache evicting the unlocked page with the farthest next counted use.

    Per tree page p, ``kept[p]`` of its k KV pages are cached (its first ones: a page is
    evicted from its end). Max-heap entries ``(-next_use, -depth, p)`` with lazy
    invalidation: an entry is current while p is cached and its next use is unchanged;
    a locked page's entry is dropped when popped and pushed again when it is unlocked.
    Budget: ``capacity`` minus the private pages of running requests.
    """

    def __init__(self, pt: PageTrace, capacity: int, schedule: Schedule) -> None:
        self.pt, self.capacity, self.k = pt, capacity, pt.geo.kv_per_page
        self.never = len(pt.events)  # next use of a page nobody reads again
        self.kept = [0] * pt.num_pages
        self.locks = [0] * pt.num_pages
        self.next_use = [self.never] * pt.num_pages
        self.cursor = [0] * pt.num_pages  # index into uses[p] of the next use
        # admits[p]: events that make p resident, ascending
        self.admits: list[list[int]] = [[] for _ in range(pt.num_pages)]
        self.admit_cursor = [0] * pt.num_pages
        self.admitted: list[Sequence[int]] = [()] * len(pt.events)
        for i, e in enumerate(pt.events):
            j = e if e >= 0 else ~e
            lo, hi = (
                (0, schedule.resident[j]) if e >= 0 else (schedule.resident[j], schedule.final[j])
            )
            self.admitted[i] = pt.paths[j][lo:hi]
            for page in self.admitted[i]:
                self.admits[page].append(i)
        self.size = self.private = self.evicted = 0
        self.heap: list[tuple[int, int, int]] = []

    def hits(self, j: int) -> int:
        """Cached leading KV pages of request j's counted part."""
        n = 0
        for page in self.pt.paths[j][: self.pt.pages[j].counted]:
            n += self.kept[page]
            if self.kept[page] < self.k:
                break
        return n

    def admit(self, i: int) -> None:
        """Make event i's pages resident (at an arrival: locked)."""
        lock = self.pt.events[i] >= 0
        for page in self.admitted[i]:
            self._advance(page, i)
            self.size += self.k - self.kept[page]
            self.kept[page] = self.k
            self.locks[page] += lock
            self._push(page)

    def unlock(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.locks[page] -= 1
            if not self.locks[page] and self.kept[page]:
                self._push(page)

    def _push(self, page: int) -> None:
        heapq.heappush(self.heap, (-self.next_use[page], -self.pt.depth[page], page))

    def _advance(self, page: int, i: int) -> None:
        """Eviction key of ``page`` after event i: its next counted use, or ``never``
        when an event that does not count it makes it resident first (keeping it until
        then gains nothing: that event reloads it for free)."""
        use = self._next(self.pt.uses[page], self.cursor, page, i)
        admit = self._next(self.admits[page], self.admit_cursor, page, i)
        self.next_use[page] = use if use <= admit else self.never

    def _next(self, events: list[int], cursor: list[int], page: int, i: int) -> int:
        c = cursor[page]
        while c < len(events) and events[c] <= i:
            c += 1
        cursor[page] = c
        return events[c] if c < len(events) else self.never

    def evict(self) -> None:
        """Evict KV pages, farthest next use first, down to the budget."""
        while self.size > self.capacity - self.private and self.heap:
            entry = self.heap[0]
            page = entry[2]
            if not self.kept[page] or self.next_use[page] != -entry[0] or self.locks[page]:
                heapq.heappop(self.heap)  # stale, or locked (pushed again on unlock)
                continue
            cut = min(self.kept[page], self.size - (self.capacity - self.private))
            self.kept[page] -= cut
            self.size -= cut
            self.evicted += cut
            if not self.kept[page]:
                heapq.heappop(self.heap)


def belady(pt: PageTrace, capacity_pages: int, device_pages: int | None = None) -> MinResult:
    """Belady's MIN on ``pt`` with a pool of ``capacity_pages`` KV pages (module docstring).

    ``device_pages`` (default and at most ``capacity_pages``): the pool in which running
    requests lock their pages and hold their private ones (``lock_schedule``), as the
    device tier of a two-tier cache whose device holds fewer pages than both tiers
    together (``cache_sim_tiers``); MIN then bounds the device + host hit rate."""
    device = capacity_pages if device_pages is None else min(device_pages, capacity_pages)
    schedule = lock_schedule(pt, device)
    cache = _MinCache(pt, capacity_pages, schedule)
    cached = 0
    for i, e in enumerate(pt.events):
        j = e if e >= 0 else ~e
        if e >= 0:
            if pt.scored[j]:
                cached += cache.hits(j) * pt.geo.page_size
            cache.private += schedule.granted[j]
            cache.admit(i)
        else:
            cache.admit(i)
            cache.private -= schedule.granted[j]
            cache.unlock(pt.paths[j][: schedule.resident[j]])
        cache.evict()
    return MinResult(BELADY, capacity_pages, sum(pt.prompt_tokens), cached, cache.evicted)
