"""CPU scenario tests of the batch planner + prefix cache, no model: exact page ids,
chunking, prefix reuse, duplicate inserts (C02), eviction and preemption."""

from __future__ import annotations

import itertools

import pytest

from radixlm.radix import RadixTree
from radixlm.runtime.memory.page_allocator import PageAllocator
from radixlm.runtime.messages import SamplingParams
from radixlm.runtime.scheduler.decision import ScheduleDecision
from radixlm.runtime.scheduler.planner import BatchPlanner
from radixlm.runtime.scheduler.preemption import OutputLengthEstimator, choose_victim
from radixlm.runtime.scheduler.prefix_cache import PrefixCache
from radixlm.runtime.scheduler.request import Req

PAGE = 4
_clock = itertools.count()


def make_planner(num_pages: int, radix: bool = True, budget: int = 64, chunk: int = 64,
                 max_running: int = 8, **kw) -> BatchPlanner:
    alloc = PageAllocator(num_pages)
    cache = PrefixCache(alloc, RadixTree(PAGE) if radix else None, PAGE)
    return BatchPlanner(cache, max_prefill_tokens=budget, chunked_prefill_size=chunk,
                        max_running_requests=max_running, enable_prefix_reuse=radix, **kw)


def make_req(rid: str, prompt: list[int], max_new: int = 8) -> Req:
    return Req(rid=rid, prompt_ids=list(prompt), sampling=SamplingParams(max_new_tokens=max_new),
               arrival=float(next(_clock)))


def run_step(planner: BatchPlanner, new_token: int = 7) -> list[tuple[str, int, int]]:
    """Plan one step and apply it as the scheduler would (a sampled token per finishing item)."""
    decision = planner.plan()
    for req in decision.out_of_memory:  # the scheduler finishes these with "length"
        req.finish("length")
        planner.remove(req)
    for it in decision.items:
        req = it.req
        was_prefill = req.in_prefill
        samples = it.samples
        req.num_computed += it.num_tokens
        if was_prefill and not req.in_prefill:
            planner.cache.cache(req)
        if samples:
            req.output_ids.append(new_token)
    planner.cache.check_invariants(planner.live)
    return [(it.req.rid, it.start, it.num_tokens) for it in decision.items]


def finish(planner: BatchPlanner, req: Req) -> None:
    planner.remove(req)
    planner.cache.check_invariants(planner.live)


def test_prefill_then_decode_exact_pages():
    p = make_planner(num_pages=16)
    a = make_req("a", range(10))
    p.add(a)
    assert run_step(p) == [("a", 0, 10)]
    assert a.pages == [1, 2, 3]  # ceil(10 / 4) pages, lowest ids first
    assert run_step(p) == [("a", 10, 1)]  # decode: the sampled token is fed next
    assert a.pages == [1, 2, 3]
    assert run_step(p) == [("a", 11, 1)]
    assert run_step(p) == [("a", 12, 1)]  # position 12 needs a 4th page
    assert a.pages == [1, 2, 3, 4]


def test_chunked_prefill_respects_chunk_and_budget():
    p = make_planner(num_pages=32, budget=12, chunk=8)
    a, b = make_req("a", range(20)), make_req("b", range(100, 110))
    p.add(a)
    p.add(b)
    assert run_step(p) == [("a", 0, 8), ("b", 0, 4)]
    assert run_step(p) == [("a", 8, 8), ("b", 4, 4)]
    assert run_step(p) == [("a", 16, 4), ("b", 8, 2)]
    assert run_step(p) == [("a", 20, 1), ("b", 10, 1)]  # both decoding


def test_budget_below_the_batch_never_cuts_decodes_and_paces_admission():
    """--max-prefill-tokens below the running batch: every decode still runs each step (the
    budget goes negative), a running chunked prefill and new prompts get only what the
    decodes leave, and admission resumes as decodes finish."""
    p = make_planner(num_pages=64, budget=3, chunk=8, max_running=8)
    reqs = [make_req(f"d{i}", range(10 * i, 10 * i + 2), max_new=4) for i in range(4)]
    for r in reqs:
        p.add(r)
    # step 1: the 3-token budget admits d0 (2 tokens) and 1 token of d1's prompt
    assert run_step(p) == [("d0", 0, 2), ("d1", 0, 1)]
    # step 2: d0 decodes (1), d1's chunk gets the rest (1), d2 gets the last token's worth
    assert run_step(p) == [("d0", 2, 1), ("d1", 1, 1), ("d2", 0, 1)]
    assert run_step(p) == [("d0", 3, 1), ("d1", 2, 1), ("d2", 1, 1)]  # budget spent by 3 tokens
    late = make_req("late", range(500, 520), max_new=2)
    p.add(late)
    assert run_step(p) == [("d0", 4, 1), ("d1", 3, 1), ("d2", 2, 1)]  # nothing left for d3 / late
    for r in reqs[:3]:
        r.output_ids.extend([7] * 3)  # the three finish: their budget is free again
        finish(p, r)
    assert run_step(p) == [("d3", 0, 2), ("late", 0, 1)]
    # four decoders against a budget of 2: all four decode, nothing else is scheduled
    p2 = make_planner(num_pages=64, budget=8, chunk=8, max_running=8)
    four = [make_req(f"e{i}", range(10 * i, 10 * i + 1), max_new=5) for i in range(4)]
    for r in four:
        p2.add(r)
    run_step(p2)  # all four prefilled
    p2.max_prefill_tokens = 2
    p2.add(make_req("x", range(300, 310)))
    for pos in (1, 2):
        assert run_step(p2) == [(r.rid, pos, 1) for r in four]


def test_second_request_reuses_page_aligned_prefix_and_keeps_last_token():
    p = make_planner(num_pages=32)
    a = make_req("a", range(12))  # exactly 3 pages
    p.add(a)
    run_step(p)
    finish(p, a)
    b = make_req("b", range(12))
    p.add(b)
    assert run_step(p) == [("b", 8, 4)]  # 12 - 1 = 11 matchable -> 8 (2 pages); last page recomputed
    assert b.cached_tokens == 8
    assert b.pages[:2] == a_pages_prefix(p, range(8))


def a_pages_prefix(p: BatchPlanner, tokens) -> list[int]:
    return p.cache.tree.match_prefix(list(tokens)).pages


def test_concurrent_identical_prompts_dedupe_without_freeing_live_pages():
    """C02: A and B compute the same prompt in the same step; B's insert finds A's pages,
    B switches to them and frees only its own duplicates."""
    p = make_planner(num_pages=32)
    a, b = make_req("a", range(16)), make_req("b", range(16))
    p.add(a)
    p.add(b)
    run_step(p)  # both prefilled in one pass, both inserted at the end of prefill
    assert a.pages[:4] == b.pages[:4] == [1, 2, 3, 4]
    assert b.num_tree_pages == 4
    assert p.cache.allocator.is_free(5) and p.cache.allocator.is_free(8)  # B's duplicates freed
    # Unrelated requests now reuse the freed pages; A and B keep reading pages 1-4.
    c = make_req("c", range(200, 216))
    p.add(c)
    run_step(p)
    assert set(c.pages).isdisjoint({1, 2, 3, 4})
    for r in (a, b, c):
        finish(p, r)
    assert p.cache.tree.protected_pages == 0


def test_eviction_frees_unlocked_leaves_before_preempting():
    p = make_planner(num_pages=9)  # 8 usable pages
    a = make_req("a", range(16))
    p.add(a)
    run_step(p)
    finish(p, a)  # 4 pages cached, unlocked
    assert p.cache.cached_pages == 4
    b = make_req("b", range(100, 124))  # needs 6 pages + 1 to decode
    p.add(b)
    run_step(p)
    assert len(b.pages) == 6 and p.cache.num_evicted_pages >= 2
    assert p.num_preemptions == 0


def _run_to_completion(p: BatchPlanner, steps: int = 200) -> list[str]:
    done = []
    for _ in range(steps):
        run_step(p)
        for r in list(p.running):
            if len(r.output_ids) >= r.sampling.max_new_tokens:
                r.finish("length")
                finish(p, r)
                done.append(r.rid)
        if not p.running and not p.waiting:
            break
    return done


def test_preemption_recomputes_and_never_loses_a_request():
    """Two requests that fit alone (20 tokens = 5 pages each) but not together (6 pages):
    with no decode reserve both are admitted, the newer one is preempted, recomputed
    later, and both finish all their tokens."""
    p = make_planner(num_pages=7, max_running=4, reserve_ratio_init=0.0)
    a, b = make_req("a", range(8), max_new=12), make_req("b", range(50, 58), max_new=12)
    p.add(a)
    p.add(b)
    assert _run_to_completion(p) == ["a", "b"]  # the older request is never the victim
    assert p.num_preemptions >= 1
    assert len(a.output_ids) == len(b.output_ids) == 12
    p.cache.check_invariants([])


def test_decode_reserve_avoids_the_preemption():
    """The same two requests with the default reserve: b waits until a is done instead
    of being admitted and preempted."""
    p = make_planner(num_pages=7, max_running=4)
    a, b = make_req("a", range(8), max_new=12), make_req("b", range(50, 58), max_new=12)
    p.add(a)
    p.add(b)
    assert run_step(p) == [("a", 0, 8)]  # b: 2 pages + 3 reserved for a's 12 tokens > 6
    assert _run_to_completion(p) == ["a", "b"]
    assert p.num_preemptions == 0
    assert len(a.output_ids) == len(b.output_ids) == 12


def test_reserve_ratio_decays_and_jumps_back_on_preemption():
    p = make_planner(num_pages=7, max_running=4, reserve_ratio_init=1.0, reserve_ratio_min=0.5,
                     reserve_decay_steps=5)
    for _ in range(3):
        p.plan()
    assert p.reserve_ratio == pytest.approx(0.7)
    for _ in range(10):
        p.plan()
    assert p.reserve_ratio == pytest.approx(0.5)
    a, b = make_req("a", range(8), max_new=12), make_req("b", range(50, 58), max_new=12)
    p.add(a)
    p.add(b)
    p.reserve_ratio_min = p.reserve_ratio = 0.0  # let both in, then force a preemption
    p._reserve_decay = 0.0
    _run_to_completion(p)
    assert p.num_preemptions >= 1 and p.reserve_ratio == 1.0


def _running_trio(policy: str, radix: bool = False) -> tuple[BatchPlanner, dict[str, Req]]:
    """a (oldest, 12 + 1 tokens, 3 pages), b (19 + 1, 5 pages), c (newest, 7 + 1, 2 pages),
    all decoding; the rest of the pool taken (with the radix tree on, every cached page is
    locked by its request), so nothing is evictable. a's next token needs a 4th page, so
    the plan must preempt someone."""
    p = make_planner(num_pages=13, radix=radix, preemption_policy=policy, reserve_ratio_init=0.0)
    reqs = {"a": make_req("a", range(12), max_new=40), "b": make_req("b", range(100, 119), max_new=40),
            "c": make_req("c", range(200, 207), max_new=4)}
    for r in reqs.values():
        p.add(r)
    run_step(p)
    assert [len(r.pages) for r in reqs.values()] == [3, 5, 2]
    assert p.cache.allocator.num_free == 2
    reqs["filler"] = Req(rid="filler", prompt_ids=[], sampling=SamplingParams())
    reqs["filler"].pages = p.cache.allocator.alloc(p.cache.allocator.num_free)  # pool full
    return p, reqs


@pytest.mark.parametrize(("policy", "victim"), [("lru", "c"), ("longest", "b")])
def test_preemption_policy_picks_exact_victim(policy, victim):
    """lru: c was idle in the last step (a and b ran). longest: b holds 5 pages."""
    p, reqs = _running_trio(policy)
    reqs["c"].last_scheduled_step = p.step - 1
    held = {k: list(r.pages) for k, r in reqs.items()}
    decision = p.plan()
    assert [r.rid for r in decision.preempted] == [victim]
    gone = reqs[victim]
    assert gone.pages == [] and gone.num_computed == 0 and gone in p.waiting
    assert set(held[victim]) - set(reqs["a"].pages) <= p.cache.allocator.free_pages()
    assert len(reqs["a"].pages) == 4  # the request that needed a page got one
    p.cache.check_invariants([*p.live, reqs["filler"]])


def _req_with(rid: str, arrival: float, pages: int, generated: int, max_new: int, last_step: int) -> Req:
    req = Req(rid=rid, prompt_ids=[1], sampling=SamplingParams(max_new_tokens=max_new), arrival=arrival)
    req.pages, req.output_ids, req.last_scheduled_step = list(range(pages)), [5] * generated, last_step
    return req


def test_importance_score_terms_and_weights():
    """At step 10, no output lengths observed (expected remaining = max_new - generated):
    x: idle 0, 2 pages, 90 left -> recency 1, memory 0.25, remaining 1.0
    y: idle 4, 8 pages, 10 left -> recency 0, memory 1.0, remaining 0.111
    z: idle 2, 4 pages, 45 left -> recency 0.5, memory 0.5, remaining 0.5
    weights (1, -1, -1): x -0.25, y -1.111, z -0.5 -> y;  (0, 1, 0): smallest KV -> x;
    (0, 0, -1): most left -> x;  (1, 0, 0): idlest -> y;  (0, 0, 1): least left -> y."""
    reqs = [_req_with("x", 0.0, 2, 10, 100, 10), _req_with("y", 1.0, 8, 30, 40, 6),
            _req_with("z", 2.0, 4, 5, 50, 8)]
    est = OutputLengthEstimator()
    picks = {w: choose_victim(reqs, "importance", 10, est, w).rid
             for w in [(1.0, -1.0, -1.0), (0.0, 1.0, 0.0), (0.0, 0.0, -1.0), (1.0, 0.0, 0.0), (0.0, 0.0, 1.0)]}
    assert picks == {(1.0, -1.0, -1.0): "y", (0.0, 1.0, 0.0): "x", (0.0, 0.0, -1.0): "x",
                     (1.0, 0.0, 0.0): "y", (0.0, 0.0, 1.0): "y"}
    assert choose_victim(reqs, "importance", 10, est, (0.0, 0.0, 0.0)).rid == "z"  # tie: newest
    assert choose_victim(reqs, "lru", 10, est).rid == "y"
    assert choose_victim(reqs, "longest", 10, est).rid == "y"
    with pytest.raises(ValueError, match="unknown preemption policy"):
        choose_victim(reqs, "fifo", 10, est)


def test_output_length_estimator():
    est = OutputLengthEstimator()
    req = make_req("r", range(3), max_new=100)
    assert est.expected_remaining(req) == 100  # nothing observed: max_new_tokens
    for n in (4, 10, 20):
        est.observe(n)
    req.output_ids = [1] * 5
    assert est.expected_remaining(req) == pytest.approx(10.0)  # mean(10 - 5, 20 - 5)
    req.output_ids = [1] * 25
    assert est.expected_remaining(req) == 75  # no observation longer: the cap
    short = make_req("s", range(3), max_new=8)
    short.output_ids = [1] * 5
    assert est.expected_remaining(short) == 3  # capped by its own max_new_tokens


def test_request_that_cannot_fit_alone_is_reported_out_of_memory():
    p = make_planner(num_pages=4)  # 3 pages = 12 tokens
    a = make_req("a", range(10), max_new=100)
    p.add(a)
    run_step(p)
    outs = []
    for _ in range(6):
        d = p.plan()
        outs += d.out_of_memory
        for it in d.items:
            it.req.num_computed += it.num_tokens
            it.req.output_ids.append(1)
    assert outs == [a]
    assert a not in p.running
    a.pages and p.cache.release(a)
    p.cache.check_invariants([])


def test_waiting_request_that_never_fits_is_rejected():
    p = make_planner(num_pages=3)  # 8 tokens
    a = make_req("a", range(20))
    p.add(a)
    d = p.plan()
    assert d.out_of_memory == [a] and not d.items
    p.cache.check_invariants([])


@pytest.mark.parametrize("radix", [True, False])
def test_idle_accounting_after_many_requests(radix):
    p = make_planner(num_pages=20, radix=radix, max_running=3)
    reqs = [make_req(f"r{i}", list(range(i % 3, i % 3 + 9)), max_new=3) for i in range(9)]
    for r in reqs:
        p.add(r)
    for _ in range(60):
        run_step(p)
        for r in list(p.running):
            if len(r.output_ids) >= r.sampling.max_new_tokens:
                finish(p, r)
        if not p.running and not p.waiting:
            break
    assert not p.running and not p.waiting
    p.cache.check_invariants([])
    cached = p.cache.cached_pages
    assert p.cache.allocator.num_free + cached == 19
    if not radix:
        assert cached == 0


@pytest.mark.parametrize("order", [("d", "a", "b"), ("a", "d", "b"), ("b", "a", "d")])
def test_request_outgrowing_the_pool_does_not_starve_requests_that_fit(order):
    """d (16 + 50 tokens) cannot fit in 8 pages of 4 tokens even alone; a and b (12
    tokens each) fit. d is cut with out_of_memory once it is alone and full; its pages
    must be free for the admission that follows in the same plan, so a and b still get all
    their tokens (they were rejected as 'never fits' before the fix)."""
    p = make_planner(num_pages=9)
    jobs = {"a": (list(range(5)), 7), "b": (list(range(50, 55)), 7), "d": (list(range(100, 116)), 50)}
    reqs = {k: make_req(k, jobs[k][0], max_new=jobs[k][1]) for k in order}
    for k in order:
        p.add(reqs[k])
    oom, done = [], []
    for _ in range(300):
        decision = p.plan()
        for req in decision.out_of_memory:
            oom.append(req.rid)
            p.remove(req)
        for it in decision.items:
            req = it.req
            was_prefill, samples = req.in_prefill, it.samples
            req.num_computed += it.num_tokens
            if was_prefill and not req.in_prefill:
                p.cache.cache(req)
            if samples:
                req.output_ids.append(7)
                if len(req.output_ids) >= req.sampling.max_new_tokens:
                    done.append(req.rid)
                    p.remove(req)
        p.cache.check_invariants(p.live)
        if not p.running and not p.waiting:
            break
    assert oom == ["d"]
    assert sorted(done) == ["a", "b"]
    assert len(reqs["a"].output_ids) == len(reqs["b"].output_ids) == 7


def _drain(p: BatchPlanner, reqs: list[Req], steps: int = 100) -> list[tuple[str, int, int]]:
    """Run until ``reqs`` finish; returns every scheduled item."""
    items = []
    for _ in range(steps):
        items += run_step(p)
        for r in list(p.running):
            if r in reqs and len(r.output_ids) >= r.sampling.max_new_tokens:
                r.finish("length")
                finish(p, r)
        if all(r.finished for r in reqs):
            break
    return items


@pytest.mark.parametrize("radix", [False, True])
def test_swap_out_and_back_in_without_recompute(radix):
    """lru preempts c (idle); in swap mode its 7 computed tokens (2 pages) go to host
    memory; when it is re-admitted the pages the tree no longer holds are copied back
    and it resumes at position 7: no prompt token is fed again."""
    p, reqs = _running_trio("lru", radix=radix)  # with radix: c's full page survives in the tree
    p.preemption_mode, p.swap_capacity_tokens = "swap", 64
    c = reqs["c"]
    c.last_scheduled_step = p.step - 1
    c_pages = list(c.pages)
    decision = p.plan()
    assert decision.preempted == [c] and decision.swap_out == [(c, c_pages)]
    assert c.swap_tokens == 7 and p.swapped_tokens == 8 and p.num_swapped_out == 1
    p.cache.allocator.free(reqs["filler"].pages)
    reqs["filler"].pages = []
    items = _drain(p, [reqs["a"], reqs["b"], c])
    resumed = [it for it in items if it[0] == "c"]
    assert resumed[0] == ("c", 7, 1)  # the sampled token, nothing recomputed
    assert len(c.output_ids) == 4 and p.swapped_tokens == 0 and c.swap_tokens == 0
    p.cache.check_invariants([])


def test_swap_in_is_scheduled_with_exact_pages():
    p = make_planner(num_pages=13, radix=True, preemption_policy="lru", reserve_ratio_init=0.0,
                     preemption_mode="swap", swap_capacity_tokens=64)
    a = make_req("a", range(12), max_new=40)
    c = make_req("c", range(200, 206), max_new=40)  # 6 tokens: 1 full page + 2 tokens
    p.add(a)
    p.add(c)
    run_step(p)
    run_step(p)
    p._preempt(c, ScheduleDecision())  # preempt by hand: 7 tokens computed
    assert c.swap_tokens == 7 and p.cache.cached_pages >= 1  # full page kept in the tree
    decision = p.plan()  # c is re-admitted: the tree gives page 1, the tail is copied
    (swap,) = decision.swap_in
    assert swap.req is c and swap.first_page == 1 and swap.pages == c.pages[1:2]
    assert c.num_computed == 7 and ("c" in [it.req.rid for it in decision.items])
    assert [it.start for it in decision.items if it.req is c] == [7]


def test_auto_mode_asks_the_cost_model_and_respects_swap_space():
    asked = []
    p, reqs = _running_trio("lru")
    p.preemption_mode, p.swap_capacity_tokens = "auto", 64
    p.swap_is_cheaper = lambda n: asked.append(n) or False
    reqs["c"].last_scheduled_step = p.step - 1
    decision = p.plan()
    assert asked == [7] and decision.preempted == [reqs["c"]] and decision.swap_out == []
    p2, reqs2 = _running_trio("lru")
    p2.preemption_mode, p2.swap_capacity_tokens = "swap", 4  # 2 pages do not fit in 4 tokens
    reqs2["c"].last_scheduled_step = p2.step - 1
    assert p2.plan().swap_out == [] and reqs2["c"].swap_tokens == 0


def test_token_array_tracks_prompt_and_output():
    """Req.token_array: all_ids[:end] packed, extended as output tokens arrive."""
    req = make_req("a", [5, 6, 7])
    assert req.token_array(2).tolist() == [5, 6]
    req.output_ids += [8, 9]
    assert req.token_array(5).tolist() == [5, 6, 7, 8, 9]
    assert req.token_array(4).tolist() == req.all_ids[:4]
    req.output_ids.append(10)
    assert req.token_array(99).tolist() == req.all_ids


# ------------------------------------------------------------ schedule policies


def _warm(p: BatchPlanner, *prefixes: list[int]) -> None:
    """Cache each prefix in the tree (as a finished request would have left it)."""
    for prefix in prefixes:
        pages = p.cache.alloc(len(prefix) // PAGE)
        p.cache.tree.insert(prefix, pages)


SYS = list(range(1000, 1008))  # 2 cached pages


def _q(base: int, n: int = 5) -> list[int]:
    return list(range(base, base + n))


def _policy_queue(policy: str, **kw) -> tuple[BatchPlanner, dict[str, Req]]:
    """x1 matches nothing; g1a, g1b extend the cached SYS (8 tokens) with different
    questions; g2a..g2c share an uncached 8-token prefix P2 (3 waiting requests)."""
    p = make_planner(num_pages=64, max_running=8, schedule_policy=policy, **kw)
    _warm(p, SYS)
    p2 = list(range(2000, 2008))
    prompts = {"x1": _q(3000, 9), "g2a": p2 + _q(10), "g1a": SYS + _q(20), "g2b": p2 + _q(30),
               "g1b": SYS + _q(40), "g2c": p2 + _q(50)}
    reqs = {rid: make_req(rid, prompt) for rid, prompt in prompts.items()}
    for req in reqs.values():
        p.add(req)
    p.order.check_invariants(p.waiting)
    return p, reqs


def _order(p: BatchPlanner) -> list[str]:
    return [r.rid for r in p.order.candidates(p.waiting, p.running)]


@pytest.mark.parametrize(("policy", "expected"), [
    ("fcfs", ["x1", "g2a", "g1a", "g2b", "g1b", "g2c"]),
    ("lpm", ["g1a", "g1b", "x1", "g2a", "g2b", "g2c"]),  # 8 cached tokens first, then arrival
    ("dfs-weight", ["g2a", "g2b", "g2c", "g1a", "g1b", "x1"]),  # branch weights 3, 2, 1
])
def test_policy_admission_order(policy, expected):
    p, _ = _policy_queue(policy)
    assert _order(p) == expected


def test_dfs_weight_visits_deeper_branches_first():
    """Under SYS: branch Q (cached deeper, 2 waiting below it) before the single request
    hanging at SYS with an uncached question; the whole SYS branch (3) before P (1)."""
    p = make_planner(num_pages=64, schedule_policy="dfs-weight")
    q = SYS + _q(20, 4)
    _warm(p, SYS, q)
    reqs = [make_req("p", _q(500, 9)), make_req("s", SYS + _q(60)), make_req("q1", q + _q(70)),
            make_req("q2", q + _q(80))]
    for r in reqs:
        p.add(r)
    assert _order(p) == ["q1", "q2", "s", "p"]


def test_lpm_admission_defers_a_second_request_computing_the_same_page():
    """One plan admits g1a, g1b (distinct uncached pages under SYS), x1 and g2a but not
    g2b, g2c: they would compute P2 again. After g2a's prompt is cached they match it."""
    p, reqs = _policy_queue("lpm")
    assert [rid for rid, _, _ in run_step(p)] == ["g1a", "g1b", "x1", "g2a"]
    assert [r.rid for r in p.waiting] == ["g2b", "g2c"]
    assert run_step(p) == [("x1", 9, 1), ("g2a", 13, 1), ("g1a", 13, 1), ("g1b", 13, 1),
                           ("g2b", 8, 5), ("g2c", 8, 5)]
    assert reqs["g2b"].cached_tokens == reqs["g2c"].cached_tokens == 8
    p.order.check_invariants(p.waiting)


def test_match_lengths_follow_inserts_and_evictions():
    """The index is updated from the tree's listener: a request's match grows when its
    prefix is inserted and shrinks when it is evicted; the lpm order follows."""
    p = make_planner(num_pages=64, schedule_policy="lpm")
    a, b = make_req("a", _q(100, 9)), make_req("b", _q(200, 13))
    p.add(a)
    p.add(b)
    assert _order(p) == ["a", "b"]
    _warm(p, _q(200, 12))  # b's first 3 pages
    assert _order(p) == ["b", "a"]
    p.order.check_invariants(p.waiting)
    p.cache.tree.evict(3)
    assert _order(p) == ["a", "b"]
    p.order.check_invariants(p.waiting)


def test_starvation_guard_after_max_passes():
    """lpm keeps admitting cached-prefix requests ahead of x (no match); after 2 were
    admitted while x was the oldest, x goes first. One running slot: one admission per plan."""
    p = make_planner(num_pages=64, max_running=1, schedule_policy="lpm", schedule_max_passes=2)
    _warm(p, SYS)
    x = make_req("x", _q(3000, 9), max_new=1)
    p.add(x)
    admitted = []
    for i in range(4):
        p.add(make_req(f"s{i}", SYS + _q(100 * i + 10), max_new=1))
    for _ in range(4):
        items = run_step(p)
        admitted.append(items[0][0])
        for r in list(p.running):
            r.finish("length")
            finish(p, r)
    assert admitted == ["s0", "s1", "x", "s2"]
    assert p.order.num_promoted == 1


def test_starvation_guard_after_max_wait():
    now = [100.0]
    p = make_planner(num_pages=64, max_running=1, schedule_policy="lpm", schedule_max_wait_s=5.0,
                     clock=lambda: now[0])
    _warm(p, SYS)
    x = Req(rid="x", prompt_ids=_q(3000, 9), sampling=SamplingParams(max_new_tokens=1), arrival=98.0)
    s = Req(rid="s", prompt_ids=SYS + _q(10), sampling=SamplingParams(max_new_tokens=1), arrival=99.0)
    p.add(x)
    p.add(s)
    assert _order(p) == ["s", "x"]  # waited 2 s: lpm order
    now[0] = 103.0
    assert _order(p) == ["x", "s"]  # waited 5 s: the guard puts it first


@pytest.mark.parametrize("radix", [True, False])
def test_lof_admits_the_longest_output_first(radix):
    """lof: largest max_new_tokens first, ties by arrival, with or without the radix
    cache; a preempted request goes back in at its place."""
    p = make_planner(num_pages=64, radix=radix, max_running=2, schedule_policy="lof")
    reqs = [make_req(rid, _q(100 * i, 9), max_new=n) for i, (rid, n) in
            enumerate([("a", 4), ("b", 50), ("c", 9), ("d", 50), ("e", 1)])]
    for r in reqs:
        p.add(r)
    assert p.order.policy == "lof" and _order(p) == ["b", "d", "c", "a", "e"]
    assert [rid for rid, _, _ in run_step(p)] == ["b", "d"]  # two slots
    p.order.check_invariants(p.waiting)
    assert _order(p) == ["c", "a", "e"]
    b = reqs[1]
    p.running.remove(b)  # as a preemption does: KV released, back in the queue
    p.cache.release(b, keep_in_cache=True)
    p.add(b)
    p.order.check_invariants(p.waiting)
    assert _order(p) == ["b", "c", "a", "e"]
    finish(p, reqs[2])  # c aborted while waiting
    assert _order(p) == ["b", "a", "e"]
    p.order.check_invariants(p.waiting)


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof"])
def test_no_request_lost_under_pressure(policy):
    """Shared-prefix requests arriving shuffled into a small pool (evictions and
    preemptions): every request finishes exactly once and the index stays exact."""
    import random

    rng = random.Random(3)
    p = make_planner(num_pages=24, max_running=4, budget=32, chunk=16, schedule_policy=policy,
                     schedule_max_passes=6)
    systems = [list(range(5000 + 100 * g, 5000 + 100 * g + 12)) for g in range(4)]
    prompts = [systems[g] + _q(10_000 + 10 * i, rng.randrange(1, 9)) for i, g in
               enumerate(rng.choices(range(4), k=30))]
    reqs = [make_req(f"r{i}", prompt, max_new=rng.randrange(1, 6)) for i, prompt in enumerate(prompts)]
    for r in reqs[:20]:
        p.add(r)
    done: list[str] = []
    for step in range(600):
        if step == 5:
            for r in reqs[20:]:
                p.add(r)
        run_step(p)
        p.order.check_invariants(p.waiting)
        for r in list(p.running):
            if len(r.output_ids) >= r.sampling.max_new_tokens:
                r.finish("length")
                finish(p, r)
                done.append(r.rid)
        if not p.running and not p.waiting and step > 5:
            break
    assert sorted(done) == sorted(r.rid for r in reqs)
    assert p.cache.tree.protected_pages == 0


def test_unknown_schedule_policy_is_rejected():
    with pytest.raises(ValueError, match="schedule policy"):
        make_planner(num_pages=8, schedule_policy="sjf")


def test_without_radix_cache_every_policy_is_fcfs():
    p = make_planner(num_pages=32, radix=False, schedule_policy="lpm")
    a, b = make_req("a", _q(1, 9)), make_req("b", _q(50, 9))
    p.add(a)
    p.add(b)
    assert p.order.policy == "fcfs" and _order(p) == ["a", "b"]


# ------------------------------------------------------------ KV waste


def test_kv_waste_is_partial_pages_of_running_requests():
    """waste = page-table slots - computed tokens, summed over running requests; shared
    tree pages are full, so a shared prefix adds nothing."""
    p = make_planner(num_pages=32)
    a = make_req("a", range(10))
    p.add(a)
    run_step(p)  # a: 10 computed in 3 pages (12 slots)
    assert p.cache.waste_tokens(p.running) == 2
    b = make_req("b", list(range(8)) + [50, 51, 52])  # shares a's first 2 pages
    p.add(b)
    run_step(p)  # a decodes (11 computed, 12 slots); b: 8 cached + 3 computed in 3 pages
    assert (b.num_tree_pages, len(b.pages), b.num_computed) == (2, 3, 11)
    assert p.cache.waste_tokens([a]) == 1 and p.cache.waste_tokens([b]) == 1
    assert p.cache.waste_tokens(p.running) == 2
    run_step(p)  # a: 12 computed, page full; b: 12 computed
    assert p.cache.waste_tokens(p.running) == 0


# ------------------------------------------------------------ admission batching


def _admission_scenario(admit_batch: int, max_wait: int, max_news: list[int], waiting: int
                        ) -> tuple[BatchPlanner, list[list[tuple[str, int, int]]]]:
    """len(max_news) requests fill every slot and decode, ``waiting`` more queue behind them;
    requests finish at their max_new_tokens. Returns the planner and each step's items."""
    p = make_planner(num_pages=256, radix=False, max_running=len(max_news), admit_batch=admit_batch,
                     admit_max_wait_steps=max_wait)
    for i, n in enumerate(max_news):
        p.add(make_req(f"r{i}", _q(10 * i + 1, 4), max_new=n))
    for i in range(waiting):
        p.add(make_req(f"w{i}", _q(200 + 10 * i, 4), max_new=50))
    steps = []
    for _ in range(12):
        steps.append(run_step(p))
        for r in list(p.running):
            if len(r.output_ids) >= r.sampling.max_new_tokens:
                r.finish("length")
                finish(p, r)
    return p, steps


def _admitted(steps: list[list[tuple[str, int, int]]]) -> list[tuple[int, list[str]]]:
    """(step index, requests whose prompt starts there) for the queued requests."""
    return [(k, [rid for rid, start, _ in items if rid.startswith("w") and start == 0])
            for k, items in enumerate(steps)
            if any(rid.startswith("w") and start == 0 for rid, start, _ in items)]


def test_admission_waits_for_a_batch_of_free_slots():
    """4 slots, 4 queued: r0 finishes after step 2 (its 3rd token), r1 after step 4. With a
    batch of 2 the freed slot of r0 waits for r1's, and both queued requests are prefilled
    in one step; without batching each is admitted in the step after its slot frees."""
    _, steps = _admission_scenario(2, 32, [3, 5, 40, 40], waiting=4)
    assert _admitted(steps) == [(5, ["w0", "w1"])]
    assert [[rid for rid, _, _ in items] for items in steps[3:5]] == [["r1", "r2", "r3"]] * 2  # held
    _, steps = _admission_scenario(1, 32, [3, 5, 40, 40], waiting=4)
    assert _admitted(steps) == [(3, ["w0"]), (5, ["w1"])]


def test_admission_is_held_at_most_max_wait_steps():
    """Only r0 finishes: its slot is filled after 2 held plans (steps 3 and 4)."""
    p, steps = _admission_scenario(2, 2, [3, 40, 40, 40], waiting=4)
    assert _admitted(steps) == [(5, ["w0"])]
    assert len(p.running) == 4 and [r.rid for r in p.waiting] == ["w1", "w2", "w3"]


def test_a_queue_no_longer_than_the_free_slots_is_admitted_at_once():
    """One queued request and a free slot: no batching delay (an unsaturated server)."""
    _, steps = _admission_scenario(4, 32, [3, 40, 40, 40], waiting=1)
    assert _admitted(steps) == [(3, ["w0"])]


def test_admission_is_open_when_the_step_prefills_anyway():
    """A running request still in chunked prefill makes the step eager: the queued request
    joins it at once although only one slot (< the batch of 2) is free."""
    p = make_planner(num_pages=256, radix=False, budget=64, chunk=8, max_running=4, admit_batch=2)
    a, b = make_req("a", _q(1, 4), max_new=40), make_req("b", _q(20, 4), max_new=40)
    p.add(a)
    p.add(b)
    run_step(p)
    long = make_req("long", list(range(100, 140)), max_new=4)  # 40 tokens: 5 chunks of 8
    p.add(long)
    assert ("long", 0, 8) in run_step(p)
    p.add(make_req("c", _q(60, 4)))
    p.add(make_req("d", _q(80, 4)))
    items = run_step(p)  # long is in prefill; one slot is free, 2 wait
    assert ("long", 8, 8) in items and ("c", 0, 4) in items and ("d", 0, 4) not in items
    p.add(make_req("e", _q(120, 4)))
    for _ in range(3):  # long's prefill: c's slot was the last, nothing more is admitted
        run_step(p)
    assert [r.rid for r in p.waiting] == ["d", "e"]


def test_admission_batch_arguments_are_checked():
    with pytest.raises(ValueError, match="admit_batch"):
        make_planner(num_pages=8, admit_batch=0)


def test_a_pure_decode_plan_becomes_a_window_with_its_pages_grown():
    """decode_window 4: with nothing waiting, a plan whose items all decode (requests
    allowed windows) is a window of 4 steps and each request's pages cover the 4
    positions; the context length caps it (at 2 positions or more left; fewer: one step);
    a prefill item, a waiting request, a request not allowed windows, or too few pages
    keep the plan one step."""
    p = make_planner(num_pages=40, decode_window=4, context_length=40)
    a, b = make_req("a", list(range(1, 7)), max_new=30), make_req("b", list(range(11, 14)), max_new=30)
    for r in (a, b):
        r.multi_step = True
        p.add(r)
    d = p.plan()  # prefill both: one step
    assert d.decode_steps == 1 and [it.num_tokens for it in d.items] == [6, 3]
    for it in d.items:
        it.req.num_computed += it.num_tokens
        it.req.output_ids.append(7)
    d = p.plan()  # both decode: a window, pages for positions start .. start + 3
    assert d.decode_steps == 4 and [(it.req.rid, it.start, it.num_tokens) for it in d.items] == [("a", 6, 1), ("b", 3, 1)]
    assert len(a.pages) * PAGE >= 6 + 4 and len(b.pages) * PAGE >= 3 + 4
    assert (len(a.pages), len(b.pages)) == (3, 2)
    c = make_req("c", [50, 51])
    p.add(c)  # a waiting request: one step (it is admitted now, a prefill item)
    d = p.plan()
    assert d.decode_steps == 1 and "c" in [it.req.rid for it in d.items]
    p.remove(c)
    a.output_ids += [7] * 30  # a at 37 of 40 positions: 3 left caps the window
    a.num_computed = len(a.prompt_ids) + len(a.output_ids) - 1
    d = p.plan()
    assert d.decode_steps == 3
    a.output_ids.append(7)
    a.num_computed += 1  # 38 of 40: 2 left
    assert p.plan().decode_steps == 2
    a.output_ids.append(7)
    a.num_computed += 1  # 39: 1 left, one step
    assert p.plan().decode_steps == 1
    a.multi_step = False
    a.output_ids[-3:] = []
    a.num_computed -= 3
    assert p.plan().decode_steps == 1  # a request not allowed windows


def test_a_window_without_the_pages_for_it_stays_one_step():
    p = make_planner(num_pages=3, decode_window=8)  # 2 usable pages of 4 tokens
    a = make_req("a", [1, 2, 3, 4, 5], max_new=30)
    a.multi_step = True
    p.add(a)
    run_step(p)
    d = p.plan()  # decoding at position 5 needs 5 + 8 = 13 positions: 4 pages
    assert d.decode_steps == 1 and len(a.pages) == 2
