"""Start-up compilation of the attention kernels, and no JIT while serving.

A mixed step (decodes beside prefill chunks) launches the decode kernels with the split
count of its decodes and the extend kernels on the extend rows' slices of the page table
and prefix lengths: values that change every step. Each new specialisation Triton sees
(an integer 1 or divisible by 16, a pointer 16-byte aligned or not, a merge block size) is
one more binary, compiled in seconds while every request in flight waits. The kernels
leave those arguments unspecialised (``kernels/launch.jit_unspecialised``) and the model
runner compiles the rest at start-up (``warm_up_decode_path``, ``warm_up_extend_path``,
``warm_up_split_path``); the CUDA test checks that no launch of the kinds a mixed step
makes compiles anything afterwards.

Dimension letters: B requests, H query heads, K kv heads, D head dim, P pages, S page size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels.decode_attention import (  # noqa: E402
    PREFIX_CONFIG,
    decode_attention,
    decode_num_splits,
    merge_variants,
    plan_shared_prefixes,
    warm_up_decode_path,
)
from radixlm.kernels.extend_attention import (  # noqa: E402
    default_extend_config,
    extend_attention,
    warm_up_extend_path,
    warm_up_split_path,
)

from .conftest import DEVICE  # noqa: E402


def test_merge_variants_one_split_count_per_binary() -> None:
    """One N per (next power of two, warps): 4 warps from D * N >= 4096."""
    assert merge_variants(40, 128) == [2, 3, 5, 9, 17, 32, 33]
    assert merge_variants(200, 32) == [2, 3, 5, 9, 17, 33, 65, 128, 129]
    assert merge_variants(8, 64) == [2, 3, 5]
    assert merge_variants(1, 128) == []


def test_warm_up_decode_path_runs_each_variant_and_only_reads() -> None:
    """N = 1 and each merge variant up to the batch-1 split count (4 SMs x 4 programs / 1
    kv head = 16 under the interpreter); the pool is left as it was."""
    pool = torch.randn(3, 4, 1, 32, device=DEVICE)
    before = pool.clone()
    most = decode_num_splits(1, 1, 4096, pool.device)
    assert most == 16 or DEVICE == "cuda"
    assert warm_up_decode_path(pool, 2, torch.float32, 4096) == [1, *merge_variants(most, 32)]
    assert warm_up_decode_path(pool, 2, torch.float32, 64) == [1]  # one split of 64 keys
    # cascade: merges of n - 1 suffix splits + 1 prefix split, n up to twice the most
    assert warm_up_decode_path(pool, 2, torch.float32, 4096, cascade=True) == [
        1, *merge_variants(most, 32), *[-n for n in merge_variants(2 * most, 32)]]
    assert torch.equal(pool, before)


def test_warm_up_extend_path_compiles_each_config() -> None:
    """The prefill and cached-prefix configs this device picks (one on the CPU and before
    Hopper, two on Hopper); the pool is only read."""
    pool = torch.randn(3, 4, 2, 32, device=DEVICE)
    before = pool.clone()
    configs = warm_up_extend_path(pool, 4, torch.float32)
    device = pool.device
    assert configs == list(dict.fromkeys([default_extend_config(device, 1, 1), default_extend_config(device, 128, 256)]))
    assert torch.equal(pool, before)


def _compile_counter():
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    compiled: list[str] = []

    def hook(*args, **kwargs) -> bool:
        compiled.append(str(kwargs.get("fn", args[0] if args else "?")))
        return False

    return knobs.runtime, hook, compiled


@pytest.mark.skipif(DEVICE != "cuda", reason="compilation happens on CUDA only")
def test_mixed_steps_compile_nothing_after_warm_up() -> None:
    """bf16 pool of the 8B shape's heads (32 query / 8 kv heads, D 128, 16-token pages):
    after the three warm-ups, mixed steps with 1..9 decodes over 1..40-page tables, each
    decode split count ``decode_num_splits`` gives, with and without cascade decode (the
    decodes sharing their first pages), and extend rows over no prefix and over a cached
    one (both configs), compile no new binary."""
    runtime, hook, compiled = _compile_counter()
    heads, kv_heads, dim, page = 32, 8, 128, 16
    pool = torch.randn(64, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    warm_up_extend_path(pool, heads, torch.bfloat16)
    warm_up_decode_path(pool, heads, torch.bfloat16, 8192, cascade=True)
    warm_up_split_path(pool, heads, torch.bfloat16, 8192)
    torch.cuda.synchronize()
    old = runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = hook
    try:
        for width in (1, 16, 17, 40):
            seq = width * page
            for decodes in range(1, 10):
                for prefix, extend in ((0, min(seq, 200)), (seq - 150, 150), (seq - 40, 40)):
                    if prefix < 0:
                        continue
                    rows = decodes + extend
                    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, device="cuda", dtype=torch.bfloat16)
                    q = qkv[:, :heads]
                    out = torch.empty(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
                    table = torch.randint(1, 64, (decodes + 1, width), device="cuda", dtype=torch.int32)
                    seq_lens = torch.full((decodes + 1,), seq, device="cuda", dtype=torch.int32)
                    prefix_lens = torch.tensor([seq - 1] * decodes + [prefix], device="cuda", dtype=torch.int32)
                    splits = decode_num_splits(decodes, kv_heads, seq, pool.device)
                    decode_attention(q[:decodes], pool, pool, table[:decodes], seq_lens[:decodes], dim**-0.5,
                                     num_splits=splits, out=out[:decodes])
                    if decodes >= 2 and width >= 2:  # the decodes share their first width // 2 pages
                        table[1:decodes, : width // 2] = table[0, : width // 2]
                        plan = plan_shared_prefixes(table[:decodes].cpu().numpy(), seq_lens[:decodes].cpu().numpy(),
                                                    page, heads // kv_heads, min_shared_pages=1)
                        nsp = decode_num_splits(plan.chunk_rows.shape[0], kv_heads, int(plan.chunk_keys.max()),
                                                pool.device, PREFIX_CONFIG)
                        decode_attention(q[:decodes], pool, pool, table[:decodes], seq_lens[:decodes], dim**-0.5,
                                         num_splits=splits, out=out[:decodes], shared=plan.to("cuda", nsp))
                    cu = torch.tensor([0, extend], device="cuda", dtype=torch.int32)
                    extend_attention(q[decodes:], pool, pool, table[decodes:], cu, prefix_lens[decodes:], dim**-0.5,
                                     extend, out=out[decodes:])
        torch.cuda.synchronize()
        after_mixed = list(compiled)
        # control: a head dim never launched before is a new binary, and the hook sees it
        small = torch.zeros(4, page, kv_heads, 64, device="cuda", dtype=torch.bfloat16)
        decode_attention(torch.zeros(1, heads, 64, device="cuda", dtype=torch.bfloat16), small, small,
                         torch.zeros(1, 1, device="cuda", dtype=torch.int32),
                         torch.ones(1, device="cuda", dtype=torch.int32), 0.125, num_splits=1)
        torch.cuda.synchronize()
    finally:
        runtime.jit_post_compile_hook = old
    assert after_mixed == []
    assert len(compiled) >= 1
