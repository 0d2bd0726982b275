"""Overlap scheduling with the real model runner on the CPU (SmolLM2): the next step is
launched before the host reads the token in flight, and nothing a request returns changes."""

from __future__ import annotations

import random
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from radixlm.runtime import messages as m
from radixlm.runtime.executor.cuda_graph_runner import CudaGraphRunner
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs


@pytest.fixture(scope="module")
def runner(smollm2_dir: str) -> ModelRunner:
    # Windows of up to 4 steps: the buffers only; a scheduler asks for windows in its own args.
    return ModelRunner(ServerArgs(model_path=smollm2_dir, device="cpu", max_total_tokens=4096, num_scheduler_steps=4))


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
        self._buffers(runner.model, runner.pool, max_bs, pages, runner._prev_ids, 0, runner.max_decode_window)
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
        self.prev_ids[:bs] = logits.argmax(dim=-1)  # the graph's greedy ids
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
    from radixlm.runtime.scheduler.request import Req

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
    from radixlm.runtime.executor import model_runner as mr
    from radixlm.runtime.scheduler.request import Req

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


def _stream(runner: ModelRunner, steps: int, overlap: bool, reqs: list[m.GenerateReq]) -> dict[str, dict]:
    """Serve ``reqs`` with ``--num-scheduler-steps steps``: per request its streamed tokens
    (the token columns and every output, in order), finish reason and matched stop."""
    s = Scheduler(ServerArgs(model_path="unused", num_scheduler_steps=steps, disable_overlap_schedule=not overlap,
                             debug_invariants=True), runner)
    for req in reqs:
        s.handle(req)
    got = {req.rid: {"ids": [], "finish": None, "matched": None} for req in reqs}
    for _ in range(80):
        s._safe_step()
        batch = s.take_outputs()
        if batch is None:
            continue
        for rid, token in zip(batch.token_rids, batch.token_ids, strict=True):
            got[rid]["ids"].append(token)
        for out in batch.outputs:
            got[out.rid]["ids"] += out.new_token_ids
            if out.finish_reason is not None:
                got[out.rid].update(finish=out.finish_reason, matched=out.matched_stop)
    assert s.violations == [] and not s.has_work
    assert s.allocator.num_free + s.cache.cached_pages == s.allocator.capacity  # no page leaked
    return got


def _count_launches(runner: ModelRunner, monkeypatch) -> list[int]:
    """The decode steps of each later ``runner.launch`` (1, or a window's)."""
    launches: list[int] = []
    launch = runner.launch
    monkeypatch.setattr(runner, "launch", lambda decision: launches.append(decision.decode_steps) or launch(decision))
    return launches


@pytest.mark.parametrize("graphs", [False, True])
def test_multi_step_windows_stream_the_single_step_tokens(runner: ModelRunner, monkeypatch, graphs: bool) -> None:
    """--num-scheduler-steps 4 (greedy): every request streams the tokens, finish reason
    and matched stop it gets one step at a time: a length cap that is not a multiple of the
    window, a stop token id and a stop string met inside a window (the tokens after them
    dropped); with and without overlap, on the eager path and the decode-graph path."""
    if graphs:
        monkeypatch.setattr(runner, "graph_runner", EagerGraphs(runner, max_bs=4))

    def reqs(stop_id: int | None = None, stop: str | None = None) -> list[m.GenerateReq]:
        def gen(rid, ids, n, **sp):
            return m.GenerateReq(rid=rid, input_ids=ids, stream=True, sampling=m.SamplingParams(
                max_new_tokens=n, temperature=0.0, ignore_eos=True, **sp))
        return [gen("a", PROMPTS["a"], 11), gen("b", PROMPTS["b"], 6),
                gen("c", [1, 9, 8, 7], 12, **({"stop_token_ids": (stop_id,)} if stop_id is not None else {})),
                gen("d", [1, 5, 5, 5], 12, **({"stop": (stop,)} if stop is not None else {}))]

    free = _stream(runner, 1, True, reqs())
    c_ids, d_ids = free["c"]["ids"], free["d"]["ids"]
    stop_id = c_ids[6]  # met inside the second window, unless it came earlier
    stop = runner.tokenizer.decode(d_ids[5:7])
    base = _stream(runner, 1, True, reqs(stop_id, stop))
    assert base["c"]["finish"] == "stop" and base["c"]["matched"] == stop_id and len(base["c"]["ids"]) <= 7
    assert base["d"]["finish"] == "stop" and base["d"]["matched"] == stop
    assert [base[r]["finish"] for r in "ab"] == ["length", "length"] and len(base["a"]["ids"]) == 11
    launches = _count_launches(runner, monkeypatch)
    for overlap in (True, False):
        launches.clear()
        assert _stream(runner, 4, overlap, reqs(stop_id, stop)) == base
        # b's max_new_tokens (6) cuts no window; the last is cut to the most any request may still
        # take: a's last 2 (11 = 1 + 4 + 4 + 2), or c's 3 with overlap (its stop not read yet)
        assert launches[:3] == [1, 4, 4] and launches[3:] == [3 if overlap else 2], launches


def test_a_step_with_a_logprob_request_is_not_a_window(runner: ModelRunner, monkeypatch) -> None:
    """A request returning logprobs keeps the whole batch one step at a time, with the
    same tokens as --num-scheduler-steps 1."""
    def reqs() -> list[m.GenerateReq]:
        sp = m.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        return [m.GenerateReq(rid="a", input_ids=PROMPTS["a"], sampling=sp),
                m.GenerateReq(rid="b", input_ids=PROMPTS["b"], sampling=sp, return_logprob=True)]

    launches = _count_launches(runner, monkeypatch)
    got = _stream(runner, 4, True, reqs())
    assert launches and set(launches) == {1}
    assert got == _stream(runner, 1, True, reqs())


def test_an_abort_while_a_window_is_in_flight_frees_the_request_and_spares_the_rest(runner: ModelRunner) -> None:
    """A client abort that arrives while a window holding the request is on the device:
    the request ends there, its pages come back, and the other request of the window
    streams what it streams alone."""
    def gen(rid: str, ids: list[int]) -> m.GenerateReq:
        return m.GenerateReq(rid=rid, input_ids=ids, stream=True, sampling=m.SamplingParams(
            max_new_tokens=10, temperature=0.0, ignore_eos=True))

    alone = _stream(runner, 4, True, [gen("b", PROMPTS["b"])])["b"]
    s = Scheduler(ServerArgs(model_path="unused", num_scheduler_steps=4, disable_overlap_schedule=False,
                             debug_invariants=True), runner)
    s.handle(gen("a", PROMPTS["a"]))
    s.handle(gen("b", PROMPTS["b"]))
    b_ids = []
    for turn in range(40):
        s._safe_step()
        if turn == 2:  # prefill, then the first window launched and in flight
            assert s.inflight is not None and s.inflight.decode_steps == 4
            s.handle(m.AbortReq(rid="a"))
        batch = s.take_outputs()
        if batch is not None:
            b_ids += [t for rid, t in zip(batch.token_rids, batch.token_ids, strict=True) if rid == "b"]
            b_ids += [t for out in batch.outputs if out.rid == "b" for t in out.new_token_ids]
            assert all(out.rid != "a" or not out.new_token_ids for out in batch.outputs if turn > 2)
    assert s.violations == [] and not s.has_work and "a" not in s.reqs
    assert s.allocator.num_free + s.cache.cached_pages == s.allocator.capacity
    assert b_ids == alone["ids"] and len(b_ids) == 10


@pytest.mark.parametrize("graphs", [False, True])
def test_a_sampled_window_feeds_its_sampled_ids(runner: ModelRunner, monkeypatch, graphs: bool) -> None:
    """A window of a batch that is not all greedy samples each step and feeds those ids to
    the next (not the graph's greedy ids): temperature 0.8 with top_k 1 samples the argmax,
    so its tokens equal the greedy request's, one step at a time or in windows. (Only the
    eager variant catches a window that feeds the graph's greedy ids instead: here they
    are the sampled ones.)"""
    if graphs:
        monkeypatch.setattr(runner, "graph_runner", EagerGraphs(runner, max_bs=4))

    def reqs(**sp) -> list[m.GenerateReq]:
        return [m.GenerateReq(rid=rid, input_ids=ids, stream=True, sampling=m.SamplingParams(
            max_new_tokens=9, ignore_eos=True, **sp)) for rid, ids in PROMPTS.items()]

    greedy = _stream(runner, 1, True, reqs(temperature=0.0))
    launches = _count_launches(runner, monkeypatch)
    assert _stream(runner, 4, True, reqs(temperature=0.8, top_k=1)) == greedy
    assert 4 in launches


def test_a_request_out_of_pages_keeps_the_tokens_in_flight(runner: ModelRunner, monkeypatch) -> None:
    """A lone request that outgrows the KV pool ends with "KV cache pool is full" after
    exactly as many tokens with overlap and windows of 4 as when each step is read before
    the next is planned: the tokens sampled by the step or window in flight when the plan
    found no page (their KV fit) are kept, not dropped with it (before: 1 token with
    overlap, a whole window with windows)."""
    monkeypatch.setattr(runner, "num_pages", 12)  # the schedulers' allocators: 11 pages of 16 tokens
    prompt = [1] + random.Random(7).choices(range(3, 40000), k=140)

    def run(steps: int, overlap: bool) -> dict:
        req = m.GenerateReq(rid="big", input_ids=prompt, sampling=m.SamplingParams(
            max_new_tokens=200, temperature=0.0, ignore_eos=True))
        return _stream(runner, steps, overlap, [req])["big"]

    want = run(1, False)
    assert want["finish"] == "length" and len(want["ids"]) == 11 * 16 - 141 + 1
    for steps, overlap in ((1, True), (4, True), (4, False)):
        assert run(steps, overlap) == want, (steps, overlap)


@pytest.mark.slow
def test_windows_count_prefill_and_decode_tokens_as_single_steps_do(runner: ModelRunner) -> None:
    """The scheduler's token counters (the server's prefill / cached / decode token
    metrics) are the same with windows of 4 as one step at a time: a request whose prompt
    is cached but for its last token decodes in windows from its first step (one prefill
    token, 16 cached), and the tokens a window computes after a stop are not counted."""
    prompt = PROMPTS["b"] + list(range(100, 108))  # 17 tokens: the first page is cached the second time

    def run(steps: int, overlap: bool, stop: int | None = None) -> tuple[dict, list[int]]:
        s = Scheduler(ServerArgs(model_path="unused", num_scheduler_steps=steps, disable_overlap_schedule=not overlap,
                                 debug_invariants=True), runner)
        ids: list[int] = []
        for rid, extra in (("first", {}), ("again", {}), ("stopped", {"stop_token_ids": (stop,)} if stop else {})):
            s.handle(m.GenerateReq(rid=rid, input_ids=prompt, sampling=m.SamplingParams(
                max_new_tokens=10, temperature=0.0, ignore_eos=True, **extra)))
            while s.has_work:
                s._safe_step()
                out = s.take_outputs()
                ids += [t for o in (out.outputs if out else []) if o.rid == "first" for t in o.new_token_ids]
        assert s.violations == []
        return {k: s.counters[k] for k in ("prefill_computed", "prefill_cached", "decode")}, ids

    _, ids = run(1, False)
    stop = ids[3]  # the third request stops at its 4th token (unless the same id came earlier)
    want, _ = run(1, False, stop)
    assert want["prefill_cached"] == 16 + 16 and want["prefill_computed"] == 17 + 1 + 1
    for steps, overlap in ((1, True), (4, True), (4, False)):
        assert run(steps, overlap, stop)[0] == want, (steps, overlap)
