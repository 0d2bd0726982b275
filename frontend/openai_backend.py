"""A backend for an OpenAI-compatible API (``/v1/completions``, ``/v1/chat/completions``).

- A ``gen`` right after ``assistant_begin()`` (nothing written into that message yet)
  sends the finished messages to ``/v1/chat/completions``; the server applies the
  model's chat template, so ``s.text()`` shows the roles in ``chat_template`` (ChatML by
  default) only for reading. A ``gen`` outside any role sends ``s.text()`` to
  ``/v1/completions``. A ``gen`` inside a partly written message, or in another role,
  cannot be expressed in these APIs: ValueError.
- ``json_schema`` becomes ``response_format: {"type": "json_schema", ...}`` on chat
  requests; ``regex``, ``ebnf`` and ``stop_regex`` (and ``json_schema`` on completions)
  have no OpenAI form and are sent as the extra body fields radixlm and SGLang accept
  (another server may refuse them).
- ``select`` (outside any role, like a completions ``gen``) scores the options through
  ``/v1/completions`` with ``echo``, ``logprobs=0`` and ``max_tokens=0``: one request
  whose prompts are ``text + option`` for each option and ``text`` itself; the echoed
  ``logprobs.tokens`` (token strings) of those rows stand in for token ids in the same
  joint-tokenisation scoring as ``RuntimeEndpoint`` (``choices.plan_from_tokens``, case
  C21). radixlm and vLLM give prompt logprobs this way; an API that refuses ``echo`` /
  ``max_tokens=0`` or returns no prompt logprobs raises NotImplementedError saying so.
  The scored prompts are computed whole (prompt logprobs are not read from a cache).
  Inside a chat message ``select`` is NotImplementedError: the text would have to be
  rendered by the server's chat template, which these APIs do not expose.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from radixlm.frontend.backend import Backend, Prompt
from radixlm.frontend.chat_template import CHATML, ChatTemplate
from radixlm.frontend.choices import ChoicesMethod, decide, plan_from_tokens
from radixlm.frontend.ir import SamplingParams
from radixlm.frontend.transport import BackendError, HttpClient

__all__ = ["OpenAI"]

# native name -> OpenAI name of the sampling fields sent when not at their default
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "stop": "stop",
                 "stop_token_ids": "stop_token_ids", "temperature": "temperature", "top_p": "top_p",
                 "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
                 "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
                 "ignore_eos": "ignore_eos", "seed": "seed"}


class OpenAI(Backend):
    """``model_name`` served at ``base_url`` (ending in ``/v1``), ``api_key`` sent as a
    Bearer token; ``chat_template`` renders roles into ``s.text()`` (display only);
    ``timeout`` in seconds per request."""

    def __init__(self, model_name: str, base_url: str = "https://api.openai.com/v1",
                 api_key: str | None = None, chat_template: ChatTemplate = CHATML,
                 timeout: float = 600.0) -> None:
        self.model_name = model_name
        self.http = HttpClient(base_url, api_key, timeout)
        self._template = chat_template

    def chat_template(self) -> ChatTemplate:
        return self._template

    def _body(self, prompt: Prompt, params: SamplingParams, stream: bool) -> tuple[str, dict[str, Any]]:
        if params.tools is not None:
            raise NotImplementedError("gen(tools=...) needs radixlm's native API (RuntimeEndpoint, Runtime, Engine)")
        body: dict[str, Any] = {"model": self.model_name, "stream": stream}
        for extra in ("regex", "ebnf"):
            if getattr(params, extra) is not None:
                body[extra] = getattr(params, extra)
        if params.stop_regex:
            body["stop_regex"] = list(params.stop_regex)
        for native, name in _OPENAI_NAMES.items():
            value = getattr(params, native)
            if native == "max_new_tokens" or value != SamplingParams.__dataclass_fields__[native].default:
                body[name] = list(value) if isinstance(value, tuple) else value
        if prompt.role == "assistant" and not prompt.role_text:
            body["messages"] = list(prompt.messages)
            if params.json_schema is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": json.loads(params.json_schema)}}
            return "/chat/completions", body
        if prompt.role is None and not prompt.messages:
            if params.json_schema is not None:
                body["json_schema"] = params.json_schema
            return "/completions", {**body, "prompt": prompt.text}
        raise ValueError("with the OpenAI backend a gen must open an assistant message (right after "
                         "assistant_begin()) or stand outside any role in a program without roles")

    def generate(self, prompt: Prompt, params: SamplingParams) -> tuple[str, dict[str, Any]]:
        path, body = self._body(prompt, params, stream=False)
        out = self.http.post(path, body)
        choice = out["choices"][0]
        text = choice["message"]["content"] if "messages" in body else choice["text"]
        return text or "", {"finish_reason": choice["finish_reason"], "usage": out.get("usage")}

    def generate_stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        path, body = self._body(prompt, params, stream=True)
        for event in self.http.stream(path, body):
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            text = choice.get("delta", {}).get("content") if "messages" in body else choice.get("text")
            yield text or "", {"finish_reason": choice.get("finish_reason")}

    def select(self, prompt: Prompt, choices: Sequence[str],
               method: ChoicesMethod) -> tuple[str, dict[str, Any]]:
        if prompt.role is not None or prompt.messages:
            raise NotImplementedError(
                "with the OpenAI backend a select must stand outside any role in a program without "
                "roles: it scores text through /completions (echo), and the server's rendering of "
                "chat messages is not available through the API; use RuntimeEndpoint for select in roles")
        rows = self._echo_logprobs([prompt.text + c for c in choices] + [prompt.text])
        tokens = [r["tokens"] for r in rows]
        joined = "".join(tokens[-1])  # the prompt's tokens may start with a BOS that is no text
        lead = joined[: len(joined) - len(prompt.text)] if joined.endswith(prompt.text) else ""
        plan = plan_from_tokens(lead + prompt.text, tokens[-1], tokens[:-1], "".join)
        scored = rows[:-1] + ([rows[-1]] if plan.scores_prompt_tail else [])
        lps = [r["token_logprobs"][plan.start:] for r in scored]
        if any(lp is None for row in lps for lp in row):
            raise NotImplementedError("the server returned null logprobs for prompt tokens; select needs them")
        return decide(choices, plan, lps, method, {"input_tokens": [t[plan.start:] for t in tokens[:-1]]})

    def _echo_logprobs(self, prompts: list[str]) -> list[dict[str, Any]]:
        """The echoed ``logprobs`` object of each prompt (max_tokens=0). Raises
        NotImplementedError if the API refuses that or returns no prompt logprobs."""
        body = {"model": self.model_name, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 0,
                "temperature": 0.0}
        try:
            out = self.http.post("/completions", body)
        except BackendError as exc:
            if 400 <= exc.status < 500:
                raise NotImplementedError(
                    "select through an OpenAI-compatible API needs /completions with echo=true, "
                    f"logprobs and max_tokens=0 (prompt-token logprobs); the server refused: {exc.message}"
                ) from exc
            raise
        rows = [c.get("logprobs") for c in sorted(out.get("choices", []), key=lambda c: c["index"])]
        if len(rows) != len(prompts) or any(not r or not r.get("tokens") or not r.get("token_logprobs")
                                            for r in rows):
            raise NotImplementedError("select needs prompt-token logprobs, and this server's /completions "
                                      "with echo=true returned none")
        return rows

    def flush_cache(self) -> None:
        raise NotImplementedError("the OpenAI API has no cache flush")
