"""StopChecker (scheduler side) and the stop-regex helpers, on the real SmolLM2 tokenizer.

The reference for stop regexes is Python's ``re`` over ``tokenizer.decode(output_ids)``
after each token (the first token at which some pattern matches), computed independently
of runtime/text/stop_regex.py (which uses the ``regex`` library).
"""

from __future__ import annotations

import re

import pytest

from radixlm.runtime.messages import SamplingParams
from radixlm.runtime.scheduler.request import Req
from radixlm.runtime.scheduler.stop_checker import StopChecker
from radixlm.runtime.text.stop_regex import check_stop_regex, first_match, partial_start

EOS = 2
CONTEXT = 8192


def run(tok, text: str, **sampling) -> tuple[Req, int, tuple | None]:
    """Feed ``text``'s tokens one by one as the scheduler does; (req, tokens fed, verdict)."""
    checker = StopChecker(tok, [EOS], CONTEXT)
    req = Req(rid="r", prompt_ids=tok.encode("Answer:"), sampling=SamplingParams(max_new_tokens=10_000, **sampling))
    verdict = None
    for tid in tok.encode(text):
        req.output_ids.append(tid)
        verdict = checker.check(req)
        if verdict is not None:
            break
    return req, len(req.output_ids), verdict


def first_matching_token(tok, text: str, patterns: list[str]) -> int | None:
    ids = tok.encode(text)
    for k in range(1, len(ids) + 1):
        if any(re.search(p, tok.decode(ids[:k])) for p in patterns):
            return k
    return None


@pytest.mark.parametrize(("text", "patterns"), [
    ("The answer is 42 and then 7.", [r"\d+"]),
    ("Call (555) 123-4567 now, or later.", [r"\(\d{3}\) \d{3}-\d{4}"]),
    ("Line one.\nLine two.\n\nEnd here.", [r"\n\n", r"two"]),  # "two" ends first
    ("x = [1, 2, 3]; y = {'a': 1}", [r"\{[^}]*\}", r"never"]),
    ("Prices: 10 USD, 20 EUR", [r"\d+ EUR"]),
    ("你好世界，这是一个测试。", [r"测试"]),  # multi-byte characters split across tokens
])
def test_stop_regex_stops_at_the_first_matching_token(tok, text, patterns):
    want = first_matching_token(tok, text, patterns)
    assert want is not None
    req, fed, verdict = run(tok, text, stop_regex=tuple(patterns))
    assert fed == want
    assert verdict[0] == "stop" and verdict[1] in patterns
    text_so_far = tok.decode(req.output_ids)
    assert re.search(verdict[1], text_so_far)
    assert req.stop_text.text == text_so_far  # the incrementally kept text is the decode


def test_stop_regex_without_a_match_runs_on(tok):
    req, fed, verdict = run(tok, "no digits in here at all", stop_regex=(r"\d",))
    assert verdict is None and fed == len(tok.encode("no digits in here at all"))


def test_stop_regex_waits_for_min_new_tokens(tok):
    text = "7 is a number, so is 8."
    _, fed_free, _ = run(tok, text, stop_regex=(r"\d",))
    _, fed_min, verdict = run(tok, text, stop_regex=(r"\d",), min_new_tokens=5)
    assert fed_free == 1 and fed_min == 5 and verdict == ("stop", r"\d")


def test_stop_string_beats_regex_on_the_same_token_and_eos_beats_both(tok):
    _, fed, verdict = run(tok, "Result: 7", stop=("7",), stop_regex=(r"\d",))
    assert verdict == ("stop", "7") and fed == len(tok.encode("Result: 7"))
    checker = StopChecker(tok, [EOS], CONTEXT)
    req = Req(rid="r", prompt_ids=[1], sampling=SamplingParams(stop_regex=(r"\d",)))
    req.output_ids = [*tok.encode("1"), EOS]
    assert checker.check(req) == ("stop", EOS)


def test_stop_regex_text_survives_a_preemption(tok):
    """A recompute keeps output_ids; the kept text just continues."""
    checker = StopChecker(tok, [EOS], CONTEXT)
    req = Req(rid="r", prompt_ids=[1], sampling=SamplingParams(stop_regex=(r"ab+c",)))
    ids = tok.encode("xx abbb")
    for tid in ids:
        req.output_ids.append(tid)
        assert checker.check(req) is None
    req.num_computed = 0  # what a recompute preemption does to the KV, not to output_ids
    req.output_ids += tok.encode("bc")
    assert checker.check(req) == ("stop", r"ab+c")
    assert req.stop_text.num_pushed == len(req.output_ids)


def test_length_and_context_limits(tok):
    checker = StopChecker(tok, [EOS], 6)
    req = Req(rid="r", prompt_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=2))
    req.output_ids = [10]
    assert checker.check(req) is None
    req.output_ids = [10, 11]
    assert checker.check(req) == ("length", None)
    req = Req(rid="r", prompt_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=100))
    req.output_ids = [10, 11, 12]
    assert checker.check(req) == ("length", None)  # 3 + 3 = context length 6


def test_a_search_that_times_out_aborts_the_request(tok, monkeypatch):
    import radixlm.runtime.scheduler.stop_checker as sc

    def slow(*_args):
        raise TimeoutError

    monkeypatch.setattr(sc, "first_match", slow)
    _, fed, verdict = run(tok, "anything", stop_regex=("x",))
    assert fed == 1 and verdict[0] == "abort" and verdict[1] is None and "stop_regex" in verdict[2]


@pytest.mark.parametrize(("pattern", "message"), [
    ("(unclosed", "invalid regular expression"),
    ("[z-a]", "invalid regular expression"),
    ("a*", "matches the empty text"),
    ("", "matches the empty text"),
    ("$", "matches the empty text"),
])
def test_bad_patterns_are_refused(pattern, message):
    with pytest.raises(ValueError, match=message):
        check_stop_regex(["ok", pattern])


def test_first_match_prefers_the_match_that_ends_first():
    m = first_match([r"b.*z", r"c"], "abcdz")
    assert (m.start, m.end, m.pattern) == (2, 3, "c")
    m = first_match([r"\d+", r"\d"], "ab 12")
    assert (m.start, m.end, m.pattern) == (3, 4, r"\d")
    assert first_match([r"q"], "abc") is None


def test_partial_start_finds_where_a_match_may_still_begin():
    assert partial_start([r"\(\d{3}\)"], "call (55", 0) == 5
    assert partial_start([r"\(\d{3}\)"], "call (5x", 0) is None
    assert partial_start([r"END"], "the E", 0) == 4
    assert partial_start([r"END"], "the E", 5) is None  # not before pos
