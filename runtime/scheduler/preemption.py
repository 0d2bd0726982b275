"""Which running request gives way when decode cannot get a page, and how much to reserve.

Preemption policies, chosen by ``--preemption-policy``; each maps a running request to a
sort key and the request with the *lowest* key is preempted first (ties: the newest
arrival first, as vLLM and SGLang do):

* ``lru``: least recently scheduled first (``Req.last_scheduled_step``, the planner's step
  counter when the request last advanced).
* ``longest``: the request holding the most KV pages first (frees the most at once).
* ``importance``: ``score = w1 * recency + w2 * memory_usage + w3 * expected_remaining``
  (MISSION.md section 4), each term normalised to [0, 1] over the running batch:
  ``recency = 1 - idle_steps / max idle_steps`` (1 = scheduled in the last step),
  ``memory_usage = pages / max pages``, ``expected_remaining = E / max E`` with E from
  ``OutputLengthEstimator``. The weights are signed flags; with the defaults (1, -1, -1)
  a request that ran recently is kept, and among equally recent ones the one that holds
  more KV and still has more tokens to generate goes first.

The planner scans the running batch once per preemption (O(running), at most a few
hundred requests) -- preemption is rare and the batch is small, so no heap is kept.

``OutputLengthEstimator`` is the online estimate of output lengths used by
``importance`` and by the admission reserve (planner.py): the empirical
conditional mean ``E[L - g | L > g]`` of the output lengths L of recently finished
requests, for a request that has generated g tokens, capped by its own
``max_new_tokens - g``.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.runtime.scheduler.request import Req

__all__ = [
    "PREEMPTION_POLICIES",
    "OutputLengthEstimator",
    "PreemptionContext",
    "choose_victim",
]

class OutputLengthEstimator:
    """Expected remaining output tokens from the lengths of recently finished requests.

    Keeps the last ``window`` output lengths (tokens) of requests that finished by EOS,
    a stop string or ``max_new_tokens``. ``expected_remaining`` is O(log window) (a
    sorted copy with prefix sums is rebuilt lazily after new observations).
    """

    def __init__(self, window: int = 512) -> None:
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []
        self._suffix_sums: list[int] = [0]  # suffix_sums[i] = sum(sorted[i:])
        self._dirty = False

    def observe(self, output_len: int) -> None:
        """Record the output length (tokens) of a request that finished normally."""
        self._recent.append(output_len)
        self._dirty = True

    def _refresh(self) -> None:
        self._sorted = sorted(self._recent)
        sums = [0] * (len(self._sorted) + 1)
        for i in range(len(self._sorted) - 1, -1, -1):
            sums[i] = sums[i + 1] + self._sorted[i]
        self._suffix_sums = sums
        self._dirty = False

    def expected_remaining(self, req: Req) -> float:
        """Expected tokens ``req`` still generates: mean of ``L - g`` over observed lengths
        ``L > g`` (g = tokens generated so far), at most ``max_new_tokens - g``; with no
        such observation, ``max_new_tokens - g``."""
        generated = len(req.output_ids)
        cap = max(req.sampling.max_new_tokens - generated, 0)
        if self._dirty:
            self._refresh()
        i = bisect.bisect_right(self._sorted, generated)
        longer = len(self._sorted) - i
        if longer == 0:
            return float(cap)
        return min(float(cap), self._suffix_sums[i] / longer - generated)


@dataclass(frozen=True)
class PreemptionContext:
    """What a policy may read besides the request: the planner's step counter, the
    running batch's maxima (for normalisation), the estimator and the weights."""

    step: int
    max_idle_steps: int
    max_pages: int
    max_remaining: float
    remaining: dict[int, float]  # id(req) -> expected remaining tokens
    weights: tuple[float, float, float]  # (recency, memory_usage, expected_remaining)


PreemptionPolicy = Callable[[Req, PreemptionContext], float]


def _lru(req: Req, ctx: PreemptionContext) -> float:
    return float(req.last_scheduled_step)


def _longest(req: Req, ctx: PreemptionContext) -> float:
    return -float(len(req.pages))


def _importance(req: Req, ctx: PreemptionContext) -> float:
    w_recency, w_memory, w_remaining = ctx.weights
    idle = ctx.step - req.last_scheduled_step
    recency = 1.0 - idle / ctx.max_idle_steps if ctx.max_idle_steps else 1.0
    memory = len(req.pages) / ctx.max_pages if ctx.max_pages else 0.0
    remaining = ctx.remaining[id(req)] / ctx.max_remaining if ctx.max_remaining else 0.0
    return w_recency * recency + w_memory * memory + w_remaining * remaining


PREEMPTION_POLICIES: dict[str, PreemptionPolicy] = {
    "lru": _lru,
    "longest": _longest,
    "importance": _importance,
}


def choose_victim(
    running: list[Req],
    policy: str,
    step: int,
    estimator: OutputLengthEstimator,
    weights: tuple[float, float, float] = (1.0, -1.0, -1.0),
) -> Req:
    """The running request to preempt: lowest policy key, newest arrival on ties.

    Raises ValueError for an empty batch or an unknown policy name.
    """
    if not running:
        raise ValueError("no running request to preempt")
    try:
        key = PREEMPTION_POLICIES[policy]
    except KeyError:
        raise ValueError(
            f"unknown preemption policy {policy!r}; choose from: {', '.join(PREEMPTION_POLICIES)}"
        ) from None
    remaining = {id(r): estimator.expected_remaining(r) for r in running} if policy == "importance" else {}
    ctx = PreemptionContext(
        step=step,
        max_idle_steps=max(step - r.last_scheduled_step for r in running),
        max_pages=max(len(r.pages) for r in running),
        max_remaining=max(remaining.values(), default=0.0),
        remaining=remaining,
        weights=weights,
    )
    return min(running, key=lambda r: (key(r, ctx), -r.arrival))
