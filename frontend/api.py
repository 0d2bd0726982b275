"""The public DSL, under SGLang's names.

    @function
    def qa(s, question):
        s += system("You are terse.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=32))

    set_default_backend(RuntimeEndpoint("http://127.0.0.1:30000"))
    state = qa.run(question="What is 2+2?", temperature=0)
    state["answer"], state.text(), state.messages()
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

from radixlm.frontend.backend import Backend
from radixlm.frontend.choices import ChoicesMethod, token_length_normalized
from radixlm.frontend.interpreter import ProgramState, run_program, run_program_batch
from radixlm.frontend.ir import ExprList, Gen, RoleBegin, RoleEnd, SamplingParams, Select, as_expr

__all__ = ["function", "Function", "gen", "select", "system", "user", "assistant", "system_begin",
           "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
           "set_default_backend", "get_default_backend", "flush_cache"]

_default_backend: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    """The backend used by ``run`` / ``run_batch`` when none is passed."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


def _backend(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(...)")
    return backend


def flush_cache(backend: Backend | None = None) -> None:
    """Empty the server's prefix cache. Raises transport.BackendError if it refuses."""
    _backend(backend).flush_cache()


class Function:
    """A program: ``func(s, **args)`` appending to its state ``s``. ``run`` and
    ``run_batch`` take the program's arguments plus default sampling parameters by
    their ``SamplingParams`` names (``temperature=0``, ``max_new_tokens=64``), which
    every ``gen`` inherits unless it sets its own."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        params = list(inspect.signature(func).parameters.values())[1:]  # after the state
        self._arg_names = {p.name for p in params}
        self._any_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
        """Program arguments and default sampling parameters. Raises TypeError for a
        keyword that is neither."""
        sampling_names = SamplingParams.field_names()
        args, sampling = {}, {}
        for key, value in kwargs.items():
            if key in self._arg_names or (self._any_kwargs and key not in sampling_names):
                args[key] = value
            elif key in sampling_names:
                sampling[key] = value
            else:
                raise TypeError(f"{self.__name__}() got an unexpected keyword argument {key!r}")
        return args, SamplingParams().merge(sampling)

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False,
            **kwargs: Any) -> ProgramState:
        """Run the program once; returns its state. Without ``stream`` it returns when the
        program is done and raises its error; with ``stream=True`` at once (read it with
        ``state.text_iter(name)``)."""
        program_kwargs, defaults = self._split(kwargs)
        return run_program(self.func, _backend(backend), args, program_kwargs, defaults, stream)

    __call__ = run

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any]], backend: Backend | None = None,
                  num_threads: int | str = "auto", **sampling: Any) -> list[ProgramState]:
        """Run the program once per kwargs dict, ``num_threads`` at a time ("auto": one
        per program, at most 64); the states in order. Raises the first program error."""
        _, defaults = self._split(sampling)
        threads = min(len(batch_kwargs), 64) if num_threads == "auto" else int(num_threads)
        batch = [self._split(dict(kw))[0] for kw in batch_kwargs]
        return run_program_batch(self.func, _backend(backend), batch, defaults, threads)


def function(func: Callable[..., Any] | None = None) -> Any:
    """Decorator making ``func(s, ...)`` a program (``@function`` or ``@function()``)."""
    if func is None:
        return Function
    return Function(func)


def gen(name: str | None = None, max_tokens: int | None = None, *, min_tokens: int | None = None,
        stop: str | Sequence[str] | None = None, stop_regex: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None,
        seed: int | None = None, regex: str | None = None, json_schema: str | dict | None = None,
        ebnf: str | None = None, return_logprob: bool | None = None,
        top_logprobs_num: int | None = None, choices: Sequence[str] | None = None,
        choices_method: ChoicesMethod | None = None, tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool | None = None) -> Gen | Select:
    """Generate into variable ``name``: at most ``max_tokens`` tokens, ending before a
    ``stop`` string or a match of a ``stop_regex`` pattern. Unset parameters inherit the
    program's defaults. ``regex``, or ``json_schema`` (a JSON string or a dict), or
    ``ebnf`` constrains the output (the server must support it). With ``choices`` this is
    ``select``. Raises re.error for an invalid ``stop_regex`` (the server matches those with
    Python's syntax), ValueError if more than one constraint is given. ``regex`` is the
    grammar compiler's dialect (xgrammar: e.g. ``(?<name>...)`` groups, which Python's
    ``re`` refuses), so it is not checked here: an invalid one is the server's 400 with the
    compiler's message (BackendError).

    ``tools`` (OpenAI tool definitions, ``{"type": "function", "function": {"name",
    "description", "parameters"}}``) makes this gen a tool call: the server generates the
    call in its tool-call format under the tools' grammar (``tool_choice``: "auto" (the
    default: the model may also answer in text), "required", or ``{"type": "function",
    "function": {"name": ...}}``; ``parallel_tool_calls=False``: at most one call), the
    state's text gets the output as written, and variable ``name`` holds the parsed calls:
    a list of ``{"id", "name", "arguments"}`` with the arguments decoded (a dict). The
    prompt is the program's own: describe the tools in it (e.g. in the system message).
    Needs a backend on radixlm's native API (``RuntimeEndpoint``, ``Runtime``, ``Engine``).
    Raises ValueError for an empty ``tools`` or ``tools`` with another constraint."""
    if tools is not None and (not tools or regex is not None or json_schema is not None or ebnf is not None):
        raise ValueError("tools must be a non-empty list of tool definitions, without regex / json_schema / ebnf")
    if choices is not None:
        return select(name, choices, choices_method=choices_method or token_length_normalized)
    for pattern in [stop_regex] if isinstance(stop_regex, str) else list(stop_regex or []):
        re.compile(pattern)
    if sum(c is not None for c in (regex, json_schema, ebnf)) > 1:
        raise ValueError("give at most one of regex, json_schema, ebnf")
    overrides = dict(max_new_tokens=max_tokens, min_new_tokens=min_tokens, stop=stop, stop_regex=stop_regex,
                     stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k,
                     min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                     ignore_eos=ignore_eos, seed=seed, regex=regex, json_schema=json_schema, ebnf=ebnf,
                     return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, tools=tools,
                     tool_choice=tool_choice if tools is not None else None,
                     parallel_tool_calls=parallel_tool_calls if tools is not None else None)
    SamplingParams().merge(overrides)  # type errors surface here, at the call site
    return Gen(name, {k: v for k, v in overrides.items() if v is not None})


def select(name: str | None = None, choices: Sequence[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized) -> Select:
    """Append whichever of ``choices`` scores best after the text so far, into variable
    ``name``; per-option scores go to ``s.get_meta_info(name)``. ``choices_method``:
    ``token_length_normalized`` (default: mean logprob per token) or ``sum_logprob``.
    Raises ValueError for no choices, an empty choice, or ``temperature`` > 0 (selection
    is deterministic)."""
    if not choices:
        raise ValueError("select needs at least one choice")
    if any(not c for c in choices):
        raise ValueError("select choices must be non-empty strings")
    if temperature > 0:
        raise ValueError("select is deterministic: temperature must be 0")
    return Select(name, tuple(choices), choices_method)


def _role(role: str, expr: Any = None) -> ExprList:
    inner = () if expr is None else (as_expr(expr),)
    return ExprList((RoleBegin(role), *inner, RoleEnd(role)))


def system(expr: Any = None) -> ExprList:
    """A whole system message around ``expr`` (text, gen, select or a sum of them)."""
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
