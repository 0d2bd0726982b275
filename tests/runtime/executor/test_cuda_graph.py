"""Decode and extend CUDA graphs: buckets, and replay == eager forward (GPU only for the latter)."""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from radixlm.runtime.executor.cuda_graph_runner import (
    INPUT_ROWS,
    CudaGraphRunner,
    PageTableRows,
    graph_batch_sizes,
    graph_extend_sizes,
)
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.model_loader import load_model
from radixlm.runtime.memory.kv_pool import KVPool
from radixlm.runtime.memory.page_allocator import PageAllocator


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    with pytest.raises(ValueError, match="max_bs"):
        graph_batch_sizes(0)


def test_graph_extend_sizes() -> None:
    assert graph_extend_sizes(0) == []
    assert graph_extend_sizes(2) == [2]
    assert graph_extend_sizes(16) == [16]
    assert graph_extend_sizes(100) == [16, 32, 64, 100]
    assert graph_extend_sizes(256) == [16, 32, 64, 128, 256]
    for bad in (-1, 1):
        with pytest.raises(ValueError, match="max_tokens"):
            graph_extend_sizes(bad)


def test_page_table_rows_copy_only_what_changed() -> None:
    rows = PageTableRows(4)  # rows 1..3
    a, b, c, d = "a", "b", "c", "d"
    assert rows.sync([a, b], [[5, 6], [7]]) == ([1, 2], [(1, 0, [5, 6]), (2, 0, [7])])
    assert rows.sync([a, b], [[5, 6], [7]]) == ([1, 2], [])  # nothing changed
    assert rows.sync([b, a], [[7, 9], [5, 6]]) == ([2, 1], [(2, 1, [9])])  # b grew one page
    # a's first page swapped for the tree's copy (dedup): the whole row is rewritten
    assert rows.sync([a], [[4, 6, 8]]) == ([1], [(1, 0, [4, 6, 8])])
    assert rows.sync([a], [[4]]) == ([1], [(1, 0, [4])])  # shrank (preempted, re-admitted)
    assert rows.sync([c], [[1]]) == ([3], [(3, 0, [1])])
    # no row free: a and b (not in this step) give theirs back; c keeps its row
    assert rows.sync([c, d], [[1], [2]]) == ([3, 2], [(2, 0, [2])])
    assert rows.sync([a], [[4]]) == ([1], [(1, 0, [4])])  # a comes back: written from scratch
    with pytest.raises(ValueError, match="rows"):
        rows.sync([a, b, c, d], [[1], [2], [3], [4]])


def _uncaptured(max_extend_tokens: int, max_window: int = 1) -> tuple[CudaGraphRunner, list[int]]:
    """A graph runner's host side on the CPU: buffers for 4 requests, 8 pages of 4 tokens,
    no capture; stand-in graphs doing the graphs' first ops (a decode graph's page-table
    writes, each counted in the returned list; an extend graph's ``_extend_inputs``)."""
    pool = KVPool(64, 4, 1, 1, 8, torch.float32, "cpu")
    runner = CudaGraphRunner.__new__(CudaGraphRunner)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=8))  # _buffers sizes the logits by it
    runner._buffers(model, pool, max_bs=4, max_pages=8, prev_ids=torch.zeros(4, dtype=torch.int64),
                    max_extend_tokens=max_extend_tokens, max_window=max_window)
    decode_writes: list[int] = []

    def decode() -> None:
        decode_writes.append(int(runner.write_rows.count_nonzero()))
        runner._write_pages()

    runner.graphs = {bs: SimpleNamespace(replay=decode) for bs in runner.batch_sizes}
    runner.outputs = {bs: torch.zeros(bs, 8) for bs in runner.batch_sizes}
    runner.ext_graphs = {tg: SimpleNamespace(replay=partial(runner._extend_inputs, tg)) for tg in runner.extend_sizes}
    runner.ext_outputs = {tg: torch.zeros(1, 4) for tg in runner.extend_sizes}
    return runner, decode_writes


def test_decode_page_table_writes_ride_with_the_step_inputs() -> None:
    """A decode replay stages its page-table writes in the inputs copy (rows 6-8), which the
    graph applies first (``_write_pages``); only writes beyond Bmax are written before the
    replay. Host side on the CPU: buffers without capture, a stand-in graph doing the
    graph's first op; every request's device row must end equal to its page table."""
    runner, replays = _uncaptured(max_extend_tokens=0)
    assert runner.logits.shape == (4, 8) and runner.logits.dtype == torch.float32
    assert runner.inputs.shape == (INPUT_ROWS, 4)

    def step(keys: list[str], tables: list[list[int]]) -> None:
        positions = [len(t) * 4 - 1 for t in tables]  # the last slot of each table
        runner.replay([1] * len(keys), positions, tables, keys=keys)  # inputs copied, then the graph
        for key, table in zip(keys, tables, strict=True):
            row = runner.tables._row_of[key]
            assert runner.req_pages[row, : len(table)].tolist() == table, (key, table)

    # Two new requests: 2 + 3 = 5 writes > Bmax 4. a's run of 2 fits in the graph's writes;
    # b's run of 3 then does not, and is written before the replay (one index copy).
    step(["a", "b"], [[5, 6], [7, 8, 9]])
    assert replays == [2]
    step(["a", "b"], [[5, 6, 11], [7, 8, 9]])  # a grew one page: one write, in the graph
    assert replays == [2, 1]
    step(["a", "b"], [[5, 6, 11], [7, 8, 9]])  # nothing changed: only padding writes
    assert replays == [2, 1, 0]
    step(["c", "d"], [[12, 13, 14], [15, 16, 17, 18]])  # two more new rows: c's 3 in the graph, d's 4 before
    assert replays == [2, 1, 0, 3]
    # Padding writes land on the dummy row 0, entry 0, which stays page 0.
    assert runner.req_pages[0].tolist() == [0] * 8


def test_a_window_stages_every_steps_inputs_and_replays_them_in_turn() -> None:
    """``replay(..., steps=3)`` stages steps 1 and 2 with step 0's copy: each request one
    position further, its input the previous step's sample of its row (-1, src row b), its
    KV slot the next one or, where the position starts a page, the next page's first slot;
    no page-table writes after step 0. ``replay_next`` copies them into the graph's inputs
    in turn and refuses a step past the window; a window longer than the buffers is a
    ValueError, as is a page table too short for the window's last position."""
    runner, writes = _uncaptured(max_extend_tokens=0, max_window=3)
    seen = []
    for graph in runner.graphs.values():  # record the inputs each replay sees
        graph.replay = partial(lambda old: (old(), seen.append(runner.inputs[:6, :2].clone())), graph.replay)
    # a at position 6 (page 1, slot 2 of 4): steps at 7 and 8 (8 starts its third page, 30);
    # b at position 1 (page 0): steps at 2 and 3, slots 41 and 42.
    tables = [[10, 20, 30], [40]]
    runner.replay([5, -1], [6, 1], tables, src_rows=[0, 3], keys=["a", "b"], steps=3)
    assert writes == [4]  # both rows written whole by step 0's copy (3 + 1 page ids)
    step0 = seen[0].tolist()
    assert step0[:4] == [[5, -1], [6, 1], [20 * 4 + 2, 40 * 4 + 1], [0, 3]]
    assert runner.replay_next().shape == (2, 8) and runner.replay_next().shape == (2, 8)
    assert writes == [4, 0, 0]  # later steps write nothing
    step1, step2 = seen[1].tolist(), seen[2].tolist()
    assert step1[:4] == [[-1, -1], [7, 2], [20 * 4 + 3, 40 * 4 + 2], [0, 1]]
    assert step2[:4] == [[-1, -1], [8, 3], [30 * 4 + 0, 40 * 4 + 3], [0, 1]]
    assert step1[4] == step2[4] == step0[4]  # the same device page-table rows
    with pytest.raises(RuntimeError, match="nothing staged"):
        runner.replay_next()
    with pytest.raises(ValueError, match="window holds 1..3"):
        runner.replay([5], [6], [[10, 20, 30]], keys=["a"], steps=4)
    with pytest.raises(ValueError, match="does not reach position 8"):
        runner.replay([5], [6], [[10, 20]], keys=["a"], steps=3)


def test_extend_replay_writes_the_requests_page_table_row_in_the_graph() -> None:
    """An extend replay stages the request's page ids after its other inputs (one copy of
    4 * Tmax + P values) and the graph writes the request's whole device row itself
    (``_extend_inputs``); the host's mirror of the row is updated, so the request's next
    decode step only writes the page it grew. Host side on the CPU: buffers without
    capture, stand-in graphs doing the graphs' first ops."""
    runner, decode_writes = _uncaptured(max_extend_tokens=8)
    assert runner.extend_sizes == [8] and runner.ext_flat.shape == (4 * 8 + 8,)

    def row_of(key: str) -> list[int]:
        return runner.req_pages[runner.tables._row_of[key]].tolist()

    # a: 3 new tokens at positions 9..11 of pages [5, 6, 7] (a cached prefix of 9 tokens)
    runner.replay_extend([21, 22, 23], 9, [5, 6, 7], key="a")
    assert row_of("a")[:3] == [5, 6, 7] and runner.ext_table[0, :3].tolist() == [5, 6, 7]
    assert runner.ext_inputs[0].tolist() == [21, 22, 23, 0, 0, 0, 0, 0]  # bucket 8, padded with token 0
    assert runner.ext_inputs[1, :3].tolist() == [9, 10, 11]
    assert runner.ext_inputs[2].tolist() == [7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 0, 0, 0, 0, 0]  # then dummy slot 0
    assert runner.ext_inputs[3, :4].tolist() == [9, 2, runner.tables._row_of["a"], -1]
    assert int(runner.ext_prefix) == 9 and int(runner.ext_seq_len) == 9 + 8 and int(runner.ext_row) == 2  # padded to 8
    # b: a fresh 5-token prompt over two pages; a's row stays as it was
    runner.replay_extend([1, 2, 3, 4, 5], 0, [9, 10], key="b")
    assert row_of("b")[:2] == [9, 10] and row_of("a")[:3] == [5, 6, 7]
    assert runner.ext_inputs[2].tolist() == [36, 37, 38, 39, 40, 0, 0, 0]
    # a decodes at position 12 with one more page: one write, applied in the decode graph
    runner.replay([30], [12], [[5, 6, 7, 11]], keys=["a"])
    assert decode_writes == [1] and row_of("a")[:4] == [5, 6, 7, 11]
    assert runner.req_pages[0].tolist() == [0] * 8  # the dummy row untouched


def test_an_extend_whose_padding_ends_past_the_captured_width_runs_eagerly() -> None:
    """Padded to its bucket, an extend must end within Pmax * page_size positions (the
    extend kernel reads the padding's keys through the page table too: past that, it
    would read beyond the row). A prompt ending near the context length can fail it:
    ``replay_extend`` refuses it and the model runner takes the eager path."""
    from radixlm.runtime.executor.model_runner import ModelRunner
    from radixlm.runtime.scheduler.decision import ScheduleItem

    runner, _ = _uncaptured(max_extend_tokens=8)  # 32 positions, bucket 8
    assert runner.fits_extend(24, 3) and not runner.fits_extend(25, 3)  # 25 + 8 > 32
    assert not runner.fits_extend(0, 1) and not runner.fits_extend(0, 9)  # no bucket
    with pytest.raises(ValueError, match="past the captured width"):
        runner.replay_extend([1, 2, 3], 25, list(range(1, 8)))

    class Req:  # hashable, as the model runner's requests (the page-table row's key)
        pages = list(range(1, 9))

    host = SimpleNamespace(graph_runner=runner, pool=runner.pool, _prompt_positions=lambda it: range(0))
    near_end = [ScheduleItem(Req(), 25, 3, True)]
    assert ModelRunner._replay_extend(host, near_end, [[1, 2, 3]], []) is None  # eager
    assert ModelRunner._replay_extend(host, [ScheduleItem(Req(), 24, 3, True)], [[1, 2, 3]], []) is not None


def _claim_sinks(pool: KVPool, prompts: list[list[int]]) -> tuple[list[int] | None, list[tuple[int, int]] | None]:
    """(sink slots, writes) of a prefill of ``prompts`` from position 0, as ModelRunner
    builds them (``KVPool.sink_slot``); (None, None) for pools without a sink."""
    if not pool.has_sink:
        return None, None
    slots, writes, row = [], [], 0
    for ids in prompts:
        slot, write = pool.sink_slot(ids[0], True)
        slots.append(slot)
        if write:
            writes.append((row, slot))
        row += len(ids)
    return slots, writes


def test_graph_runner_refuses_cpu(tiny_hf_model: Callable) -> None:
    model = load_model(tiny_hf_model()[0], torch.float32, "cpu", "torch")
    pool = KVPool(8, 4, 2, 2, 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaGraphRunner(model, pool, max_bs=2, max_pages=4, prev_ids=torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize(("batch", "kv"), [(1, "auto"), (3, "auto"), (8, "auto"), (13, "auto"),
                                           (3, "fp8_e4m3+means"), (13, "fp8_e4m3+means"),
                                           (3, "fp8_e4m3+sink"), (13, "fp8_e4m3+sink")])  # fmt: skip
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_matches_eager_decode(tiny_hf_model: Callable, batch: int, kv: str) -> None:
    """B requests of different lengths (prefilled eagerly) decode one token through the
    graph (padded to the bucket): logits (the LM head is in the graph) and the K/V written
    equal the eager pass, and the dummy page absorbs the padding rows' writes. ``fp8_e4m3+means``: FP8 pages
    centred on channel means (the decode kernel adds v_mean in its epilogue); ``+sink``:
    also an exact attention sink of 4 slots (13 requests: some read their FP8 page)."""
    page = 4
    model = load_model(tiny_hf_model(max_position_embeddings=64)[0], torch.float32, "cuda", "triton")
    cfg = model.config
    rng = random.Random(batch)
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    quant: tuple = ()
    if kv in ("fp8_e4m3+means", "fp8_e4m3+sink"):
        gen = torch.Generator().manual_seed(3)
        quant = ("fp8_e4m3", torch.full((layers, kv_heads), 0.02), torch.full((layers, kv_heads), 0.03),
                 torch.randn(layers, kv_heads, 16, generator=gen), torch.randn(layers, kv_heads, 16, generator=gen))  # fmt: skip

    def fresh() -> tuple[KVPool, list[list[int]], list[list[int]]]:
        pool = KVPool(96, page, layers, kv_heads, 16, torch.float32, "cuda", *quant,
                      sink_slots=4 if kv == "fp8_e4m3+sink" else 0)  # fmt: skip
        for layer in range(cfg.num_hidden_layers):  # pools start uninitialised
            pool.k[layer].zero_()
            pool.v[layer].zero_()
        alloc, tables, prompts = PageAllocator(96), [], []
        r = random.Random(7)
        for _ in range(batch):
            n = r.randint(1, 30)
            prompts.append(r.choices(range(256), k=n))
            tables.append(alloc.alloc(-(-(n + 2) // page)))  # room for two decode steps
            alloc.alloc(1)  # non-contiguous tables
        prefill = ForwardBatch.build(prompts, [0] * batch, tables, [0], page, "cuda", *_claim_sinks(pool, prompts))
        with torch.inference_mode():
            model(prefill, pool)
        return pool, tables, prompts

    next_ids = [rng.randrange(256) for _ in range(batch)]
    pool_e, tables, prompts = fresh()
    positions = [len(p) for p in prompts]
    sinks = [pool_e.sink_lookup(p[0]) for p in prompts] if pool_e.has_sink else None
    assert sinks is None or (0 in sinks and (batch < 5 or -1 in sinks)), sinks
    eager_batch = ForwardBatch.build([[t] for t in next_ids], positions, tables, list(range(batch)), page, "cuda",
                                     sinks)  # fmt: skip
    with torch.inference_mode():
        want = model.compute_logits(model(eager_batch, pool_e))  # the graphs include the LM head

    pool_g, tables_g, _ = fresh()
    prev = torch.zeros(16, dtype=torch.int64, device="cuda")
    runner = CudaGraphRunner(model, pool_g, max_bs=16, max_pages=16, prev_ids=prev)
    runner.page_table.fill_(5)  # stale entries past each row's length must not matter
    # Inputs not known on the host (-1) are read from the previous step's ids on the device.
    prev[: batch] = torch.tensor(next_ids[::-1], device="cuda")
    host_ids = [-1 if b % 2 else t for b, t in enumerate(next_ids)]
    src = [batch - 1 - b for b in range(batch)]
    got = runner.replay(host_ids, positions, tables_g, src, sink_slots=sinks)
    assert got.dtype == torch.float32 and got.shape == (batch, cfg.vocab_size)
    assert prev[:batch].tolist() == got.argmax(dim=-1).tolist()  # the graph's greedy ids, for a greedy window
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for layer in range(cfg.num_hidden_layers):
        torch.testing.assert_close(pool_g.k[layer][1:].float(), pool_e.k[layer][1:].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(pool_g.v[layer][1:].float(), pool_e.v[layer][1:].float(), atol=1e-6, rtol=0)
    # Second step: every request decodes one more token, each row's table grew at most a page.
    with torch.inference_mode():
        want2 = model.compute_logits(model(ForwardBatch.build(
            [[t] for t in next_ids], [p + 1 for p in positions], tables, list(range(batch)), page, "cuda", sinks),
            pool_e))
    got2 = runner.replay(next_ids, [p + 1 for p in positions], tables_g, keys=list(range(batch)), sink_slots=sinks)
    torch.testing.assert_close(got2, want2, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="captured sizes"):
        runner.replay([0] * 17, [0] * 17, [[1]] * 17)
    with pytest.raises(ValueError, match="does not reach"):
        runner.replay([0], [page], [[1]])


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3+sink"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_extend_replay_matches_eager(tiny_hf_model: Callable, kv: str) -> None:
    """One request extends T tokens over a cached prefix through the extend graphs (padded
    to the bucket): the last token's hidden state and the K/V written equal the eager
    pass, for prefixes mid-page and page-aligned, T from 2 to the largest bucket, the
    same runner reused across requests; the dummy page absorbs the padding's writes; each
    request's device page-table row holds its pages after its replay. ``fp8_e4m3+sink``:
    FP8 pages with an exact sink, claimed by the eager prefix passes
    (the graphs only read sink slots; a pass that claims one runs eagerly)."""
    page = 4
    model = load_model(tiny_hf_model(max_position_embeddings=128)[0], torch.float32, "cuda", "triton")
    cfg = model.config
    cases = [(0, 5), (13, 16), (37, 20), (8, 2), (60, 32), (3, 17)]  # (prefix, T)
    quant: tuple = ()
    if kv == "fp8_e4m3+sink":
        cases = cases[1:]  # prefix 0 would claim its slot in the graph's pass
        layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        quant = ("fp8_e4m3", torch.full((layers, kv_heads), 0.02), torch.full((layers, kv_heads), 0.03))
    r = random.Random(3)
    prompts = [r.choices(range(256), k=p + t) for p, t in cases]

    def fresh() -> tuple[KVPool, list[list[int]]]:
        pool = KVPool(160, page, cfg.num_hidden_layers, cfg.num_key_value_heads, 16, torch.float32, "cuda",
                      *quant, sink_slots=8 if quant else 0)  # fmt: skip
        for layer in range(cfg.num_hidden_layers):
            pool.k[layer].zero_()
            pool.v[layer].zero_()
        alloc, tables = PageAllocator(160), []
        for (prefix, t), ids in zip(cases, prompts, strict=True):
            tables.append(alloc.alloc(-(-(prefix + t) // page)))
            alloc.alloc(1)  # non-contiguous tables
            if prefix:  # the cached prefix, computed eagerly
                with torch.inference_mode():
                    model(ForwardBatch.build([ids[:prefix]], [0], [tables[-1]], [0], page, "cuda",
                                             *_claim_sinks(pool, [ids[:prefix]])), pool)  # fmt: skip
        return pool, tables

    def sink_of(pool: KVPool, ids: list[int]) -> int:
        return pool.sink_lookup(ids[0]) if pool.has_sink else -1

    pool_e, tables = fresh()
    want = []
    for (prefix, t), ids, table in zip(cases, prompts, tables, strict=True):
        with torch.inference_mode():
            sinks = [sink_of(pool_e, ids)] if pool_e.has_sink else None
            want.append(model(ForwardBatch.build([ids[prefix:]], [prefix], [table], [t - 1], page, "cuda", sinks),
                              pool_e))  # fmt: skip
    pool_g, tables_g = fresh()
    runner = CudaGraphRunner(model, pool_g, max_bs=2, max_pages=32, prev_ids=torch.zeros(2, dtype=torch.int64,
                             device="cuda"), max_extend_tokens=32)  # fmt: skip
    assert runner.extend_sizes == [16, 32]
    for k, ((prefix, _t), ids, table) in enumerate(zip(cases, prompts, tables_g, strict=True)):
        got = runner.replay_extend(ids[prefix:], prefix, table, key=k, sink_slot=sink_of(pool_g, ids))
        torch.testing.assert_close(got, want[k], atol=2e-5, rtol=2e-5)
        row = runner.tables._row_of[k]  # the graph wrote the request's row, for its decode steps
        assert runner.req_pages[row, : len(table)].tolist() == table
    for layer in range(cfg.num_hidden_layers):
        torch.testing.assert_close(pool_g.k[layer][1:].float(), pool_e.k[layer][1:].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(pool_g.v[layer][1:].float(), pool_e.v[layer][1:].float(), atol=1e-6, rtol=0)
    if pool_g.has_sink:  # the eager prefix passes wrote the same slots in both pools
        assert pool_g.sink_tokens == pool_e.sink_tokens > 0
        torch.testing.assert_close(pool_g.sink_k, pool_e.sink_k, atol=0, rtol=0)
    with pytest.raises(ValueError, match="captured extend lengths"):
        runner.replay_extend([0] * 33, 0, list(range(1, 10)))
    with pytest.raises(ValueError, match="does not reach"):
        runner.replay_extend([0] * 5, 0, [1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_server_loop_on_cuda_returns_the_tokens_of_reading_each_step(tiny_hf_model: Callable,
                                                                               monkeypatch) -> None:
    """The scheduler's overlapped loop on CUDA (decode graphs, extend graphs, the sampled ids
    copied into two pinned host buffers used in turn) returns, request by request, the
    tokens of the loop that reads each step before planning the next. Requests arrive at
    different steps and stop at different lengths, so the batch grows and shrinks while a
    step is in flight. Multi-step windows of 4 (``replay_next``, the window's ids read back
    in one copy) return them too, with and without overlap."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from radixlm.runtime import messages as m
    from radixlm.runtime.executor.model_runner import ModelRunner
    from radixlm.runtime.scheduler.scheduler import Scheduler
    from radixlm.runtime.server_args import ServerArgs

    model_dir = tiny_hf_model(max_position_embeddings=128, bos_token_id=1, eos_token_id=2)[0]
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w2").save_pretrained(model_dir)  # the runner loads one
    runner = ModelRunner(ServerArgs(model_path=model_dir, device="cuda", dtype="float32", max_total_tokens=2048,
                                    max_running_requests=8, cuda_graph_max_extend_tokens=32,
                                    num_scheduler_steps=4))  # fmt: skip
    assert runner.graph_runner is not None and runner.graph_runner.max_window == 4
    rng = random.Random(5)
    prompts = [rng.choices(range(3, 256), k=rng.randint(2, 40)) for _ in range(7)]
    launches: list[int] = []
    launch = runner.launch
    monkeypatch.setattr(runner, "launch", lambda decision: launches.append(decision.decode_steps) or launch(decision))

    def run(overlap: bool, steps: int = 1) -> dict[str, list[int]]:
        s = Scheduler(ServerArgs(model_path="unused", disable_overlap_schedule=not overlap, debug_invariants=True,
                                 max_running_requests=8, num_scheduler_steps=steps), runner)  # fmt: skip
        tokens: dict[str, list[int]] = {}
        for step in range(200):
            if step < 2 * len(prompts) and step % 2 == 0:  # a new request every other step
                k = step // 2
                s.handle(m.GenerateReq(rid=f"r{k}", input_ids=prompts[k], stream=True, sampling=m.SamplingParams(
                    max_new_tokens=3 + 4 * k, temperature=0.0, ignore_eos=True)))  # fmt: skip
            s._safe_step()
            out = s.take_outputs()
            for rid, tok in zip(out.token_rids if out else [], out.token_ids if out else [], strict=True):
                tokens.setdefault(rid, []).append(tok)
            for o in out.outputs if out else []:
                assert o.error is None
                tokens.setdefault(o.rid, []).extend(o.new_token_ids)
            if step > 2 * len(prompts) and not s.has_work:
                break
        assert s.violations == [] and not s.has_work
        return tokens

    with_overlap, without = run(True), run(False)
    assert {rid: len(t) for rid, t in without.items()} == {f"r{k}": 3 + 4 * k for k in range(len(prompts))}
    assert with_overlap == without
    assert set(launches) == {1}
    for overlap in (True, False):
        launches.clear()
        assert run(overlap, steps=4) == without
        assert launches.count(4) >= 3, launches
