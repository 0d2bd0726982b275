"""Piecewise CUDA graphs (runtime/executor/piecewise_cuda_graph.py): the pieces, run one after the
other with the eager attention between them, equal the fused model's forward pass over a
mixed batch (prefill, cached-prefix chunk, decode rows), padding rows write only the dummy
page; on CUDA the captured graphs too. On the CPU under the Triton interpreter (conftest)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")

from radixlm.runtime.executor.forward_batch import ForwardBatch  # noqa: E402
from radixlm.runtime.executor.model_loader import load_model  # noqa: E402
from radixlm.runtime.executor.piecewise_cuda_graph import PiecewiseGraphs, piecewise_sizes  # noqa: E402
from radixlm.runtime.memory.kv_pool import KVPool  # noqa: E402
from radixlm.runtime.memory.page_allocator import PageAllocator  # noqa: E402

from .conftest import DEVICE  # noqa: E402

PAGE = 4


def test_piecewise_sizes() -> None:
    assert piecewise_sizes(0) == []
    assert piecewise_sizes(16) == [16]
    assert piecewise_sizes(40) == [16, 32, 40]
    assert piecewise_sizes(300) == [*range(16, 257, 16), 300]
    assert piecewise_sizes(1024) == [*range(16, 257, 16), 320, 384, 448, 512, 640, 768, 896, 1024]
    assert piecewise_sizes(1500) == [*range(16, 257, 16), 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1500]
    for bad in (-1, 1, 15):
        with pytest.raises(ValueError, match="max_tokens"):
            piecewise_sizes(bad)


def _pool(cfg, kv: str = "auto") -> KVPool:
    pool = KVPool(48, PAGE, cfg.num_hidden_layers, cfg.num_key_value_heads, 16, torch.float32, DEVICE, kv,
                  *((torch.full((cfg.num_hidden_layers, cfg.num_key_value_heads), 0.02),) * 2
                    if kv == "fp8_e4m3" else (None, None)))  # fmt: skip
    for layer in range(cfg.num_hidden_layers):  # pools start uninitialised
        pool.k[layer].zero_()
        pool.v[layer].zero_()
    return pool


@pytest.mark.parametrize(("logits_all", "decodes_first"), [
    (False, False), pytest.param(True, False, marks=pytest.mark.slow), pytest.param(False, True, marks=pytest.mark.slow)])
def test_pieces_equal_the_fused_forward_on_a_mixed_batch(tiny_hf_model: Callable, logits_all: bool,
                                                         decodes_first: bool) -> None:
    """``decodes_first``: the planner's order (running requests first), whose decode rows the
    attention splits off to the decode kernel in a replayed pass."""
    model = load_model(tiny_hf_model(max_position_embeddings=64)[0], torch.float32, DEVICE, "triton")
    cfg = model.config
    r = random.Random(5)
    # (cached prefix, new tokens): a prompt, a chunk over a cached prefix, two decode rows
    cases = [(0, 7), (9, 3), (13, 1), (5, 1)]
    if decodes_first:
        cases = cases[2:] + cases[:2]
    prompts = [r.choices(range(256), k=p + t) for p, t in cases]

    def fresh() -> tuple[KVPool, ForwardBatch]:
        pool, alloc, tables = _pool(cfg), PageAllocator(48), []
        for (prefix, t), ids in zip(cases, prompts, strict=True):
            tables.append(alloc.alloc(-(-(prefix + t) // PAGE)))
            alloc.alloc(1)  # non-contiguous tables
            if prefix:
                with torch.inference_mode():
                    model(ForwardBatch.build([ids[:prefix]], [0], [tables[-1]], [0], PAGE, DEVICE), pool)
        total = sum(t for _, t in cases)
        ends = [sum(t for _, t in cases[: i + 1]) - 1 for i in range(len(cases))]  # each request's last token
        rows = list(range(total)) if logits_all else ends
        batch = ForwardBatch.build([ids[p:] for (p, _), ids in zip(cases, prompts, strict=True)],
                                   [p for p, _ in cases], tables, rows, PAGE, DEVICE)  # fmt: skip
        batch.logits_all = logits_all
        return pool, batch

    pool_e, batch_e = fresh()
    with torch.inference_mode():
        want = model(batch_e, pool_e)
    pool_g, batch_g = fresh()
    pieces = PiecewiseGraphs(model, pool_g, max_tokens=16, capture=DEVICE == "cuda")
    pieces.qkv.fill_(float("nan"))  # rows past the step must never be read by its attention
    got = pieces.forward(batch_g)
    assert (model.attn_backend._mixed is not None) == decodes_first
    assert got.shape == want.shape == ((12 if logits_all else 4), cfg.hidden_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for layer in range(cfg.num_hidden_layers):  # the same K / V on every real page
        torch.testing.assert_close(pool_g.k[layer][1:], pool_e.k[layer][1:], atol=1e-6, rtol=0)
        torch.testing.assert_close(pool_g.v[layer][1:], pool_e.v[layer][1:], atol=1e-6, rtol=0)
    # a second, smaller step through the same buffers: stale rows of the first stay harmless
    pool_e2, batch_e2 = fresh()
    i = cases.index((13, 1))
    small = ForwardBatch.build([prompts[i][13:]], [13], [batch_e2.page_table[i].tolist()], [0], PAGE, DEVICE)
    with torch.inference_mode():
        want2 = model(small, pool_e2)
    torch.testing.assert_close(pieces.forward(small), want2, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="17 tokens"):
        pieces.forward(ForwardBatch.build([[1] * 17], [0], [list(range(1, 6))], [0],
                                          PAGE, DEVICE))  # fmt: skip


def test_pieces_refuse_pools_they_cannot_store_into(tiny_hf_model: Callable) -> None:
    model = load_model(tiny_hf_model()[0], torch.float32, DEVICE, "triton")
    with pytest.raises(ValueError, match="float KV pool"):
        PiecewiseGraphs(model, _pool(model.config, "fp8_e4m3"), max_tokens=16, capture=False)
    torch_model = load_model(tiny_hf_model()[0], torch.float32, DEVICE, "torch")
    with pytest.raises(ValueError, match="fused"):
        PiecewiseGraphs(torch_model, _pool(torch_model.config), max_tokens=16, capture=False)
