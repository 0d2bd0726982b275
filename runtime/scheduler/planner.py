"""Batch planning: which requests advance in the next forward pass, by how many tokens.

One rule covers prefill, chunked prefill, prefix hits and decode (token-budget
scheduling): every request advances its computed-token count toward ``seq_len``, under a
per-step budget of ``max_prefill_tokens`` tokens and ``chunked_prefill_size`` tokens per
request. Running requests go first (oldest first; a decoding request needs 1 token, which
the budget never cuts: decode tokens count against it, so the budget bounds the tokens a
step adds on top of its decodes), then waiting requests are admitted in the order of the
schedule policy (runtime/scheduler/waiting_order.py: ``fcfs``, ``lpm``, ``dfs-weight``, ``lof``, with
a starvation guard) while budget, request slots and pages last; admission stops at the
first request that must wait for pages.

A budget below the running batch (``max_prefill_tokens`` < ``max_running_requests``)
paces admission: prompt tokens enter a step only while its decodes leave room, so the
work of a large offline batch spreads over the steps that its longest reply needs anyway
(with ``lof``, the longest replies start first) instead of a few huge prefill steps
followed by a long tail of small decode steps. Measured on the 8B 1000-prompt run
(BENCHMARKS.md "Pacing admission") it is still slower than the default plan (26.1-31.1 s
against 22.6 s): a mixed step costs more than its tokens cost the device (host launch and
device waits).

Out of pages: unlocked radix leaves are evicted first (inside PrefixCache.alloc); if that
is not enough a running request chosen by the preemption policy (runtime/scheduler/preemption.py:
``lru``, ``longest``, ``importance``) is preempted (its KV is kept in the radix tree as
far as it is page-aligned, the rest freed) and goes back to the waiting queue in its
arrival order, to be recomputed later. A request that cannot grow even when it runs
alone is finished with reason "length" (the KV pool is full).

Admission batching (``admit_batch`` k > 1, the server's default with CUDA graphs): a step
whose items all decode one token replays a CUDA graph, but one that also prefills a new
request runs eagerly, and an eager pass of a large model costs the host tens of ms of
kernel launches whatever its size. When the queue is deeper than the free request slots,
admitting the one request that each finish lets in would make nearly every step eager.
So while the step would be a pure decode step and fewer than ``min(k, waiting)`` slots are
free, admission is held, for at most ``admit_max_wait_steps`` plans; then the freed slots
are filled in one eager step. A short queue (no more requests waiting than slots free) is
admitted at once, so an unsaturated server adds no queueing delay. (Text Generation
Inference holds new requests back the same way: ``waiting_served_ratio``,
``max_waiting_tokens``.)

Admission reserves pages for the decode still ahead of the running requests and of the
candidate: ``reserve_ratio * expected remaining tokens`` each (OutputLengthEstimator),
at least one page per running request. The ratio starts at ``reserve_ratio_init``,
decays linearly to ``reserve_ratio_min`` over ``reserve_decay_steps`` plans without a
preemption, and jumps back to the initial value on a preemption (the adaptive
"new token ratio" of SGLang), so preemptions stay rare without a lasting throughput cliff.

Multi-step decoding (``decode_window`` n > 1, ``--num-scheduler-steps``; vLLM's multi-step
scheduling): a plan whose items all decode one token, every request allowed windows
(``Req.multi_step``) and n positions short of the context length, and nothing waiting,
becomes a window of up to n decode steps (``ScheduleDecision.decode_steps``): each
request's pages are grown for the n positions now, the model runner launches the n steps
back to back, the scheduler reads the n tokens at once. A request that stops inside the
window (a stop token or string, max_new_tokens) drops the tokens after its stop (and,
with overlap scheduling, the next window's, launched before the stop was read). Nothing
waiting: a window never holds back a request the plan could admit (one that arrives
during it waits for its end).

The planner mutates only page tables and queue membership; it returns a
ScheduleDecision that the model runner executes, so it is testable without a model.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable
from operator import attrgetter

from radixlm.runtime.scheduler.decision import ScheduleDecision, ScheduleItem, SwapIn
from radixlm.runtime.scheduler.preemption import OutputLengthEstimator, choose_victim
from radixlm.runtime.scheduler.prefix_cache import PrefixCache
from radixlm.runtime.scheduler.request import Req
from radixlm.runtime.scheduler.waiting_order import WaitingOrder

__all__ = ["PREEMPTION_MODES", "BatchPlanner"]

PREEMPTION_MODES = ("recompute", "swap", "auto")


class BatchPlanner:
    def __init__(
        self,
        cache: PrefixCache,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        max_running_requests: int,
        enable_prefix_reuse: bool = True,
        preemption_policy: str = "lru",
        importance_weights: tuple[float, float, float] = (1.0, -1.0, -1.0),
        reserve_ratio_init: float = 1.0,
        reserve_ratio_min: float = 0.25,
        reserve_decay_steps: int = 500,
        preemption_mode: str = "recompute",
        swap_capacity_tokens: int = 0,
        swap_is_cheaper: Callable[[int], bool] | None = None,
        context_length: int | None = None,
        schedule_policy: str = "fcfs",
        schedule_max_wait_s: float = float("inf"),
        schedule_max_passes: int = 1 << 62,
        admit_batch: int = 1,
        admit_max_wait_steps: int = 32,
        decode_window: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests
        self.context_length = context_length
        self.enable_prefix_reuse = enable_prefix_reuse
        self.waiting: list[Req] = []  # sorted by arrival
        self.running: list[Req] = []  # sorted by arrival
        self.num_preemptions = 0
        self.preemption_policy = preemption_policy
        self.importance_weights = importance_weights
        self.estimator = OutputLengthEstimator()
        self.reserve_ratio_init = reserve_ratio_init
        self.reserve_ratio_min = min(reserve_ratio_min, reserve_ratio_init)
        self._reserve_decay = (reserve_ratio_init - self.reserve_ratio_min) / max(reserve_decay_steps, 1)
        self.reserve_ratio = reserve_ratio_init
        self.step = 0  # plans made so far
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption mode {preemption_mode!r}; choose from {PREEMPTION_MODES}")
        self.preemption_mode = preemption_mode
        self.swap_capacity_tokens = swap_capacity_tokens
        self.swap_is_cheaper = swap_is_cheaper
        self.swapped_tokens = 0  # host tokens held by swapped-out requests (page-rounded)
        self.num_swapped_out = 0
        self._running_reserve: int | None = None  # see _decode_reserve
        if admit_batch < 1 or admit_max_wait_steps < 0:
            raise ValueError(f"need admit_batch >= 1 and admit_max_wait_steps >= 0, got "
                             f"{admit_batch}, {admit_max_wait_steps}")
        self.admit_batch = admit_batch
        if decode_window < 1:
            raise ValueError(f"need decode_window >= 1, got {decode_window}")
        self.decode_window = decode_window
        self.admit_max_wait_steps = admit_max_wait_steps
        self._held_since: int | None = None  # plan step since which admission has been held
        tree = cache.tree if enable_prefix_reuse else None
        self.order = WaitingOrder(schedule_policy, tree, self._match_limit, schedule_max_wait_s,
                                  schedule_max_passes, clock)

    # ----------------------------------------------------------------- queues
    def add(self, req: Req) -> None:
        bisect.insort_right(self.waiting, req, key=_arrival)
        self.order.add(req)
        if self.enable_prefix_reuse and self.cache.prefetches:
            self.cache.start_prefetch(req, self._match_limit(req))  # disk / peer pages come while it waits

    def _take_waiting(self, req: Req) -> bool:
        """Remove ``req`` from ``waiting`` if it is there (a binary search on arrival)."""
        i = bisect.bisect_left(self.waiting, req.arrival, key=_arrival)
        while i < len(self.waiting) and self.waiting[i].arrival == req.arrival:
            if self.waiting[i] is req:
                del self.waiting[i]
                self.order.remove(req)
                return True
            i += 1
        return False

    def remove(self, req: Req) -> None:
        """Take a request out of the queues (abort / finish); its KV is released. A
        normal finish (stop or length, no error) feeds the output-length estimator."""
        if req.finish_reason in ("stop", "length") and req.error is None:
            self.estimator.observe(len(req.output_ids))
        self._take_waiting(req)
        if req in self.running:
            self.running.remove(req)
        if req.pages or req.tree_node is not None:
            self.cache.release(req)
        self._drop_swap(req)
        self.cache.cancel_prefetch(req)

    def _drop_swap(self, req: Req) -> None:
        if req.swap_tokens:
            self.swapped_tokens -= self._pages(req.swap_tokens) * self.page_size
            req.swap_tokens, req.swap_handle = 0, None

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def live(self) -> list[Req]:
        return self.running + [r for r in self.waiting if r.pages]

    # ----------------------------------------------------------------- planning
    def plan(self) -> ScheduleDecision:
        self.step += 1
        self.reserve_ratio = max(self.reserve_ratio_min, self.reserve_ratio - self._reserve_decay)
        decision = ScheduleDecision()
        budget = self._schedule_running(decision, self.max_prefill_tokens)
        if self._admission_open(decision):
            self._admit_waiting(decision, budget)
        if self.decode_window > 1 and decision.items and not self.waiting:
            self._widen(decision)
        return decision

    def _widen(self, decision: ScheduleDecision) -> None:
        """Make a pure decode plan a window of up to ``decode_window`` steps (module
        docstring), if every item's request may take one (``Req.multi_step``) and at least 2
        positions are left before the context length, with each request's pages grown to
        cover the window. The window is no longer than the most tokens any request may
        still take (max_new_tokens); a request with fewer left than the window computes a
        few it drops: capping the window at the fewest would make a large batch, where some
        request nearly always ends soon, step one at a time. Grows without
        preempting anyone (cached leaves may be evicted): where pages run short the plan
        stays one step (the pages grown so far serve the next steps)."""
        if decision.preempted or decision.out_of_memory or decision.swap_out or decision.swap_in:
            return
        n, context, wanted = self.decode_window, self.context_length, 0
        for it in decision.items:
            req = it.req
            if it.num_tokens != 1 or not it.samples or not req.multi_step:
                return
            seq_len = len(req.prompt_ids) + len(req.output_ids) + req.num_inflight
            if context is not None and context - seq_len < n:
                if context - seq_len < 2:
                    return
                n = context - seq_len
            left = req.sampling.max_new_tokens - (seq_len - len(req.prompt_ids))
            if left > wanted:
                wanted = left
        n = min(n, wanted)  # no step that every request would drop
        if n < 2:
            return
        grow, page_size = self.cache.grow, self.page_size
        for it in decision.items:
            if len(it.req.pages) * page_size < it.start + n and not grow(it.req, it.start + n):
                return
        decision.decode_steps = n

    def _admission_open(self, decision: ScheduleDecision) -> bool:
        """False while admission batching holds the waiting requests back (module
        docstring): the step so far only decodes, the queue is deeper than the free
        request slots and fewer than ``admit_batch`` are free, for fewer than
        ``admit_max_wait_steps`` plans in a row."""
        free = self.max_running_requests - len(self.running)
        if (self.admit_batch == 1 or free <= 0 or free >= min(self.admit_batch, len(self.waiting))
                or not decision.items or any(it.num_tokens != 1 for it in decision.items)):
            self._held_since = None  # nothing to hold (or no slot to fill): open
            return True
        if self._held_since is None:
            self._held_since = self.step
        if self.step - self._held_since < self.admit_max_wait_steps:
            return False
        self._held_since = None
        return True

    def _schedule(self, decision: ScheduleDecision, req: Req, n: int) -> None:
        start = req.num_computed
        decision.items.append(ScheduleItem(req, start, n, start + n == req.seq_len))
        req.last_scheduled_step = self.step

    def _chunk(self, req: Req, budget: int) -> int:
        return min(req.num_uncomputed, self.chunked_prefill_size, budget)

    def _schedule_running(self, decision: ScheduleDecision, budget: int) -> int:
        """Schedule every running request's next chunk (one token while decoding), oldest
        first, growing pages or preempting for it; returns the token budget left (negative
        when the decode tokens alone pass it: they are never cut, chunks are). A request
        whose token in flight is sure to be its last (max_new_tokens or the context length
        reached) gets no step past it. Runs once per step over the whole batch: the hot loop
        of the planner, so it reads each request's fields once (``_chunk`` / ``_schedule``
        in one)."""
        items, preempted, step, context = decision.items, decision.preempted, self.step, self.context_length
        page_size, chunk = self.page_size, self.chunked_prefill_size
        for req in list(self.running):
            if preempted and req in preempted:  # made room for an older one
                continue
            num_out, inflight, start = len(req.output_ids), req.num_inflight, req.num_computed
            seq_len = len(req.prompt_ids) + num_out + inflight
            if inflight and (num_out + inflight >= req.sampling.max_new_tokens
                             or (context is not None and seq_len >= context)):
                continue
            n = seq_len - start  # min(seq_len - start, chunk, budget), without the call
            if n > chunk:
                n = chunk
            if n > budget and n > 1:  # a decode token is never cut (the budget may go negative)
                n = budget
                if n <= 0:
                    continue
            end = start + n
            if len(req.pages) * page_size < end and not self._grow_or_preempt(req, end, decision):
                continue
            items.append(ScheduleItem(req, start, n, end == seq_len))
            req.last_scheduled_step = step
            budget -= n
        return budget

    def _grow_or_preempt(self, req: Req, num_tokens: int, decision: ScheduleDecision) -> bool:
        while not self.cache.grow(req, num_tokens):
            victim = choose_victim(
                self.running, self.preemption_policy, self.step, self.estimator, self.importance_weights
            )
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
        if self._should_swap(req):
            decision.swap_out.append((req, req.pages[: self._pages(req.num_computed)]))
            req.swap_tokens = req.num_computed
            self.swapped_tokens += self._pages(req.num_computed) * self.page_size
            self.num_swapped_out += 1
        self.cache.release(req, keep_in_cache=True)
        self.num_preemptions += 1
        self.reserve_ratio = self.reserve_ratio_init
        decision.preempted.append(req)
        self.add(req)

    def _should_swap(self, req: Req) -> bool:
        """Swap (instead of recompute) if the mode says so, the request has KV worth
        keeping and host swap space is left; in ``auto`` mode only if the cost model
        finds copying out and back cheaper than recomputing."""
        tokens = req.num_computed
        if self.preemption_mode == "recompute" or tokens == 0 or req.swap_tokens:
            return False
        if self.swapped_tokens + self._pages(tokens) * self.page_size > self.swap_capacity_tokens:
            return False
        return self.preemption_mode == "swap" or bool(self.swap_is_cheaper and self.swap_is_cheaper(tokens))

    def _swap_in(self, req: Req, decision: ScheduleDecision) -> bool:
        """Give a re-admitted swapped request pages for what the radix tree no longer
        holds of its swapped KV and schedule the copy back. False if out of pages."""
        if req.swap_tokens <= req.num_computed:  # the tree kept all of it
            self._drop_swap(req)
            return True
        first = len(req.pages)  # pages from the tree: page-aligned prefix
        if not self.cache.grow(req, req.swap_tokens):
            return False
        decision.swap_in.append(SwapIn(req, req.pages[first:], first))
        req.num_computed = req.swap_tokens
        self.swapped_tokens -= self._pages(req.swap_tokens) * self.page_size
        req.swap_tokens = 0  # the runner drops the handle after the copy
        return True

    def _admit_waiting(self, decision: ScheduleDecision, budget: int) -> None:
        self._running_reserve = None  # the running requests' decode reserve, summed lazily
        if not self.waiting:  # nothing to order (the order's per-plan refresh waits for a request)
            return
        with contextlib.closing(self.order.candidates(self.waiting, self.running)) as candidates:
            for req in candidates:
                if budget <= 0 or len(self.running) >= self.max_running_requests:
                    break
                if req.num_inflight or self.order.should_defer(req):
                    continue  # num_inflight: preempted with a token in flight, not read yet
                if not self.cache.prefetch_ready(req):
                    continue  # its disk or peer pages are on their way (KV tiers)
                admitted = self._admit_one(decision, req, budget)
                if admitted is None:
                    break
                budget -= admitted

    def _admit_one(self, decision: ScheduleDecision, req: Req, budget: int) -> int | None:
        """Admit ``req`` and schedule its first chunk: the tokens scheduled (0 if it was
        rejected: it can never fit), or None if it must wait for pages."""
        verdict = self._admit(req)
        if verdict == "reject":
            self._take_waiting(req)
            decision.out_of_memory.append(req)
            return 0
        if verdict == "wait":
            return None
        reused = req.num_computed  # the cached prefix match_and_lock gave it
        if req.swap_tokens and not self._swap_in(req, decision):
            self.cache.release(req, keep_in_cache=False)
            return None
        n = self._chunk(req, budget)
        if not self.cache.grow(req, req.num_computed + n):
            if decision.swap_in and decision.swap_in[-1].req is req:  # undo the swap-in
                decision.swap_in.pop()
                req.swap_tokens = req.num_computed
                self.swapped_tokens += self._pages(req.swap_tokens) * self.page_size
            self.cache.release(req, keep_in_cache=False)
            return None
        if not req.admitted:  # its first admission: what the cache gave it is its cached_tokens
            req.cached_tokens, req.admitted = reused, True
            self.cache.count_hits(req)
        self.order.admitted(req)
        self._take_waiting(req)
        if self._running_reserve is not None:
            self._running_reserve += self._reserve_extra(req, 1)
        bisect.insort(self.running, req, key=_arrival)  # usually at the end: no full sort per admission
        self._schedule(decision, req, n)
        return n

    def _admit(self, req: Req) -> str:
        """Match the prefix and decide: "admit" if the pool can hold the request's whole
        current sequence plus the decode reserve (``_decode_reserve``; no reserve when
        nothing else runs), "wait" if it must wait for running requests to free pages,
        "reject" if its sequence can never fit."""
        if self.enable_prefix_reuse:
            self.cache.match_and_lock(req, self._match_limit(req), lambda pages: self._fits(req, pages))
        if self._fits(req, len(req.pages)):
            return "admit"
        self.cache.release(req, keep_in_cache=False)
        return "wait" if self.running else "reject"

    def _fits(self, req: Req, held_pages: int) -> bool:
        """Whether the pool can take ``req``'s whole current sequence beyond the
        ``held_pages`` cached pages it holds, plus the decode reserve (none when nothing
        else runs: alone, a request only needs its sequence to fit). Pages loaded from a
        lower tier come out of the same free pages as recomputed ones."""
        need = -(-req.seq_len // self.page_size) - held_pages
        available = self.cache.available_pages
        return need <= available and (not self.running or need + self._decode_reserve(req) <= available)

    def _decode_reserve(self, candidate: Req) -> int:
        """Pages to keep free for decode: for each running request (at least one page
        each) and for ``candidate``, the pages that ``reserve_ratio`` x its expected
        remaining output tokens would add beyond the pages it holds or is about to get.
        The running requests' part is summed once per plan (``_running_reserve``) and
        grown as requests are admitted: O(running + admitted), not their product."""
        if self._running_reserve is None:
            self._running_reserve = sum(self._reserve_extra(r, 1) for r in self.running)
        return self._running_reserve + self._reserve_extra(candidate, 0)

    def _reserve_extra(self, req: Req, min_pages: int) -> int:
        ratio = self.reserve_ratio
        if ratio <= 0:
            return min_pages
        tokens = req.seq_len + ratio * self.estimator.expected_remaining(req)
        held = max(len(req.pages), -(-req.seq_len // self.page_size))
        return max(-(-int(tokens) // self.page_size) - held, min_pages)

    def _match_limit(self, req: Req) -> int:
        """Tokens that may come from the cache: never the last one (its logits are
        needed), and none whose prompt logprob was asked for."""
        limit = req.seq_len - 1
        if req.wants_prompt_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit


_arrival = attrgetter("arrival")
