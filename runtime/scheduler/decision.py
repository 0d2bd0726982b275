"""The scheduler <-> executor contract: the plan of one step and what running it gave back.

The scheduler's planner (``planner.BatchPlanner``) builds a ``ScheduleDecision``; the
executor (``radixlm.runtime.executor.model_runner.ModelRunner``) runs it and returns a
``PendingStep`` (launched, results on their way to the host); ``PendingStep.collect()``
gives one ``ItemResult`` per ``ScheduleItem``. Torch-free: the sampled tensors are only
read through ``.tolist()``.

    request tokens:   |<----- num_computed ----->|<-- num_tokens -->|
                      [ cached / computed pages ][ this step's feed ]
                                                 ^ ScheduleItem.start
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixlm.runtime.scheduler.request import Req

if TYPE_CHECKING:
    from radixlm.runtime.executor.sampling import SampleResult

__all__ = ["ItemResult", "PendingStep", "ScheduleDecision", "ScheduleItem", "SwapIn"]


@dataclass(slots=True)
class ScheduleItem:
    """Feed ``req.all_ids[start : start + num_tokens]`` (start = req.num_computed)."""

    req: Req
    start: int
    num_tokens: int
    samples: bool  # the pass reaches the end of the sequence (``req.seq_len``): a token is sampled


@dataclass
class SwapIn:
    """Copy host KV pages ``req.swap_handle[:, :, first_page:]`` into ``pages``."""

    req: Req
    pages: list[int]
    first_page: int


@dataclass
class ScheduleDecision:
    items: list[ScheduleItem] = field(default_factory=list)
    preempted: list[Req] = field(default_factory=list)
    out_of_memory: list[Req] = field(default_factory=list)  # finished: pool too small
    # Executed before the forward pass, swap-outs first (their pages may be reused by a
    # swap-in or by the forward of the same step).
    swap_out: list[tuple[Req, list[int]]] = field(default_factory=list)
    swap_in: list[SwapIn] = field(default_factory=list)
    # Decode steps of this plan: > 1 is a multi-step window (module docstring); every item
    # then decodes one token per step, ``decode_steps`` tokens in all, pages already grown.
    decode_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)


@dataclass(slots=True)
class ItemResult:
    """What one ScheduleItem produced (aligned with decision.items)."""

    next_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    window_ids: list[int] | None = None  # a multi-step window's tokens, in order (next_id None)


@dataclass
class PendingStep:
    """A launched step: its items, results filled so far (prompt logprobs), and the sampled
    ids / logprobs on their way to the host. ``collect()`` waits and fills the results."""

    items: list[ScheduleItem]
    # Filled so far (prompt logprobs); None: nothing yet, built by ``collect``.
    results: list[ItemResult] | None = None
    picks: list[int] = field(default_factory=list)  # item index of each sampled row
    sampled: SampleResult | None = None
    ready: Any = None  # CUDA event recorded after the copies to the host
    decode_steps: int = 1  # > 1: a multi-step window; ``sampled`` holds [steps, B] ids
    was_prefill: list[bool] = field(default_factory=list)  # per item, set by the scheduler
    ends_prefill: list[bool] = field(default_factory=list)  # per item: this step completes the prompt
    wait_seconds: float = 0.0  # host time collect() spent waiting for the device

    def collect(self) -> list[ItemResult]:
        """Wait for the sampled ids and fill ``results`` (idempotent)."""
        out = self.sampled
        if out is None:
            if self.results is None:
                self.results = [ItemResult() for _ in self.items]
            return self.results
        if self.ready is not None:
            start = time.perf_counter()
            self.ready.synchronize()
            self.wait_seconds = time.perf_counter() - start
        next_ids = out.next_ids.tolist()
        lps = out.logprobs.tolist() if out.logprobs is not None else [None] * len(next_ids)
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        self.sampled = None
        if self.decode_steps > 1:  # item j's tokens: column j of [steps, B]
            b = len(self.items)
            self.results = [ItemResult(window_ids=next_ids[j::b]) for j in range(b)]
            return self.results
        if self.results is None and top_ids is None and len(self.picks) == len(self.items):  # item i sampled row i
            self.results = list(map(ItemResult, next_ids, lps))  # map: ~30% less than a comprehension
            return self.results
        if self.results is None:
            self.results = [ItemResult() for _ in self.items]
        for k, i in enumerate(self.picks):
            res, req = self.results[i], self.items[i].req
            res.next_id, res.logprob = next_ids[k], lps[k]
            if top_ids is not None and req.top_logprobs_num:
                n = req.top_logprobs_num
                res.top_logprobs = list(zip(top_ids[k][:n], top_lps[k][:n], strict=True))
        return self.results
