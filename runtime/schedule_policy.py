"""Batch planning: which requests advance in the next forward pass, by how many tokens.

One rule covers prefill, chunked prefill, prefix hits and decode (token-budget
scheduling): every request advances its computed-token count toward ``seq_len``, under a
per-step budget of ``max_prefill_tokens`` tokens and ``chunked_prefill_size`` tokens per
request. Running requests go first (oldest first; a decoding request needs 1 token),
then waiting requests are admitted first-come-first-served while budget, request slots
and pages last.

Out of pages: unlocked radix leaves are evicted first (inside PrefixCache.alloc); if that
is not enough the newest running request is preempted (its KV is kept in the radix tree
as far as it is page-aligned, the rest freed) and goes back to the waiting queue in its
arrival order, to be recomputed later. A request that cannot grow even when it runs
alone is finished with reason "length" (the KV pool is full).

The planner mutates only page tables and queue membership; it returns a
ScheduleDecision that the model runner executes, so it is testable without a model.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from radixlm.runtime.prefix_cache import PrefixCache
from radixlm.runtime.request import Req

__all__ = ["ScheduleItem", "ScheduleDecision", "BatchPlanner"]


@dataclass
class ScheduleItem:
    """Feed ``req.all_ids[start : start + num_tokens]`` (start = req.num_computed)."""

    req: Req
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True if this pass reaches the end of the sequence, so a token is sampled."""
        return self.start + self.num_tokens == self.req.seq_len


@dataclass
class ScheduleDecision:
    items: list[ScheduleItem] = field(default_factory=list)
    preempted: list[Req] = field(default_factory=list)
    out_of_memory: list[Req] = field(default_factory=list)  # finished: pool too small

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)


class BatchPlanner:
    def __init__(
        self,
        cache: PrefixCache,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        max_running_requests: int,
        enable_prefix_reuse: bool = True,
    ) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests
        self.enable_prefix_reuse = enable_prefix_reuse
        self.waiting: list[Req] = []  # sorted by arrival
        self.running: list[Req] = []  # sorted by arrival
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queues
    def add(self, req: Req) -> None:
        keys = [r.arrival for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, req.arrival), req)

    def remove(self, req: Req) -> None:
        """Take a request out of the queues (abort / finish); its KV is released."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.pages or req.tree_node is not None:
            self.cache.release(req)

    @property
    def live(self) -> list[Req]:
        return self.running + [r for r in self.waiting if r.pages]

    # ----------------------------------------------------------------- planning
    def plan(self) -> ScheduleDecision:
        decision = ScheduleDecision()
        budget = self._schedule_running(decision, self.max_prefill_tokens)
        self._admit_waiting(decision, budget)
        return decision

    def _chunk(self, req: Req, budget: int) -> int:
        return min(req.num_uncomputed, self.chunked_prefill_size, budget)

    def _schedule_running(self, decision: ScheduleDecision, budget: int) -> int:
        for req in list(self.running):
            if req not in self.running:  # preempted while making room for an older one
                continue
            n = self._chunk(req, budget)
            if n == 0:
                continue
            if not self._grow_or_preempt(req, req.num_computed + n, decision):
                continue
            decision.items.append(ScheduleItem(req, req.num_computed, n))
            budget -= n
        return budget

    def _grow_or_preempt(self, req: Req, num_tokens: int, decision: ScheduleDecision) -> bool:
        while not self.cache.grow(req, num_tokens):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                self.running.remove(req)
                self.cache.release(req)  # now: admission later in this plan needs the pages
                decision.out_of_memory.append(req)
                return False
            self._preempt(victim, decision)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Req, decision: ScheduleDecision) -> None:
        self.running.remove(req)
        for i, item in enumerate(decision.items):
            if item.req is req:
                del decision.items[i]
                break
        self.cache.release(req, keep_in_cache=True)
        self.num_preemptions += 1
        decision.preempted.append(req)
        self.add(req)

    def _admit_waiting(self, decision: ScheduleDecision, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            verdict = self._admit(req)
            if verdict == "reject":
                self.waiting.pop(0)
                decision.out_of_memory.append(req)
                continue
            if verdict == "wait":
                break
            n = self._chunk(req, budget)
            if not self.cache.grow(req, req.num_computed + n):
                self.cache.release(req, keep_in_cache=False)
                break
            self.waiting.pop(0)
            self.running.append(req)
            self.running.sort(key=lambda r: r.arrival)
            decision.items.append(ScheduleItem(req, req.num_computed, n))
            budget -= n

    def _admit(self, req: Req) -> str:
        """Match the prefix and decide: "admit" if the pool can hold the request's whole
        remaining sequence plus one page per running request, "wait" if it must wait for
        running requests to free pages, "reject" if it can never fit."""
        reused = 0
        if self.enable_prefix_reuse:
            reused = self.cache.match_and_lock(req, self._match_limit(req))
        if not req.admitted:
            req.cached_tokens = reused
            req.admitted = True
        need = -(-req.seq_len // self.page_size) - len(req.pages)
        if need + len(self.running) <= self.cache.available_pages:
            return "admit"
        self.cache.release(req, keep_in_cache=False)
        return "wait" if self.running else "reject"

    def _match_limit(self, req: Req) -> int:
        """Tokens that may come from the cache: never the last one (its logits are
        needed), and none whose prompt logprob was asked for."""
        limit = req.seq_len - 1
        if req.wants_prompt_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit
