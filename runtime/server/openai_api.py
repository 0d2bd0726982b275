"""OpenAI-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``; the official ``openai`` client drives them unchanged.

Policies (documented in docs/SERVING.md):
- ``max_tokens`` (and ``max_completion_tokens``) must be >= 1; a request whose prompt +
  ``max_tokens`` exceeds the context is clamped to the context (``finish_reason="length"``).
- ``usage.prompt_tokens`` counts each prompt once, whatever ``n``;
  ``completion_tokens`` sums over choices; ``prompt_tokens_details.cached_tokens`` is
  the prompt tokens that choice 0 reused from the radix cache (what an n=1 request would
  report), summed over prompts.
- ``stream_options.include_usage``: one extra chunk with ``choices: []`` and the usage,
  just before ``data: [DONE]``; every other chunk then carries ``usage: null``.
  ``stream_options`` with ``stream=false`` is ignored.
- The ``developer`` role is rendered as ``system``; unknown roles are HTTP 400.
- ``/v1/completions`` ``echo`` (OpenAI / vLLM semantics): each choice's text starts with
  the prompt (a string prompt as given, a token prompt decoded); with ``logprobs`` the
  prompt tokens come first in ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
  ``text_offset``, the first token's logprob and top logprobs null. ``max_tokens=0``
  (only with ``echo``) scores the prompt: ``finish_reason`` "length", no completion
  tokens. Prompt logprobs are computed, not read from the radix cache. A streamed choice
  carries the echo in its first chunk. ``text_offset`` counts the characters of the
  tokens' strings (as vLLM does), streamed or not.
- A sample the server aborts with a reason (a stop_regex search that timed out, a grammar
  that failed to compile, an internal error): without streaming the response is that
  error (HTTP 400, or 500 for an internal error); streamed, the choice's last chunk
  (``finish_reason`` "abort", as vLLM reports aborts) is followed by an error event, and
  the stream still ends with ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.server.http_common import (
    CLIENT_CLOSED,
    SSE_DONE,
    HeldStream,
    collect_until_disconnect,
    error_response,
    sse,
)
from radixlm.runtime.server.metrics import Metrics
from radixlm.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from radixlm.runtime.server.tokenizer_manager import (
    Generation,
    GenInput,
    InvalidRequest,
    SampleChunk,
    SchedulerDied,
    TokenizerManager,
    check_unicode_in,
)
from radixlm.runtime.server.tool_calling import ToolCallStream, ToolPlan, plan_tools, render_chat

__all__ = ["install_openai_routes"]


def _check_model(tm: TokenizerManager, name: str) -> None:
    if name not in _model_names(tm):
        raise InvalidRequest(f"model {name!r} does not exist; this server serves {tm.model_name!r}", "model")


def _model_names(tm: TokenizerManager) -> set[str]:
    return {tm.model_name, "default", tm.ready.model_dir}


def _finish(c: SampleChunk) -> str:
    return "stop" if c.finish_reason == "stop" else "length" if c.finish_reason == "length" else "abort"


def _abort_error(c: SampleChunk | None) -> dict[str, Any] | None:
    """The OpenAI error body of a sample the server aborted with a reason, else None: an
    internal error is a 500 ``server_error``, the others (stop_regex timeout, grammar
    failed to compile) the request's fault, a 400 ``invalid_request_error``."""
    if c is None or c.finish_reason != "abort" or not c.error:
        return None
    internal = c.error.startswith("internal error")
    return {"message": c.error, "type": "server_error" if internal else "invalid_request_error",
            "param": None, "code": 500 if internal else 400}


def _failed(choices: list[_Choice]) -> JSONResponse | None:
    """The error response of a non-streamed request one of whose samples was aborted with
    a reason (``_abort_error``), else None."""
    for ch in choices:
        err = _abort_error(ch.last)
        if err is not None:
            return error_response(err["code"], err["message"], err_type=err["type"])
    return None


class _Choice:
    """Accumulates one choice (one sample of one prompt); ``echo`` = (prompt text, prompt
    ids) goes in front, with the prompt logprobs of the sample's first chunk."""

    def __init__(self, index: int, echo: tuple[str, list[int]] | None = None) -> None:
        self.index = index
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.top: list[list[tuple[int, float]] | None] = []
        self.last: SampleChunk | None = None
        self.echo = echo

    def add(self, c: SampleChunk) -> None:
        if self.echo is not None:  # c is the sample's first chunk: it carries the prompt logprobs
            (self.text, ids), self.echo = self.echo, None
            self.ids = list(ids)  # one logprob per prompt token (the scheduler may report more)
            self.logprobs = list(c.prompt_logprobs or [])[: len(ids)]
            self.top = list(c.prompt_top_logprobs or [])[: len(ids)]
        self.text += c.text
        self.ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.top += c.top_logprobs or []
        self.last = c


class _Usage:
    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0

    def add(self, c: SampleChunk) -> None:
        if c.finished:
            self.completion += c.completion_tokens
            if c.index == 0:
                self.prompt += c.prompt_tokens
                self.cached += c.cached_tokens

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}


# ----------------------------------------------------------------------------- logprobs
def _tok(tm: TokenizerManager, tid: int) -> str:
    return tm.tokenizer.decode([tid])


def _completion_logprobs(tm: TokenizerManager, ids: list[int], lps: list[float | None], tops: list | None,
                         offset: int) -> tuple[dict[str, Any], int]:
    """The legacy ``logprobs`` object of ``ids`` (``text_offset`` from ``offset`` on) and
    the offset after the last token. A None entry (the first prompt token) stays null;
    ``tops`` None (``logprobs: 0``, no alternatives asked for) gives ``top_logprobs`` null,
    a list (possibly empty, as in a stream's last chunk) gives a list."""
    tokens = [_tok(tm, t) for t in ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = None if tops is None else [None if t is None else {_tok(tm, i): lp for i, lp in t} for t in tops]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}, pos


def _chat_logprobs(tm: TokenizerManager, ids: list[int], lps: list[float], tops: list) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = _tok(tm, tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for k, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
        e = entry(tid, lp)
        e["top_logprobs"] = [entry(i, v) for i, v in tops[k]] if k < len(tops) else []
        content.append(e)
    return {"content": content}


# ----------------------------------------------------------------------------- requests
def _completion_prompts(tm: TokenizerManager, prompt: Any) -> list[tuple[list[int], str | None]]:
    """(ids, text) per prompt; ``text`` None for a token prompt (decoded only for echo)."""
    if isinstance(prompt, str):
        return [(tm.encode(prompt, "prompt"), prompt)]
    if not prompt:
        raise InvalidRequest("prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        return [(list(prompt), None)]
    if isinstance(prompt[0], str):
        return [(tm.encode(p), p) for p in prompt]
    return [(list(p), None) for p in prompt]


Echo = tuple[str, list[int]] | None  # (prompt text, prompt ids) put in front of each choice


def _completion_gens(tm: TokenizerManager, body: CompletionRequest) -> tuple[list[GenInput], list[Echo]]:
    _check_model(tm, body.model)
    gens, echoes = [], []
    prompt_logprobs = body.echo and body.logprobs is not None
    for ids, text in _completion_prompts(tm, body.prompt):
        gen = GenInput(input_ids=ids, sampling=body.to_sampling(body.max_tokens), n=body.n,
                       return_logprob=body.logprobs is not None, top_logprobs_num=body.logprobs or 0,
                       logprob_start_len=0 if prompt_logprobs else -1, stream=body.stream)
        gens.append(tm.validate(gen, "prompt"))
        echoes.append((tm.tokenizer.decode(ids) if text is None else text, ids) if body.echo else None)
    return gens, echoes


def _chat_gen(tm: TokenizerManager, body: ChatCompletionRequest) -> tuple[GenInput, ToolPlan | None]:
    _check_model(tm, body.model)
    check_unicode_in([t.model_dump() for t in body.tools or ()], "tools")  # before they join the messages
    messages, tools = render_chat(body, tm.tool_format, tm.tokenizer.chat_template)
    ids = tm.apply_chat_template(messages, body.add_generation_prompt, tools)
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, tm.tool_format)
    max_new = body.max_new_tokens or tm.context_length  # clamped to the context by validate()
    sampling = body.to_sampling(max_new)
    if plan is not None:
        sampling = msgspec.structs.replace(sampling, structural_tag=plan.grammar)
    gen = GenInput(input_ids=ids, sampling=sampling, n=body.n,
                   return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0,
                   stream=body.stream)
    return tm.validate(gen, "messages"), plan


# ----------------------------------------------------------------------------- routes
def install_openai_routes(app: FastAPI, tm: TokenizerManager, metrics: Metrics) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": tm.model_name, "object": "model", "created": 0, "owned_by": "radixlm",
                "root": tm.ready.model_dir, "max_model_len": tm.context_length}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gens, echoes = _completion_gens(tm, body)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            ticket, generation = tm.start(gens)
            return HeldStream(_stream(tm, metrics, generation, gens, body, rid, created, chat=False, echoes=echoes),
                              ticket)
        with tm.admit(gens):
            done = await _run_all(tm, metrics, gens, request, echoes)
        if done is None:
            return Response(status_code=CLIENT_CLOSED)
        choices, usage = done
        if (failed := _failed(choices)) is not None:
            return failed
        out = []
        for ch in choices:
            lp = (_completion_logprobs(tm, ch.ids, ch.logprobs, ch.top if body.logprobs else None, 0)[0]
                  if body.logprobs is not None else None)
            out.append({"index": ch.index, "text": ch.text, "logprobs": lp, "finish_reason": _finish(ch.last)})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": tm.model_name, "choices": out, "usage": usage.body()})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        gen, plan = _chat_gen(tm, body)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            ticket, generation = tm.start([gen])
            return HeldStream(_stream(tm, metrics, generation, [gen], body, rid, created, chat=True, plan=plan),
                              ticket)
        with tm.admit([gen]):
            done = await _run_all(tm, metrics, [gen], request)
        if done is None:
            return Response(status_code=CLIENT_CLOSED)
        choices, usage = done
        if (failed := _failed(choices)) is not None:
            return failed
        out = []
        for ch in choices:
            lp = _chat_logprobs(tm, ch.ids, ch.logprobs, ch.top) if body.logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": ch.text}
            finish = _finish(ch.last)
            if plan is not None:
                message["content"], calls = plan.message(ch.text)
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            out.append({"index": ch.index, "message": message, "logprobs": lp, "finish_reason": finish})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                             "model": tm.model_name, "choices": out, "usage": usage.body()})


async def _run_all(tm: TokenizerManager, metrics: Metrics, gens: list[GenInput], request: Request,
                   echoes: list[Echo] | None = None) -> tuple[list[_Choice], _Usage] | None:
    """Run every prompt's samples; None if the client disconnected."""
    choices: list[_Choice] = []
    usage = _Usage()
    for k, gen in enumerate(gens):
        base = len(choices)
        choices += [_Choice(base + i, echoes[k] if echoes else None) for i in range(gen.n)]
        chunks = await collect_until_disconnect(request, tm.generate(gen))
        if chunks is None:
            return None
        for c in chunks:
            choices[base + c.index].add(c)
            usage.add(c)
            metrics.observe_chunk(gen, c)
    return choices, usage


async def _stream(tm: TokenizerManager, metrics: Metrics, generation: Generation, gens: list[GenInput],
                  body: Any, rid: str, created: int, chat: bool, echoes: list[Echo] | None = None,
                  plan: ToolPlan | None = None) -> AsyncIterator[bytes]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage = _Usage()

    def chunk(choice: dict[str, Any]) -> bytes:
        payload = {"id": rid, "object": obj, "created": created, "model": tm.model_name, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    bases = list(itertools.accumulate((gen.n for gen in gens), initial=0))
    offsets = [[0] * gen.n for gen in gens]
    pending = [[_Choice(i, echoes[k] if echoes else None) for i in range(gen.n)]  # tokens not yet sent
               for k, gen in enumerate(gens)]
    calls = [ToolCallStream(plan.fmt) for _ in range(bases[-1])] if plan is not None else None
    try:
        if chat:
            for i in range(bases[-1]):
                # with tools, content stays null unless text comes (as in an unstreamed reply)
                yield chunk({"index": i, "delta": {"role": "assistant", "content": None if calls else ""},
                             "logprobs": None, "finish_reason": None})
        # the prompts of a batch run concurrently; chunks interleave, each with its index
        async with contextlib.aclosing(generation) as chunks:
            async for k, c in chunks:
                metrics.observe_chunk(gens[k], c)
                usage.add(c)
                p = pending[k][c.index]
                p.add(c)
                if calls is not None:  # chat with tools: content and calls out of the text
                    for piece in _tool_pieces(tm, body, p, bases[k], calls[bases[k] + c.index], c):
                        yield chunk(piece)
                    if p.last is None:  # its tokens went out with a piece
                        pending[k][c.index] = _Choice(c.index)
                    if c.finished and (err := _abort_error(c)) is not None:
                        yield sse({"error": err})
                    continue
                if p.text:
                    yield chunk(_stream_choice(tm, body, p, bases[k], offsets[k], chat, None))
                    pending[k][c.index] = p = _Choice(c.index)
                if c.finished:
                    yield chunk(_stream_choice(tm, body, p, bases[k], offsets[k], chat, _finish(c)))
                    if (err := _abort_error(c)) is not None:  # aborted with a reason: say why
                        yield sse({"error": err})
    except SchedulerDied as exc:  # an error event, then [DONE] (as vLLM ends a failed stream)
        yield sse({"error": {"message": str(exc), "type": "server_error", "code": 503}})
        yield SSE_DONE
        return
    except InvalidRequest as exc:
        yield sse({"error": {"message": exc.message, "type": "invalid_request_error", "param": exc.param,
                             "code": 400}})
        yield SSE_DONE
        return
    if include_usage:
        yield sse({"id": rid, "object": obj, "created": created, "model": tm.model_name,
                   "choices": [], "usage": usage.body()})
    yield SSE_DONE


def _tool_pieces(tm: TokenizerManager, body: Any, p: _Choice, base: int, stream: ToolCallStream,
                 c: SampleChunk) -> list[dict[str, Any]]:
    """The streamed choices for chunk ``c`` of a chat with tools: one per delta of
    ``stream`` (the first carries the logprobs of ``p``'s tokens), and the last one with
    the finish reason ("tool_calls" once a call was sent). Clears ``p.last`` when its
    tokens were sent."""
    deltas = stream.push(c.text, c.finished)
    finish = None
    if c.finished:
        finish = "tool_calls" if stream.called and _finish(c) == "stop" else _finish(c)
        deltas.append({})
    out = []
    for i, delta in enumerate(deltas):
        lp = _chat_logprobs(tm, p.ids, p.logprobs, p.top) if body.logprobs and i == 0 else None
        out.append({"index": base + p.index, "delta": delta, "logprobs": lp,
                    "finish_reason": finish if i == len(deltas) - 1 else None})
    if out:
        p.last = None
    return out


def _stream_choice(tm: TokenizerManager, body: Any, p: _Choice, base: int, offsets: list[int],
                   chat: bool, finish: str | None) -> dict[str, Any]:
    """One streamed choice carrying ``p``'s text and the logprobs of its tokens (moves
    ``offsets[p.index]`` past them)."""
    if chat:
        lp = _chat_logprobs(tm, p.ids, p.logprobs, p.top) if body.logprobs else None
        delta = {"content": p.text} if p.text else {}
        return {"index": base + p.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    lp = None
    if body.logprobs is not None:
        lp, offsets[p.index] = _completion_logprobs(tm, p.ids, p.logprobs, p.top if body.logprobs else None,
                                                    offsets[p.index])
    return {"index": base + p.index, "text": p.text, "logprobs": lp, "finish_reason": finish}
