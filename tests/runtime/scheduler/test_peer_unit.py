"""The peer KV tier's controller (scheduler/peer.py) without processes: two replicas, each
a real radix tree, page allocator and PrefixCache, joined by a fake link (a FIFO wire per
direction that checks sends and receives pair up by tag) and fake sockets (lists). Every
page's "bytes" are its token ids, so a loaded page is checked against what it must hold.

Covered: the happy path (pages land in the tree, the request is released, cached_tiers
says peer), a peer that evicted the prefix (none) or holds less than the hint (partial),
a peer that never answers (the request times out, the late pages are still cached), an
answer nobody wants any more (drained: the pairing holds), an unresponsive peer (no new
fetch), the cost model's verdict, two requests sharing one fetch, an abort while waiting,
no room for the pages, and the serving side's lock and busy refusal."""

from __future__ import annotations

import pytest

from radixlm.radix import RadixTree
from radixlm.runtime import messages as m
from radixlm.runtime.memory.cost_model import SwapCostModel, TierCostModel
from radixlm.runtime.memory.page_allocator import PageAllocator
from radixlm.runtime.scheduler import peer as peer_mod
from radixlm.runtime.scheduler.peer import PeerCache
from radixlm.runtime.scheduler.prefix_cache import PrefixCache
from radixlm.runtime.scheduler.request import Req

S = 4  # page size


class FakeTransfer:
    def __init__(self, link, peer: int, tag: int, num_pages: int, data=None) -> None:
        self.link, self.peer, self.tag, self.num_pages, self.data = link, peer, tag, num_pages, data
        self.failed: Exception | None = None
        self.is_send, self.received = data is not None, False  # a send is done once received

    def done(self) -> bool:
        if self.is_send:
            return self.received
        if self.data is not None:
            return True
        if self.link.hold:
            return False
        queue = self.link.wire.setdefault((self.peer, self.link.rank), [])
        if not queue:
            return False
        send = queue.pop(0)
        assert send.tag == self.tag and send.num_pages == self.num_pages, "sends and receives out of pairing"
        send.received = True
        self.data = send.data
        return True

    def error(self):
        return self.failed


class FakeLink:
    page_bytes = 16

    def __init__(self, rank: int, pool: dict, wire: dict) -> None:
        self.rank, self.pool, self.wire, self.hold = rank, pool, wire, False
        self.staged: list[list[int]] = []

    def stage(self, pages):
        self.staged.append(list(pages))
        return [self.pool[p] for p in pages]

    def post_send(self, dst, staging, tag):
        t = FakeTransfer(self, dst, tag, len(staging), list(staging))
        self.wire.setdefault((self.rank, dst), []).append(t)
        return t

    def recv(self, src, num_pages, tag):
        return FakeTransfer(self, src, tag, num_pages)

    def write(self, transfer, pages, skip=0):
        for i, p in enumerate(pages):
            self.pool[p] = transfer.data[skip + i]


class FakeOutbox:
    def __init__(self, inbox: list) -> None:
        self.inbox, self.full = inbox, False

    def try_send(self, msg) -> bool:
        if self.full:
            return False
        self.inbox.append(m.decode(m.encode(msg)))  # as it travels
        return True


def peer_costs(peer_bw: float = 1e9, flops: float = 1e9) -> TierCostModel:
    compute = SwapCostModel(kv_bytes_per_token=4, params=10**6, num_layers=2, q_dim=8,
                            link_bytes_per_s=1e9, flops_per_s=flops)
    return TierCostModel(compute, page_bytes=16, page_size=S, read_bytes_per_s={"peer": peer_bw},
                         latency_s={"peer": 1e-6})


class Replica:
    def __init__(self, rank: int, wire: dict, now: list, pages: int = 33, costs: TierCostModel | None = None,
                 tiers: tuple[str, ...] = ()) -> None:
        self.rank, self.now = rank, now
        self.tree = RadixTree(S, tiers=tiers)
        self.allocator = PageAllocator(pages)
        self.cache = PrefixCache(self.allocator, self.tree, S)
        self.pool: dict[int, tuple] = {}
        self.inbox: list = []
        self.link = FakeLink(rank, self.pool, wire)
        self.outboxes: dict[int, FakeOutbox] = {}
        self.peer = PeerCache(rank, self.cache, self.link, self.outboxes, costs or peer_costs(), timeout_s=1.0,
                              min_wait_s=0.05, clock=lambda: now[0])
        self.cache.peer = self.peer

    def compute(self, tokens: list[int]) -> list[int]:
        """As a request that computed ``tokens`` (whole pages) and finished: its pages hold
        those tokens and are cached."""
        pages = self.cache.alloc(len(tokens) // S)
        for i, p in enumerate(pages):
            self.pool[p] = tuple(tokens[i * S : (i + 1) * S])
        result = self.tree.insert(tokens, pages)
        assert result.pages == pages
        return pages

    def deliver(self) -> None:
        """One scheduler loop turn: handle the messages, then the step's start takes the
        pages that arrived (``PrefixCache.take_arrivals``)."""
        msgs, self.inbox[:] = list(self.inbox), []
        for msg in msgs:
            if isinstance(msg, m.PeerFetchReq):
                self.peer.on_request(msg)
            else:
                self.peer.on_answer(msg)
        self.cache.take_arrivals()

    def check(self, live: tuple = ()) -> None:
        self.cache.check_invariants(list(live))

    def held(self, tokens: list[int]) -> int:
        """Device tokens of ``tokens`` in the tree, each page checked against its bytes."""
        match = self.tree.match_prefix(tokens)
        for i, p in enumerate(match.pages):
            assert self.pool[p] == tuple(tokens[i * S : (i + 1) * S]), f"page {i} holds the wrong KV"
        return match.num_tokens


def pair(**kw) -> tuple[Replica, Replica, list]:
    wire, now = {}, [0.0]
    a, b = Replica(0, wire, now, **kw), Replica(1, wire, now, **kw)
    a.outboxes[1], b.outboxes[0] = FakeOutbox(b.inbox), FakeOutbox(a.inbox)
    return a, b, now


def request(rid: str, tokens: list[int], hint_rank: int = 0, hint_tokens: int | None = None) -> Req:
    req = Req(rid=rid, prompt_ids=list(tokens), sampling=m.SamplingParams())
    req.peer_rank, req.peer_tokens = hint_rank, len(tokens) if hint_tokens is None else hint_tokens
    return req


PROMPT = list(range(100, 125))  # 6 whole pages + 1 token


def test_pages_come_from_the_peer_and_count_as_peer_tokens() -> None:
    a, b, _ = pair()
    a.compute(PROMPT[:24])
    req = request("r", PROMPT, hint_tokens=24)
    assert b.peer.start(req, len(PROMPT) - 1)
    assert not b.peer.ready(req)
    assert isinstance(a.inbox[0], m.PeerFetchReq) and a.inbox[0].start == 0
    a.deliver()  # A: match, lock, gather, unlock, answer, send
    assert a.link.staged == [a.tree.match_prefix(PROMPT[:24]).pages] and a.tree.protected_pages == 0
    b.deliver()  # B: post the receive
    assert b.peer.ready(req)  # the pages arrived: inserted, the request released
    assert b.held(PROMPT) == 24 and req.peer_span == (0, 24)
    assert b.tree.protected_pages == 0
    assert b.cache.match_and_lock(req, len(PROMPT) - 1) == 24
    assert req.cached_tiers == {"device": 0, "peer": 24}
    assert b.peer.stats.hit_tokens == 0  # counted when the planner admits it
    b.cache.count_hits(req)
    st = b.peer.stats
    assert (st.fetches, st.fetches_loaded, st.pages_received, st.tokens_inserted, st.hit_tokens) == (1, 1, 6, 24, 24)
    assert (a.peer.stats.requests_served, a.peer.stats.pages_sent) == (1, 6)
    a.peer.poll()
    assert a.peer.sending == []  # the send completed
    b.check([req])
    a.check()


def test_only_the_pages_past_its_own_prefix_are_fetched() -> None:
    a, b, _ = pair()
    a.compute(PROMPT[:24])
    b.compute(PROMPT[:8])
    req = request("r", PROMPT)
    assert b.peer.start(req, len(PROMPT) - 1)
    assert a.inbox[0].start == 8
    a.deliver()
    b.deliver()
    assert b.peer.ready(req)
    assert b.held(PROMPT) == 24 and req.peer_span == (8, 24)
    b.cache.match_and_lock(req, len(PROMPT) - 1)
    assert req.cached_tiers == {"device": 8, "peer": 16}


def test_a_peer_that_evicted_the_prefix_answers_none() -> None:
    """The hint is never trusted: A was sent the prompt but holds nothing of it now."""
    a, b, _ = pair()
    req = request("r", PROMPT, hint_tokens=24)
    assert b.peer.start(req, len(PROMPT) - 1)
    a.deliver()
    assert a.inbox == [] and a.peer.stats.requests_refused == 1
    b.deliver()
    assert b.peer.ready(req) and b.held(PROMPT) == 0 and req.peer_span is None
    assert b.peer.stats.fetches_none == 1 and b.tree.protected_pages == 0
    b.check()


def test_a_peer_holding_less_than_hinted_sends_what_it_has() -> None:
    a, b, _ = pair()
    a.compute(PROMPT[:12])
    req = request("r", PROMPT, hint_tokens=24)
    assert b.peer.start(req, len(PROMPT) - 1)
    a.deliver()
    b.deliver()
    assert b.peer.ready(req) and b.held(PROMPT) == 12 and req.peer_span == (0, 12)


def test_no_answer_times_out_and_the_late_pages_are_still_cached() -> None:
    a, b, now = pair()
    a.compute(PROMPT[:24])
    b.compute(PROMPT[:8])
    req = request("r", PROMPT)
    assert b.peer.start(req, len(PROMPT) - 1)
    assert b.tree.protected_pages == 2  # its own prefix, for the insert
    now[0] = 0.04
    assert not b.peer.ready(req)  # min_wait_s 0.05: the recompute estimate is microseconds
    now[0] = 0.06
    assert b.peer.ready(req) and b.peer.stats.waits_timed_out == 1
    assert b.tree.protected_pages == 0  # nobody waits: no lock
    b.check()
    a.deliver()  # A was stalled; it answers now
    b.deliver()
    b.peer.poll()
    assert b.held(PROMPT) == 24 and b.peer.stats.fetches_loaded == 1
    assert b.peer.fetches == {} and req.peer_span is None  # it had left: its own tokens are computed
    b.check()


def test_an_answer_to_a_forgotten_fetch_is_received_and_dropped() -> None:
    """Pairing: B must post the receive of every answer with pages, or the next transfer
    from A would pair with this one."""
    a, b, now = pair()
    a.compute(PROMPT[:24])
    first = request("r1", PROMPT)
    assert b.peer.start(first, len(PROMPT) - 1)
    now[0] = 1.0
    assert b.peer.ready(first)  # timed out
    now[0] = peer_mod.PEER_FORGET_S + 10
    b.peer.poll()
    assert b.peer.fetches == {}  # forgotten
    a.deliver()
    b.link.hold = True  # the bytes are still on their way
    b.deliver()
    assert len(b.peer.draining) == 1  # the receive is posted all the same
    b.link.hold = False
    b.peer.poll()
    assert b.peer.draining == [] and b.held(PROMPT) == 0 and a.link.wire[0, 1] == []
    other = [7] * 25  # the next transfer pairs correctly
    a.compute(other[:24])
    req = request("r2", other)
    assert b.peer.start(req, 24)
    a.deliver()
    b.deliver()
    assert b.peer.ready(req) and b.held(other) == 24


def test_an_unresponsive_peer_gets_no_new_fetch() -> None:
    a, b, now = pair()
    a.compute(PROMPT[:24])
    assert b.peer.start(request("r1", PROMPT), len(PROMPT) - 1)
    now[0] = 2.0  # unanswered for longer than timeout_s (1 s)
    assert not b.peer.start(request("r2", PROMPT), len(PROMPT) - 1)
    assert b.peer.stats.skipped == 1 and len(a.inbox) == 1
    a.deliver()  # it answers: responsive again
    b.deliver()
    b.peer.poll()
    b.peer.ready(request("r1", PROMPT))  # r1 still registered: release it
    assert not b.peer.start(request("r3", PROMPT), len(PROMPT) - 1)  # B holds it all now
    assert b.held(PROMPT) == 24


def test_the_cost_model_keeps_a_slow_peer_out() -> None:
    """1 byte/s: 6 pages of 16 bytes take 96 s; recomputing them microseconds."""
    a, b, _ = pair(costs=peer_costs(peer_bw=1.0))
    a.compute(PROMPT[:24])
    req = request("r", PROMPT)
    assert not b.peer.start(req, len(PROMPT) - 1)
    assert b.peer.stats.skipped == 1 and a.inbox == [] and b.peer.ready(req)


def test_samples_of_one_prompt_share_one_fetch() -> None:
    a, b, _ = pair()
    a.compute(PROMPT[:24])
    reqs = [request(f"r-{i}", PROMPT) for i in range(3)]
    assert all(b.peer.start(r, len(PROMPT) - 1) for r in reqs)
    assert len(a.inbox) == 1 and b.peer.stats.fetches == 1
    a.deliver()
    b.deliver()
    assert all(b.peer.ready(r) for r in reqs)
    assert all(r.peer_span == (0, 24) for r in reqs) and b.tree.protected_pages == 0
    b.check()


def test_a_request_without_a_hint_waits_for_the_fetch_bringing_its_prefix() -> None:
    """The router hints only the first request it sends away from a prefix (then its tree
    says this replica holds it too): the next ones wait for the same fetch instead of
    computing the prefix themselves."""
    a, b, _ = pair()
    a.compute(PROMPT[:24])
    b.compute(PROMPT[:4])
    hinted = request("r1", PROMPT)
    assert b.peer.start(hinted, len(PROMPT) - 1)
    b.cache.cancel_prefetch(hinted)  # its waiters all left: the own prefix is unlocked
    assert b.tree.protected_pages == 0
    plain = request("r2", PROMPT[:20] + [1, 2, 3], hint_rank=-1, hint_tokens=0)
    assert b.peer.start(plain, 22)
    assert b.tree.protected_pages == 1  # locked again for the insert
    unrelated = request("r3", [5] * 25, hint_rank=-1, hint_tokens=0)
    assert not b.peer.start(unrelated, 24)
    a.deliver()
    b.deliver()
    assert b.peer.ready(plain) and plain.peer_span == (4, 24)
    b.cache.match_and_lock(plain, 22)
    assert plain.cached_tiers == {"device": 4, "peer": 16}
    b.check([plain])


def test_an_abort_while_waiting_releases_the_lock() -> None:
    a, b, _ = pair()
    a.compute(PROMPT[:24])
    b.compute(PROMPT[:8])
    req = request("r", PROMPT)
    assert b.peer.start(req, len(PROMPT) - 1)
    b.cache.cancel_prefetch(req)
    assert b.tree.protected_pages == 0 and b.peer.waiting == {}
    a.deliver()
    b.deliver()
    b.peer.poll()
    assert b.held(PROMPT) == 24 and b.peer.fetches == {}
    b.check()


def test_no_room_for_the_pages_drops_them() -> None:
    a, b, _ = pair()
    b.allocator.alloc(b.allocator.num_free - 2)  # requests hold all but 2 pages
    a.compute(PROMPT[:24])
    req = request("r", PROMPT)
    assert b.peer.start(req, len(PROMPT) - 1)
    a.deliver()
    b.deliver()
    assert b.peer.ready(req) and b.held(PROMPT) == 0
    assert b.peer.stats.fetches_failed == 1 and b.allocator.num_free == 2


def test_a_replica_with_the_prefix_in_its_own_lower_tier_does_not_ask() -> None:
    a, b, _ = pair(tiers=("host",))
    a.compute(PROMPT[:24])
    b.tree.insert_copy(PROMPT[:24], 0, list(range(1, 7)))  # cached in its host tier
    req = request("r", PROMPT)
    assert not b.peer.start(req, len(PROMPT) - 1)
    assert b.peer.stats.skipped == 1 and a.inbox == []


def test_serving_side_refuses_while_its_sends_are_not_received(monkeypatch) -> None:
    monkeypatch.setattr(peer_mod, "PEER_MAX_INFLIGHT_BYTES", 6 * FakeLink.page_bytes)
    a, b, _ = pair()
    a.compute(PROMPT[:24])
    assert b.peer.start(request("r1", PROMPT), len(PROMPT) - 1)
    a.deliver()  # 6 pages sent, not received yet
    other = [9] * 25
    a.compute(other[:24])
    b.peer.timeout_s = 10.0
    assert not b.peer.start(request("r2", other), 24)  # B's own in-flight limit
    a.peer.on_request(m.PeerFetchReq(xfer=99, src=1, tokens=other[:24], start=0))
    assert b.inbox[-1].num_pages == 0 and b.inbox[-1].reason == "busy"


@pytest.mark.parametrize("start", [-4, 3])
def test_a_malformed_request_is_refused(start: int) -> None:
    a, b, _ = pair()
    a.compute(PROMPT[:24])
    a.peer.on_request(m.PeerFetchReq(xfer=1, src=1, tokens=PROMPT[:24], start=start))
    assert b.inbox[-1].num_pages == 0 and a.link.staged == []


def test_peer_load_seconds_is_one_hop_plus_latency() -> None:
    model = TierCostModel(peer_costs().compute, page_bytes=100, page_size=S,
                          read_bytes_per_s={"host": 100.0, "disk": 50.0, "peer": 1000.0}, latency_s={"peer": 0.5})
    assert model.load_seconds("peer", 2 * S) == pytest.approx(0.5 + 0.2)
    assert model.load_seconds("host", 2 * S) == pytest.approx(2.0)
    assert model.load_seconds("disk", 2 * S) == pytest.approx(2.0 + 4.0)
    assert model.load_seconds("nowhere", S) == float("inf")


def test_pages_evicted_for_the_insert_are_saved_before_they_are_rewritten() -> None:
    """write_back: the page the insert takes is evicted from a node whose only copy is on
    the device; its save to the host tier must read it before the received bytes land."""
    from radixlm.runtime.scheduler.hicache import HiCache

    events: list[tuple[str, list[int]]] = []

    class Host:
        num_pages, page_bytes = 9, 16

        def save(self, device, rows):
            events.append(("save", list(device)))

        def load(self, rows, device):
            events.append(("load", list(device)))

        def wait_saves(self):
            pass

    tree = RadixTree(S, tiers=("host",))
    costs = TierCostModel(peer_costs().compute, page_bytes=16, page_size=S, read_bytes_per_s={"host": 1e9})
    cache = PrefixCache(PageAllocator(5), tree, S, HiCache(tree, Host(), None, costs, "write_back"))
    old = cache.alloc(4)
    tree.insert(list(range(16)), old)  # the pool is full of an evictable node, no host copy
    node, first = cache.insert_loaded(list(range(50, 58)), 0, 2,
                                      lambda pages, skip: events.append(("fill", list(pages))))
    assert node is not None and first == 0
    assert [kind for kind, _ in events] == ["save", "fill"]
    assert set(events[1][1]) <= set(events[0][1])  # the rewritten pages were saved first
    cache.check_invariants([])
