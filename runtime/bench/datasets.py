"""Workloads of the serving benchmark (``radixlm bench serving``), named as SGLang's
``bench_serving`` names them, and the arrival process.

* ``sharegpt``: one request per ShareGPT conversation: its first user message is the
  prompt (text), the token length of the first reply is the output length (or
  ``--sharegpt-output-len``). SGLang / vLLM filter: conversations with >= 2 messages,
  drop prompt or output < 4 tokens, and, without a context length, prompt > 1024 or
  prompt + output > 2048 tokens (with one: prompt + output > context). Seeded shuffle.
* ``random``: input and output lengths drawn uniformly in ``[max(1, int(L * r)), L]``
  (``--random-range-ratio`` r); prompt token ids uniform in ``[0, vocab)``.
* ``generated-shared-prefix``: G groups x P prompts, a system prompt of S random tokens
  per group plus a Q-token question; O output tokens each
  (``cache_traces.shared_prefix``, the same workload as ``radixlm bench cache-sim``).
* ``sharegpt-multiturn``: whole ShareGPT conversations (``cache_traces.sample_conversations``)
  replayed turn by turn; the client builds each turn's messages from the history, the
  server's generated replies and the next user message (see serving.py).
* ``mooncake``: the Mooncake production trace (``cache_traces.mooncake``) at its own
  timestamps, scaled down (``mooncake_requests``): token ids made from its block hashes.

Arrivals: all at once (``request_rate = inf``) or a Poisson process: exponential gaps of
mean ``1 / request_rate`` seconds; a trace's requests carry their own send times
(``BenchRequest.arrival_s``). Torch-free.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "BenchRequest",
    "Conversation",
    "RequestOutput",
    "load_tokenizer",
    "sharegpt_requests",
    "random_requests",
    "shared_prefix_requests",
    "multiturn_conversations",
    "MooncakeWindow",
    "mooncake_requests",
    "poisson_gaps",
]


class Tokenizer(Protocol):
    """What the generators need of a tokenizer (a transformers tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: ``prompt`` is text or token ids, ``prompt_len`` its length in tokens
    (the client's count; the server's usage replaces it when reported), ``output_len``
    the ``max_new_tokens`` asked for. ``group``: the GSP group, -1 otherwise.
    ``arrival_s``: when to send it, seconds from the run's start (a trace replay); None:
    the run's arrival process."""

    prompt: str | tuple[int, ...]
    prompt_len: int
    output_len: int
    group: int = -1
    arrival_s: float | None = None


@dataclass(frozen=True, slots=True)
class Conversation:
    """One multi-turn conversation: ``users[t]`` is turn t's user message, sent with
    ``max_new_tokens = output_lens[t]`` (the dataset reply's token length)."""

    users: tuple[str, ...]
    output_lens: tuple[int, ...]


def _sharegpt_pair(record: dict[str, Any]) -> tuple[str, str] | None:
    messages = record.get("conversations") or []
    if len(messages) < 2:
        return None
    return messages[0].get("value") or "", messages[1].get("value") or ""


def _sharegpt_keep(prompt_len: int, output_len: int, context_len: int | None) -> bool:
    if prompt_len < 4 or output_len < 4:
        return False
    if context_len is None:
        return prompt_len <= 1024 and prompt_len + output_len <= 2048
    return prompt_len + output_len <= context_len


def sharegpt_requests(
    records: Sequence[dict[str, Any]],
    tokenizer: Tokenizer,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    context_len: int | None = None,
) -> list[BenchRequest]:
    """``num_prompts`` ShareGPT requests (filter in the module docstring; ``output_len``
    fixes every output length, still filtered on the dataset's). ValueError when the
    records hold fewer than ``num_prompts`` that pass."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    out: list[BenchRequest] = []
    for index in order:
        pair = _sharegpt_pair(records[index])
        if pair is None:
            continue
        prompt_len = len(tokenizer.encode(pair[0]))
        reply_len = len(tokenizer.encode(pair[1]))
        if not _sharegpt_keep(prompt_len, reply_len, context_len):
            continue
        out.append(BenchRequest(pair[0], prompt_len, output_len or reply_len))
        if len(out) == num_prompts:
            return out
    raise ValueError(
        f"--num-prompts {num_prompts}: only {len(out)} ShareGPT conversations pass the filter"
    )


def _uniform_lens(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, length) for _ in range(n)]


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """SGLang's ``random`` dataset: lengths uniform in ``[max(1, int(L * range_ratio)), L]``,
    prompt ids uniform in ``[0, vocab_size)``. ValueError for a ratio outside [0, 1]."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    ins = _uniform_lens(rng, num_prompts, input_len, range_ratio)
    outs = _uniform_lens(rng, num_prompts, output_len, range_ratio)
    return [
        BenchRequest(tuple(rng.choices(range(vocab_size), k=n)), n, m)
        for n, m in zip(ins, outs, strict=True)
    ]


def shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Every (group, prompt) pair once in a seeded random order, token-id prompts of
    ``system_prompt_len + question_len`` tokens (ids below SmolLM2's vocab, 49152).
    Best possible token hit rate (P - 1) S / (P (S + Q)): 88.2% for 64 x 16, 2048, 128."""
    from radixlm.runtime.bench.cache_traces import SharedPrefixConfig, shared_prefix

    cfg = SharedPrefixConfig(
        num_groups=num_groups,
        prompts_per_group=prompts_per_group,
        system_prompt_len=system_prompt_len,
        question_len=question_len,
        output_len=output_len,
    )
    return [
        BenchRequest(r.prompt, len(r.prompt), output_len, r.session)
        for r in shared_prefix(cfg, seed)
    ]


def multiturn_conversations(
    tokenizer: Tokenizer,
    num_conversations: int,
    seed: int = 0,
    max_turns: int | None = None,
    output_len: int | None = None,
    dataset_path: str | None = None,
) -> list[Conversation]:
    """``num_conversations`` whole ShareGPT conversations (the dataset's split records
    joined back), at most ``max_turns`` turns each; a turn's output length is its reply's
    token length (at least 1), or ``output_len``."""
    from radixlm.runtime.bench.cache_traces import MultiTurnConfig, sample_conversations

    cfg = MultiTurnConfig(num_conversations=num_conversations)
    out = []
    for pairs in sample_conversations(cfg, seed, dataset_path)[:num_conversations]:
        pairs = pairs[:max_turns] if max_turns else pairs
        lens = [output_len or max(1, len(tokenizer.encode(reply))) for _, reply in pairs]
        out.append(Conversation(tuple(u for u, _ in pairs), tuple(lens)))
    return out


@dataclass(frozen=True)
class MooncakeWindow:
    """Which part of the Mooncake trace to replay and how much smaller (``mooncake_requests``)."""

    start_s: float = 0.0  # trace seconds
    duration_s: float = 600.0  # trace seconds
    sample: int = 1  # keep one conversation in this many
    time_scale: float = 1.0  # the window is replayed this many times faster
    block_tokens: int = 512  # tokens per hash block (512: the trace's own lengths)
    output_scale: float | None = None  # output lengths x this (None: x block_tokens / 512)


def mooncake_requests(
    path: str, window: MooncakeWindow, vocab: int, seed: int = 0
) -> list[BenchRequest]:
    """The requests of the Mooncake trace (``cache_traces.mooncake``) arriving in
    ``[start_s, start_s + duration_s)``, scaled down to run on a small server:

    * one conversation in ``sample``: a request is kept when the id of its second hash
      block (the first after the shared system prompt; its own index when it has one
      block) is a multiple of ``sample``, so a conversation's turns stay together;
    * lengths x ``block_tokens / 512``: each hash id becomes a fixed block of
      ``block_tokens`` random token ids (seeded by the id), so two prompts share exactly
      the blocks the trace says they share; the prompt is those blocks cut to the scaled
      input length (at least 1), the output the output length x ``output_scale`` (by
      default the same scale; at least 1);
    * sent at ``(timestamp - start_s) / time_scale`` seconds from the run's start.
    """
    from radixlm.runtime.bench.cache_traces import MOONCAKE_BLOCK_TOKENS, mooncake

    scale = window.block_tokens / MOONCAKE_BLOCK_TOKENS
    out_scale = scale if window.output_scale is None else window.output_scale
    end = window.start_s + window.duration_s
    blocks: dict[int, tuple[int, ...]] = {}

    def block(hash_id: int) -> tuple[int, ...]:
        if hash_id not in blocks:
            rng = random.Random(seed * 1_000_003 + hash_id)
            blocks[hash_id] = tuple(rng.randrange(vocab) for _ in range(window.block_tokens))
        return blocks[hash_id]

    out = []
    for index, req in enumerate(mooncake(path)):
        conversation = req.prompt[1] if len(req.prompt) > 1 else index
        if not window.start_s <= req.arrival_s < end or conversation % window.sample:
            continue
        length = max(1, round(req.input_tokens * scale))
        ids = tuple(t for h in req.prompt for t in block(h))[:length]
        arrival = (req.arrival_s - window.start_s) / window.time_scale
        output = max(1, round(req.output_tokens * out_scale))
        out.append(BenchRequest(ids, len(ids), output, -1, arrival))
    return out


def poisson_gaps(request_rate: float, seed: int = 0) -> Iterator[float]:
    """Seconds to wait before each request: 0 forever for ``inf`` (all at once), else
    exponential with mean ``1 / request_rate`` (a Poisson process). ValueError for a rate
    <= 0."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    rng = random.Random(seed)
    while True:
        yield 0.0 if math.isinf(request_rate) else rng.expovariate(request_rate)


@dataclass
class RequestOutput:
    """One request's measurements (seconds; lengths in tokens)."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    error: str = ""
    turn: int | None = None  # sharegpt-multiturn: the turn's 1-based index in its conversation


def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer of a model directory (transformers imported here only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
