"""The Triton skinny GEMM (kernels/gemv.py) against ``x @ w.T`` on tiny shapes
(interpreter without CUDA), and its input errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels.gemv import GemvConfig, RopeStore, gemv, rmsnorm_gemv, silu_mul_gemv  # noqa: E402

from .conftest import DEVICE  # noqa: E402

HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # interpreter: bf16 truncates


@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 64), (3, 16, 128), (4, 70, 256)])
def test_gemv_matches_matmul(m, n, k) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).to(DEVICE, HALF)
    w = torch.randn(n, k, generator=gen).to(DEVICE, HALF)
    out = gemv(x, w, config=GemvConfig(block_n=16, block_k=32, num_warps=2, num_stages=1))
    ref = x.float() @ w.float().T
    assert out.shape == (m, n) and out.dtype == HALF
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 1e-2, err  # one rounding of the fp32 sum to the half dtype


def test_gemv_rejects_bad_inputs() -> None:
    x = torch.randn(1, 48, dtype=HALF, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of block_k"):
        gemv(x, torch.randn(8, 48, dtype=HALF, device=DEVICE), config=GemvConfig(block_k=32))
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        gemv(x, torch.randn(8, 64, dtype=HALF, device=DEVICE))
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x, torch.randn(8, 48, dtype=torch.float32, device=DEVICE), config=GemvConfig(block_k=16))


@pytest.mark.parametrize(("m", "with_residual"), [(1, True), (1, False), (3, True)])
def test_rmsnorm_gemv_matches_fused_add_rmsnorm_then_matmul(m, with_residual) -> None:
    from radixlm.kernels.fused_ops import fused_add_rmsnorm, rmsnorm

    gen = torch.Generator().manual_seed(m + 10 * with_residual)
    n, k, eps = 37, 128, 1e-5
    x = (3 * torch.randn(m, k, generator=gen)).to(DEVICE, HALF)  # rms ~3: rstd matters
    res = torch.randn(m, k, generator=gen).to(DEVICE, HALF) if with_residual else None
    norm_w = (1 + 0.3 * torch.randn(k, generator=gen)).to(DEVICE, HALF)
    w = torch.randn(n, k, generator=gen).to(DEVICE, HALF)
    config = GemvConfig(block_n=16, block_k=32, num_warps=2, num_stages=1)
    out, s = rmsnorm_gemv(x, res, norm_w, eps, w, config=config)
    if with_residual:
        h, s_want = fused_add_rmsnorm(x, res, norm_w, eps)
        assert torch.equal(s, s_want)  # the residual sum, rounded the same way
        assert s.data_ptr() not in (x.data_ptr(), res.data_ptr())
    else:
        h, s_want = rmsnorm(x, norm_w, eps), x
        assert s is x
    ref = h.float() @ w.float().T
    assert out.shape == (m, n) and out.dtype == HALF
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 1e-2, err  # the fused path skips one rounding of the normed row
    # Against a wrong statistic (no rstd) it would be far off: the check can fail.
    assert ((s_want.float() * norm_w.float()) @ w.float().T - ref).norm() / ref.norm() > 0.1


@pytest.mark.parametrize("m", [1, 2])
def test_silu_mul_gemv_matches_silu_and_mul_then_gemv(m) -> None:
    from radixlm.kernels.fused_ops import silu_and_mul

    gen = torch.Generator().manual_seed(m)
    n, f = 21, 96
    gate_up = torch.randn(m, 2 * f, generator=gen).to(DEVICE, HALF)
    w = torch.randn(n, f, generator=gen).to(DEVICE, HALF)
    config = GemvConfig(block_n=8, block_k=32, num_warps=2, num_stages=1)
    out = silu_mul_gemv(gate_up, w, config=config)
    want = gemv(silu_and_mul(gate_up), w, config=config)  # the same roundings, in two launches
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"w \[N, K\]"):
        silu_mul_gemv(gate_up, torch.randn(n, 2 * f, dtype=HALF, device=DEVICE), config=config)


def test_rmsnorm_gemv_rejects_bad_norm_inputs() -> None:
    x = torch.randn(1, 64, dtype=HALF, device=DEVICE)
    w = torch.randn(8, 64, dtype=HALF, device=DEVICE)
    with pytest.raises(ValueError, match="norm_weight"):
        rmsnorm_gemv(x, None, torch.ones(32, dtype=HALF, device=DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match="residual must match"):
        rmsnorm_gemv(x, torch.randn(2, 64, dtype=HALF, device=DEVICE), torch.ones(64, dtype=HALF, device=DEVICE),
                     1e-5, w)  # fmt: skip


@pytest.mark.parametrize(("block_n", "slot"), [(16, 13), (8, 2), (32, 30)])
def test_rope_store_epilogue_equals_rope_and_store_after_the_projection(block_n, slot) -> None:
    """QKV projection of one decode token with RoPE and the KV-pool write fused in: the
    rotated q / k and plain v it returns, and what lands in the pools, equal the projection
    followed by fused_ops.rotary_embedding_ and store_kv (same roundings, so exactly);
    every other pool slot is left as it was."""
    from radixlm.kernels.fused_ops import rotary_embedding_
    from radixlm.kernels.reference import store_kv

    gen = torch.Generator().manual_seed(block_n)
    heads, kv_heads, head_dim, hidden, page = 4, 2, 32, 64, 4
    n = (heads + 2 * kv_heads) * head_dim
    x = (3 * torch.randn(1, hidden, generator=gen)).to(DEVICE, HALF)
    res = torch.randn(1, hidden, generator=gen).to(DEVICE, HALF)
    norm_w = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(DEVICE, HALF)
    w = (0.2 * torch.randn(n, hidden, generator=gen)).to(DEVICE, HALF)
    positions = torch.tensor([37], device=DEVICE)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)).float().to(DEVICE)
    slots = torch.tensor([slot], device=DEVICE)
    pools = [torch.randn(9, page, kv_heads, head_dim, generator=gen).to(DEVICE, HALF) for _ in range(2)]
    pools += [p.clone() for p in pools]
    config = GemvConfig(block_n=block_n, block_k=32, num_warps=2, num_stages=1)

    rope = RopeStore(positions, inv_freq, slots, pools[0], pools[1], heads)
    got, s_got = rmsnorm_gemv(x, res, norm_w, 1e-5, w, config=config, rope_store=rope)
    want, s_want = rmsnorm_gemv(x, res, norm_w, 1e-5, w, config=config)
    q, k, v = want.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(1, -1, head_dim) for t in (q, k, v))
    rotary_embedding_(q, k, positions, inv_freq)
    store_kv(pools[2], pools[3], k, v, slots)
    assert torch.equal(s_got, s_want)
    # v (no rotation) is the same projection: equal everywhere. q / k: the interpreter runs
    # the same float32 ops in both paths, so equal; compiled into two different kernels
    # for a GPU, a rotated value may come out one bf16 step apart (seen on the H200: 6 of
    # 256 values, 0.0068 apart), so there the bound is one step of the largest.
    qk = (heads + kv_heads) * head_dim
    assert torch.equal(got[:, qk:], want[:, qk:]) and torch.equal(pools[1], pools[3])
    step = 0 if DEVICE == "cpu" else 2**-7 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=step)
    torch.testing.assert_close(pools[0], pools[2], rtol=0, atol=step)
    page_of, in_page = divmod(slot, page)
    assert torch.equal(pools[1][page_of, in_page].reshape(-1), v.reshape(-1))  # the slot was written
    assert not torch.equal(want[0, :head_dim], rmsnorm_gemv(x, res, norm_w, 1e-5, w, config=config)[0][0, :head_dim])


def test_rope_store_rejects_what_does_not_fit() -> None:
    x = torch.randn(1, 64, dtype=HALF, device=DEVICE)
    norm_w = torch.ones(64, dtype=HALF, device=DEVICE)
    pool = torch.zeros(3, 4, 2, 32, dtype=HALF, device=DEVICE)
    args = (torch.tensor([1], device=DEVICE), torch.ones(16, device=DEVICE), torch.tensor([1], device=DEVICE))
    with pytest.raises(ValueError, match=r"\(H \+ 2K\) \* D"):
        rmsnorm_gemv(x, None, norm_w, 1e-5, torch.randn(100, 64, dtype=HALF, device=DEVICE),
                     rope_store=RopeStore(*args, pool, pool.clone(), 4))  # fmt: skip
    with pytest.raises(ValueError, match="one layout"):
        rmsnorm_gemv(x, None, norm_w, 1e-5, torch.randn(256, 64, dtype=HALF, device=DEVICE),
                     rope_store=RopeStore(*args, pool, pool.float(), 4))  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        rmsnorm_gemv(x, None, norm_w, 1e-5, torch.randn(256, 64, dtype=HALF, device=DEVICE),
                     config=GemvConfig(block_n=6, block_k=64))  # fmt: skip
    with pytest.raises(ValueError, match="contiguous, on x's device"):  # two rows, strided positions
        positions = torch.tensor([1, 0, 2, 0], device=DEVICE)[::2]
        rmsnorm_gemv(torch.randn(2, 64, dtype=HALF, device=DEVICE), None, norm_w, 1e-5,
                     torch.randn(256, 64, dtype=HALF, device=DEVICE),
                     rope_store=RopeStore(positions, args[1], torch.tensor([1, 2], device=DEVICE), pool, pool.clone(), 4))  # fmt: skip
    with pytest.raises(ValueError, match="must divide half the head dim"):
        rmsnorm_gemv(x, None, norm_w, 1e-5, torch.randn(256, 64, dtype=HALF, device=DEVICE),
                     config=GemvConfig(block_n=64, block_k=64), rope_store=RopeStore(*args, pool, pool.clone(), 4))  # fmt: skip
