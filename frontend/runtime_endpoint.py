"""Backends for a radixlm (or SGLang) server's native API, and one that starts a server.

``RuntimeEndpoint(url)`` talks to ``/generate``, ``/get_model_info`` and
``/flush_cache`` with SGLang's field names:

- ``gen`` sends the state's ``text`` (the server tokenizes it), streaming when asked;
- ``select`` tokenizes ``prompt + option`` locally and sends one ``input_ids`` row per
  option (and one for the prompt when its tail is scored, see ``choices``) in one
  request with ``max_new_tokens=0``, ``return_logprob`` and ``logprob_start_len`` = the
  scoring start; the server returns ``input_token_logprobs`` from that position (the
  prefix before it can come from the radix cache);
- a fork first sends the prefix with ``max_new_tokens=0`` (the prompt is computed and
  cached, no token generated, as in SGLang) so its pages are in the radix cache before
  the branches run.

The tokenizer and chat template come from the model directory the server reports as
``tokenizer_path`` in ``/get_model_info`` (read with ``tokenizer.HFTokenizer``, no
torch); the frontend must see that directory (same machine or shared disk), or be given
``tokenizer_path`` pointing at a copy. Plain ``gen`` programs without roles need neither.

``Runtime(**server_flags)`` starts ``python -m radixlm.runtime.launch_server`` as a child
process (it talks to the runtime over HTTP only and imports none of it; ``engine.Engine``
runs the runtime in-process instead) and is a ``RuntimeEndpoint`` to it until
``shutdown()``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from radixlm.frontend.backend import Backend, Prompt
from radixlm.frontend.chat_template import ChatTemplate
from radixlm.frontend.choices import ChoicesMethod, decide, plan_scoring
from radixlm.frontend.ir import SamplingParams
from radixlm.frontend.tokenizer import HFTokenizer
from radixlm.frontend.transport import HttpClient

__all__ = ["RuntimeEndpoint", "Runtime"]


class RuntimeEndpoint(Backend):
    """The native API at ``base_url`` (e.g. ``http://127.0.0.1:30000``). ``api_key``:
    the server's ``--api-key``; ``tokenizer_path``: a local copy of the model's tokenizer
    files (default: the server's ``tokenizer_path``); ``timeout`` in seconds per HTTP
    request. Raises transport.BackendError if ``/get_model_info`` fails."""

    def __init__(self, base_url: str, api_key: str | None = None, tokenizer_path: str | None = None,
                 timeout: float = 600.0) -> None:
        http = HttpClient(base_url, api_key, timeout)
        self.base_url = http.base_url
        self._connect(http, tokenizer_path)

    def _connect(self, http: Any, tokenizer_path: str | None) -> None:
        """Use ``http`` (an ``HttpClient``, or anything with its ``get``/``post``/``stream``
        taking the native API's paths: ``Engine``'s in-process server)."""
        self.http = http
        self.model_info: dict[str, Any] = self.http.get("/get_model_info")
        self._tokenizer_path = tokenizer_path or self.model_info.get("tokenizer_path")
        # --stream-output: events carry disjoint segments; else the text so far (SGLang's default)
        self._segments = bool(self.model_info.get("stream_output"))
        self._tokenizer: HFTokenizer | None = None
        self._template: ChatTemplate | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ model files
    @property
    def tokenizer(self) -> HFTokenizer:
        """The model's tokenizer, loaded on first use. Raises ValueError if its files
        cannot be read here."""
        with self._lock:
            if self._tokenizer is None:
                path = self._tokenizer_path
                if not path or not Path(path).is_dir():
                    raise ValueError(
                        f"cannot read the model's tokenizer at {path!r} (the server's tokenizer_path); "
                        "pass RuntimeEndpoint(..., tokenizer_path=<local copy of the model directory>)")
                self._tokenizer = HFTokenizer(path)
            return self._tokenizer

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            tokenizer = self.tokenizer
            if tokenizer.template_source is None:
                raise ValueError(f"the model at {tokenizer.path} has no chat template; roles need one")
            self._template = ChatTemplate(tokenizer.render)
        return self._template

    # ------------------------------------------------------------------ generation
    def _body(self, prompt: Prompt, params: SamplingParams, stream: bool) -> dict[str, Any]:
        return {"text": prompt.text, "sampling_params": params.native(), "stream": stream,
                **params.request_fields()}

    def generate(self, prompt: Prompt, params: SamplingParams) -> tuple[str, dict[str, Any]]:
        out = self.http.post("/generate", self._body(prompt, params, stream=False))
        return out["text"], out["meta_info"]

    def generate_stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        sent = 0
        for event in self.http.stream("/generate", self._body(prompt, params, stream=True)):
            text, meta = event["text"], event["meta_info"]
            piece = text if self._segments else text[sent:]
            sent = len(text)
            # events that only add token ids (their text held back) carry nothing for the DSL
            if piece or meta.get("finish_reason") is not None:
                yield piece, meta

    def select(self, prompt: Prompt, choices: Sequence[str],
               method: ChoicesMethod) -> tuple[str, dict[str, Any]]:
        tok = self.tokenizer
        plan = plan_scoring(prompt.text, choices, tok.encode, tok.decode)
        out = self.http.post("/generate", {
            "input_ids": plan.rows, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": plan.start})
        lps = [[entry[0] for entry in r["meta_info"]["input_token_logprobs"]] for r in out]
        extra = {"input_token_ids": [j[plan.start:] for j in plan.joint],
                 "cached_tokens": [r["meta_info"]["cached_tokens"] for r in out[:len(choices)]]}
        return decide(choices, plan, lps, method, extra)

    # ------------------------------------------------------------------ cache
    def cache_prefix(self, prompt: Prompt) -> None:
        self.http.post("/generate", {"text": prompt.text,
                                     "sampling_params": {"max_new_tokens": 0}})

    def flush_cache(self) -> None:
        self.http.post("/flush_cache", {})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(flags: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


class Runtime(RuntimeEndpoint):
    """Starts a radixlm server (``python -m radixlm.runtime.launch_server``) on a free
    loopback port and is the ``RuntimeEndpoint`` to it. ``server_flags`` are the
    launcher's flags as keywords (``model_path="..."``, ``page_size=16``,
    ``disable_radix_cache=True``); ``log`` receives the server's output (default:
    discarded); ``startup_timeout`` in seconds (the first start ever converts the default
    model, ~20 s). Raises RuntimeError if the server exits or is not healthy in time.
    ``shutdown()`` (also at exit, or leaving a ``with`` block) stops it with SIGTERM."""

    def __init__(self, log: IO[str] | None = None, startup_timeout: float = 900.0,
                 **server_flags: Any) -> None:
        port = _free_port()
        cmd = [sys.executable, "-m", "radixlm.runtime.launch_server", *_flags(server_flags),
               "--port", str(port)]
        self.proc = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        atexit.register(self.shutdown)
        url = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy(url, startup_timeout)
            super().__init__(url, api_key=server_flags.get("api_key"))
        except BaseException:
            self.shutdown()
            raise

    def _wait_healthy(self, url: str, timeout: float) -> None:
        probe = HttpClient(url, timeout=2.0)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.proc.returncode} during start-up")
                with contextlib.suppress(Exception):
                    probe.get("/health")
                    return
                time.sleep(0.5)
        finally:
            probe.close()
        raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")

    @property
    def url(self) -> str:
        return self.base_url

    def shutdown(self, timeout: float = 60.0) -> int | None:
        """Stop the server (SIGTERM: it drains requests; SIGKILL to its process group
        after ``timeout`` seconds). Returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # the scheduler must not outlive it
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
