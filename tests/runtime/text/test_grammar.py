"""Tests for radixlm.runtime.text.grammar.GrammarMasker: the rows with a matcher get their
grammar's mask, the others are left exactly as they were, also when a row's reused
buffer held another grammar's bits the step before (CPU, and CUDA if present)."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from radixlm.runtime.text.grammar import GrammarMasker

VOCAB = ["a", "b", "c", "ab", "1", "2", "</s>"]  # token id = index; </s> is the stop token
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _matcher(regex: str) -> xgr.GrammarMatcher:
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[len(VOCAB) - 1])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))


def _allowed(logits_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits_row)).flatten().tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_masks_only_the_rows_with_a_matcher(device):
    masker = GrammarMasker(len(VOCAB), torch.device(device))
    for step in range(4):  # the host buffers are reused every other step
        logits = torch.randn(3, len(VOCAB), device=device)
        before = logits.clone()
        digits, letters = _matcher("[12]+"), _matcher("a(b|c)")
        # the grammar moves between rows 0 and 1: a row's buffer holds stale bits
        matchers = [digits, None, letters] if step % 3 == 0 else [None, digits, letters]
        masker.apply(logits, matchers)
        free = 1 if matchers[1] is None else 0
        assert torch.equal(logits[free], before[free])  # no grammar: untouched
        allowed = {1 - free: {4, 5}, 2: {0, 3}}  # first token of "[12]+" / "a(b|c)" ("a", "ab")
        for row, ids in allowed.items():
            assert _allowed(logits[row]) == ids
            keep = sorted(ids)
            assert torch.equal(logits[row, keep], before[row, keep])


@pytest.mark.parametrize("device", DEVICES)
def test_more_rows_than_the_buffers_hold(device):
    masker = GrammarMasker(len(VOCAB), torch.device(device))
    masker.apply(torch.zeros(2, len(VOCAB), device=device), [_matcher("1"), None])
    logits = torch.zeros(100, len(VOCAB), device=device)
    masker.apply(logits, [None] * 99 + [_matcher("2")])
    assert _allowed(logits[99]) == {5}
    assert all(_allowed(logits[i]) == set(range(len(VOCAB))) for i in range(99))


def test_advanced_matcher_allows_the_stop_token_only_when_complete():
    masker = GrammarMasker(len(VOCAB), torch.device("cpu"))
    logits = torch.zeros(1, len(VOCAB))
    m = _matcher("a(b|c)")
    assert m.accept_token(0)  # "a"
    masker.apply(logits, [m])
    assert _allowed(logits[0]) == {1, 2}
    assert m.accept_token(2)  # "c": complete, only the stop token is left
    logits = torch.zeros(1, len(VOCAB))
    masker.apply(logits, [m])
    assert _allowed(logits[0]) == {len(VOCAB) - 1}


def test_no_matcher_is_a_no_op():
    logits = torch.randn(2, len(VOCAB))
    before = logits.clone()
    GrammarMasker(len(VOCAB), torch.device("cpu")).apply(logits, [None, None])
    assert torch.equal(logits, before)
