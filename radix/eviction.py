"""Eviction policies for the radix tree, selected by name.

A policy is a plain function ``node -> sort key``: the tree evicts the candidate leaf
with the *lowest* key first. Keys must be mutually comparable (numbers or tuples of
numbers). The registry ``EVICTION_POLICIES`` feeds the CLI ``choices``; adding a policy
is one function plus one registry line. ``CandidateHeap`` is the tree's lazily
invalidated min-heap over those keys.

Contract a policy must keep (the tree's heap relies on it):

* Pure: the key depends only on the node's fields, never on global state.
* Monotone: while a node stays a candidate leaf, its key may only *grow*
  (``last_access`` and ``hit_count`` only grow). The tree keeps a lazy min-heap: an
  entry whose key went stale is noticed when it reaches the top, re-keyed and pushed
  back. A key that *shrinks* behind the tree's back is only noticed when it reaches
  the top, so that node would be evicted later than its true key says.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar


class NodeStats(Protocol):
    """The node fields a policy may read (``radix.tree.TreeNode`` provides them)."""

    last_access: float  # clock value of the last match/insert that touched the node
    hit_count: int  # number of match_prefix calls that matched into the node

    @property
    def num_pages(self) -> int: ...


class HeapNode(NodeStats, Protocol):
    heap_seq: int  # sequence number of the node's newest heap entry, set by CandidateHeap


EvictionPolicy = Callable[[NodeStats], Any]
N = TypeVar("N", bound=HeapNode)


def lru(node: NodeStats) -> float:
    """Least recently used first."""
    return node.last_access


def lfu(node: NodeStats) -> tuple[int, float]:
    """Least frequently used first; ties broken by least recently used."""
    return (node.hit_count, node.last_access)


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "lru": lru,
    "lfu": lfu,
}


def get_policy(name: str) -> EvictionPolicy:
    """Look a policy up by name; ValueError lists the valid names."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        choices = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; choose from: {choices}") from None


class CandidateHeap:
    """Min-heap of eviction candidates ordered by a policy, with lazy invalidation.

    Entries are ``(policy key, seq, node)``; ``seq`` is unique, so nodes are never
    compared. Pushing a node again supersedes its older entries (``node.heap_seq``).
    ``pop`` skips superseded entries and entries the owner no longer considers valid,
    and re-pushes an entry whose key grew since it was pushed (policies are monotone).
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._entries: list[tuple[Any, int, Any]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, node: HeapNode) -> None:
        node.heap_seq = next(self._seq)
        heapq.heappush(self._entries, (self._policy(node), node.heap_seq, node))

    def pop(self, is_valid: Callable[[N], bool]) -> N | None:
        """Remove and return the valid node with the lowest current key, or None."""
        while self._entries:
            key, seq, node = heapq.heappop(self._entries)
            if seq != node.heap_seq or not is_valid(node):
                continue
            current = self._policy(node)
            if current != key:  # touched since it was pushed: re-key and retry
                heapq.heappush(self._entries, (current, seq, node))
                continue
            return node
        return None

    def rebuild(self, nodes: Iterable[HeapNode]) -> None:
        """Replace all entries by one fresh entry per node in ``nodes``. O(len(nodes))."""
        self._entries = []
        for node in nodes:
            node.heap_seq = next(self._seq)
            self._entries.append((self._policy(node), node.heap_seq, node))
        heapq.heapify(self._entries)

    def live_ids(self) -> set[int]:
        """``id()`` of every node whose newest entry is present (for invariant checks)."""
        return {id(node) for _key, seq, node in self._entries if seq == node.heap_seq}
