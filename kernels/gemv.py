"""Triton skinny GEMM ("GEMV") for decode at tiny batch: out = x @ w.T for a few rows of x.

What: the linear layers of a decode step at batch 1-4 read every weight once and do two
FLOPs per weight element per row, so they are bound by the weight read (PERFORMANCE.md's
bandwidth floor). Inside the 8B decode graph on an H200, cuBLAS reaches 91-92% of the
copy bandwidth on the MLP weights but 71-77% on the attention projections (qkv 4096 ->
6144, o_proj 4096 -> 4096), and splits K on o_proj and down (an extra reduce kernel
each). This kernel beats it at batch 1 on all four (``GemvConfig.for_k``); at batch 2 it
wins on three and loses on gate_up, at batch 4 it loses on all (each row of x re-reads
its tile from L2), so the model uses it for single-row inputs only
(runtime/executor/models/llama.py).

Fused variants (one launch where the model ran two or three at batch 1; each small kernel
costs 1-3 us of a ~4 ms 8B step, bench/kernels/decode_step.py):
  * ``rmsnorm_gemv``: the (add +) RMSNorm before qkv / gate_up in the GEMV's input path;
  * ``RopeStore``: the QKV GEMV of a decode token also applies RoPE to its q / k heads and
    writes k / v into a float KV pool (a program owns matching rotate-half rows of one head);
  * ``silu_mul_gemv``: SwiGLU's activation in the down GEMV's input path.
H200, Llama-3-8B shape, bf16, batch-1 decode: 369 -> 207 kernels a step, the decode graph's
device time 3.880 ms = 1.126x the weight-read floor
(BENCHMARKS.md "Batch-1 decode vs the weight-read floor").

Dimension letters: M rows of x (1..4), N output features, K input features.

Layout::

    x    [M, K]  fp16/bf16, last dim contiguous
    w    [N, K]  same dtype (nn.Linear's weight), last dim contiguous
    out  [M, N]  x's dtype

Algorithm: grid (M, N / BLOCK_N). A program owns BLOCK_N output features of one row of x
(two groups of BLOCK_N / 2 rows), streams their weight rows in [BLOCK_N / 2, BLOCK_K] tiles
(coalesced along K),
multiplies by the matching x chunk in fp32 and accumulates elementwise, then reduces
once over the BLOCK_K lanes at the end. The M programs of one weight tile are adjacent in
launch order, so rows 2..M read it from L2.

Limits: K a multiple of BLOCK_K, BLOCK_N a power of two >= 2 (checked on the host); N any (masked).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["GemvConfig", "RopeStore", "gemv", "rmsnorm_gemv", "silu_mul_gemv"]


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: output features per program (a power of two >= 2), weight columns per tile,
    warps, software-pipelining stages of the tile loop."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4

    @classmethod
    def for_k(cls, k: int, base: GemvConfig | None = None) -> GemvConfig:
        """``base`` (default: the default config) with ``block_k`` the largest of its own,
        its half, ..., 16 that divides K.

        H200, bf16, batch 1 (bench/kernels/bench_gemv.py; GPU time, L2 cleared): 8 x 512
        tiles, 4 warps, 4 stages take 17.2 / 13.6 / 58.9 / 31.2 us on the 8B qkv / o_proj /
        gate_up / down weights vs cuBLAS's 18.2 / 16.3 / 60.8 / 33.8 us (the best of 24
        configs per shape is within 1 us of it)."""
        base = base or cls()
        block_k = next((b for b in (512, 256, 128, 64, 32, 16) if b <= base.block_k and k % b == 0), None)
        if block_k is None:
            raise ValueError(f"gemv: K={k} is not a multiple of 16")
        return replace(base, block_k=block_k)


PROLOGUE_CONFIGS: dict[str, GemvConfig] = {
    "none": GemvConfig(),
    "rmsnorm": GemvConfig(block_n=32, block_k=256),
    "silu_mul": GemvConfig(block_n=16),
}
"""Default config per prologue (before ``for_k`` fits block_k to K). With RMSNorm fused in,
each program also reads x, the residual and the norm weight, so fewer, wider programs win.
H200, Llama-3-8B shape, bf16, batch-1 decode graph (bench/kernels/decode_step.py --gemv-sweep,
device ms per step): RMSNorm tiles 8 x 512 4.057, 16 x 512 3.952, 16 x 256 3.896, 32 x 256
3.878; SiLU tiles (norm at 16 x 256) 8 x 512 3.896, 16 x 512 3.886, 32 x 256 3.929."""


@triton.jit
def _x_tile(
    X, R, NormW, ResOut, m, j, k0, K, stride_xm, stride_rm, stride_rom, sum_sq,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Columns k0 .. k0 + BLOCK_K of row m of the GEMV's input, float32, after the prologue;
    also returns sum_sq [BLOCK_K] updated (RMSNorm's statistics)."""
    dtype = X.dtype.element_ty
    cols = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(X + m * stride_xm + cols).to(tl.float32)
    if PROLOGUE == 1:
        if HAS_RESIDUAL:
            x = (x + tl.load(R + m * stride_rm + cols).to(tl.float32)).to(dtype).to(tl.float32)
            if j == 0:
                tl.store(ResOut + m * stride_rom + cols, x.to(dtype))
        sum_sq += x * x
        x = x * tl.load(NormW + cols).to(tl.float32)
    if PROLOGUE == 2:
        up = tl.load(X + m * stride_xm + K + cols).to(tl.float32)
        x = ((x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
    return x, sum_sq


@triton.jit
def _gemv_kernel(
    X, R, NormW, ResOut, W, Out, N, K, stride_xm, stride_rm, stride_rom, stride_wn, stride_om, eps,
    Pos, InvFreq, Slots, KPool, VPool, stride_kp, stride_ks, stride_kk, page_size, num_q_heads, num_kv_heads,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROPE_STORE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Program (m, j) computes BLOCK_N outputs of row m as two groups of HB = BLOCK_N / 2
    rows, ``a`` and ``b``: rows j * BLOCK_N + [0, HB) and + [HB, BLOCK_N); with ROPE_STORE,
    dims i0 + [0, HB) and HALF + i0 + [0, HB) of one head (rotate-half pairs).

    PROLOGUE 0: x as given; 1: x = RMSNorm(X (+ R)), the row's statistics gathered in the
    same pass and rstd applied to the sums at the end (program j = 0 also writes X + R to
    ResOut); 2: x = silu(X[:, :K]) * X[:, K:].
    ROPE_STORE (QKV projection of one decode token): the output is rounded, q and k heads
    get RoPE at Pos[m] (as fused_ops.rotary_embedding_), and k / v heads are also written to
    KPool / VPool at flat slot Slots[m] (as store_kv into a float pool)."""
    HB: tl.constexpr = BLOCK_N // 2
    HALF: tl.constexpr = HEAD_DIM // 2
    m = tl.program_id(0)
    j = tl.program_id(1)
    if ROPE_STORE:
        head = j // (HALF // HB)
        start_a = head * HEAD_DIM + (j % (HALF // HB)) * HB
        start_b = start_a + HALF
    else:
        start_a = j * BLOCK_N
        start_b = start_a + HB
    rows_a = start_a + tl.arange(0, HB)  # [HB]
    rows_b = start_b + tl.arange(0, HB)
    mask_a, mask_b = rows_a < N, rows_b < N
    cols = tl.arange(0, BLOCK_K)  # [Kb]
    wa_ptr = W + rows_a[:, None].to(tl.int64) * stride_wn + cols[None, :]
    wb_ptr = W + rows_b[:, None].to(tl.int64) * stride_wn + cols[None, :]
    dtype = Out.dtype.element_ty
    acc_a = tl.zeros([HB, BLOCK_K], dtype=tl.float32)
    acc_b = tl.zeros([HB, BLOCK_K], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x, sum_sq = _x_tile(X, R, NormW, ResOut, m, j, k0, K, stride_xm, stride_rm, stride_rom, sum_sq,
                            PROLOGUE, HAS_RESIDUAL, BLOCK_K)  # fmt: skip
        wa = tl.load(wa_ptr + k0, mask=mask_a[:, None], other=0.0)
        wb = tl.load(wb_ptr + k0, mask=mask_b[:, None], other=0.0)
        acc_a += wa.to(tl.float32) * x[None, :]
        acc_b += wb.to(tl.float32) * x[None, :]
    out_a = tl.sum(acc_a, 1)
    out_b = tl.sum(acc_b, 1)
    if PROLOGUE == 1:
        rstd = tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)
        out_a, out_b = out_a * rstd, out_b * rstd
    if ROPE_STORE:
        out_a = out_a.to(dtype).to(tl.float32)  # the projection's output, rounded
        out_b = out_b.to(dtype).to(tl.float32)
        if head < num_q_heads + num_kv_heads:  # q or k head: rotate (each product rounded)
            angle = tl.load(Pos + m).to(tl.float32) * tl.load(InvFreq + (j % (HALF // HB)) * HB + tl.arange(0, HB))
            cos = tl.cos(angle).to(dtype).to(tl.float32)
            sin = tl.sin(angle).to(dtype).to(tl.float32)
            rot_a = (out_a * cos).to(dtype).to(tl.float32) + (-out_b * sin).to(dtype).to(tl.float32)
            rot_b = (out_b * cos).to(dtype).to(tl.float32) + (out_a * sin).to(dtype).to(tl.float32)
            out_a, out_b = rot_a, rot_b
        if head >= num_q_heads:  # k or v head: into the pool
            slot = tl.load(Slots + m)
            kv = head - num_q_heads
            pool = KPool
            if kv >= num_kv_heads:
                kv -= num_kv_heads
                pool = VPool
            dims = (j % (HALF // HB)) * HB + tl.arange(0, HB)
            base = pool + (slot // page_size) * stride_kp + (slot % page_size) * stride_ks + kv * stride_kk
            tl.store(base + dims, out_a.to(dtype))
            tl.store(base + HALF + dims, out_b.to(dtype))
    tl.store(Out + m * stride_om + rows_a, out_a.to(dtype), mask=mask_a)
    tl.store(Out + m * stride_om + rows_b, out_b.to(dtype), mask=mask_b)


def _check(x: torch.Tensor, w: torch.Tensor, k: int, config: GemvConfig | None, prologue: str = "none"
           ) -> GemvConfig:  # fmt: skip
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"gemv: x [M, K] and w [N, K] expected, got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.dtype != w.dtype or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv: x and w need one dtype and a contiguous last dim")
    config = config or GemvConfig.for_k(k, PROLOGUE_CONFIGS[prologue])
    if k % config.block_k:
        raise ValueError(f"gemv: K={k} is not a multiple of block_k={config.block_k}")
    return config


class RopeStore(NamedTuple):
    """The epilogue of a decode token's QKV projection (``rmsnorm_gemv(..., rope_store=)``):
    RoPE on its q and k heads, then k and v into a float KV pool.

    positions [M] int64; inv_freq [D/2] float32; slots [M] int64 flat pool slots;
    k_pool / v_pool [P, S, K, D] in the projection's dtype, one layout, each (S, K, D) block
    contiguous; num_q_heads H. The projection's N must be (H + 2K) * D."""

    positions: torch.Tensor
    inv_freq: torch.Tensor
    slots: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    num_q_heads: int


def _launch(
    x: torch.Tensor, w: torch.Tensor, k: int, config: GemvConfig, prologue: int,
    r: torch.Tensor | None = None, norm_w: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
    eps: float = 0.0, out: torch.Tensor | None = None, rope: RopeStore | None = None,
) -> torch.Tensor:  # fmt: skip
    m, n = x.shape[0], w.shape[0]
    if config.block_n < 2 or config.block_n & (config.block_n - 1):
        raise ValueError(f"gemv: block_n={config.block_n} must be a power of two >= 2")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r_, nw, ro = (r if r is not None else x), (norm_w if norm_w is not None else x), (res_out if res_out is not None else x)
    if rope is None:
        rope_args, head_dim = (x, x, x, x, x, 0, 0, 0, 1, 0, 0), 2
    else:
        head_dim, kv_heads = rope.k_pool.shape[3], rope.k_pool.shape[2]
        rope_args = (rope.positions, rope.inv_freq, rope.slots, rope.k_pool, rope.v_pool, rope.k_pool.stride(0),
                     rope.k_pool.stride(1), rope.k_pool.stride(2), rope.k_pool.shape[1], rope.num_q_heads, kv_heads)  # fmt: skip
    _gemv_kernel[(m, triton.cdiv(n, config.block_n))](
        x, r_, nw, ro, w, out, n, k, x.stride(0), r_.stride(0), ro.stride(0), w.stride(0), out.stride(0), eps,
        *rope_args, PROLOGUE=prologue, HAS_RESIDUAL=r is not None, ROPE_STORE=rope is not None, HEAD_DIM=head_dim,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages, num_warps=config.num_warps,
    )  # fmt: skip
    return out


def _check_rope(rope: RopeStore, x: torch.Tensor, n: int, block_n: int) -> None:
    kp, vp = rope.k_pool, rope.v_pool
    if kp.dim() != 4 or kp.shape != vp.shape or kp.stride() != vp.stride() or not kp.dtype == vp.dtype == x.dtype:
        raise ValueError("rope_store: k_pool / v_pool [P, S, K, D] of one layout in the projection's dtype expected")
    if kp.stride(3) != 1 or kp.stride(2) != kp.shape[3] or kp.stride(1) != kp.shape[2] * kp.shape[3]:
        raise ValueError("rope_store: each page's (S, K, D) block must be contiguous")
    head_dim, kv_heads = kp.shape[3], kp.shape[2]
    if n != (rope.num_q_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"rope_store: N={n} is not (H + 2K) * D = ({rope.num_q_heads} + 2 * {kv_heads}) * {head_dim}")
    if (head_dim // 2) % (block_n // 2):
        raise ValueError(f"rope_store: block_n / 2 = {block_n // 2} must divide half the head dim ({head_dim // 2})")
    m = x.shape[0]
    if rope.positions.shape != (m,) or rope.slots.shape != (m,) or rope.inv_freq.shape != (head_dim // 2,):
        raise ValueError("rope_store: positions / slots [M], inv_freq [D/2] expected")
    if rope.inv_freq.dtype != torch.float32 or rope.slots.dtype != torch.int64:
        raise ValueError("rope_store: inv_freq float32 and slots int64 expected")
    if any(not t.is_contiguous() or t.device != x.device for t in (rope.positions, rope.inv_freq, rope.slots)):
        raise ValueError("rope_store: positions, inv_freq and slots must be contiguous, on x's device")


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
    config = _check(x, w, x.shape[1] if x.dim() == 2 else -1, config)
    return _launch(x, w, x.shape[1], config, 0, out=out)


def rmsnorm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
    config: GemvConfig | None = None, rope_store: RopeStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """RMSNorm (Zhang & Sennrich 2019) of ``s = x + residual`` (or of x) fused into the
    GEMV that consumes it: ``(rmsnorm(s) @ w.T, s)``; replaces ``fused_add_rmsnorm`` + ``gemv``
    (one launch, not two) at batch 1.

    x, residual [M, K], norm_weight [K], w [N, K], one dtype -> out [M, N], s [M, K] (a
    new tensor; ``x`` itself when residual is None). Numerics: the sum is rounded to the
    dtype (as ``x + residual``); each program gathers sum(s^2) over its own pass along K
    and multiplies its fp32 dot products by rsqrt(mean + eps) at the end, so the normed
    activations are not rounded to the dtype as the unfused path rounds them (a bf16
    difference of a few ulps in the output).

    ``rope_store``: the projection is a decode token's QKV ([q | k | v] heads); its q and
    k heads leave rotated (``fused_ops.rotary_embedding_``'s rounding) and k / v are also
    written to the pool (``store_kv``), replacing those two launches too.

    Raises:
        ValueError: as ``gemv``; residual or norm_weight of another shape or dtype; a
            ``rope_store`` that does not fit (see ``RopeStore``).
    """
    explicit = config
    config = _check(x, w, x.shape[1] if x.dim() == 2 else -1, config, "rmsnorm")
    k = x.shape[1]
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
        raise ValueError(f"rmsnorm_gemv: norm_weight [{k}] contiguous in {x.dtype} expected")
    if rope_store is not None:
        half_groups = rope_store.k_pool.shape[-1] // 2
        while explicit is None and config.block_n > 2 and half_groups % (config.block_n // 2):
            config = replace(config, block_n=config.block_n // 2)  # row groups within half a head
        _check_rope(rope_store, x, w.shape[0], config.block_n)
    if residual is None:
        return _launch(x, w, k, config, 1, norm_w=norm_weight, eps=eps, rope=rope_store), x
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError("rmsnorm_gemv: residual must match x (shape, dtype, contiguous last dim)")
    s = torch.empty_like(x)
    return _launch(x, w, k, config, 1, r=residual, norm_w=norm_weight, res_out=s, eps=eps, rope=rope_store), s


def silu_mul_gemv(gate_up: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """SwiGLU's down projection with the activation fused in: ``(silu(gate) * up) @ w.T``
    for gate_up [M, 2F] = [gate | up], w [N, F] -> [M, N]; replaces ``silu_and_mul`` +
    ``gemv`` at batch 1. The activation rounds as ``fused_ops.silu_and_mul`` does.

    Raises:
        ValueError: as ``gemv``, with K = F (half of gate_up's last dim).
    """
    k = gate_up.shape[1] // 2 if gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 else -1
    config = _check(gate_up, w, k, config, "silu_mul")
    return _launch(gate_up, w, k, config, 2)
