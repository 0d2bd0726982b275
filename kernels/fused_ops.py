"""Triton fused elementwise kernels of the Llama layer: add + RMSNorm, RoPE, SiLU-and-mul.

Why: in a decode step each of these is a chain of small PyTorch kernels (RMSNorm alone is
seven), and at batch 1 an 8B model's step is ~1,180 kernels whose fixed cost (2-3 us each,
even replayed from a CUDA graph) rivals the weight streaming (bench/kernels/decode_step.py). One
launch per operation removes most of it (vLLM and SGLang fuse the same three).

Dimension letters: T tokens, E hidden size, H heads, D head dim, F MLP intermediate size.

Numerics follow the PyTorch / Hugging Face code they replace, rounding where it rounds:
  * RMSNorm: ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``, the residual add rounded
    to the input dtype first (``x = x + h``), statistics in float32.
  * RoPE (rotate-half, GPT-NeoX layout): cos / sin of ``position * inv_freq`` in float32,
    rounded to the input dtype, then ``x * cos + rotate_half(x) * sin`` with each product
    rounded (as the bf16 PyTorch ops do). The float32 cos may differ from PyTorch's in the
    last ulp, which the rounding to bf16 hides almost always.
  * SiLU-and-mul: ``silu(gate)`` in float32 rounded, times ``up``, rounded.

All run on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (tests). Inputs: last dim
contiguous; rows may be strided (views of a fused projection's output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_add_rmsnorm", "rmsnorm", "rotary_embedding_", "silu_and_mul"]


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Y, RES_OUT, stride_x, stride_r, stride_y, stride_ro, eps, n_cols,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2^31 elements in big passes
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # rounded like x + r
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * normed).to(Y.dtype.element_ty), mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    rows, cols = x.shape
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
        res_out = torch.empty_like(y)
    if rows:
        block = triton.next_power_of_2(cols)
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else y
        _rmsnorm_kernel[(rows,)](
            x, r, weight, y, ro, x.stride(0), r.stride(0), y.stride(0), ro.stride(0), eps, cols,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8),
        )  # fmt: skip
    return y, res_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): x [T, E] (fp16/bf16/fp32), weight [E] -> [T, E]."""
    return _norm(x, None, weight, eps)[0]


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` then ``(rmsnorm(s), s)``; x, residual [T, E] same dtype -> two new [T, E]."""
    y, s = _norm(x, residual, weight, eps)
    assert s is not None
    return y, s


@triton.jit
def _rope_heads(
    base, t, stride_t, stride_h, first, n, cos, sin, Rot,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, ROTATE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Rotate heads ``first .. first + BLOCK_H`` (those below ``n``) of token t in place;
    cos / sin [1, D/2] f32 (rounded). With ROTATE, the rounded result row x [D] is then
    replaced by ``x @ Rot`` (Rot [D, D] row-major in the heads' dtype; float32 products and
    sums, rounded once)."""
    dtype = base.dtype.element_ty
    heads = first + tl.arange(0, BLOCK_H)[:, None]  # [Hb, 1]
    half = tl.arange(0, HALF)[None, :]  # [1, D/2]
    mask = heads < n
    ptr = base + t * stride_t + heads * stride_h + half
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)  # first half   [Hb, D/2]
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)  # second half
    # rotate_half(x) = [-x2, x1]; each product rounded, then the sum.
    o1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    if ROTATE:  # [o1, o2] @ [[R11, R12], [R21, R22]], the blocks D/2 x D/2
        # float32 operands holding the rounded values. For 16-bit heads the dots run in tf32
        # on the tensor cores: a 16-bit value and R's +-1 (or +-1/D) entries are exact in
        # tf32, so the products are exact and only the float32 sums round. "ieee" (FMA) dots,
        # needed for float32 heads, took ~50 us per token program on the H200 (1.6 ms of a
        # Llama-3-8B bf16 decode step). The CPU interpreter gets bf16 dots wrong, hence
        # float32 operands.
        a1, a2 = o1.to(dtype).to(tl.float32), o2.to(dtype).to(tl.float32)
        rows = tl.arange(0, HALF)[:, None] * (2 * HALF)
        cols = tl.arange(0, HALF)[None, :]
        r11 = tl.load(Rot + rows + cols).to(tl.float32)
        r12 = tl.load(Rot + rows + HALF + cols).to(tl.float32)
        r21 = tl.load(Rot + HALF * 2 * HALF + rows + cols).to(tl.float32)
        r22 = tl.load(Rot + HALF * 2 * HALF + rows + HALF + cols).to(tl.float32)
        o1 = tl.dot(a2, r21, acc=tl.dot(a1, r11, input_precision=PRECISION), input_precision=PRECISION)
        o2 = tl.dot(a2, r22, acc=tl.dot(a1, r12, input_precision=PRECISION), input_precision=PRECISION)
    tl.store(ptr, o1.to(dtype), mask=mask)
    tl.store(ptr + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, Pos, InvFreq, RotQ, RotK, stride_qt, stride_qh, stride_kt, stride_kh, num_q_heads, num_k_heads,
    q_blocks, HALF: tl.constexpr, BLOCK_H: tl.constexpr, ROTATE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (t, j): token t's q heads j * BLOCK_H .. for j < q_blocks, else its k heads
    (j - q_blocks) * BLOCK_H .. (several programs per token: at batch 1 one SM would do all)."""
    t = tl.program_id(0).to(tl.int64)  # t * stride passes 2^31 elements in big passes
    j = tl.program_id(1)
    half = tl.arange(0, HALF)  # [D/2]
    angle = tl.load(Pos + t).to(tl.float32) * tl.load(InvFreq + half)  # [D/2] f32
    dtype = Q.dtype.element_ty
    cos = tl.cos(angle).to(dtype).to(tl.float32)[None, :]
    sin = tl.sin(angle).to(dtype).to(tl.float32)[None, :]
    if j < q_blocks:
        _rope_heads(Q, t, stride_qt, stride_qh, j * BLOCK_H, num_q_heads, cos, sin, RotQ, HALF, BLOCK_H, ROTATE,
                    PRECISION)  # fmt: skip
    else:
        _rope_heads(K, t, stride_kt, stride_kh, (j - q_blocks) * BLOCK_H, num_k_heads, cos, sin, RotK, HALF,
                    BLOCK_H, ROTATE, PRECISION)  # fmt: skip


MIN_DOT = 16  # tl.dot's smallest M / N / K on NVIDIA GPUs


def rotary_embedding_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:  # fmt: skip
    """Rotary position embedding (Su et al. 2021, RoFormer), rotate-half layout, in place.

    q [T, H, D], k [T, K, D] (same dtype, last dim contiguous, any token / head strides);
    positions [T] int64; inv_freq [D/2] float32 on the same device. D a power of two.
    ``rotation`` (R_q, R_k), each [D, D] contiguous in q's dtype: afterwards q = rope(q) @ R_q
    and k = rope(k) @ R_k, each rope'd row rounded to the dtype first (as ``apply_rope``
    followed by a matmul); the KV pool's key rotation (``KVPool.rotate_qk``). Fused into the
    same launch when D >= 32 (tl.dot's 16 x 16 minimum on half rows), a matmul after it
    otherwise.
    """
    assert q.dim() == 3 and k.dim() == 3 and q.stride(2) == 1 and k.stride(2) == 1
    assert q.dtype == k.dtype and q.shape[0] == k.shape[0] == positions.shape[0]
    head_dim = q.shape[2]
    assert k.shape[2] == head_dim and head_dim & (head_dim - 1) == 0, head_dim
    assert inv_freq.shape == (head_dim // 2,) and inv_freq.dtype == torch.float32
    fused = rotation is not None and head_dim // 2 >= MIN_DOT
    if rotation is not None:
        assert all(r.shape == (head_dim, head_dim) and r.dtype == q.dtype and r.is_contiguous() for r in rotation)
    tokens = q.shape[0]
    if tokens:
        rot_q, rot_k = rotation if fused else (q, k)  # unused pointers when not fused
        # Fused: blocks of 16 heads (a dot's M is at least 16 rows; masked), a program each;
        # else one block holds all q heads, another all k heads.
        block = MIN_DOT if fused else triton.next_power_of_2(max(q.shape[1], k.shape[1]))
        q_blocks = triton.cdiv(q.shape[1], block)
        _rope_kernel[(tokens, q_blocks + triton.cdiv(k.shape[1], block))](
            q, k, positions, inv_freq, rot_q, rot_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q.shape[1], k.shape[1], q_blocks, HALF=head_dim // 2, BLOCK_H=block, ROTATE=fused,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
        )  # fmt: skip
    if rotation is not None and not fused:
        q.copy_(q @ rotation[0])
        k.copy_(k @ rotation[1])


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    # int64: with the 8B shape's 2 x 14336 columns, row * stride passes 2^31 at 37,450 tokens
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` (Shazeer 2020) for gate_up [T, 2F] = [gate | up] -> [T, F]."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), cols, BLOCK=block, num_warps=4)
    return out
