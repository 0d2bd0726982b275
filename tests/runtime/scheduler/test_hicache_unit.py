"""HiCache (scheduler/hicache.py) with a real tiered RadixTree and fake byte movers: the
prefetch timeout, a failed disk read, the cost model's verdict, the selective write
policy and loads at admission (with the batch planner), each checked on the tree, the
host rows and the counters."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

from radixlm.radix import RadixTree
from radixlm.runtime.memory.cost_model import SwapCostModel, TierCostModel
from radixlm.runtime.memory.page_allocator import PageAllocator
from radixlm.runtime.messages import SamplingParams
from radixlm.runtime.scheduler.hicache import DISK, HOST, HiCache
from radixlm.runtime.scheduler.planner import BatchPlanner
from radixlm.runtime.scheduler.prefix_cache import PrefixCache
from radixlm.runtime.scheduler.request import Req

S = 2  # page size


class FakeHost:
    num_pages, page_bytes = 9, 4  # rows 1..8

    def __init__(self) -> None:
        self.saves, self.loads = [], []

    def save(self, device, rows):
        self.saves.append((list(device), list(rows)))

    def load(self, rows, device):
        self.loads.append((list(rows), list(device)))

    def wait_saves(self):
        pass

    def row(self, r):
        return memoryview(bytes(4))

    def adopt_row(self, r):
        pass


class FakeDisk:
    capacity_pages, writes_disabled = 16, False

    def __init__(self) -> None:
        self.reads: list[Future] = []
        self.deleted: list = []

    def submit_write(self, header, payload):
        f = Future()
        f.set_result(True)
        return f

    def submit_read(self, key, into):
        f = Future()
        self.reads.append(f)
        return f

    def delete(self, keys):
        self.deleted.extend(keys)

    def index(self):
        return []

    def drain(self):
        pass


def costs(flops: float = 1e9, host_bw: float = 1e9, disk_bw: float = 1e9) -> TierCostModel:
    compute = SwapCostModel(kv_bytes_per_token=2, params=10**6, num_layers=2, q_dim=8,
                            link_bytes_per_s=1e9, flops_per_s=flops)
    return TierCostModel(compute, page_bytes=4, page_size=S, read_bytes_per_s={"host": host_bw, "disk": disk_bw})


def make(policy: str = "write_through", model: TierCostModel | None = None, disk: bool = True):
    now = [0.0]
    tree = RadixTree(S, tiers=("host", "disk") if disk else ("host",))
    hc = HiCache(tree, FakeHost(), FakeDisk() if disk else None, model or costs(), policy,
                 write_threshold=2, prefetch_timeout_s=1.0, clock=lambda: now[0])
    return tree, hc, now


def disk_only(tree: RadixTree, tokens: list[int]) -> None:
    tree.insert_copy(tokens, DISK, [bytes([i]) * 16 for i in range(len(tokens) // S)])


def test_prefetch_times_out_then_lands_in_the_background() -> None:
    tree, hc, now = make()
    disk_only(tree, [1, 2, 3, 4])
    match = tree.match_prefix([1, 2, 3, 4])
    assert hc.prefetch("r", match.tail, 0)
    assert len(hc.disk.reads) == 2 and hc.host_rows.num_free == 6
    assert not hc.prefetch_ready("r")  # reads running, not timed out
    now[0] = 2.0
    assert hc.prefetch_ready("r") and hc.stats.prefetch_timeouts == 1
    assert tree.protected_pages == 0 and match.tail[0].copy_in(HOST) is None
    for f in hc.disk.reads:
        f.set_result(True)
    hc.poll()  # the late reads hand their rows to the tree
    assert match.tail[0].copy_in(HOST) is not None
    hc.check_invariants()
    tree.check_invariants()


def test_prefetches_refine_the_disk_read_rate() -> None:
    """A prefetch of 2 pages of 32 MiB whose last read ends 2 s after it started: 32 MiB/s
    observed, weighted 64 / (64 + 64) against the 1 GB/s known before; a failed read or a
    timeout teaches nothing."""
    model = dataclasses.replace(costs(disk_bw=1e9), page_bytes=32 << 20, always_load=True)
    tree, hc, now = make(model=dataclasses.replace(model, read_bytes_per_s=dict(model.read_bytes_per_s)))
    disk_only(tree, [1, 2, 3, 4])
    assert hc.prefetch("r", tree.match_prefix([1, 2, 3, 4]).tail, 0)
    now[0] = 0.5
    hc.disk.reads[0].set_result(True)
    now[0] = 2.0
    hc.disk.reads[1].set_result(True)
    now[0] = 3.0  # seen later: the reads' own end counts
    assert hc.prefetch_ready("r")
    assert abs(hc.costs.read_bytes_per_s["disk"] - (0.5 * 1e9 + 0.5 * (64 << 20) / 2.0)) < 1
    rate = hc.costs.read_bytes_per_s["disk"]
    tree2, hc2, _ = make(model=dataclasses.replace(model, read_bytes_per_s=dict(model.read_bytes_per_s)))
    disk_only(tree2, [1, 2, 3, 4])
    assert hc2.prefetch("r", tree2.match_prefix([1, 2, 3, 4]).tail, 0)
    hc2.disk.reads[0].set_result(False)
    hc2.disk.reads[1].set_result(True)
    assert hc2.prefetch_ready("r") and hc2.costs.read_bytes_per_s["disk"] == 1e9
    assert rate < 1e9


def test_failed_read_drops_the_node() -> None:
    tree, hc, _ = make()
    disk_only(tree, [1, 2, 3, 4])
    assert hc.prefetch("r", tree.match_prefix([1, 2, 3, 4]).tail, 0)
    hc.disk.reads[0].set_result(False)
    hc.disk.reads[1].set_result(True)
    assert hc.prefetch_ready("r")
    assert hc.stats.prefetch_failures == 1 and hc.stats.prefetch_failed == 1 and hc.stats.prefetch_hits == 0
    assert tree.match_prefix([1, 2, 3, 4]).tail == ()  # a miss: recomputed
    assert hc.host_rows.num_free == 8
    hc.check_invariants()
    tree.check_invariants()


def test_cost_model_skips_a_load_slower_than_recompute() -> None:
    """A host tier of 1 byte/s: loading 2 pages takes 8 s, recomputing them microseconds."""
    tree, hc, _ = make(model=costs(host_bw=1.0), disk=False)
    hc.on_insert(tree.insert([1, 2, 3, 4], [5, 6]).node)
    hc.issue()
    assert tree.evict(2) == [5, 6]  # write-through gave the node a host copy: it stays below
    match = tree.match_prefix([1, 2, 3, 4])
    node, pages, source = hc.load_tail(match.tail, 0, lambda n: list(range(10, 10 + n)))
    assert node is None and pages == [] and hc.stats.skipped_loads == 2
    fast = make(disk=False)[1].costs
    assert fast.worth_loading("host", 0, 4) and not hc.costs.worth_loading("host", 0, 4)


def test_always_load_loads_what_the_cost_model_skips() -> None:
    """--hicache-load-policy always: the 1 byte/s host tier is loaded anyway; a tier
    without a measured rate still is not."""
    model = dataclasses.replace(costs(host_bw=1.0), always_load=True)
    tree, hc, _ = make(model=model, disk=False)
    hc.on_insert(tree.insert([1, 2, 3, 4], [5, 6]).node)
    hc.issue()
    assert tree.evict(2) == [5, 6]
    match = tree.match_prefix([1, 2, 3, 4])
    node, pages, source = hc.load_tail(match.tail, 0, lambda n: list(range(10, 10 + n)))
    assert node is match.tail[-1] and pages == [10, 11] and source == {"host": 4, "disk": 0}
    assert hc.stats.skipped_loads == 0
    no_disk = dataclasses.replace(model, read_bytes_per_s={"host": 1.0})
    assert no_disk.worth_loading("host", 0, 4) and not no_disk.worth_loading("disk", 0, 4)


def test_always_load_waits_for_the_disk_up_to_the_prefetch_timeout() -> None:
    """cost_model: a prefetch waits at most the recompute time (8 ms here); always: the
    whole --hicache-prefetch-timeout-s (1 s)."""
    for always, ready_at_half_s in ((False, True), (True, False)):
        tree, hc, now = make(model=dataclasses.replace(costs(), always_load=always))
        disk_only(tree, [1, 2, 3, 4])
        assert hc.prefetch("r", tree.match_prefix([1, 2, 3, 4]).tail, 0)
        now[0] = 0.5
        assert hc.prefetch_ready("r") is ready_at_half_s
        now[0] = 1.5
        assert hc.prefetch_ready("r") and hc.stats.prefetch_timeouts == 1


def test_selective_write_waits_for_hits() -> None:
    tree, hc, _ = make("write_through_selective", disk=False)
    result = tree.insert([1, 2], [5])
    hc.on_insert(result.node)
    assert hc.saves == []
    for expected in ([], [([5], [1])]):  # the second match reaches the threshold of 2
        match = tree.match_prefix([1, 2])
        hc.on_match(match.node)
        assert hc.saves == expected
    hc.issue()
    assert hc.host.saves == [([5], [1])]


def test_index_disk_rebuilds_chains_and_drops_orphans() -> None:
    """Two conversations sharing a first page, and a page whose parent is missing: the two
    chains become disk-only nodes (3 pages), the orphan is deleted."""
    from radixlm.runtime.memory.disk_store import ROOT_KEY, PageHeader, page_key

    def chain(pages, parent=ROOT_KEY):
        out = []
        for tokens in pages:
            key = page_key(parent, tokens)
            out.append(PageHeader(key=key, parent=parent, tokens=tuple(tokens)))
            parent = key
        return out

    a, b = chain([[1, 2], [3, 4]]), chain([[1, 2], [5, 6]])
    orphan = chain([[9, 9]], parent=page_key(ROOT_KEY, [7, 7]))
    tree, hc, _ = make()
    hc.disk.index = lambda: a + b[1:] + orphan
    assert hc.index_disk() == 3
    assert hc.disk.deleted == [orphan[0].key]
    for tokens in ([1, 2, 3, 4], [1, 2, 5, 6]):
        match = tree.match_prefix(tokens)
        assert match.tail_tokens == 4 and [k for n in match.tail for k in n.copy_in(DISK)][-1] in (a[1].key, b[1].key)
    tree.check_invariants()


def test_a_request_that_must_wait_loads_nothing_and_counts_the_match_that_admits_it() -> None:
    """A host-cached prefix is loaded only when its request is admitted: while a running
    request holds the pool, the waiting one moves no page; once admitted, its
    cached_tokens and the host hit counter are those of the admitting match, counted once."""
    tree = RadixTree(S, tiers=("host",))
    hc = HiCache(tree, FakeHost(), None, costs(), "write_through", write_threshold=2, prefetch_timeout_s=1.0)
    alloc = PageAllocator(9)  # pages 1..8
    cache = PrefixCache(alloc, tree, S, hicache=hc)
    planner = BatchPlanner(cache, max_prefill_tokens=64, chunked_prefill_size=64, max_running_requests=8,
                           enable_prefix_reuse=True)
    pages = alloc.alloc(2)
    hc.on_insert(tree.insert([1, 2, 3, 4], pages).node)
    hc.issue()
    alloc.free(tree.evict(2))  # [1, 2, 3, 4] now lives in the host tier only

    def step() -> list[str]:
        decision = planner.plan()
        for it in decision.items:
            req, was_prefill = it.req, it.req.in_prefill
            req.num_computed += it.num_tokens
            if was_prefill and not req.in_prefill:
                cache.cache(req)
            if it.samples:
                req.output_ids.append(7)
        hc.issue()
        cache.check_invariants(planner.live)
        return [it.req.rid for it in decision.items]

    def req(rid: str, prompt: list[int]) -> Req:
        return Req(rid=rid, prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=4), arrival=float(len(rid)))

    running = req("r", list(range(100, 111)))  # 11 tokens + 1 decoded: 6 of the 8 pages, 2 free
    planner.add(running)
    assert step() == ["r"]
    waiting = req("ww", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 5 pages, 2 of them cached on the host
    planner.add(waiting)
    assert step() == ["r"]  # no room: it waits
    assert hc.stats.pages_moved["host_to_device"] == 0 and hc.host.loads == []
    assert not waiting.admitted and tree.match_prefix([1, 2, 3, 4]).tail  # still host-only
    planner.remove(running)
    assert step() == ["ww"]
    assert waiting.cached_tokens == 4 and waiting.cached_tiers == {"device": 0, "host": 4, "disk": 0}
    assert hc.stats.hit_tokens["host"] == 4 and hc.stats.pages_moved["host_to_device"] == 2
    assert len(hc.host.loads) == 1


def test_rows_a_disk_write_reads_are_freed_only_after_it() -> None:
    """write_back with a 2-row host tier: child B is demoted (saved, its disk write queued);
    then its parent A, with no lower copy and no room to save, is device-evicted with its
    subtree. B's rows, still read by the queued write (from pinned memory, no copy), stay
    allocated until the write ends, and are then free; the invariants hold throughout."""

    class TinyHost(FakeHost):
        num_pages = 3  # rows 1, 2

    class SlowDisk(FakeDisk):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[Future] = []

        def submit_write(self, header, payload):
            self.writes.append(Future())
            return self.writes[-1]

    tree = RadixTree(S, tiers=("host", "disk"))
    hc = HiCache(tree, TinyHost(), SlowDisk(), costs(), "write_back")
    tree.insert([1, 2, 3, 4], [5, 6])
    b = tree.insert([1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7, 8]).node
    assert tree.evict(2) == [7, 8]  # B demoted to rows 1, 2; its write queued at issue()
    hc.issue()
    rows = list(b.copy_in(HOST))
    assert sorted(rows) == [1, 2] and len(hc.disk.writes) == 2
    assert sorted(tree.evict(2)) == [5, 6]  # A cannot be saved: its subtree goes, B with it
    assert b.parent is None
    assert hc.host_rows.free_pages() == set()  # B's rows wait for the write
    hc.check_invariants()
    for f in hc.disk.writes:
        f.set_result(True)
    hc.poll()
    assert hc.host_rows.free_pages() == set(rows)
    hc.check_invariants()
