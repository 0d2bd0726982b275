"""``RadixLMIngress``: the HTTP face of a Ray Serve deployment of radixlm servers.

Every route of the server (native, OpenAI, health, info; streaming included) is passed to a
replica as it came (method, path, query, headers, body) and its answer comes back as the
server gave it: status code, headers, JSON errors, SSE events. Before that the ingress
tokenizes the prompt as the server will (``/generate``: ``input_ids`` or ``text``;
``/v1/completions``: ``prompt``; ``/v1/chat/completions``: the chat template over
``messages`` and ``tools``; a batch by its first prompt) so that the router can match it
against the replicas' caches; a body it cannot read is routed by load and left for the
server to refuse. The tokenizer's files come from a replica when the first prompt arrives
(prompts arriving while they load are routed by load).

Failover: an answer marked ``retryable`` (the replica's server never got the request) or a
replica that dies before answering makes the ingress try another replica, ``MAX_ATTEMPTS``
in all, excluding those that failed; then a 503 JSON error. A stream cut midway ends with
an error event and ``[DONE]``.

Admin routes go to every replica and are merged: ``POST /flush_cache`` (200 only if every
replica flushed), ``GET /debug/check_invariants`` (``ok`` if every replica is; counts
summed; per replica under ``replicas``), ``GET /metrics`` (counters and histograms summed,
gauges summed except usage / rate / ratio gauges, averaged), and ``GET /radixlm/replicas``
(each replica's id, server pid and URL, KV event endpoints; the router's decision counts,
median decision time and per-replica view; the median time to tokenize a prompt; how many
tries did not reach a live server).
"""

import asyncio
import dataclasses
import hmac
import logging
import statistics
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from radixlm.runtime.deploy.protocol import (
    ROUTING_HEADER,
    ROUTING_POLICIES,
    ProxyRequest,
    ProxyResponse,
    sse_error,
)
from radixlm.runtime.deploy.router import live_routers

__all__ = ["RadixLMIngress", "merge_metrics", "prompt_ids"]

logger = logging.getLogger("ray.serve")  # lands in the replica's Serve log
MAX_ATTEMPTS = 3
ADMIN_TIMEOUT_S = 60.0
PROMPT_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
MEAN_GAUGE_WORDS = ("usage", "_rate", "ratio")

app = FastAPI(title="radixlm on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


def _first(value: Any) -> Any:
    """A batch's first prompt (a list of prompts), else the value itself."""
    if isinstance(value, list) and value and isinstance(value[0], list | str):
        return value[0]
    return value


def prompt_ids(tokenizer: Any, path: str, body: bytes) -> list[int] | None:
    """The token ids the server will see for the request's (first) prompt, or None when the
    route has no prompt or the body cannot be read (the server then answers it)."""
    if path not in PROMPT_PATHS:
        return None
    try:
        data = orjson.loads(body)
        if not isinstance(data, dict):
            return None
        if path == "/v1/chat/completions":
            ids = tokenizer.apply_chat_template(data["messages"], tools=data.get("tools"), tokenize=True,
                                                add_generation_prompt=data.get("add_generation_prompt", True),
                                                return_dict=False)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        else:
            prompt = _first(data.get("input_ids")) if data.get("input_ids") is not None else None
            if prompt is None:
                prompt = _first(data.get("prompt") if path == "/v1/completions" else data.get("text"))
            ids = tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
        if isinstance(ids, list) and all(isinstance(t, int) and 0 <= t < 2**32 for t in ids):
            return ids
    except Exception:  # any malformed body: the server says what is wrong
        return None
    return None


def merge_metrics(texts: list[str]) -> str:
    """Prometheus texts of several servers as one: each series (name and labels) summed
    over the servers, except gauges whose name says usage, rate or ratio (averaged)."""
    order: list[str] = []
    values: dict[str, list[float]] = {}
    comments: list[str] = []
    for i, text in enumerate(texts):
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                if i == 0:
                    comments.append(line)
                continue
            key, _, value = line.rpartition(" ")
            if key not in values:
                order.append(key)
                values[key] = []
            try:
                values[key].append(float(value))
            except ValueError:
                continue
    gauges = {ln.split()[2] for ln in comments if ln.startswith("# TYPE") and ln.split()[-1] == "gauge"}
    out, emitted = [], set()
    for line in comments:  # families in the first server's order, each with its samples
        parts = line.split()
        out.append(line)
        if line.startswith("# TYPE"):
            family = parts[2]
            for key in order:
                name = key.split("{", 1)[0]
                if key not in emitted and (name == family or name.rsplit("_", 1)[0] == family):
                    vals = values[key]
                    mean = family in gauges and any(w in family for w in MEAN_GAUGE_WORDS)
                    out.append(f"{key} {(sum(vals) / len(vals)) if mean else sum(vals)}")
                    emitted.add(key)
    out += [f"{key} {sum(values[key])}" for key in order if key not in emitted]
    return "\n".join(out) + "\n"


def _auto_tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@serve.ingress(app)
class RadixLMIngress:
    """The ingress deployment (module docstring). ``server``: the handle of the
    ``RadixLMServer`` deployment; ``server_deployment``: its name (the router's key)."""

    def __init__(self, server: DeploymentHandle, server_deployment: str = "RadixLMServer",
                 api_key: str | None = None) -> None:
        self.server = server
        self.server_deployment = server_deployment
        self.api_key = api_key  # the servers' --api-key: the routes answered here check it too
        self.tokenizer: Any = None
        self._tokenizer_lock = asyncio.Lock()
        self.tokenize_seconds: deque[float] = deque(maxlen=100_000)  # prompt_ids per prompt
        self.retried = 0  # tries that did not reach a live server (another replica was tried)
        self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="radixlm-ingress-tokenizer-")

    # ------------------------------------------------------------------ tokenizer
    async def _load_tokenizer(self) -> Any:
        async with self._tokenizer_lock:
            if self.tokenizer is None:
                files = await self.server.options(method_name="tokenizer_files").remote(
                    ProxyRequest("GET", "/", policy="pow2"))
                folder = Path(self._tokenizer_dir.name)
                for name, data in files.items():
                    (folder / name).write_bytes(data)
                self.tokenizer = await asyncio.to_thread(_auto_tokenizer, str(folder))
        return self.tokenizer

    async def _routing_ids(self, path: str, body: bytes) -> list[int] | None:
        """The prompt's ids for the router. The first prompt loads the tokenizer (prompts
        arriving meanwhile are routed by load: None)."""
        if path not in PROMPT_PATHS:
            return None
        if self.tokenizer is None:
            if self._tokenizer_lock.locked():
                return None
            try:  # not in the background: Ray Serve gives every handle call of one request the
                await self._load_tokenizer()  # same internal id, and the router matches by it
            except Exception:
                logger.exception("cannot load the tokenizer for routing; routing by load")
                return None
        start = time.perf_counter()
        ids = prompt_ids(self.tokenizer, path, body)
        self.tokenize_seconds.append(time.perf_counter() - start)
        return ids

    # ------------------------------------------------------------------ forwarding
    async def _send(self, req: ProxyRequest) -> tuple[ProxyResponse, Any]:
        """The first answer of a replica that got ``req`` (and the stream of the rest),
        trying others as the module docstring says."""
        last = "no replica answered"
        for attempt in range(MAX_ATTEMPTS):
            gen = self.server.options(stream=True).forward.remote(req)
            try:
                head = await gen.__anext__()
            except Exception as exc:  # the replica actor died or could not be reached
                self.retried += 1
                last = f"replica failed before answering: {exc!r}"
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            if not head.retryable:
                return head, gen
            self.retried += 1
            last = orjson.loads(head.body)["error"]["message"]
            req = dataclasses.replace(req, exclude=(*req.exclude, head.replica))
        return ProxyResponse(503, [("content-type", "application/json")],
                             orjson.dumps({"error": {"message": f"no radixlm replica could take the request: {last}",
                                                     "type": "service_unavailable", "param": None, "code": 503}}),
                             "", retryable=True), None

    @staticmethod
    async def _chunks(gen: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in gen:
                yield chunk
        except Exception as exc:  # the replica died midway
            yield sse_error(503, f"the replica failed midway: {exc!r}")

    async def _respond(self, req: ProxyRequest) -> Response:
        head, gen = await self._send(req)
        headers = {k: v for k, v in head.headers if k.lower() != "content-type"}
        media = dict((k.lower(), v) for k, v in head.headers).get("content-type")
        if head.stream:
            return StreamingResponse(self._chunks(gen), status_code=head.status, headers=headers, media_type=media)
        return Response(head.body, status_code=head.status, headers=headers, media_type=media)

    @staticmethod
    def _request(request: Request, body: bytes, **kw: Any) -> ProxyRequest:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        policy = request.headers.get(ROUTING_HEADER)
        return ProxyRequest(request.method, path, body, tuple(request.headers.items()),
                            policy=policy if policy in ROUTING_POLICIES else None, **kw)

    # ------------------------------------------------------------------ every replica
    async def _replica_ids(self) -> list[str]:
        """The replicas the router knows (after a first call creates it, if needed)."""
        for _ in range(100):
            router = live_routers().get(self.server_deployment)
            if router is not None and router.replica_ids():
                return router.replica_ids()
            if router is None:
                await self.server.options(method_name="describe").remote(ProxyRequest("GET", "/", policy="pow2"))
            else:
                await asyncio.sleep(0.1)
        return []

    async def _each(self, method: str, req: ProxyRequest) -> list[Any]:
        """``method`` called on every replica with ``req`` pinned to it, one replica after
        the other (concurrent calls of one request would share its internal id, by which Ray
        Serve's router hands chosen replicas to calls)."""
        out = []
        for rid in await self._replica_ids():
            pinned = dataclasses.replace(req, pin=rid)
            call = (self._forward_pinned(pinned) if method == "forward"
                    else self.server.options(method_name=method).remote(pinned))
            out.append(await asyncio.wait_for(call, ADMIN_TIMEOUT_S))
        return out

    async def _forward_pinned(self, req: ProxyRequest) -> ProxyResponse:
        gen = self.server.options(stream=True).forward.remote(req)
        head = await gen.__anext__()
        if head.stream:
            head = dataclasses.replace(head, body=b"".join([c async for c in gen]))
        return head

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(self, request: Request) -> Response:
        answers = await self._each("forward", self._request(request, await request.body()))
        failed = [a for a in answers if a.status != 200]
        if failed:
            return Response(failed[0].body, status_code=failed[0].status, media_type="application/json")
        return Response(answers[0].body if answers else b"", status_code=200,
                        media_type=dict(answers[0].headers).get("content-type") if answers else None)

    @app.get("/debug/check_invariants")
    async def check_invariants(self, request: Request) -> Response:
        answers = await self._each("forward", self._request(request, b""))
        if any(a.status != 200 for a in answers):
            bad = next(a for a in answers if a.status != 200)
            return Response(bad.body, status_code=bad.status, media_type="application/json")
        reports = {a.replica: orjson.loads(a.body) for a in answers}
        merged: dict[str, Any] = {"ok": all(r["ok"] for r in reports.values()),
                                  "message": "; ".join(r["message"] for r in reports.values() if r["message"]),
                                  "violations": [v for r in reports.values() for v in r["violations"]]}
        for key in ("num_live", "free_pages", "cached_pages", "locked_pages"):
            merged[key] = sum(r[key] for r in reports.values())
        merged["replicas"] = reports
        return JSONResponse(merged)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        answers = await self._each("forward", self._request(request, b""))
        bad = [a for a in answers if a.status != 200]
        if bad or not answers:
            return Response(bad[0].body if bad else b"", status_code=bad[0].status if bad else 503)
        text = merge_metrics([a.body.decode() for a in answers])
        return Response(text, media_type=dict(answers[0].headers).get("content-type", "text/plain"))

    @app.get("/radixlm/replicas")
    async def replicas(self, request: Request) -> JSONResponse:
        given = request.headers.get("authorization", "")
        if self.api_key is not None and not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return JSONResponse({"error": {"message": "invalid or missing API key", "type": "authentication_error",
                                           "param": None, "code": 401}}, status_code=401)
        described = await self._each("describe", ProxyRequest("GET", "/"))
        router = live_routers().get(self.server_deployment)
        decisions = list(router.decision_seconds) if router is not None else []
        return JSONResponse({
            "replicas": sorted(described, key=lambda d: d["replica"]),
            "router": {"policy": router.routing.policy if router else None,
                       "mode": router.routing.mode if router else None,
                       "decisions": dict(router.reasons) if router else {},
                       "median_decision_ms": statistics.median(decisions) * 1e3 if decisions else None,
                       **(router.routing.describe() if router else {})},
            "tokenizer_loaded": self.tokenizer is not None, "retried": self.retried,
            "median_tokenize_ms": statistics.median(self.tokenize_seconds) * 1e3 if self.tokenize_seconds else None})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def proxy(self, request: Request, path: str) -> Response:
        body = await request.body()
        ids = await self._routing_ids(request.url.path, body)
        return await self._respond(self._request(request, body, routing_ids=ids))
