"""Tensor parallel sharding without a process group: which heads, rows and columns a rank
holds (``TPShard``) and that loading a rank reads only its slice of the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from radixlm.runtime.executor.model_loader import _safetensors_files, load_model
from radixlm.runtime.executor.parallel import TPShard


def test_shard_arithmetic() -> None:
    # SmolLM2 at TP 3: 9 q heads, 3 kv heads -> 3 q heads and kv head r on rank r
    assert [TPShard(r, 3).q_heads(9) for r in range(3)] == [(0, 3), (3, 3), (6, 3)]
    assert [TPShard(r, 3).kv_heads(9, 3) for r in range(3)] == [(0, 1), (1, 1), (2, 1)]
    # fewer kv heads than ranks: replicated, each rank the kv head of its q heads
    assert [TPShard(r, 4).kv_heads(8, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [TPShard(r, 2).kv_heads(4, 2) for r in range(2)] == [(0, 1), (1, 1)]
    # vocabulary padded to ceil(V / P) rows per rank, the last rank holding fewer
    assert [TPShard(r, 3).vocab(10) for r in range(3)] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]
    with pytest.raises(ValueError, match="does not divide the attention heads"):
        TPShard(0, 2).q_heads(9)
    with pytest.raises(ValueError, match="neither a divisor nor a multiple"):
        TPShard(0, 4).kv_heads(12, 3)


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = f.get_tensor(name)
    return out


def test_smollm2_tp3_ranks_load_only_their_slices(smollm2_dir) -> None:
    """Each of 3 ranks reads about a third of SmolLM2's bytes (norms whole), and its
    tensors are exactly its rows / columns of the checkpoint's."""
    full = _checkpoint(smollm2_dir)
    total = sum(t.numel() * t.element_size() for t in full.values())
    norms = sum(t.numel() * t.element_size() for n, t in full.items() if "norm" in n)
    d = 64
    for rank in range(3):
        model = load_model(smollm2_dir, "float32", "cpu", "torch", tp=TPShard(rank, 3))
        read = model.load_stats["bytes_read"]
        assert read == (total - norms) // 3 + norms
        layer = model.model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
        assert tuple(attn.qkv_proj.weight.shape) == (5 * d, 576)  # 3 q heads + 1 k + 1 v
        assert tuple(attn.o_proj.weight.shape) == (576, 3 * d)
        assert tuple(mlp.gate_up_proj.weight.shape) == (2 * 512, 576)  # MLP 1536 / 3
        assert tuple(mlp.down_proj.weight.shape) == (576, 512)
        assert tuple(model.model.embed_tokens.weight.shape) == (16384, 576)  # tied LM head: the same
        prefix = "model.layers.0."
        q, k = attn.qkv_proj.weight[: 3 * d], attn.qkv_proj.weight[3 * d : 4 * d]
        assert torch.equal(q, full[prefix + "self_attn.q_proj.weight"][rank * 3 * d : (rank + 1) * 3 * d])
        assert torch.equal(k, full[prefix + "self_attn.k_proj.weight"][rank * d : (rank + 1) * d])
        assert torch.equal(attn.o_proj.weight, full[prefix + "self_attn.o_proj.weight"][:, rank * 3 * d : (rank + 1) * 3 * d])
        assert torch.equal(mlp.down_proj.weight, full[prefix + "mlp.down_proj.weight"][:, rank * 512 : (rank + 1) * 512])
        assert torch.equal(model.model.embed_tokens.weight,
                           full["model.embed_tokens.weight"][rank * 16384 : (rank + 1) * 16384])
        del model


def test_uneven_vocabulary_pads_the_last_rank(tiny_hf_model) -> None:
    """A vocabulary of 251 over 2 ranks: 126 rows each, the last one a zero row; 3 ranks
    do not divide the 4 heads."""
    model_dir, hf = tiny_hf_model("llama", vocab_size=251)
    with pytest.raises(ValueError, match="does not divide the attention heads"):
        load_model(model_dir, "float32", "cpu", "torch", tp=TPShard(0, 3))
    emb, head = hf.model.embed_tokens.weight, hf.lm_head.weight
    for rank, (start, rows) in enumerate([(0, 126), (126, 125)]):
        model = load_model(model_dir, "float32", "cpu", "torch", tp=TPShard(rank, 2))
        assert model.model.embed_tokens.weight.shape[0] == model.lm_head.weight.shape[0] == 126
        assert torch.equal(model.model.embed_tokens.weight[:rows], emb[start : start + rows])
        assert torch.equal(model.lm_head.weight[:rows], head[start : start + rows])
        assert not model.lm_head.weight[rows:].any()
