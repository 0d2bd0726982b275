"""Request traces for the prefix-cache simulator (``radixlm bench cache-sim``).

A trace is a list of ``TraceRequest`` in arrival order: token ids of the prompt, token ids
of the output the server would generate (the simulator caches prompt + output, as the
server does when a request finishes), and an arrival time in seconds. Three generators
and a loader:

* ``sharegpt_multiturn``: real ShareGPT conversations (``radixlm.runtime.bench.sharegpt``;
  the records the dataset split a chat into are joined back, see ``_conversations``),
  tokenised with the SmolLM2 tokenizer in its ChatML chat template. Turn t's prompt is
  the whole history (system prompt, user 1, assistant 1, ..., user t) plus the generation
  header; its output is the dataset's assistant reply t and ``<|im_end|>``. Many
  conversations are interleaved: they start as a Poisson process and each next turn
  arrives after an exponential think time.
* ``shared_prefix``: SGLang's generated shared prefix workload (G groups x P prompts, a
  system prompt of S tokens per group, a Q-token question, O output tokens; random token
  ids), requests in a seeded random order.
* ``scan_mix``: a reusable working set (hot documents with Zipf popularity, each request
  adding a short question) interleaved with one-off long prompts that are never reused
  (a "scan", the classic LRU-polluting pattern).
* ``mooncake``: the Mooncake production conversation trace (a file of 512-token block
  hashes and lengths, no tokens, real timestamps): each block is one id of 512 tokens
  (``TraceRequest.id_tokens``), which the simulators make one radix-tree page of 512 /
  page size KV pages (``cache_model.Geometry``); hit rates on it are of tokens.

Torch-free; the ShareGPT trace needs a tokenizer directory with a ``tokenizer.json``
(package ``tokenizers``), found from the default model when not given.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, islice
from pathlib import Path
from typing import Any

__all__ = [
    "TraceRequest",
    "inserted_pages",
    "MultiTurnConfig",
    "SharedPrefixConfig",
    "ScanMixConfig",
    "sharegpt_multiturn",
    "sample_conversations",
    "shared_prefix",
    "scan_mix",
    "MooncakeConfig",
    "mooncake",
]

VOCAB_SIZE = 49152  # SmolLM2's vocabulary; synthetic traces draw token ids below it
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _cfg(default: Any, help: str) -> Any:
    """A config field with its CLI help text (``radixlm bench cache-sim --help``)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: ``prompt`` and ``output`` ids, arrival time in seconds.

    The ids are token ids (``id_tokens`` = 1), or ids of ``id_tokens``-token blocks (the
    Mooncake trace: one id per 512-token block), in which case ``lengths`` gives the real
    prompt and output lengths in tokens."""

    arrival_s: float
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    session: int  # conversation / group / hot document; -1: a one-off prompt, or not known
    lengths: tuple[int, int] | None = None  # (prompt, output) tokens; None: the id counts
    id_tokens: int = 1  # tokens per id

    @property
    def input_tokens(self) -> int:
        """Prompt length in tokens."""
        return self.lengths[0] if self.lengths else len(self.prompt) * self.id_tokens

    @property
    def output_tokens(self) -> int:
        """Output length in tokens (the decode steps the request runs)."""
        return self.lengths[1] if self.lengths else len(self.output) * self.id_tokens


def inserted_pages(req: TraceRequest, page_size: int) -> int:
    """Whole pages the simulator caches for ``req``: prompt + output minus the last output
    token, which is never run through the model (``cache_sim``'s diagram)."""
    return (len(req.prompt) + len(req.output) - 1) // page_size


# ----------------------------------------------------------------------------- multi-turn
@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn ShareGPT replay. Times in seconds, lengths in tokens."""

    num_conversations: int = _cfg(1000, "conversations sampled from ShareGPT")
    conversation_rate: float = _cfg(4.0, "new conversations per second (Poisson)")
    think_time_s: float = _cfg(60.0, "mean pause between two turns (exponential), seconds")
    context_length: int = _cfg(8192, "a conversation ends before a turn longer than this")
    split_records: bool = _cfg(
        False,
        "use the dataset's records as conversations (cut at ~2K LLaMA tokens) instead "
        "of joining each conversation's records",
    )


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}


def _chat_pairs(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(user, assistant) pairs of one conversation: consecutive messages of one role are
    joined with a newline; it ends at the first message of another role (system, bing)."""
    merged: list[tuple[str, str]] = []
    for message in messages:
        role = _ROLES.get(message.get("from", ""))
        if role is None:
            break
        text = message.get("value") or ""
        if merged and merged[-1][0] == role:
            text = merged.pop()[1] + "\n" + text
        merged.append((role, text))
    if not merged or merged[0][0] != "user":
        return []
    return [(user, reply) for (_, user), (_, reply) in zip(merged[::2], merged[1::2], strict=False)]


def _conversations(split_records: bool, path: str | None = None) -> list[list[dict[str, Any]]]:
    """Messages of each ShareGPT conversation. The dataset's preprocessing split long
    chats into records ``<id>_<k>`` (k = index of the record's first message) of about
    2K LLaMA tokens. Unless ``split_records``, a conversation's records are joined back
    in file order, so it ends where the user stopped, not at a split point. ``path``: a
    ShareGPT file (``sharegpt.iter_records``), None for the packaged one."""
    from radixlm.runtime.bench.sharegpt import iter_records

    chats: dict[str, list[dict[str, Any]]] = {}
    for index, record in enumerate(iter_records(path)):
        chat_id = str(index) if split_records else str(record.get("id")).rsplit("_", 1)[0]
        chats.setdefault(chat_id, []).extend(record.get("conversations") or [])
    return list(chats.values())


def sample_conversations(
    cfg: MultiTurnConfig, seed: int, path: str | None = None
) -> list[list[tuple[str, str]]]:
    """``cfg.num_conversations`` conversations as (user, assistant) text pairs, each with
    at least one pair (seeded shuffle); ``path`` as in ``_conversations``."""
    chats = [pairs for pairs in map(_chat_pairs, _conversations(cfg.split_records, path)) if pairs]
    random.Random(seed).shuffle(chats)
    return chats[: cfg.num_conversations]


def _default_tokenizer_dir() -> str:
    """The default model's directory (converting the SmolLM2 GGUF once if needed; this
    imports torch, so pass ``--tokenizer-path`` to stay torch-free)."""
    from radixlm.runtime.executor.model_loader import resolve_model_path

    return resolve_model_path(None)


class ChatMLTokenizer:
    """SmolLM2's chat template (ChatML, default system prompt) rendered piece by piece.

    Each message is tokenised on its own and the pieces are concatenated, so turn t+1's
    prompt is an exact extension of turn t's prompt + reply (what a server that keeps
    the generated ids sees). Checked on the SmolLM2 tokenizer: for all 983 turns of 200
    sampled conversations the pieces equal the rendered template tokenised in one go
    (the special tokens cut BPE merges at every piece boundary).
    """

    def __init__(self, tokenizer_dir: str | None) -> None:
        from tokenizers import Tokenizer

        directory = Path(tokenizer_dir or _default_tokenizer_dir())
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.generation_header = self.encode(f"{IM_START}assistant\n")
        self.end_of_reply = self.encode(IM_END)
        self.newline = self.encode("\n")
        self.system = self.message("system", SMOLLM2_SYSTEM)

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[tuple[int, ...]]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [tuple(e.ids) for e in encodings]

    def message(self, role: str, content: str) -> tuple[int, ...]:
        return (
            self.encode(f"{IM_START}{role}\n")
            + self.encode(content)
            + self.end_of_reply
            + self.newline
        )


def _conversation_turns(
    pairs: list[tuple[str, str]], chat: ChatMLTokenizer, context_length: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, output) per turn, ending before the first turn longer than the context.

    prompt t = system | user 1 | asst 1 | ... | user t | "<|im_start|>assistant\\n"
    output t = reply t + "<|im_end|>";  history t+1 = prompt t + output t + "\\n"
    """
    users = chat.encode_batch([u for u, _ in pairs])
    replies = chat.encode_batch([r for _, r in pairs])
    user_header = chat.encode(f"{IM_START}user\n")
    history, turns = chat.system, []
    for user, reply in zip(users, replies, strict=True):
        prompt = history + user_header + user + chat.end_of_reply + chat.newline
        prompt += chat.generation_header
        output = reply + chat.end_of_reply
        if len(prompt) + len(output) > context_length:
            break
        turns.append((prompt, output))
        history = prompt + output + chat.newline
    return turns


def sharegpt_multiturn(
    cfg: MultiTurnConfig, seed: int = 0, tokenizer_dir: str | None = None
) -> list[TraceRequest]:
    """Interleaved multi-turn ShareGPT conversations (see the module docstring).

    Conversation c starts at a Poisson arrival (rate ``conversation_rate``); turn t+1
    arrives ``Exp(think_time_s)`` after turn t. The simulator serves a request at its
    arrival instant, so this gap covers generating the reply, reading it and typing.
    """
    rng = random.Random(seed)
    chat = ChatMLTokenizer(tokenizer_dir)
    trace: list[TraceRequest] = []
    start = 0.0
    for index, pairs in enumerate(sample_conversations(cfg, seed)):
        start += rng.expovariate(cfg.conversation_rate)
        now = start
        for prompt, output in _conversation_turns(pairs, chat, cfg.context_length):
            trace.append(TraceRequest(now, prompt, output, index))
            now += rng.expovariate(1 / cfg.think_time_s)
    trace.sort(key=lambda r: r.arrival_s)
    return trace


# ----------------------------------------------------------------------------- synthetic
def _random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.choices(range(VOCAB_SIZE), k=n))


def _poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    return list(accumulate(rng.expovariate(rate) for _ in range(n)))


@dataclass(frozen=True)
class SharedPrefixConfig:
    """SGLang's generated shared prefix workload (PERFORMANCE.md defaults); tokens."""

    num_groups: int = _cfg(64, "groups, each with its own system prompt")
    prompts_per_group: int = _cfg(16, "prompts per group")
    system_prompt_len: int = _cfg(2048, "system prompt tokens")
    question_len: int = _cfg(128, "question tokens per prompt")
    output_len: int = _cfg(256, "output tokens per prompt")
    request_rate: float = _cfg(4.0, "requests per second (Poisson)")


def shared_prefix(cfg: SharedPrefixConfig, seed: int = 0) -> list[TraceRequest]:
    """Every (group, prompt) pair once, in a seeded random order.

    Best possible token hit rate: every prompt but the first of its group reuses the
    system prompt, (P - 1) S / (P (S + Q)) = 88.2% with the defaults.
    """
    rng = random.Random(seed)
    systems = [_random_ids(rng, cfg.system_prompt_len) for _ in range(cfg.num_groups)]
    requests = [
        (
            group,
            systems[group] + _random_ids(rng, cfg.question_len),
            _random_ids(rng, cfg.output_len),
        )
        for group in range(cfg.num_groups)
        for _ in range(cfg.prompts_per_group)
    ]
    rng.shuffle(requests)
    times = _poisson_times(rng, len(requests), cfg.request_rate)
    return [TraceRequest(t, p, o, g) for t, (g, p, o) in zip(times, requests, strict=True)]


@dataclass(frozen=True)
class ScanMixConfig:
    """Hot documents reused with Zipf popularity, interleaved with one-off long prompts."""

    num_requests: int = _cfg(4000, "requests")
    num_documents: int = _cfg(500, "hot documents")
    document_len: int = _cfg(2048, "tokens per hot document")
    zipf_exponent: float = _cfg(0.9, "document k is chosen with weight 1/k^s")
    question_len: int = _cfg(32, "fresh tokens after the document")
    one_off_fraction: float = _cfg(0.1, "share of requests that are one-off long prompts")
    one_off_len: int = _cfg(4096, "tokens per one-off prompt")
    output_len: int = _cfg(64, "output tokens per request")
    request_rate: float = _cfg(4.0, "requests per second (Poisson)")


def _scan_mix_requests(
    cfg: ScanMixConfig, rng: random.Random
) -> Iterator[tuple[int, tuple[int, ...]]]:
    docs = [_random_ids(rng, cfg.document_len) for _ in range(cfg.num_documents)]
    weights = [1 / (k + 1) ** cfg.zipf_exponent for k in range(cfg.num_documents)]
    for _ in range(cfg.num_requests):
        if rng.random() < cfg.one_off_fraction:
            yield -1, _random_ids(rng, cfg.one_off_len)
        else:
            doc = rng.choices(range(cfg.num_documents), weights)[0]
            yield doc, docs[doc] + _random_ids(rng, cfg.question_len)


def scan_mix(cfg: ScanMixConfig, seed: int = 0) -> list[TraceRequest]:
    """``num_requests`` requests: a one-off ``one_off_len`` prompt with probability
    ``one_off_fraction``, else a Zipf-chosen hot document plus a fresh question."""
    rng = random.Random(seed)
    times = _poisson_times(rng, cfg.num_requests, cfg.request_rate)
    return [
        TraceRequest(t, prompt, _random_ids(rng, cfg.output_len), session)
        for t, (session, prompt) in zip(times, _scan_mix_requests(cfg, rng), strict=True)
    ]


# ----------------------------------------------------------------------------- Mooncake
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash block of the Mooncake traces


@dataclass(frozen=True)
class MooncakeConfig:
    """The Mooncake conversation trace file (see ``mooncake``)."""

    path: str = _cfg(
        "../shared/data/traces/mooncake_conversation_trace.jsonl",
        "the trace's JSON lines, relative to the current directory",
    )
    max_requests: int = _cfg(0, "read only the first N lines (0: all)")


def mooncake(path: str | Path, max_requests: int = 0) -> list[TraceRequest]:
    """The Mooncake trace (FAST'25, kvcache-ai/Mooncake ``FAST25-release/traces``) in
    timestamp order; ``max_requests`` > 0 reads only the first lines of the file.

    Each line holds ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and
    ``hash_ids``: one id per 512-token prompt block, chained on the prefix, so equal ids
    at a position mean an equal prefix; the last block may be partial. The prompt is the
    block ids themselves (``id_tokens`` = 512; ``lengths`` = the input and output lengths
    in tokens, for the timed model and the token hit rate). Only whole blocks are ever hit
    (the last block is never matched: the server recomputes the last prompt token; for a
    prompt whose last block is full the server would also reuse that block's first 31
    pages, which the simulators do not count).

    Output tokens are not inserted (the hash ids of a conversation's next turn already
    cover its history). What is inserted is the prompt's whole blocks: a partial last
    block (12,009 of 12,031 requests) is left out, as a page-granular cache leaves out
    a partial page; a full one is kept, which ``output`` = one id (the never-inserted
    last output token of the simulator's request model) expresses. Sessions are not
    known (-1). An infinite cache hits 36.6% of prompt blocks (the file's README), 37.3%
    of prompt tokens.
    FileNotFoundError names the path when it is missing.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"no Mooncake trace at {file.resolve()} (get conversation_trace.jsonl from "
            "kvcache-ai/Mooncake, FAST25-release/traces/, and pass --mooncake-path)"
        )
    with file.open() as lines:
        records = [json.loads(line) for line in islice(lines, max_requests or None)]
    records.sort(key=lambda r: r["timestamp"])  # stable: ties keep file order
    return [
        TraceRequest(
            r["timestamp"] / 1000,
            tuple(r["hash_ids"]),
            () if r["input_length"] % MOONCAKE_BLOCK_TOKENS else (0,),
            -1,
            (r["input_length"], r["output_length"]),
            MOONCAKE_BLOCK_TOKENS,
        )
        for r in records
    ]


def trace_summary(trace: Sequence[TraceRequest]) -> dict[str, float]:
    """Request count, sessions, mean prompt/output tokens, duration in seconds."""
    n = max(len(trace), 1)
    return {
        "requests": len(trace),
        "sessions": len({r.session for r in trace if r.session >= 0}),
        "mean_prompt_tokens": sum(len(r.prompt) for r in trace) / n,
        "mean_output_tokens": sum(len(r.output) for r in trace) / n,
        "duration_s": trace[-1].arrival_s - trace[0].arrival_s if trace else 0.0,
    }
