"""Overlap scheduling with the real model runner on the CPU (SmolLM2): the next step is
launched before the host reads the token in flight, and nothing a request returns changes."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from radixlm.runtime import messages as m
from radixlm.runtime.cuda_graph_runner import CudaGraphRunner
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs


@pytest.fixture(scope="module")
def runner(smollm2_dir: str) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=smollm2_dir, device="cpu", max_total_tokens=4096))


PROMPTS = {"a": [1, 504, 3458, 282, 4649, 314], "b": [1, 20, 30, 40, 50, 60, 70, 80, 90]}


def _run(runner: ModelRunner, overlap: bool, prompts: dict[str, list[int]] = PROMPTS) -> dict[str, m.ReqOutput]:
    s = Scheduler(ServerArgs(model_path="unused", disable_overlap_schedule=not overlap, debug_invariants=True), runner)
    for rid, ids in prompts.items():
        s.handle(m.GenerateReq(rid=rid, input_ids=ids, return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
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


class EagerGraphs(CudaGraphRunner):
    """The decode CUDA graphs' host side on the CPU: ``replay`` stages its inputs and
    page-table writes as on the GPU, and each "graph" runs the graph's ops eagerly from
    those staged inputs (device page-table rows included), so the model runner's graph path
    (one sampled row per item, in order) runs without CUDA."""

    def __init__(self, runner: ModelRunner, max_bs: int) -> None:  # no super(): nothing captured
        pages = -(-runner.context_length // runner.page_size)
        self._buffers(runner.model, runner.pool, max_bs, pages, runner._prev_ids, 0)
        self.graphs = {bs: SimpleNamespace(replay=partial(self._eager, bs)) for bs in self.batch_sizes}
        self.outputs, self.replays = {}, 0

    def _eager(self, bs: int) -> None:
        self.replays += 1
        self._write_pages()
        ids = torch.where(self.input_ids[:bs] >= 0, self.input_ids[:bs], self.prev_ids[self.src_rows[:bs]])
        tables = self.req_pages[self.table_rows[:bs]].tolist()
        batch = ForwardBatch.build([[i] for i in ids.tolist()], self.positions[:bs].tolist(), tables,
                                   list(range(bs)), self.page_size, "cpu")
        assert batch.out_slots.tolist() == self.out_slots[:bs].tolist()  # the staged KV slots
        logits = self.model.compute_logits(self.model.forward(batch, self.pool), out=self.logits[:bs])
        assert logits.data_ptr() == self.logits.data_ptr()  # written into the shared buffer, as the graph's
        self.outputs[bs] = logits


def test_the_decode_graph_path_gives_the_eager_paths_tokens_and_logprobs(runner: ModelRunner, monkeypatch) -> None:
    """The model runner's decode-graph path (the graph's logits, each item sampling its own
    row; logprobs and top logprobs; a one-token prompt whose first step already decodes from
    its graph) returns what the eager path returns, with and without overlap."""
    prompts = {**PROMPTS, "c": [1]}
    eager = {overlap: _run(runner, overlap, prompts) for overlap in (True, False)}
    graphs = EagerGraphs(runner, max_bs=4)
    monkeypatch.setattr(runner, "graph_runner", graphs)
    for overlap in (True, False):
        before = graphs.replays
        got = _run(runner, overlap, prompts)
        assert graphs.replays - before >= 4  # decode steps took the graph path
        for rid in prompts:
            assert got[rid].new_token_ids == eager[overlap][rid].new_token_ids
            assert got[rid].new_logprobs == pytest.approx(eager[overlap][rid].new_logprobs, abs=1e-4)
            assert got[rid].new_top_logprobs is not None
            assert [[t for t, _ in top] for top in got[rid].new_top_logprobs] == [
                [t for t, _ in top] for top in eager[overlap][rid].new_top_logprobs]
            assert got[rid].prompt_logprobs[1:] == pytest.approx(eager[overlap][rid].prompt_logprobs[1:], abs=1e-4)


def test_sampling_batch_is_reused_only_for_the_same_stateless_rows(runner: ModelRunner) -> None:
    """A steady decode batch builds its SamplingBatch once; seeded or penalised rows (their
    noise key and counted tokens change every step) and a changed batch build a new one,
    with the right values."""
    from radixlm.runtime.request import Req

    def req(rid: str, **sp) -> Req:
        return Req(rid=rid, prompt_ids=[1, 2, 3], sampling=m.SamplingParams(max_new_tokens=8, **sp))

    a, b = req("a", temperature=0.5), req("b", temperature=0.0, top_k=5)
    first, rows, grammar = runner._sampling_batch([a, b])
    assert rows == {a: 0, b: 1} and grammar is False
    again = runner._sampling_batch([a, b])
    assert again[0] is first and again[1] is rows  # the rows are the next launch's _prev_rows
    assert first.temperatures.tolist() == [0.5, 1.0] and first.greedy.tolist() == [False, True]
    swapped, rows, _ = runner._sampling_batch([b, a])
    assert swapped is not first and swapped.temperatures.tolist() == [1.0, 0.5] and rows == {b: 0, a: 1}
    constrained = req("g")
    constrained.grammar = object()  # a matcher, as the scheduler sets it before the request runs
    assert runner._sampling_batch([a, constrained])[2] is True
    assert runner._sampling_batch([a, constrained])[2] is True and runner._sampling_batch([a])[2] is False
    seeded = req("s", temperature=0.7, seed=3)
    one = runner._sampling_batch([a, seeded])[0]
    seeded.output_ids.append(9)  # the next step: another noise key
    two = runner._sampling_batch([a, seeded])[0]
    assert two is not one and one.seed_keys != two.seed_keys
    penalised = req("p", frequency_penalty=0.5)
    one = runner._sampling_batch([penalised])[0]
    penalised.output_ids.append(4)
    two = runner._sampling_batch([penalised])[0]
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
    fewer, rows, _ = runner._sampling_batch([c, a])
    assert builds == [] and fewer.temperatures.tolist() == pytest.approx([0.9, 0.5]) and rows == {c: 0, a: 1}
    assert fewer.top_ps.tolist() == pytest.approx([0.8, float("inf")]) and not fewer.all_greedy
    assert runner._sampling_batch([a])[0].temperatures.tolist() == [0.5] and builds == []
    assert runner._sampling_batch([b])[0].greedy.tolist() == [True]  # not in the last batch [a]
    assert len(builds) == 1
    runner._sampling_batch([b, req("p", presence_penalty=0.5)])  # penalised: never cached
    runner._sampling_batch([b])
    assert len(builds) == 3
