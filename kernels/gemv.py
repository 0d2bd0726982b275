"""Triton skinny GEMM ("GEMV") for decode at tiny batch: out = x @ w.T for a few rows of x.

What: the linear layers of a decode step at batch 1-4 read every weight once and do two
FLOPs per weight element per row, so they are bound by the weight read (PERFORMANCE.md's
bandwidth floor). Inside the 8B decode graph on an H200, cuBLAS reaches 91-92% of the
copy bandwidth on the MLP weights but 71-77% on the attention projections (qkv 4096 ->
6144, o_proj 4096 -> 4096), and splits K on o_proj and down (an extra reduce kernel
each). This kernel beats it at batch 1 on all four (``GemvConfig.for_k``); at batch 2 it
wins on three and loses on gate_up, at batch 4 it loses on all (each row of x re-reads
its tile from L2), so the model uses it for single-row inputs only
(runtime/models/llama.py).

Dimension letters: M rows of x (1..4), N output features, K input features.

Layout::

    x    [M, K]  fp16/bf16, last dim contiguous
    w    [N, K]  same dtype (nn.Linear's weight), last dim contiguous
    out  [M, N]  x's dtype

Algorithm: grid (M, N / BLOCK_N). A program owns BLOCK_N output features of one row of x,
streams its [BLOCK_N, K] weight rows in [BLOCK_N, BLOCK_K] tiles (coalesced along K),
multiplies by the matching x chunk in fp32 and accumulates elementwise, then reduces
once over the BLOCK_K lanes at the end. The M programs of one weight tile are adjacent in
launch order, so rows 2..M read it from L2.

Limits: K a multiple of BLOCK_K (asserted on the host); N any (masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["GemvConfig", "gemv"]


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: output features per program, weight columns per tile, warps,
    software-pipelining stages of the tile loop."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4

    @classmethod
    def for_k(cls, k: int) -> GemvConfig:
        """The default config with ``block_k`` the largest of 512, 256, ..., 16 dividing K.

        H200, bf16, batch 1 (bench/bench_gemv.py; GPU time, L2 cleared): 8 x 512 tiles, 4
        warps, 4 stages take 17.2 / 13.6 / 58.9 / 31.2 us on the 8B qkv / o_proj / gate_up
        / down weights vs cuBLAS's 18.2 / 16.3 / 60.8 / 33.8 us (the best of 24 configs per
        shape is within 1 us of it)."""
        block_k = next((b for b in (512, 256, 128, 64, 32, 16) if k % b == 0), None)
        if block_k is None:
            raise ValueError(f"gemv: K={k} is not a multiple of 16")
        return cls(block_k=block_k)


@triton.jit
def _gemv_kernel(
    X, W, Out, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [Nb]
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)  # [Kb]
    w_ptr = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    x_ptr = X + m * stride_xm + cols
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptr + k0).to(tl.float32)
        w = tl.load(w_ptr + k0, mask=row_mask[:, None], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1)
    tl.store(Out + m * stride_om + rows, out.to(Out.dtype.element_ty), mask=row_mask)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] (x's dtype), fp32 accumulation.

    Raises:
        ValueError: K not a multiple of ``config.block_k`` (default ``GemvConfig.for_k``:
            of 16), mismatched shapes or dtypes, or a last dim that is not contiguous.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: x [M, K] and w [N, K] expected, got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.dtype != w.dtype or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv: x and w need one dtype and a contiguous last dim")
    m, k = x.shape
    n = w.shape[0]
    config = config or GemvConfig.for_k(k)
    if k % config.block_k:
        raise ValueError(f"gemv: K={k} is not a multiple of block_k={config.block_k}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (m, triton.cdiv(n, config.block_n))
    _gemv_kernel[grid](
        x, w, out, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )  # fmt: skip
    return out
