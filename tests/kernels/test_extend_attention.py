"""kernels/extend_attention.py (Triton paged extend) against kernels/reference.py.

Tiny shapes, fp32 (run by the interpreter without CUDA): new tokens attend to cached
prefix pages plus, causally, to each other; variable prefix and extend lengths in one
batch, zero-length prefixes, prefixes ending mid-page, extend lengths longer than one
BLOCK_M, shuffled non-contiguous pages, GQA ratios 1/3/4/8, NaN-poisoned pools and output.

Dimension letters: B requests, T new tokens, H query heads, K kv heads, D head dim,
S page size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels import extend_attention as extend_mod  # noqa: E402
from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.extend_attention import (  # noqa: E402
    HOPPER_EXTEND_CONFIG,
    HOPPER_PREFILL_CONFIG,
    ExtendConfig,
    default_extend_config,
    extend_attention,
)

# (prefix_len, extend_len): plain prefill, decode rows, chunked extend starting mid-page,
# 1-token prefill, a long prefix, an extend spanning 3 query blocks of 16.
MIXED = [(0, 7), (5, 1), (13, 9), (0, 1), (30, 1), (17, 40)]
SMALL = ExtendConfig(block_m=16, block_n=16, num_warps=2, num_stages=1)
# (page size, H, K): every page size meets GQA ratios 1, 3, 4 or 8, and each ratio meets
# at least two page sizes (a subset of the full cross product keeps the interpreter fast).
PAGED_GQA = [
    (1, 4, 4), (1, 6, 2), (1, 8, 1),
    (4, 8, 2), (4, 6, 2),
    (16, 8, 1), (16, 4, 4), (16, 8, 2),
]  # fmt: skip


def _run(case, config: ExtendConfig = SMALL) -> torch.Tensor:
    """The long-extend kernel (num_splits=1; the split-KV path: test_extend_split.py)."""
    out = torch.full_like(case.q, float("nan"))
    extend_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.cu_extend, case.prefix_lens,
        case.scale, case.max_extend, out=out, config=config, num_splits=1,
    )  # fmt: skip
    return out


def _reference(case) -> torch.Tensor:
    return reference.paged_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.prefix, case.extend, case.scale
    )


@pytest.mark.parametrize(("page_size", "num_heads", "num_kv_heads"), PAGED_GQA)
def test_extend_matches_reference(paged_case, relerr, page_size, num_heads, num_kv_heads) -> None:
    case = paged_case(MIXED, num_heads, num_kv_heads, 64, page_size)
    out = _run(case)
    assert not out.isnan().any(), "unwritten output row, or a poisoned slot was read"
    assert relerr(out, _reference(case)) < 1e-5


@pytest.mark.parametrize(
    "config",
    [ExtendConfig(32, 16, 4, 1), ExtendConfig(16, 32, 2, 1)],
    ids=["block_m>block_n", "block_n>block_m"],
)
def test_extend_head_dim_128_and_block_shapes(paged_case, relerr, config) -> None:
    case = paged_case([(0, 20), (9, 35), (16, 3)], 8, 2, 128, 4, seed=2)
    out = _run(case, config)
    assert not out.isnan().any()
    assert relerr(out, _reference(case)) < 1e-5


def test_extend_hopper_tiles(paged_case, relerr) -> None:
    """The 128 x 128 tiles picked on sm_90: two query blocks, a prefix that is not a whole
    tile, and rows far shorter than one tile."""
    case = paged_case([(0, 130), (150, 7), (3, 1)], 4, 2, 64, 16, seed=11)
    out = _run(case, HOPPER_EXTEND_CONFIG)
    assert not out.isnan().any()
    assert relerr(out, _reference(case)) < 1e-5


def test_extend_hopper_prefill_tiles(paged_case, relerr) -> None:
    """The 64 x 64 tiles picked on sm_90 for plain / short-prefix prefill: three query
    blocks, a prefix ending mid-tile."""
    case = paged_case([(0, 150), (70, 20), (5, 64)], 4, 2, 64, 16, seed=12)
    out = _run(case, HOPPER_PREFILL_CONFIG)
    assert not out.isnan().any()
    assert relerr(out, _reference(case)) < 1e-5


@pytest.mark.parametrize(
    ("scale_mode", "reverse_m", "warp_specialize"),
    [("mul", True, False), ("fma", False, False), ("q", True, False), ("fma", True, True)],
)
def test_extend_launch_knobs(paged_case, relerr, scale_mode, reverse_m, warp_specialize) -> None:
    """Every scale mode, both query-block orders and the warp-specialisation flag give the
    same result (the flag only changes code generation on the GPU)."""
    case = paged_case(MIXED, 8, 2, 64, 4, seed=13)
    cfg = ExtendConfig(16, 16, 2, 1, reverse_m, scale_mode, warp_specialize)
    out = _run(case, cfg)
    assert not out.isnan().any()
    assert relerr(out, _reference(case)) < 1e-5


def test_default_extend_config_buckets(monkeypatch) -> None:
    assert default_extend_config(torch.device("cpu"), 2048, 2048) == ExtendConfig()
    monkeypatch.setattr(extend_mod, "_is_hopper_or_newer", lambda device: True)
    dev = torch.device("cpu")
    assert default_extend_config(dev) == HOPPER_EXTEND_CONFIG  # no bounds given
    assert default_extend_config(dev, 2048, 2048) == HOPPER_PREFILL_CONFIG  # plain prefill
    assert default_extend_config(dev, 2048, 3072) == HOPPER_PREFILL_CONFIG  # short prefix
    assert default_extend_config(dev, 2048, 4096) == HOPPER_EXTEND_CONFIG  # prefix >= new
    assert default_extend_config(dev, 128, 8320) == HOPPER_EXTEND_CONFIG
    assert default_extend_config(dev, 64, 8256) == HOPPER_PREFILL_CONFIG  # short extend
    for bounds in ((2048, 2048), (128, 8320)):  # tiered pools: one config for every shape
        assert default_extend_config(dev, *bounds, tiered=True) == extend_mod.HOPPER_TIERED_EXTEND_CONFIG


def _attention_seeing(case, visible) -> torch.Tensor:
    """fp32 attention in which new token i of request b sees its keys [0, visible(p, e, i))."""
    out = torch.empty_like(case.q)
    start = 0
    for b, (p, e) in enumerate(zip(case.prefix, case.extend, strict=True)):
        k = reference.gather_kv(case.k_pool, case.page_table[b], p + e)  # [L, K, D]
        v = reference.gather_kv(case.v_pool, case.page_table[b], p + e)
        group = case.q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = case.q[start : start + e]  # [E, H, D]
        scores = torch.einsum("ehd,lhd->hel", q, k) * case.scale  # [H, E, L]
        limit = torch.tensor([visible(p, e, i) for i in range(e)], device=q.device)[:, None]  # [E, 1]
        scores = scores.masked_fill(torch.arange(p + e, device=q.device)[None, :] >= limit, float("-inf"))
        out[start : start + e] = torch.einsum("hel,lhd->ehd", scores.softmax(-1), v)
        start += e
    return out


def test_extend_probes(paged_case, relerr) -> None:
    """Measurement probes of ``_launch`` (bench/kernels/bench_kernels.py) on lengths that are
    multiples of the 16-key tiles: 1 = diagonal tiles unmasked (each 16-row block sees up to
    its last row's key), 2 = every row sees every key; 3 = no page-table loads, right when
    request b's pages are b * 1024 + 1, + 2, ..."""
    case = paged_case([(16, 32), (0, 48)], 4, 2, 64, 4, seed=14)
    cfg = ExtendConfig(16, 16, 2, 1)
    expect = {
        1: _attention_seeing(case, lambda p, e, i: p + (i // 16 + 1) * 16),
        2: _attention_seeing(case, lambda p, e, i: p + e),
    }
    for probe, ref in expect.items():
        out = torch.full_like(case.q, float("nan"))
        extend_mod._launch(
            case.q, case.k_pool, case.v_pool, case.page_table, case.cu_extend,
            case.prefix_lens, out, case.scale, case.max_extend, cfg, probe=probe,
        )  # fmt: skip
        assert relerr(out, ref) < 1e-5, probe
    # probe 3: move request b's pages to b * 1024 + 1, + 2, ... in bigger pools
    num_pages = case.page_table.shape[1]
    shape = (2 * 1024, *case.k_pool.shape[1:])
    k_pool = torch.full(shape, float("nan"), dtype=case.k_pool.dtype, device=case.k_pool.device)
    v_pool = torch.full_like(k_pool, float("nan"))
    table = torch.zeros_like(case.page_table)
    for b in range(2):
        table[b] = b * 1024 + 1 + torch.arange(num_pages, dtype=torch.int32, device=table.device)
        k_pool[table[b].long()] = case.k_pool[case.page_table[b].long()]
        v_pool[table[b].long()] = case.v_pool[case.page_table[b].long()]
    out = torch.full_like(case.q, float("nan"))
    extend_mod._launch(
        case.q, k_pool, v_pool, table, case.cu_extend, case.prefix_lens, out, case.scale,
        case.max_extend, cfg, probe=3,
    )  # fmt: skip
    assert relerr(out, _reference(case)) < 1e-5


def test_first_query_of_prefill_sees_only_itself(paged_case) -> None:
    case = paged_case([(0, 5)], 2, 1, 64, 4, seed=4)
    out = _run(case)
    v0 = case.v_pool[case.page_table[0, 0], 0, 0]  # value of key 0
    torch.testing.assert_close(out[0], v0.expand(2, 64))


def test_extend_default_config(paged_case, relerr) -> None:
    case = paged_case([(3, 20), (0, 2)], 4, 2, 64, 16, seed=6)
    out = extend_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.cu_extend, case.prefix_lens,
        case.scale, case.max_extend,
    )  # fmt: skip
    assert relerr(out, _reference(case)) < 1e-5


def test_extend_fp16(paged_case, relerr) -> None:
    """Half precision (bf16 runs on the GPU only: the interpreter's bf16 dot is wrong)."""
    case = paged_case([(0, 20), (13, 9)], 8, 2, 64, 4, torch.float16, seed=8)
    k_pool, v_pool = case.k_pool.float(), case.v_pool.float()
    ref = reference.paged_attention(
        case.q.float(), k_pool, v_pool, case.page_table, case.prefix, case.extend, case.scale
    )
    out = _run(case)
    assert out.dtype == torch.float16
    assert relerr(out, ref) < 2e-3
