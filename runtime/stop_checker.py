"""Finish conditions checked by the scheduler after every sampled token.

Order: EOS / stop token ids ("stop", matched = the token id), stop strings ("stop",
matched = the string), ``max_new_tokens`` ("length"), context length ("length").
``min_new_tokens`` suppresses EOS and stop conditions until reached. Stop strings are
found by decoding only a tail of the output (enough tokens to cover the longest stop
string); the tokenizer process cuts the text at the same string, so the client never
sees it (unless ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Iterable

from radixlm.runtime.request import Req

__all__ = ["StopChecker"]


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: Iterable[int], context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length

    def check(self, req: Req) -> tuple[str, int | str | None] | None:
        """(finish_reason, matched_stop) if ``req`` must stop after its last token."""
        sp = req.sampling
        n_out = len(req.output_ids)
        if n_out >= sp.min_new_tokens:
            last = req.output_ids[-1]
            if last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_token_ids):
                return "stop", last
            matched = self._stop_string(req)
            if matched is not None:
                return "stop", matched
        if n_out >= sp.max_new_tokens:
            return "length", None
        if req.num_known >= self.context_length:
            return "length", None
        return None

    def _stop_string(self, req: Req) -> str | None:
        stops = req.sampling.stop
        if not stops:
            return None
        # Each token decodes to >= 1 byte; a stop string of c chars needs <= 4c bytes,
        # plus a few tokens of context for byte-pieces that straddle the window start.
        window = 4 * max(len(s) for s in stops) + 4
        tail = self.tokenizer.decode(
            req.output_ids[-window:], skip_special_tokens=req.sampling.skip_special_tokens
        )
        hits = [(tail.find(s), s) for s in stops if s and s in tail]
        return min(hits)[1] if hits else None
