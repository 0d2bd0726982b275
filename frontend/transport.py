"""JSON over HTTP for the backends: one pooled, thread-safe client per backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

__all__ = ["BackendError", "HttpClient"]


class BackendError(RuntimeError):
    """The server answered with an error: ``status`` is the HTTP status (0 for an error
    event inside a stream), ``message`` the server's error message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message


def _error_message(body: str) -> str:
    try:
        err = json.loads(body)
    except ValueError:
        return body
    if isinstance(err, dict) and isinstance(err.get("error"), dict):
        return str(err["error"].get("message"))
    return body


class HttpClient:
    """``base_url`` like ``http://127.0.0.1:30000``; ``api_key`` is sent as a Bearer
    token; ``timeout`` in seconds per request (connect, read, write)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def get(self, path: str) -> Any:
        """GET ``path``; the decoded JSON body. Raises BackendError on a non-2xx status."""
        return self._decode(self._client.get(path))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` as JSON; the decoded JSON body (None if not JSON). Raises
        BackendError on a non-2xx status."""
        return self._decode(self._client.post(path, json=body))

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST ``body`` and yield each server-sent event's JSON until ``[DONE]``.
        Raises BackendError on a non-2xx status or an error event."""
        with self._client.stream("POST", path, json=body) as r:
            if r.status_code >= 300:
                raise BackendError(r.status_code, _error_message(r.read().decode(errors="replace")))
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise BackendError(0, _error_message(data))
                yield event

    def close(self) -> None:
        self._client.close()

    @staticmethod
    def _decode(r: httpx.Response) -> Any:
        if r.status_code >= 300:
            raise BackendError(r.status_code, _error_message(r.text))
        try:
            return r.json()
        except ValueError:
            return None
