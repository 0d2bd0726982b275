"""Stop regexes (``sampling_params.stop_regex``, SGLang's name): generation stops once the
output text contains a match of any of the patterns.

One definition, used by both processes so they agree: the output text (as the
incremental detokenizer produces it) is searched from its start with the ``regex``
library (mrab-regex, Python ``re`` syntax); the leftmost match of each pattern counts, and
across patterns the match that *ends* first wins (ties: the earlier start), as for stop
strings. The scheduler (``StopChecker``) finishes the request at the token where a match
first exists; the tokenizer process (``IncrementalDetokenizer``) cuts the text at the
match's start (its end with ``include_stop_str_in_output``) and, while streaming, holds
back the text from the leftmost *partial* match on (text that may still become the
start of a match: ``regex``'s ``partial=True``), so no streamed delta is ever taken back.

Limits: a pattern that matches the empty text (``a*``, ``$``) would stop at once and is
refused (HTTP 400 at the tokenizer process, like one that does not compile); a search
that runs longer than ``SEARCH_TIMEOUT_S`` (catastrophic backtracking) raises
``TimeoutError`` (the scheduler then aborts the request, so one pattern cannot stall
every other request). Text held back for a partial match can be long for patterns like
``a.*b`` (everything after an ``a`` until a ``b`` shows up or the request ends). Cost: a
request with stop regexes searches its whole output text once per step in each process
(O(output length) per step); requests without them pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import regex

__all__ = ["StopMatch", "check_stop_regex", "compile_stop_regex", "first_match", "partial_start",
           "SEARCH_TIMEOUT_S"]

SEARCH_TIMEOUT_S = 0.05  # one search of one pattern over one request's output text


@dataclass(frozen=True)
class StopMatch:
    """A match of ``pattern`` at ``text[start:end]``."""

    start: int
    end: int
    pattern: str


@lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> regex.Pattern:
    """The compiled pattern. Raises ValueError if it does not compile or matches the
    empty text."""
    try:
        compiled = regex.compile(pattern)
    except (regex.error, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None
    except RecursionError:  # thousands of nested groups
        raise ValueError(f"invalid regular expression {pattern[:40]!r}...: nested too deeply") from None
    if compiled.search("") is not None:
        raise ValueError(f"regular expression {pattern!r} matches the empty text, so it would stop "
                         "generation at once")
    return compiled


def check_stop_regex(patterns: Sequence[str]) -> None:
    """Raises ValueError naming the first bad pattern (see ``compile_stop_regex``)."""
    for pattern in patterns:
        compile_stop_regex(pattern)


def first_match(patterns: Sequence[str], text: str) -> StopMatch | None:
    """The match that ends first in ``text`` (ties: earliest start), or None. Raises
    TimeoutError if one search takes longer than SEARCH_TIMEOUT_S."""
    best: StopMatch | None = None
    for pattern in patterns:
        m = compile_stop_regex(pattern).search(text, timeout=SEARCH_TIMEOUT_S)
        if m is not None and (best is None or (m.end(), m.start()) < (best.end, best.start)):
            best = StopMatch(m.start(), m.end(), pattern)
    return best


def partial_start(patterns: Sequence[str], text: str, pos: int) -> int | None:
    """Leftmost position >= ``pos`` where a match of some pattern may start but has not
    completed by the end of ``text`` (None: none). Raises TimeoutError like first_match."""
    starts = []
    for pattern in patterns:
        m = compile_stop_regex(pattern).search(text, pos, partial=True, timeout=SEARCH_TIMEOUT_S)
        if m is not None and m.partial and m.start() < len(text):  # (a match may begin at the end: nothing to hold)
            starts.append(m.start())
    return min(starts, default=None)
