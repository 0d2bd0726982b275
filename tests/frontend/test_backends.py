"""The OpenAI-compatible backend, the server-starting ``Runtime`` backend, and the
frontend's torch-free promise at run time."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from radixlm.frontend import BackendError, OpenAI, Runtime, assistant, function, gen, select, user


@function
def qa(s, q):
    s += user(q)
    s += assistant(gen("a", max_tokens=12))


@function
def complete(s, text):
    s += text
    s += gen("a", max_tokens=6, stop="\n")


def test_openai_backend_gen_matches_the_native_endpoint(endpoint, openai_backend):
    for program, kwargs in ((qa, {"q": "What is the capital of France?"}),
                            (complete, {"text": "The capital of France is"})):
        native = program.run(**kwargs, temperature=0, backend=endpoint)
        openai = program.run(**kwargs, temperature=0, backend=openai_backend)
        assert openai["a"] == native["a"] and openai["a"]
        assert openai.messages() == native.messages()
    meta = openai.get_meta_info("a")
    assert meta["finish_reason"] in ("stop", "length") and meta["usage"]["prompt_tokens"] > 0
    streamed = qa.run(q="What is the capital of France?", temperature=0, backend=openai_backend, stream=True)
    pieces = list(streamed.text_iter("a"))
    assert len(pieces) > 1 and "".join(pieces) == qa.run(
        q="What is the capital of France?", temperature=0, backend=endpoint)["a"]


@function
def pick(s, prompt, options):
    s += prompt
    s += select("c", options)


@pytest.mark.parametrize(("prompt", "options"), [
    ("The capital of France is", [" Paris", " Rome", " a city in Europe"]),
    ("Say hello.\n ", ["Hello", "^*B^&A"]),  # C21: the prompt's last token merges with an option
])
def test_openai_backend_select_scores_like_the_native_endpoint(endpoint, openai_backend, prompt, options):
    """Through /v1/completions echo + logprobs the joint-tokenisation scoring sees the same
    tokens (as strings) and the same logprobs as the native input_ids path."""
    native = pick.run(prompt=prompt, options=options, backend=endpoint)
    via_openai = pick.run(prompt=prompt, options=options, backend=openai_backend)
    assert via_openai["c"] == native["c"]
    got, want = via_openai.get_meta_info("c"), native.get_meta_info("c")
    for key in ("scoring_start", "num_tokens"):
        assert got[key] == want[key]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)
    assert got["prompt_tail_logprob"] == pytest.approx(want["prompt_tail_logprob"], abs=1e-3)
    assert all(lp < 0 for lp in got["logprobs"])


def test_openai_backend_select_says_why_an_api_cannot(openai_backend, monkeypatch):
    @function
    def in_role(s):
        s += user("What is the capital of France?")
        s += assistant(select("c", ["Paris", "Rome"]))

    with pytest.raises(NotImplementedError, match="outside any role"):
        in_role.run(backend=openai_backend)

    def refuse(path, body):
        assert path == "/completions" and body["echo"] is True and body["max_tokens"] == 0
        raise BackendError(400, "echo is not supported")

    monkeypatch.setattr(openai_backend.http, "post", refuse)
    with pytest.raises(NotImplementedError, match="the server refused: echo is not supported"):
        pick.run(prompt="The capital of France is", options=[" Paris", " Rome"], backend=openai_backend)

    def no_logprobs(path, body):  # an API that ignores echo/logprobs
        return {"choices": [{"index": i, "text": "", "logprobs": None} for i in range(len(body["prompt"]))]}

    monkeypatch.setattr(openai_backend.http, "post", no_logprobs)
    with pytest.raises(NotImplementedError, match="returned none"):
        pick.run(prompt="The capital of France is", options=[" Paris", " Rome"], backend=openai_backend)


def test_openai_backend_select_skips_a_leading_bos_token_string(monkeypatch):
    """An API whose echo starts with a BOS token ("<s>", no prompt text) and whose prompt
    tail merges with an option (C21): scoring starts where the rows part, the prompt's own
    tail token is subtracted, and the BOS does not count as option text."""
    rows = {  # prompt -> (tokens, token_logprobs) as an echo with max_tokens=0 returns them
        "Say hi.\n ": (["<s>", "Say", " hi", ".", "\n "], [None, -5.0, -2.0, -1.0, -4.0]),
        "Say hi.\n Hello": (["<s>", "Say", " hi", ".", "\n", " Hello"], [None, -5.0, -2.0, -1.0, -0.5, -0.25]),
        "Say hi.\n ^*B": (["<s>", "Say", " hi", ".", "\n", " ^*", "B"], [None, -5.0, -2.0, -1.0, -0.5, -6.0, -3.0]),
    }

    def echo(path, body):
        assert body["prompt"][-1] == "Say hi.\n " and body["max_tokens"] == 0 and body["echo"] is True
        return {"choices": [{"index": i, "text": p, "logprobs": {"tokens": rows[p][0], "token_logprobs": rows[p][1]}}
                            for i, p in enumerate(body["prompt"])]}

    backend = OpenAI("m", base_url="http://127.0.0.1:9/v1")
    monkeypatch.setattr(backend.http, "post", echo)
    state = pick.run(prompt="Say hi.\n ", options=["Hello", "^*B"], backend=backend)
    meta = state.get_meta_info("c")
    assert meta["scoring_start"] == 4 and meta["num_tokens"] == [1, 2]
    assert meta["prompt_tail_logprob"] == -4.0
    assert meta["logprobs"] == [-0.75 + 4.0, -9.5 + 4.0]
    assert state["c"] == "Hello" and meta["scores"] == [3.25, -5.5 / 2]


def test_openai_backend_refuses_what_the_api_cannot_express(openai_backend):
    @function
    def mid_message(s):
        s += user("Hi")
        s += assistant("Sure: " + gen("a", max_tokens=4))

    with pytest.raises(ValueError, match="assistant_begin"):
        mid_message.run(backend=openai_backend)


@pytest.mark.slow
def test_runtime_starts_serves_and_stops_a_server(tmp_path):
    log = open(tmp_path / "server.log", "w")
    with Runtime(log=log, max_total_tokens=2048, startup_timeout=240) as runtime:
        state = complete.run(text="The capital of France is", temperature=0, backend=runtime)
        assert "Paris" in state["a"]
        url = runtime.url
    assert runtime.proc.returncode == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def test_frontend_runs_select_without_importing_torch(dsl_server):
    code = f"""
import sys
from radixlm.frontend import RuntimeEndpoint, assistant, function, select, user

@function
def capital(s):
    s += user("What is the capital of France?")
    s += assistant(select("city", ["Paris", "Antidisestablishmentarianism"]))

state = capital.run(backend=RuntimeEndpoint({dsl_server.url!r}))
assert state["city"] == "Paris", state.get_meta_info("city")
assert "torch" not in sys.modules and "transformers" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
