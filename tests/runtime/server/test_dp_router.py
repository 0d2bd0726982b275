"""The data parallel router (server/dp_router.py): cache-aware placement, the load
balance rule, round robin, aborts following their request."""

from __future__ import annotations

from radixlm.runtime import messages as m
from radixlm.runtime.server.dp_router import BALANCE_ABS, DPRouter


class _Sock:
    def __init__(self) -> None:
        self.sent: list = []

    def asend_nowait(self, msg) -> None:
        self.sent.append(msg)


def _router(policy: str, replicas: int = 2, capacity: int = 1 << 20) -> tuple[DPRouter, list[_Sock]]:
    socks = [_Sock() for _ in range(replicas)]
    return DPRouter(socks, policy, capacity, page_size=4), socks


def _req(rid: str, ids: list[int]) -> m.GenerateReq:
    return m.GenerateReq(rid=rid, input_ids=ids, sampling=m.SamplingParams())


def test_cache_aware_keeps_a_conversation_on_one_replica() -> None:
    """Two conversations start on different replicas (the emptier tree); every later turn,
    which extends its history, goes where that history went."""
    router, socks = _router("cache_aware")
    a, b = list(range(100, 140)), list(range(500, 540))
    router.asend_nowait(_req("a0", a))
    router.asend_nowait(_req("b0", b))
    first = {"a": router.where["a0"], "b": router.where["b0"]}
    assert first["a"] != first["b"]
    for turn in range(1, 4):
        a, b = a + list(range(200 + turn * 10, 210 + turn * 10)), b + list(range(600 + turn * 10, 610 + turn * 10))
        router.asend_nowait(_req(f"a{turn}", a))
        router.asend_nowait(_req(f"b{turn}", b))
        assert router.where[f"a{turn}"] == first["a"] and router.where[f"b{turn}"] == first["b"]
    router.asend_nowait(m.AbortReq(rid="a2"))
    assert isinstance(socks[first["a"]].sent[-1], m.AbortReq)
    assert router.loads == [4, 4]
    for rid in ("a0", "a1", "a2", "a3"):
        router.release(rid)
    assert router.loads[first["a"]] == 0 and router.loads[first["b"]] == 4


def test_cache_aware_balances_an_overloaded_replica() -> None:
    """A shared prefix goes to its replica until that one has BALANCE_ABS more samples in
    flight than the other; then the least loaded takes it."""
    router, _ = _router("cache_aware")
    prefix = list(range(1000, 1064))
    placed = [router.pick(prefix + [i]) for i in range(3)]
    assert len(set(placed)) == 1
    hot = placed[0]
    router.loads[hot] = BALANCE_ABS + 1
    assert router.pick(prefix + [99]) == 1 - hot
    # --dp-balance-abs 0: one sample more in flight is imbalanced already
    strict = DPRouter([_Sock(), _Sock()], "cache_aware", 1 << 20, page_size=4, balance_abs=0)
    held = strict.pick(prefix)
    assert strict.pick(prefix + [1]) == held  # loads 0 and 0
    strict.loads[held] = 1
    assert strict.pick(prefix + [2]) == 1 - held


def test_round_robin_alternates_and_broadcasts_control() -> None:
    router, socks = _router("round_robin", replicas=3)
    prefix = list(range(64))
    assert [router.pick(prefix) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    router.asend_nowait(m.FlushCacheReq())
    assert all(isinstance(s.sent[-1], m.FlushCacheReq) for s in socks)


def test_router_tree_is_trimmed_to_the_replica_capacity() -> None:
    router, _ = _router("cache_aware", replicas=1, capacity=40)  # 10 pages of 4 tokens
    for k in range(5):
        router.pick(list(range(k * 100, k * 100 + 16)))
    assert router.trees[0].cached_pages <= 10
    router.trees[0].check_invariants()


def _hinted(replicas: int = 2, policy: str = "cache_aware") -> tuple[DPRouter, list[_Sock]]:
    socks = [_Sock() for _ in range(replicas)]
    return DPRouter(socks, policy, 1 << 20, page_size=4, peer_hints=True), socks


def test_a_request_sent_away_from_its_prefix_carries_a_peer_hint() -> None:
    """Replica 0 got a prompt; the same prefix sent to replica 1 (the client's choice, or
    the load balance) names replica 0 and its matched whole pages."""
    router, socks = _hinted()
    prefix = list(range(1000, 1042))  # 10 whole pages and 2 tokens
    router.asend_nowait(m.GenerateReq(rid="a", input_ids=prefix, sampling=m.SamplingParams(), data_parallel_rank=0))
    assert socks[0].sent[-1].peer_rank == -1  # nothing anywhere: no hint
    router.asend_nowait(m.GenerateReq(rid="b", input_ids=prefix + [7, 8], sampling=m.SamplingParams(),
                                      data_parallel_rank=1))
    sent = socks[1].sent[-1]
    assert router.where["b"] == 1 and (sent.peer_rank, sent.peer_tokens) == (0, 40)
    # replica 1 now holds it too (its tree says so): no hint either way
    router.asend_nowait(m.GenerateReq(rid="c", input_ids=prefix + [9], sampling=m.SamplingParams(),
                                      data_parallel_rank=1))
    assert socks[1].sent[-1].peer_rank == -1
    router.loads = [0, BALANCE_ABS + 1]  # the balance rule: a prefix held by 1 overflows to 0
    other = list(range(2000, 2040))
    router.route(other, 1)
    replica, hint = router.route(other + [5])
    assert replica == 0 and hint == (1, 40)


def test_no_hint_for_less_than_a_page_or_without_the_flag() -> None:
    router, _ = _hinted()
    prefix = list(range(64))
    router.route(prefix, 0)
    _, hint = router.route(prefix[:3] + [999] * 10, 1)  # shares 3 tokens: no whole page
    assert hint is None
    plain, _ = _router("cache_aware")
    plain.route(prefix, 0)
    assert plain.route(prefix, 1) == (1, None)


def test_round_robin_with_hints_keeps_the_trees() -> None:
    router, _ = _hinted(policy="round_robin")
    prefix = list(range(300, 340))
    assert router.route(prefix) == (0, None)
    assert router.route(prefix) == (1, (0, 40))
