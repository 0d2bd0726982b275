"""How a trace request occupies the KV pool over time, and the online replay of a trace
against a radix tree (``PoolReplay``), for the prefix-cache simulators.

Shared by the single-tier replay (``cache_sim``), Belady's MIN (``cache_min``) and the
two-tier replay (``cache_sim_tiers``), so all three see the same requests, pages and
overlaps.

Units. A trace's ids are token ids or ids of ``id_tokens``-token blocks (Mooncake: 512);
the pool holds KV pages of ``page_size`` tokens (16 by default). The radix tree's pages
(``Geometry``): for token ids, ``page_size`` ids each, one KV page; for block ids, one id
(a whole block) each, ``id_tokens // page_size`` KV pages (32 for 512-token blocks and
16-token pages). A block trace's hash chains only diverge at block boundaries, so that
tree splits and evicts exactly where a tree of 16-token pages would.

Two request models:

* **instant** (``service`` None): a request happens at its arrival instant -- match,
  then cache prompt + output (minus the last output token) -- and holds nothing after,
  so the whole pool is cache. Requests never overlap.
* **timed** (a ``ServiceModel``): a request runs from its arrival until
  ``arrival + ServiceModel.duration_s``. At arrival it matches its prompt, caches the
  whole pages of its prompt and locks them; while it runs it also holds *private* KV
  pages outside the tree (the partial last page or block of the prompt and its output
  tokens); when it finishes it caches the whole pages of prompt + output (minus the last
  token) from those private pages, releases the rest, and unlocks. Requests overlap, and
  the locked and private pages of running requests cannot be evicted::

      arrival              prefill done                   finish
        |-- input/prefill rate --|-- output x decode step --|
        [prompt pages: cached, locked ...................... ] unlocked
        [private: partial page + output pages ............... ] -> cached / freed

  When the unlocked part of the pool cannot take a request's pages (the pool is too small
  for the trace's concurrency), the request caches only the prompt pages that fit and
  gets only the private pages left; the rest is counted as ``overflow`` (the server would
  make it wait). Arrival times never move, so every policy sees the same overlaps.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from radixlm.radix import MatchResult, RadixTree
from radixlm.radix.tree import TreeNode
from radixlm.runtime.bench.cache_traces import TraceRequest, inserted_pages

__all__ = [
    "ServiceModel",
    "Geometry",
    "RequestPages",
    "request_pages",
    "event_order",
    "PoolReplay",
]


@dataclass(frozen=True)
class ServiceModel:
    """How long a request runs (the timed model), from its lengths in tokens only.

    ``duration_s = input_tokens / prefill_tokens_per_s + output_tokens * decode_step_s``:
    the whole prompt prefilled at a fixed rate, then one decode step per output token.
    Cached tokens are *not* skipped, so a request's duration does not depend on the
    eviction policy: every policy and the optimum see the same overlaps.
    """

    prefill_tokens_per_s: float  # tokens/s; 0: prefill takes no time
    decode_step_s: float  # seconds per output token

    def duration_s(self, req: TraceRequest) -> float:
        rate = self.prefill_tokens_per_s
        prefill = req.input_tokens / rate if rate > 0 else 0.0
        return prefill + req.output_tokens * self.decode_step_s


@dataclass(frozen=True)
class Geometry:
    """Radix-tree pages of a trace in KV pages of ``page_size`` tokens (module docstring)."""

    page_size: int  # tokens per KV page
    id_tokens: int  # tokens per trace id
    ids_per_page: int  # ids per radix-tree page (the tree's page size)
    kv_per_page: int  # KV pages per radix-tree page

    @classmethod
    def of(cls, trace: Sequence[TraceRequest], page_size: int) -> Geometry:
        """Token ids: tree pages of ``page_size`` ids; block ids: one id per tree page.
        ValueError when a block is not a whole number of pages."""
        id_tokens = trace[0].id_tokens if trace else 1
        if id_tokens == 1:
            return cls(page_size, 1, page_size, 1)
        if id_tokens % page_size:
            raise ValueError(f"{id_tokens}-token blocks are not whole {page_size}-token pages")
        return cls(page_size, id_tokens, 1, id_tokens // page_size)

    @property
    def page_tokens(self) -> int:
        """Tokens per radix-tree page."""
        return self.ids_per_page * self.id_tokens


@dataclass(frozen=True, slots=True)
class RequestPages:
    """What one request caches and holds; tree pages unless stated."""

    counted: int  # pages its match may reuse: whole pages of prompt[:-1]
    arrival: int  # pages cached (and locked) at arrival
    inserted: int  # pages cached once it finishes: whole pages of prompt + output[:-1]
    private: int  # KV pages held outside the tree while it runs


def request_pages(req: TraceRequest, geo: Geometry, timed: bool) -> RequestPages:
    """The instant model caches everything at arrival and holds nothing private; the
    timed model caches the prompt's whole pages at arrival and holds the rest of the
    request's KV (prompt + output tokens, in KV pages) privately until it finishes."""
    ids = geo.ids_per_page
    counted = (len(req.prompt) - 1) // ids
    inserted = inserted_pages(req, ids)
    if not timed:
        return RequestPages(counted, inserted, inserted, 0)
    arrival = min(len(req.prompt) // ids, inserted)
    kv_pages = -(-(req.input_tokens + req.output_tokens) // geo.page_size)
    return RequestPages(counted, arrival, inserted, max(kv_pages - arrival * geo.kv_per_page, 0))


def event_order(
    trace: Sequence[TraceRequest], service: ServiceModel | None
) -> list[tuple[float, int]]:
    """``(time s, event)`` in the order the simulators handle them: ``event = j`` is
    request j's arrival, ``~j`` its finish. Finishes due at or before an arrival come
    first (earliest first, ties by request index); the instant model finishes each
    request right after its own arrival. ``trace`` must be in arrival order."""
    order: list[tuple[float, int]] = []
    running: list[tuple[float, int]] = []  # (finish time, j), a min-heap
    last = float("-inf")
    for j, req in enumerate(trace):
        if req.arrival_s < last:
            raise ValueError(f"trace not in arrival order at request {j}")
        last = req.arrival_s
        while running and running[0][0] <= req.arrival_s:
            end, done = heapq.heappop(running)
            order.append((end, ~done))
        order.append((req.arrival_s, j))
        duration = service.duration_s(req) if service is not None else 0.0
        heapq.heappush(running, (req.arrival_s + duration, j))
    order.extend((end, ~done) for end, done in sorted(running))
    return order


class PoolReplay:
    """A ``RadixTree`` on the trace's clock in a pool of ``capacity`` KV pages, replaying a
    trace request by request (``run``). One request, as the server handles it
    (runtime/scheduler/prefix_cache.py)::

        prompt  [p0 ............................ pN-1]   output [o0 ..... oM-1]
        match   [ whole pages of p0..pN-2 ]                      (last prompt token recomputed)
        insert  [ whole pages of p0 .. pN-1 o0 .. oM-2 ]         (the last output token is
                                                                  never run through the model)

    1. Arrival: ``match_prefix(prompt[:-1])`` -> cached tokens; lock the match.
    2. Pages for the rest of the key cached at arrival (instant: the whole insert; timed:
       the prompt's whole pages) and the private pages: free pages first, then ``evict``
       unlocked nodes by the policy; what still does not fit is cut (``overflow``).
    3. ``insert`` that key and lock it (the match's lock is released).
    4. Finish (instant: right away; timed: at ``arrival + ServiceModel.duration_s``):
       ``insert`` the whole key, its new pages taken from the private ones (the insert
       also marks the path used, as the server's insert at finish does), release the
       private pages, unlock.

    ``lock_schedule`` (cache_min) computes the pages each request gets in closed form;
    the tests check that both agree. Subclasses (the two-tier cache) override the hooks
    ``_hold``, ``_inserted`` and ``_score``.
    """

    def __init__(
        self,
        geo: Geometry,
        capacity: int,
        policy: str,
        timed: bool,
        tiers: Sequence[str] = (),
        tier_policy: str | None = None,
    ) -> None:
        self.geo, self.capacity, self.policy, self.timed = geo, capacity, policy, timed
        self.now = 0.0
        self.tree = RadixTree(
            geo.ids_per_page, policy, lambda: self.now, tiers, tier_eviction_policy=tier_policy
        )
        self._page_ids = itertools.count()
        self.private = 0  # KV pages held by running requests outside the tree
        self.running: dict[int, tuple[TreeNode, list[int], int, RequestPages]] = {}
        self.resident: dict[int, int] = {}  # request -> tree pages cached at arrival
        self.granted: dict[int, int] = {}  # request -> private KV pages it got
        self.prompt_tokens = self.evicted_pages = self.overflow_pages = 0

    def run(
        self,
        trace: Sequence[TraceRequest],
        service: ServiceModel | None,
        warmup_s: float = 0.0,
    ) -> None:
        """Every arrival and finish of ``trace`` in ``event_order``; requests arriving
        before ``warmup_s`` are not scored."""
        for now, e in event_order(trace, service):
            self.now = now
            if e >= 0:
                self.arrive(e, trace[e], trace[e].arrival_s >= warmup_s)
            else:
                self.finish(~e, trace[~e])

    def free(self) -> int:
        """KV pages neither cached on the device nor held privately."""
        return self.capacity - self.private - self.tree.cached_pages * self.geo.kv_per_page

    def arrive(self, j: int, req: TraceRequest, scored: bool) -> None:
        tree, k = self.tree, self.geo.kv_per_page
        rp = request_pages(req, self.geo, self.timed)
        match = tree.match_prefix(req.prompt[:-1])
        hold = self._hold(match)
        tree.inc_lock(hold)
        need = min(rp.arrival, self.capacity // k) - len(match.pages)
        short = need * k + rp.private - self.free()
        if short > 0:
            self.evicted_pages += len(tree.evict(-(-short // k))) * k
        fits = min(need, self.free() // k)
        granted = min(rp.private, self.free() - fits * k)
        pages = match.pages + [next(self._page_ids) for _ in range(fits)]
        node = tree.insert(self._key(req, len(pages)), pages).node
        self._inserted(node)
        tree.inc_lock(node)
        tree.dec_lock(hold)
        self.private += granted
        self.running[j] = (node, pages, granted, rp)
        self.resident[j], self.granted[j] = len(pages), granted
        self.overflow_pages += (rp.arrival - len(pages)) * k + rp.private - granted
        if scored:
            self.prompt_tokens += req.input_tokens
            self._score(match, len(pages))

    def finish(self, j: int, req: TraceRequest) -> None:
        node, pages, granted, rp = self.running.pop(j)
        more = 0
        if len(pages) == rp.arrival:  # the whole prompt is cached: add the output's pages
            more = min(rp.inserted - rp.arrival, granted // self.geo.kv_per_page)
        pages = pages + [next(self._page_ids) for _ in range(more)]
        self._inserted(self.tree.insert(self._key(req, len(pages)), pages).node)
        self.tree.dec_lock(node)
        self.private -= granted

    def _key(self, req: TraceRequest, num_pages: int) -> tuple[int, ...]:
        return (req.prompt + req.output)[: num_pages * self.geo.ids_per_page]

    # hooks
    def _hold(self, match: MatchResult) -> TreeNode:
        """The node to lock while the request's pages are made room for."""
        return match.node

    def _inserted(self, node: TreeNode) -> None:
        """Called after each insert with the node ending the inserted key."""

    def _score(self, match: MatchResult, num_pages: int) -> None:
        """Count a scored request's hits (``num_pages``: tree pages cached at arrival)."""
        raise NotImplementedError
