"""Scenario tests for RadixTree with exact page ids and eviction order."""

from __future__ import annotations

import pytest

from radixlm.radix import RadixTree


class FakeClock:
    """Manually advanced clock, so LRU order is explicit in each test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += 1.0


def make_tree(page_size: int = 2, policy: str = "lru") -> tuple[RadixTree, FakeClock]:
    clock = FakeClock()
    return RadixTree(page_size, eviction_policy=policy, clock=clock), clock


def test_match_on_empty_tree_returns_root() -> None:
    tree, _ = make_tree()
    result = tree.match_prefix([1, 2, 3, 4])
    assert result.pages == []
    assert result.num_tokens == 0
    assert result.node is tree.root
    tree.check_invariants()


def test_partial_page_is_not_matched() -> None:
    tree, _ = make_tree(page_size=4)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7]).pages == [10]
    assert tree.match_prefix([1, 2, 3]).pages == []
    assert tree.match_prefix([1, 2, 3, 9, 5, 6, 7, 8]).pages == []
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 9]).num_tokens == 4
    full = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (full.pages, full.num_tokens) == ([10, 11], 8)


def test_match_splits_node_in_the_middle() -> None:
    tree, _ = make_tree(page_size=2)
    first = tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    result = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert result.pages == [10, 11]
    assert result.num_tokens == 4
    upper = result.node
    assert upper.key == (1, 2, 3, 4) and upper.pages == [10, 11]
    assert list(upper.children) == [(5, 6)]
    # The old handle is the lower half and still ends at the end of the inserted key.
    assert first.node.key == (5, 6) and first.node.pages == [12]
    assert first.node.parent is upper and upper.parent is tree.root
    assert tree.cached_pages == 3
    tree.check_invariants()


def test_match_updates_access_time_and_hit_count() -> None:
    tree, clock = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11])
    clock.now = 7.0
    result = tree.match_prefix([1, 2, 3, 4])
    tree.match_prefix([1, 2])
    assert result.node.key == (3, 4)
    assert (result.node.last_access, result.node.hit_count) == (7.0, 1)
    assert (result.node.parent.last_access, result.node.parent.hit_count) == (7.0, 2)


def test_insert_of_existing_prefix_returns_tree_pages() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    result = tree.insert([1, 2, 3, 4], [20, 21])
    assert result.num_existing_tokens == 4
    assert result.pages == [10, 11]
    assert result.node.key == (1, 2, 3, 4)  # split so a node ends exactly at the key end
    assert tree.cached_pages == 3
    assert tree.all_pages() == {10, 11, 12}
    tree.check_invariants()


def test_insert_reports_duplicates_to_free() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11])
    # The caller matched page 10 earlier, then computed the rest into its own pages.
    mine = [10, 21, 22, 23]
    result = tree.insert([1, 2, 3, 4, 5, 6, 7, 8], mine)
    assert result.num_existing_tokens == 4
    assert result.pages == [10, 11, 22, 23]
    duplicates = [page for page, kept in zip(mine, result.pages, strict=True) if page != kept]
    assert duplicates == [21]
    assert tree.all_pages() == {10, 11, 22, 23}
    assert result.node.key == (5, 6, 7, 8)
    tree.check_invariants()


def test_insert_diverging_branch_splits_and_adds_sibling() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    result = tree.insert([1, 2, 7, 8], [20, 21])
    assert (result.num_existing_tokens, result.pages) == (2, [10, 21])
    shared = result.node.parent
    assert shared.key == (1, 2) and sorted(shared.children) == [(3, 4), (7, 8)]
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).pages == [10, 11, 12]
    tree.check_invariants()


def test_insert_empty_and_bad_arguments() -> None:
    tree, _ = make_tree(page_size=2)
    empty = tree.insert([], [])
    assert (empty.num_existing_tokens, empty.pages, empty.node) == (0, [], tree.root)
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3], [10, 11])
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3, 4], [10])
    assert tree.cached_pages == 0
    with pytest.raises(ValueError):
        RadixTree(0)
    with pytest.raises(ValueError, match="importance, lfu, liveness, longest, lru"):
        RadixTree(1, eviction_policy="nope")


def test_lock_prevents_eviction() -> None:
    tree, clock = make_tree()
    locked = tree.insert([1, 2, 3, 4], [10, 11]).node
    clock.tick()
    tree.insert([5, 6], [12])
    tree.inc_lock(locked)
    assert (tree.protected_pages, tree.evictable_pages) == (2, 1)
    assert tree.evict(10) == [12]
    assert tree.match_prefix([1, 2, 3, 4]).pages == [10, 11]
    tree.dec_lock(locked)
    assert (tree.protected_pages, tree.evictable_pages) == (0, 2)
    assert tree.evict(1) == [10, 11]  # whole leaf goes, more than asked
    assert tree.cached_pages == 0
    tree.check_invariants()


def test_lock_protects_the_whole_prefix_but_not_siblings() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11])
    locked = tree.insert([1, 2, 5, 6], [10, 12]).node
    tree.inc_lock(locked)
    assert tree.protected_pages == 2  # pages 10 and 12
    assert tree.evict(10) == [11]
    assert tree.all_pages() == {10, 12}
    tree.check_invariants()
    tree.dec_lock(locked)
    assert sorted(tree.evict(10)) == [10, 12]


def test_split_keeps_lock_counts() -> None:
    tree, _ = make_tree()
    node = tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]).node
    tree.inc_lock(node)
    upper = tree.match_prefix([1, 2, 3, 4]).node
    assert upper.lock_ref == 1 and tree.protected_pages == 3
    tree.check_invariants()
    tree.dec_lock(node)
    assert upper.lock_ref == 0 and tree.protected_pages == 0
    tree.check_invariants()


def test_lock_errors() -> None:
    tree, _ = make_tree()
    node = tree.insert([1, 2], [10]).node
    with pytest.raises(RuntimeError):
        tree.dec_lock(node)
    tree.inc_lock(tree.root)  # no-op, like dec_lock(root)
    tree.dec_lock(tree.root)
    assert tree.evict(1) == [10]
    with pytest.raises(RuntimeError):
        tree.inc_lock(node)  # evicted handle
    assert tree.protected_pages == 0
    tree.check_invariants()


def test_lru_evicts_least_recently_used_first() -> None:
    tree, clock = make_tree(page_size=1)
    for token, page in [(1, 10), (2, 20), (3, 30)]:
        tree.insert([token], [page])
        clock.tick()
    tree.match_prefix([1])  # page 10 becomes the most recent
    assert tree.evict(1) == [20]
    assert tree.evict(1) == [30]
    assert tree.evict(1) == [10]
    assert tree.evict(1) == []


def test_lfu_evicts_least_frequently_used_first() -> None:
    tree, clock = make_tree(page_size=1, policy="lfu")
    for token, page in [(1, 10), (2, 20), (3, 30)]:
        tree.insert([token], [page])
    for token in [1, 1, 2]:
        clock.tick()
        tree.match_prefix([token])
    assert tree.evict(3) == [30, 20, 10]  # hits 0, 1, 2 despite 2 being most recent


def test_eviction_cascades_to_parent_that_becomes_a_leaf() -> None:
    tree, clock = make_tree(page_size=1)
    tree.insert([1, 2, 3], [10, 11, 12])
    clock.tick()
    tree.insert([1, 2, 4], [10, 11, 13])
    clock.tick()
    tree.insert([7], [70])
    assert tree.evict(3) == [12, 13, 10, 11]
    assert tree.all_pages() == {70}
    tree.check_invariants()


def test_evict_bounds() -> None:
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11])
    assert tree.evict(0) == []
    with pytest.raises(ValueError):
        tree.evict(-1)
    assert tree.evict(100) == [10, 11]
    assert tree.evict(100) == []


def test_reset() -> None:
    tree, _ = make_tree()
    node = tree.insert([1, 2, 3, 4], [10, 11]).node
    tree.insert([1, 2, 5, 6], [10, 12])
    tree.inc_lock(node)
    with pytest.raises(RuntimeError):
        tree.reset()
    tree.dec_lock(node)
    assert sorted(tree.reset()) == [10, 11, 12]
    assert (tree.cached_pages, tree.all_pages()) == (0, set())
    assert tree.match_prefix([1, 2]).node is tree.root
    with pytest.raises(RuntimeError):
        tree.inc_lock(node)  # handles from before the reset are dead
    tree.check_invariants()


def test_page_size_one_is_token_granular() -> None:
    tree, _ = make_tree(page_size=1)
    tree.insert([5, 6, 7], [1, 2, 3])
    result = tree.match_prefix([5, 6, 9])
    assert (result.pages, result.num_tokens, result.node.key) == ([1, 2], 2, (5, 6))
    assert tree.insert([5, 8], [4, 5]).pages == [1, 5]
    tree.check_invariants()


def test_page_size_sixteen() -> None:
    tree, clock = make_tree(page_size=16)
    tokens = list(range(100, 132))
    with pytest.raises(ValueError):
        tree.insert(tokens[:20], [7, 8])
    tree.insert(tokens, [7, 8])
    assert tree.match_prefix(tokens + list(range(15))).pages == [7, 8]
    assert tree.match_prefix(tokens[:31]).pages == [7]
    diverged = tokens[:20] + [0] * 12
    result = tree.match_prefix(diverged)
    assert (result.pages, result.num_tokens, len(result.node.key)) == ([7], 16, 16)
    clock.tick()
    assert tree.insert(diverged, [1, 9]).pages == [7, 9]
    assert tree.evict(1) == [8]
    tree.check_invariants()


# ---------------------------------------------------------------- packed keys (speed path)


@pytest.mark.parametrize("first_diff_page", range(1, 9))
def test_match_stops_at_the_first_differing_page(first_diff_page: int) -> None:
    """The binary search over pages (one long node, mismatch anywhere inside it, even
    at a single token in the middle of a page) splits exactly before that page."""
    size = 4
    tree, _ = make_tree(page_size=size)
    key = list(range(100, 100 + 9 * size))
    tree.insert(key, list(range(1, 10)))
    probe = list(key)
    probe[first_diff_page * size + 2] = 7  # third token of the differing page
    result = tree.match_prefix(probe)
    assert result.num_tokens == first_diff_page * size
    assert result.pages == list(range(1, first_diff_page + 1))
    assert result.node.key == tuple(key[: first_diff_page * size])
    tree.check_invariants()


def test_array_input_matches_list_input() -> None:
    """An ``array("I")`` (the scheduler's packed tokens) behaves exactly like a list."""
    from array import array

    tree, _ = make_tree(page_size=2)
    tree.insert(array("I", [1, 2, 3, 4, 5, 6]), [10, 11, 12])
    result = tree.insert([1, 2, 3, 4, 7, 8], [20, 21, 22])
    assert (result.num_existing_tokens, result.pages) == (4, [10, 11, 22])
    by_array = tree.match_prefix(array("I", [1, 2, 7, 7, 9]))
    by_list = tree.match_prefix([1, 2, 7, 7, 9])
    assert (by_array.pages, by_array.num_tokens) == (by_list.pages, by_list.num_tokens) == ([10], 2)
    assert [c.key for c in tree.root.children.values()] == [(1, 2)]  # the match split it
    tree.check_invariants()


@pytest.mark.parametrize("bad", [[1, -1], [1, 2**32], [1, 2.5]])
def test_token_ids_outside_uint32_are_rejected(bad: list) -> None:
    tree, _ = make_tree(page_size=2)
    with pytest.raises(ValueError, match="token ids"):
        tree.insert(bad, [1])
    with pytest.raises(ValueError, match="token ids"):
        tree.match_prefix(bad)
    assert tree.cached_pages == 0


def test_large_token_ids_round_trip() -> None:
    tree, _ = make_tree(page_size=2)
    tree.insert([2**32 - 1, 0, 151_000, 5], [1, 2])
    assert tree.match_prefix([2**32 - 1, 0, 151_000, 5]).pages == [1, 2]
    assert tree.root.children[(2**32 - 1, 0)].key == (2**32 - 1, 0, 151_000, 5)
