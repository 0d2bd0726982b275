"""HTTP plumbing shared by the native and the OpenAI routes: JSON error bodies, the API-key
and body-size middlewares, orjson request parsing, request-validation messages, SSE framing,
disconnect handling, and the exception handlers.

Every error is JSON: ``{"error": {"message", "type", "param", "code"}}``; malformed JSON
and wrong types are HTTP 400 (FastAPI's 422 is mapped to 400, as OpenAI does).

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
import hmac
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

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
from radixlm.runtime.server.tokenizer_manager import (
    InvalidRequest,
    QueueFull,
    SampleChunk,
    SchedulerDied,
    Ticket,
)

__all__ = ["CLIENT_CLOSED", "PUBLIC_PATHS", "SSE_DONE", "VERSION", "ApiKeyMiddleware",
           "BodyLimitMiddleware", "BodyTooLarge", "HeldStream", "OrjsonRoute", "api_error",
           "collect_until_disconnect", "error_response", "install_error_handlers", "sse"]


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


def install_error_handlers(app: FastAPI) -> None:
    """JSON errors for every failure: the runtime's own exceptions (``api_error``), 4xx from
    Starlette, and a 500 for anything else."""
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
