"""IncrementalDetokenizer against the real SmolLM2 byte-level BPE tokenizer.

Reference for every streaming check: ``tokenizer.decode(output_ids)`` cut at the stop
string that a character-by-character scan hits first (``reference_cut``), computed
independently of runtime/text/detokenizer.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.runtime.text.detokenizer import IncrementalDetokenizer, final_text

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it?",
    "你好世界，这是一个测试。日本語のテキストも。",
    "🌶️👍🏽👨‍👩‍👧 你好世界 ďábelské",
    "Příliš žluťoučký kůň úpěl ďábelské ódy; naïve café, Ærøskøbing.",
    "def f(x):\n\tif x:\n\t\treturn {'a': [1, 2]}\n\n    # done\r\n",
    "  leading spaces, trailing spaces   \n\n",
]
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def prompt_ids(tok) -> list[int]:
    return tok.encode(PROMPT)


@pytest.fixture(scope="session")
def normal_ids(tok) -> list[int]:
    """Every id that is not an added/special token."""
    added = set(tok.added_tokens_decoder)
    return [i for i in range(len(tok)) if i not in added]


def reference_cut(text: str, stops: Sequence[str], include: bool = False) -> str:
    """Cut at the first point where a stop string completes (longest one on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            return text[:end] if include else text[: end - len(max(hits, key=len))]
    return text


def chunk(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Splits ids into chunks of the given sizes (cycled); empty chunks included."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        out.append(list(ids[i : i + n]))
        i, k = i + n, k + 1
    return out


def stream(tok, prompt, chunks, **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas = [detok.push(c) for c in chunks]
    deltas.append(detok.finish())
    return detok, deltas


chunk_sizes = st.lists(st.integers(0, 6), min_size=1, max_size=8).filter(any)
fast = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_tokenizer_splits_multibyte_chars_across_tokens(tok):
    ids = tok.encode(TEXTS[2])
    pieces = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in p for p in pieces) > 10  # the property the tests rely on
    assert tok.decode(ids) == TEXTS[2]


@pytest.mark.parametrize("sizes", [[1], [4], [3, 1, 2, 5], [1000]])
@pytest.mark.parametrize("text", TEXTS)
def test_fixed_chunkings_equal_plain_decode(tok, prompt_ids, text, sizes):
    ids = tok.encode(text)
    detok, deltas = stream(tok, prompt_ids, chunk(ids, sizes))
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert final_text(tok, ids, prompt_ids) == text
    assert not any("\ufffd" in d for d in deltas)


@fast
@given(text=st.sampled_from(TEXTS), sizes=chunk_sizes, with_prompt=st.booleans())
def test_random_chunkings_of_texts(tok, prompt_ids, text, sizes, with_prompt):
    ids, prompt = tok.encode(text), prompt_ids if with_prompt else []
    _, deltas = stream(tok, prompt, chunk(ids, sizes))
    assert "".join(deltas) == final_text(tok, ids, prompt) == text
    assert not any("\ufffd" in d for d in deltas)


@fast
@given(data=st.data(), sizes=chunk_sizes)
def test_random_vocab_ids(tok, prompt_ids, normal_ids, data, sizes):
    ids = data.draw(st.lists(st.sampled_from(normal_ids), max_size=40))
    _, deltas = stream(tok, prompt_ids, chunk(ids, sizes))
    assert "".join(deltas) == final_text(tok, ids, prompt_ids) == tok.decode(ids)


@fast
@given(data=st.data(), sizes=chunk_sizes, include=st.booleans())
def test_random_stop_strings(tok, prompt_ids, data, sizes, include):
    text = data.draw(st.sampled_from(TEXTS))
    i = data.draw(st.integers(0, len(text) - 1))
    j = data.draw(st.integers(i + 1, min(len(text), i + 8)))
    stops = [text[i:j], "never-appears", data.draw(st.text(min_size=1, max_size=3))]
    ids = tok.encode(text)
    opts = dict(stop=stops, include_stop_str_in_output=include)
    detok, deltas = stream(tok, prompt_ids, chunk(ids, sizes), **opts)
    expected = reference_cut(text, stops, include)
    assert "".join(deltas) == final_text(tok, ids, prompt_ids, **opts) == expected
    assert detok.stopped and detok.matched_stop in stops


def test_stop_string_is_never_partially_emitted(tok, prompt_ids):
    ids = tok.encode("ABC DEFGHIJ KLM")
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["DEFGHIJ"])
    deltas = [detok.push([i]) for i in ids] + [detok.push(tok.encode(" DEFGHIJ more"))]
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas) == "ABC "
    assert detok.stopped and detok.matched_stop == "DEFGHIJ"
    assert not any("D" in d for d in deltas)  # no prefix of the matched stop string
    assert detok.finish() == ""


def test_stop_string_included_once(tok, prompt_ids):
    ids = tok.encode("ABC DEFGHIJ KLM DEFGHIJ")
    for sizes in ([1], [2], [100]):
        opts = dict(stop=["DEFGHIJ"], include_stop_str_in_output=True)
        detok, deltas = stream(tok, prompt_ids, chunk(ids, sizes), **opts)
        assert "".join(deltas) == detok.text == "ABC DEFGHIJ"
        assert final_text(tok, ids, prompt_ids, **opts) == "ABC DEFGHIJ"


def test_held_prefix_that_does_not_match_is_emitted_later(tok, prompt_ids):
    text = "ABC DEFG and DEFX after"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["DEFX", "DEFGHIJ"])
    seen = []  # (decoded so far, emitted so far) after each push
    for n, i in enumerate(ids, 1):
        detok.push([i])
        seen.append((tok.decode(ids[:n]), detok.text))
    assert detok.finish() == "" and detok.text == "ABC DEFG and "
    assert detok.matched_stop == "DEFX"
    held = [emitted for decoded, emitted in seen if decoded.endswith("DEFG")]
    assert held == ["ABC "]  # "DEFG" could still become "DEFGHIJ": held back
    later = [emitted for decoded, emitted in seen if decoded.endswith(" and")]
    assert later and later[0].startswith("ABC DEFG")  # ...and emitted once disproved


def test_unfinished_stop_prefix_is_flushed_by_finish(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["DEFGHIJ"])
    assert detok.push(tok.encode("ABC DEFG")) == "ABC "
    assert detok.finish() == "DEFG" and not detok.stopped
    assert detok.text == "ABC DEFG"


def test_stop_string_inside_tokens_across_chunks(tok, prompt_ids):
    ids = tok.encode("ABC DEFGHIJ KLM")
    assert len(tok.encode("DEFGHIJ")) > 1
    for stop in ["FGH", "C DEF", "J K"]:  # starts and ends mid-token
        want = reference_cut("ABC DEFGHIJ KLM", [stop])
        for sizes in ([1], [2, 1], [100]):
            _, deltas = stream(tok, prompt_ids, chunk(ids, sizes), stop=[stop])
            assert "".join(deltas) == want


def test_stop_that_completes_first_wins_regardless_of_chunking(tok, prompt_ids):
    ids = tok.encode("xABCDEy")
    for sizes in ([1], [100]):  # "BC" completes before "ABCDE" does
        detok, _ = stream(tok, prompt_ids, chunk(ids, sizes), stop=["ABCDE", "BC"])
        assert detok.text == "xA" and detok.matched_stop == "BC"


def test_prompt_ending_mid_character_never_leaks_prompt(tok):
    """C12(c): the completed character is emitted; no prompt text before it is."""
    prefix = "Prompt text here: "
    text = prefix + "你好世界 👨‍👩‍👧"
    ids = tok.encode(text)
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert len(cuts) > 5
    for k in cuts:
        clean = tok.decode(ids[:k]).rstrip("\ufffd")
        assert text.startswith(clean)
        for sizes in ([1], [3], [100]):
            _, deltas = stream(tok, ids[:k], chunk(ids[k:], sizes))
            assert "".join(deltas) == final_text(tok, ids[k:], ids[:k]) == text[len(clean) :]
            assert not any(w in d for d in deltas for w in ("Prompt", "text", "here"))
            assert not any("\ufffd" in d for d in deltas)


def test_prompt_ending_mid_character_then_unrelated_output(tok):
    ids = tok.encode("Prompt: 你")
    prompt = ids[:-1]
    assert tok.decode(prompt).endswith("\ufffd")
    detok, _ = stream(tok, prompt, [tok.encode("A b")])
    assert detok.text == "A b"  # the prompt's broken character is not emitted


def test_first_token_keeps_leading_space(tok):
    prompt, out = tok.encode("Hello"), tok.encode(" world, again")
    detok, deltas = stream(tok, prompt, [[i] for i in out])
    assert deltas[0] == " world" and detok.text == " world, again"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, prompt_ids, skip):
    ids = tok.encode("Hi 你好!<|im_end|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    want = "Hi 你好!" if skip else "Hi 你好!<|im_end|>"
    for sizes in ([1], [100]):
        _, deltas = stream(tok, prompt_ids, chunk(ids, sizes), skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == want


def test_lifecycle(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[""])  # empty stop: ignored
    assert detok.push([]) == "" and detok.push(tok.encode("ok")) == "ok"
    assert detok.finish() == "" and detok.finish() == "" and detok.finished
    assert not detok.stopped and detok.matched_stop is None
    with pytest.raises(RuntimeError):
        detok.push([1])
    assert final_text(tok, []) == ""


# ----------------------------------------------------------------------------- stop regexes
REGEX_CASES = [
    ("Call me at (555) 123-4567 tonight.", [r"\(\d{3}\) \d{3}-\d{4}"]),
    ("The answer is 42 and then 7.", [r"\d+"]),
    ("Line one.\nLine two.\n\nEnd here.", [r"\n\n", r"t[wx]o"]),
    ("你好世界，这是一个测试。日本語", [r"测试"]),
    ("a = {'k': [1, 2]} and more", [r"\{[^}]*\}", r"never"]),
]


def regex_reference(tok, ids: list[int], patterns: list[str], include: bool) -> tuple[int, str]:
    """(tokens the scheduler generates, expected text): stop at the first token whose
    decoded output has a match; cut at the match that ends first (``re``, independent)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        found = [(m.end(), m.start()) for p in patterns if (m := re.search(p, text))]
        if found:
            end, start = min(found)
            return k, text[: end if include else start]
    return len(ids), tok.decode(ids)


@fast
@given(case=st.sampled_from(REGEX_CASES), sizes=chunk_sizes, include=st.booleans())
def test_stop_regex_cuts_like_the_reference_for_any_chunking(tok, prompt_ids, case, sizes, include):
    text, patterns = case
    ids = tok.encode(text)
    k, expected = regex_reference(tok, ids, patterns, include)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop_regex=patterns, include_stop_str_in_output=include)
    deltas = []
    for c in chunk(ids[:k], sizes):  # the scheduler stops after token k
        deltas.append(detok.push(c))
        assert expected.startswith(detok.text)  # nothing streamed is taken back later
    deltas.append(detok.finish())
    assert "".join(deltas) == expected
    assert final_text(tok, ids[:k], prompt_ids, stop_regex=patterns, include_stop_str_in_output=include) == expected
    assert detok.stopped and detok.matched_stop in patterns


def test_partial_regex_match_is_held_back_then_released(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop_regex=[r"\(\d{3}\)"])
    assert detok.push(tok.encode("call (55")) == "call "  # "(55" may become "(555)"
    assert detok.push(tok.encode("x")) == "(55x"  # it cannot any more
    assert detok.push(tok.encode(" or (123) later")) == " or "
    assert detok.stopped and detok.matched_stop == r"\(\d{3}\)"
    assert detok.text == "call (55x or "


def test_regex_and_string_stops_together_the_first_to_end_wins(tok, prompt_ids):
    ids = tok.encode("x = 12; y = 3")
    detok, _ = stream(tok, prompt_ids, [ids], stop=["y ="], stop_regex=[r"\d+;"])
    assert detok.text == "x = " and detok.matched_stop == r"\d+;"
    detok, _ = stream(tok, prompt_ids, [ids], stop=["= 1"], stop_regex=[r"\d+;"])
    assert detok.text == "x " and detok.matched_stop == "= 1"
