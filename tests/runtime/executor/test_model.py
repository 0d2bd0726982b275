"""Our Llama/Qwen2 against transformers, and paged-KV reuse across chunks and decode steps.

Dimension letters: T tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
import torch

from radixlm.runtime.executor.attention import (
    ATTENTION_BACKENDS,
    TorchAttentionBackend,
    attention_backend_choices,
    create_attention_backend,
)
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.model_loader import load_model
from radixlm.runtime.executor.models import LlamaForCausalLM
from radixlm.runtime.memory.kv_pool import KVPool
from radixlm.runtime.memory.page_allocator import PageAllocator

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


class Session:
    """Drives a model like the scheduler would: pages on demand, one pool, many passes."""

    def __init__(
        self, model: LlamaForCausalLM, page_size: int, num_pages: int = 64, device: str = "cpu"
    ) -> None:
        cfg = model.config
        dtype = next(model.parameters()).dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.model, self.page_size, self.device = model, page_size, device
        self.pool = KVPool(
            num_pages, page_size, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
            dtype, device,
        )  # fmt: skip
        self.alloc = PageAllocator(num_pages)
        self.tables: dict[int, list[int]] = {}

    def step(self, chunks: dict[int, tuple[list[int], int]]) -> dict[int, torch.Tensor]:
        """chunks[req] = (new token ids, prefix_len) -> logits [len(new), V] per request."""
        tokens, prefix, tables = [], [], []
        for req, (ids, start) in chunks.items():
            table = self.tables.setdefault(req, [])
            short = -(-(start + len(ids)) // self.page_size) - len(table)
            table.extend(self.alloc.alloc(max(short, 0)))
            self.alloc.alloc(1)  # a stray page between requests: tables stay non-contiguous
            tokens.append(ids)
            prefix.append(start)
            tables.append(table)
        rows = list(range(sum(len(t) for t in tokens)))
        batch = ForwardBatch.build(tokens, prefix, tables, rows, self.page_size, self.device)
        writes = [(table, start, len(ids)) for table, start, ids in zip(tables, prefix, tokens, strict=True)]
        with torch.inference_mode():
            self.pool.begin_pass(writes)  # int4 / mixed pools: FP8 slots, then demotion
            hidden = self.model(batch, self.pool)
            self.pool.end_pass(writes)
            logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split([len(t) for t in tokens]), strict=True))


def full_logits(model: LlamaForCausalLM, ids: list[int], device: str = "cpu") -> torch.Tensor:
    """Logits [T, V] of every position of ``ids`` in one pass on a fresh pool."""
    return Session(model, page_size=4, device=device).step({0: (ids, 0)})[0]


def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("llama", {"rope_parameters": LLAMA3_ROPE}),
        ("llama", {"tie_word_embeddings": True, "head_dim": 32}),
        (
            "llama",
            {"num_key_value_heads": 4, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
        ),
        ("qwen2", {}),
    ],
    ids=["default-rope", "llama3-rope", "tied-headdim32", "mha-linear-rope", "qwen2-bias"],
)
def test_matches_transformers_fp32(tiny_hf_model: Callable, arch: str, overrides: dict) -> None:
    model_dir, hf_model = tiny_hf_model(arch, **overrides)
    model = load_model(model_dir, torch.float32, "cpu", "torch")
    ids = random.Random(0).choices(range(256), k=48)  # positions well past 16 (llama3 case)
    diff = (full_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item()
    assert diff < 1e-4


def test_chunked_prefill_and_decode_reuse_paged_kv(tiny_hf_model: Callable) -> None:
    model = load_model(tiny_hf_model()[0], torch.float32, "cpu", "torch")
    ids = random.Random(1).choices(range(256), k=23)
    expected = full_logits(model, ids)
    session = Session(model, page_size=4)
    got = [session.step({0: (ids[0:10], 0)})[0], session.step({0: (ids[10:18], 10)})[0]]
    got += [session.step({0: ([ids[t]], t)})[0] for t in range(18, 23)]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch_of_two_requests(tiny_hf_model: Callable, page_size: int) -> None:
    model = load_model(tiny_hf_model()[0], torch.float32, "cpu", "torch")
    rng = random.Random(2)
    seqs = {0: rng.choices(range(256), k=23), 1: rng.choices(range(256), k=13)}
    session = Session(model, page_size)
    done = {0: 0, 1: 0}
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    plan = [{0: 10, 1: 9}, {0: 8, 1: 1}] + [{0: 1, 1: 1}] * 5  # A: 10+8+5, B: 9+1+3 (+2 idle)
    for step in plan:
        chunks = {r: (seqs[r][done[r] : done[r] + n], done[r]) for r, n in step.items()}
        chunks = {r: c for r, c in chunks.items() if c[0]}
        for r, logits in session.step(chunks).items():
            got[r].append(logits)
            done[r] += logits.shape[0]
    assert done == {0: 23, 1: 13}
    for r, ids in seqs.items():
        torch.testing.assert_close(torch.cat(got[r]), full_logits(model, ids), atol=1e-5, rtol=1e-5)


def test_forward_returns_only_logits_rows(tiny_hf_model: Callable) -> None:
    model = load_model(tiny_hf_model()[0], torch.float32, "cpu", "torch")
    pool = KVPool(8, 4, 2, 2, 16, torch.float32, "cpu")
    batch = ForwardBatch.build([[1, 2, 3], [4, 5]], [0, 0], [[1], [2]], [2, 4], 4, "cpu")
    with torch.inference_mode():
        hidden = model(batch, pool)
    assert hidden.shape == (2, 64)
    assert model.compute_logits(hidden).dtype == torch.float32
    out = torch.full((2, model.config.vocab_size), float("nan"))  # the decode graphs' shared buffer
    assert model.compute_logits(hidden, out=out) is out
    torch.testing.assert_close(out, model.compute_logits(hidden), atol=0, rtol=0)
    bf16 = load_model(tiny_hf_model()[0], torch.bfloat16, "cpu", "torch")  # bf16 GEMM, cast into the buffer
    h16 = hidden.to(torch.bfloat16)
    assert bf16.compute_logits(h16, out=out) is out
    torch.testing.assert_close(out, bf16.compute_logits(h16), atol=0, rtol=0)
    assert not batch.logits_all
    # A decode step samples every row in order: no gather, and the same rows as gathering them.
    step = ForwardBatch.build([[6], [7]], [3, 2], [[1], [2]], [0, 1], 4, "cpu")
    assert step.logits_all and not ForwardBatch.build([[6], [7]], [3, 2], [[1], [2]], [1, 0], 4, "cpu").logits_all
    with torch.inference_mode():
        hidden = model(step, pool)
        gathered = model(dataclasses.replace(step, logits_all=False), pool)
    torch.testing.assert_close(hidden, gathered, rtol=0, atol=0)


def test_attention_backend_registry() -> None:
    assert attention_backend_choices() == ("auto", *ATTENTION_BACKENDS)
    assert isinstance(create_attention_backend("auto", "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="choices: auto, torch"):
        create_attention_backend("flashinfer", "cpu")


def test_smollm2_matches_transformers(smollm2_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors and say why they matter."},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert 30 <= len(ids) <= 60
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model = load_model(smollm2_dir, torch.float32, "cpu", "auto")

    ref = hf_logits(hf_model, ids)
    diff = (full_logits(model, ids) - ref).abs().max() / ref.abs().max()
    assert diff < 1e-3

    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)
    expected = out[0, len(ids) :].tolist()
    session = Session(model, page_size=16)
    logits = session.step({0: (ids, 0)})[0]
    generated = [int(logits[-1].argmax())]
    while len(generated) < 16:
        step = session.step({0: ([generated[-1]], len(ids) + len(generated) - 1)})[0]
        generated.append(int(step[-1].argmax()))
    assert generated[: len(expected)] == expected


def test_rope_parameters_reads_old_and_new_config_styles() -> None:
    from types import SimpleNamespace

    from radixlm.runtime.executor.models.llama import rope_parameters

    new = SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})
    old = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1e4)
    bare = SimpleNamespace(rope_scaling=None)
    assert (
        rope_parameters(new)["rope_theta"] == 5e5 and rope_parameters(new)["rope_type"] == "llama3"
    )
    assert rope_parameters(old) == {
        "type": "linear",
        "factor": 2.0,
        "rope_theta": 1e4,
        "rope_type": "linear",
    }
    assert rope_parameters(bare) == {"rope_theta": 10000.0, "rope_type": "default"}


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])],
)
def test_kv_pool_pages_round_trip_through_host_memory(tiny_hf_model: Callable, device: str) -> None:
    """Swap: a request's pages read to host memory (pinned on CUDA, asynchronous copies)
    and written to other pages give the same logits when decoding continues from them."""
    model = load_model(tiny_hf_model()[0], torch.float32, device, "torch")
    ids = random.Random(3).choices(range(256), k=11)
    session = Session(model, page_size=4, device=device)
    session.step({0: (ids[:10], 0)})
    pool, old = session.pool, session.tables[0]
    host = pool.read_pages(old)  # [layers, 2, 3, 4, K, D]
    assert host.shape[:3] == (model.config.num_hidden_layers, 2, 3) and host.device.type == "cpu"
    assert host.is_pinned() == (device == "cuda")
    if device == "cuda":
        torch.cuda.synchronize()
    # page 2 holds tokens 8-9; its two unwritten slots are uninitialised memory (may be NaN)
    torch.testing.assert_close(host[1, 1, 2], pool.v[1][old[2]].cpu(), rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(host[:, :, 2, :2]).all()
    new = session.alloc.alloc(3)
    for layer in range(pool.num_layers):  # poison the new pages first
        pool.k[layer][new] = float("nan")
        pool.v[layer][new] = float("nan")
    pool.write_pages(new, host)
    session.tables[0] = new
    got = session.step({0: ([ids[10]], 10)})[0]
    torch.testing.assert_close(got, full_logits(model, ids, device)[10:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="host KV shape"):
        pool.write_pages(new[:2], host)
