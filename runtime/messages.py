"""Typed messages between the tokenizer (HTTP) process and the scheduler process.

One codec for all of them: msgspec msgpack with a tagged union, so a message's type
travels with it and decoding never executes arbitrary code (no pickle).

    tokenizer process                                scheduler process
      GenerateReq / AbortReq / FlushCacheReq  ----->  (PULL)
      (PULL)  <-----  BatchOutput / FlushCacheOut / SchedulerStats / SchedulerReady

A request has one id (``rid``) end to end; with ``n > 1`` the tokenizer process sends
one GenerateReq per sample (``rid-0 .. rid-(n-1)``).

With tensor parallelism the scheduler (rank 0) also sends every step it runs to the other
ranks of its replica (``TPStep``, scheduler/tensor_parallel.py). With data parallelism and
the peer KV tier (``--enable-peer-kv``) the replicas' schedulers ask each other for cached
pages (``PeerFetchReq`` / ``PeerFetchOut``, scheduler/peer.py); the pages themselves travel
over torch.distributed (memory/peer_link.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "SamplingParams",
    "GenerateReq",
    "AbortReq",
    "FlushCacheReq",
    "CheckInvariantsReq",
    "CheckInvariantsOut",
    "ReqOutput",
    "BatchOutput",
    "FlushCacheOut",
    "SchedulerStats",
    "SchedulerReady",
    "SchedulerError",
    "TPNewReq",
    "TPItem",
    "TPStep",
    "PeerFetchReq",
    "PeerFetchOut",
    "PeerStats",
    "encode",
    "decode",
]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling settings (SGLang / vLLM field names and meanings).

    ``max_new_tokens`` counts generated tokens; ``temperature == 0`` is greedy;
    ``top_k <= 0`` disables top-k; ``seed`` makes sampling reproducible per request.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()  # patterns (runtime/text/stop_regex.py), validated by the tokenizer process
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured generation (runtime/text/grammar.py): at most one of these.
    regex: str | None = None
    json_schema: str | None = None  # a JSON Schema as JSON text
    ebnf: str | None = None
    structural_tag: str | None = None  # an xgrammar structural tag as JSON text (tool calls)


class GenerateReq(msgspec.Struct, tag=True, kw_only=True):
    """A tokenized request. ``logprob_start_len`` = first prompt position whose logprob is
    returned (-1: no prompt logprobs).

    Data parallelism: ``data_parallel_rank`` (SGLang's field) is the replica the client
    asked for (None: the router picks). ``peer_rank`` / ``peer_tokens`` are the router's
    hint for the peer KV tier: replica ``peer_rank`` was sent a prompt sharing the first
    ``peer_tokens`` tokens (whole pages) with this one (-1 / 0: no hint). A hint, not a
    promise: that replica may have evicted them."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    data_parallel_rank: int | None = None
    peer_rank: int = -1
    peer_tokens: int = 0


class AbortReq(msgspec.Struct, tag=True):
    rid: str


class FlushCacheReq(msgspec.Struct, tag=True):
    pass


class CheckInvariantsReq(msgspec.Struct, tag=True):
    """Ask the scheduler to check pool/tree invariants now (debug endpoint, tests)."""


class CheckInvariantsOut(msgspec.Struct, tag=True, kw_only=True):
    ok: bool
    message: str
    num_live: int
    free_pages: int
    cached_pages: int
    locked_pages: int
    violations: list[str]  # found by --debug-invariants checks since start


class ReqOutput(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """New tokens of one request since its last output (all lists aligned with
    ``new_token_ids``). ``finish_reason`` is set on the last output of a request:
    "stop" (EOS, stop token or stop string; ``matched_stop`` says which), "length",
    or "abort" (``error`` says why).

    A streamed request's output of one plain token is sent in BatchOutput's columns
    instead. Encoded as an array (no field names: 64 outputs encode in half the time, in a
    sixth of the bytes) and not tracked by the garbage collector (it holds no reference
    back to anything that holds it)."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Sent once, with the first output of a request that asked for prompt logprobs:
    # logprob of prompt token i given tokens < i, for i >= logprob_start_len (first may be None).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    cached_tiers: dict[str, int] | None = None  # cached_tokens by tier: device / host / disk / peer (KV tiers)


class BatchOutput(msgspec.Struct, tag=True):
    """One loop turn's outputs. A streamed request's output that is only one new token
    (not its first output, not its last, no logprobs: nearly every output of a decode
    step) goes in the columns ``token_rids`` / ``token_ids`` instead of a ReqOutput of its
    own; its ``prompt_tokens`` / ``cached_tokens`` are those of the request's first output.
    The columns come before ``outputs``: a request's output in ``outputs`` is never earlier
    than its token in the columns."""

    outputs: list[ReqOutput] = []
    token_rids: list[str] = []
    token_ids: list[int] = []


class FlushCacheOut(msgspec.Struct, tag=True):
    success: bool
    message: str = ""


class HiCacheStats(msgspec.Struct, kw_only=True):
    """The hierarchical cache's tiers (cumulative counts unless named total / used)."""

    host_pages_total: int
    host_pages_used: int
    disk_pages_total: int
    disk_pages_used: int
    page_bytes: int  # bytes of one page in the host and disk tiers
    hit_tokens: dict[str, int]  # prompt tokens reused, by the tier they were in: device / host / disk
    pages_moved: dict[str, int]  # device_to_host / host_to_device / host_to_disk / disk_to_host
    prefetch_hits: int  # disk prefetches complete before admission
    prefetch_timeouts: int  # admitted before the prefetch ended (the rest recomputed)
    prefetch_failed: int  # ended with a page missing or failing verification (recomputed)
    prefetch_failures: int  # pages that failed verification: dropped, recomputed
    prefetch_seconds: float  # summed prefetch wait
    prefetch_count: int
    skipped_loads: int  # lower-tier pages matched but recomputed (cheaper by the cost model, or not read in time)
    disk_writes_skipped: int  # pages not written to disk: quota or disk full


class PeerStats(msgspec.Struct, kw_only=True):
    """The peer KV tier of one replica (cumulative counts; scheduler/peer.py). As the
    asking side: fetches by outcome, pages and tokens received; as the serving side:
    requests answered, pages sent."""

    hit_tokens: int = 0  # prompt tokens of admitted requests that came from a peer
    fetches: int = 0  # fetches started (requests to a peer)
    fetches_loaded: int = 0  # fetches whose pages arrived and were inserted
    fetches_none: int = 0  # the peer held none of the pages (evicted, or busy)
    fetches_failed: int = 0  # the transfer failed, or the pages could not be inserted
    waits_timed_out: int = 0  # requests admitted before their fetch ended (they recomputed)
    skipped: int = 0  # hinted spans recomputed: the cost model, an unresponsive peer, or own lower tiers
    pages_received: int = 0
    tokens_inserted: int = 0  # tokens the received pages added to the radix tree
    pages_sent: int = 0
    requests_served: int = 0  # peers' requests answered with pages
    requests_refused: int = 0  # peers' requests answered with none
    page_bytes: int = 0  # bytes of one page on the wire
    fetch_seconds: float = 0.0  # summed request -> inserted time of loaded fetches


class SchedulerStats(msgspec.Struct, tag=True, kw_only=True):
    """Sent after scheduler steps (rate-limited) for /metrics."""

    dp_rank: int = 0  # the replica that sent it (data parallelism)
    num_running: int
    num_waiting: int
    kv_total_pages: int
    kv_used_pages: int  # held by requests or the radix tree
    kv_cached_pages: int  # held by the radix tree
    prefill_tokens_computed: int  # cumulative
    prefill_tokens_cached: int  # cumulative (skipped thanks to the radix cache)
    decode_tokens: int  # cumulative
    num_preemptions: int  # cumulative
    num_evicted_pages: int  # cumulative
    num_swapped_out: int = 0  # cumulative: preemptions that swapped KV to host memory
    prefill_tokens_recomputed: int = 0  # cumulative: KV computed again after a preemption
    forward_steps: int = 0  # cumulative: forward passes launched
    decode_steps: int = 0  # cumulative: forward passes where every item decodes one token
    scheduler_busy_seconds: float = 0.0  # cumulative: scheduler loop time not waiting for the device or messages
    scheduler_decode_busy_seconds: float = 0.0  # cumulative: the part of it in steps that launched a decode pass
    kv_waste_tokens: int = 0  # KV slots held by running requests without a computed token
    page_size: int = 1  # tokens per KV page (to turn the page counts into tokens)
    kv_sink_slots_total: int = 0  # FP8 pools' exact-sink slots (--kv-sink-slots; 0 without)
    kv_sink_slots_used: int = 0  # slots claimed by a first token (never evicted)
    hicache: HiCacheStats | None = None  # None without a hierarchical cache
    peer: PeerStats | None = None  # None without the peer KV tier


class SchedulerReady(msgspec.Struct, tag=True, kw_only=True):
    """The scheduler's handshake once the model is loaded and the pool is sized."""

    max_total_tokens: int
    context_length: int
    page_size: int
    vocab_size: int
    model_dir: str
    device: str
    dtype: str
    kv_bytes: int
    # defaults resolved at start-up (/get_server_info shows these, not the flags' None)
    cuda_graph_max_bs: int | None = None  # largest decode-graph batch; None: no decode graphs
    admit_batch_size: int = 1
    idle_spin_ms: float = 0.0
    disable_overlap_schedule: bool = False
    weight_dtype: str = "model"  # the decoder linears' kind (--weight-dtype resolved), "model": --dtype
    hicache: dict[str, Any] | None = None  # tier sizes and measured bandwidths (hierarchical cache)
    peer_kv: dict[str, Any] | None = None  # the peer KV tier's measured bandwidth and latency


class SchedulerError(msgspec.Struct, tag=True):
    """The scheduler failed to start (sent instead of SchedulerReady)."""

    message: str


class TPNewReq(msgspec.Struct, array_like=True, gc=False):
    """A request the other tensor parallel ranks have not seen: what their copy of it needs."""

    rid: str
    prompt_ids: list[int]
    return_logprob: bool
    logprob_start_len: int


class TPItem(msgspec.Struct, array_like=True, gc=False):
    """One ``ScheduleItem`` for the other ranks, with the request's state that the forward
    pass reads: output tokens the host has that the rank has not seen yet, tokens in
    flight, the page table, and how many prompt logprobs rank 0 has recorded (which rows
    need logits)."""

    rid: str
    start: int
    num_tokens: int
    samples: bool
    new_output_ids: list[int]
    num_inflight: int
    pages: list[int]
    num_prompt_logprobs: int = 0


class TPStep(msgspec.Struct, tag=True, kw_only=True, gc=False):
    """Rank 0's step, run by every other rank of its replica in the same order: swaps
    first (``ScheduleDecision.swap_out`` / ``swap_in``: rid, pages[, first page]), then the
    forward pass over ``items`` (none: swaps only). ``done``: requests gone since the last step."""

    new_reqs: list[TPNewReq] = []
    items: list[TPItem] = []
    decode_steps: int = 1
    swap_out: list[tuple[str, list[int]]] = []
    swap_in: list[tuple[str, list[int], int]] = []
    done: list[str] = []


class PeerFetchReq(msgspec.Struct, tag=True, kw_only=True, gc=False):
    """Replica ``src`` asks a peer replica for the KV pages of ``tokens[start:]`` (whole
    pages; it holds ``tokens[:start]`` itself). ``xfer`` numbers the requests of ``src``."""

    xfer: int
    src: int
    tokens: list[int]
    start: int


class PeerFetchOut(msgspec.Struct, tag=True, kw_only=True):
    """The answer to ``PeerFetchReq`` ``xfer``: replica ``src`` sends ``num_pages`` pages,
    the KV of tokens ``[start, start + num_pages * page_size)``, over torch.distributed
    (posted before this answer; the asking side must post the matching receive, even if
    it no longer wants them). 0 pages: none (``reason`` says why)."""

    xfer: int
    src: int
    start: int
    num_pages: int
    reason: str = ""


Message = (
    GenerateReq
    | AbortReq
    | FlushCacheReq
    | CheckInvariantsReq
    | CheckInvariantsOut
    | BatchOutput
    | FlushCacheOut
    | SchedulerStats
    | SchedulerReady
    | SchedulerError
    | TPStep
    | PeerFetchReq
    | PeerFetchOut
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError on bytes that are not a known message."""
    return _decoder.decode(data)
