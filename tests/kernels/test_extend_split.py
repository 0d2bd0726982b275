"""The split-KV path of kernels/extend_attention.py against kernels/reference.py.

Tiny fp32 shapes (interpreter without CUDA): each program holds BLOCK_M new tokens x the
G query heads of one kv head and one of N key splits; the partial outputs are merged by
their log-sum-exp. Covered: several prefix / extend lengths in one batch (short and long
extends mixed, zero prefixes, prefixes ending mid-page), splits that start inside the
causal diagonal (rows that see no key of their split), GQA ratios 1/3/4/8 (3 padded to 4),
page sizes 1/4/16, FP8 pages, fp16, the heuristic ``extend_num_splits`` and the runtime
backend taking the path, the start-up warm-up. Pools and outputs are NaN-poisoned.

Dimension letters: B requests, T new tokens, H query heads, K kv heads, D head dim,
S page size, N key splits.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import DecodeWorkspace  # noqa: E402
from radixlm.kernels.extend_attention import (  # noqa: E402
    HOPPER_SPLIT_CONFIG,
    ExtendSplitConfig,
    extend_attention,
    extend_num_splits,
    warm_up_split_path,
)

from .conftest import DEVICE  # noqa: E402

# 16 rows per program: 16 tokens x 1 head ... 2 tokens x 8 heads; 16-key tiles.
TINY = ExtendSplitConfig(block_rows=16, block_n=16, num_warps=2, num_stages=1)
# (prefix_len, extend_len): long prefixes with short extends, a prefix ending mid-page,
# a plain prefill, a one-token extend, a long extend over a short prefix.
MIXED = [(70, 5), (37, 19), (0, 9), (101, 1), (5, 40), (16, 16)]


def _run(case, num_splits: int | None, config: ExtendSplitConfig = TINY, **kwargs) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    extend_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.cu_extend, case.prefix_lens,
        case.scale, case.max_extend, out=out, num_splits=num_splits, split_config=config, **kwargs,
    )  # fmt: skip
    return out


def _reference(case, **scales) -> torch.Tensor:
    return reference.paged_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.prefix, case.extend, case.scale,
        **scales,
    )


@pytest.mark.parametrize(
    ("page_size", "num_heads", "num_kv_heads"),
    [(1, 4, 4), (4, 6, 2), pytest.param(16, 8, 2, marks=pytest.mark.slow), pytest.param(4, 8, 1, marks=pytest.mark.slow)],  # GQA 1, 3 (padded), 4, 8
)
@pytest.mark.parametrize("num_splits", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_split_matches_reference(paged_case, relerr, page_size, num_heads, num_kv_heads,
                                 num_splits) -> None:  # fmt: skip
    case = paged_case(MIXED, num_heads, num_kv_heads, 32, page_size, seed=page_size + num_heads)
    out = _run(case, num_splits)
    assert not out.isnan().any(), "unwritten output row, or a poisoned slot was read"
    assert relerr(out, _reference(case)) < 1e-5


def test_splits_inside_the_diagonal(paged_case, relerr) -> None:
    """Prefill of 40 tokens in 16-token blocks with 8 splits of 16 keys: most splits lie in
    the causal diagonal, where some rows see none of their split's keys (l = 0, lse -inf)."""
    case = paged_case([(0, 40), (3, 33)], 4, 4, 32, 4, seed=3)
    out = _run(case, 8)
    assert not out.isnan().any()
    assert relerr(out, _reference(case)) < 1e-5


def test_more_splits_than_key_tiles(paged_case, relerr) -> None:
    """N = 64 splits of at most 80 keys: most splits are empty (partial lse -inf, weight 0)
    and write no partial output; the scratch starts NaN, so a merge that read one shows."""
    case = paged_case([(70, 3), (2, 1)], 8, 2, 32, 16, seed=4)
    work = DecodeWorkspace.allocate(case.q.shape[0], 8, 64, 32, case.q.device)
    work.partial_out.fill_(float("nan"))
    out = _run(case, 64, workspace=work)
    assert not out.isnan().any()
    assert work.partial_out.isnan().any(), "every partial row was written: no empty split was tested"
    assert relerr(out, _reference(case)) < 1e-5


def test_split_head_dim_128_and_wider_program(paged_case, relerr) -> None:
    """D 128, 64-row programs (16 tokens x 4 heads), 32-key tiles, caller-owned scratch."""
    case = paged_case([(90, 20), (33, 7)], 8, 2, 128, 16, seed=5)
    config = ExtendSplitConfig(block_rows=64, block_n=32, num_warps=4, num_stages=1)
    work = DecodeWorkspace.allocate(case.q.shape[0], 8, 3, 128, case.q.device)
    out = _run(case, 3, config, workspace=work)
    assert relerr(out, _reference(case)) < 1e-5
    with pytest.raises(AssertionError):  # scratch sized for another split count
        _run(case, 4, config, workspace=work)


@pytest.mark.slow
def test_split_fp8_pages(paged_case, relerr) -> None:
    """FP8 (e4m3) pools with distinct per-kv-head scales, as the reference dequantises them."""
    case = paged_case(MIXED, 8, 2, 32, 4, seed=6)
    k_scale = torch.tensor([0.011, 0.017], device=DEVICE)
    v_scale = torch.tensor([0.013, 0.007], device=DEVICE)
    case.k_pool = reference.quantize_fp8(case.k_pool, k_scale)
    case.v_pool = reference.quantize_fp8(case.v_pool, v_scale)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    ref = _reference(case, **scales)
    for num_splits in (1, 3):
        out = _run(case, num_splits, **scales)
        assert not out.isnan().any(), num_splits
        assert relerr(out, ref) < 1e-5, num_splits


def test_split_fp16(paged_case, relerr) -> None:
    """Half precision q and pools (bf16 runs on the GPU only: the interpreter's bf16 dot is
    wrong); partials stay fp32."""
    case = paged_case([(60, 12), (9, 30)], 8, 2, 64, 4, torch.float16, seed=7)
    ref = reference.paged_attention(
        case.q.float(), case.k_pool.float(), case.v_pool.float(), case.page_table, case.prefix,
        case.extend, case.scale,
    )  # fmt: skip
    out = _run(case, 4)
    assert out.dtype == torch.float16
    assert relerr(out, ref) < 2e-3


def test_extend_num_splits() -> None:
    """The heuristic on the 8B shape (H 32, K 8) and 132 SMs, Hopper config (32 tokens x 4
    heads per program, one wave of 2 programs per SM = 264 programs)."""
    cfg = HOPPER_SPLIT_CONFIG

    def n(batch: int, extend: int, seq: int) -> int:
        return extend_num_splits(batch, 32, 8, extend, seq, 132, cfg)

    assert n(1, 128, 4096) == 8  # 4 query blocks x 8 kv heads = 32 programs -> 264 // 32
    assert n(1, 32, 1024 + 32) == 8  # 8 programs -> 33, capped at 1056 / 128 -> 9; 2^3
    assert n(1, 128, 16384 + 128) == 8
    assert n(8, 128, 4096 + 128) == 1  # 256 programs unsplit: already a wave
    assert n(2, 128, 4096 + 128) == 4
    assert n(1, 256, 4096 + 256) == 4
    assert n(1, 257, 4096 + 257) == 1  # longer than max_extend_len: the long-extend kernel
    assert extend_num_splits(1, 32, 8, 512, 4096 + 512, 132, replace(cfg, max_extend_len=512)) == 2
    assert n(1, 128, 255) == 1  # plain / short-prefix prefill
    assert n(1, 1, 100) == 1  # one split of >= 128 keys
    # 4 SMs x 2 = 8 programs: 4 kv heads x 1 block of 16 tokens -> 2; 1 kv head of 4
    # query heads (4 tokens x 4 heads per program) x 2 blocks -> 4
    assert extend_num_splits(1, 4, 4, 8, 1000, 4, TINY) == 2
    assert extend_num_splits(1, 4, 1, 8, 1000, 4, TINY) == 4


def test_default_takes_the_split_path(paged_case, relerr) -> None:
    """No num_splits: ``extend_num_splits`` on the host bounds (max_extend_len, Pmax * S)
    picks N > 1 for one short extend over a long prefix (4 SMs under the interpreter)."""
    case = paged_case([(300, 10)], 4, 1, 32, 16, seed=8)
    bound = case.page_table.shape[1] * 16
    # min(8 // 1 programs, 20 pages x 16 keys / 128 = 3) = 3, rounded down to a power of two
    assert extend_num_splits(1, 4, 1, 10, bound, case.q.device) == 2
    out = _run(case, None, ExtendSplitConfig())
    assert relerr(out, _reference(case)) < 1e-5


def test_warm_up_compiles_every_power_of_two() -> None:
    """Server start-up compile of the split path: one tiny extend per N in 2, 4, .. up to
    the batch-1 value of ``extend_num_splits`` (4 SMs x 2 under the interpreter, 1 kv head
    -> 8); the pool is only read."""
    pool = torch.randn(3, 4, 1, 32, device=DEVICE)
    before = pool.clone()
    most = extend_num_splits(1, 2, 1, 1, 4096, pool.device)  # 8 here; 32 on a 132-SM GPU
    assert most == 8 or DEVICE == "cuda"
    assert warm_up_split_path(pool, 2, torch.float32, 4096) == [1 << i for i in range(1, most.bit_length())]
    assert warm_up_split_path(pool, 2, torch.float32, 128) == []  # one split of 128 keys
    assert torch.equal(pool, before)
