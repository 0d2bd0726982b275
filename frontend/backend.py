"""What a program needs from a model: the interface every backend implements."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.frontend.chat_template import ChatTemplate
from radixlm.frontend.choices import ChoicesMethod
from radixlm.frontend.ir import SamplingParams

__all__ = ["Backend", "Prompt"]


@dataclass(frozen=True)
class Prompt:
    """A state at the moment it calls the model: the whole ``text``; the finished chat
    ``messages``; the open ``role`` (None outside a role) and ``role_text``, what that
    role's message holds so far."""

    text: str
    messages: tuple[dict[str, str], ...] = ()
    role: str | None = None
    role_text: str = ""


class Backend:
    """A model behind an API. ``generate`` returns (text, meta_info); ``generate_stream``
    yields (new text, meta_info so far); ``select`` returns (choice, meta_info). Errors
    from the server are ``transport.BackendError``; an operation the API cannot do is
    NotImplementedError."""

    def chat_template(self) -> ChatTemplate:
        """The role prefixes/suffixes of the model. Raises ValueError if unknown."""
        raise NotImplementedError

    def generate(self, prompt: Prompt, params: SamplingParams) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def generate_stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        raise NotImplementedError

    def select(self, prompt: Prompt, choices: Sequence[str],
               method: ChoicesMethod) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def cache_prefix(self, prompt: Prompt) -> None:
        """Make the server compute and cache ``prompt`` (before a fork); a no-op where
        the API has no prefix cache to warm."""

    def flush_cache(self) -> None:
        raise NotImplementedError
