"""kernels/decode_attention.py (Triton split-KV decode) against kernels/reference.py.

Tiny shapes, fp32 (run by the interpreter without CUDA): shuffled non-contiguous pages,
lengths that are not multiples of the page size, GQA ratios 1/3/4/8, batches mixing
1-token and long requests, 1 split (direct path) and several (merge path, with splits
that end up empty), outputs and scratch poisoned with NaN so unwritten elements show.

Dimension letters: B requests, H query heads, K kv heads, D head dim, S page size,
N splits per request.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import (  # noqa: E402
    FP8_DECODE_CONFIG,
    FP8_LARGE_BATCH,
    FP8_LARGE_BATCH_DECODE_CONFIG,
    TIERED_DECODE_CONFIG,
    DecodeConfig,
    DecodeWorkspace,
    decode_attention,
    decode_num_splits,
    default_decode_config,
)

# Sequence lengths (prefix + the one new token): 1-token request, not multiples of 4/16,
# one long enough for several BLOCK_N tiles per split.
LENS = [1, 7, 38, 16, 75]
SMALL = DecodeConfig(block_n=16, num_warps=2, num_stages=1)
# (page size, H, K): every page size meets GQA ratios 1, 3, 4 or 8, and each ratio meets
# at least two page sizes (a subset of the full cross product keeps the interpreter fast).
PAGED_GQA = [
    (1, 4, 4), (1, 6, 2), (1, 8, 1),
    (4, 8, 2), (4, 6, 2),
    (16, 8, 1), (16, 4, 4), (16, 8, 2),
]  # fmt: skip


def _reference(case) -> torch.Tensor:
    return reference.paged_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.prefix, case.extend, case.scale
    )


def _run(case, num_splits: int, config: DecodeConfig = SMALL) -> torch.Tensor:
    batch, num_heads, head_dim = case.q.shape
    out = torch.full_like(case.q, float("nan"))
    work = DecodeWorkspace.allocate(batch, num_heads, num_splits, head_dim, case.q.device)
    work.partial_out.fill_(float("nan"))
    work.partial_lse.fill_(float("nan"))
    decode_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.seq_lens, case.scale,
        num_splits=num_splits, out=out, workspace=work, config=config,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(("page_size", "num_heads", "num_kv_heads"), PAGED_GQA)
def test_decode_matches_reference(paged_case, relerr, page_size, num_heads, num_kv_heads) -> None:
    case = paged_case([(n - 1, 1) for n in LENS], num_heads, num_kv_heads, 64, page_size)
    ref = _reference(case)
    for num_splits in (1, 3):
        out = _run(case, num_splits)
        assert not out.isnan().any(), f"unwritten or NaN output with {num_splits} splits"
        assert relerr(out, ref) < 1e-5, num_splits


@pytest.mark.parametrize("page_size", [4, 16])
def test_decode_head_dim_128(paged_case, relerr, page_size) -> None:
    case = paged_case([(n - 1, 1) for n in [1, 21, 50]], 8, 2, 128, page_size, seed=3)
    out = _run(case, 2, DecodeConfig(block_n=32, num_warps=4, num_stages=1))
    assert not out.isnan().any()
    assert relerr(out, _reference(case)) < 1e-5


def test_decode_more_splits_than_tiles(paged_case, relerr) -> None:
    """8 splits over sequences of 1..40 keys: most splits are empty and must weigh 0."""
    case = paged_case([(0, 1), (39, 1), (12, 1)], 4, 2, 64, 4, seed=5)
    out = _run(case, 8)
    assert relerr(out, _reference(case)) < 1e-5


def test_decode_default_launch_and_strided_q(paged_case, relerr) -> None:
    """Defaults (config, splits, out, workspace) and q as a strided view of a qkv tensor."""
    case = paged_case([(n - 1, 1) for n in LENS], 6, 2, 64, 4, seed=7)
    qkv = torch.cat([case.q, torch.zeros_like(case.q)], dim=1)  # [B, 2H, D]
    q = qkv[:, : case.q.shape[1]]
    out = decode_attention(q, case.k_pool, case.v_pool, case.page_table, case.seq_lens, case.scale)
    assert relerr(out, _reference(case)) < 1e-5


@pytest.mark.parametrize("split_pools", [False, True])
def test_decode_pages_ahead(paged_case, relerr, split_pools) -> None:
    """Page-table entries loaded one tile ahead (``pages_ahead``, the FP8 default): same
    result as the reference, with K and V pools of equal strides (one offset vector) and
    of different strides (V a slice of a wider tensor: its own offsets)."""
    case = paged_case([(n - 1, 1) for n in LENS], 8, 2, 32, 4, seed=5)
    v_pool = case.v_pool
    if split_pools:
        wide = torch.full((*v_pool.shape[:3], 2 * v_pool.shape[3]), float("nan"), device=v_pool.device)
        wide[..., : v_pool.shape[3]] = v_pool
        v_pool = wide[..., : v_pool.shape[3]]
        assert v_pool.stride() != case.k_pool.stride()
    config = DecodeConfig(block_n=16, num_warps=1, num_stages=3, pages_ahead=True)
    for num_splits in (1, 3):
        out = decode_attention(case.q, case.k_pool, v_pool, case.page_table, case.seq_lens, case.scale,
                               num_splits=num_splits, config=config)  # fmt: skip
        assert relerr(out, _reference(case)) < 1e-5, num_splits


def test_default_decode_config_by_pool_and_batch() -> None:
    """bf16 pools: ``DecodeConfig()``; FP8: 64-key tiles on 2 warps below FP8_LARGE_BATCH
    requests, 64-key tiles on 1 warp from it (both with page-table entries ahead); tiered
    pools their own. The batch size alone decides (a CUDA graph bucket and the eager path
    agree)."""
    assert default_decode_config(torch.bfloat16, batch=128) == DecodeConfig()
    assert default_decode_config(torch.float8_e4m3fn, batch=FP8_LARGE_BATCH - 1) == FP8_DECODE_CONFIG
    assert default_decode_config(torch.float8_e4m3fn, batch=FP8_LARGE_BATCH) == FP8_LARGE_BATCH_DECODE_CONFIG
    assert default_decode_config(torch.float8_e4m3fn, tiered=True, batch=64) == TIERED_DECODE_CONFIG
    assert FP8_DECODE_CONFIG.pages_ahead and FP8_LARGE_BATCH_DECODE_CONFIG.pages_ahead
    assert (FP8_DECODE_CONFIG.block_n, FP8_DECODE_CONFIG.num_warps, FP8_DECODE_CONFIG.num_stages) == (64, 2, 3)
    assert (FP8_LARGE_BATCH_DECODE_CONFIG.block_n, FP8_LARGE_BATCH_DECODE_CONFIG.num_warps) == (64, 1)


def test_num_splits_heuristic() -> None:
    cfg = DecodeConfig(programs_per_sm=4, min_split_keys=128)  # 132 SMs, as on an H200
    assert decode_num_splits(1, 8, 2048, 132, cfg) == 16  # capped by 2048 / 128 keys
    assert decode_num_splits(1, 8, 32768, 132, cfg) == 66  # one wave of 4 x 132 programs
    assert decode_num_splits(32, 8, 8192, 132, cfg) == 2  # 512 programs, not 768
    assert decode_num_splits(8, 8, 32768, 132, cfg) == 8
    assert decode_num_splits(128, 8, 8192, 132, cfg) == 1  # the batch fills the GPU
    assert decode_num_splits(4, 8, 10, 132, cfg) == 1


def test_decode_rejects_mismatched_dtypes(paged_case) -> None:
    case = paged_case([(3, 1)], 4, 2, 64, 4)
    with pytest.raises(AssertionError):
        decode_attention(
            case.q.half(), case.k_pool, case.v_pool, case.page_table, case.seq_lens, 1.0
        )


def test_decode_fp16(paged_case, relerr) -> None:
    """Half precision (bf16 runs on the GPU only: the interpreter's bf16 dot is wrong)."""
    case = paged_case([(n - 1, 1) for n in LENS], 8, 2, 64, 16, torch.float16, seed=9)
    k_pool, v_pool = case.k_pool.float(), case.v_pool.float()
    ref = reference.paged_attention(
        case.q.float(), k_pool, v_pool, case.page_table, case.prefix, case.extend, case.scale
    )
    out = _run(case, 2)
    assert out.dtype == torch.float16
    assert relerr(out, ref) < 2e-3
