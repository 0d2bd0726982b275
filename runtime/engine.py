"""The server without HTTP: scheduler and tokenizer manager on threads of this process.

``LocalServer(args)`` starts, in the calling process, the scheduler loop
(``scheduler.serve_scheduler``: the model, the KV pool, the radix cache) on one daemon
thread and an asyncio event loop hosting the server's ``TokenizerManager`` on another,
connected by the same ZeroMQ PUSH/PULL sockets (ipc://) as the server's two processes.
No uvicorn, no port. Its ``get``/``post``/``stream`` take the native routes' paths and
JSON bodies (``/generate``, ``/get_model_info``, ``/flush_cache``) and run the very
functions the HTTP routes run (``http_server.native_generate`` ...) on the loop, so
results, stream events and error messages are the server's; it is the in-process twin of
``frontend.transport.HttpClient`` and backs ``radixlm.frontend.Engine``.

Errors are ``RequestError`` (or the ``error`` type given: the frontend passes its
``BackendError``) with the status and message the HTTP route would answer (400 for an
invalid request, 429 queue full, 503 scheduler gone or engine closed; 0 for an error
event inside a stream).
``close()`` stops both threads (in-flight requests fail) and drops the model.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import zmq

from radixlm.runtime.executor.model_loader import default_gguf_path
from radixlm.runtime.ipc import MsgSocket, new_ipc_address
from radixlm.runtime.launch_server import SchedulerStartError, make_tokenizer_manager, wait_ready
from radixlm.runtime.scheduler.scheduler import serve_scheduler
from radixlm.runtime.server.http_common import api_error
from radixlm.runtime.server.http_server import (
    flush_radix_cache,
    model_info,
    native_generate,
    native_generate_stream,
)
from radixlm.runtime.server.metrics import Metrics
from radixlm.runtime.server.protocol import GenerateRequest
from radixlm.runtime.server.tokenizer_manager import Ticket, TokenizerManager
from radixlm.runtime.server_args import ServerArgs

__all__ = ["LocalServer", "RequestError"]

logger = logging.getLogger("radixlm.engine")
_END = object()  # the end of a stream's events
STOP_TIMEOUT_S = 30.0  # how long close() waits for each thread


class RequestError(RuntimeError):
    """A request the server answers with an error: ``status`` is the HTTP status (0 for an
    error event inside a stream), ``message`` the route's error message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message


class LocalServer:
    """The scheduler and tokenizer manager of a server for ``args``, in this process.
    ``error(status, message)`` builds the exception request errors raise. Blocks until the
    model is loaded; raises RuntimeError if the scheduler fails to start (its error
    message) or is not ready within ``args.startup_timeout`` seconds, ValueError for tensor
    or data parallelism (several processes: ``launch_server``)."""

    def __init__(self, args: ServerArgs, error: Callable[[int, str], Exception] = RequestError) -> None:
        if args.tp_size > 1 or args.dp_size > 1:
            raise ValueError("an in-process server runs one model process: --tp-size / --dp-size > 1 "
                             "need `radixlm launch_server`")
        self.args = args
        self.error = error
        self.model_path = args.model_path or str(default_gguf_path())
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="radixlm-engine-loop",
                                             daemon=True)
        self._loop_thread.start()
        self._scheduler_thread: threading.Thread | None = None
        self._sockets: list[MsgSocket] = []
        self._recv_task: asyncio.Task | None = None
        self.tm: TokenizerManager | None = None
        try:
            self._call(self._start())
        except BaseException:
            self.close()
            raise
        self.metrics = Metrics(self.tm.model_name)

    # ----------------------------------------------------------------- start / stop
    async def _start(self) -> None:
        to_sched, from_sched = new_ipc_address("to-sched"), new_ipc_address("from-sched")
        send = MsgSocket(zmq.PUSH, to_sched, bind=True, asyncio=True)
        recv = MsgSocket(zmq.PULL, from_sched, bind=True, asyncio=True)
        self._sockets = [send, recv]
        failure: list[str] = []
        self._scheduler_thread = threading.Thread(
            target=self._run_scheduler, args=(to_sched, from_sched, failure), name="radixlm-scheduler", daemon=True)
        self._scheduler_thread.start()
        try:
            ready = await wait_ready(recv, lambda: None if self._scheduler_thread.is_alive() else
                                     (failure[0] if failure else "the scheduler thread ended"),
                                     self.args.startup_timeout)
        except SchedulerStartError as exc:
            raise RuntimeError(f"the engine failed to start: {exc}") from exc
        tm = await asyncio.to_thread(make_tokenizer_manager, self.args, ready, send, recv)
        self.tm = tm
        self._recv_task = asyncio.ensure_future(tm.recv_loop())

    def _run_scheduler(self, to_sched: str, from_sched: str, failure: list[str]) -> None:
        try:
            serve_scheduler(self.args, to_sched, from_sched, stop=self._stop)
        except BaseException as exc:  # a crash of the loop: fail the requests in flight
            logger.exception("the scheduler thread failed")
            failure.append(f"the scheduler thread failed: {type(exc).__name__}: {exc}")
            if self.tm is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self.tm.fail_all, failure[0])

    def close(self) -> None:
        """Stop the scheduler thread, fail the requests still in flight, stop the event loop
        and drop the model (freed once no other reference holds it). Idempotent."""
        self._stop.set()
        if self._scheduler_thread is not None:
            self._scheduler_thread.join(STOP_TIMEOUT_S)
        if self._loop.is_closed():
            return
        if self._loop_thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop_loop(), self._loop).result(STOP_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(STOP_TIMEOUT_S)
        self._loop.close()
        self.tm = None
        gc.collect()

    async def _stop_loop(self) -> None:
        if self.tm is not None:
            self.tm.fail_all("the engine was shut down")
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
        others = asyncio.all_tasks() - {asyncio.current_task()}  # requests of other threads
        if others:  # failed above: they end with their error; one stuck is cancelled
            _, stuck = await asyncio.wait(others, timeout=5.0)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        for sock in self._sockets:
            sock.close()
        self._sockets = []

    # ----------------------------------------------------------------- routes
    def _call(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the engine's loop and wait for it; the runtime's request errors
        become ``error`` with the HTTP route's status and message."""
        if self._stop.is_set():
            coro.close()
            raise self.error(503, "the engine was shut down")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except Exception as exc:
            err = api_error(exc)
            if err is None:
                raise
            raise self.error(err[0], err[1]) from exc

    def get(self, path: str) -> Any:
        """``GET path`` of the native API (``/get_model_info``)."""
        if path == "/get_model_info":
            return model_info(self.tm, self.args, self.model_path)
        raise ValueError(f"the engine has no route GET {path}")

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """``POST path`` of the native API (``/generate``, non-streaming; ``/flush_cache``):
        the JSON the route answers (None for ``/flush_cache``). Raises ``error``."""
        if path == "/generate":
            return self._call(self._generate(body))
        if path == "/flush_cache":
            return self._call(flush_radix_cache(self.tm))
        raise ValueError(f"the engine has no route POST {path}")

    async def _generate(self, body: dict[str, Any]) -> Any:
        return await native_generate(self.tm, self.metrics, GenerateRequest.model_validate(body))

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """A streaming ``POST /generate``: each event's JSON (what HTTP sends as SSE)
        until the end. Raises ``error`` for an invalid request or an error event.
        Closing the iterator early aborts the generation."""
        if path != "/generate":
            raise ValueError(f"the engine has no streaming route {path}")
        ticket, events = self._call(self._open_stream(body))
        try:
            while (event := self._call(_next(events))) is not _END:
                if "error" in event:
                    raise self.error(0, str(event["error"].get("message")))
                yield event
        finally:
            if not self._stop.is_set():  # else close() failed the generation already
                asyncio.run_coroutine_threadsafe(_close(events, ticket), self._loop).result(STOP_TIMEOUT_S)

    async def _open_stream(self, body: dict[str, Any]) -> Any:
        return native_generate_stream(self.tm, self.metrics, GenerateRequest.model_validate(body),
                                      self.args.stream_output)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _next(events: AsyncIterator[dict[str, Any]]) -> Any:
    return await anext(events, _END)


async def _close(events: AsyncIterator[dict[str, Any]], ticket: Ticket) -> None:
    try:
        await events.aclose()  # aborts the samples not finished
    finally:
        ticket.release()
