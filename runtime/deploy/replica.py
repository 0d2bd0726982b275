"""``RadixLMServer``: a Ray Serve replica that runs one radixlm server and proxies to it.

The replica starts ``launch_server`` (any ``--tp-size`` / ``--dp-size``) as a child process
(``deploy/child.py``: it dies with the replica) on a free loopback port, with KV events on
free TCP ports of the node unless the flags name their own, and waits until it is healthy.
Then:

* ``forward(ProxyRequest)`` sends the request to the server and yields a ``ProxyResponse``
  (status and headers as the server sent them; the body too unless it is an event stream,
  whose chunks follow as ``bytes``). A request that gets no response (the server is gone or
  refuses the connection) yields a 503 marked ``retryable``; a stream cut midway ends with
  the server's own error event and ``[DONE]``; a plain response cut midway is a 503.
* ``check_health`` (Ray Serve calls it every ``health_check_period_s``) raises once the
  server process exited or ``/health`` is not 200: Ray then replaces the replica.
* ``record_routing_stats`` (every ``request_routing_stats_period_s``): running and waiting
  requests and KV usage (fraction of the pool) from the server's ``/get_server_info``.
* ``record_replica_metadata`` (once): the page size, KV capacity and the KV event endpoints
  (``tcp://<node ip>:<port>``, one per data parallel rank) for the router.
* ``tokenizer_files``: the tokenizer's files (the ingress tokenizes prompts for routing).

Works without Ray too (``serve`` helpers are looked up only when present), which the tests
of the proxy use.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from radixlm.runtime.deploy.protocol import (
    HOP_HEADERS,
    ProxyRequest,
    ProxyResponse,
    error_body,
    sse_error,
)
from radixlm.runtime.server_args import ServerArgs

__all__ = ["RadixLMServer", "free_port_block", "parse_server_args"]

STARTUP_TIMEOUT_S = 900.0  # a first start converts the default GGUF
STOP_TIMEOUT_S = 10.0
TOKENIZER_FILE_LIMIT = 64 * 2**20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5")


def free_port_block(count: int, host: str = "0.0.0.0", tries: int = 50) -> int:
    """The first of ``count`` consecutive TCP ports free on ``host`` now (a data parallel
    server's ranks publish on port + rank). RuntimeError after ``tries`` attempts."""
    for _ in range(tries):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 65536:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def parse_server_args(argv: list[str]) -> ServerArgs:
    """``launch_server`` flags -> ServerArgs; ValueError (not a usage exit) on bad ones."""
    try:
        return ServerArgs.parse(argv)
    except SystemExit as exc:
        raise ValueError(f"bad launch_server flags {argv} (see `radixlm launch_server --help`)") from exc


def _replica_id() -> str:
    """This replica's unique id in Ray Serve ("local" outside a replica)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a Serve replica (tests)
        return "local"


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


class RadixLMServer:
    """One radixlm server behind a Ray Serve replica (module docstring). ``server_argv``:
    ``launch_server`` flags (``--host`` / ``--port`` are the replica's own and replaced);
    ``kv_events``: publish KV events for the router (on free ports unless the flags set
    ``--kv-events-endpoint``). Raises RuntimeError when the server does not come up."""

    def __init__(self, server_argv: list[str], kv_events: bool = True,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        args = parse_server_args(list(server_argv))
        self.replica_id = _replica_id()
        self.node_ip = _node_ip()
        self.port = free_port_block(1, "127.0.0.1")
        flags = [*server_argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.kv_events: list[dict] = []
        publish, replay = args.kv_events_endpoint, args.kv_events_replay_endpoint
        if kv_events and publish is None:
            publish = f"tcp://*:{free_port_block(args.dp_size)}"
            replay = f"tcp://*:{free_port_block(args.dp_size)}"
            flags += ["--kv-events-endpoint", publish, "--kv-events-replay-endpoint", replay]
        if publish is not None:
            self.kv_events = [{"endpoint": self._reachable(publish, rank), "dp_rank": rank,
                               "replay": self._reachable(replay, rank) if replay else None,
                               "topic": args.kv_events_topic} for rank in range(args.dp_size)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "radixlm.runtime.deploy.child", str(os.getpid()), *flags],
                                     start_new_session=True)
        try:
            self._wait_healthy(startup_timeout_s)
            self.model_info = httpx.get(f"{self.url}/get_model_info", timeout=30,
                                        headers=self._auth(args)).raise_for_status().json()
        except BaseException:
            self._stop()
            raise
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.api_headers = self._auth(args)

    @staticmethod
    def _auth(args: ServerArgs) -> dict[str, str]:
        return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def _reachable(self, endpoint: str, rank: int) -> str:
        """A published endpoint as another node connects to it: ``*`` -> this node's IP,
        the port offset by the data parallel rank (as the server binds it)."""
        from radixlm.runtime.kv_events import offset_endpoint

        return offset_endpoint(endpoint.replace("*", self.node_ip), rank)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"radixlm server exited with code {code} during start-up")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"radixlm server not healthy after {timeout:.0f} s")

    # ------------------------------------------------------------------ requests
    async def forward(self, req: ProxyRequest) -> AsyncIterator[ProxyResponse | bytes]:
        """The server's answer to ``req`` (module docstring)."""
        code = self.proc.poll()
        if code is not None:
            yield self._unavailable(f"the replica's radixlm server exited with code {code}")
            return
        headers = [(k, v) for k, v in req.headers if k.lower() not in HOP_HEADERS]
        request = self.client.build_request(req.method, req.path, content=req.body or None, headers=headers)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:  # no response at all: the request never ran
            yield self._unavailable(f"the replica's radixlm server did not answer: {exc!r}")
            return
        try:
            out_headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS]
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                yield ProxyResponse(resp.status_code, out_headers, b"", self.replica_id, stream=True)
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                except httpx.TransportError as exc:
                    yield sse_error(503, f"the replica's radixlm server failed midway: {exc!r}")
                return
            try:
                body = await resp.aread()
            except httpx.TransportError as exc:
                yield ProxyResponse(503, [("content-type", "application/json")],
                                    error_body(503, f"the replica's radixlm server failed midway: {exc!r}"),
                                    self.replica_id)
                return
            yield ProxyResponse(resp.status_code, out_headers, body, self.replica_id)
        finally:
            await resp.aclose()

    def _unavailable(self, message: str) -> ProxyResponse:
        return ProxyResponse(503, [("content-type", "application/json")], error_body(503, message),
                             self.replica_id, retryable=True)

    def describe(self, req: ProxyRequest | None = None) -> dict:
        """This replica: its unique id, the server's pid and URL, the node's IP."""
        return {"replica": self.replica_id, "server_pid": self.proc.pid, "server_url": self.url,
                "node_ip": self.node_ip, "kv_events": self.kv_events}

    def tokenizer_files(self, req: ProxyRequest | None = None) -> dict[str, bytes]:
        """The files of the server's tokenizer directory (weights left out), by name."""
        folder = Path(self.model_info.get("tokenizer_path") or self.model_info["model_dir"])
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
                if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.stat().st_size <= TOKENIZER_FILE_LIMIT}

    # ------------------------------------------------------------------ Ray Serve hooks
    async def check_health(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"radixlm server (pid {self.proc.pid}) exited with code {code}")
        try:
            r = await self.client.get("/health", timeout=5.0)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"radixlm server /health failed: {exc!r}") from exc
        if r.status_code != 200:
            raise RuntimeError(f"radixlm server /health answered {r.status_code}")

    async def record_routing_stats(self) -> dict:
        """``num_running`` and ``num_waiting`` requests and ``kv_usage`` (0..1, the mean over
        data parallel ranks) of the server now; {} when it does not answer."""
        try:
            r = await self.client.get("/get_server_info", timeout=5.0, headers=self.api_headers)
            states = [s for s in r.json().get("internal_states", []) if s]
        except (httpx.HTTPError, ValueError):
            return {}
        if not states:
            return {}
        return {"num_running": sum(s["num_running_reqs"] for s in states),
                "num_waiting": sum(s["num_waiting_reqs"] for s in states),
                "kv_usage": sum(s["token_usage"] for s in states) / len(states)}

    def record_replica_metadata(self) -> dict:
        return {"page_size": self.model_info["page_size"], "max_total_tokens": self.model_info["max_total_tokens"],
                "kv_events": self.kv_events}

    # ------------------------------------------------------------------ shutdown
    def _stop(self) -> None:
        """SIGTERM the server (it drains), SIGKILL its whole group after STOP_TIMEOUT_S."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def __del__(self) -> None:
        if getattr(self, "proc", None) is not None:
            self._stop()
