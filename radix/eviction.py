"""Eviction policies for the radix tree, selected by name.

A policy is a plain function ``node -> sort key``: the tree evicts the candidate leaf
(an unlocked node without children) with the *lowest* key first. Keys must be mutually
comparable (numbers or tuples of numbers). The registry ``EVICTION_POLICIES`` feeds the
CLI ``choices`` (``--radix-eviction-policy``); adding a policy is one function plus one
registry line. ``CandidateHeap`` is the tree's lazily invalidated min-heap over those keys.

Policies (``radixlm bench cache-sim`` compares them with Belady's offline optimum; the
figures are in BENCHMARKS.md):

* ``lru``: least recently used first.
* ``lfu``: fewest prefix matches first, then least recently used.
* ``longest``: largest leaf (most pages, i.e. frees the most) first, then LRU.
* ``importance``: a weighted score in seconds, lowest first; see ``importance``.

Contract a policy must keep (the tree's heap relies on it):

* Pure: the key depends only on the node's fields, never on global state (no clock
  read, no tree-wide statistics), so a key computed when the node was pushed is still
  its key later unless the node itself changed.
* Monotone: while a node stays a candidate leaf, its key may only *grow*. The node
  fields change only this way: ``last_access`` and ``hit_count`` grow (match/insert
  touch it), ``num_pages`` shrinks (a split moves the node's first pages into a new
  parent), ``prefix_len`` never changes (a split keeps where the node ends). So a key
  may increase with ``last_access``, ``hit_count`` and decrease with ``num_pages``;
  it may use ``prefix_len`` either way. The tree keeps a lazy min-heap: an entry whose
  key went stale is noticed when it reaches the top, re-keyed and pushed back. A key
  that *shrinks* behind the tree's back is only noticed when it reaches the top, so
  that node would be evicted later than its true key says.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar


class NodeStats(Protocol):
    """The node fields a policy may read (``radix.tree.TreeNode`` provides them)."""

    last_access: float  # clock value of the last match/insert that touched the node
    hit_count: int  # number of match_prefix calls that matched into the node
    prefix_len: int  # tokens from the root to the end of the node's key

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


def longest(node: NodeStats) -> tuple[int, float]:
    """Largest leaf (most pages) first; ties broken by least recently used.

    MISSION.md section 4's "longest first: evict the largest sequences (frees most)",
    applied to cached leaves: one eviction frees a whole leaf, so this frees the most
    pages per evicted leaf. Monotone: a split only shrinks ``num_pages``.
    """
    return (-node.num_pages, node.last_access)


IMPORTANCE_REUSE_S = 10.0  # w3: seconds of extra life per doubling of (1 + hit_count)
IMPORTANCE_MEMORY_S = 10.0  # w2: seconds less per doubling of the sequence's length


def importance(node: NodeStats) -> float:
    """MISSION.md section 4's ``w1 * recency + w2 * memory_usage + w3 * reuse`` for an
    unlocked cached leaf, lowest first. Every term is in seconds (w1 = 1):

        key = last_access                                  recency: the clock, seconds
              - IMPORTANCE_MEMORY_S * log2(prefix_len)     memory: the KV the sequence
                                                           ending here holds, in tokens
              + IMPORTANCE_REUSE_S * log2(1 + hit_count)   expected reuse: past matches

    Normalisation: the memory and reuse terms are log2 ratios (doubling the sequence or
    the hit count moves the key by a fixed number of seconds), so they are unit-free and
    do not depend on the page size; the weights convert one doubling into seconds of
    recency, the scale of the time between two uses of a cached prefix (a chat user's
    think time). Recency is the node's last access on the tree's clock, not an age
    ``now - last_access``: the order is the same and the key needs no global clock.
    Monotone (see the module docstring): it grows with ``last_access`` and
    ``hit_count``; ``prefix_len`` is fixed while the node is a leaf.
    Weights: chosen with ``radixlm bench cache-sim`` (BENCHMARKS.md).
    """
    return (
        node.last_access
        - IMPORTANCE_MEMORY_S * math.log2(node.prefix_len)
        + IMPORTANCE_REUSE_S * math.log2(1 + node.hit_count)
    )


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "lru": lru,
    "lfu": lfu,
    "longest": longest,
    "importance": importance,
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
