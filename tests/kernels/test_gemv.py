"""The Triton skinny GEMM (kernels/gemv.py) against ``x @ w.T`` on tiny shapes
(interpreter without CUDA), and its input errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels.gemv import GemvConfig, gemv  # noqa: E402

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
