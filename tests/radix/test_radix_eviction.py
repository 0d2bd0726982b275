"""Eviction policy registry, each policy's order (exact page ids), the heap against a
brute-force model, and the cost of evict()."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.radix import EVICTION_POLICIES, RadixTree
from radixlm.radix.eviction import (
    IMPORTANCE_MEMORY_S,
    IMPORTANCE_REUSE_S,
    get_policy,
    importance,
    lfu,
    longest,
    lru,
)


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
    assert list(EVICTION_POLICIES) == ["lru", "lfu", "longest", "importance"]
    assert get_policy("lru") is lru and get_policy("lfu") is lfu
    assert get_policy("longest") is longest and get_policy("importance") is importance
    with pytest.raises(ValueError, match="choose from"):
        get_policy("fifo")


def test_policy_keys_read_node_stats() -> None:
    tree = RadixTree(1)
    node = tree.insert([1], [10]).node
    node.last_access, node.hit_count = 5.0, 3
    assert lru(node) == 5.0
    assert lfu(node) == (3, 5.0)
    assert longest(node) == (-1, 5.0)
    assert (node.prefix_len, IMPORTANCE_REUSE_S, IMPORTANCE_MEMORY_S) == (1, 10.0, 10.0)
    assert importance(node) == 5.0 + 10.0 * 2  # log2(1 + 3 hits) = 2, log2(1 token) = 0


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


def test_longest_evicts_the_largest_leaf_first() -> None:
    tree = RadixTree(2, eviction_policy="longest", clock=ticking_clock())
    tree.insert([1, 1, 2, 2, 3, 3], [10, 11, 12])  # t0
    tree.insert([1, 1, 2, 2, 4, 4, 4, 4], [10, 11, 40, 41])  # t1: splits off [3 3]
    tree.insert([7, 7], [70])  # t2
    # leaves: [3 3] 1 page (t0), [4 4 4 4] 2 pages, [7 7] 1 page (t2)
    assert tree.evict(1) == [40, 41]
    assert tree.evict(1) == [12]  # size tie with [7 7]: least recently used
    assert tree.evict(1) == [10, 11]  # [1 1 2 2] is a leaf now and has 2 pages
    assert tree.evict(1) == [70]
    tree.check_invariants()


def test_importance_weighs_recency_reuse_and_memory() -> None:
    clock = [0.0]
    tree = RadixTree(1, eviction_policy="importance", clock=lambda: clock[0])
    old = tree.insert([1], [10]).node  # t=0: key 0
    reused = tree.insert([2], [20]).node  # t=0, matched 3 times: key 0 + 10 * log2(4)
    for _ in range(3):
        tree.match_prefix([2])
    clock[0] = 15.0
    recent = tree.insert([3], [30]).node  # key 15
    clock[0] = 25.0
    long = tree.insert([4] * 8, list(range(40, 48))).node  # key 25 - 10 * log2(8 tokens)
    assert [importance(n) for n in (long, old, recent, reused)] == [-5.0, 0.0, 15.0, 20.0]
    # The newest leaf goes first (it holds 8 tokens), the most reused one last even
    # though it was used 15 s before the recent one.
    assert [tree.evict(1) for _ in range(4)] == [list(range(40, 48)), [10], [30], [20]]


# ------------------------------------------------------- heap vs brute force
tokens = st.lists(st.integers(0, 2), max_size=8)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), tokens),
        st.tuples(st.just("match"), tokens),
        st.tuples(st.just("rematch"), st.integers(0, 7)),  # match an earlier inserted key
        st.tuples(st.just("lock"), tokens),
        st.tuples(st.just("unlock"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(1, 3)),
    ),
    max_size=40,
)


def evict_one_checked(tree: RadixTree, key) -> bool:
    """evict(1) must take a leaf whose key is the lowest of all candidate leaves, found
    by sorting every candidate (the model). Returns False when nothing was evictable."""
    candidates = [n for n in tree._iter_nodes() if tree._is_candidate(n)]
    freed = tree.evict(1)
    if not candidates:
        assert freed == []
        return False
    by_pages = {tuple(n.pages): n for n in candidates}
    assert tuple(freed) in by_pages, "evicted something that was not a candidate leaf"
    assert key(by_pages[tuple(freed)]) == min(key(n) for n in candidates)
    return True


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2]), ops=operations)
def test_evict_takes_the_lowest_key_leaf(policy: str, page_size: int, ops) -> None:
    now = [0.0]
    tree = RadixTree(page_size, eviction_policy=policy, clock=lambda: now[0])
    key, page_ids, locks, inserted = EVICTION_POLICIES[policy], itertools.count(), [], []
    for op, arg in ops:
        now[0] += 1.0  # every operation happens at its own time
        if op == "insert":
            aligned = arg[: len(arg) // page_size * page_size]
            tree.insert(aligned, [next(page_ids) for _ in range(len(aligned) // page_size)])
            inserted.append(aligned)
        elif op == "match":
            tree.match_prefix(arg)
        elif op == "rematch" and inserted:
            tree.match_prefix(inserted[arg % len(inserted)])
        elif op == "lock":
            locks.append(tree.match_prefix(arg).node)
            tree.inc_lock(locks[-1])
        elif op == "unlock" and locks:
            tree.dec_lock(locks.pop(arg % len(locks)))
        elif op == "evict":
            for _ in range(arg):
                if not evict_one_checked(tree, key):
                    break
    for node in locks:
        tree.dec_lock(node)
    while evict_one_checked(tree, key):
        pass
    assert tree.cached_pages == 0
    tree.check_invariants()
