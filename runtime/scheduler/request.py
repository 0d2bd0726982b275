"""Req: the scheduler's state of one request (one sample; n > 1 arrives as n requests).

A request is a token sequence ``prompt + output`` whose KV is computed left to right.
``num_computed`` tokens have KV in ``pages``; the next forward pass feeds the tokens
after that. The last token of the sequence is always fed (its KV is written and its
logits sample the next token).

    all_ids:   [ prompt ............................ | output ........ ]
    KV:        [ tree pages (shared) | own pages ...........  |        ]
               ^0          num_tree_pages*S      num_computed^  len(all_ids)^

With overlap scheduling the next step is launched before the host has read the tokens
the current one samples: ``num_inflight`` counts those (0-2). They are part of ``seq_len``
(the planner feeds them; the model runner reads them on the device) but not of
``output_ids`` / ``all_ids`` (``num_known`` tokens), which hold only tokens the host has.

Preemption by recompute frees the KV (``num_computed`` back to 0); on resume the
request is re-admitted like a new one whose prompt is ``all_ids``, so the radix tree
usually still holds most of it. Preemption by swap also copies the computed KV to host
memory first; on resume what the tree no longer holds is copied back instead of
recomputed.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.messages import GenerateReq, SamplingParams

__all__ = ["Req"]


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    arrival: float = 0.0

    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_tree_pages: int = 0  # leading pages of `pages` owned by the radix tree
    tree_node: Any = None  # radix node locked by this request (None: nothing locked)
    cached_tokens: int = 0  # prompt tokens reused from the cache at first admission
    cached_tiers: dict[str, int] | None = None  # cached_tokens by where they came from (KV tiers)
    admitted: bool = False
    # Peer KV tier: the router's hint (replica, tokens; -1 / 0: none) and the token span a
    # peer fetch inserted for this request (scheduler/peer.py).
    peer_rank: int = -1
    peer_tokens: int = 0
    peer_span: tuple[int, int] | None = None

    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None

    # Output bookkeeping.
    num_sent: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    last_scheduled_step: int = 0
    # Preemption by swap: the first ``swap_tokens`` positions' KV waits in host memory
    # (``swap_handle``, set by the model runner) until re-admission copies it back.
    swap_tokens: int = 0
    swap_handle: Any = None
    max_computed: int = 0  # high-water mark of num_computed (recompute accounting)
    grammar: Any = None  # xgrammar GrammarMatcher of a structured-generation request
    num_inflight: int = 0  # sampled by launched steps, not read by the host yet
    # (token, accepted) fed to ``grammar`` by the model runner before the scheduler read the
    # token (overlap: the next step's mask needs it); the scheduler consumes them in order.
    grammar_ahead: list[tuple[int, bool]] = field(default_factory=list)
    _packed: array = field(default_factory=lambda: array("I"), repr=False)  # see token_array
    stop_text: Any = None  # IncrementalDetokenizer of the output, kept by StopChecker for stop_regex
    sampling_info: Any = None  # SamplingInfo of a request without per-step sampling state (model runner)
    # Set by the scheduler for a request whose every sampled token is only appended and
    # checked against stop ids and lengths (no grammar, logprobs, stop strings or regexes,
    # min_new_tokens): the ids that end it, and the output
    # length that ends it, min(max_new_tokens, context length - prompt length). None: the
    # full per-token path (Scheduler._append_token). StopChecker.set_fast_path sets both.
    fast_stop_ids: frozenset[int] | None = None
    output_limit: int = 0
    # Set by the scheduler for a request that may decode in multi-step windows (no grammar,
    # logprobs, penalty or seed: nothing the host must see or feed between two of its tokens).
    multi_step: bool = False

    @classmethod
    def from_message(cls, msg: GenerateReq, arrival: float) -> Req:
        return cls(
            rid=msg.rid,
            prompt_ids=list(msg.input_ids),
            sampling=msg.sampling,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            stream=msg.stream,
            arrival=arrival,
            peer_rank=msg.peer_rank,
            peer_tokens=msg.peer_tokens,
        )

    # ----------------------------------------------------------------- sequence views
    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids``."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def token_array(self, end: int) -> array:
        """``all_ids[:end]`` as ``array("I")``, the radix tree's packed form (a memcpy for
        it, radix/tree.py). The prompt is packed once and output tokens are appended as
        they come (both lists only grow), so matching and inserting a long prompt never
        converts it again."""
        packed, n = self._packed, len(self.prompt_ids)
        if len(packed) < n:
            packed.fromlist(self.prompt_ids[len(packed) :])  # fromlist: 2x faster than extend
        if len(packed) < self.seq_len:
            packed.fromlist(self.output_ids[len(packed) - n :])
        return packed[:end]

    @property
    def seq_len(self) -> int:
        """Sequence length including tokens still in flight."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_known(self) -> int:
        """Tokens the host has: ``len(all_ids)``."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed before the next sample (1 while decoding)."""
        return self.seq_len - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        """True until the whole prompt has its KV (output may exist after a preemption)."""
        return self.num_computed < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, matched: int | str | None = None, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.matched_stop, self.error = reason, matched, error
