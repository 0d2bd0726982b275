"""GPU checks of the Triton kernels in bf16 at real head shapes, against kernels/reference.py
(float32 math on the same bf16 inputs): relative error within 1e-2, NaN-poisoned outputs
and pools, long and short requests mixed, page sizes 1, 16 and 128.

Shapes: Llama-3-8B (32 query heads, 8 kv heads, D 128) and SmolLM2-135M (9 / 3, D 64).
Dimension letters: B requests, T new tokens, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import decode_attention  # noqa: E402
from radixlm.kernels.extend_attention import (  # noqa: E402
    HOPPER_EXTEND_CONFIG,
    HOPPER_PREFILL_CONFIG,
    extend_attention,
    extend_num_splits,
)
from radixlm.kernels.store_kv import store_kv  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BF16 = torch.bfloat16
SHAPES = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}


def _reference(case) -> torch.Tensor:
    """float32 reference on the upcast bf16 inputs."""
    k_pool, v_pool = case.k_pool.float(), case.v_pool.float()
    return reference.paged_attention(
        case.q.float(), k_pool, v_pool, case.page_table, case.prefix, case.extend, case.scale
    )


@pytest.mark.parametrize(
    ("shape", "page_size"),
    [("llama3-8b", 16), ("llama3-8b", 1), ("llama3-8b", 128), ("smollm2", 16)],
)
def test_decode_bf16(paged_case, relerr, shape: str, page_size: int) -> None:
    heads, kv_heads, head_dim = SHAPES[shape]
    lens = [1, 17, 600, 4099, 33, 2048]
    case = paged_case([(n - 1, 1) for n in lens], heads, kv_heads, head_dim, page_size, BF16)
    ref = _reference(case)
    for num_splits in (None, 1, 7):
        out = torch.full_like(case.q, float("nan"))
        decode_attention(
            case.q, case.k_pool, case.v_pool, case.page_table, case.seq_lens, case.scale,
            num_splits=num_splits, out=out,
        )  # fmt: skip
        assert not out.isnan().any(), num_splits
        assert relerr(out, ref) < 1e-2, num_splits


EXTEND_CONFIGS = {"default": None, "long": HOPPER_EXTEND_CONFIG, "prefill": HOPPER_PREFILL_CONFIG}


@pytest.mark.parametrize("config", list(EXTEND_CONFIGS))
@pytest.mark.parametrize(
    ("shape", "page_size"), [("llama3-8b", 16), ("llama3-8b", 1), ("smollm2", 16)]
)
def test_extend_bf16(paged_case, relerr, shape: str, page_size: int, config: str) -> None:
    heads, kv_heads, head_dim = SHAPES[shape]
    specs = [(0, 300), (1000, 129), (4103, 700), (5, 1), (0, 1), (16, 16)]
    case = paged_case(specs, heads, kv_heads, head_dim, page_size, BF16, seed=1)
    out = torch.full_like(case.q, float("nan"))
    extend_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.cu_extend, case.prefix_lens,
        case.scale, case.max_extend, out=out, config=EXTEND_CONFIGS[config],
    )  # fmt: skip
    assert not out.isnan().any()
    assert relerr(out, _reference(case)) < 1e-2


def test_extend_bf16_plain_prefill_default(paged_case, relerr) -> None:
    """A batch of plain / short-prefix prefills (the default picks the prefill tiles on
    sm_90): lengths that are not multiples of 64, one request of one token."""
    heads, kv_heads, head_dim = SHAPES["llama3-8b"]
    specs = [(0, 1000), (0, 777), (100, 300), (0, 1), (37, 64)]
    case = paged_case(specs, heads, kv_heads, head_dim, 16, BF16, seed=2)
    out = torch.full_like(case.q, float("nan"))
    extend_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.cu_extend, case.prefix_lens,
        case.scale, case.max_extend, out=out,
    )  # fmt: skip
    assert not out.isnan().any()
    assert relerr(out, _reference(case)) < 1e-2


@pytest.mark.parametrize("num_splits", [None, 3, 16])
@pytest.mark.parametrize(("shape", "page_size"), [("llama3-8b", 16), ("llama3-8b", 1), ("smollm2", 16)])
def test_extend_split_bf16(paged_case, relerr, shape: str, page_size: int, num_splits) -> None:
    """The split-KV extend path: 128 new tokens over 3968 cached (the TTFT case), mixed with
    a short extend over a prefix ending mid-page and a short prefill (3 requests: on an
    H100/H200 the default heuristic splits the 8B shape in 2, SmolLM2's in 7)."""
    heads, kv_heads, head_dim = SHAPES[shape]
    specs = [(3968, 128), (1003, 32), (0, 5)]
    case = paged_case(specs, heads, kv_heads, head_dim, page_size, BF16, seed=3)
    props = torch.cuda.get_device_properties(0)
    if num_splits is None and props.major >= 9 and props.multi_processor_count >= 132:
        bound = case.page_table.shape[1] * page_size  # the default takes the split path
        assert extend_num_splits(len(specs), heads, kv_heads, 128, bound, "cuda") > 1
    out = torch.full_like(case.q, float("nan"))
    extend_attention(
        case.q, case.k_pool, case.v_pool, case.page_table, case.cu_extend, case.prefix_lens,
        case.scale, case.max_extend, out=out, num_splits=num_splits,
    )  # fmt: skip
    assert not out.isnan().any()
    assert relerr(out, _reference(case)) < 1e-2


def test_store_kv_bf16() -> None:
    k_pool = torch.full((64, 16, 8, 128), float("nan"), dtype=BF16, device="cuda")
    v_pool = torch.full_like(k_pool, float("nan"))
    slots = torch.randperm(63 * 16, device="cuda")[:300] + 16  # never page 0
    qkv = torch.randn(300, 48, 128, device="cuda", dtype=BF16)  # [T, H + 2K, D]
    k, v = qkv[:, 32:40], qkv[:, 40:]
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    reference.store_kv(k_ref, v_ref, k, v, slots)
    store_kv(k_pool, v_pool, k, v, slots)
    torch.testing.assert_close(k_pool, k_ref, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_pool, v_ref, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_pages_with_bf16_queries(shape: str) -> None:
    """FP8 (e4m3) pages, bf16 queries: store_kv bit-identical to the reference quantiser,
    decode and extend within 1e-2 of the reference on the same FP8 pages."""
    from .conftest import make_paged_case

    heads, kv_heads, head_dim = SHAPES[shape]
    case = make_paged_case([(0, 300), (700, 1), (1500, 77)], heads, kv_heads, head_dim, 16, dtype=BF16)
    k_scale = case.k_pool.float().nan_to_num(0).abs().amax(dim=(0, 1, 3)) * 2 / 448
    v_scale = case.v_pool.float().nan_to_num(0).abs().amax(dim=(0, 1, 3)) * 2 / 448
    k8 = reference.quantize_fp8(case.k_pool, k_scale)
    v8 = reference.quantize_fp8(case.v_pool, v_scale)
    ref = reference.paged_attention(case.q, k8, v8, case.page_table, case.prefix, case.extend,
                                    case.scale, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    out = extend_attention(case.q, k8, v8, case.page_table, case.cu_extend, case.prefix_lens,
                           case.scale, case.max_extend, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    dec = make_paged_case([(n, 1) for n in (1, 37, 4000)], heads, kv_heads, head_dim, 16, dtype=BF16)
    dk8, dv8 = reference.quantize_fp8(dec.k_pool, k_scale), reference.quantize_fp8(dec.v_pool, v_scale)
    ref = reference.paged_decode_attention(dec.q, dk8, dv8, dec.page_table, dec.seq_lens, dec.scale,
                                           k_scale, v_scale)  # fmt: skip
    out = decode_attention(dec.q, dk8, dv8, dec.page_table, dec.seq_lens, dec.scale,
                           k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    slots = torch.arange(16, 16 + 50, device="cuda")
    k_new = torch.randn(50, kv_heads, head_dim, device="cuda", dtype=BF16)
    got_k, got_v = torch.zeros_like(k8), torch.zeros_like(v8)
    want_k, want_v = torch.zeros_like(k8), torch.zeros_like(v8)
    store_kv(got_k, got_v, k_new, k_new, slots, k_scale, v_scale)
    reference.store_kv(want_k, want_v, k_new, k_new, slots, k_scale, v_scale)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
