"""What the ingress and the replicas pass through Ray Serve (no Ray import here).

A request travels as one ``ProxyRequest`` (the HTTP request as the client sent it, plus the
routing key and hints the router reads); the replica's ``forward`` answers with a
``ProxyResponse`` (status, headers and, unless streamed, the body), followed for a streamed
(``text/event-stream``) response by the body's chunks as ``bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

__all__ = ["ProxyRequest", "ProxyResponse", "ROUTING_HEADER", "ROUTING_POLICIES", "error_body", "sse_error"]

ROUTING_POLICIES = ("cache_aware", "pow2")  # PrefixCacheRouter's policies (ROUTING_HEADER picks one)
ROUTING_HEADER = "x-radixlm-routing"  # a request's own policy (A/B comparisons on one deployment)
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                         "content-encoding", "upgrade", "te", "trailer", "proxy-authorization"})


@dataclass
class ProxyRequest:
    """One HTTP request for a replica's server.

    ``path`` includes the query string; ``headers`` are the client's less hop-by-hop ones.
    Routing: ``routing_ids`` are the prompt's token ids as the server will see them (None:
    no prompt, or it could not be tokenized: load decides), ``policy`` overrides the
    deployment's (one of ``ROUTING_POLICIES``), ``pin`` names the replica (its unique id) that
    must take it (admin calls sent to every replica), ``exclude`` the replicas that already
    failed to start it."""

    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    routing_ids: list[int] | None = None
    policy: str | None = None
    pin: str | None = None
    exclude: tuple[str, ...] = field(default=())


@dataclass
class ProxyResponse:
    """A server's answer: HTTP ``status``, ``headers`` (hop-by-hop ones dropped) and ``body``
    (empty when ``stream``: the chunks follow). ``replica`` is the answering replica's
    unique id; ``retryable`` marks an answer made without the request reaching a live server
    (nothing of it ran: another replica may take it)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    replica: str
    stream: bool = False
    retryable: bool = False


def error_body(status: int, message: str, err_type: str = "service_unavailable") -> bytes:
    """The server's JSON error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": None, "code": status}})


def sse_error(status: int, message: str) -> bytes:
    """An error event and ``[DONE]``: how a server's stream ends when it fails midway."""
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"
