"""Replay multi-turn conversations through an OpenAI-compatible chat endpoint with the
official ``openai`` client: each turn sends the whole history (the server's own earlier
replies included) plus the next user message, streamed, greedy, exactly ``output_len``
tokens (``ignore_eos``). Workers take conversations from a shared queue, so up to
``workers`` turns are in flight; ``think_time_s`` > 0 puts an exponential pause of that mean
(seeded per conversation) before each later turn, as a user reading the reply. Per turn: the reply, time to first token, latency, prompt
and cached tokens (``usage.prompt_tokens_details.cached_tokens``). Used by the Ray Serve
tests and bench/serving/ray_router.py.
"""

from __future__ import annotations

import queue
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["TurnResult", "replay_chats", "summarize"]


@dataclass
class TurnResult:
    conversation: int
    turn: int
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None  # seconds to the first content chunk
    latency_s: float = 0.0
    error: str | None = None


def replay_chats(base_url: str, conversations: Sequence[Sequence[str]], output_len: int, workers: int = 4,
                 headers: dict[str, str] | None = None, model: str = "default",
                 timeout_s: float = 600.0, think_time_s: float = 0.0, seed: int = 0) -> list[TurnResult]:
    """Replay ``conversations`` (each a list of user messages) against ``base_url`` (the
    server root; ``/v1`` is added). Returns every turn's result, by conversation then turn;
    a failed turn ends its conversation (``error`` set)."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", default_headers=headers or {},
                           max_retries=0, timeout=timeout_s)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(conversations)):
        todo.put(index)
    results: dict[int, list[TurnResult]] = {}

    def work() -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            pauses = random.Random(seed * 100_003 + index)
            results[index] = _converse(client, model, index, conversations[index], output_len,
                                       lambda pauses=pauses: pauses.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [turn for index in sorted(results) for turn in results[index]]


def _converse(client, model: str, index: int, users: Sequence[str], output_len: int,
              think: Callable[[], float]) -> list[TurnResult]:
    history: list[dict[str, str]] = []
    out = []
    for turn, user in enumerate(users):
        if turn:
            time.sleep(think())
        history.append({"role": "user", "content": user})
        result = TurnResult(index, turn)
        start = time.perf_counter()
        pieces: list[str] = []
        try:
            stream = client.chat.completions.create(
                model=model, messages=history, max_tokens=output_len, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    pieces.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    result.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
        except Exception as exc:  # an HTTP error or an error event mid-stream
            result.error = f"{type(exc).__name__}: {exc}"
        result.latency_s = time.perf_counter() - start
        result.text = "".join(pieces)
        out.append(result)
        if result.error is not None:
            break
        history.append({"role": "assistant", "content": result.text})
    return out


def summarize(results: Sequence[TurnResult]) -> dict[str, float | int | None]:
    """Turns, failures, prefix-cache hit rate (cached / prompt tokens over the turns that
    succeeded), and TTFT median / p90 in ms."""
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    ttfts = sorted(r.ttft_s * 1e3 for r in ok if r.ttft_s is not None)
    return {"turns": len(results), "failed": len(results) - len(ok),
            "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in ok),
            "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
            "median_ttft_ms": statistics.median(ttfts) if ttfts else None,
            "p90_ttft_ms": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None}
