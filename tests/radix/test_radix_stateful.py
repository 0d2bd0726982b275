"""Random operation sequences on RadixTree checked against a naive model.

Naive model: ``cached`` maps every cached page-aligned token prefix to the page id that
holds its last page, e.g. with S = 2 inserting "a b c d" with pages [p, q] adds
{(a, b): p, (a, b, c, d): q}. It is prefix-closed, the tree holds exactly its pages, and
the longest cached prefix of a sequence is the longest of its page-aligned prefixes
present in the dict. Evicted pages are dropped from it. Eviction order is checked one
leaf at a time: ``evict(1)`` must take an unlocked leaf with the lowest policy key.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm.radix import EVICTION_POLICIES, RadixTree

Key = tuple[int, ...]
token_lists = st.lists(st.integers(0, 2), max_size=12)


class RadixTreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree: RadixTree | None = None
        self.cached: dict[Key, int] = {}
        self.inserted: list[Key] = []
        self.locks: list[tuple[object, Key]] = []  # (locked node, token prefix it ends)
        self.page_ids = itertools.count(1)

    @initialize(
        page_size=st.sampled_from([1, 2, 3]), policy=st.sampled_from(sorted(EVICTION_POLICIES))
    )
    def make_tree(self, page_size: int, policy: str) -> None:
        ticks = itertools.count()
        self.tree = RadixTree(page_size, policy, clock=lambda: float(next(ticks)))
        self.size = page_size

    # ------------------------------------------------------------- model helpers

    def aligned(self, tokens: list[int]) -> Key:
        return tuple(tokens[: len(tokens) // self.size * self.size])

    def prefixes(self, key: Key) -> list[Key]:
        return [key[:end] for end in range(self.size, len(key) + 1, self.size)]

    def expected_match(self, tokens: list[int]) -> list[int]:
        pages = []
        for prefix in self.prefixes(self.aligned(tokens)):
            if prefix not in self.cached:
                break
            pages.append(self.cached[prefix])
        return pages

    def fresh_pages(self, count: int) -> list[int]:
        return [next(self.page_ids) for _ in range(count)]

    # --------------------------------------------------------------------- rules

    def do_insert(self, key: Key, mine: list[int]) -> list[int]:
        expected_existing = len(self.expected_match(list(key)))
        result = self.tree.insert(key, mine)
        for prefix, page in zip(self.prefixes(key), mine, strict=True):
            self.cached.setdefault(prefix, page)
        assert result.num_existing_tokens == expected_existing * self.size
        assert result.pages == [self.cached[p] for p in self.prefixes(key)]
        assert not key or key[len(key) - len(result.node.key) :] == result.node.key
        self.inserted.append(key)
        return [page for page, kept in zip(mine, result.pages, strict=True) if page != kept]

    @rule(tokens=token_lists)
    def insert_fresh_pages(self, tokens: list[int]) -> None:
        key = self.aligned(tokens)
        expected_existing = len(self.expected_match(tokens))
        mine = self.fresh_pages(len(key) // self.size)
        assert self.do_insert(key, mine) == mine[:expected_existing]

    @rule(tokens=token_lists)
    def insert_after_match(self, tokens: list[int]) -> None:
        key = self.aligned(tokens)
        shared = self.tree.match_prefix(key).pages
        mine = shared + self.fresh_pages(len(key) // self.size - len(shared))
        assert self.do_insert(key, mine) == []

    @rule(tokens=token_lists)
    def match_random(self, tokens: list[int]) -> None:
        self.check_match(tokens)

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def match_inserted(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.inserted))
        cut = data.draw(st.integers(0, len(key)))
        self.check_match(list(key[:cut]) + data.draw(token_lists))

    def check_match(self, tokens: list[int]) -> None:
        result = self.tree.match_prefix(tokens)
        assert result.pages == self.expected_match(tokens)
        assert result.num_tokens == len(result.pages) * self.size

    @rule(tokens=token_lists)
    def lock(self, tokens: list[int]) -> None:
        result = self.tree.match_prefix(tokens)
        self.tree.inc_lock(result.node)
        self.locks.append((result.node, tuple(tokens[: result.num_tokens])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.dec_lock(node)

    @rule(num_pages=st.integers(0, 6))
    def evict(self, num_pages: int) -> None:
        evictable = self.tree.evictable_pages
        freed = self.tree.evict(num_pages)
        assert len(set(freed)) == len(freed)
        assert len(freed) >= num_pages or self.tree.evictable_pages == 0
        assert self.tree.evictable_pages == evictable - len(freed)
        gone = set(freed)
        assert gone <= set(self.cached.values())
        self.cached = {k: page for k, page in self.cached.items() if page not in gone}

    @rule()
    def evict_one_leaf_in_policy_order(self) -> None:
        """``evict(1)`` takes exactly one unlocked leaf, one with the lowest policy key."""
        key_of = self.tree._policy  # the tree's own instance (a learned policy has state)
        leaves = [n for n in self.nodes() if n.is_leaf and n.lock_ref == 0]
        # keys as the eviction sees them: the parent it leaves behind becomes a candidate,
        # whose push may refresh a policy's clock snapshot (ReuseGap) and re-key everything
        keys = {id(n): key_of(n) for n in leaves}
        freed = self.tree.evict(1)
        if not leaves:
            assert freed == []
            return
        victim = next(n for n in leaves if n.pages == freed)
        assert keys[id(victim)] == min(keys.values()), "evicted out of policy order"
        self.cached = {k: page for k, page in self.cached.items() if page not in set(freed)}

    def nodes(self) -> list:
        stack, out = list(self.tree.root.children.values()), []
        while stack:
            out.append(stack.pop())
            stack.extend(out[-1].children.values())
        return out

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self) -> None:
        assert sorted(self.tree.reset()) == sorted(self.cached.values())
        self.cached.clear()

    # ---------------------------------------------------------------- invariants

    def locked_prefixes(self) -> set[Key]:
        return {p for _, key in self.locks for p in self.prefixes(key)}

    @invariant()
    def tree_matches_model(self) -> None:
        if self.tree is None:
            return
        self.tree.check_invariants()
        assert self.tree.all_pages() == set(self.cached.values())
        assert self.tree.cached_pages == len(self.cached)
        assert all(key[: -self.size] in self.cached for key in self.cached if len(key) > self.size)
        locked = self.locked_prefixes()
        assert locked <= set(self.cached), "a locked prefix was evicted"
        assert self.tree.protected_pages == len(locked)


RadixTreeMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_radix_tree_against_model = RadixTreeMachine.TestCase


def test_reuse_gap_refresh_inside_an_eviction_keeps_policy_order() -> None:
    """A sequence hypothesis found: the last eviction removes leaf [8] (the lowest key)
    and pushes its parent, a first-time candidate whose push refreshes ReuseGap's clock
    snapshot; under the new snapshot leaf [6] ranks lower. The eviction was right; its
    check must use the keys it saw."""
    m = RadixTreeMachine()
    m.make_tree(page_size=1, policy="reuse-gap")
    steps = ([0, 2], None, [], [1, 2], [2], [0], None, "match", [], [1, 0], None, [], [], [1], None)
    for tokens in steps:  # each insert and match reads the tree's clock (one tick)
        if tokens is None:
            m.evict_one_leaf_in_policy_order()
        elif tokens == "match":
            m.match_random([0])
        else:
            m.insert_fresh_pages(tokens)
        m.tree_matches_model()
    assert m.tree._policy.now == 10.0  # the snapshot moved during the last eviction
