"""Exact attention sink of FP8 pools: position 0 of a request with a sink slot is read from
the slot (float32, the pages' units) instead of its FP8 page, by the reference ops and the
Triton decode / extend kernels (``KVPool`` doc).

Tiny fp32 shapes (interpreter without CUDA). Dimension letters as in test_kv_fp8.py; C
sink slots.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import DecodeConfig, decode_attention  # noqa: E402
from radixlm.kernels.extend_attention import ExtendConfig, ExtendSplitConfig, extend_attention  # noqa: E402

from .conftest import DEVICE, rel_error  # noqa: E402
from .test_kv_fp8 import _fp8_case  # noqa: E402


def _sink(num_kv_heads: int, head_dim: int, slots: list[int], seed: int = 5) -> reference.Sink:
    """Three slots of values well away from the pages' (x4), so reading the page instead
    of the slot (or the slot for the wrong request) moves the output by far more than the
    tolerance."""
    gen = torch.Generator().manual_seed(seed)
    k = 4.0 * torch.randn(3, num_kv_heads, head_dim, generator=gen)
    v = 4.0 * torch.randn(3, num_kv_heads, head_dim, generator=gen)
    return reference.Sink(k.to(DEVICE), v.to(DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE))


def _substituted(case, k8, v8, k_scale, v_scale, sink) -> tuple[torch.Tensor, torch.Tensor]:
    """Float pools: the FP8 pages dequantised, with position 0 of each request that has a
    slot overwritten by the slot (what the sink means, built without ``Sink.apply``)."""
    k = reference.dequantize_fp8(k8, k_scale)
    v = reference.dequantize_fp8(v8, v_scale)
    for b, slot in enumerate(sink.slots.tolist()):
        if slot >= 0:
            page = int(case.page_table[b, 0])
            k[page, 0] = sink.k[slot] * k_scale[:, None]
            v[page, 0] = sink.v[slot] * v_scale[:, None]
    return k, v


@pytest.mark.parametrize(("page_size", "num_heads", "num_kv_heads"), [(4, 8, 2), pytest.param(16, 6, 3, marks=pytest.mark.slow)])
def test_decode_sink_matches_reference(page_size, num_heads, num_kv_heads) -> None:
    lens = [1, 7, 38, 75]
    case, k8, v8, k_scale, v_scale = _fp8_case([(n - 1, 1) for n in lens], num_heads, num_kv_heads, 32, page_size)
    sink = _sink(num_kv_heads, 32, [0, -1, 2, 0])  # slot 0 shared, request 1 reads its page
    k_f, v_f = _substituted(case, k8, v8, k_scale, v_scale, sink)
    want = reference.paged_attention(case.q, k_f, v_f, case.page_table, case.prefix, case.extend, case.scale)
    ref = reference.paged_decode_attention(case.q, k8, v8, case.page_table, lens, case.scale, k_scale, v_scale,
                                           sink)  # fmt: skip
    assert rel_error(ref, want) < 1e-5
    plain = reference.paged_decode_attention(case.q, k8, v8, case.page_table, lens, case.scale, k_scale, v_scale)
    for b in (0, 2, 3):  # the sink changes those requests' outputs, not request 1's
        assert rel_error(plain[b], ref[b]) > 0.05, b
    assert rel_error(plain[1], ref[1]) < 1e-6
    v_mean = torch.randn(num_kv_heads, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    group = num_heads // num_kv_heads
    for num_splits in (1, 3):
        for config in (DecodeConfig(block_n=16, num_warps=2, num_stages=1),
                       DecodeConfig(block_n=16, num_warps=1, num_stages=3, pages_ahead=True)):  # fmt: skip
            out = decode_attention(case.q, k8, v8, case.page_table, case.seq_lens, case.scale,
                                   num_splits=num_splits, config=config, k_scale=k_scale, v_scale=v_scale,
                                   sink=sink)  # fmt: skip
            assert rel_error(out, ref) < 1e-5, (num_splits, config)
        out = decode_attention(case.q, k8, v8, case.page_table, case.seq_lens, case.scale, num_splits=num_splits,
                               config=DecodeConfig(block_n=16, num_warps=2, num_stages=1), k_scale=k_scale,
                               v_scale=v_scale, v_mean=v_mean, sink=sink)  # fmt: skip
        assert rel_error(out, ref + v_mean.repeat_interleave(group, 0)) < 1e-5, num_splits


@pytest.mark.parametrize(("page_size", "num_heads", "num_kv_heads"), [(4, 4, 4), pytest.param(16, 8, 2, marks=pytest.mark.slow)])
def test_extend_sink_matches_reference(page_size, num_heads, num_kv_heads) -> None:
    """The one-pass kernel (every scale mode) and the split-KV path, prefixes of 0 (the pass
    computes position 0), 13 and 40 tokens, one request without a slot."""
    specs = [(0, 19), (13, 5), (40, 33)]
    case, k8, v8, k_scale, v_scale = _fp8_case(specs, num_heads, num_kv_heads, 32, page_size, seed=2)
    sink = _sink(num_kv_heads, 32, [1, 2, -1])
    k_f, v_f = _substituted(case, k8, v8, k_scale, v_scale, sink)
    want = reference.paged_attention(case.q, k_f, v_f, case.page_table, case.prefix, case.extend, case.scale)
    ref = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend, case.scale,
                                    k_scale=k_scale, v_scale=v_scale, sink=sink)  # fmt: skip
    assert rel_error(ref, want) < 1e-5
    plain = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend, case.scale,
                                      k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert rel_error(plain[:24], ref[:24]) > 0.05  # requests 0 and 1 read their slots
    split = ExtendSplitConfig(block_rows=16, block_n=16, num_warps=2)
    runs = [(1, ExtendConfig(block_m=16, block_n=16, scale_mode=m)) for m in ("mul", "fma", "q")]
    for num_splits, config in [*runs, (3, ExtendConfig(block_m=16, block_n=16))]:
        out = extend_attention(case.q, k8, v8, case.page_table, case.cu_extend, case.prefix_lens, case.scale,
                               max_extend_len=case.max_extend, config=config, k_scale=k_scale, v_scale=v_scale,
                               num_splits=num_splits, split_config=split, sink=sink)  # fmt: skip
        assert rel_error(out, ref) < 1e-5, (num_splits, config)


@pytest.mark.slow
def test_sink_half_queries_fp16_dots() -> None:
    """fp16 queries on FP8 pages with a sink: decode and both extend paths on their fp16-dot
    path match the fp32 reference with the sink."""
    lens = [5, 40, 77]
    case, k8, v8, k_scale, v_scale = _fp8_case([(n - 1, 1) for n in lens], 8, 2, 32, 16, seed=3)
    sink = _sink(2, 32, [2, 0, -1])
    ref = reference.paged_decode_attention(case.q, k8, v8, case.page_table, lens, case.scale, k_scale, v_scale,
                                           sink)  # fmt: skip
    for num_splits in (1, 2):
        out = decode_attention(case.q.half(), k8, v8, case.page_table, case.seq_lens, case.scale,
                               num_splits=num_splits, config=DecodeConfig(block_n=16, num_warps=2, num_stages=1),
                               k_scale=k_scale, v_scale=v_scale, sink=sink)  # fmt: skip
        assert rel_error(out.float(), ref) < 5e-3, num_splits
    specs = [(0, 19), (13, 5), (40, 33)]
    case, k8, v8, k_scale, v_scale = _fp8_case(specs, 8, 2, 32, 16, seed=4)
    sink = _sink(2, 32, [0, -1, 1])
    ref = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend, case.scale,
                                    k_scale=k_scale, v_scale=v_scale, sink=sink)  # fmt: skip
    for num_splits, config in ((1, ExtendConfig(block_m=16, block_n=16, scale_mode="q")), (3, ExtendConfig())):
        out = extend_attention(case.q.half(), k8, v8, case.page_table, case.cu_extend, case.prefix_lens,
                               case.scale, max_extend_len=case.max_extend, config=config, k_scale=k_scale,
                               v_scale=v_scale, num_splits=num_splits,
                               split_config=ExtendSplitConfig(block_rows=16, block_n=16, num_warps=2),
                               sink=sink)  # fmt: skip
        assert rel_error(out.float(), ref) < 5e-3, (num_splits, config)
