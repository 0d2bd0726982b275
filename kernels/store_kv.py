"""Triton store-KV: write the new tokens' K and V into their page slots.

What: ``k_pool.view(-1, K, D)[out_slots] = k`` and the same for V, in one launch. A slot
can be any position inside a page (a partly filled last page, a decode token, a chunk of a
prefill that starts mid-page). Values are cast to the pool's dtype.

Dimension letters: T new tokens, K kv heads, D head dim, P pages, S page size.

Layout::

    k, v            [T, K, D]     any strides, last dim contiguous (views of the qkv output)
    k_pool, v_pool  [P, S, K, D]  K's last dim contiguous; V's too, or an FP8 V pool stored
                                  channel-major ([P, K, D, S] in memory,
                                  ``reference.channel_major``)
    out_slots       [T] int64     flat slot = page * S + offset
    token t  ->  k_pool[out_slots[t] // S, out_slots[t] % S, :, :]

Grid: one program per token; it moves the whole [K, D] tile of K and of V (K padded to a
power of two and masked).

FP8 pools (float8_e4m3fn, with per-kv-head float32 scales ``k_scale``/``v_scale`` [K] and
optional channel means ``k_mean``/``v_mean`` [K, D]): the kernel stores
``clamp((x - mean[k]) / scale[k], +-448)`` rounded to e4m3 (quantisation on the fly, same
rounding as ``reference.quantize_fp8``; why the means: ``radixlm.runtime.executor.kv_calibration``).

Limits: D a power of two (16..256); K <= 64.

Algorithm: the KV write of PagedAttention (Kwon et al., SOSP 2023): tokens go to slots of
fixed-size pages named by a page table, not to a contiguous per-request buffer.
Reference: ``radixlm.kernels.reference.store_kv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.reference import channel_major

__all__ = ["store_kv"]


@triton.jit
def _store_kv_kernel(
    K, V, KPool, VPool, Slots, KScale, VScale, KMean, VMean,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_ks, stride_kk, stride_vp, stride_vs, stride_vk, stride_vd,
    NUM_KV_HEADS: tl.constexpr, BLOCK_KH: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr, CENTER: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)  # t * stride passes 2^31 elements in big passes
    heads = tl.arange(0, BLOCK_KH)  # [Kp]
    dims = tl.arange(0, HEAD_DIM)  # [D]
    mask = (heads < NUM_KV_HEADS)[:, None]  # [Kp, 1]
    slot = tl.load(Slots + t)  # int64
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    k = tl.load(K + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANT:  # FP8: (x - mean) / scale, saturated to the e4m3 range
        k_scale = tl.load(KScale + heads, mask=heads < NUM_KV_HEADS, other=1.0)  # [Kp]
        v_scale = tl.load(VScale + heads, mask=heads < NUM_KV_HEADS, other=1.0)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if CENTER:  # [K, D] float32 channel means, contiguous
            means = heads[:, None] * HEAD_DIM + dims[None, :]
            k = k - tl.load(KMean + means, mask=mask, other=0.0)
            v = v - tl.load(VMean + means, mask=mask, other=0.0)
        k = tl.clamp(tl.math.div_rn(k, k_scale[:, None]), -448.0, 448.0)
        v = tl.clamp(tl.math.div_rn(v, v_scale[:, None]), -448.0, 448.0)
    k_dst = KPool + page * stride_kp + offset * stride_ks + heads[:, None] * stride_kk
    v_dst = VPool + page * stride_vp + offset * stride_vs + heads[:, None] * stride_vk
    tl.store(k_dst + dims[None, :], k.to(KPool.dtype.element_ty), mask=mask)
    tl.store(v_dst + dims[None, :] * stride_vd, v.to(VPool.dtype.element_ty), mask=mask)


def _check_pool(pool: torch.Tensor, name: str) -> None:
    assert pool.dim() == 4, f"{name} must be [P, S, K, D], got {tuple(pool.shape)}"
    assert pool.stride(-1) == 1 or (name == "v_pool" and channel_major(pool)), f"{name} last dim must be contiguous"
    assert pool.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn), pool.dtype


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` [T, K, D] into ``k_pool``/``v_pool`` [P, S, K, D] at ``out_slots``
    (flat slot ids, int64 [T]), in place, casting to the pool dtype.

    ``k_scale``/``v_scale``: [K] float32 per-kv-head scales, required for (and only for)
    float8_e4m3fn pools, which get ``clamp((x - mean) / scale, +-448)`` in e4m3;
    ``k_mean``/``v_mean``: [K, D] float32 contiguous channel means (both or neither; FP8
    pools only), zero when None.
    """
    quant = k_pool.dtype == torch.float8_e4m3fn
    assert quant == (k_scale is not None) == (v_scale is not None), (k_pool.dtype, k_scale is None)
    _check_pool(k_pool, "k_pool")
    _check_pool(v_pool, "v_pool")
    num_pages, page_size, num_kv_heads, head_dim = k_pool.shape
    assert v_pool.shape == k_pool.shape, (v_pool.shape, k_pool.shape)
    assert k.shape == v.shape and k.dim() == 3, (k.shape, v.shape)
    assert k.shape[1:] == (num_kv_heads, head_dim), (k.shape, k_pool.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v last dim must be contiguous"
    assert out_slots.shape == (k.shape[0],) and out_slots.dtype == torch.int64, (
        out_slots.shape,
        out_slots.dtype,
    )
    assert k.device == k_pool.device == out_slots.device, (k.device, k_pool.device)
    assert head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256, head_dim
    assert num_kv_heads <= 64, num_kv_heads
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if quant:
        assert k_scale.shape == v_scale.shape == (num_kv_heads,), (k_scale.shape, v_scale.shape)
        assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.device == k_pool.device
    center = k_mean is not None
    assert center == (v_mean is not None) and (quant or not center), "means go with FP8 scales"
    if center:
        for mean in (k_mean, v_mean):
            assert mean.shape == (num_kv_heads, head_dim) and mean.is_contiguous(), mean.shape
            assert mean.dtype == torch.float32 and mean.device == k_pool.device, mean.dtype
    _store_kv_kernel[(num_tokens,)](
        k, v, k_pool, v_pool, out_slots,
        k_scale if quant else out_slots, v_scale if quant else out_slots,
        k_mean if center else out_slots, v_mean if center else out_slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), v_pool.stride(3),
        NUM_KV_HEADS=num_kv_heads, BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, QUANT=quant, CENTER=center,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )  # fmt: skip
