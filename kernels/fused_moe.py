"""Fused sparse-MoE MLP in Triton: token-to-expert sort, grouped GEMM over experts, combine.

Computes what ``reference.fused_moe`` computes: for each token t and each of its k experts
e, ``w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, summed over j. The design is vLLM's
``fused_moe`` (after MegaBlocks, Gale et al., "MegaBlocks: Efficient Sparse Training with
Mixture-of-Experts", 2023): no per-expert Python loop, no padding of experts to a capacity.

Dimension letters: T tokens, k experts per token, X experts, E hidden size, F expert
intermediate size, M = T * k (token, slot) pairs, BM / BN / BK the GEMM tiles.

1. Align (``moe_align_block_size``, PyTorch ops, no host sync, CUDA-graph safe): sort the M
   pair ids (t * k + j) by expert, and pad each expert's run to a multiple of BM with the
   sentinel M, so every BM block of the sorted list belongs to one expert::

       sorted ids:  | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e3 -- -- -- |   (-- = M)
       block expert:      0             2             2             3        (e1: no block)

   The list has room for the worst case, M + X * (BM - 1) entries; blocks past
   ``num_post_padded`` (the real padded length, a device scalar) exit at once.
2. Grouped GEMM (``_moe_gemm_kernel``), one program per (BM block, BN block): gathers the BM
   rows of A its pair ids name (row id // k of x for the first GEMM, the pair's own row of
   the intermediate for the second), multiplies by its expert's [N, K] weight, optionally
   scales each row by its routing weight, and scatters the rows to C[pair id].
   GEMM 1: x [T, E] @ w13[e]^T -> [M, 2F]; SiLU-and-mul -> [M, F];
   GEMM 2: [M, F] @ w2[e]^T * w -> [M, E] in x's dtype.
3. Combine: the k rows of each token summed in float32 -> [T, E].

Shape limits: x [T, E] contiguous float16 / bfloat16 / float32; w13 [X, 2F, E], w2 [X, E, F]
with unit last stride; top-k ids int32 / int64 in [0, X). Features: ``tl.dot`` and masked
loads only (triton 3.6 has them all). Runs on CUDA, and on the CPU under
``TRITON_INTERPRET=1`` (tests).

Caveats: the tile sizes are fixed per M range (``default_moe_config``), not tuned per GPU as
vLLM's JSON tables are; the intermediate [M, 2F] is one allocation (no chunking of very long
prefills); no FP8 / INT4 expert weights; expert parallelism is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.kernels.launch import jit_unspecialised

__all__ = ["MoeConfig", "default_moe_config", "fused_moe", "moe_align_block_size"]


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """GEMM tiles and launch settings of ``_moe_gemm_kernel``."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_moe_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Tiles by the average rows per expert: small BM where experts see few rows (decode),
    larger where they see many (prefill)."""
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert <= 16:
        return MoeConfig(16, 64, 64, 4, 3)
    if rows_per_expert <= 64:
        return MoeConfig(32, 64, 64, 4, 3)
    return MoeConfig(64, 128, 64, 8, 3)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sort (token, slot) pairs by expert, each expert's run padded to a multiple of BM.

    Args:
        topk_ids: [T, k] expert ids.
        num_experts: X.
        block_m: BM.

    Returns:
        (sorted_ids [M + X * (BM - 1)] int32: pair ids t * k + j by expert, padding = M;
        block_expert [that length / BM rounded up] int32: the expert of each BM block (blocks
        past the end: X - 1, never read); num_post_padded [1] int32: the padded length used).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # [M]
    num_pairs = flat.numel()
    device = flat.device
    capacity = num_pairs + num_experts * (block_m - 1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [X] (bincount would sync the host)
    padded = (counts + block_m - 1) // block_m * block_m  # [X]
    ends = torch.cumsum(padded, 0)  # [X] end of each expert's padded run
    order = torch.sort(flat, stable=True).indices  # [M] pair ids by expert
    experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [X] rank of an expert's first pair
    rank = torch.arange(num_pairs, device=device) - first_of_expert[experts]
    dest = (ends - padded)[experts] + rank  # [M] position in the padded list
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)  # [blocks]
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


@jit_unspecialised("num_pairs")  # T * k varies per step: one binary per config
def _moe_gemm_kernel(
    A, B, C, RowWeight, SortedIds, BlockExpert, NumPostPadded,
    N, K, num_pairs, stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """C[p, n] = sum_k A[p // TOP_K, k] * B[e, n, k] (* RowWeight[p]) for the pairs p of one
    BM block of expert e (``moe_align_block_size``); A, B, C unit last stride."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= tl.load(NumPostPadded):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m).to(tl.int64)  # [BM]
    row_ok = pair < num_pairs
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + (pair // TOP_K)[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(RowWeight + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = C + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, row_weight: torch.Tensor | None,
              align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, config: MoeConfig) -> None:  # fmt: skip
    """One grouped GEMM: c [M, N] rows by pair from a [rows, K] and w [X, N, K]."""
    sorted_ids, block_expert, num_post = align
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel() * triton.cdiv(n, config.block_n),)
    _moe_gemm_kernel[grid](
        a, w, c, row_weight if row_weight is not None else c, sorted_ids, block_expert, num_post,
        n, k, c.shape[0], a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        TOP_K=top_k, MUL_WEIGHT=row_weight is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, E], w13 [X, 2F, E], w2 [X, E, F], topk_weights [T, k] float, topk_ids [T, k]
    -> [T, E] in x's dtype (``reference.fused_moe``'s contract and rounding)."""
    num_tokens, hidden = x.shape
    num_experts, two_f, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert x.is_contiguous() and x.dtype in (torch.float16, torch.bfloat16, torch.float32), (x.dtype, x.stride())
    assert w13.shape == (num_experts, two_f, hidden) and w2.shape == (num_experts, hidden, two_f // 2), (
        w13.shape, w2.shape)
    assert w13.dtype == x.dtype == w2.dtype and w13.stride(2) == 1 and w2.stride(2) == 1
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k), (topk_weights.shape, topk_ids.shape)
    num_pairs = num_tokens * top_k
    config = config or default_moe_config(num_pairs, num_experts)
    align = moe_align_block_size(topk_ids, num_experts, config.block_m)
    inter = torch.empty((num_pairs, two_f), dtype=x.dtype, device=x.device)  # [M, 2F]
    _moe_gemm(x, w13, inter, None, align, top_k, config)
    gate, up = inter.chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).contiguous()  # [M, F]
    out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)  # [M, E]
    _moe_gemm(act, w2, out, topk_weights.reshape(-1).contiguous(), align, 1, config)
    return out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
