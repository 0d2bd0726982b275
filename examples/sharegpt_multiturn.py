"""Replay real multi-turn ShareGPT chats through radixlm's OpenAI API (``make run``).

    .venv/bin/python examples/sharegpt_multiturn.py                   # starts its own server
    .venv/bin/python examples/sharegpt_multiturn.py --url http://127.0.0.1:30000
    .venv/bin/python examples/sharegpt_multiturn.py --server-args "--disable-radix-cache"

What it does:
  1. starts ``python -m radixlm.runtime.launch_server`` on a free loopback port (or uses
     ``--url``) and waits for ``/health``;
  2. picks ``--num-conversations`` real conversations from ShareGPT (seeded; >= 2 human
     turns, short first turn, mostly-ASCII text; a conversation is cut before its first
     over-long user message);
  3. replays up to ``--max-turns`` turns of each, ``--concurrency`` conversations at a
     time, with the official ``openai`` client (streaming, temperature 0). Turn t's prompt
     is the whole history -- the real user messages and the model's *own* earlier
     answers -- plus user message t, so turn t can reuse the KV of turn t-1;
  4. prints every answer with prompt_tokens, cached_tokens (from the usage report) and
     TTFT (send -> first streamed text), then a summary: token-level prefix-cache hit
     rate, the best hit rate achievable on this trace, TTFT per turn index;
  5. stops the server (SIGTERM, wait) and exits non-zero if a request failed or the
     server did not exit with status 0.

Best achievable hit rate (what a perfect, unbounded paged cache could reuse):

    turn t-1 computed KV:  [ prompt_{t-1} ........ | answer_{t-1}[:-1] ]
    turn t   prompt:       [ prompt_{t-1} ........ | answer_{t-1} | user_t ]
                            |<- page-aligned common prefix ->|  ... at most prompt_t - 1

The last answer token is sampled but never run through the model, and the last prompt
token must be computed for its logits. The bound is taken over every sequence available
when the turn was sent (the prompts of requests sent earlier, the prompt+answer of requests
finished earlier; e.g. other chats' shared system prompt), starting from an empty cache
(use ``--flush-cache`` with ``--url``). The OpenAI API returns text, not token ids, so the
answers are re-tokenised: where that differs from the generated ids (e.g. "\n\n" generated
as one token re-encodes as two), the next prompt diverges from the computed KV there, so
the bound is approximate in both directions: a turn can show a hit rate a little above its
bound (the totals over a run agree).

The benchmark ``bench/cpu/bench_cpu.py`` imports this module; keep one replay implementation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import openai
from tqdm import tqdm

from radixlm.runtime.bench.server_process import ServerProcess
from radixlm.runtime.bench.sharegpt import iter_records

__all__ = [
    "Conversation",
    "ReplayConfig",
    "TurnResult",
    "TurnStats",
    "Summary",
    "add_replay_args",
    "config_from_args",
    "launched_server",
    "model_info",
    "flush_cache",
    "load_tokenizer",
    "select_conversations",
    "turn_messages",
    "replay",
    "fill_best_cached",
    "summarize",
    "format_turn",
    "format_summary",
    "run_replay",
]

REQUEST_TIMEOUT_S = 600.0
ANSWER_PREVIEW_CHARS = 110


# ----------------------------------------------------------------------------- types
@dataclass(frozen=True)
class ReplayConfig:
    """What to replay and how hard to drive the server."""

    num_conversations: int = 20
    max_turns: int = 4
    max_tokens: int = 48
    concurrency: int = 4
    seed: int = 0
    max_first_turn_tokens: int = 200
    max_turn_tokens: int = 400
    min_ascii_fraction: float = 0.9


@dataclass(frozen=True)
class Conversation:
    index: int
    id: str
    user_turns: tuple[str, ...]


@dataclass
class TurnResult:
    conversation: int
    conversation_id: str
    turn: int  # 1-based
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    finish_reason: str | None = None
    answer: str = ""
    error: str | None = None
    sent_at: float = 0.0
    done_at: float = 0.0
    best_cached_tokens: int | None = None  # filled by fill_best_cached

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class TurnStats:
    turn: int
    count: int
    mean_ttft_s: float
    median_ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    best_cached_tokens: int


@dataclass(frozen=True)
class Summary:
    conversations: int
    turns: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    best_cached_tokens: int
    per_turn: list[TurnStats] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    @property
    def best_hit_rate(self) -> float:
        return self.best_cached_tokens / max(self.prompt_tokens, 1)


# ----------------------------------------------------------------------------- server
@contextlib.contextmanager
def launched_server(
    server_args: list[str], log: IO[str]
) -> Iterator[tuple[str, Callable[[], int]]]:
    """Start ``launch_server`` on a free port; yields ``(url, stop)`` where ``stop()``
    shuts it down and returns its exit code (called on exit if the caller did not)."""
    with ServerProcess.launch(["--log-level", "warning", *server_args], log=log) as srv:
        yield srv.url, srv.stop


def model_info(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/get_model_info", timeout=30)
    r.raise_for_status()
    return r.json()


def flush_cache(url: str) -> None:
    """Drop the server's cached prefixes (refused while requests are running)."""
    r = httpx.post(f"{url}/flush_cache", timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache failed: {r.text}")


def load_tokenizer(info: dict[str, Any]) -> Any:
    """The server's own tokenizer (``/get_model_info``'s local ``tokenizer_path``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(info["tokenizer_path"])


# ----------------------------------------------------------------------------- data
def _human_turns(record: dict[str, Any], max_turns: int) -> list[str] | None:
    """The first ``max_turns`` human messages, or None if the chat does not start with
    a human or has fewer than two."""
    turns = record.get("conversations") or []
    if not turns or turns[0].get("from") not in ("human", "user"):
        return None
    humans = [t.get("value") or "" for t in turns if t.get("from") in ("human", "user")]
    return humans[:max_turns] if len(humans) >= 2 else None


def _ascii_fraction(text: str) -> float:
    return sum(c.isascii() for c in text) / max(len(text), 1)


def _usable_turns(turns: list[str], tokenizer: Any, cfg: ReplayConfig) -> list[str] | None:
    """Turns up to the first empty, over-long or non-ASCII-heavy one; None if fewer than
    two remain or the first is longer than ``max_first_turn_tokens``."""
    kept: list[str] = []
    for i, text in enumerate(turns):
        limit = cfg.max_first_turn_tokens if i == 0 else cfg.max_turn_tokens
        if not text.strip() or _ascii_fraction(text) < cfg.min_ascii_fraction:
            break
        if len(tokenizer.encode(text, add_special_tokens=False)) >= limit:
            break
        kept.append(text)
    return kept if len(kept) >= 2 else None


def select_conversations(tokenizer: Any, cfg: ReplayConfig) -> list[Conversation]:
    """``cfg.num_conversations`` conversations, chosen by a seeded shuffle."""
    candidates = []
    for record in iter_records():
        turns = _human_turns(record, cfg.max_turns)
        if turns and len(turns[0]) <= 8 * cfg.max_first_turn_tokens:  # cheap pre-filter
            candidates.append((str(record.get("id")), turns))
    random.Random(cfg.seed).shuffle(candidates)
    chosen: list[Conversation] = []
    for cid, turns in candidates:
        usable = _usable_turns(turns, tokenizer, cfg)
        if usable:
            chosen.append(Conversation(len(chosen), cid, tuple(usable)))
            if len(chosen) == cfg.num_conversations:
                break
    return chosen


# ----------------------------------------------------------------------------- replay
def turn_messages(conv: Conversation, answers: list[str], turn: int) -> list[dict[str, str]]:
    """Turn ``turn``'s (1-based) messages: user 1, answer 1, ..., user ``turn``."""
    messages = []
    for i in range(turn):
        messages.append({"role": "user", "content": conv.user_turns[i]})
        if i < turn - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def _stream_turn(
    client: openai.OpenAI,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    result: TurnResult,
) -> None:
    """One streamed chat completion; fills ``result`` (TTFT = send -> first text)."""
    result.sent_at = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if not parts:
                    result.ttft_s = time.perf_counter() - result.sent_at
                parts.append(choice.delta.content)
            result.finish_reason = choice.finish_reason or result.finish_reason
    result.done_at = time.perf_counter()
    result.latency_s = result.done_at - result.sent_at
    result.answer = "".join(parts)
    if usage is None:
        raise RuntimeError("the stream carried no usage report")
    details = usage.prompt_tokens_details
    result.prompt_tokens, result.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    result.cached_tokens = (details.cached_tokens or 0) if details else 0


def _replay_conversation(
    client: openai.OpenAI,
    model: str,
    conv: Conversation,
    max_tokens: int,
    on_turn: Callable[[TurnResult], None],
) -> list[TurnResult]:
    """Turns of one conversation in order; stops at the first failed turn."""
    results: list[TurnResult] = []
    answers: list[str] = []
    for turn in range(1, len(conv.user_turns) + 1):
        result = TurnResult(conv.index, conv.id, turn)
        try:
            _stream_turn(client, model, turn_messages(conv, answers, turn), max_tokens, result)
        except Exception as exc:  # report every failure, keep the other conversations going
            result.error = f"{type(exc).__name__}: {exc}"
        results.append(result)
        on_turn(result)
        if not result.ok:
            break
        answers.append(result.answer)
    return results


def replay(
    url: str,
    conversations: list[Conversation],
    cfg: ReplayConfig,
    on_turn: Callable[[TurnResult], None] | None = None,
    progress: bool = True,
) -> list[TurnResult]:
    """Replay every conversation, ``cfg.concurrency`` at a time; results in
    (conversation, turn) order."""
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    model = client.models.list().data[0].id
    total = sum(len(c.user_turns) for c in conversations)
    lock = threading.Lock()
    # disable=None: no bar when stderr is not a terminal (its redraws would interleave with the answers)
    with tqdm(total=total, unit="turn", desc="replay", disable=None if progress else True) as bar:

        def done(result: TurnResult) -> None:
            with lock:
                if on_turn is not None:
                    on_turn(result)
                bar.update(1)

        with ThreadPoolExecutor(max_workers=cfg.concurrency) as pool:
            futures = [
                pool.submit(_replay_conversation, client, model, c, cfg.max_tokens, done)
                for c in conversations
            ]
            return [r for f in futures for r in f.result()]


# ----------------------------------------------------------------------------- best achievable
class _PagedPrefixes:
    """Page-aligned prefixes of token sequences, as chained page hashes (what a perfect
    unbounded paged radix cache would hold)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.keys: set[int] = set()

    def _chain(self, ids: list[int]) -> Iterator[int]:
        key, ps = 0, self.page_size
        for start in range(0, len(ids) - ps + 1, ps):
            key = hash((key, tuple(ids[start : start + ps])))
            yield key

    def add(self, ids: list[int]) -> None:
        self.keys.update(self._chain(ids))

    def match(self, ids: list[int]) -> int:
        """Longest cached page-aligned prefix of ``ids``, in tokens."""
        pages = 0
        for key in self._chain(ids):
            if key not in self.keys:
                break
            pages += 1
        return pages * self.page_size


def _prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def _computed_ids(tokenizer: Any, prompt: list[int], r: TurnResult) -> list[int]:
    """Tokens whose KV the server computed for turn ``r``: prompt + answer minus the last
    sampled token (EOS included when the model stopped by itself)."""
    answer = tokenizer.encode(r.answer, add_special_tokens=False)
    if r.finish_reason == "stop" and len(answer) < r.completion_tokens:
        answer.append(tokenizer.eos_token_id)
    return prompt + answer[:-1]


def fill_best_cached(
    results: list[TurnResult], conversations: list[Conversation], tokenizer: Any, page_size: int
) -> int:
    """Set ``best_cached_tokens`` of every successful turn; returns how many prompts the
    local template rendered to a different length than the server reported (expect 0)."""
    answers = {(r.conversation, r.turn): r.answer for r in results}
    ok = [r for r in results if r.ok]
    prompts = {}
    for r in ok:
        conv = conversations[r.conversation]
        history = [answers[(r.conversation, t)] for t in range(1, r.turn)]
        prompts[id(r)] = _prompt_ids(tokenizer, turn_messages(conv, history, r.turn))
    # events: a prompt is available once sent (0), its prompt+answer once done (1);
    # at one instant: look up (2) before anything becomes available (1, 0)
    events = [(r.sent_at, 0, r) for r in ok] + [(r.done_at, 1, r) for r in ok]
    events += [(r.sent_at, 2, r) for r in ok]
    cache = _PagedPrefixes(page_size)
    for _, kind, r in sorted(events, key=lambda e: (e[0], -e[1])):
        prompt = prompts[id(r)]
        if kind == 2:
            limit = (len(prompt) - 1) // page_size * page_size
            r.best_cached_tokens = min(cache.match(prompt), limit)
        else:
            cache.add(prompt if kind == 0 else _computed_ids(tokenizer, prompt, r))
    return sum(len(prompts[id(r)]) != r.prompt_tokens for r in ok)


# ----------------------------------------------------------------------------- summary
def _turn_stats(turn: int, rs: list[TurnResult]) -> TurnStats:
    ttfts = [r.ttft_s for r in rs]
    return TurnStats(
        turn,
        len(rs),
        statistics.fmean(ttfts),
        statistics.median(ttfts),
        sum(r.prompt_tokens for r in rs),
        sum(r.cached_tokens for r in rs),
        sum(r.best_cached_tokens or 0 for r in rs),
    )


def summarize(results: list[TurnResult]) -> Summary:
    ok = [r for r in results if r.ok and r.ttft_s == r.ttft_s]  # a turn with no text has no TTFT
    turns = sorted({r.turn for r in ok})
    per_turn = [_turn_stats(t, [r for r in ok if r.turn == t]) for t in turns]
    good = [r for r in results if r.ok]
    return Summary(
        conversations=len({r.conversation for r in results}),
        turns=len(results),
        failed=len(results) - len(good),
        prompt_tokens=sum(r.prompt_tokens for r in good),
        cached_tokens=sum(r.cached_tokens for r in good),
        best_cached_tokens=sum(r.best_cached_tokens or 0 for r in good),
        per_turn=per_turn,
    )


def format_turn(r: TurnResult) -> str:
    head = (
        f"conv {r.conversation:02d} turn {r.turn} prompt_tokens={r.prompt_tokens} "
        f"cached_tokens={r.cached_tokens} ttft={r.ttft_s:.3f}s"
    )
    if not r.ok:
        return f"{head} FAILED: {r.error}"
    text = " ".join(r.answer.split())
    if len(text) > ANSWER_PREVIEW_CHARS:
        text = text[: ANSWER_PREVIEW_CHARS - 3] + "..."
    return f"{head} | {text}"


def format_summary(s: Summary) -> str:
    lines = [
        "",
        "| turn | requests | mean TTFT (s) | median TTFT (s) | prompt tokens | "
        "cached | hit rate | best achievable |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in s.per_turn:
        lines.append(
            f"| {t.turn} | {t.count} | {t.mean_ttft_s:.3f} | {t.median_ttft_s:.3f} | "
            f"{t.prompt_tokens} | {t.cached_tokens} | "
            f"{t.cached_tokens / max(t.prompt_tokens, 1):.1%} | "
            f"{t.best_cached_tokens / max(t.prompt_tokens, 1):.1%} |"
        )
    ratio = s.cached_tokens / max(s.best_cached_tokens, 1)
    lines.append(
        f"summary: {s.conversations} conversations, {s.turns} turns, {s.failed} failed; "
        f"prefix-cache hit rate {s.hit_rate:.1%} ({s.cached_tokens}/{s.prompt_tokens} "
        f"prompt tokens), best achievable {s.best_hit_rate:.1%} "
        f"({ratio:.1%} of best)"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def add_replay_args(p: argparse.ArgumentParser) -> None:
    """The replay flags (shared with bench/cpu/bench_cpu.py); defaults from ReplayConfig."""
    d = ReplayConfig()
    p.add_argument("--num-conversations", type=int, default=d.num_conversations)
    p.add_argument("--max-turns", type=int, default=d.max_turns)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per turn")
    p.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help="conversations replayed at the same time (client threads)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="conversation sampling seed")
    p.add_argument("--max-first-turn-tokens", type=int, default=d.max_first_turn_tokens)
    p.add_argument(
        "--max-turn-tokens",
        type=int,
        default=d.max_turn_tokens,
        help="a conversation is cut before its first longer user message",
    )


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    return ReplayConfig(
        num_conversations=args.num_conversations,
        max_turns=args.max_turns,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        seed=args.seed,
        max_first_turn_tokens=args.max_first_turn_tokens,
        max_turn_tokens=args.max_turn_tokens,
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--url", help="use this running server instead of starting one")
    p.add_argument(
        "--server-args",
        default="",
        help='extra launch_server flags, e.g. "--disable-radix-cache" (port is chosen here)',
    )
    p.add_argument("--server-log", help="server output file (default: a temporary file)")
    p.add_argument("--output", help="write one JSON line per turn to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--flush-cache",
        action="store_true",
        help="POST /flush_cache first, so the hit rate is comparable with the bound",
    )
    add_replay_args(p)
    return p.parse_args(argv)


def run_replay(
    url: str,
    cfg: ReplayConfig,
    on_turn: Callable[[TurnResult], None] | None = None,
    progress: bool = True,
) -> tuple[list[TurnResult], Summary]:
    """Select conversations with the server's tokenizer, replay them, compute the bound."""
    info = model_info(url)
    tokenizer = load_tokenizer(info)
    start = time.perf_counter()
    conversations = select_conversations(tokenizer, cfg)
    print(
        f"selected {len(conversations)} ShareGPT conversations "
        f"({sum(len(c.user_turns) for c in conversations)} turns) in "
        f"{time.perf_counter() - start:.1f} s",
        flush=True,
    )
    results = replay(url, conversations, cfg, on_turn, progress)
    mismatched = fill_best_cached(results, conversations, tokenizer, info["page_size"])
    if mismatched:
        print(
            f"warning: {mismatched} prompts rendered locally to a different token count "
            "than the server reported; the best-achievable bound is approximate",
            file=sys.stderr,
        )
    return results, summarize(results)


def _write_jsonl(path: str, results: list[TurnResult]) -> None:
    with open(path, "w") as f:
        for r in results:
            f.write(json.dumps(asdict(r)) + "\n")


def _run(url: str, args: argparse.Namespace) -> tuple[list[TurnResult], Summary]:
    def show(r: TurnResult) -> None:
        tqdm.write(format_turn(r))

    if args.flush_cache:
        flush_cache(url)
    results, summary = run_replay(url, config_from_args(args), show, not args.no_progress)
    print(format_summary(summary), flush=True)
    if args.output:
        _write_jsonl(args.output, results)
    return results, summary


def _run_with_own_server(args: argparse.Namespace) -> int:
    own_log = not args.server_log  # a temporary log, removed after a clean run
    log_path = args.server_log or tempfile.mkstemp(prefix="radixlm-server-", suffix=".log")[1]
    print(f"starting the server (log: {log_path}) ...", flush=True)
    try:
        with (
            open(log_path, "w") as log,
            launched_server(shlex.split(args.server_args), log) as (url, stop),
        ):
            print(f"server ready at {url}", flush=True)
            summary = _run(url, args)[1]
            code = stop()
    except RuntimeError as exc:  # start-up failed
        tail = Path(log_path).read_text(errors="replace")[-3000:]
        print(f"error: {exc}\n--- server log tail ---\n{tail}", file=sys.stderr)
        return 1
    print(f"server stopped (exit code {code}{'' if code == 0 else ', NOT clean'})")
    failed = bool(summary.failed) or code != 0
    if own_log and not failed:
        Path(log_path).unlink(missing_ok=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.url:
        return 1 if _run(args.url.rstrip("/"), args)[1].failed else 0
    return _run_with_own_server(args)


if __name__ == "__main__":
    sys.exit(main())
