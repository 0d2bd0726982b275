"""FP8 (e4m3) KV pages: Triton store_kv / decode / extend against the reference ops with
the same per-kv-head scales, and the quantisation error against the float pools.

Tiny fp32 shapes (interpreter without CUDA). Pools keep NaN (fp8 NaN after quantising)
outside every sequence, so a kernel that reads an unwritten slot shows it.

Dimension letters: T tokens, H query heads, K kv heads, D head dim, P pages, S page size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import DecodeConfig, decode_attention  # noqa: E402
from radixlm.kernels.extend_attention import (  # noqa: E402
    ExtendConfig,
    ExtendSplitConfig,
    extend_attention,
)
from radixlm.kernels.store_kv import store_kv  # noqa: E402

from .conftest import DEVICE, make_paged_case, rel_error  # noqa: E402

FP8 = torch.float8_e4m3fn


def _scales(num_kv_heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct per-head scales (absmax 5..10 of randn data -> 448), so a wrong head shows."""
    gen = torch.Generator().manual_seed(seed)
    k = (torch.rand(num_kv_heads, generator=gen) + 1.0) * 5.0 / 448.0
    v = (torch.rand(num_kv_heads, generator=gen) + 1.0) * 5.0 / 448.0
    return k.to(DEVICE), v.to(DEVICE)


def _fp8_case(specs, num_heads, num_kv_heads, head_dim, page_size, seed=0):
    case = make_paged_case(specs, num_heads, num_kv_heads, head_dim, page_size, seed=seed)
    k_scale, v_scale = _scales(num_kv_heads, seed)
    k8 = reference.quantize_fp8(case.k_pool, k_scale)
    v8 = reference.quantize_fp8(case.v_pool, v_scale)
    return case, k8, v8, k_scale, v_scale


def test_quantize_fp8_round_trip_and_saturation() -> None:
    scale = torch.tensor([0.5, 2.0])
    x = torch.tensor([[[1.0, -3.0, 1000.0], [1.0, 0.3, -5000.0]]])  # [1, K=2, 3]
    q = reference.quantize_fp8(x, scale)
    assert q.dtype == FP8
    back = reference.dequantize_fp8(q, scale)
    # 1/0.5 = 2 and -3/0.5 = -6 are exact in e4m3; 1000/0.5 saturates at 448 -> 224.
    assert back[0, 0].tolist() == [1.0, -3.0, 224.0]
    # 0.3/2 = 0.15 -> nearest e4m3 0.15625 -> 0.3125; -5000/2 saturates -> -896.
    assert back[0, 1].tolist() == [1.0, 0.3125, -896.0]


def _assert_same_fp8(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise equal on CUDA. The Triton interpreter's float32 -> e4m3 conversion drops the
    carry when rounding up to the next power of two (126.6 -> 64 instead of 128; seen with
    triton 3.x on CPU), and its subnormals (below 2^-6) may round one step (2^-9) off, so
    there only those elements may differ, by exactly that."""
    same = out.view(torch.uint8) == ref.view(torch.uint8)
    if out.is_cuda:
        assert bool(same.all())
        return
    subnormal = (ref.float().abs() < 2**-6) & ((out.float() - ref.float()).abs() <= 2**-9)
    same |= subnormal
    got, want = out.float()[~same], ref.float()[~same]
    assert bool((got * 2 == want).all()) and bool((want.abs().log2() % 1 == 0).all()), (got, want)
    assert int((~same).sum()) < same.numel() // 20


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "page_size", "centred"),
    [(1, 64, 4, False), (3, 32, 16, False), (2, 128, 1, False), (3, 32, 4, True)],
)
def test_store_kv_fp8_matches_reference_bitwise(num_kv_heads, head_dim, page_size, centred) -> None:
    num_pages, num_tokens = 6, 9
    gen = torch.Generator().manual_seed(3)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pool = torch.full(shape, float("nan")).to(FP8).to(DEVICE)
    v_pool = k_pool.clone()
    slots = (
        torch.randperm((num_pages - 1) * page_size, generator=gen)[:num_tokens] + page_size
    ).to(DEVICE)
    qkv = torch.randn(len(slots), 3 * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]  # strided views
    k[0, 0, 0] = 1e6  # saturates
    k_scale, v_scale = _scales(num_kv_heads, 1)
    # Channel means (kv_calibration): stored = (x - mean) / scale; one channel with a large
    # offset, as some key channels carry.
    means = (None, None)
    if centred:
        means = tuple(torch.randn(num_kv_heads, head_dim, generator=gen).to(DEVICE) for _ in "kv")
        means[0][:, 3] += 40.0
        k[:, :, 3] += 40.0
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    reference.store_kv(k_ref, v_ref, k, v, slots, k_scale, v_scale, *means)
    store_kv(k_pool, v_pool, k, v, slots, k_scale, v_scale, *means)
    _assert_same_fp8(k_pool, k_ref)
    _assert_same_fp8(v_pool, v_ref)
    written = reference.dequantize_fp8(k_ref.view(-1, num_kv_heads, head_dim)[slots], k_scale)
    if centred:  # read back = stored * scale + mean
        written = written + means[0]
    mean0 = float(means[0][0, 0]) if centred else 0.0
    assert float(written[0, 0, 0]) == pytest.approx(448.0 * float(k_scale[0]) + mean0)
    # Quantisation error of unsaturated values: within half an e4m3 step (2^-4 relative to
    # the stored, centred value: the offset channel's error is that of its deviation).
    centre = means[0] if centred else torch.zeros_like(k[0])  # [K, D]
    err = (written.flatten()[1:] - k.flatten()[1:]).abs()
    bound = (k - centre).flatten()[1:].abs() / 16 + float(k_scale.max()) * 2**-9
    assert bool((err <= bound).all())


@pytest.mark.parametrize(
    ("page_size", "num_heads", "num_kv_heads"), [(1, 4, 4), (4, 8, 2), (16, 6, 2)]
)
def test_decode_fp8_matches_reference(page_size, num_heads, num_kv_heads) -> None:
    lens = [1, 7, 38, 75]
    case, k8, v8, k_scale, v_scale = _fp8_case(
        [(n - 1, 1) for n in lens], num_heads, num_kv_heads, 32, page_size
    )
    ref = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend,
                                    case.scale, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    batched = reference.paged_decode_attention(case.q, k8, v8, case.page_table, lens, case.scale,
                                               k_scale, v_scale)  # fmt: skip
    assert rel_error(batched, ref) < 1e-5
    for num_splits in (1, 3):
        for config in (DecodeConfig(block_n=16, num_warps=2, num_stages=1),
                       DecodeConfig(block_n=16, num_warps=1, num_stages=3, pages_ahead=True)):  # fmt: skip
            out = decode_attention(case.q, k8, v8, case.page_table, case.seq_lens, case.scale,
                                   num_splits=num_splits, config=config, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
            assert rel_error(out, ref) < 1e-5, (num_splits, config)
        # Centred values: v_mean joins the output in the epilogue (direct) or the merge.
        v_mean = torch.randn(num_kv_heads, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)
        out = decode_attention(case.q, k8, v8, case.page_table, case.seq_lens, case.scale,
                               num_splits=num_splits, config=DecodeConfig(block_n=16, num_warps=2, num_stages=1),
                               k_scale=k_scale, v_scale=v_scale, v_mean=v_mean)  # fmt: skip
        group = num_heads // num_kv_heads
        assert rel_error(out, ref + v_mean.repeat_interleave(group, 0)) < 1e-5, num_splits
    exact = reference.paged_attention(case.q, case.k_pool, case.v_pool, case.page_table, case.prefix,
                                      case.extend, case.scale)  # fmt: skip
    err = rel_error(ref, exact)
    assert 1e-3 < err < 0.08, err  # e4m3 keeps 3 mantissa bits: a few percent, never zero


@pytest.mark.parametrize("fp8_compute", ["fp16", "q"])
def test_decode_fp8_half_queries_both_compute_dtypes(fp8_compute) -> None:
    """fp16 queries on FP8 pages: the fp16-dot path (q clamped and cast, tiles converted to
    fp16) and the q-dtype path both match the fp32 reference on the same FP8 pages."""
    lens = [5, 40, 77]
    case, k8, v8, k_scale, v_scale = _fp8_case([(n - 1, 1) for n in lens], 8, 2, 32, 16, seed=3)
    ref = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend,
                                    case.scale, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    config = DecodeConfig(block_n=16, num_warps=2, num_stages=1, fp8_compute=fp8_compute)
    for num_splits in (1, 2):
        out = decode_attention(case.q.half(), k8, v8, case.page_table, case.seq_lens, case.scale,
                               num_splits=num_splits, config=config, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        assert out.dtype == torch.float16
        err = rel_error(out.float(), ref)
        assert err < 5e-3, (num_splits, err)


@pytest.mark.parametrize("num_splits", [1, 3])  # long-extend kernel, split-KV path
@pytest.mark.parametrize(("page_size", "num_heads", "num_kv_heads"), [(4, 4, 4), pytest.param(16, 8, 2, marks=pytest.mark.slow)])
def test_extend_fp8_matches_reference(page_size, num_heads, num_kv_heads, num_splits) -> None:
    specs = [(0, 19), (13, 5), (40, 33)]
    case, k8, v8, k_scale, v_scale = _fp8_case(
        specs, num_heads, num_kv_heads, 32, page_size, seed=2
    )
    ref = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend,
                                    case.scale, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    out = extend_attention(case.q, k8, v8, case.page_table, case.cu_extend, case.prefix_lens, case.scale,
                           max_extend_len=case.max_extend, config=ExtendConfig(block_m=16, block_n=16),
                           k_scale=k_scale, v_scale=v_scale, num_splits=num_splits,
                           split_config=ExtendSplitConfig(block_rows=16, block_n=16, num_warps=2))  # fmt: skip
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("q_dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fp8_compute", ["fp16", pytest.param("q", marks=pytest.mark.slow)])
def test_extend_fp8_half_queries_both_compute_dtypes(q_dtype, fp8_compute) -> None:
    """16-bit queries on FP8 pages, every scale mode of the one-pass kernel and the split
    path: the fp16-dot path (q clamped and cast once, tiles converted to fp16) and the
    q-dtype path both match the fp32 reference on the same FP8 pages."""
    if q_dtype == torch.bfloat16 and fp8_compute == "q" and DEVICE == "cpu":
        pytest.skip("TRITON_INTERPRET converts e4m3 -> bf16 wrongly (errors of 1e7); GPU only")
    specs = [(0, 19), (13, 5), (40, 33)]
    case, k8, v8, k_scale, v_scale = _fp8_case(specs, 8, 2, 32, 16, seed=4)
    ref = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend,
                                    case.scale, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    split = ExtendSplitConfig(block_rows=16, block_n=16, num_warps=2, fp8_compute=fp8_compute)
    runs = [(1, ExtendConfig(block_m=16, block_n=16, scale_mode=m, fp8_compute=fp8_compute))
            for m in ("mul", "fma", "q")] + [(3, ExtendConfig(fp8_compute=fp8_compute))]  # fmt: skip
    for num_splits, config in runs:
        out = extend_attention(case.q.to(q_dtype), k8, v8, case.page_table, case.cu_extend, case.prefix_lens,
                               case.scale, max_extend_len=case.max_extend, config=config, k_scale=k_scale,
                               v_scale=v_scale, num_splits=num_splits, split_config=split)  # fmt: skip
        assert out.dtype == q_dtype
        err = rel_error(out.float(), ref)
        assert err < (5e-3 if q_dtype == torch.float16 or fp8_compute == "fp16" else 2e-2), (num_splits, config, err)


def test_fp8_pool_requires_scales() -> None:
    case = make_paged_case([(3, 1)], 4, 2, 32, 4)
    k8 = case.k_pool.to(FP8)
    with pytest.raises(AssertionError):
        decode_attention(case.q, k8, k8, case.page_table, case.seq_lens, case.scale)


def _channel_major_copy(v8: torch.Tensor) -> torch.Tensor:
    """``v8`` in a channel-major pool (``reference.channel_major_pool``), its never-written
    (NaN) slots set to the largest finite e4m3 value: the kernels read whole V pages and weight
    the slots past a request's last key by 0, so a wrong weight shows as a large error."""
    out = reference.channel_major_pool(tuple(v8.shape), v8.device)
    out.copy_(v8.float().nan_to_num(reference.FP8_E4M3_MAX).to(FP8))
    assert reference.channel_major(out) and not reference.channel_major(v8)
    return out


@pytest.mark.parametrize(("page_size", "block_n"), [(4, 16), (16, 16), (16, 32), (32, 16)])
def test_decode_fp8_channel_major_v_matches_reference(page_size, block_n) -> None:
    """V pages stored channel-major ([P, K, D, S] in memory): decode reads each tile's V as
    whole pages (page size 32 > block 16: the tile is half a page) and matches the reference
    on the row-major pages, with and without page-table entries ahead, one and three splits,
    and the exact sink."""
    lens = [1, 7, 38, 75]
    case, k8, v8, k_scale, v_scale = _fp8_case([(n - 1, 1) for n in lens], 8, 2, 32, page_size, seed=5)
    v8c = _channel_major_copy(v8)
    ref = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend,
                                    case.scale, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    for num_splits in (1, 3):
        for config in (DecodeConfig(block_n=block_n, num_warps=2, num_stages=1),
                       DecodeConfig(block_n=block_n, num_warps=1, num_stages=3, pages_ahead=True)):  # fmt: skip
            out = decode_attention(case.q, k8, v8c, case.page_table, case.seq_lens, case.scale,
                                   num_splits=num_splits, config=config, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
            assert rel_error(out, ref) < 1e-5, (num_splits, config)
    gen = torch.Generator().manual_seed(6)
    sink = reference.Sink(*(torch.randn(2, 2, 32, generator=gen).to(DEVICE) for _ in "kv"),
                          torch.tensor([1, -1, 0, 1], dtype=torch.int32, device=DEVICE))  # fmt: skip
    want = reference.paged_decode_attention(case.q, k8, v8, case.page_table, lens, case.scale,
                                            k_scale, v_scale, sink)  # fmt: skip
    got = decode_attention(case.q, k8, v8c, case.page_table, case.seq_lens, case.scale, num_splits=3,
                           config=DecodeConfig(block_n=block_n), k_scale=k_scale, v_scale=v_scale, sink=sink)  # fmt: skip
    assert rel_error(got, want) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("page_size", "block_n"), [(16, 16), pytest.param(16, 32, marks=pytest.mark.slow), pytest.param(32, 16, marks=pytest.mark.slow)])
def test_extend_fp8_channel_major_v_matches_reference(page_size, block_n, num_splits) -> None:
    """Extend over channel-major V pages (one-pass and split-KV kernels) matches the
    reference on the row-major pages; the causal tiles read V slots of keys a row does not
    see, weighted 0."""
    specs = [(0, 19), (13, 5), (40, 33)]
    case, k8, v8, k_scale, v_scale = _fp8_case(specs, 8, 2, 32, page_size, seed=7)
    ref = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend,
                                    case.scale, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    out = extend_attention(case.q, k8, _channel_major_copy(v8), case.page_table, case.cu_extend, case.prefix_lens,
                           case.scale, max_extend_len=case.max_extend,
                           config=ExtendConfig(block_m=16, block_n=block_n), k_scale=k_scale, v_scale=v_scale,
                           num_splits=num_splits,
                           split_config=ExtendSplitConfig(block_rows=16, block_n=block_n, num_warps=2))  # fmt: skip
    assert rel_error(out, ref) < 1e-5


def test_store_kv_into_a_channel_major_v_pool() -> None:
    """store_kv (Triton and reference) writes the same bytes into a channel-major V pool as
    into a row-major one, and the pool keeps its channel-major strides; a fresh channel-major
    pool is all zeros (finite slots for the kernels' whole-page V reads)."""
    num_kv_heads, head_dim, page_size = 3, 32, 16
    shape = (5, page_size, num_kv_heads, head_dim)
    fresh = reference.channel_major_pool(shape, DEVICE)
    assert fresh.shape == shape and fresh.stride() == (3 * 32 * 16, 1, 32 * 16, 16)
    assert bool((fresh.float() == 0).all())
    gen = torch.Generator().manual_seed(8)
    slots = torch.tensor([16, 17, 31, 40, 79], device=DEVICE)
    k, v = (torch.randn(5, num_kv_heads, head_dim, generator=gen).to(DEVICE) for _ in "kv")
    k_scale, v_scale = _scales(num_kv_heads, 2)
    rows = {}
    for name, fn in (("triton", store_kv), ("reference", reference.store_kv)):
        for layout in ("row", "channel"):
            k_pool = torch.zeros(shape, dtype=FP8, device=DEVICE)
            v_pool = torch.zeros(shape, dtype=FP8, device=DEVICE) if layout == "row" else reference.channel_major_pool(
                shape, DEVICE)  # fmt: skip
            fn(k_pool, v_pool, k, v, slots, k_scale, v_scale)
            assert reference.channel_major(v_pool) == (layout == "channel")
            rows[name, layout] = v_pool.contiguous().view(torch.uint8)
    assert torch.equal(rows["triton", "row"], rows["triton", "channel"])
    assert torch.equal(rows["reference", "row"], rows["reference", "channel"])
    _assert_same_fp8(rows["triton", "channel"].view(FP8), rows["reference", "channel"].view(FP8))
    assert int((rows["reference", "channel"] != 0).sum()) > 0.9 * 5 * num_kv_heads * head_dim
