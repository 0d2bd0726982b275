"""Role prefixes and suffixes taken from the model's own chat template.

``user_begin()`` must append exactly the text the template puts before a user message's
content, and ``user_end()`` the text after it, so that a DSL program builds the same
prompt as ``/v1/chat/completions`` would (and shares its radix-cache pages). A Jinja
chat template renders whole conversations, not roles, so the affixes are cut out of
renderings with placeholder contents::

    render([.., {"role": "user", "content": "RADIXLM_MSG_3"}])
      = "<history>" + prefix + "RADIXLM_MSG_3" + suffix

    prefix = text between the previous message's suffix and the placeholder
             (the first message's prefix includes a default system prompt, if any)
    suffix = text after the placeholder when the message is the last one

A template that rewrites contents (drops the placeholder) or renders earlier messages
differently once a later one follows cannot be cut this way: ``ChatTemplateError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

__all__ = ["ChatTemplate", "ChatTemplateError", "CHATML"]

Render = Callable[[list[dict[str, str]]], str]


class ChatTemplateError(ValueError):
    """The chat template cannot be split into role prefixes and suffixes."""


def _placeholder(i: int) -> str:
    return f"RADIXLM_MSG_{i}"


class ChatTemplate:
    """Role affixes of a chat template given as ``render(messages) -> text`` (no
    generation prompt). Affixes depend on the roles that came before (e.g. a default
    system prompt before the first message), so they are looked up by role history."""

    def __init__(self, render: Render, name: str = "hf") -> None:
        self._render = render
        self.name = name
        self.prefix_and_suffix = lru_cache(maxsize=256)(self._affixes)

    def _rendered(self, roles: Sequence[str]) -> str:
        return self._render([{"role": r, "content": _placeholder(i)} for i, r in enumerate(roles)])

    def _affixes(self, roles: tuple[str, ...]) -> tuple[str, str]:
        """(prefix, suffix) of the last role in ``roles``."""
        text = self._rendered(roles)
        here = _placeholder(len(roles) - 1)
        if text.count(here) != 1:
            raise ChatTemplateError(f"the chat template does not render message contents verbatim: {text!r}")
        start = 0
        if len(roles) > 1:
            prev = _placeholder(len(roles) - 2)
            _, prev_suffix = self.prefix_and_suffix(roles[:-1])
            start = text.index(prev) + len(prev)
            if not text.startswith(prev_suffix, start):
                raise ChatTemplateError("the chat template renders a message differently once another follows")
            start += len(prev_suffix)
        before, after = text[start:].split(here)
        return before, after

    def prefix(self, history: Sequence[str], role: str) -> str:
        """Text appended by ``<role>_begin()`` after messages with roles ``history``."""
        return self.prefix_and_suffix((*history, role))[0]

    def suffix(self, history: Sequence[str], role: str) -> str:
        """Text appended by ``<role>_end()``; ``history`` excludes this message."""
        return self.prefix_and_suffix((*history, role))[1]


def _chatml(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


CHATML = ChatTemplate(_chatml, name="chatml")
