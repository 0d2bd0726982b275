"""A backend for an OpenAI-compatible API (``/v1/completions``, ``/v1/chat/completions``).

- A ``gen`` right after ``assistant_begin()`` (nothing written into that message yet)
  sends the finished messages to ``/v1/chat/completions``; the server applies the
  model's chat template, so ``s.text()`` shows the roles in ``chat_template`` (ChatML by
  default) only for reading. A ``gen`` outside any role sends ``s.text()`` to
  ``/v1/completions``. A ``gen`` inside a partly written message, or in another role,
  cannot be expressed in these APIs: ValueError.
- ``json_schema`` becomes ``response_format: {"type": "json_schema", ...}`` on chat
  requests; ``regex`` and ``ebnf`` (and ``json_schema`` on completions) have no OpenAI
  form and are sent as the extra body fields radixlm and SGLang accept (another
  server may refuse them).
- ``select`` needs the logprobs of given tokens (the prompt's, i.e. ``echo``), which
  these APIs do not return here: NotImplementedError (radixlm's ``/v1/completions``
  refuses ``echo``; its logprobs are those of sampled tokens only). Use a
  ``RuntimeEndpoint`` for ``select``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from radixlm.frontend.backend import Backend, Prompt
from radixlm.frontend.chat_template import CHATML, ChatTemplate
from radixlm.frontend.choices import ChoicesMethod
from radixlm.frontend.ir import SamplingParams
from radixlm.frontend.transport import HttpClient

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
        body: dict[str, Any] = {"model": self.model_name, "stream": stream}
        for extra in ("regex", "ebnf"):
            if getattr(params, extra) is not None:
                body[extra] = getattr(params, extra)
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
        raise NotImplementedError(
            "select needs prompt-token logprobs (echo), which this OpenAI-compatible API does not "
            "return; use RuntimeEndpoint for select")

    def flush_cache(self) -> None:
        raise NotImplementedError("the OpenAI API has no cache flush")
