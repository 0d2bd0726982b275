"""Structured generation: regex / JSON-schema / EBNF grammars with xgrammar.

A request carries at most one grammar (``SamplingParams.regex``, ``json_schema``, ``ebnf``
or ``structural_tag``; OpenAI ``response_format`` is translated into ``json_schema``, chat
``tools`` into a ``structural_tag``, see runtime/text/tool_parsers.py). The pieces:

* ``check_grammar`` (tokenizer process, before the request is queued): parses the grammar
  with xgrammar (no tokenizer needed, milliseconds) so a bad one is an HTTP 400 carrying
  the parser's message, and refuses JSON-schema keywords that xgrammar would silently
  drop (regression case C18: ``pattern``/``format`` together with ``minLength``/
  ``maxLength``; ``uniqueItems``, ``not``, ``if``/``then``/``else``, ``allOf``,
  ``dependentRequired``, ``dependentSchemas``) -- never an unconstrained output.
* ``GrammarCache`` (scheduler process): compiles grammars against the model's vocabulary
  on a worker thread, off the scheduling loop, cached by (kind, text); the scheduler
  keeps a request aside until its grammar is ready.
* ``GrammarMatcher`` per request (xgrammar's pushdown automaton): each step it fills its
  row of a token bitmask (``[B, ceil(V / 32)]`` int32) that masks the logits of the rows
  that carry a grammar, the rest of the batch untouched; the sampled token is then
  accepted. When the grammar's root is complete only the stop tokens stay allowed;
  accepting one terminates the matcher and the request finishes with "stop".

JSON schemas compile with ``any_whitespace=False`` (one space after ':' and ',', no
newlines): whitespace is not free to run away (case C19), and strings allow only JSON's
legal escapes (case C20). xgrammar: Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models".
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pydantic
import torch
import xgrammar as xgr

__all__ = [
    "GRAMMAR_KINDS",
    "GrammarCache",
    "GrammarMasker",
    "check_grammar",
    "grammar_of",
]

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")

# JSON-schema keywords xgrammar 0.2 accepts but does not enforce (checked by hand on
# violating inputs; see tests/runtime/text/test_grammar.py).
_UNENFORCED = ("uniqueItems", "not", "if", "then", "else", "allOf", "dependentRequired",
               "dependentSchemas")
_LENGTH = ("minLength", "maxLength")
_STRING_SHAPE = ("pattern", "format")


def grammar_of(sampling: Any) -> tuple[str, str] | None:
    """(kind, text) of the grammar a SamplingParams carries, or None. At most one is set:
    the request models (runtime/server/protocol.py) refuse more than one."""
    return next(((kind, getattr(sampling, kind)) for kind in GRAMMAR_KINDS if getattr(sampling, kind) is not None),
                None)


MAX_SCHEMA_DEPTH = 256  # nesting levels (objects and arrays) of a JSON schema


def check_json_depth(value: Any, what: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """Raises ValueError if ``value`` (decoded JSON) nests objects / arrays deeper than
    ``limit`` levels: near Python's recursion limit, ``json.dumps`` and the keyword check
    raised RecursionError (an HTTP 500). Iterative, so any depth is checked."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            raise ValueError(f"{what} is nested deeper than {limit} levels")
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _unenforced_keywords(node: Any, path: str = "#") -> Iterable[str]:
    """Descriptions of the schema's keywords that xgrammar would drop, with JSON pointers."""
    if isinstance(node, dict):
        for key in _UNENFORCED:
            if key in node and not (key == "uniqueItems" and node[key] is False):
                yield f"'{key}' at {path}"
        shape = [k for k in _STRING_SHAPE if k in node]
        length = [k for k in _LENGTH if k in node]
        if shape and length:
            yield f"'{shape[0]}' together with '{length[0]}' at {path}"
        for key, value in node.items():
            if key in ("enum", "const", "default", "examples"):
                continue
            yield from _unenforced_keywords(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _unenforced_keywords(value, f"{path}/{i}")


def check_grammar(kind: str, text: str, refuse_unenforced: bool = True) -> None:
    """Parse a grammar without a tokenizer. Raises ValueError with xgrammar's message if
    it does not parse, or (``refuse_unenforced``) naming the keyword if a JSON schema uses
    one xgrammar would silently drop."""
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError(f"json_schema is nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("json_schema must be a JSON object (a JSON Schema)")
        check_json_depth(schema, "json_schema")
        dropped = list(_unenforced_keywords(schema)) if refuse_unenforced else []
        if dropped:
            raise ValueError(
                "json_schema uses keywords the grammar backend cannot enforce: "
                + "; ".join(dropped[:5]) + " (refused rather than ignored)")
    try:
        if kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "json_schema":
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(text)
        else:
            raise ValueError(f"unknown grammar kind {kind!r}")
    except (RuntimeError, pydantic.ValidationError) as exc:  # xgrammar's parser errors
        message = str(exc).strip().splitlines()[0]
        message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message)  # "[time] file.cc:94: " noise
        raise ValueError(f"{kind} does not compile: {message}") from None


class GrammarCache:
    """Compiled grammars for one tokenizer, built on a worker thread and cached by key.

    ``vocab_size`` is the model's (logits width, may exceed the tokenizer's: the extra
    ids are never allowed); ``stop_token_ids`` end a completed grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], threads: int = 1) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._futures: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def _compile(self, kind: str, text: str) -> Any:
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if kind == "json_schema":
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "structural_tag":
            return self._compiler.compile_structural_tag(text)
        return self._compiler.compile_grammar(text)

    def get(self, key: tuple[str, str]) -> Future:
        """A future of the compiled grammar for ``(kind, text)`` (started on first use)."""
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._futures[key] = self._pool.submit(self._compile, *key)
            return future

    def matcher(self, compiled: Any) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def allows_a_token(matcher: xgr.GrammarMatcher, vocab_size: int) -> bool:
    """Whether the grammar in ``matcher``'s current state allows any of the ``vocab_size``
    token ids next. False: a dead end no token sequence can get past (e.g. a regex that
    needs a character no token's bytes spell); the mask then leaves every logit at -inf."""
    bits = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bits, 0)
    flags = (bits[0].to(torch.int64)[:, None] >> torch.arange(32)) & 1  # [W, 32], token 32 w + b
    return bool(flags.flatten()[:vocab_size].any())


class GrammarMasker:
    """Applies the grammars' next-token masks to a step's logits, with bitmask buffers
    reused from step to step: [rows, ceil(V / 32)] int32, one bit per token (xgrammar's
    layout), on the host (pinned on CUDA; two, used in turn) and on the device.

    Measured on the H200 host (SmolLM2 shape, V = 49152, batch 32, an integer-array JSON
    schema, served): allocating the bitmask each step (``xgr.allocate_token_bitmask``:
    ``torch.full`` on 1.5M bits, run by torch's CPU thread pool) and pinning it took half
    of the scheduler's busy time, ~1 ms a step; the fills themselves take ~2 us per row.
    Before that, xgrammar was given the row indices as a list, which it copied to the
    device from pageable memory: that made the host wait for the queued forward pass and
    undid overlap scheduling (in-process: 1.85 vs 1.32 ms a step; 1.48 after).
    xgrammar's multithreaded BatchGrammarMatcher was slower (its 16 worker threads cost
    ~4 ms a step in all)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.width = xgr.get_bitmask_shape(1, vocab_size)[1]
        self._host: list[torch.Tensor] = []  # two [R, W] buffers, used in turn
        self._rows_in_use: list[list[bool]] = []  # per buffer: row i holds a grammar's bits
        self._copied: list[Any] = []  # per buffer: CUDA event after its copy to the device
        self._device_buf: torch.Tensor | None = None
        self._turn = 0

    def _ensure_rows(self, rows: int) -> None:
        if self._host and self._host[0].shape[0] >= rows:
            return
        n = max(rows, 64, 2 * (self._host[0].shape[0] if self._host else 0))
        cuda = self.device.type == "cuda"
        self._host = [torch.full((n, self.width), -1, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._rows_in_use = [[False] * n for _ in range(2)]
        self._copied = [None, None]
        if cuda:
            self._device_buf = torch.empty((n, self.width), dtype=torch.int32, device=self.device)

    def apply(self, logits: torch.Tensor, matchers: list[Any | None]) -> None:
        """Mask in place the logits ``[B, V]`` (on ``device``) of the rows whose matcher is
        not None to the tokens their grammar allows next (others get -inf); rows without a
        matcher get all-ones bits and are left as they are. ``matchers``: B xgrammar
        GrammarMatcher or None."""
        if all(m is None for m in matchers):
            return
        rows = len(matchers)
        self._ensure_rows(rows)
        turn = self._turn
        if self._copied[turn] is not None:  # its previous copy to the device has been read
            self._copied[turn].synchronize()
        host, in_use = self._host[turn], self._rows_in_use[turn]
        bits = host[:rows]
        codes = None
        for i, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.fill_next_token_bitmask(bits, i)
                in_use[i] = True
            elif in_use[i]:  # stale bits of an earlier step's grammar: allow everything
                codes = host.numpy() if codes is None else codes
                codes[i] = -1
                in_use[i] = False
        if self._device_buf is not None:
            device_bits = self._device_buf[:rows]
            device_bits.copy_(bits, non_blocking=True)
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
            self._turn = 1 - turn
        else:
            device_bits = bits.to(logits.device)
        xgr.apply_token_bitmask_inplace(logits, device_bits)
