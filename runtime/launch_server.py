"""Launch the server: scheduler child process + HTTP/tokenizer process (this one).

    python -m radixlm.runtime.launch_server --port 30000
    radixlm launch_server --model-path path/to/model.gguf

Start order: bind the ZeroMQ sockets, spawn the scheduler, wait until it reports ready
(model loaded, KV pool sized) or fails, load the tokenizer, then serve HTTP. A watchdog
checks the scheduler every 0.5 s: if it dies, in-flight requests get an error, /health
turns 503 and the server exits with status 1 instead of hanging. SIGINT/SIGTERM stop
accepting requests, let uvicorn finish the in-flight ones (for up to
GRACEFUL_SHUTDOWN_S), then stop the scheduler; the exit status is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
import zmq

from radixlm.runtime import messages as m
from radixlm.runtime.executor.model_loader import default_gguf_path
from radixlm.runtime.ipc import MsgSocket, new_ipc_address
from radixlm.runtime.scheduler.scheduler import freeze_startup_objects, run_scheduler_process
from radixlm.runtime.server.http_server import create_app
from radixlm.runtime.server.metrics import Metrics
from radixlm.runtime.server.tokenizer_manager import TokenizerManager
from radixlm.runtime.server_args import ServerArgs

__all__ = ["launch_server", "main", "served_model_name", "wait_ready", "make_tokenizer_manager",
           "SchedulerStartError"]

logger = logging.getLogger("radixlm.launch")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GRACEFUL_SHUTDOWN_S = 30  # in-flight requests still running after this are cut


def served_model_name(args: ServerArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    if not args.model_path:
        return DEFAULT_MODEL_NAME
    path = Path(args.model_path)
    return path.stem if path.suffix == ".gguf" else path.name


class SchedulerStartError(RuntimeError):
    pass


class _Server(uvicorn.Server):
    """uvicorn, minus re-raising SIGINT/SIGTERM after its graceful shutdown (that would
    kill the launcher before it stops the scheduler, and exit with -15 instead of 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def wait_ready(recv: MsgSocket, gone: Callable[[], str | None], timeout: float) -> m.SchedulerReady:
    """The scheduler's ``SchedulerReady``. ``gone()`` says why the scheduler is no longer
    running (None while it is). Raises SchedulerStartError on its ``SchedulerError``, its
    end, or after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await recv.sock.poll(500):
            msg = await recv.arecv()
            if isinstance(msg, m.SchedulerReady):
                return msg
            if isinstance(msg, m.SchedulerError):
                raise SchedulerStartError(msg.message)
        elif (reason := gone()) is not None:
            raise SchedulerStartError(f"{reason} during start-up")
    raise SchedulerStartError(f"scheduler not ready after {timeout:.0f} s")


def make_tokenizer_manager(args: ServerArgs, ready: m.SchedulerReady, send: MsgSocket,
                           recv: MsgSocket) -> TokenizerManager:
    """The tokenizer side of a started scheduler (loads the model's tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or ready.model_dir)
    return TokenizerManager(tokenizer, ready, send, recv, served_model_name(args), log_requests=args.log_requests,
                            max_running_requests=args.max_running_requests,
                            max_queued_requests=args.max_queued_requests, tool_call_parser=args.tool_call_parser)


async def _watchdog(proc: mp.Process, tm: TokenizerManager, server: uvicorn.Server, state: dict) -> None:
    while not server.should_exit:
        await asyncio.sleep(0.5)
        if not proc.is_alive():
            reason = f"scheduler process exited with code {proc.exitcode}"
            logger.error("%s; shutting down", reason)
            tm.fail_all(reason)
            state["exit_code"] = 1
            await asyncio.sleep(0.5)  # let failing requests flush their error responses
            server.should_exit = True
            return


async def _serve(args: ServerArgs) -> int:
    to_sched, from_sched = new_ipc_address("to-sched"), new_ipc_address("from-sched")
    send = MsgSocket(zmq.PUSH, to_sched, bind=True, asyncio=True)
    recv = MsgSocket(zmq.PULL, from_sched, bind=True, asyncio=True)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=run_scheduler_process, args=(args, to_sched, from_sched, os.getpid()),
                       name="radixlm-scheduler", daemon=True)
    proc.start()
    try:
        ready = await wait_ready(recv, lambda: None if proc.is_alive() else
                                 f"scheduler exited with code {proc.exitcode}", args.startup_timeout)
        return await _run_http(args, ready, send, recv, proc)
    except SchedulerStartError as exc:
        logger.error("server failed to start: %s", exc)
        return 1
    finally:
        _stop(proc)
        send.close()
        recv.close()


async def _run_http(args: ServerArgs, ready: m.SchedulerReady, send: MsgSocket, recv: MsgSocket,
                    proc: mp.Process) -> int:
    tm = make_tokenizer_manager(args, ready, send, recv)
    freeze_startup_objects()  # the HTTP process's imports and tokenizer, as the scheduler's
    name = tm.model_name
    app = create_app(tm, Metrics(name), args, args.model_path or str(default_gguf_path()))
    loop_kind = "uvloop" if _has_uvloop() else "asyncio"
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            loop=loop_kind, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config)
    state = {"exit_code": 0}
    tasks = [asyncio.ensure_future(tm.recv_loop()), asyncio.ensure_future(_watchdog(proc, tm, server, state))]
    logger.info("serving %s on http://%s:%d (KV capacity %d tokens, %.1f MiB, page size %d)",
                name, args.host, args.port, ready.max_total_tokens, ready.kv_bytes / 2**20, ready.page_size)
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s without --api-key: anyone who reaches the port can use it", args.host)
    try:
        await server.serve()
    finally:
        for t in tasks:
            t.cancel()
        gc.unfreeze()
    if not server.started and state["exit_code"] == 0:
        return 1  # e.g. the port was taken
    return state["exit_code"]


def _stop(proc: mp.Process) -> None:
    """The scheduler keeps no state worth saving and ignores SIGTERM (so a signal to the
    whole process group drains HTTP first): stop it with SIGKILL."""
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def launch_server(args: ServerArgs) -> int:
    """Run the server until it is stopped; returns the process exit status."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if _has_uvloop():
        import uvloop

        return uvloop.run(_serve(args))
    return asyncio.run(_serve(args))


def main(argv: list[str] | None = None) -> None:
    sys.exit(launch_server(ServerArgs.parse(argv)))


if __name__ == "__main__":
    main()
