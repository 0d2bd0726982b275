"""Overlap scheduling with the real model runner on the CPU (SmolLM2): the next step is
launched before the host reads the token in flight, and nothing a request returns changes."""

from __future__ import annotations

import pytest

from radixlm.runtime import messages as m
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs


@pytest.fixture(scope="module")
def runner(smollm2_dir: str) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=smollm2_dir, device="cpu", max_total_tokens=4096))


def _run(runner: ModelRunner, overlap: bool) -> dict[str, m.ReqOutput]:
    s = Scheduler(ServerArgs(model_path="unused", disable_overlap_schedule=not overlap, debug_invariants=True), runner)
    prompts = {"a": [1, 504, 3458, 282, 4649, 314], "b": [1, 20, 30, 40, 50, 60, 70, 80, 90]}
    for rid, ids in prompts.items():
        s.handle(m.GenerateReq(rid=rid, input_ids=ids, return_logprob=True, logprob_start_len=0,
                               sampling=m.SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)))
    outs: dict[str, m.ReqOutput] = {}
    for _ in range(30):
        s._safe_step()
        for out in s.outbox:
            outs[out.rid] = out
        s.outbox.clear()
    assert s.violations == [] and not s.has_work
    for rid, ids in prompts.items():
        assert len(outs[rid].prompt_logprobs) == len(ids) and outs[rid].prompt_logprobs[0] is None
    return outs


def test_overlap_gives_the_same_tokens_and_logprobs_as_reading_each_step(runner: ModelRunner) -> None:
    with_overlap, without = _run(runner, True), _run(runner, False)
    for rid in ("a", "b"):
        assert with_overlap[rid].new_token_ids == without[rid].new_token_ids
        assert len(with_overlap[rid].new_token_ids) == 5 and with_overlap[rid].finish_reason == "length"
        assert with_overlap[rid].new_logprobs == pytest.approx(without[rid].new_logprobs, abs=1e-4)
        assert with_overlap[rid].prompt_logprobs[1:] == pytest.approx(without[rid].prompt_logprobs[1:], abs=1e-4)


def test_sampling_batch_is_reused_only_for_the_same_stateless_rows(runner: ModelRunner) -> None:
    """A steady decode batch builds its SamplingBatch once; seeded or penalised rows (their
    noise key and counted tokens change every step) and a changed batch build a new one,
    with the right values."""
    from radixlm.runtime.request import Req

    def req(rid: str, **sp) -> Req:
        return Req(rid=rid, prompt_ids=[1, 2, 3], sampling=m.SamplingParams(max_new_tokens=8, **sp))

    a, b = req("a", temperature=0.5), req("b", temperature=0.0, top_k=5)
    first = runner._sampling_batch([a, b])
    assert runner._sampling_batch([a, b]) is first
    assert first.temperatures.tolist() == [0.5, 1.0] and first.greedy.tolist() == [False, True]
    swapped = runner._sampling_batch([b, a])
    assert swapped is not first and swapped.temperatures.tolist() == [1.0, 0.5]
    seeded = req("s", temperature=0.7, seed=3)
    one = runner._sampling_batch([a, seeded])
    seeded.output_ids.append(9)  # the next step: another noise key
    two = runner._sampling_batch([a, seeded])
    assert two is not one and one.seed_keys != two.seed_keys
    penalised = req("p", frequency_penalty=0.5)
    one = runner._sampling_batch([penalised])
    penalised.output_ids.append(4)
    two = runner._sampling_batch([penalised])
    assert one.output_ids.tolist() == [] and two.output_ids.tolist() == [4]


def test_sampling_batch_of_fewer_stateless_rows_indexes_the_last_one(runner: ModelRunner, monkeypatch) -> None:
    """When requests leave a stateless batch (or it is reordered) the model runner takes
    the remaining rows of the last SamplingBatch (``SamplingBatch.take``) instead of a
    rebuild; a new request in the batch, or a penalised one, builds from scratch."""
    from radixlm.runtime import model_runner as mr
    from radixlm.runtime.request import Req

    def req(rid: str, **sp) -> Req:
        return Req(rid=rid, prompt_ids=[1, 2, 3], sampling=m.SamplingParams(max_new_tokens=8, **sp))

    a, b, c = req("a", temperature=0.5), req("b", temperature=0.0, top_k=5), req("c", temperature=0.9, top_p=0.8)
    runner._sampling_batch([a, b, c])
    builds = []
    real_build = mr.SamplingBatch.build
    monkeypatch.setattr(mr.SamplingBatch, "build", lambda *args: builds.append(args) or real_build(*args))
    fewer = runner._sampling_batch([c, a])
    assert builds == [] and fewer.temperatures.tolist() == pytest.approx([0.9, 0.5])
    assert fewer.top_ps.tolist() == pytest.approx([0.8, float("inf")]) and not fewer.all_greedy
    assert runner._sampling_batch([a]).temperatures.tolist() == [0.5] and builds == []
    assert runner._sampling_batch([b]).greedy.tolist() == [True]  # not in the last batch [a]
    assert len(builds) == 1
    runner._sampling_batch([b, req("p", presence_penalty=0.5)])  # penalised: never cached
    runner._sampling_batch([b])
    assert len(builds) == 3
