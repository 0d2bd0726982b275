"""How ``select`` scores its options, and where the scored tokens start (case C21).

Every option is tokenised *jointly* with the prompt, never on its own, and scored from
the first token position where any option's tokens leave the prompt's tokens::

    prompt            [ t0 ... t30 | "\n " ]                (ends in "\n ": one token)
    prompt + "Hello"  [ t0 ... t30 | "\n" " Hello" ]         (the space merged into "Hello")
    prompt + "^*B^&A" [ t0 ... t30 | "\n" " ^*" "B" "^&" "A" ]
                                   ^ start = 31: common to the prompt and every option

A boundary token that merges prompt text with option text (``" Hello"``) is scored as a
whole. The traps avoided: dropping it (``logprob_start_len = len(prompt tokens)`` on the
joint tokens would score "Hello" with no token at all, and "^*B^&A" by its easy tail
"B^&A"), or scoring the option's own tokens after the prompt's last token (``"\n "``
then ``"Hello"``, a pair the model has hardly seen).

The score of option ``o`` is ``log P(prompt + o) - log P(prompt)`` from ``start`` on,
each under its own (canonical) tokenisation: the joint tokens' logprob sum minus that
of the prompt's tokens after ``start`` (``"\n "`` above; nothing when the prompt's
tokens are a prefix of every joint tokenisation). That is ``log P(o | prompt)``, the
prompt's tail text included, however the boundary merged; the tail's cost is the same
for every option, so the sum ranks as the joint likelihood would. It can exceed 0
where the canonical tokenisation of the prompt's tail is an unlikely one.

Methods (``select(..., choices_method=...)``), higher is better:
- ``token_length_normalized`` (default, as in SGLang): that logprob divided by the
  option's token count (scored tokens holding option text; ``"\n"`` above does not);
- ``sum_logprob``: the logprob itself (the likelihood; favours short options).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ChoicesMethod", "token_length_normalized", "sum_logprob", "ScoringPlan", "plan_scoring",
           "plan_from_tokens", "decide"]


@dataclass(frozen=True)
class ChoicesMethod:
    """A named rule ``score(logprob per option, token count per option) -> score per
    option`` (higher is better)."""

    name: str
    score: Callable[[list[float], list[int]], list[float]]

    def __repr__(self) -> str:
        return f"<choices method {self.name}>"


token_length_normalized = ChoicesMethod(
    "token_length_normalized", lambda lps, counts: [lp / n for lp, n in zip(lps, counts, strict=True)])
sum_logprob = ChoicesMethod("sum_logprob", lambda lps, counts: list(lps))


@dataclass(frozen=True)
class ScoringPlan:
    """Token rows to score from ``start``: ``joint[i]`` (prompt + option i) and, when the
    prompt has tokens after ``start``, the prompt's own tokens ``prompt_ids``;
    ``option_tokens[i]`` = scored tokens of row i that hold option text."""

    start: int
    joint: list[list[int]]
    prompt_ids: list[int]
    option_tokens: list[int]

    @property
    def scores_prompt_tail(self) -> bool:
        """Whether the prompt's own tokens after ``start`` are scored (a row of their own)."""
        return len(self.prompt_ids) > self.start

    @property
    def rows(self) -> list[list[int]]:
        """Every row to send: the joint rows, then the prompt if its tail is scored."""
        return self.joint + ([self.prompt_ids] if self.scores_prompt_tail else [])


def _common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def plan_scoring(prompt: str, choices: Sequence[str], encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str]) -> ScoringPlan:
    """Tokenise ``prompt`` and each ``prompt + choice`` and find ``start`` (module doc).
    Raises ValueError if ``start`` is 0 (the first token has no logprob: the prompt
    needs text) or an option adds no token."""
    return plan_from_tokens(prompt, encode(prompt), [encode(prompt + c) for c in choices], decode)


def plan_from_tokens(prompt: str, prompt_ids: list, joint: list[list], decode: Callable[[Sequence], str]) -> ScoringPlan:
    """``plan_scoring`` from tokenisations made elsewhere: ``prompt_ids`` of ``prompt``,
    ``joint[i]`` of ``prompt + choice i``. Tokens may be ids or token strings (any
    comparable values ``decode`` turns into text, e.g. ``"".join`` of an OpenAI
    ``logprobs.tokens`` list). Raises ValueError like plan_scoring."""
    start = min(_common_prefix(prompt_ids, j) for j in joint)
    if start == 0:
        raise ValueError("select needs a prompt whose first token does not change with the option")
    if any(len(j) <= start for j in joint):
        raise ValueError("every select option must add at least one token to the prompt")
    return ScoringPlan(start, joint, prompt_ids, [_option_tokens(prompt, j, start, decode) for j in joint])


def _option_tokens(prompt: str, ids: list, start: int, decode: Callable[[Sequence], str]) -> int:
    """Tokens of ``ids[start:]`` after the leading ones that decode to prompt text only."""
    first = start
    while first < len(ids) - 1 and prompt.startswith(decode(ids[:first + 1])):
        first += 1
    return len(ids) - first


def decide(choices: Sequence[str], plan: ScoringPlan, row_logprobs: list[list[float]],
           method: ChoicesMethod, extra: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The winning choice (ties: the earliest) from the per-token logprobs of
    ``plan.rows`` from ``plan.start``, and the select variable's meta info: ``scores`` (by
    ``method``), ``logprobs`` (``log P(option | prompt)``), ``num_tokens``,
    ``normalized_prompt_logprobs`` (SGLang's name: logprob per token),
    ``prompt_tail_logprob``, ``input_token_logprobs`` (per option, the joint tokens from
    ``start``), ``scoring_start``, ``method``."""
    n = len(choices)
    tail = sum(row_logprobs[n]) if len(row_logprobs) > n else 0.0
    lps = [sum(row) - tail for row in row_logprobs[:n]]
    scores = method.score(lps, plan.option_tokens)
    best = max(range(n), key=lambda i: (scores[i], -i))
    meta = {"method": method.name, "scores": scores, "logprobs": lps, "num_tokens": plan.option_tokens,
            "normalized_prompt_logprobs": token_length_normalized.score(lps, plan.option_tokens),
            "prompt_tail_logprob": tail, "input_token_logprobs": row_logprobs[:n],
            "scoring_start": plan.start, **(extra or {})}
    return choices[best], meta
