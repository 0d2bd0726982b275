"""Incremental, UTF-8-safe detokenization with stop strings (one object per sample).

Lives in the tokenizer (HTTP) process: the scheduler streams output token ids, this
turns them into text deltas that are safe to send to a client.

Algorithm: the offset-based incremental decode of vLLM
(``vllm/transformers_utils/detokenizer_utils.py: detokenize_incrementally``) and HF TGI
(``Seq2SeqLM``/``CausalLM`` ``decode_token``), with two changes noted below::

    ids:   [ .. last CONTEXT prompt ids .. | out0 out1 out2 .. ]
             ^prefix_offset   ^read_offset                     ^len(ids)
             |<-- prefix_text -->|
             |<--------------- full_text --------------------->|
    new text = full_text[len(prefix_text):]

``decode(ids[prefix_offset:])`` is decoded with a few ids of left context so a token's
leading space (SentencePiece) comes out right; only the part past ``prefix_text`` is new.
If ``full_text`` ends with U+FFFD the last ids end inside a multi-byte UTF-8 character
(byte-level BPE splits CJK/emoji across tokens): nothing is emitted and the ids wait for
the next push. Otherwise both offsets move forward (``prefix_offset = read_offset``,
``read_offset = len(ids)``), so every emission ends on a character boundary. (A genuine
trailing U+FFFD, e.g. invalid bytes, is held the same way until the next id or finish().)

Change 1, prompt cut mid-character (C12c): when the prompt ends with 2 of 3 bytes of a
character, ``prefix_text`` ends with U+FFFD that the first output bytes turn into a real
character. We cut at the longest common prefix of ``prefix_text`` and ``full_text``
instead of at ``len(prefix_text)``: the *completed character* is emitted (once all its
bytes arrived), never any prompt text before it. (vLLM silently drops that character.)

Change 2, stop strings (C11): decoded text goes to ``pending``; the stop string whose
occurrence *ends first* wins (ties: the earliest start), i.e. what a character-by-character
stream would hit first, so the result is independent of chunking. Without a match, the
longest suffix of ``pending`` that is a prefix of some stop string is held back, so no
delta ever carries a fragment of a stop string that later matches; ``finish()`` flushes.
Stop regexes (runtime/text/stop_regex.py) take part the same way: they are searched over the
whole output text (emitted + pending), the match that ends first among strings and
regexes wins, and the text from the leftmost partial match on is held back.

Contract: for any chunking of the ids, the concatenated deltas equal
``final_text(...)``, which runs this same machine in one push (agreement by
construction). For byte-level BPE tokenizers (GPT-2, Llama-3, Qwen, SmolLM2) that is
exactly ``tokenizer.decode(output_ids)`` cut at the stop string, except when the prompt
ends mid-character (then the completed character replaces the decoder's U+FFFD).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from radixlm.runtime.text.stop_regex import first_match, partial_start

__all__ = ["IncrementalDetokenizer", "final_text", "PROMPT_CONTEXT_IDS"]

PROMPT_CONTEXT_IDS = 5  # prompt ids decoded as left context (leading-space handling)
_REPLACEMENT = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a stream of output ids into text deltas for one sample.

    ``push(ids)`` returns the newly emittable text; ``finish()`` flushes what is held
    back (an incomplete UTF-8 tail, a possible stop-string prefix or partial stop-regex
    match) and returns the last delta. After a stop string (or regex) matched, ``stopped``
    is True, ``matched_stop`` names it (the pattern for a regex), and nothing more is ever
    emitted. A stop regex search that times out counts as no match. Not thread-safe; one
    instance per sample.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        stop_regex: Sequence[str] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)  # an empty stop string means nothing
        self._stop_regex = tuple(stop_regex)
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT_IDS) :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pending = ""  # decoded, not yet emitted (a possible stop-string prefix)
        self._deltas: list[str] = []  # everything emitted
        self._finished = False
        self.num_pushed = 0  # output ids pushed so far
        self.stopped = False
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned)."""
        return "".join(self._deltas)

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds output ids; returns the text delta that is now safe to emit."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        self.num_pushed += len(new_ids)
        if self.stopped:
            return ""
        self._ids.extend(new_ids)
        self._pending += self._decode_new(flush=False)
        return self._emit(final=False)

    def finish(self) -> str:
        """Flushes held-back text at the end of the request; returns the last delta."""
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        self._pending += self._decode_new(flush=True)
        return self._emit(final=True)

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, flush: bool) -> str:
        """Text of the ids past read_offset; "" while they end mid-character (unless flush)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if full_text.endswith(_REPLACEMENT) and not flush:
            return ""
        new_text = _text_after(prefix_text, full_text)
        if new_text:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text

    def _emit(self, final: bool) -> str:
        """Moves the emittable part of ``pending`` out, cutting at a stop string or regex."""
        match = self._first_match()
        if match is not None:
            start, end, stop = match
            cut = max(0, end if self._include_stop else start)
            delta, self._pending = self._pending[:cut], ""
            self.stopped, self.matched_stop = True, stop
        else:
            hold = 0 if final else self._hold_len()
            cut = len(self._pending) - hold
            delta, self._pending = self._pending[:cut], self._pending[cut:]
        if delta:
            self._deltas.append(delta)
        return delta

    def _first_match(self) -> tuple[int, int, str] | None:
        """(start, end, stop) in ``pending`` of the stop string or regex match that ends
        first (ties: earliest start); a regex match may start before ``pending`` (< 0)."""
        best = _first_stop(self._pending, self._stop)
        if self._stop_regex:
            emitted = self.text
            try:
                m = first_match(self._stop_regex, emitted + self._pending)
            except TimeoutError:  # the scheduler aborts the request
                m = None
            if m is not None:
                base = len(emitted)
                candidate = (m.start - base, m.end - base, m.pattern)
                if best is None or (candidate[1], candidate[0]) < (best[1], best[0]):
                    best = candidate
        return best

    def _hold_len(self) -> int:
        """Length of the tail of ``pending`` that may still become part of a stop."""
        hold = _stop_prefix_len(self._pending, self._stop)
        if self._stop_regex:
            emitted = self.text
            try:
                start = partial_start(self._stop_regex, emitted + self._pending, len(emitted))
            except TimeoutError:
                start = None
            if start is not None:
                hold = max(hold, len(emitted) + len(self._pending) - start)
        return hold


def _text_after(prefix_text: str, full_text: str) -> str:
    """The part of ``full_text`` past ``prefix_text``.

    Normally ``full_text`` starts with ``prefix_text``. When ``prefix_text`` ended in an
    incomplete character (U+FFFD) that the new ids completed, cut at the common prefix,
    so the completed character is emitted and the text before it is not.
    """
    if full_text.startswith(prefix_text):
        return full_text[len(prefix_text) :]
    return full_text[len(os.path.commonprefix([prefix_text, full_text])) :]


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """(start, end, stop) of the stop occurrence that ends first in ``text`` (ties:
    earliest start)."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            candidate = (start + len(stop), start, stop)
            best = candidate if best is None else min(best, candidate)
    return None if best is None else (best[1], best[0], best[2])


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def final_text(
    tokenizer: Any,
    output_ids: Sequence[int],
    prompt_ids: Sequence[int] = (),
    skip_special_tokens: bool = True,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
    stop_regex: Sequence[str] = (),
) -> str:
    """The non-streaming text of ``output_ids``: the same machine fed in one push.

    Equals the concatenated deltas of any streaming of the same ids by construction; for
    byte-level BPE it is ``tokenizer.decode(output_ids)`` cut at the first stop string
    (see the module docstring for the one prompt-mid-character exception).
    """
    detok = IncrementalDetokenizer(
        tokenizer, prompt_ids, skip_special_tokens, stop, include_stop_str_in_output, stop_regex
    )
    detok.push(output_ids)
    detok.finish()
    return detok.text
