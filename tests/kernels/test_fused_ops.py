"""Fused add+RMSNorm, RoPE and SiLU-and-mul kernels vs the model's PyTorch code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.fused_ops import fused_add_rmsnorm, rmsnorm, rotary_embedding_, silu_and_mul
from radixlm.runtime.executor.models.llama import RMSNorm, RotaryEmbedding, apply_rope

from .conftest import DEVICE

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    # bf16: within two rounding steps (2^-7 relative each): float32 sums in another order, an
    # ulp of float32 cos, and the interpreter's own bf16 casts on the CPU.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a masked tail (not a power of two)
def test_rmsnorm_and_fused_add_match_torch(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * 0.5 + 1.0)
    norm = norm.to(dtype)
    x = torch.randn(5, 2 * hidden, device=DEVICE, dtype=dtype)[:, :hidden]  # strided rows
    res = torch.randn(5, hidden, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(rmsnorm(x, norm.weight, 1e-5), norm(x), **_tol(dtype))
        y, s = fused_add_rmsnorm(x, res, norm.weight, 1e-5)
        # The add rounds like PyTorch's: exactly on the GPU; the CPU interpreter's bf16 cast
        # truncates, one step (2^-7 relative) off.
        one_step = dict(atol=0, rtol=0) if DEVICE == "cuda" or dtype == torch.float32 else dict(atol=0, rtol=2**-7)
        torch.testing.assert_close(s, x + res, **one_step)
        torch.testing.assert_close(y, norm(x + res), **_tol(dtype))
    assert rmsnorm(x[:0], norm.weight, 1e-5).shape == (0, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (9, 3, 64)])
def test_rope_in_place_matches_apply_rope(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(1)
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    tokens = 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.tensor([0, 1, 5, 17, 100, 1000, 4095], device=DEVICE)
    cos, sin = rope(positions, dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rotary_embedding_(q, k, positions, rope._inv_freq)
    torch.testing.assert_close(q, want_q, **_tol(dtype))
    torch.testing.assert_close(k, want_k, **_tol(dtype))
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], v_before, atol=0, rtol=0)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    gate_up = torch.randn(3, 2 * 1100, device=DEVICE, dtype=dtype) * 3  # 1100: two blocks, masked
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
# 16: the matmul fallback; 34 / 17 heads: three q programs and two k programs per token
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (34, 17, 32)])
def test_rope_with_the_key_rotation_matches_apply_rope_then_the_matmuls(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """rotary_embedding_(..., rotation) = apply_rope then @ R / D (q) and @ R (k), the
    rotation fused into the RoPE launch for D >= 32; q . k per head is unchanged."""
    from radixlm.runtime.memory.kv_pool import key_rotation

    torch.manual_seed(3)
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    tokens = 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype) * 3
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    r = key_rotation(head_dim).to(DEVICE, dtype)
    rotation = ((r / head_dim).contiguous(), r)
    positions = torch.tensor([0, 3, 64, 700, 8191], device=DEVICE)
    cos, sin = rope(positions, dtype)
    roped_q, roped_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    want_q, want_k = roped_q @ rotation[0], roped_k @ rotation[1]
    rotary_embedding_(q, k, positions, rope._inv_freq, rotation)
    # Each element sums D terms that cancel, so it is compared against the tensor's scale:
    # bf16, within four roundings of the largest element (the interpreter's bf16 casts
    # truncate, so a RoPE'd input may be an ulp off apply_rope's before the D-term sums,
    # and torch's bf16 matmul sums in another order); a wrong rotation is off by O(1).
    for got, want in ((q, want_q), (k, want_k)):
        scale = float(want.abs().max())
        tol = 1e-6 if dtype == torch.float32 else 4 * 2**-8
        torch.testing.assert_close(got, want, atol=tol * scale, rtol=0)
    group = heads // kv_heads
    scores = torch.einsum("thd,shd->hts", q.float(), k.float().repeat_interleave(group, 1))
    plain = torch.einsum("thd,shd->hts", roped_q.float(), roped_k.float().repeat_interleave(group, 1))
    assert float((scores - plain).abs().max()) < (1e-3 if dtype == torch.float32 else 0.05) * float(plain.abs().max())


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (and ~11 GB of device memory)")
def test_token_offsets_past_2_31_elements() -> None:
    """A forward pass over many tokens: token index x row stride passes 2^31 elements (the
    8B shape's gate_up rows at 37,450 tokens, its qkv rows at 349,526), which an int32
    offset turned into an illegal address. The last tokens of such a pass must come out as
    the same kernels give them in a small pass."""
    from radixlm.kernels.store_kv import store_kv

    dtype, limit = torch.bfloat16, 2**31
    buf = torch.randn(limit + (1 << 20), device="cuda", dtype=dtype)  # ~4.3 GB, made in bf16 (no float32 copy)

    def big(cols: int) -> torch.Tensor:  # [rows, cols], rows * cols just past 2^31
        rows = limit // cols + 2
        return buf[: rows * cols].view(rows, cols)

    gate_up = big(2 * 14336)
    torch.testing.assert_close(silu_and_mul(gate_up)[-2:], silu_and_mul(gate_up[-2:].clone()), atol=0, rtol=0)

    x, w = big(4096), torch.randn(4096, device="cuda", dtype=dtype)
    torch.testing.assert_close(rmsnorm(x, w, 1e-5)[-2:], rmsnorm(x[-2:].clone(), w, 1e-5), atol=0, rtol=0)

    qkv = big(6144)  # 32 q heads, 8 k heads, 8 v heads of 128
    tail = qkv[-2:].clone()
    positions = torch.zeros(qkv.shape[0], dtype=torch.int64, device="cuda")
    positions[-2:] = torch.tensor([5, 4000])
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128))
    heads = qkv.view(-1, 48, 128)
    rotary_embedding_(heads[:, :32], heads[:, 32:40], positions, inv_freq)
    small = tail.view(2, 48, 128)
    rotary_embedding_(small[:, :32], small[:, 32:40], positions[-2:].clone(), inv_freq)
    torch.testing.assert_close(qkv[-2:], tail, atol=0, rtol=0)

    pools = [torch.zeros(2, 16, 8, 128, device="cuda", dtype=dtype) for _ in range(2)]
    slots = torch.zeros(qkv.shape[0], dtype=torch.int64, device="cuda")
    slots[-1] = 17  # the last token alone goes to page 1, slot 1
    store_kv(*pools, heads[:, 32:40], heads[:, 40:], slots)
    assert torch.equal(pools[0][1, 1], heads[-1, 32:40]) and torch.equal(pools[1][1, 1], heads[-1, 40:])
