"""The HTTP app (FastAPI): native routes here, OpenAI routes in openai_api.py.

Native API (SGLang field names): ``POST /generate``, ``GET /health``,
``GET /health_generate``, ``GET /get_model_info``, ``GET /get_server_info``,
``POST /flush_cache``, ``GET /metrics`` (Prometheus).
Every error is JSON: ``{"error": {"message", "type", "param", "code"}}``; malformed
JSON and wrong types are HTTP 400 (FastAPI's 422 is mapped to 400, as OpenAI does).

Guards, in the order a request meets them:
1. ``ApiKeyMiddleware`` (``--api-key``): every path except ``/health`` (the OpenAPI docs
   and ``/metrics`` included) needs ``Authorization: Bearer <key>``, compared in constant
   time; otherwise 401 with ``WWW-Authenticate: Bearer``.
2. ``BodyLimitMiddleware`` (``--max-request-body-bytes``): 413 for a body over the limit,
   before it is read: a ``Content-Length`` over it is refused before the app runs; a
   chunked body is counted as it is read and the read crossing the limit raises
   ``BodyTooLarge`` (an HTTPException: FastAPI's body parser hands it to the JSON handler).
3. Body validation (400), then admission (``--max-queued-requests``): 429 with
   ``Retry-After`` (``TokenizerManager.admit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import orjson
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import radixlm
from radixlm.runtime.messages import SchedulerStats
from radixlm.runtime.metrics import Metrics
from radixlm.runtime.protocol import GenerateRequest
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.tokenizer_manager import (
    Generation,
    GenInput,
    InvalidRequest,
    QueueFull,
    SampleChunk,
    SchedulerDied,
    Ticket,
    TokenizerManager,
)

__all__ = ["create_app", "error_response", "sse", "collect_until_disconnect", "HeldStream",
           "ApiKeyMiddleware", "BodyLimitMiddleware", "BodyTooLarge", "PUBLIC_PATHS", "api_error",
           "native_generate", "native_generate_stream", "flush_radix_cache", "model_info"]

PUBLIC_PATHS = frozenset({"/health"})  # reachable without the API key (liveness probes)
VERSION = radixlm.__version__  # not importlib.metadata: a checkout on PYTHONPATH has none


def error_response(status: int, message: str, param: str | None = None,
                   err_type: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


# --------------------------------------------------------------------------- guards
class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer <api_key>`` (paths in PUBLIC_PATHS are open)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        problem = self._problem(Headers(scope=scope).get("authorization"))
        if problem is None:
            return await self.app(scope, receive, send)
        response = error_response(401, problem, err_type="authentication_error",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _problem(self, header: str | None) -> str | None:
        """None if ``header`` carries the key, else what is wrong (the 401 message)."""
        if not header:
            return "missing API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return "the Authorization header must use the Bearer scheme: 'Authorization: Bearer <key>'"
        # Headers arrive latin-1 decoded: encoding back gives the bytes the client sent.
        if not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
            return "invalid API key"
        return None


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {max_bytes} bytes")


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``, before it is read (see the module doc)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received, started = 0, False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:  # raised where no exception handler saw it
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(413, BodyTooLarge(self.max_bytes).detail)(scope, receive, send)


class HeldStream(StreamingResponse):
    """An SSE response holding its admission ticket until the response ends, however it
    ends: finished, failed, or the client gone before the body generator even started
    (the generator's own ``finally`` would never run then)."""

    def __init__(self, content: AsyncIterator[bytes], ticket: Ticket) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()


_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * 19  # after _DIGITS_TO_ZERO: 19 digits in a row


class OrjsonRequest(Request):
    """A request whose JSON body is parsed by orjson: 0.08 ms for a 4096-id /generate body
    against json.loads' 0.21 ms (CPU box, 2026-12-05). json.loads parses what orjson would
    read differently or refuse, so what is accepted, and every 400's message, is as before:
    a body with a run of 19 or more digits (orjson reads an integer beyond 64 bits as a
    float; the check costs 0.02 ms for that body), and one orjson refuses (NaN, nesting
    deeper than 1024, a byte-order mark, UTF-16)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if body.translate(_DIGITS_TO_ZERO).find(_LONG_DIGIT_RUN) < 0:
                try:
                    self._json = orjson.loads(body)
                    return self._json
                except orjson.JSONDecodeError:
                    pass
            self._json = json.loads(body)  # raises json.JSONDecodeError: FastAPI's 400
        return self._json


class OrjsonRoute(APIRoute):
    """Every route of the app: FastAPI's handler, given an ``OrjsonRequest`` (FastAPI calls
    ``request.json()`` before validating the body model)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(OrjsonRequest(request.scope, request.receive))

        return route


def _is_union_tag(part: str | int) -> bool:
    """A pydantic location entry naming the member of a union that was tried ("str",
    "list[str]", "list[constrained-int]", "function-after[...]"), not a field: no field of
    the request models is named like a type."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none")
                                      or "[" in part or part.startswith(("constrained-", "function-")))


def _validation_message(exc: RequestValidationError | pydantic.ValidationError) -> tuple[str, str | None]:
    """(message, param) of the first error; ``param`` is the field's dotted path (list
    indices included, union members left out: ``sampling_params.stop``, ``input_ids.0``)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None
    if param is None:  # the body as a whole (empty, or JSON that is not an object)
        if first.get("type") == "missing":
            return "request body is empty; expected a JSON object", None
        if first.get("type") in ("model_type", "model_attributes_type", "dict_type"):  # e.g. curl -d's form type
            return (f"request body: {first.get('msg')}; send a JSON object with "
                    "'Content-Type: application/json'"), None
        return f"request body: {first.get('msg')}", None
    return f"{param}: {first.get('msg')}", param


def sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, logs stay quiet


async def collect_until_disconnect(request: Request, chunks: AsyncIterator[SampleChunk]) -> list[SampleChunk] | None:
    """Gather a whole generation; None if the client disconnected first (the generation
    is then closed, which aborts it in the scheduler and frees its pages)."""
    async def gather() -> list[SampleChunk]:
        return [c async for c in chunks]

    task = asyncio.ensure_future(gather())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await chunks.aclose()
            return None


def create_app(tm: TokenizerManager, metrics: Metrics, args: ServerArgs, model_path: str) -> FastAPI:
    """The app serving ``tm`` with the settings ``args`` (``--api-key`` None = no key
    needed); ``model_path`` is the model as the user named it (``--model-path``, or the
    default model's GGUF file), reported by ``/get_model_info``."""
    app = FastAPI(title="radixlm", version=VERSION)
    app.router.route_class = OrjsonRoute  # before any route is added
    app.state.tm = tm
    app.state.metrics = metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    if args.api_key is not None:  # added last = outermost: a refused client is never read
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    _install_error_handlers(app)
    _install_native_routes(app, tm, metrics, args.stream_output)
    _install_info_routes(app, tm, args, model_path)
    from radixlm.runtime.openai_api import install_openai_routes

    install_openai_routes(app, tm, metrics)
    return app


def api_error(exc: Exception) -> tuple[int, str, str | None, str] | None:
    """(HTTP status, message, param, error type) of a refused or failed request, for the
    runtime's own exceptions and request-body validation errors; None for any other
    exception. The HTTP error handlers and the in-process ``runtime.engine`` both use it."""
    if isinstance(exc, RequestValidationError | pydantic.ValidationError):
        message, param = _validation_message(exc)
        return 400, message, param, "invalid_request_error"
    if isinstance(exc, InvalidRequest):
        return 400, exc.message, exc.param, "invalid_request_error"
    if isinstance(exc, QueueFull):
        return 429, str(exc), None, "rate_limit_error"
    if isinstance(exc, SchedulerDied):
        return 503, f"the scheduler is not running: {exc}", None, "server_error"
    return None


def _install_error_handlers(app: FastAPI) -> None:
    async def _known(_: Request, exc: Exception) -> JSONResponse:
        status, message, param, err_type = api_error(exc)
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QueueFull) else None
        return error_response(status, message, param, err_type=err_type, headers=headers)

    for exc_type in (RequestValidationError, InvalidRequest, QueueFull, SchedulerDied):
        app.add_exception_handler(exc_type, _known)

    @app.exception_handler(Exception)  # Starlette's last resort: it still logs the traceback
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal server error ({type(exc).__name__})", err_type="server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail), err_type="invalid_request_error")
        response.headers.update(exc.headers or {})  # e.g. Allow on a 405 (RFC 9110)
        return response


# --------------------------------------------------------------------------- native API
def _native_inputs(tm: TokenizerManager, req: GenerateRequest) -> list[tuple[list[int], str]]:
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        return [(tm.encode(t, "text"), "text") for t in texts]
    ids = req.input_ids
    batch = ids if ids and isinstance(ids[0], list) else [ids]
    return [(list(b), "input_ids") for b in batch]


def _native_gens(tm: TokenizerManager, req: GenerateRequest) -> list[GenInput]:
    inputs = _native_inputs(tm, req)
    if not inputs:
        raise InvalidRequest("the batch is empty", "text" if req.text is not None else "input_ids")
    rids = [req.rid] if isinstance(req.rid, str) else (req.rid or [None] * len(inputs))
    if len(rids) != len(inputs):
        raise InvalidRequest("rid must have one entry per prompt", "rid")
    sp = req.sampling_params
    gens = []
    for (ids, field), rid in zip(inputs, rids, strict=True):
        gen = GenInput(input_ids=ids, sampling=sp.to_sampling(), n=sp.n, return_logprob=req.return_logprob,
                       logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                       top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                       stream=req.stream)
        if rid:
            gen.rid = rid
        gens.append(tm.validate(gen, field))
    return gens


class _NativeResult:
    """Accumulates one sample's chunks into SGLang's response shape."""

    def __init__(self, tm: TokenizerManager, gen: GenInput, index: int, with_text: bool) -> None:
        self.tm, self.gen, self.index, self.with_text = tm, gen, index, with_text
        self.text, self.ids = "", []
        self.logprobs: list[float] = []
        self.top: list = []
        self.last: SampleChunk | None = None
        self.start = gen.created  # when the request was validated, not when results were gathered
        self._sent = (0, 0)  # (characters, tokens) already sent as segments (--stream-output)

    def add(self, c: SampleChunk) -> None:
        self.text += c.text
        self.ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.top += c.top_logprobs or []
        if c.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top = c.prompt_logprobs, c.prompt_top_logprobs
        self.last = c

    def _tok(self, tid: int) -> str | None:
        return self.tm.tokenizer.decode([tid]) if self.with_text else None

    def _triples(self, lps: list, ids: list[int]) -> list:
        return [[lp, t, self._tok(t)] for lp, t in zip(lps, ids, strict=False)]

    def _tops(self, tops: list) -> list:
        return [None if t is None else [[lp, i, self._tok(i)] for i, lp in t] for t in tops]

    def segment(self) -> dict[str, Any]:
        """``body()`` of what arrived since the last segment (``--stream-output``: disjoint
        ``text`` / ``output_ids`` / output logprobs; prompt logprobs in the first segment only;
        ``completion_tokens`` stays the total)."""
        out = self.body(self._sent)
        self._sent = (len(self.text), len(self.ids))
        return out

    def body(self, since: tuple[int, int] = (0, 0)) -> dict[str, Any]:
        """The response so far, from character / token ``since`` on (default: all of it)."""
        chars, toks = since
        c = self.last
        meta: dict[str, Any] = {
            "id": f"{self.gen.rid}-{self.index}" if self.gen.n > 1 else self.gen.rid,
            "prompt_tokens": c.prompt_tokens if c else len(self.gen.input_ids),
            "completion_tokens": len(self.ids),
            "cached_tokens": c.cached_tokens if c else 0,
            "finish_reason": _native_finish(c),
            "e2e_latency": time.perf_counter() - self.start,
        }
        if self.gen.return_logprob:  # input_* are empty without prompt logprobs (logprob_start_len -1)
            meta["output_token_logprobs"] = self._triples(self.logprobs[toks:], self.ids[toks:])
            start = self.gen.logprob_start_len
            plp = (getattr(self, "prompt_logprobs", None) or []) if since == (0, 0) else []
            meta["input_token_logprobs"] = self._triples(plp, self.gen.input_ids[start:]) if start >= 0 else []
            if self.gen.top_logprobs_num:
                ptop = (getattr(self, "prompt_top", None) or []) if since == (0, 0) else []
                meta["input_top_logprobs"] = self._tops(ptop)
                meta["output_top_logprobs"] = self._tops(self.top[toks:])
        if since == (0, 0):
            return {"text": self.text, "output_ids": self.ids, "meta_info": meta}
        return {"text": self.text[chars:], "output_ids": self.ids[toks:], "meta_info": meta}


def _native_finish(c: SampleChunk | None) -> dict[str, Any] | None:
    if c is None or c.finish_reason is None:
        return None
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched_stop}
    if c.finish_reason == "length":  # "message" says why when the KV pool, not a limit, cut it
        return {"type": "length", "length": c.completion_tokens, **({"message": c.error} if c.error else {})}
    return {"type": "abort", "message": c.error}


def _install_native_routes(app: FastAPI, tm: TokenizerManager, metrics: Metrics, stream_output: bool) -> None:
    @app.get("/health")
    async def health() -> Response:
        if tm.dead:
            return error_response(503, f"scheduler died: {tm.dead}", err_type="server_error")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once a one-token generation went through the scheduler (SGLang's deep
        health check); 503 if the scheduler is dead or the generation failed."""
        if tm.dead:
            return error_response(503, f"scheduler died: {tm.dead}", err_type="server_error")
        gens = _native_gens(tm, GenerateRequest(input_ids=[1], sampling_params={"max_new_tokens": 1}))
        chunks = [c async for c in tm.generate(gens[0])]
        if not chunks or chunks[-1].finish_reason not in ("stop", "length"):
            return error_response(503, "health generation failed", err_type="server_error")
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        await flush_radix_cache(tm)
        return Response("Cache flushed.\n", status_code=200)

    @app.get("/debug/check_invariants")
    async def check_invariants() -> dict[str, Any]:
        """Page/tree invariants checked in the scheduler now (200 even if violated)."""
        out = await tm.check_invariants()
        return {"ok": out.ok, "message": out.message, "num_live": out.num_live,
                "free_pages": out.free_pages, "cached_pages": out.cached_pages,
                "locked_pages": out.locked_pages, "violations": out.violations}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render(tm.stats)
        return Response(body, media_type=content_type)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        if body.stream:
            ticket, events = native_generate_stream(tm, metrics, body, stream_output)
            return HeldStream(_sse_stream(events), ticket)
        out = await native_generate(tm, metrics, body, lambda chunks: collect_until_disconnect(request, chunks))
        return Response(status_code=CLIENT_CLOSED) if out is None else JSONResponse(out)


async def flush_radix_cache(tm: TokenizerManager) -> None:
    """``/flush_cache``: empty the radix cache. Raises InvalidRequest (400) if the
    scheduler refuses (requests are running)."""
    out = await tm.flush_cache()
    if not out.success:
        raise InvalidRequest(f"cache not flushed: {out.message}")


async def _collect(chunks: AsyncIterator[SampleChunk]) -> list[SampleChunk] | None:
    return [c async for c in chunks]


async def native_generate(tm: TokenizerManager, metrics: Metrics, body: GenerateRequest,
                          collect: Callable[[AsyncIterator[SampleChunk]], Any] = _collect) -> Any:
    """The JSON of a non-streaming native ``/generate``: one result dict, or a list for a
    batch or ``n`` > 1. ``collect`` gathers one prompt's chunks (None: the client left;
    then this returns None). Raises InvalidRequest, QueueFull, SchedulerDied."""
    gens = _native_gens(tm, body)
    results = []
    with tm.admit(gens):  # the prompts of a batch run concurrently (batched by the scheduler)
        gathered = await asyncio.gather(*(collect(tm.generate(g)) for g in gens))
        if any(chunks is None for chunks in gathered):
            return None
        for gen, chunks in zip(gens, gathered, strict=True):
            res = [_NativeResult(tm, gen, i, body.return_text_in_logprobs) for i in range(gen.n)]
            for c in chunks:
                res[c.index].add(c)
                metrics.observe_chunk(gen, c)
            results += [r.body() for r in res]
    single = len(gens) == 1 and gens[0].n == 1 and not isinstance(body.text, list) and not (
        body.input_ids and isinstance(body.input_ids[0], list))
    return results[0] if single else results


def native_generate_stream(tm: TokenizerManager, metrics: Metrics, body: GenerateRequest,
                           segments: bool = False) -> tuple[Ticket, AsyncIterator[dict[str, Any]]]:
    """A streaming native ``/generate``, sent to the scheduler now (``TokenizerManager.start``):
    its admission ticket (the caller releases it when the stream ends, however it ends;
    that aborts what is not finished) and its events (see ``_native_stream``; ``segments``:
    ``--stream-output``). Raises InvalidRequest, QueueFull, SchedulerDied."""
    gens = _native_gens(tm, body)
    ticket, generation = tm.start(gens)
    return ticket, _native_stream(tm, generation, gens, body, metrics, segments)


async def _sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(events):  # a client gone: close now, which aborts the samples
        async for event in events:
            yield sse(event)
    yield SSE_DONE


def model_info(tm: TokenizerManager, args: ServerArgs, model_path: str) -> dict[str, Any]:
    """``/get_model_info``'s body (see that route)."""
    r = tm.ready
    return {"model_path": model_path, "tokenizer_path": args.tokenizer_path or r.model_dir,
            "model_dir": r.model_dir, "served_model_name": tm.model_name, "is_generation": True,
            "context_length": r.context_length, "page_size": r.page_size,
            "max_total_tokens": r.max_total_tokens, "device": r.device, "dtype": r.dtype,
            "stream_output": args.stream_output}  # how native streams read (the DSL's endpoint)


def _install_info_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs, model_path: str) -> None:
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        """SGLang's model info. ``model_path``: the model as given (``--model-path``, or the
        default model's GGUF file), so clients can pick a chat template by name;
        ``tokenizer_path``: the directory the tokenizer was loaded from; ``model_dir``: the
        Hugging Face directory the weights were loaded from (a GGUF's converted copy)."""
        return model_info(tm, args, model_path)

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        """SGLang's server info: every setting except the API key, overridden by the
        values resolved at start-up (``device``, ``dtype``, ``context_length``,
        ``max_total_tokens``, ``cuda_graph_max_bs`` (null: no decode graphs),
        ``admit_batch_size``, ``idle_spin_ms``, and for the KV cache dtypes that use them
        ``kv_mixed_window_pages`` / ``kv_sink_slots``), the model info, ``max_total_num_tokens`` /
        ``max_req_input_len`` (SGLang's names), ``internal_states`` (the scheduler's last
        report: running/waiting requests, KV pool usage, prefix-cache hit rate,
        preemptions) and ``version``."""
        r = tm.ready
        resolved = {"cuda_graph_max_bs": r.cuda_graph_max_bs, "admit_batch_size": r.admit_batch_size,
                    "idle_spin_ms": r.idle_spin_ms}
        if args.kv_cache_dtype == "mixed":
            resolved["kv_mixed_window_pages"] = args.mixed_window_pages
        if args.kv_cache_dtype == "fp8_e4m3":
            resolved["kv_sink_slots"] = args.sink_slots
        return {**args.public_dict(), **resolved, **model_info(tm, args, model_path),
                "max_total_num_tokens": r.max_total_tokens, "max_req_input_len": r.context_length - 1, "kv_cache_bytes": r.kv_bytes,
                "internal_states": [_internal_state(tm.stats)], "version": VERSION}


def _internal_state(stats: SchedulerStats | None) -> dict[str, Any]:
    """The scheduler's last ``SchedulerStats`` (empty before its first report) with SGLang's
    ``num_running_reqs``, ``num_waiting_reqs``, ``token_usage`` and ``cache_hit_rate``."""
    if stats is None:
        return {}
    seen = stats.prefill_tokens_computed + stats.prefill_tokens_cached
    return {"num_running_reqs": stats.num_running, "num_waiting_reqs": stats.num_waiting,
            "token_usage": stats.kv_used_pages / max(stats.kv_total_pages, 1),
            "cache_hit_rate": stats.prefill_tokens_cached / seen if seen else 0.0,
            **msgspec.structs.asdict(stats)}


async def _native_stream(tm: TokenizerManager, generation: Generation, gens: list[GenInput],
                         body: GenerateRequest, metrics: Metrics, segments: bool = False
                         ) -> AsyncIterator[dict[str, Any]]:
    """SGLang-style stream events: each carries the cumulative ``text`` and ``output_ids``
    of one sample with its ``index`` (``segments``, SGLang's ``--stream-output``: only what
    is new since that sample's last event; a long reply then costs O(n), not O(n^2), to
    encode, send and parse); a failure mid-stream is a last ``{"error": ...}`` event (HTTP
    sends each as SSE, then ``data: [DONE]``)."""
    bases = list(itertools.accumulate((gen.n for gen in gens), initial=0))
    res = [[_NativeResult(tm, gen, i, body.return_text_in_logprobs) for i in range(gen.n)] for gen in gens]
    try:  # the prompts of a batch run concurrently; events interleave, each with its index
        async with contextlib.aclosing(generation) as chunks:  # closed with us: aborts now
            async for k, c in chunks:
                r = res[k][c.index]
                r.add(c)
                metrics.observe_chunk(gens[k], c)
                if c.text or c.finished:
                    yield {**(r.segment() if segments else r.body()), "index": bases[k] + c.index}
    except SchedulerDied as exc:
        yield {"error": {"message": str(exc), "type": "server_error", "code": 503}}
    except InvalidRequest as exc:
        yield {"error": {"message": exc.message, "type": "invalid_request_error", "param": exc.param,
                         "code": 400}}


Handler = Callable[..., Any]
