"""Finish conditions checked by the scheduler after every sampled token.

Order: EOS / stop token ids ("stop", matched = the token id), stop strings ("stop",
matched = the string), stop regexes ("stop", matched = the pattern), ``max_new_tokens``
("length"), context length ("length"). ``min_new_tokens`` suppresses EOS and stop
conditions until reached. Stop strings are found by decoding only a tail of the output
(enough tokens to cover the longest stop string). A stop regex can match text of any
length, so the whole output text is searched: it is kept per request by an
``IncrementalDetokenizer`` (the same text the tokenizer process builds, decoded a few
tokens per step) in ``req.stop_text``; see runtime/text/stop_regex.py. The tokenizer process
cuts the text at the same string or match, so the client never sees it (unless
``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Iterable

from radixlm.runtime.scheduler.request import Req
from radixlm.runtime.text.detokenizer import IncrementalDetokenizer
from radixlm.runtime.text.stop_regex import SEARCH_TIMEOUT_S, first_match

__all__ = ["StopChecker"]


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: Iterable[int], context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length

    def check(self, req: Req) -> tuple[str, int | str | None] | tuple[str, None, str] | None:
        """(finish_reason, matched_stop) if ``req`` must stop after its last token;
        ("abort", None, message) if its stop regex search timed out."""
        sp = req.sampling
        n_out = len(req.output_ids)
        if sp.stop_regex:
            self._update_text(req)
        if n_out >= sp.min_new_tokens:
            last = req.output_ids[-1]
            if last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_token_ids):
                return "stop", last
            matched = self._stop_string(req) if sp.stop else None
            if matched is not None:
                return "stop", matched
            if sp.stop_regex:
                try:
                    match = first_match(sp.stop_regex, req.stop_text.text)
                except TimeoutError:
                    return "abort", None, (f"a stop_regex search took over {SEARCH_TIMEOUT_S * 1000:.0f} ms "
                                           "(catastrophic backtracking?); simplify the pattern")
                if match is not None:
                    return "stop", match.pattern
        if n_out >= sp.max_new_tokens:
            return "length", None
        if len(req.prompt_ids) + n_out >= self.context_length:  # req.num_known
            return "length", None
        return None

    def set_fast_path(self, req: Req) -> None:
        """Give ``req`` the scheduler's per-token fast path if stop token ids and lengths are
        all of its finish conditions (no stop string, stop regex or ``min_new_tokens``, and
        ``max_new_tokens`` > 0): ``req.fast_stop_ids`` = the ids that end it whenever sampled,
        ``req.output_limit`` = the output length that ends it. Verdicts as ``check``'s. The
        caller decides the rest (no grammar, no logprobs to append); else nothing is set."""
        sp = req.sampling
        if sp.stop or sp.stop_regex or sp.min_new_tokens > 0 or sp.max_new_tokens <= 0:
            return
        ids = frozenset(sp.stop_token_ids)
        req.fast_stop_ids = ids if sp.ignore_eos else ids | self.eos_token_ids
        req.output_limit = min(sp.max_new_tokens, self.context_length - len(req.prompt_ids))

    def _update_text(self, req: Req) -> None:
        """Bring ``req.stop_text`` (the output text so far) up to date with output_ids."""
        if req.stop_text is None:
            req.stop_text = IncrementalDetokenizer(self.tokenizer, req.prompt_ids,
                                                   skip_special_tokens=req.sampling.skip_special_tokens)
        req.stop_text.push(req.output_ids[req.stop_text.num_pushed:])

    def _stop_string(self, req: Req) -> str | None:
        stops = req.sampling.stop
        # Each token decodes to >= 1 byte; a stop string of c chars needs <= 4c bytes,
        # plus a few tokens of context for byte-pieces that straddle the window start.
        window = 4 * max(len(s) for s in stops) + 4
        tail = self.tokenizer.decode(
            req.output_ids[-window:], skip_special_tokens=req.sampling.skip_special_tokens
        )
        hits = [(tail.find(s), s) for s in stops if s and s in tail]
        return min(hits)[1] if hits else None
