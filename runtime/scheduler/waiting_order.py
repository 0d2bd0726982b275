"""Admission order of the waiting queue: first come first served, or radix-aware.

Policies (SGLang's names, ``--schedule-policy``):

* ``fcfs``: arrival order.
* ``lof``: longest output first: the largest ``max_new_tokens`` first, ties by arrival
  (SGLang's ``lof``). Meant for throughput runs: the requests that need the most
  sequential decode steps start first (longest processing time first, the classic
  makespan heuristic). On the 1000-prompt ShareGPT run it did not shorten the tail
  (BENCHMARKS.md "Pacing admission"). Ignores the radix tree.
* ``lpm``: longest prefix match first (most tokens already cached), ties by arrival.
* ``dfs-weight``: depth-first over the radix tree; at each node the branch holding the
  most requests (its weight) goes first, deeper matches before the requests hanging at
  the node itself, so requests sharing a prefix run back to back while it is cached
  (SGLang's DFS weight; Zheng et al., "SGLang: Efficient Execution of Structured
  Language Model Programs", 2024, section 3, cache-aware scheduling). Unlike SGLang the
  weight also counts running requests (at the node their cached prefix ends) and ties
  go to the cached branch: counting only waiting requests makes the order round-robin
  over groups (admitting one lowers its group's weight below the next group's), which
  evicts every shared prefix before its reuse under a small pool (0-4% hit rate on a
  small run of bench/scheduler/bench_schedule.py, 4a7db11:BENCHMARKS.md; the
  current comparison: BENCHMARKS.md "Schedule policies").

Starvation guard (every policy): the oldest waiting request goes first once it has
waited ``max_wait_s`` seconds or ``max_passes`` other requests were admitted while it
was the oldest. Admission stops at the first request that must wait for memory, so a
promoted request is passed by nobody.

In-batch prefix sharing (lpm, dfs-weight): a request whose next page is not cached is
deferred while another request that hangs at the same place (same node, same next
page) is in its prefill, admitted in this plan or earlier: both would compute that
page; deferred, it finds the page cached once the other's prompt is inserted (SGLang's
in-batch prefix caching check, keyed on the tree position instead of a scratch tree).

Cost at any queue length (no re-matching of the queue per plan): each waiting request
is kept where it hangs in the tree (``RadixTree.peek_prefix``: deepest fully matched
node, next page, match length), in a bucket per (node, next page). The tree's listener
reports the buckets whose prefixes may have changed length (a child added, split or
removed at that node and page; a hang node evicted) and only their requests are matched
again, resuming at their node. ``lpm`` keeps a lazily invalidated heap on
(-match length, arrival): O(log n) per admitted or re-matched request. ``dfs-weight``
sums the bucket sizes up the tree at each plan: O(nodes holding waiting requests x
depth), then sorts the branches of the nodes it visits. bench/scheduler/bench_schedule.py
measures plan() time against queue length.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter

from radixlm.radix import RadixTree
from radixlm.radix.tree import Key, TreeNode
from radixlm.runtime.scheduler.request import Req

__all__ = ["SCHEDULE_POLICIES", "WaitingOrder"]

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof")
_CACHE_AGNOSTIC = ("fcfs", "lof")  # policies that do not read the radix tree
_by_arrival = attrgetter("arrival")
Bucket = tuple[TreeNode, Key]


@dataclass(slots=True)
class _Hang:
    """Where a waiting request's tokens hang in the tree (``RadixTree.peek_prefix``)."""

    node: TreeNode
    next_page: Key | None
    num_tokens: int  # cached tokens it would reuse now
    seq: int  # id of its newest lpm heap entry

    @property
    def uncached_bucket(self) -> Bucket | None:
        """(node, next page) when the next page is cached nowhere, else None."""
        if self.next_page is None or self.next_page in self.node.children:
            return None
        return (self.node, self.next_page)


class WaitingOrder:
    """Orders the planner's waiting requests for admission (see the module docstring).

    The planner keeps its arrival-sorted ``waiting`` list and tells this object about
    every request added, admitted or removed; ``candidates`` yields the admission order.
    Without a tree (radix cache off) the cache-aware policies are ``fcfs``.
    """

    def __init__(
        self,
        policy: str,
        tree: RadixTree | None,
        match_limit: Callable[[Req], int],
        max_wait_s: float = float("inf"),
        max_passes: int = 1 << 62,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; choose from {SCHEDULE_POLICIES}")
        self.policy = policy if tree is not None or policy in _CACHE_AGNOSTIC else "fcfs"
        self.tree = tree
        self.match_limit = match_limit
        self.max_wait_s, self.max_passes, self.clock = max_wait_s, max_passes, clock
        self.num_promoted = 0  # requests the starvation guard moved to the front
        self._hang: dict[Req, _Hang] = {}
        self._buckets: dict[TreeNode, dict[Key | None, dict[Req, None]]] = {}
        self._count: dict[TreeNode, int] = {}  # waiting requests hanging at the node
        self._shared: dict[TreeNode, set[Key]] = {}  # its pages with a branch (see _is_shared)
        self._dirty: set[tuple[TreeNode, Key]] = set()
        self._removed: list[TreeNode] = []
        self._stale_all = False
        self._heap: list[tuple[int, float, int, Req]] = []  # lpm; lof: (-max_new_tokens, arrival, seq, req)
        self._lof_seq: dict[Req, int] = {}  # lof: each waiting request's live heap entry
        self._seq = itertools.count()
        self._head: Req | None = None
        self._head_passes = 0
        self._promoted: Req | None = None
        self._in_prefill: dict[Req, Bucket] = {}  # admitted, prefill maybe not finished
        self._busy: set[Bucket] = set()  # buckets being computed during this plan
        if self.cache_aware:
            tree.listener = self

    @property
    def cache_aware(self) -> bool:
        return self.policy not in _CACHE_AGNOSTIC

    # ----------------------------------------------------------------- membership
    def add(self, req: Req) -> None:
        if self.policy == "lof":
            seq = self._lof_seq[req] = next(self._seq)
            heapq.heappush(self._heap, (-req.sampling.max_new_tokens, req.arrival, seq, req))
        elif self.cache_aware:
            self._rehang(req, None)

    def remove(self, req: Req) -> None:
        """``req`` left the queue without being admitted (abort, finish, reject)."""
        self._lof_seq.pop(req, None)
        hang = self._hang.pop(req, None)
        if hang is not None:
            self._unbucket(req, hang)

    def admitted(self, req: Req) -> None:
        """``req`` was admitted (the planner takes it out of ``waiting`` next)."""
        if req is not self._head:
            self._head_passes += 1
        hang = self._hang.get(req)
        bucket = hang.uncached_bucket if hang is not None else None
        if bucket is not None:
            self._busy.add(bucket)
            self._in_prefill[req] = bucket
        self.remove(req)

    # ----------------------------------------------------------------- tree listener
    def edge_changed(self, parent: TreeNode, first_page: Key) -> None:
        buckets = self._buckets.get(parent)
        if buckets is not None and first_page in buckets:
            self._dirty.add((parent, first_page))

    def node_removed(self, node: TreeNode) -> None:
        if node in self._buckets:
            self._removed.append(node)

    def reset(self) -> None:
        self._stale_all = True

    # ----------------------------------------------------------------- admission order
    def candidates(self, waiting: list[Req], running: list[Req]) -> Iterator[Req]:
        """Waiting requests in admission order: a starving oldest request first, then the
        policy's order. ``waiting`` is the planner's arrival-sorted list; the caller may
        admit (remove) the request just yielded and may stop at any point."""
        self._start_plan(running)
        self._promoted = self._starving(waiting)
        if self._promoted is not None:
            self.num_promoted += 1
            yield self._promoted
        if self.policy == "fcfs":
            order = self._fcfs(waiting)
        elif self.policy == "lpm":
            order = self._heap_order(self._live_lpm)
        elif self.policy == "lof":
            order = self._heap_order(self._live_lof)
        else:
            order = self._dfs(running)
        with_guard = self._promoted
        for req in order:
            if req is not with_guard:
                yield req

    def should_defer(self, req: Req) -> bool:
        """True if ``req`` would compute an uncached page that another request admitted
        in this plan or still in its prefill computes too (module docstring)."""
        if not self.cache_aware or req is self._promoted:
            return False
        hang = self._hang.get(req)
        return hang is not None and hang.uncached_bucket in self._busy

    def _start_plan(self, running: list[Req]) -> None:
        if self._in_prefill:
            live = {id(r) for r in running if r.in_prefill}
            self._in_prefill = {r: b for r, b in self._in_prefill.items() if id(r) in live}
        self._busy = set(self._in_prefill.values())
        if self.cache_aware:
            self._refresh()

    def _starving(self, waiting: list[Req]) -> Req | None:
        if not waiting:
            return None
        head = waiting[0]
        if head is not self._head:
            self._head, self._head_passes = head, 0
        waited = self.clock() - head.arrival
        return head if self._head_passes >= self.max_passes or waited >= self.max_wait_s else None

    @staticmethod
    def _fcfs(waiting: list[Req]) -> Iterator[Req]:
        i = 0
        while i < len(waiting):
            req = waiting[i]
            yield req
            if i < len(waiting) and waiting[i] is req:  # not admitted: move on
                i += 1

    def _live_lpm(self, entry: tuple[int, float, int, Req]) -> bool:
        hang = self._hang.get(entry[3])
        return hang is not None and hang.seq == entry[2]

    def _live_lof(self, entry: tuple[int, float, int, Req]) -> bool:
        return self._lof_seq.get(entry[3]) == entry[2]

    def _heap_order(self, live: Callable[[tuple[int, float, int, Req]], bool]) -> Iterator[Req]:
        """The requests of the lazily invalidated heap (lpm, lof) in order: entries that
        are not ``live`` (superseded or gone) are dropped, the ones not admitted put back."""
        popped: list[tuple[int, float, int, Req]] = []
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                if not live(entry):
                    continue
                popped.append(entry)
                yield entry[3]
        finally:
            for entry in popped:
                if live(entry):
                    heapq.heappush(self._heap, entry)

    def _dfs(self, running: list[Req]) -> Iterator[Req]:
        weight: dict[TreeNode, int] = {}
        kids: dict[TreeNode, list[TreeNode]] = {}
        counts = list(self._count.items())
        counts += [(r.tree_node, 1) for r in running if r.tree_node is not None]
        for node, n in counts:
            step = node
            while True:  # add n on the path to the root
                before = weight.get(step)
                weight[step] = n + (before or 0)
                parent = step.parent
                if parent is None:
                    break
                if before is None:
                    kids.setdefault(parent, []).append(step)
                step = parent
        if self.tree is not None:
            yield from self._dfs_from(self.tree.root, weight, kids)

    def _dfs_from(self, node: TreeNode, weight: dict, kids: dict) -> Iterator[Req]:
        """Branches by weight, heaviest first. Lone requests (a bucket of one whose next
        page is cached nowhere: the common case in a long queue of unrelated prompts)
        are not sorted: they come last, in bucket order, so only the branches that share
        something are sorted (``_shared`` tracks them as requests come and go)."""
        buckets = self._buckets.get(node, {})
        children = node.children
        groups: dict[object, list] = {}  # branch -> [weight, child with requests, bucket page]
        for page in self._shared.get(node, ()):
            child = children.get(page)
            groups[page if child is None else child] = [len(buckets[page]), None, page]
        for child in kids.get(node, ()):
            group = groups.setdefault(child, [0, None, None])
            group[0] += weight[child]
            group[1] = child
        for _, child, page in sorted(groups.values(), key=lambda g: (-g[0], g[1] is None)):
            if child is not None:
                yield from self._dfs_from(child, weight, kids)
            if page is not None:
                yield from self._emit(buckets.get(page))
        shared = self._shared.get(node, set())
        for page, bucket in list(buckets.items()):  # the lone ones (a snapshot: admission edits)
            if page is not None and page not in shared:
                yield from self._emit(bucket)
        yield from self._emit(buckets.get(None))

    def _emit(self, bucket: dict[Req, None] | None) -> Iterator[Req]:
        for req in sorted(bucket or (), key=_by_arrival):  # a copy: admission edits it
            if req in self._hang:
                yield req

    # ----------------------------------------------------------------- index upkeep
    def _refresh(self) -> None:
        """Match again the requests whose prefixes may have changed length."""
        if self._stale_all:
            self._stale_all, self._dirty, self._removed = False, set(), []
            for req in list(self._hang):
                self._rehang(req, None)
            return
        removed, self._removed = self._removed, []
        for node in removed:
            for bucket in list(self._buckets.get(node, {}).values()):
                for req in list(bucket):
                    self._rehang(req, None)
        dirty, self._dirty = self._dirty, set()
        for node, page in dirty:
            bucket = self._buckets.get(node, {}).get(page)
            start = node if self.tree.is_attached(node) else None
            for req in list(bucket or ()):
                self._rehang(req, start)
        if len(self._heap) > 2 * len(self._hang) + 64:  # mostly stale entries: compact
            self._heap = [(-h.num_tokens, r.arrival, h.seq, r) for r, h in self._hang.items()]
            heapq.heapify(self._heap)

    def _rehang(self, req: Req, start: TreeNode | None) -> None:
        old = self._hang.pop(req, None)
        if old is not None:
            self._unbucket(req, old)
        peek = self.tree.peek_prefix(req.token_array(self.match_limit(req)), start)
        hang = _Hang(peek.node, peek.next_page, peek.num_tokens, next(self._seq))
        self._hang[req] = hang
        bucket = self._buckets.setdefault(hang.node, {}).setdefault(hang.next_page, {})
        bucket[req] = None
        self._count[hang.node] = self._count.get(hang.node, 0) + 1
        self._classify(hang.node, hang.next_page, bucket)
        if self.policy == "lpm":
            heapq.heappush(self._heap, (-hang.num_tokens, req.arrival, hang.seq, req))

    def _unbucket(self, req: Req, hang: _Hang) -> None:
        node = hang.node
        buckets = self._buckets[node]
        bucket = buckets[hang.next_page]
        del bucket[req]
        self._classify(node, hang.next_page, bucket)
        self._count[node] -= 1
        if not bucket:
            del buckets[hang.next_page]
            if not buckets:
                del self._buckets[node], self._count[node]

    @staticmethod
    def _is_shared(node: TreeNode, page: Key | None, bucket: dict) -> bool:
        """A bucket is a branch of its own in dfs-weight when more than one request
        hangs there or its next page is cached (a child to descend into)."""
        return page is not None and bool(bucket) and (len(bucket) > 1 or page in node.children)

    def _classify(self, node: TreeNode, page: Key | None, bucket: dict) -> None:
        if self._is_shared(node, page, bucket):
            self._shared.setdefault(node, set()).add(page)
        elif page is not None and node in self._shared:
            pages = self._shared[node]
            pages.discard(page)
            if not pages:
                del self._shared[node]

    # ----------------------------------------------------------------- checks
    def check_invariants(self, waiting: list[Req]) -> None:
        """Every waiting request is indexed exactly once, at its current peek. Raises
        AssertionError (O(n) peeks: tests only)."""
        if self.policy == "lof":
            assert set(self._lof_seq) == set(waiting), "lof index and waiting queue differ"
            live = [e for e in self._heap if self._lof_seq.get(e[3]) == e[2]]
            assert len(live) == len(waiting), "a waiting request without one live heap entry"
            return
        if not self.cache_aware:
            return
        self._refresh()
        assert set(self._hang) == set(waiting), "index and waiting queue differ"
        for req, hang in self._hang.items():
            peek = self.tree.peek_prefix(req.token_array(self.match_limit(req)))
            got = (peek.node, peek.next_page, peek.num_tokens)
            assert got == (hang.node, hang.next_page, hang.num_tokens), f"{req.rid}: stale match"
            assert req in self._buckets[hang.node][hang.next_page], f"{req.rid}: not in its bucket"
        assert sum(len(b) for bs in self._buckets.values() for b in bs.values()) == len(waiting)
        for node, buckets in self._buckets.items():
            assert self._count[node] == sum(map(len, buckets.values())), "stale count"
            shared = {page for page, b in buckets.items() if self._is_shared(node, page, b)}
            assert shared == self._shared.get(node, set()), "stale shared-branch set"
        assert set(self._count) == set(self._buckets)
        assert set(self._shared) <= set(self._buckets)
