"""``select``: where scoring starts (C21's token boundary) and what wins, on the real model."""

from __future__ import annotations

import pytest

from radixlm.frontend import (
    assistant,
    assistant_begin,
    function,
    gen,
    select,
    sum_logprob,
    token_length_normalized,
    user,
)
from radixlm.frontend.choices import plan_scoring
from radixlm.frontend.tokenizer import HFTokenizer

C21_OPTIONS = ["Hello", "Goodbye", "^*B^&A"]
METHODS = [token_length_normalized, sum_logprob]


@function
def greet(s, space, options, method):
    s += user("Hi!")
    s += assistant_begin()
    if space:
        s += " "
    s += select("v", options, choices_method=method)


@function
def capital(s, method):
    s += user("What is the capital of France?")
    s += assistant(select("city", ["Paris", "Antidisestablishmentarianism"], choices_method=method))


def test_plan_scores_the_merged_boundary_token_whole(smollm2_dir):
    tok = HFTokenizer(smollm2_dir)
    prompt = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n "
    plan = plan_scoring(prompt, C21_OPTIONS, tok.encode, tok.decode)
    prompt_ids = tok.encode(prompt)
    assert tok.decode(prompt_ids[plan.start:]) == "\n "  # the prompt's tail: one token
    assert len(prompt_ids) == plan.start + 1
    scored = [tok.decode(j[plan.start:]) for j in plan.joint]
    assert scored == ["\n Hello", "\n Goodbye", "\n ^*B^&A"]
    hello = plan.joint[0][plan.start:]
    assert [tok.decode([t]) for t in hello] == ["\n", " Hello"]  # " Hello" spans the join
    assert plan.option_tokens == [1, 2, 6]  # "\n" holds prompt text only
    assert plan.rows == [*plan.joint, prompt_ids]  # the prompt's tail is scored too

    no_space = plan_scoring(prompt[:-1], C21_OPTIONS, tok.encode, tok.decode)
    assert no_space.start == len(tok.encode(prompt[:-1]))  # no merge: the options follow the prompt
    assert no_space.rows == no_space.joint
    assert no_space.option_tokens == [1, 2, 6]


def test_select_rejects_bad_options():
    with pytest.raises(ValueError, match="at least one"):
        select("x", [])
    with pytest.raises(ValueError, match="non-empty"):
        select("x", ["a", ""])
    with pytest.raises(ValueError, match="temperature"):
        select("x", ["a", "b"], temperature=0.5)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
@pytest.mark.parametrize("space", [False, True], ids=["no-space", "space"])
def test_c21_hello_wins_at_the_assistant_boundary(endpoint, space, method):
    state = greet.run(space=space, options=C21_OPTIONS, method=method, backend=endpoint)
    meta = state.get_meta_info("v")
    assert state["v"] == "Hello", meta
    assert meta["method"] == method.name
    assert meta["num_tokens"] == [1, 2, 6]
    assert max(meta["scores"]) == meta["scores"][0] and len(set(meta["scores"])) == 3
    expected = [lp / n for lp, n in zip(meta["logprobs"], meta["num_tokens"], strict=True)]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(expected)
    assert (meta["prompt_tail_logprob"] < 0) == space  # only the space variant scores a tail
    assert state.text().endswith("<|im_start|>assistant\n" + (" " if space else "") + "Hello")


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_clear_cut_capital(endpoint, method):
    state = capital.run(method=method, backend=endpoint)
    meta = state.get_meta_info("city")
    assert state["city"] == "Paris", meta
    assert meta["scores"][0] > meta["scores"][1]
    assert state.messages()[-1] == {"role": "assistant", "content": "Paris"}


def test_the_greedy_continuation_wins(endpoint):
    @function
    def free(s):
        s += user("Hi!")
        s += assistant_begin()
        s += gen("free", max_tokens=12, temperature=0)

    greedy = free.run(backend=endpoint)["free"]
    assert len(greedy) > 3
    options = ["Goodbye", greedy, "^*B^&A"]
    state = greet.run(space=False, options=options, method=token_length_normalized, backend=endpoint)
    assert state["v"] == greedy, state.get_meta_info("v")


def test_choice_is_the_same_cold_warm_and_forked(endpoint, dsl_server, idle_invariants):
    @function
    def forked(s):
        s += user("Hi!")
        s += assistant_begin()
        branches = s.fork(2)
        branches += select("v", C21_OPTIONS)
        branches.join()

    endpoint.flush_cache()
    cold = greet.run(space=True, options=C21_OPTIONS, method=token_length_normalized, backend=endpoint)
    warm = greet.run(space=True, options=C21_OPTIONS, method=token_length_normalized, backend=endpoint)
    cold_meta, warm_meta = cold.get_meta_info("v"), warm.get_meta_info("v")
    assert cold_meta["cached_tokens"][0] == 0  # the first row computed the prefix
    assert all(c > 0 for c in warm_meta["cached_tokens"])  # the warm run reused it
    assert cold["v"] == warm["v"] == "Hello"
    assert warm_meta["scores"] == pytest.approx(cold_meta["scores"], abs=1e-3)

    state = forked.run(backend=endpoint)
    assert state["v"] == ["Hello", "Hello"]
    idle_invariants(dsl_server)  # scoring requests leave no page locked
