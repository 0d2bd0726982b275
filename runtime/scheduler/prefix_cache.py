"""PrefixCache: the adapter between the torch-free radix tree and the page allocator.

It owns the page accounting of the scheduler. Every allocatable page is in exactly one
of three places:

    free (allocator)  |  cached in the radix tree  |  owned by one request (not in the tree)

A request's page table starts with pages owned by the tree (shared, locked through the
request's ``tree_node``) followed by its own pages:

    req.pages: [ t0 t1 t2 | o3 o4 o5 ]      num_tree_pages = 3
                 tree       own (freed or inserted into the tree when the request ends)

Inserting a request's computed full pages may find some of them already cached (another
request computed the same tokens at the same time, case C02): the request then switches
its page table to the tree's copies and frees its duplicates; it never frees a page the
tree holds. With the radix cache disabled ``tree`` is None and all pages are owned.

With a hierarchical cache (``hicache``, scheduler/hicache.py) a match may go on past the
device pages into pages cached in host memory or on disk: the host part is loaded into
new device pages at admission (they join the tree's pages of the page table), the disk
part is prefetched while the request waits (``start_prefetch`` / ``prefetch_ready``).

With the peer KV tier (``peer``, scheduler/peer.py) a request that arrives with a router hint
waits the same way while another replica's pages come (``start_prefetch`` /
``prefetch_ready``); ``insert_loaded`` puts them into the tree as if computed.

With ``--kv-events-endpoint`` an ``events`` recorder (runtime/kv_events.py) hears every device
page the tree takes (``cache`` and ``insert_loaded``: inserted, or loaded back and inserted),
drops (``alloc``'s evictions) or loses at once (``flush``); the scheduler publishes what it
recorded once per loop turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixlm.radix import RadixTree
from radixlm.runtime.kv_events import KVEventRecorder
from radixlm.runtime.memory.page_allocator import PageAllocator
from radixlm.runtime.scheduler.request import Req

__all__ = ["PrefixCache"]


class PrefixCache:
    def __init__(self, allocator: PageAllocator, tree: RadixTree | None, page_size: int,
                 hicache: Any = None) -> None:
        self.allocator = allocator
        self.tree = tree
        self.page_size = page_size
        self.hicache = hicache  # a scheduler.hicache.HiCache, or None
        self.peer: Any = None  # a scheduler.peer.PeerCache, or None (set by the scheduler)
        self.num_evicted_pages = 0
        self.events: KVEventRecorder | None = None  # set by the scheduler (--kv-events-endpoint)

    # ----------------------------------------------------------------- admission
    def match_and_lock(self, req: Req, max_tokens: int, can_load: Callable[[int], bool] | None = None) -> int:
        """Point ``req`` at the longest cached page-aligned prefix of its first
        ``max_tokens`` tokens and lock it. Pages cached only in a lower tier are loaded
        (where the cost model finds it worth it) only if ``can_load(device pages
        matched)`` is true or absent: the admission check, made with the path locked,
        so that a request that must wait moves no pages. Returns the number of reused
        tokens."""
        assert not req.pages and req.tree_node is None, "request already holds KV"
        if self.tree is None or max_tokens < self.page_size:
            return 0
        match = self.tree.match_prefix(req.token_array(max_tokens))
        node, pages, source = match.node, list(match.pages), None
        if match.tail:  # cached below the device: load what is worth loading
            self.tree.inc_lock(match.tail[-1])  # nothing on the path goes while pages are allocated
            if can_load is None or can_load(len(pages)):
                loaded, more, source = self.hicache.load_tail(match.tail, match.num_tokens, self.alloc)
                if loaded is not None:
                    node = loaded
                    pages.extend(more)
            self.tree.inc_lock(node)
            self.tree.dec_lock(match.tail[-1])
        elif pages:
            self.tree.inc_lock(node)
        if self.hicache is not None:
            self.hicache.on_match(match.node)
        if not req.admitted and (self.hicache is not None or self.peer is not None):
            self._split_tiers(req, match.num_tokens, source)
        if not pages:
            return 0
        req.tree_node = node
        req.pages = pages
        req.num_tree_pages = len(pages)
        req.num_computed = len(pages) * self.page_size
        return req.num_computed

    def _split_tiers(self, req: Req, device_tokens: int, source: dict[str, int] | None) -> None:
        """``req.cached_tiers`` of this match (the one that first admits it counts,
        ``count_hits``): the device run split into the tokens a peer fetch inserted for
        it (``req.peer_span``) and the rest, plus the tokens loaded from host and disk
        (``source``)."""
        peer = 0
        if req.peer_span is not None:
            first, end = req.peer_span
            peer = max(0, min(end, device_tokens) - first)
        tiers = {"device": device_tokens - peer}
        if self.hicache is not None:
            tiers.update(source or {"host": 0, "disk": 0})
        if self.peer is not None:
            tiers["peer"] = peer
        req.cached_tiers = tiers

    def count_hits(self, req: Req) -> None:
        """Add ``req.cached_tiers`` to the tiers' hit counters: once, at its first admission."""
        tiers = req.cached_tiers
        if tiers is None:
            return
        if self.hicache is not None:
            self.hicache.count_hits(tiers["device"], {t: tiers[t] for t in ("host", "disk")})
        if self.peer is not None:
            self.peer.stats.hit_tokens += tiers["peer"]

    # ----------------------------------------------------------------- lower tiers
    @property
    def prefetches(self) -> bool:
        """Whether arriving requests may wait for pages (hierarchical cache, peer tier)."""
        return self.hicache is not None or self.peer is not None

    def start_prefetch(self, req: Req, max_tokens: int) -> None:
        """A request starts waiting: read its disk-only cached pages into host memory, or
        ask the peer its router hint names for the pages it lacks."""
        if self.tree is None or max_tokens < self.page_size:
            return
        if self.peer is not None and self.peer.start(req, max_tokens):
            return
        if self.hicache is None or self.hicache.disk is None:
            return
        match = self.tree.match_prefix(req.token_array(max_tokens))
        if match.tail:
            self.hicache.prefetch(req.rid, match.tail, match.num_tokens)

    def prefetch_ready(self, req: Req) -> bool:
        """False while ``req`` waits for a disk prefetch or a peer fetch (not timed out)."""
        return ((self.hicache is None or self.hicache.prefetch_ready(req.rid))
                and (self.peer is None or self.peer.ready(req)))

    def cancel_prefetch(self, req: Req) -> None:
        if self.hicache is not None:
            self.hicache.cancel_prefetch(req.rid)
        if self.peer is not None:
            self.peer.cancel(req)

    def issue(self) -> None:
        """Run the tier copies planned this step (before the step's launch)."""
        if self.hicache is not None:
            self.hicache.issue()
            self.hicache.poll()

    def take_arrivals(self) -> None:
        """Insert the peer pages that arrived (``PeerCache.poll``); at the start of a step,
        before planning (``insert_loaded``)."""
        if self.peer is not None:
            self.peer.poll()

    def insert_loaded(self, tokens: Any, start: int, num_pages: int,
                      fill: Callable[[list[int], int], None]) -> tuple[Any, int]:
        """Insert pages that hold the KV of ``tokens[start:]`` (``num_pages`` whole pages,
        from another replica) as if computed: the tree's device run over ``tokens`` must
        reach ``start``; the pages it lacks past its run get device pages from ``alloc``
        (which may evict), ``fill(pages, skip)`` writes them from the loaded page ``skip``
        on, and they are inserted (a tiered tree's nodes cached below are promoted; the
        write policy copies them down as any insert). Returns (the node ending at the end
        of ``tokens``, the first token inserted), or (None, 0) when the run does not reach
        ``start`` or no pages are left; (node, len(tokens)) when it already held them.

        Call it before planning a step, not during: ``fill`` writes the pages now, and a page
        that a plan freed may still have to be read (a swap-out, run after planning). The
        hierarchical cache's copies queued so far (saves of pages the allocation evicted,
        write-back) are issued before ``fill`` writes. If ``fill`` raises, the pages go back
        to the allocator and the exception propagates."""
        size = self.page_size
        end = start + num_pages * size
        match = self.tree.match_prefix(tokens[:end])
        have = match.num_tokens
        if have < start:
            return None, 0
        if have >= end:
            return match.node, end
        self.tree.inc_lock(match.node)  # the run stays while pages are allocated
        try:
            pages = self.alloc((end - have) // size)
            if pages is None:
                return None, 0
            if self.hicache is not None:
                self.hicache.issue()  # an evicted page's save reads it before it is rewritten
            try:
                fill(pages, (have - start) // size)
            except BaseException:
                self.allocator.free(pages)
                raise
            result = self.tree.insert(tokens[:end], list(match.pages) + pages)
            if self.events is not None:
                self.events.stored(tokens[:end], result.pages)
        finally:
            self.tree.dec_lock(match.node)
        self.allocator.free([mine for mine, kept in zip(pages, result.pages[have // size :], strict=True)
                             if mine != kept])
        if self.hicache is not None:
            self.hicache.on_insert(result.node)
        return result.node, have

    # ----------------------------------------------------------------- allocation
    @property
    def available_pages(self) -> int:
        """Pages obtainable now: free + evictable from the tree."""
        evictable = self.tree.evictable_pages if self.tree is not None else 0
        return self.allocator.num_free + evictable

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages, evicting unlocked tree leaves if needed; None if impossible
        (nothing is taken then)."""
        short = n - self.allocator.num_free
        if short > 0 and self.tree is not None:
            evicted = self.tree.evict(short)
            self.num_evicted_pages += len(evicted)
            if self.events is not None:
                self.events.removed(evicted)
            self.allocator.free(evicted)
        return self.allocator.alloc(n)

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Make ``req.pages`` cover ``num_tokens`` positions. False if out of pages."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self.alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    # ----------------------------------------------------------------- caching / release
    def cache(self, req: Req) -> None:
        """Insert the request's computed full pages into the tree and re-lock the new
        end node. Duplicate pages (already cached by someone else) are swapped for the
        tree's copies and freed."""
        if self.tree is None:
            return
        # KV of an in-flight token may be computed already, its id is not known yet.
        num_pages = min(min(req.num_computed, req.num_known) // self.page_size, len(req.pages))
        if num_pages <= req.num_tree_pages:
            return
        tokens = req.token_array(num_pages * self.page_size)
        result = self.tree.insert(tokens, req.pages[:num_pages])
        if self.events is not None:
            self.events.stored(tokens, result.pages)
        dup = [mine for mine, kept in zip(req.pages, result.pages, strict=False) if mine != kept]
        req.pages[:num_pages] = result.pages
        self.tree.inc_lock(result.node)
        if req.tree_node is not None:
            self.tree.dec_lock(req.tree_node)
        req.tree_node = result.node
        req.num_tree_pages = num_pages
        self.allocator.free(dup)
        if self.hicache is not None:
            self.hicache.on_insert(result.node)

    def release(self, req: Req, keep_in_cache: bool = True) -> None:
        """Drop the request's KV: insert what is reusable (if ``keep_in_cache``), unlock,
        free its own pages. Afterwards the request holds nothing."""
        if keep_in_cache:
            self.cache(req)
        if self.tree is not None and req.tree_node is not None:
            self.tree.dec_lock(req.tree_node)
        self.allocator.free(req.pages[req.num_tree_pages :])
        req.pages, req.num_tree_pages, req.tree_node, req.num_computed = [], 0, None, 0

    def flush(self) -> bool:
        """Drop every cached prefix. False (nothing done) while any request holds a lock."""
        if self.tree is None:
            return True
        if self.tree.protected_pages > 0 or (self.hicache is not None and self.hicache.prefetches):
            return False
        self.allocator.free(self.tree.reset() if self.hicache is None else self.hicache.reset())
        if self.events is not None:
            self.events.cleared()
        return True

    # ----------------------------------------------------------------- stats / checks
    @property
    def cached_pages(self) -> int:
        return self.tree.cached_pages if self.tree is not None else 0

    @property
    def used_pages(self) -> int:
        return self.allocator.capacity - self.allocator.num_free

    def waste_tokens(self, reqs: list[Req]) -> int:
        """KV slots allocated to ``reqs`` that hold no computed token: per request its
        page table's slots minus ``num_computed`` (the partial last page plus pages
        grown ahead of the computation). Tree pages are full and computed, so shared
        pages add nothing and nothing is counted twice.

            req.pages:  [ p0 | p1 | p2 ... ]   len(req.pages) * page_size slots
            computed:   [ ############.... ]   num_computed
                                      ^^^^ waste
        """
        return sum(len(req.pages) * self.page_size - req.num_computed for req in reqs)

    def check_invariants(self, live: list[Req]) -> None:
        """free + cached + owned-by-requests == capacity; no page both free and
        referenced; tree pages referenced by requests are the tree's; no lock held
        when no request is live. Raises AssertionError."""
        self.allocator.check_invariants()
        free = self.allocator.free_pages()
        cached = self.tree.all_pages() if self.tree is not None else set()
        owned: list[int] = []
        for req in live:
            shared = req.pages[: req.num_tree_pages]
            assert set(shared) <= cached, f"{req.rid}: shared page not in tree"
            owned.extend(req.pages[req.num_tree_pages :])
            assert not free & set(req.pages), f"{req.rid}: references a free page"
        assert len(set(owned)) == len(owned), "page owned by two requests"
        assert not set(owned) & cached, "request-owned page also cached in the tree"
        total = len(free) + len(cached) + len(owned)
        assert total == self.allocator.capacity, (
            f"page leak: free {len(free)} + cached {len(cached)} + owned {len(owned)}"
            f" != {self.allocator.capacity}"
        )
        if self.tree is not None:
            self.tree.check_invariants()
            if not live and not (self.hicache is not None and self.hicache.prefetches) and not (
                    self.peer is not None and self.peer.holds_locks):
                assert self.tree.protected_pages == 0, "lock held with no live request"
        if self.hicache is not None:
            self.hicache.check_invariants()
        if self.peer is not None:
            self.peer.check_invariants()
