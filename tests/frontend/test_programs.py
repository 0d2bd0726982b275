"""Programs against a real server: roles, fork/join, multi-turn reuse, batches, streaming,
errors."""

from __future__ import annotations

import re

import pytest

from radixlm.frontend import (
    BackendError,
    assistant,
    function,
    gen,
    system,
    user,
)


@function
def chat(s, q1, q2):
    s += user(q1)
    s += assistant(gen("a1", max_tokens=16))
    s += user(q2)
    s += assistant(gen("a2", max_tokens=16))


def test_roles_render_the_models_chat_template(endpoint, smollm2_dir):
    from transformers import AutoTokenizer

    @function
    def qa(s):
        s += system("Answer in one word.")
        s += user("Which planet is red?")
        s += assistant(gen("answer", max_tokens=6, stop="."))

    state = qa.run(temperature=0, backend=endpoint)
    answer = state["answer"]
    assert answer and "." not in answer
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Which planet is red?"},
                {"role": "assistant", "content": answer}]
    assert state.messages() == messages
    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    assert state.text() == hf.apply_chat_template(messages, tokenize=False)
    meta = state.get_meta_info("answer")
    prompt = hf.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert meta["prompt_tokens"] == len(prompt)  # the server saw exactly the template's prompt


def test_fork_of_four_reports_the_shared_prefix_as_cached(endpoint, dsl_server, idle_invariants):
    @function
    def taglines(s):
        s += system("You write short taglines for small shops.")
        s += user("Write a tagline for a coffee shop called Bean There.")
        branches = s.fork(4)
        for i, branch in enumerate(branches):  # queued at once: the four requests run together
            branch += assistant(gen("tag", max_tokens=8, temperature=0.8, seed=i))
        branches.join()
        return [b.get_meta_info("tag") for b in branches]

    endpoint.flush_cache()
    state = taglines.run(backend=endpoint)
    tags = state["tag"]  # join gathers the branch variable as a list, in branch order
    assert isinstance(tags, list) and len(tags) == 4 and all(tags)
    assert len(set(tags)) > 1  # four samples, not one answer copied
    metas = state.ret_value
    prompt = metas[0]["prompt_tokens"]
    assert prompt > 32  # the shared prefix (all but "<|im_start|>assistant\n") spans a page
    for meta in metas:  # the fork cached the prefix before the branches ran
        assert meta["prompt_tokens"] == prompt
        assert 16 <= meta["cached_tokens"] < prompt and meta["cached_tokens"] % 16 == 0
    idle_invariants(dsl_server)


def test_second_turn_reuses_the_first_turns_pages(endpoint):
    endpoint.flush_cache()
    state = chat.run(q1="Name a fruit.", q2="What colour is it?", temperature=0, backend=endpoint)
    first, second = state.get_meta_info("a1"), state.get_meta_info("a2")
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] >= first["prompt_tokens"] // 16 * 16 > 0
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]


@pytest.mark.slow
def test_run_batch_matches_single_runs(endpoint):
    args = [{"q1": "Name a fruit.", "q2": "What colour is it?"},
            {"q1": "Name a planet.", "q2": "Is it large?"},
            {"q1": "Name a river.", "q2": "Where is it?"}]
    states = chat.run_batch(args, backend=endpoint, num_threads=3, temperature=0)
    assert len(states) == 3
    for kwargs, state in zip(args, states, strict=True):
        assert state.messages()[0]["content"] == kwargs["q1"]
        single = chat.run(**kwargs, temperature=0, backend=endpoint)
        assert (state["a1"], state["a2"]) == (single["a1"], single["a2"])


def test_streaming_yields_the_non_streaming_text(endpoint):
    kwargs = dict(q1="Tell me a story about a cat.", q2="Shorter, please.", temperature=0, backend=endpoint)
    reference = chat.run(**kwargs)
    state = chat.run(**kwargs, stream=True)
    pieces = list(state.text_iter("a1"))
    assert len(pieces) > 1  # it did stream
    assert "".join(pieces) == reference["a1"]
    assert state["a2"] == reference["a2"]
    whole = chat.run(**kwargs, stream=True)
    assert "".join(whole.text_iter()) == reference.text()


def test_variables_drive_control_flow(endpoint):
    @function
    def loop(s):
        s += "Count: 1, 2, 3,"
        for _ in range(3):
            s += gen("n", max_tokens=3, stop=",")
            if not s["n"].strip():
                break
            s += ","
        return s["n"]

    state = loop.run(temperature=0, backend=endpoint)
    assert state.text().startswith("Count: 1, 2, 3, 4, 5, 6")
    assert state.ret_value == " 6"


def test_stop_regex_ends_a_gen_on_every_backend(endpoint, openai_backend):
    @function
    def count(s):
        s += "Count from 1 to 20: 1, 2, 3,"
        s += gen("n", max_tokens=40, stop_regex=r"[7-9],")
        s += gen("more", max_tokens=2, stop_regex=[r"\d"])

    for backend in (endpoint, openai_backend):
        state = count.run(temperature=0, backend=backend)
        assert state["n"] == " 4, 5, 6, " and state["more"] == ""  # the greedy text goes on " 7,"
    assert count.run(temperature=0, backend=endpoint).get_meta_info("n")["finish_reason"] == {
        "type": "stop", "matched": "[7-9],"}
    with pytest.raises(re.error):
        gen("x", stop_regex=["ok", "(unclosed"])


def test_server_errors_surface(endpoint):
    @function
    def bad(s):
        s += "Hello"
        s += gen("x", max_tokens=4, temperature=0, top_k=-5)  # the server refuses top_k < -1

    with pytest.raises(BackendError) as err:
        bad.run(backend=endpoint)
    assert err.value.status == 400 and "top_k" in err.value.message

    state = bad.run(backend=endpoint, stream=True)
    with pytest.raises(BackendError):
        list(state.text_iter("x"))
    with pytest.raises(BackendError):
        state += "more"


def test_roles_must_not_nest(endpoint):
    @function
    def nested(s):
        s += user(user("hi"))

    with pytest.raises(ValueError, match="roles do not nest"):
        nested.run(backend=endpoint)


def test_unknown_keyword_is_a_type_error(endpoint):
    with pytest.raises(TypeError, match="unexpected keyword argument 'q3'"):
        chat.run(q1="a", q2="b", q3="c", backend=endpoint)
