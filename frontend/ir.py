"""The expressions a program appends to its state (``s += expr``) and the sampling
parameters they carry.

    s += "text"                      -> Text
    s += gen("x", max_tokens=8)      -> Gen
    s += select("y", ["a", "b"])     -> Select
    s += user("hi")                  -> ExprList[RoleBegin, Text, RoleEnd]
    s += "Q: " + gen("a")            -> ExprList[Text, Gen]

Expressions are plain immutable data; ``interpreter.StreamExecutor`` executes them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SamplingParams", "Expr", "Text", "Gen", "Select", "RoleBegin", "RoleEnd", "ExprList",
           "as_expr"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one ``gen``, with SGLang's native ``/generate`` names.

    ``max_new_tokens`` counts tokens; ``stop`` holds strings that end the generation (not
    included in the output), ``stop_regex`` patterns that do the same when the output
    text matches (the server must support them: radixlm and SGLang do); ``regex`` / ``json_schema`` (a JSON string) / ``ebnf``
    constrain the output (the server must support constrained decoding; one at most).
    ``return_logprob`` and the fields after it are request-level options of ``/generate``
    whose results land in the variable's meta info; ``tools`` (OpenAI tool definitions, as
    JSON text), ``tool_choice`` (JSON text) and ``parallel_tool_calls`` make the server
    generate calls under the tools' grammar and parse them (``meta_info["tool_calls"]``).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    tools: str | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None

    REQUEST_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num",
                      "return_text_in_logprobs")
    TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    def merge(self, overrides: dict[str, Any]) -> SamplingParams:
        """A copy with ``overrides`` applied (None values are skipped). Raises TypeError
        for a name that is not a field."""
        unknown = set(overrides) - self.field_names()
        if unknown:
            raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
        clean = {k: _normalise(k, v) for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **clean)

    def native(self) -> dict[str, Any]:
        """The ``sampling_params`` object of a ``/generate`` body (defaults left out)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.REQUEST_FIELDS or f.name in self.TOOL_FIELDS or value == f.default:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["max_new_tokens"] = self.max_new_tokens
        return out

    def request_fields(self) -> dict[str, Any]:
        """The request-level logprob and tool options of a ``/generate`` body (only those set)."""
        out: dict[str, Any] = {}
        if self.return_logprob:
            out["return_logprob"] = True
            for name in self.REQUEST_FIELDS[1:]:
                value = getattr(self, name)
                if value not in (None, False):
                    out[name] = value
        if self.tools is not None:
            out["tools"] = json.loads(self.tools)
            if self.tool_choice is not None:
                out["tool_choice"] = json.loads(self.tool_choice)
            if self.parallel_tool_calls is not None:
                out["parallel_tool_calls"] = self.parallel_tool_calls
        return out

    @property
    def constrained(self) -> bool:
        return any(v is not None for v in (self.regex, self.json_schema, self.ebnf))


def _normalise(name: str, value: Any) -> Any:
    if name in ("stop", "stop_regex"):
        return (value,) if isinstance(value, str) else tuple(value)
    if name == "stop_token_ids":
        return tuple(value)
    if name == "json_schema" and not isinstance(value, str):
        return json.dumps(value)  # a dict schema is accepted too
    if name in ("tools", "tool_choice"):
        return json.dumps(list(value) if name == "tools" else value)
    return value


class Expr:
    """Base of every expression; ``a + b`` concatenates (strings become Text)."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList((self, as_expr(other)))

    def __radd__(self, other: Any) -> ExprList:
        return ExprList((as_expr(other), self))


@dataclass(frozen=True)
class Text(Expr):
    value: str


@dataclass(frozen=True)
class Gen(Expr):
    """Generate into variable ``name``; ``overrides`` are the sampling fields given to
    ``gen`` (merged over the program's defaults when executed)."""

    name: str | None
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Select(Expr):
    """Append the best-scoring of ``choices``; ``method`` is a ``choices`` scoring method."""

    name: str | None
    choices: tuple[str, ...]
    method: Any


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class ExprList(Expr):
    items: tuple[Expr, ...]

    def __add__(self, other: Any) -> ExprList:
        return ExprList((*self.items, as_expr(other)))

    def __radd__(self, other: Any) -> ExprList:
        return ExprList((as_expr(other), *self.items))


def as_expr(value: Any) -> Expr:
    """``value`` as an expression: an Expr as is, anything else as its ``str``. Raises
    ValueError for None (a program appending None is a bug)."""
    if isinstance(value, Expr):
        return value
    if value is None:
        raise ValueError("cannot append None to a program state")
    return Text(str(value))
