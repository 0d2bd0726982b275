"""Tiered (int4 / mixed) KV pages: the Triton decode and extend kernels read a page from
its FP8 slot or dequantise its INT4 codes in registers; they must match the reference
(``reference.dequantize_tiered_pages`` + ``reference.paged_attention``).

Tiny fp32 shapes (interpreter without CUDA). Full pages are split at random between FP8
slots (shuffled slot ids) and INT4; each sequence's partly filled last page is FP8, as in
the pool. FP8 slots keep NaN outside every sequence, so a kernel that reads an unwritten
slot shows it.

Dimension letters: T tokens, H query heads, K kv heads, D head dim, P pages, S page size,
F FP8 slots, G value group.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import DecodeConfig, TieredPages, decode_attention  # noqa: E402
from radixlm.kernels.extend_attention import ExtendConfig, extend_attention  # noqa: E402

from .conftest import DEVICE, make_paged_case, rel_error  # noqa: E402

# Which pages of a sequence are INT4 (the others, and every partly filled last page, are
# in FP8 slots): "random" (half of the pool's pages), "mixed" (the steady state of
# --kv-cache-dtype mixed: the sink page and a window of the last MIXED_WINDOW pages in FP8,
# the pages between INT4), "int4" (every full page), "fp8" (none).
LAYOUTS = ("random", "mixed", "int4", "fp8")
MIXED_WINDOW = 5


def _int4_pages(layout, case, page_size, gen) -> torch.Tensor:
    """[P] bool: the pages of ``case`` stored as INT4 under ``layout`` (LAYOUTS)."""
    num_pages = case.k_pool.shape[0]
    k_float = case.k_pool.cpu()
    full = torch.tensor([bool(torch.isfinite(k_float[p]).all()) for p in range(num_pages)])
    if layout == "random":
        in_int4 = torch.rand(num_pages, generator=gen) < 0.5
    else:
        in_int4 = torch.zeros(num_pages, dtype=torch.bool)
        for b, seq_len in enumerate(case.seq_lens.tolist()):
            n = -(-seq_len // page_size)
            keep = {0, *range(n - MIXED_WINDOW, n)} if layout == "mixed" else set()
            for i in range(n):
                in_int4[int(case.page_table[b, i])] = layout != "fp8" and i not in keep
    in_int4 &= full
    in_int4[0] = False
    return in_int4


def _tiered_case(specs, num_heads, num_kv_heads, head_dim, page_size, group, seed=0, layout="random"):
    """A paged case whose pools are turned into FP8 slots + INT4 pages (``layout``, one of
    LAYOUTS), and the dense float32 pools the reference reads ([P, S, K, D], what each page
    dequantises to)."""
    case = make_paged_case(specs, num_heads, num_kv_heads, head_dim, page_size, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    k_scale = ((torch.rand(num_kv_heads, generator=gen) + 1.0) * 5.0 / 448.0).to(DEVICE)
    v_scale = ((torch.rand(num_kv_heads, generator=gen) + 1.0) * 5.0 / 448.0).to(DEVICE)
    num_pages = case.k_pool.shape[0]
    k_float, v_float = case.k_pool.cpu(), case.v_pool.cpu()
    in_int4 = _int4_pages(layout, case, page_size, gen)
    fp8_pages = [p for p in range(num_pages) if not in_int4[p]]
    num_slots = len(fp8_pages) + 2
    order = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    fp8_slot = torch.full((num_pages,), -1, dtype=torch.int32)
    k8 = torch.full((num_slots, page_size, num_kv_heads, head_dim), float("nan")).to(torch.float8_e4m3fn)
    v8 = k8.clone()
    for p in fp8_pages:
        slot = 0 if p == 0 else order.pop()
        fp8_slot[p] = slot
        k8[slot] = reference.quantize_fp8(k_float[p], k_scale.cpu())
        v8[slot] = reference.quantize_fp8(v_float[p], v_scale.cpu())
    codes = reference.quantize_int4_pages(k_float.nan_to_num(), v_float.nan_to_num(), group)
    tiered = TieredPages(fp8_slot, *codes)
    tiered = TieredPages(*(t.to(DEVICE).contiguous() for t in tiered))
    k8, v8 = k8.to(DEVICE), v8.to(DEVICE)
    dense = reference.dequantize_tiered_pages(
        torch.arange(num_pages, device=DEVICE), tiered.fp8_slot, k8, v8, k_scale, v_scale,
        tiered.k_codes, tiered.k_stat, tiered.v_codes, tiered.v_stat,
    )  # fmt: skip
    if layout in ("random", "mixed"):
        assert int(in_int4.sum()) >= 2 and len(fp8_pages) >= 3  # both kinds are exercised
    return case, k8, v8, k_scale, v_scale, tiered, dense


def _tile_kinds(case, tiered, block_n) -> set[str]:
    """The kinds of BLOCK_N-key tiles (from key 0) in ``case``'s sequences: "int4" (every
    page INT4), "fp8" (every page in an FP8 slot) or "both" -- the kernels' three branches."""
    kinds = set()
    in_fp8 = (tiered.fp8_slot >= 0).cpu()
    for b, seq_len in enumerate(case.seq_lens.tolist()):
        for n0 in range(0, seq_len, block_n):
            keys = torch.arange(n0, min(n0 + block_n, seq_len))
            page_size = case.k_pool.shape[1]
            fp8 = in_fp8[case.page_table[b].cpu()[keys // page_size].long()]
            kinds.add("fp8" if bool(fp8.all()) else "int4" if not bool(fp8.any()) else "both")
    return kinds


@pytest.mark.parametrize(
    ("page_size", "num_heads", "num_kv_heads", "head_dim", "group"),
    [(4, 4, 4, 32, 32), (16, 6, 2, 32, 16), pytest.param(8, 8, 2, 64, 64, marks=pytest.mark.slow)],
)
def test_decode_tiered_matches_reference(page_size, num_heads, num_kv_heads, head_dim, group) -> None:
    lens = [1, 7, 38, 75]
    case, k8, v8, k_scale, v_scale, tiered, (k_dense, v_dense) = _tiered_case(
        [(n - 1, 1) for n in lens], num_heads, num_kv_heads, head_dim, page_size, group
    )
    ref = reference.paged_attention(case.q, k_dense, v_dense, case.page_table, case.prefix,
                                    case.extend, case.scale)  # fmt: skip
    for num_splits in (1, 3):
        out = decode_attention(case.q, k8, v8, case.page_table, case.seq_lens, case.scale,
                               num_splits=num_splits, config=DecodeConfig(block_n=16, num_warps=2, num_stages=1),
                               k_scale=k_scale, v_scale=v_scale, tiered=tiered)  # fmt: skip
        assert rel_error(out, ref) < 1e-5, num_splits
        # Centred values: v_mean added in the epilogue (both halves of D) or the merge.
        v_mean = torch.randn(num_kv_heads, head_dim, generator=torch.Generator().manual_seed(9)).to(DEVICE)
        out = decode_attention(case.q, k8, v8, case.page_table, case.seq_lens, case.scale,
                               num_splits=num_splits, config=DecodeConfig(block_n=16, num_warps=2, num_stages=1),
                               k_scale=k_scale, v_scale=v_scale, tiered=tiered, v_mean=v_mean)  # fmt: skip
        want = ref + v_mean.repeat_interleave(num_heads // num_kv_heads, 0)
        assert rel_error(out, want) < 1e-5, num_splits
    exact = reference.paged_attention(case.q, case.k_pool, case.v_pool, case.page_table, case.prefix,
                                      case.extend, case.scale)  # fmt: skip
    err = rel_error(ref, exact)
    assert 1e-2 < err < 0.3, err  # 4-bit pages on random data: ~10%, never zero


@pytest.mark.parametrize(
    ("page_size", "num_heads", "num_kv_heads", "group"), [(4, 4, 4, 32), pytest.param(16, 8, 2, 8, marks=pytest.mark.slow)]
)
def test_extend_tiered_matches_reference(page_size, num_heads, num_kv_heads, group) -> None:
    specs = [(0, 19), (13, 5), (40, 33)]
    case, k8, v8, k_scale, v_scale, tiered, (k_dense, v_dense) = _tiered_case(
        specs, num_heads, num_kv_heads, 32, page_size, group, seed=2
    )
    ref = reference.paged_attention(case.q, k_dense, v_dense, case.page_table, case.prefix,
                                    case.extend, case.scale)  # fmt: skip
    for block in (16, 32):  # 32: unmasked full tiles too
        out = extend_attention(case.q, k8, v8, case.page_table, case.cu_extend, case.prefix_lens, case.scale,
                               max_extend_len=case.max_extend, config=ExtendConfig(block_m=16, block_n=block),
                               k_scale=k_scale, v_scale=v_scale, tiered=tiered)  # fmt: skip
        assert rel_error(out, ref) < 1e-5, block


# (page size, tile): 4 pages per tile, one page, half a page, and pages straddling tiles
# (6 does not divide 16: every key looks its page up instead of one lookup per page).
TILINGS = [(4, 16), *(pytest.param(*t, marks=pytest.mark.slow) for t in [(16, 16), (32, 16), (6, 16)])]


def _check_tile_kinds(case, tiered, layout, page_size, block_n) -> None:
    """The mixed layout reaches every branch the tiling can take; "int4" is mostly INT4
    tiles (a partly filled last page stays FP8), "fp8" only FP8 tiles."""
    kinds = _tile_kinds(case, tiered, block_n)
    if layout == "mixed":
        within_page = page_size % block_n == 0  # a tile never spans two pages
        assert kinds == ({"int4", "fp8"} if within_page else {"int4", "fp8", "both"})
    else:
        assert layout in kinds and (layout == "int4" or kinds == {"fp8"}), kinds


@pytest.mark.parametrize(("page_size", "block_n"), TILINGS)
@pytest.mark.parametrize("layout", ["mixed", *(pytest.param(k, marks=pytest.mark.slow) for k in ("int4", "fp8"))])
def test_decode_tiered_tile_kinds(page_size, block_n, layout) -> None:
    """Decode over the mixed steady state (sink page FP8, INT4 middle, FP8 window), all
    INT4 and all FP8 pages: tiles that are all INT4, all FP8 and both, split or not."""
    lens = [1, 75, 400]
    case, k8, v8, k_scale, v_scale, tiered, (k_dense, v_dense) = _tiered_case(
        [(n - 1, 1) for n in lens], 4, 2, 32, page_size, 16, seed=4, layout=layout
    )
    _check_tile_kinds(case, tiered, layout, page_size, block_n)
    ref = reference.paged_attention(case.q, k_dense, v_dense, case.page_table, case.prefix,
                                    case.extend, case.scale)  # fmt: skip
    for num_splits in (1, 3):
        out = decode_attention(case.q, k8, v8, case.page_table, case.seq_lens, case.scale,
                               num_splits=num_splits, config=DecodeConfig(block_n=block_n, num_warps=2),
                               k_scale=k_scale, v_scale=v_scale, tiered=tiered)  # fmt: skip
        assert rel_error(out, ref) < 1e-5, num_splits


@pytest.mark.parametrize(("page_size", "block_n"), TILINGS)
@pytest.mark.parametrize("layout", ["mixed", *(pytest.param(k, marks=pytest.mark.slow) for k in ("int4", "fp8"))])
def test_extend_tiered_tile_kinds(page_size, block_n, layout) -> None:
    """Extend (unmasked prefix tiles and causal diagonal tiles) over the same layouts; the
    (0, 40) prefill's first rows see only the FP8 sink page of a tile that also holds INT4
    keys (they see no key in its INT4 update)."""
    specs = [(0, 19), (60, 15), (383, 17), (0, 40)]
    case, k8, v8, k_scale, v_scale, tiered, (k_dense, v_dense) = _tiered_case(
        specs, 4, 2, 32, page_size, 16, seed=5, layout=layout
    )
    _check_tile_kinds(case, tiered, layout, page_size, block_n)
    ref = reference.paged_attention(case.q, k_dense, v_dense, case.page_table, case.prefix,
                                    case.extend, case.scale)  # fmt: skip
    out = extend_attention(case.q, k8, v8, case.page_table, case.cu_extend, case.prefix_lens, case.scale,
                           max_extend_len=case.max_extend, config=ExtendConfig(block_m=16, block_n=block_n),
                           k_scale=k_scale, v_scale=v_scale, tiered=tiered)  # fmt: skip
    assert rel_error(out, ref) < 1e-5


def test_tiered_pages_need_fp8_slots_and_matching_shapes() -> None:
    case, k8, v8, k_scale, v_scale, tiered, _ = _tiered_case([(20, 1), (30, 1)], 4, 2, 32, 4, 32)
    bad = tiered._replace(k_stat=tiered.k_stat[:, :1].contiguous())
    with pytest.raises(AssertionError):
        decode_attention(case.q, k8, v8, case.page_table, case.seq_lens, case.scale,
                         k_scale=k_scale, v_scale=v_scale, tiered=bad)  # fmt: skip


# Launch parameters checked on the GPU besides the defaults (TIERED_DECODE_CONFIG,
# HOPPER_TIERED_EXTEND_CONFIG), at page 16 only (each is one more compile): one page per
# decode tile, the bench's larger tiles.
GPU_DECODE_CONFIGS = [DecodeConfig(block_n=16), DecodeConfig(block_n=128, num_warps=8)]
GPU_EXTEND_CONFIGS = [ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64)])  # Llama-3-8B, SmolLM2-135M
@pytest.mark.parametrize("page_size", [16, 64, 12])  # 12: pages straddle tiles
@pytest.mark.parametrize("layout", ["random", "mixed"])
def test_tiered_pages_with_bf16_queries_on_gpu(shape, page_size, layout) -> None:
    """bf16 queries over FP8 slots + INT4 pages at real head shapes (G 64), pages split
    at random or as mixed's steady state (sink and window FP8): decode with and without
    splits and extend (more launch configs at page 16), within 1e-2 of the float32
    reference on the same pages."""
    num_heads, num_kv_heads, head_dim = shape
    lens = [1, 100, 700, 2100]
    case, k8, v8, k_scale, v_scale, tiered, (k_dense, v_dense) = _tiered_case(
        [(n - 1, 1) for n in lens], num_heads, num_kv_heads, head_dim, page_size, 64, layout=layout
    )
    q = case.q.to(torch.bfloat16)
    ref = reference.paged_attention(q.float(), k_dense, v_dense, case.page_table, case.prefix,
                                    case.extend, case.scale)  # fmt: skip
    for config in [None, *GPU_DECODE_CONFIGS] if page_size == 16 else [None]:
        for num_splits in (1, 4):
            out = decode_attention(q, k8, v8, case.page_table, case.seq_lens, case.scale, num_splits=num_splits,
                                   config=config, k_scale=k_scale, v_scale=v_scale, tiered=tiered)  # fmt: skip
            assert rel_error(out, ref) < 1e-2, (config, num_splits)
    specs = [(0, 300), (500, 77), (1000, 1)]
    case, k8, v8, k_scale, v_scale, tiered, (k_dense, v_dense) = _tiered_case(
        specs, num_heads, num_kv_heads, head_dim, page_size, 64, seed=3, layout=layout
    )
    q = case.q.to(torch.bfloat16)
    ref = reference.paged_attention(q.float(), k_dense, v_dense, case.page_table, case.prefix,
                                    case.extend, case.scale)  # fmt: skip
    for config in [None, *GPU_EXTEND_CONFIGS] if page_size == 16 else [None]:
        out = extend_attention(q, k8, v8, case.page_table, case.cu_extend, case.prefix_lens, case.scale,
                               max_extend_len=case.max_extend, config=config, k_scale=k_scale,
                               v_scale=v_scale, tiered=tiered)  # fmt: skip
        assert rel_error(out, ref) < 1e-2, config


@pytest.mark.parametrize(("page_size", "num_kv_heads", "head_dim", "group"), [(16, 3, 64, 64), (4, 2, 32, 8)])
def test_demote_kernel_matches_reference(page_size, num_kv_heads, head_dim, group) -> None:
    """Triton demotion (FP8 slot -> INT4 page) against dequantize_fp8 + quantize_int4_pages:
    the same codes and statistics (a constant channel included: scale 1, code 0)."""
    from radixlm.kernels.demote_int4 import demote_pages

    gen = torch.Generator().manual_seed(5)
    num_slots, num_pages = 5, 9
    shape = (num_slots, page_size, num_kv_heads, head_dim)
    k8 = (torch.randn(shape, generator=gen) * 100).to(torch.float8_e4m3fn)
    v8 = (torch.randn(shape, generator=gen) * 100).to(torch.float8_e4m3fn)
    k8[:, :, :, 3] = 7.0  # a constant key channel
    k_scale = torch.tensor([0.01, 0.02, 0.03][:num_kv_heads])
    v_scale = torch.tensor([0.03, 0.01, 0.02][:num_kv_heads])
    pages, slots = torch.tensor([7, 2, 5]), torch.tensor([1, 4, 2])
    k_codes = torch.zeros((num_pages, page_size, num_kv_heads, head_dim // 2), dtype=torch.uint8)
    v_codes = torch.zeros_like(k_codes)
    k_stat = torch.zeros((num_pages, 2, num_kv_heads, head_dim), dtype=torch.float16)
    v_stat = torch.zeros((num_pages, page_size, num_kv_heads, 2, head_dim // group), dtype=torch.float16)
    dev = [t.to(DEVICE) for t in (pages, slots, k8, v8, k_scale, v_scale, k_codes, k_stat, v_codes, v_stat)]
    demote_pages(*dev)
    k = reference.dequantize_fp8(k8.view(torch.uint8)[slots].view(torch.float8_e4m3fn), k_scale)
    v = reference.dequantize_fp8(v8.view(torch.uint8)[slots].view(torch.float8_e4m3fn), v_scale)
    want = reference.quantize_int4_pages(k, v, group)
    for got, ref in zip(dev[6:], want, strict=True):
        assert torch.equal(got.cpu()[pages], ref)
    assert int(dev[6].cpu()[0].sum()) == 0  # pages not demoted are untouched
    assert float(want[1][0, 0, 0, 3]) == 1.0 and float(want[1][0, 1, 0, 3]) == pytest.approx(0.07, abs=1e-4)
