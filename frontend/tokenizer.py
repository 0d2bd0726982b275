"""A Hugging Face model directory's tokenizer and chat template, without torch.

``transformers`` imports torch as soon as a tokenizer class is imported, so the
frontend reads the same files itself: ``tokenizer.json`` with the ``tokenizers``
library (the fast tokenizer transformers wraps; ``encode`` adds special tokens as
``tokenizer.encode(text)`` does, like the server's tokenizer process) and the Jinja chat
template from ``chat_template.jinja`` or ``tokenizer_config.json``, rendered in a
sandbox with the helpers transformers provides (``raise_exception``, ``tojson``,
``strftime_now``) and ``trim_blocks`` / ``lstrip_blocks``.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

__all__ = ["HFTokenizer"]


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older configs
        return token.get("content")
    return token


def _read_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


class HFTokenizer:
    """Tokenizer files of the model directory ``path``. Raises FileNotFoundError without
    ``tokenizer.json`` (a slow-tokenizer-only model is not supported)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self.path = path
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.template_source = _read_template(path, config)
        self._template = None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, special tokens added as the server adds them."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The chat template applied to ``messages``. Raises ValueError if the model has
        no chat template, jinja2.TemplateError if the template rejects the messages."""
        if self.template_source is None:
            raise ValueError(f"the model at {self.path} has no chat template")
        if self._template is None:
            self._template = _compile(self.template_source)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special)


def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)
