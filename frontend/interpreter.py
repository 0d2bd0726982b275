"""Executes programs: a state's expressions run in order on its own worker thread.

``s += expr`` only queues ``expr`` and returns, as in SGLang, so forked branches run
concurrently (``for f in forks: f += gen(...)`` sends one request per branch at once)
and ``run(stream=True)`` can hand out text while the program is still running. Reading
a result waits for it: ``s["name"]`` until that variable is set, ``s.text()`` /
``s.messages()`` until everything queued so far has run.

An exception while executing (an HTTP error, a bad role nesting) stops the state's
worker; later reads, appends and ``run`` raise it.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from radixlm.frontend.backend import Backend, Prompt
from radixlm.frontend.ir import (
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    SamplingParams,
    Select,
    Text,
    as_expr,
)

__all__ = ["StreamExecutor", "ProgramState", "ProgramStateGroup", "run_program", "run_program_batch"]

_END = object()  # queued by end(): the worker exits


class StreamExecutor:
    """One state's text, chat messages, variables and worker thread."""

    def __init__(self, backend: Backend, defaults: SamplingParams, stream: bool) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.cur_role: str | None = None
        self.role_begin_pos = 0
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.var_done: dict[str, threading.Event] = {}
        self.error_: BaseException | None = None
        self.finished = False  # the worker has exited
        self.ended = False  # end() was called: no more expressions are accepted
        self.changed = threading.Condition()  # notified on every text change and at the end
        self._lock = threading.Lock()  # orders submit() against the worker dying
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ caller side
    def submit(self, expr: Any) -> None:
        """Queue ``expr``. Raises the state's error if its worker has stopped on one,
        RuntimeError if the state has ended."""
        expr = as_expr(expr)
        with self._lock:
            self._raise_error()
            if self.ended:
                raise RuntimeError("this program state has ended; nothing more can be appended")
            self._register_vars(expr)
            self._queue.put(expr)

    def sync(self) -> None:
        """Wait until everything queued has run. Raises the state's error."""
        self._queue.join()
        self._raise_error()

    def end(self) -> None:
        """Let the worker exit once the queue is done (idempotent)."""
        with self._lock:
            if not self.ended:
                self.ended = True
                self._queue.put(_END)

    def get_var(self, name: str) -> Any:
        """The variable's value, waiting until it is set. Raises KeyError for a name never
        set nor pending, or the state's error."""
        event = self.var_done.get(name)
        if event is not None:
            event.wait()
        self._raise_error()
        return self.variables[name]

    def fork(self, size: int) -> list[StreamExecutor]:
        """``size`` new executors starting from this state's text, messages and
        variables; the shared prefix is cached on the server first (size > 1)."""
        self.sync()
        if size > 1 and self.text_:
            self.backend.cache_prefix(self._prompt())
        children = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.defaults, self.stream)
            child.text_, child.messages_ = self.text_, list(self.messages_)
            child.cur_role, child.role_begin_pos = self.cur_role, self.role_begin_pos
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            children.append(child)
        return children

    def fail(self, error: BaseException) -> None:
        """Record ``error`` (the program body raised) and end the state."""
        with self.changed:
            self.error_ = self.error_ or error
        self._release_waiters()
        self.end()

    def _raise_error(self) -> None:
        if self.error_ is not None:
            raise self.error_

    def _register_vars(self, expr: Expr) -> None:
        if isinstance(expr, Gen | Select) and expr.name is not None:
            self.var_done[expr.name] = threading.Event()
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._register_vars(item)

    # ------------------------------------------------------------------ worker side
    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is _END:
                self._queue.task_done()
                break
            try:
                self._execute(expr)
            except BaseException as exc:  # stored and re-raised to the reader
                self.fail(exc)
                with self._lock:  # nothing queued after the failure will run
                    self._drain()
                self._queue.task_done()
                break
            self._queue.task_done()
        with self.changed:
            self.finished = True
            self.changed.notify_all()
        self._release_waiters()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._queue.task_done()

    def _release_waiters(self) -> None:
        for event in list(self.var_done.values()):
            event.set()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.value)
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        else:
            raise TypeError(f"cannot execute {expr!r}")

    def _append(self, text: str) -> None:
        with self.changed:
            self.text_ += text
            self.changed.notify_all()

    def _prompt(self) -> Prompt:
        role_text = self.text_[self.role_begin_pos:] if self.cur_role else ""
        return Prompt(self.text_, tuple(self.messages_), self.cur_role, role_text)

    def _set_var(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        with self.changed:
            self.variables[name] = value
            self.meta_info[name] = meta
            self.var_done[name].set()
            self.changed.notify_all()

    def _gen(self, expr: Gen) -> None:
        params = self.defaults.merge(expr.overrides)
        prompt = self._prompt()
        if not self.stream:
            text, meta = self.backend.generate(prompt, params)
            self._append(text)
            self._set_var(expr.name, _gen_value(text, meta, params), meta)
            return
        out, meta = "", {}
        for delta, chunk_meta in self.backend.generate_stream(prompt, params):
            out, meta = out + delta, chunk_meta
            with self.changed:  # the variable grows with the text, for text_iter(name)
                if expr.name is not None:
                    self.variables[expr.name] = out
                self.text_ += delta
                self.changed.notify_all()
        self._set_var(expr.name, _gen_value(out, meta, params), meta)

    def _select(self, expr: Select) -> None:
        choice, meta = self.backend.select(self._prompt(), expr.choices, expr.method)
        self._append(choice)
        self._set_var(expr.name, choice, meta)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"{role}_begin() inside an open {self.cur_role} message: roles do not nest")
        history = [m["role"] for m in self.messages_]
        self._append(self.backend.chat_template().prefix(history, role))
        self.cur_role, self.role_begin_pos = role, len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role}_end() without {role}_begin() (open role: {self.cur_role})")
        history = [m["role"] for m in self.messages_]
        content = self.text_[self.role_begin_pos:]
        self._append(self.backend.chat_template().suffix(history, role))
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None


def _gen_value(text: str, meta: dict[str, Any], params: SamplingParams) -> Any:
    """A gen's variable: its text, or with ``tools`` the calls the server parsed out of it
    (``[{"id", "name", "arguments": dict}]``)."""
    if params.tools is None:
        return text
    return [{"id": c["id"], "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
            for c in meta.get("tool_calls") or []]


class ProgramState:
    """What a program function gets as ``s``: ``s += expr``, ``s["name"]``, ``s.text()``,
    ``s.messages()``, ``s.fork(n)``, ``s.get_meta_info(name)``, ``s.text_iter(name)``."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    def __iadd__(self, expr: Any) -> ProgramState:
        self.stream_executor.submit(expr)
        return self

    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.sync()
        self.stream_executor.variables[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables or name in self.stream_executor.var_done

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def get_meta_info(self, name: str) -> Any:
        """The meta info of variable ``name`` (the server's ``meta_info`` for a gen; the
        per-option scores for a select), waiting until it is set."""
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        """The finished chat messages, OpenAI style ``{"role", "content"}``."""
        self.sync()
        return list(self.stream_executor.messages_)

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        """The error that stopped this state, if any (does not raise it)."""
        self.stream_executor._queue.join()
        return self.stream_executor.error_

    def fork(self, size: int = 1) -> ProgramStateGroup:
        return ProgramStateGroup([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    def _role(self, role: str, expr: Any) -> Any:
        if expr is not None:
            self += ExprList((RoleBegin(role), as_expr(expr), RoleEnd(role)))
            return None

        @contextmanager
        def scope() -> Iterator[None]:
            self.stream_executor.submit(RoleBegin(role))
            yield
            self.stream_executor.submit(RoleEnd(role))

        return scope()

    def system(self, expr: Any = None) -> Any:
        """``s.system("text")`` appends a system message; ``with s.system():`` opens one."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or variable ``var_name``) as it grows, in pieces, until the program
        (or that variable) is done. Without ``stream=True`` one piece: the final value.
        Raises the state's error after the last piece."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self[var_name]
            return

        def current() -> str:
            return ex.text_ if var_name is None else ex.variables.get(var_name, "")

        def done() -> bool:
            event = ex.var_done.get(var_name) if var_name is not None else None
            return ex.finished or (event is not None and event.is_set())

        sent = 0
        while True:
            with ex.changed:
                ex.changed.wait_for(lambda seen=sent: len(current()) > seen or done())
                piece, over = current()[sent:], done()
            sent += len(piece)
            if piece:
                yield piece
            if over and len(current()) == sent:
                break
        ex._raise_error()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of ``s.fork(n)``: index them, ``forks += expr`` appends to every
    branch (a callable ``i -> expr`` or a list gives each its own), ``join()`` waits for
    all and gives the parent each new variable as a list over the branches."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        for i, state in enumerate(self.states):
            if callable(other) and not isinstance(other, Expr):
                state += other(i)
            elif isinstance(other, list | tuple):
                state += other[i]
            else:
                state += other
        return self

    def join(self) -> None:
        """Wait for every branch; raise the first branch error; the parent's variables
        gain each branch-only variable as a list (branch order)."""
        parent = self.parent.stream_executor
        before = set(parent.variables)
        for state in self.states:
            state.sync()
        for state in self.states:
            for name, value in state.stream_executor.variables.items():
                if name not in before:
                    parent.variables.setdefault(name, []).append(value)
            state.stream_executor.end()


def run_program(func: Callable[..., Any], backend: Backend, args: tuple, kwargs: dict[str, Any],
                defaults: SamplingParams, stream: bool) -> ProgramState:
    """Run ``func(state, *args, **kwargs)``. Without ``stream`` wait for the whole program
    and raise its error; with ``stream`` return at once (the body runs on a thread)."""
    executor = StreamExecutor(backend, defaults, stream)
    state = ProgramState(executor)

    def body() -> None:
        try:
            state.ret_value = func(state, *args, **kwargs)
        except BaseException as exc:
            executor.fail(exc)
            if not stream:
                raise
        finally:
            executor.end()

    if stream:
        threading.Thread(target=body, daemon=True).start()
        return state
    body()
    state.sync()
    return state


def run_program_batch(func: Callable[..., Any], backend: Backend, batch: list[dict[str, Any]],
                      defaults: SamplingParams, num_threads: int) -> list[ProgramState]:
    """``run_program`` for each kwargs dict of ``batch`` on ``num_threads`` threads; the
    states in ``batch`` order. Raises the first program error (in batch order)."""
    with ThreadPoolExecutor(max(1, min(num_threads, len(batch)))) as pool:
        futures = [pool.submit(run_program, func, backend, (), kw, defaults, False) for kw in batch]
        return [f.result() for f in futures]
