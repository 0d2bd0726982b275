"""Eviction policy registry, each policy's order (exact page ids), the heap against a
brute-force model, and the cost of evict()."""

from __future__ import annotations

import itertools
import math
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.radix import EVICTION_POLICIES, RadixTree, eviction
from radixlm.radix.eviction import (
    CONTINUATION_AGE_BINS,
    IMPORTANCE_MEMORY_S,
    IMPORTANCE_REUSE_S,
    LIVENESS_BIAS,
    LIVENESS_WEIGHTS,
    REUSE_GAP_FIRST_LOG_ODDS,
    REUSE_GAP_OFFSET_S,
    REUSE_GAP_SCALE,
    REUSE_GAP_UNKNOWN_S,
    ContinuationOdds,
    Liveness,
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
    assert list(EVICTION_POLICIES) == [
        "lru", "lfu", "longest", "importance", "continuation-odds", "reuse-gap", "liveness"
    ]
    assert get_policy("lru") is lru and get_policy("lfu") is lfu
    assert get_policy("longest") is longest and get_policy("importance") is importance
    # a learned policy: one fresh model per tree
    first, second = get_policy("continuation-odds"), get_policy("continuation-odds")
    assert isinstance(first, ContinuationOdds) and first is not second
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


def test_continuation_odds_orders_by_recency_plus_learned_log_odds() -> None:
    clock = [0.0]
    tree = RadixTree(256, eviction_policy="continuation-odds", clock=lambda: clock[0])
    policy = tree._policy
    assert policy.think_s == 60.0
    # A snapshot as if learned: sequences of 512-1023 tokens (class 1) come back with
    # odds 3:1, shorter ones (class 0) with odds 1:3; keys are last_access + 60 s * log-odds.
    policy.log_odds[0], policy.log_odds[1] = math.log(1 / 3), math.log(3)
    short_old = tree.insert([1] * 256, [10]).node  # t=0, class 0: key -65.9
    long_old = tree.insert([2] * 512, [20, 21]).node  # t=0, class 1: key +65.9
    clock[0] = 100.0
    short_new = tree.insert([3] * 256, [30]).node  # t=100, class 0: key 34.1
    clock[0] = 150.0
    long_new = tree.insert([4] * 768, [40, 41, 42]).node  # t=150, class 1: key 215.9
    keys = [policy(n) for n in (short_old, short_new, long_old, long_new)]
    assert keys == pytest.approx(
        [-60 * math.log(3), 100 - 60 * math.log(3), 60 * math.log(3), 150 + 60 * math.log(3)]
    )
    # The long sequence cached at t=0 outlives the short one cached 100 s later.
    assert [tree.evict(1) for _ in range(4)] == [[10], [30], [20, 21], [40, 41, 42]]
    tree.check_invariants()


def test_continuation_odds_counts_continued_and_censored_trials() -> None:
    clock = [0.0]
    tree = RadixTree(256, eviction_policy="continuation-odds", clock=lambda: clock[0])
    policy = tree._policy
    turn1 = [5] * 512  # class 1
    tree.insert(turn1, [50, 51])
    tree.insert([6] * 256, [60])  # class 0, never used again
    clock[0] = 30.0
    match = tree.match_prefix(turn1 + [7] * 256)  # the conversation comes back at t=30
    assert match.pages == [50, 51]
    tree.insert(turn1 + [7] * 256, [50, 51, 70])  # its new leaf extends turn 1's
    assert policy.continued[:3] == [0, 1, 0]
    clock[0] = 95.0
    tree.insert([8] * 256, [80])  # "now" = 95 s
    assert tree.evict(1) == [60]  # the unused class-0 leaf, idle 95 s: age bin 95 / 30 = 3
    assert policy.censored[0][:5] == [0, 0, 0, 1, 0] and sum(map(sum, policy.censored)) == 1
    assert tree.evict(1) == [70]  # turn 2's leaf (t=30, 768 tokens), unused: age 65 s
    assert policy.censored[1][2] == 1
    assert tree.evict(1) == [50, 51]  # turn 1's leaf again: it was used, not a trial
    assert sum(map(sum, policy.censored)) == 2


def test_continuation_odds_estimate_discounts_young_evictions() -> None:
    mle = ContinuationOdds()._mle
    old, young = [0] * CONTINUATION_AGE_BINS, [0] * CONTINUATION_AGE_BINS
    old[-1] = young[0] = 1
    # 3 continued, 1 evicted unused after 8 think times: it had almost surely ended.
    assert mle(3, old, 0.5, 0.0) == pytest.approx(0.75, abs=1e-3)
    # ... evicted after a quarter of a think time: it may well have come back.
    assert mle(3, young, 0.5, 0.0) > 0.9
    # no data: the prior
    assert mle(0, [0] * CONTINUATION_AGE_BINS, 0.3, 100.0) == pytest.approx(0.3)


def test_continuation_odds_refreshes_amortised() -> None:
    tree = RadixTree(1, eviction_policy="continuation-odds", clock=ticking_clock())
    refreshes = []
    policy = tree._policy
    original = policy.refresh
    policy.refresh = lambda: (refreshes.append(len(tree._heap)), original())[1]
    for token in range(4000):
        tree.insert([token], [token])
    # A refresh re-keys every entry (n), so the next one waits for n new leaves: the
    # first after 64, then the heap doubles between refreshes (O(1) amortised per push).
    assert refreshes == [63, 127, 254, 508, 1016, 2032]
    assert sorted(tree.evict(4000)) == list(range(4000))


def test_reuse_gap_is_the_time_between_turns_and_survives_eviction() -> None:
    clock = [0.0]
    tree = RadixTree(1, eviction_policy="reuse-gap", clock=lambda: clock[0])

    def turn(t: float, prompt: list[int]):
        clock[0] = t
        tree.match_prefix(prompt[:-1])
        return tree.insert(prompt, [100 * t + i for i in range(len(prompt))]).node

    a1 = turn(0, [0, 1, 2])  # 0: a system prompt; conversation A's first turn
    assert a1.reuse_gap == math.inf
    b1 = turn(5, [0, 5, 6])  # the second user of [0]: matched once, taken for a turn
    assert b1.reuse_gap == 5.0 and b1.parent.hit_count == 1
    c1 = turn(7, [0, 8, 9])  # [0] matched twice: a shared prefix, no gap
    assert c1.reuse_gap == math.inf and c1.parent.reuse_gap == 2.0
    a2 = turn(40, [0, 1, 2, 3, 4])  # A's next turn, 40 s after its first
    assert a2.reuse_gap == 40.0 and a2.parent.key == (1, 2)
    # At t=40 (the snapshot) C goes first (no gap: first-turn odds), then B (gap 5 s,
    # idle 35 s), then A's turns (gap 40 s, just used).
    assert tree.evict(100) == [701, 702, 501, 502, 4003, 4004, 1, 2, 0]
    # A comes back at t=100 to an empty tree, but the removed [0 1 2 3 4] ended at
    # token 5 with page (4,), last used at t=40: the new leaf's gap is 60 s.
    a3 = turn(100, [0, 1, 2, 3, 4, 7, 8])
    assert a3.prefix_len == 7 and a3.reuse_gap == 60.0
    tree.check_invariants()


def test_reuse_gap_ranks_by_decaying_hit_density() -> None:
    # F: gap 10 s (mu 40 s), S: gap 300 s (mu 330 s), U: no gap (mu 300 s, first-turn
    # odds), all last used at t=300. key = log_odds - idle / mu - log(mu).
    def build() -> tuple[RadixTree, list[float]]:
        clock = [0.0]
        tree = RadixTree(1, eviction_policy="reuse-gap", clock=lambda: clock[0])
        tree.insert([3], [30])  # t=0
        clock[0] = 290.0
        tree.insert([1], [10])
        clock[0] = 300.0
        for first, second in ((1, 2), (3, 4)):
            tree.match_prefix([first])
            tree.insert([first, second], [10 * first, 10 * second])  # F: [2], S: [4]
        tree.insert([5, 6], [50, 60])  # U
        return tree, clock

    mu_f = REUSE_GAP_SCALE * 10 + REUSE_GAP_OFFSET_S
    mu_s = REUSE_GAP_SCALE * 300 + REUSE_GAP_OFFSET_S

    def keys(idle: float) -> list[float]:
        return [
            -idle / mu_f - math.log(mu_f),
            -idle / mu_s - math.log(mu_s),
            REUSE_GAP_FIRST_LOG_ODDS - idle / REUSE_GAP_UNKNOWN_S - math.log(REUSE_GAP_UNKNOWN_S),
        ]
    # just used, the fast conversation is the most likely to come back soon; 200 s later
    # it is overdue and falls below the slow one. The first turn goes first either way.
    f0, s0, u0 = keys(0.0)
    f200, s200, u200 = keys(200.0)
    assert u0 < s0 < f0 and u200 < f200 < s200
    tree, _ = build()
    policy = tree._policy
    by_page = {n.pages[-1]: n for n in tree._iter_nodes() if tree._is_candidate(n)}
    assert [policy(by_page[p]) for p in (20, 40, 60)] == pytest.approx([f0, s0, u0])
    # a turn's parent ([1] of F, [3] of S) has its key and follows it
    assert [tree.evict(1) for _ in range(5)] == [[50, 60], [40], [30], [20], [10]]
    # The clock reaches the keys through the snapshot, refreshed when a new candidate is
    # >= REUSE_GAP_REFRESH_S newer.
    tree, clock = build()
    clock[0] = 500.0
    filler = tree.insert([9], [90]).node
    tree.inc_lock(filler)
    assert tree._policy.now == 500.0
    assert [tree.evict(1) for _ in range(5)] == [[50, 60], [20], [10], [40], [30]]


def test_reuse_gap_refresh_is_due_on_the_clock() -> None:
    clock = [0.0]
    tree = RadixTree(1, eviction_policy="reuse-gap", clock=lambda: clock[0])
    refreshes = []
    policy = tree._policy
    original = policy.refresh
    policy.refresh = lambda: (refreshes.append(clock[0]), original())[1]
    for token in range(60):
        clock[0] = 2.5 * token
        tree.insert([token], [token])
    assert refreshes == [10.0 * k for k in range(1, 15)]  # every 10 s of clock (60 < 64 leaves)


def test_reuse_gap_rekeys_a_leaf_whose_match_lowered_its_key() -> None:
    """A match of an unlocked leaf lengthens its reuse gap, which lowers its key (the
    snapshot has not moved): eviction must still take the lowest key (hypothesis found
    page 3 evicted while page 4's key was lower)."""
    ticks = itertools.count()
    tree = RadixTree(1, "reuse-gap", clock=lambda: float(next(ticks)))
    pages = itertools.count(1)

    def insert_after_match(key: tuple[int, ...]) -> None:
        shared = tree.match_prefix(key).pages
        tree.insert(key, shared + [next(pages) for _ in range(len(key) - len(shared))])

    insert_after_match((0,))
    tree.evict(1)
    for key in ((0, 0), (0, 1), ()):
        insert_after_match(key)
    tree.match_prefix([0, 1])
    leaves = {n.pages[0]: tree._policy(n) for n in tree._iter_nodes() if n.is_leaf and n.lock_ref == 0}
    assert tree._policy.now == 0.0 and len(leaves) == 2
    assert tree.evict(1) == [min(leaves, key=leaves.get)]


class RecordingLiveness(Liveness):
    """``Liveness`` that keeps each node's features (computed once per node)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict = {}

    def features(self, node):
        self.seen[node] = super().features(node)
        return self.seen[node]


def liveness_tree(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(EVICTION_POLICIES, "liveness-recording", RecordingLiveness)
    clock = [0.0]
    tree = RadixTree(1, eviction_policy="liveness-recording", clock=lambda: clock[0])

    def turn(t: float, prompt: list[int]):
        clock[0] = t
        tree.match_prefix(prompt[:-1])
        return tree.insert(prompt, [1000 * t + i for i in range(len(prompt))]).node

    return tree, clock, turn


def test_liveness_features_follow_a_conversation_through_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    tree, clock, turn = liveness_tree(monkeypatch)
    seen = tree._policy.seen
    log2 = math.log2
    a1 = turn(0, [1, 2, 3])  # a first turn: 3 new pages of 3
    assert seen[a1] == (log2(1 + 3), 0.0, log2(3), 0.0)
    a2 = turn(10, [1, 2, 3, 4, 5])  # its second turn: extends a1 (matched once) by 2
    assert seen[a2] == (log2(1 + 2), log2(2), log2(5), log2(1 + 10))
    assert tree.evict(100)  # everything goes; the records stay
    a3 = turn(30, [1, 2, 3, 4, 5, 6])  # one new leaf of 6 pages, but turn 3 with 1 new page
    assert a3.num_pages == 6 and seen[a3] == (log2(1 + 1), log2(3), log2(6), log2(1 + 30))
    # the server caches a request twice: its prompt, then prompt + output (the prompt's
    # leaf never matched in between): the same turn, its new pages counted from the start
    b1 = turn(40, [7, 8])
    clock[0] = 45.0
    b2 = tree.insert([7, 8, 9, 10], [1, 2, 3, 4]).node
    assert b2.parent is b1 and seen[b2] == (log2(1 + 4), 0.0, log2(4), log2(1 + 5))
    # a prefix matched by two later sequences is shared (a system prompt), not a turn
    s = turn(50, [20, 21])
    c = turn(51, [20, 21, 30])
    d = turn(52, [20, 21, 31])
    assert c.parent is s is d.parent and s.hit_count == 2
    assert seen[c][:2] == (log2(1 + 1), log2(2)) and seen[d][:2] == (log2(1 + 1), 0.0)
    policy = tree._policy
    for node in (a3, b2, c, d):
        z = LIVENESS_BIAS + sum(w * f for w, f in zip(LIVENESS_WEIGHTS, seen[node], strict=True))
        assert policy.log_odds(node) == pytest.approx(z)
    tree.check_invariants()


def test_liveness_evicts_the_less_likely_to_return_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two conversations with the same pace (second turn 10 s after the first): P adds a
    # 2-page follow-up at t=10, Q a 32-page one at t=11. reuse-gap evicts P first (used
    # earlier, same gap); liveness predicts Q's long follow-up less likely to be followed
    # (new pages weigh -0.364 per doubling) and evicts Q first.
    def build(policy: str) -> tuple[RadixTree, list[float]]:
        clock = [0.0]
        tree = RadixTree(1, eviction_policy=policy, clock=lambda: clock[0])
        for t, prompt in ((0, [1, 2]), (1, [5, 6]), (10, [1, 2, 3, 4]), (11, [5, 6, *range(100, 132)])):
            clock[0] = t
            tree.match_prefix(prompt[:-1])
            tree.insert(prompt, [1000 * t + i for i in range(len(prompt))])
        return tree, clock

    tree, _ = build("reuse-gap")
    assert tree.evict(1) == [10002, 10003]  # P's follow-up
    tree, clock = build("liveness")
    assert tree.evict(1) == [11000 + i for i in range(2, 34)]  # Q's follow-up
    # the key: z - idle / mu - log(mu), mu = REUSE_GAP_SCALE x 10 s + REUSE_GAP_OFFSET_S
    tree, clock = build("liveness")
    clock[0] = 200.0
    tree.inc_lock(tree.insert([9], [9]).node)  # a new leaf 189 s later: the snapshot moves
    policy, mu = tree._policy, REUSE_GAP_SCALE * 10 + REUSE_GAP_OFFSET_S
    assert policy.now == 200.0
    by_page = {n.pages[-1]: n for n in tree._iter_nodes() if tree._is_candidate(n)}
    p2, q2 = by_page[10003], by_page[11033]
    log2 = math.log2

    def z(features: tuple[float, ...]) -> float:
        return LIVENESS_BIAS + sum(w * f for w, f in zip(LIVENESS_WEIGHTS, features, strict=True))

    z_p = z((log2(1 + 2), 1.0, log2(4), log2(1 + 10)))
    z_q = z((log2(1 + 32), 1.0, log2(34), log2(1 + 10)))
    assert policy.log_odds(p2) == pytest.approx(z_p) and policy.log_odds(q2) == pytest.approx(z_q)
    assert z_p > z_q
    assert policy(p2) == pytest.approx(z_p - 190 / mu - math.log(mu))  # idle 190 s
    assert policy(q2) == pytest.approx(z_q - 189 / mu - math.log(mu))
    assert tree.evict(1) == [11000 + i for i in range(2, 34)]


def test_liveness_forgets_detached_nodes_at_refresh() -> None:
    clock = [0.0]
    tree = RadixTree(1, eviction_policy="liveness", clock=lambda: clock[0])
    for token in range(100):
        clock[0] = float(token)
        tree.insert([token], [token])
    tree.evict(100)
    clock[0] = 200.0
    tree.insert([500], [500])  # 100 s later: a refresh forgets the evicted leaves
    assert list(tree._policy._log_odds) == [tree.match_prefix([500]).node]


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
    # keys as the heap sees them now: the evict may refresh a learned policy's clock
    # snapshot (the victim's parent becomes a new candidate), which reorders later keys
    keys = {tuple(n.pages): key(n) for n in candidates}
    freed = tree.evict(1)
    if not candidates:
        assert freed == []
        return False
    assert tuple(freed) in keys, "evicted something that was not a candidate leaf"
    assert keys[tuple(freed)] == min(keys.values())
    return True


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2]), ops=operations)
def test_evict_takes_the_lowest_key_leaf(policy: str, page_size: int, ops) -> None:
    # A learned policy re-keys the heap after every new leaf here (its snapshot moves).
    with mock.patch.object(eviction, "REFRESH_MIN_NEW", 1):
        run_and_check_evictions(policy, page_size, ops)


def run_and_check_evictions(policy: str, page_size: int, ops) -> None:
    now = [0.0]
    tree = RadixTree(page_size, eviction_policy=policy, clock=lambda: now[0])
    key, page_ids, locks, inserted = tree._policy, itertools.count(), [], []
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
