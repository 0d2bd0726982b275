"""Random request lifecycles on PrefixCache (radix tree + page allocator) against a model.

Operations, as the planner and scheduler use them: admit a request (``match_and_lock``),
grow it and advance its computed tokens (``grow``, evicting when short), decode a token,
insert its computed pages (``cache``), release it with or without caching (finish /
abort), re-admit a released one (resume after preemption), take and give back raw pages
(``alloc`` / ``release`` of a page holder), and flush.

Model: ``cached`` maps every cached page-aligned token prefix to the page holding its last
page (as in tests/radix/test_radix_stateful.py). A match must return the model's longest
cached prefix; an insert adds the missing prefixes with the request's pages and keeps the
tree's pages for the others; an allocation succeeds exactly when free + evictable pages
suffice; evicted prefixes are dropped from the model and were never locked. After every
step: free + cached + owned == capacity, no page both free and referenced
(``PrefixCache.check_invariants``), the tree holds exactly the model's pages, every live
request's shared pages are the model's pages for its prefix, and the tree's locked pages
are exactly the prefixes locked by live requests. KV events (runtime/kv_events.py): the
blocks a consumer holds after applying every event recorded so far are exactly the cached
prefixes (each prefix's block hash), and each stored block's tokens hash to its hash.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm.radix import EVICTION_POLICIES, RadixTree
from radixlm.runtime.kv_events import (
    BlockStored,
    EventBatch,
    KVBlockIndex,
    KVEventRecorder,
    block_hashes,
    page_hash,
)
from radixlm.runtime.memory.page_allocator import PageAllocator
from radixlm.runtime.messages import SamplingParams
from radixlm.runtime.scheduler.prefix_cache import PrefixCache
from radixlm.runtime.scheduler.request import Req

Key = tuple[int, ...]
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=12)
MAX_LIVE = 4  # more live requests only fill the pool with their own pages


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: PrefixCache | None = None
        self.cached: dict[Key, int] = {}
        self.live: list[Req] = []  # requests holding KV
        self.released: list[Req] = []  # finished / preempted requests, re-admittable
        self.holders: list[Req] = []  # raw pages taken with PrefixCache.alloc
        self.rids = itertools.count()

    @initialize(
        page_size=st.sampled_from([1, 2, 3]),
        num_pages=st.integers(4, 12),
        policy=st.sampled_from(sorted(EVICTION_POLICIES)),
        radix=st.sampled_from([True, True, True, False]),  # no tree: the simple path
    )
    def make_cache(self, page_size: int, num_pages: int, policy: str, radix: bool) -> None:
        ticks = itertools.count()
        tree = RadixTree(page_size, policy, clock=lambda: float(next(ticks))) if radix else None
        self.size = page_size
        self.cache = PrefixCache(PageAllocator(num_pages), tree, page_size)
        if radix:
            self.cache.events = KVEventRecorder(page_size)
        self.index = KVBlockIndex()

    # ------------------------------------------------------------- model helpers

    @property
    def tree(self) -> RadixTree | None:
        return self.cache.tree

    def prefixes(self, tokens: list[int]) -> list[Key]:
        aligned = len(tokens) // self.size * self.size
        return [tuple(tokens[:end]) for end in range(self.size, aligned + 1, self.size)]

    def expected_match(self, tokens: list[int]) -> list[int]:
        pages = []
        for prefix in self.prefixes(tokens):
            if prefix not in self.cached:
                break
            pages.append(self.cached[prefix])
        return pages

    def locked_prefixes(self) -> set[Key]:
        return {p for r in self.live if r.tree_node is not None
                for p in self.prefixes(r.all_ids[: r.num_tree_pages * self.size])}

    def owned_pages(self) -> set[int]:
        return {p for r in self.live + self.holders for p in r.pages[r.num_tree_pages :]}

    def new_req(self, prompt: list[int]) -> Req:
        return Req(rid=f"r{next(self.rids)}", prompt_ids=list(prompt),
                   sampling=SamplingParams(max_new_tokens=8))

    def checked_alloc(self, n: int, take) -> bool:
        """Run ``take`` (which allocates ``n`` pages through the cache) and check the
        outcome and any eviction against the model."""
        free, available = self.cache.allocator.num_free, self.cache.available_pages
        before = self.tree.all_pages() if self.tree is not None else set()
        locked = {self.cached[p] for p in self.locked_prefixes()}
        ok = take()
        assert ok == (n <= available), f"alloc {n} with {available} available returned {ok}"
        evicted = before - (self.tree.all_pages() if self.tree is not None else set())
        assert not evicted & locked, f"evicted locked pages {evicted & locked}"
        if n <= free:
            assert not evicted, f"evicted {evicted} with {free} free pages for {n}"
        elif ok:
            assert len(evicted) >= n - free
        self.cached = {k: p for k, p in self.cached.items() if p not in evicted}
        return ok

    def model_insert(self, req: Req) -> int:
        """What ``cache(req)`` must do to the model; returns the pages it must cover."""
        num_pages = min(req.num_computed // self.size, len(req.pages))
        if self.tree is None or num_pages <= req.num_tree_pages:
            return req.num_tree_pages
        for prefix, page in zip(self.prefixes(req.all_ids[: num_pages * self.size]),
                                req.pages, strict=False):
            self.cached.setdefault(prefix, page)
        return num_pages

    def check_cached_req(self, req: Req, num_pages: int) -> None:
        key = req.all_ids[: num_pages * self.size]
        assert req.num_tree_pages == num_pages
        assert req.pages[:num_pages] == [self.cached[p] for p in self.prefixes(key)]

    # --------------------------------------------------------------------- rules

    def admit(self, req: Req, max_tokens: int) -> None:
        expected = self.expected_match(req.all_ids[:max_tokens]) if self.tree is not None else []
        reused = self.cache.match_and_lock(req, max_tokens)
        assert reused == len(expected) * self.size
        assert req.pages == expected and req.num_tree_pages == len(expected)
        assert req.num_computed == reused and (req.tree_node is not None) == bool(expected)
        self.live.append(req)

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(prompt=prompts, data=st.data())
    def admit_new(self, prompt: list[int], data: st.DataObject) -> None:
        self.admit_prompt(data, prompt)

    @precondition(lambda self: (self.live or self.released) and len(self.live) < MAX_LIVE)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=6))
    def admit_like_another(self, data: st.DataObject, suffix: list[int]) -> None:
        """A request that starts like another one, cached or still computing (C02)."""
        other = data.draw(st.sampled_from(self.live + self.released)).all_ids
        self.admit_prompt(data, other[: data.draw(st.integers(1, len(other)))] + suffix)

    @precondition(lambda self: self.cached and len(self.live) < MAX_LIVE)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=6))
    def admit_after_cached_prefix(self, data: st.DataObject, suffix: list[int]) -> None:
        """A follow-up turn: a cached prefix plus new tokens."""
        self.admit_prompt(data, list(data.draw(st.sampled_from(sorted(self.cached)))) + suffix)

    def admit_prompt(self, data: st.DataObject, prompt: list[int]) -> None:
        limit = st.one_of(st.just(len(prompt) - 1), st.integers(0, len(prompt)))  # planner: n - 1
        self.admit(self.new_req(prompt), data.draw(limit))

    @precondition(lambda self: self.released and len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def readmit_released(self, data: st.DataObject) -> None:
        req = self.released.pop(data.draw(st.integers(0, len(self.released) - 1)))
        self.admit(req, req.seq_len - 1)  # resume: the last token is always recomputed

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.integers(1, 8))
    def advance(self, data: st.DataObject, tokens: int) -> None:
        req = data.draw(st.sampled_from(self.live))
        self.compute_up_to(req, min(req.seq_len, req.num_computed + tokens))

    def compute_up_to(self, req: Req, target: int) -> bool:
        """``grow`` the request to ``target`` tokens and, if it got the pages, mark them
        computed (the forward pass)."""
        need = max(0, -(-target // self.size) - len(req.pages))
        held = list(req.pages)
        if not self.checked_alloc(need, lambda: self.cache.grow(req, target)):
            assert req.pages == held
            return False
        assert req.pages[: len(held)] == held and len(req.pages) * self.size >= target
        req.num_computed = target
        return True

    @precondition(lambda self: any(r.num_computed == r.seq_len for r in self.live))
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = data.draw(st.sampled_from([r for r in self.live if r.num_computed == r.seq_len]))
        req.output_ids.append(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def prefill_then_cache(self, data: st.DataObject) -> None:
        """What the scheduler does once a prompt is computed: pages for every token, then
        insert the full pages so later requests share them while this one decodes."""
        req = data.draw(st.sampled_from(self.live))
        if self.compute_up_to(req, req.seq_len):
            self.insert(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_computed(self, data: st.DataObject) -> None:
        self.insert(data.draw(st.sampled_from(self.live)))

    def insert(self, req: Req) -> None:
        num_pages = self.model_insert(req)
        self.cache.cache(req)
        self.check_cached_req(req, num_pages)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep=st.booleans())
    def release(self, data: st.DataObject, keep: bool) -> None:
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        if keep:
            self.model_insert(req)
        self.cache.release(req, keep_in_cache=keep)
        assert req.pages == [] and req.tree_node is None
        assert req.num_tree_pages == 0 and req.num_computed == 0
        self.released.append(req)

    @precondition(lambda self: not self.holders)
    @rule(n=st.integers(0, 6))
    def take_pages(self, n: int) -> None:
        holder = self.new_req([0])

        def take() -> bool:
            holder.pages = self.cache.alloc(n) or []
            return len(holder.pages) == n

        if self.checked_alloc(n, take):
            self.holders.append(holder)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def give_pages_back(self, data: st.DataObject) -> None:
        holder = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        pages = holder.pages
        self.cache.release(holder, keep_in_cache=False)
        assert set(pages) <= self.cache.allocator.free_pages()

    @precondition(lambda self: len(self.cached) >= 2 and len(self.live) <= 2)  # now and then
    @rule()
    def flush(self) -> None:
        expect = self.tree is None or not any(r.tree_node is not None for r in self.live)
        assert self.cache.flush() == expect
        if expect:
            self.cached.clear()

    # ---------------------------------------------------------------- invariants

    @invariant()
    def cache_matches_model(self) -> None:
        if self.cache is None:
            return
        self.cache.check_invariants(self.live + self.holders)
        alloc = self.cache.allocator
        owned = self.owned_pages()
        assert alloc.num_free + len(self.cached) + len(owned) == alloc.capacity
        if self.tree is None:
            assert all(r.num_tree_pages == 0 and r.tree_node is None for r in self.live)
            return
        assert self.tree.all_pages() == set(self.cached.values())
        assert all(k[: -self.size] in self.cached for k in self.cached if len(k) > self.size)
        for req in self.live:
            self.check_cached_req(req, req.num_tree_pages)
        locked = self.locked_prefixes()
        assert locked <= set(self.cached), "a locked prefix was evicted"
        assert self.tree.protected_pages == len(locked), "locks unbalanced"
        self.events_match_model()

    def events_match_model(self) -> None:
        events = self.cache.events.take()
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == self.size * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    parent = page_hash(parent, event.token_ids[i * self.size : (i + 1) * self.size])
                    assert parent == h
        self.index.apply("server", EventBatch(ts=0.0, events=events))
        expected = {block_hashes(list(k), self.size)[-1] for k in self.cached}
        assert self.cache.events.held_hashes() == expected
        assert self.index.held("server") == expected
        for key in self.cached:  # a consumer's match of a cached prefix covers it whole
            assert self.index.match(block_hashes(list(key), self.size)) == {"server": len(key) // self.size}


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_prefix_cache_against_model = PrefixCacheMachine.TestCase
