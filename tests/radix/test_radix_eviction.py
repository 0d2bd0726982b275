"""Eviction policy registry, pluggability, and the cost of evict()."""

from __future__ import annotations

import pytest

from radixlm.radix import EVICTION_POLICIES, RadixTree
from radixlm.radix.eviction import get_policy, lfu, lru


class CountingLRU:
    """LRU policy that counts how often the tree asks for a key."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, node) -> float:
        self.calls += 1
        return node.last_access


def ticking_clock():
    now = iter(range(10**9))
    return lambda: float(next(now))


def test_registry_names_and_lookup() -> None:
    assert {"lru", "lfu"} <= set(EVICTION_POLICIES)
    assert get_policy("lru") is lru and get_policy("lfu") is lfu
    with pytest.raises(ValueError, match="choose from"):
        get_policy("fifo")


def test_policy_keys_read_node_stats() -> None:
    tree = RadixTree(1)
    node = tree.insert([1], [10]).node
    node.last_access, node.hit_count = 5.0, 3
    assert lru(node) == 5.0
    assert lfu(node) == (3, 5.0)


def test_registered_policy_is_used_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # Most recently used first: shows a new policy plugs in with one registry entry.
    monkeypatch.setitem(EVICTION_POLICIES, "mru", lambda node: -node.last_access)
    tree = RadixTree(1, eviction_policy="mru", clock=ticking_clock())
    for token in range(3):
        tree.insert([token], [10 + token])
    assert tree.evict(3) == [12, 11, 10]


def test_evict_does_not_scan_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = CountingLRU()
    monkeypatch.setitem(EVICTION_POLICIES, "counting", policy)
    tree = RadixTree(1, eviction_policy="counting", clock=ticking_clock())
    for token in range(2000):
        tree.insert([token, token], [2 * token, 2 * token + 1])
    policy.calls = 0
    assert tree.evict(1) == [0, 1]
    assert policy.calls <= 3  # validate the popped leaf, push its parent (the root: no)
    tree.check_invariants()


def test_lock_churn_keeps_heap_bounded() -> None:
    tree = RadixTree(1, clock=ticking_clock())
    for token in range(10):
        tree.insert([token], [token])
    node = tree.match_prefix([3]).node
    for _ in range(1000):
        tree.inc_lock(node)
        tree.dec_lock(node)  # pushes a fresh heap entry each time
    assert len(tree._heap) <= 2 * 10 + 64 + 1  # stale entries get compacted away
    tree.check_invariants()
    assert sorted(tree.evict(10)) == list(range(10))


def test_touched_leaf_is_rekeyed_not_evicted_early() -> None:
    tree = RadixTree(1, clock=ticking_clock())
    tree.insert([1], [10])
    tree.insert([2], [20])
    tree.match_prefix([1])  # its heap entry is now stale (too low)
    assert tree.evict(1) == [20]
    assert tree.evict(1) == [10]
