"""Launch the server: scheduler child process + HTTP/tokenizer process (this one).

    python -m radixlm.runtime.launch_server --port 30000
    radixlm launch_server --model-path path/to/model.gguf

Start order: bind the ZeroMQ sockets, spawn the model processes, wait until every
scheduler reports ready (model loaded, KV pool sized) or one fails, load the tokenizer,
then serve HTTP. A watchdog checks the model processes every 0.5 s: if one dies,
in-flight requests get an error, /health turns 503, the others are killed and the server
exits with status 1 instead of hanging. SIGINT/SIGTERM stop accepting requests, let
uvicorn finish the in-flight ones (for up to GRACEFUL_SHUTDOWN_S), then stop the model
processes; the exit status is 0.

Process tree (``--dp-size`` M, ``--tp-size`` N; docs/ARCHITECTURE.md "Processes"):

    this process (HTTP, tokenizer, DP router)
     |-- replica 0: scheduler = TP rank 0 (scheduler.py), TP ranks 1..N-1 (tensor_parallel.py)
     |-- ...
     `-- replica M-1: the same
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
import zmq

from radixlm.runtime import messages as m
from radixlm.runtime.executor.model_loader import default_gguf_path, resolve_model_path
from radixlm.runtime.executor.parallel import PeerPlacement, RankPlacement, TPShard
from radixlm.runtime.ipc import MsgSocket, new_ipc_address
from radixlm.runtime.scheduler.scheduler import freeze_startup_objects, run_scheduler_process
from radixlm.runtime.scheduler.tensor_parallel import run_tp_worker_process
from radixlm.runtime.server.dp_router import DPRouter
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


async def wait_ready(recv: MsgSocket, gone: Callable[[], str | None], timeout: float,
                     count: int = 1) -> m.SchedulerReady:
    """The schedulers' ``SchedulerReady`` (the first of ``count``, once all arrived).
    ``gone()`` says why a model process is no longer running (None while all are). Raises
    SchedulerStartError on a ``SchedulerError``, a process's end, or after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    ready: list[m.SchedulerReady] = []
    while loop.time() < deadline:
        if await recv.sock.poll(500):
            msg = await recv.arecv()
            if isinstance(msg, m.SchedulerReady):
                ready.append(msg)
                if len(ready) == count:
                    return ready[0]
            if isinstance(msg, m.SchedulerError):
                raise SchedulerStartError(msg.message)
        elif (reason := gone()) is not None:
            raise SchedulerStartError(f"{reason} during start-up")
    raise SchedulerStartError(f"scheduler not ready after {timeout:.0f} s")


def make_tokenizer_manager(args: ServerArgs, ready: m.SchedulerReady, send: MsgSocket | DPRouter,
                           recv: MsgSocket) -> TokenizerManager:
    """The tokenizer side of a started scheduler (loads the model's tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or ready.model_dir)
    return TokenizerManager(tokenizer, ready, send, recv, served_model_name(args), log_requests=args.log_requests,
                            max_running_requests=args.max_running_requests,
                            max_queued_requests=args.max_queued_requests, tool_call_parser=args.tool_call_parser)


def _dead(procs: list[mp.Process]) -> str | None:
    """Why model processes are no longer running (None while all are): every dead one,
    those killed by a signal first (a rank's peers then fail in their collective and exit
    with code 1, often before the watchdog looks, and are not the cause)."""
    dead = [proc for proc in procs if not proc.is_alive()]
    dead.sort(key=lambda proc: not (proc.exitcode is not None and proc.exitcode < 0))
    return "; ".join(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}" for proc in dead) or None


async def _watchdog(procs: list[mp.Process], tm: TokenizerManager, server: uvicorn.Server, state: dict) -> None:
    while not server.should_exit:
        await asyncio.sleep(0.5)
        if (reason := _dead(procs)) is not None:
            logger.error("%s; shutting down", reason)
            tm.fail_all(reason)
            state["exit_code"] = 1
            await asyncio.sleep(0.5)  # let failing requests flush their error responses
            server.should_exit = True
            return


def _spawn(args: ServerArgs, from_sched: str) -> tuple[list[MsgSocket], list[mp.Process]]:
    """Start every model process: per replica its scheduler (TP rank 0) and TP ranks
    1..N-1; with ``--enable-peer-kv`` each scheduler also gets its ``PeerPlacement`` (the
    replicas' rendezvous and inboxes). Returns the sockets to the schedulers (by dp rank)
    and the processes."""
    ctx, socks, procs, tp = mp.get_context("spawn"), [], [], args.tp_size
    peers = None
    if args.enable_peer_kv:  # the replicas' own group: port + dp_size (port + i: replica i's TP group)
        peers = (_dist_addr(args.dist_init_addr, args.dp_size),
                 tuple(new_ipc_address(f"peer-{r}") for r in range(args.dp_size)))
    for dp_rank in range(args.dp_size):
        to_sched = new_ipc_address(f"to-sched-{dp_rank}")
        socks.append(MsgSocket(zmq.PUSH, to_sched, bind=True, asyncio=True))
        steps = tuple(new_ipc_address(f"tp-steps-{dp_rank}-{r}") for r in range(1, tp))
        addr = _dist_addr(args.dist_init_addr, dp_rank) if tp > 1 else ""
        suffix = f"-dp{dp_rank}" if args.dp_size > 1 else ""
        leader = RankPlacement(0, tp, addr, dp_rank * tp, steps)
        peer = PeerPlacement(dp_rank, args.dp_size, *peers) if peers is not None else None
        procs.append(ctx.Process(target=run_scheduler_process, name=f"radixlm-scheduler{suffix}", daemon=True,
                                 args=(args, to_sched, from_sched, os.getpid(), leader, dp_rank, peer)))
        for r in range(1, tp):
            placement = RankPlacement(r, tp, addr, dp_rank * tp + r, (steps[r - 1],))
            procs.append(ctx.Process(target=run_tp_worker_process, name=f"radixlm-tp{r}{suffix}", daemon=True,
                                     args=(args, placement, os.getpid())))
    for proc in procs:
        proc.start()
    return socks, procs


def _dist_addr(base: str | None, dp_rank: int) -> str:
    """The rendezvous of replica ``dp_rank``: ``--dist-init-addr`` with its port + dp_rank,
    or a free loopback port (``dp_rank`` = --dp-size: the replicas' peer KV group)."""
    if base is None:
        with socket.socket() as sock:  # a free loopback port
            sock.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{sock.getsockname()[1]}"
    host, port = base.rsplit(":", 1)
    return f"{host}:{int(port) + dp_rank}"


async def _serve(args: ServerArgs) -> int:
    from_sched = new_ipc_address("from-sched")
    recv = MsgSocket(zmq.PULL, from_sched, bind=True, asyncio=True)
    socks, procs = _spawn(args, from_sched)
    try:
        ready = await wait_ready(recv, lambda: _dead(procs), args.startup_timeout, args.dp_size)
        send = socks[0] if args.dp_size == 1 else DPRouter(socks, args.dp_routing, ready.max_total_tokens,
                                                           ready.page_size, peer_hints=args.enable_peer_kv,
                                                           balance_abs=args.dp_balance_abs)
        return await _run_http(args, ready, send, recv, procs)
    except SchedulerStartError as exc:
        logger.error("server failed to start: %s", exc)
        return 1
    finally:
        for proc in procs:
            _stop(proc)
        for sock in socks:
            sock.close()
        recv.close()


async def _run_http(args: ServerArgs, ready: m.SchedulerReady, send: MsgSocket | DPRouter, recv: MsgSocket,
                    procs: list[mp.Process]) -> int:
    tm = make_tokenizer_manager(args, ready, send, recv)
    freeze_startup_objects()  # the HTTP process's imports and tokenizer, as the scheduler's
    name = tm.model_name
    app = create_app(tm, Metrics(name), args, args.model_path or str(default_gguf_path()))
    loop_kind = "uvloop" if _has_uvloop() else "asyncio"
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            loop=loop_kind, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config)
    state = {"exit_code": 0}
    tasks = [asyncio.ensure_future(tm.recv_loop()), asyncio.ensure_future(_watchdog(procs, tm, server, state))]
    logger.info("serving %s on http://%s:%d (KV capacity %d tokens, %.1f MiB, page size %d; tp %d, dp %d)",
                name, args.host, args.port, ready.max_total_tokens, ready.kv_bytes / 2**20, ready.page_size,
                args.tp_size, args.dp_size)
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
    """Model processes keep no state worth saving and ignore SIGTERM (so a signal to the
    whole process group drains HTTP first): stop them with SIGKILL."""
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def tp_shape_problem(args: ServerArgs) -> str | None:
    """What of the model's config.json ``--tp-size`` does not split (the attention heads,
    the KV heads, the MLP width), checked before any model process starts (each rank
    would find it only after spawning and loading); None if it splits, or if the model
    path cannot be read here (the scheduler then reports it as before)."""
    if args.tp_size == 1:
        return None
    try:
        model_dir = resolve_model_path(args.model_path, args.model_cache_dir)
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg  # multimodal checkpoints keep the decoder's shape there
    shard = TPShard(0, args.tp_size)
    try:
        heads = cfg["num_attention_heads"]
        shard.q_heads(heads)
        shard.kv_heads(heads, cfg.get("num_key_value_heads") or heads)
        if cfg.get("intermediate_size"):
            shard.split(cfg["intermediate_size"], "the MLP width")
    except KeyError:
        return None
    except ValueError as exc:
        return f"--tp-size {args.tp_size}: {exc} of {model_dir}"
    return None


def launch_server(args: ServerArgs) -> int:
    """Run the server until it is stopped; returns the process exit status (2 for a
    ``--tp-size`` the model cannot be split by, ``tp_shape_problem``)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    problem = tp_shape_problem(args)
    if problem is not None:
        print(f"launch_server: error: {problem}", file=sys.stderr)
        return 2
    if _has_uvloop():
        import uvloop

        return uvloop.run(_serve(args))
    return asyncio.run(_serve(args))


def main(argv: list[str] | None = None) -> None:
    sys.exit(launch_server(ServerArgs.parse(argv)))


if __name__ == "__main__":
    main()
