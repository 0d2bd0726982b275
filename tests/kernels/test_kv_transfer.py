"""kernels/kv_transfer.py (Triton page load from page-first records) against
``PageRecords.scatter``: every KV format that loads layer by layer (bf16 / fp32 pages, FP8
with row-major or channel-major V, pages of odd byte sizes), rows and pages out of order,
every other page left exactly as it was, and the argument errors. On a GPU the records sit
in pinned host memory (the zero-copy path); on the CPU under the interpreter. On a GPU
also the whole model: an extend over pages still being loaded layer by layer.

Dimension letters: L layers, K kv heads, D head dim, P pages, S page size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels.kv_transfer import load_page_columns  # noqa: E402
from radixlm.runtime.memory.kv_pool import KVPool  # noqa: E402
from radixlm.runtime.memory.page_records import PageRecords  # noqa: E402

from .conftest import DEVICE  # noqa: E402

L, P = 2, 12
# (kv cache dtype, model dtype, page size, kv heads, head dim)
KINDS = [("auto", torch.bfloat16, 4, 2, 16), ("auto", torch.float32, 3, 1, 8),
         ("fp8_e4m3", torch.float32, 4, 2, 16),  # V stored channel-major (strided bytes)
         ("fp8_e4m3", torch.float32, 3, 1, 8),  # V row-major, 24-byte pages
         ("fp8_e4m3", torch.float32, 1, 1, 2)]  # 2-byte pages: the byte path  # fmt: skip


def _pool(kind: str, dtype: torch.dtype, page_size: int, heads: int, dim: int) -> KVPool:
    scales = (torch.full((L, heads), 0.01), torch.full((L, heads), 0.02)) if kind == "fp8_e4m3" else ()
    return KVPool(P, page_size, L, heads, dim, dtype, DEVICE, kind, *scales)


def _fill(pool: KVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in [*pool.k, *pool.v]:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen).to(raw.device))


def _bytes(pool: KVPool) -> list[torch.Tensor]:
    return [t.view(torch.uint8).cpu().clone() for t in [*pool.k, *pool.v]]


@pytest.mark.parametrize(("kind", "dtype", "page_size", "heads", "dim"), KINDS,
                         ids=[f"{k}-{str(d)[6:]}-S{s}-K{h}-D{n}" for k, d, s, h, n in KINDS])
def test_load_matches_scatter_bitwise(kind: str, dtype: torch.dtype, page_size: int, heads: int, dim: int) -> None:
    source = _pool(kind, dtype, page_size, heads, dim)
    _fill(source, 1)
    records = PageRecords(source)
    src_pages = [3, 7, 1, 10, 5]
    staging = records.gather(src_pages)  # [n, page_bytes] on the device
    host = torch.zeros((9, records.page_bytes), dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    rows = [8, 2, 5, 1, 6]  # out of order, not consecutive
    host[rows] = staging.cpu()
    dst_pages = [4, 11, 2, 9, 6]

    want = _pool(kind, dtype, page_size, heads, dim)
    _fill(want, 2)
    PageRecords(want).scatter(staging, dst_pages)
    got = _pool(kind, dtype, page_size, heads, dim)
    _fill(got, 2)
    before = _bytes(got)
    columns = PageRecords(got)
    rows_t = torch.tensor(rows, device=DEVICE)
    pages_t = torch.tensor(dst_pages, dtype=torch.int32, device=DEVICE)  # int32 ids work too
    for layer in range(L):
        for dst, offset in columns.layer_columns(layer):
            load_page_columns(host, rows_t, pages_t, dst, offset)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    after, expected = _bytes(got), _bytes(want)
    for a, e, b in zip(after, expected, before, strict=True):
        assert torch.equal(a, e)
        untouched = [p for p in range(P) if p not in dst_pages]
        assert torch.equal(a[untouched], b[untouched])
        assert not torch.equal(a[dst_pages], b[dst_pages])  # the pages did change


def test_layer_columns_cover_a_record_in_order() -> None:
    pool = _pool("auto", torch.bfloat16, 4, 2, 16)
    records = PageRecords(pool)
    offsets = [off for layer in range(L) for _, off in records.layer_columns(layer)]
    page = 4 * 2 * 16 * 2
    assert offsets == [i * page for i in range(2 * L)] and records.page_bytes == 2 * L * page
    k, v = records.layer_columns(1)
    assert k[0] is pool.k[1] and v[0] is pool.v[1]
    with pytest.raises(ValueError, match="int4 / mixed"):
        PageRecords(KVPool(P, 4, L, 2, 16, torch.float32, "cpu", "int4", torch.full((L, 2), 0.01),
                           torch.full((L, 2), 0.02))).layer_columns(0)


def test_argument_errors() -> None:
    pool = _pool("auto", torch.float32, 4, 2, 16)
    host = torch.zeros((3, 2 * 4 * 2 * 16 * 4), dtype=torch.uint8)
    ids = torch.tensor([1], device=DEVICE)
    page = 4 * 2 * 16 * 4
    with pytest.raises(ValueError, match="do not fit"):
        load_page_columns(host, ids, ids, pool.k[0], page + 4)
    with pytest.raises(ValueError, match="do not fit"):
        load_page_columns(host, ids, ids, pool.k[0], -4)
    with pytest.raises(ValueError, match="1-byte"):
        load_page_columns(host, ids, ids, pool.k[0].transpose(1, 2), 0)
    load_page_columns(host, ids[:0], ids[:0], pool.k[0], 0)  # no pages: nothing launched


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="layer-wise loads run on CUDA (pinned host rows)")
def test_model_extend_over_pages_loaded_layer_by_layer_matches_the_original_pages(tiny_hf_model) -> None:
    """A prefix's pages saved to the host tier and loaded into other pages layer by layer,
    the load stream held back so the load is still in flight when the forward is queued:
    the extend over the loaded pages waits for each layer and gives the logits of the same
    extend over the original pages (the pool is NaN-filled: an unloaded page would show)."""
    import random

    from radixlm.runtime.executor.forward_batch import ForwardBatch
    from radixlm.runtime.executor.model_loader import load_model
    from radixlm.runtime.memory.host_pool import HostKVPool

    model = load_model(tiny_hf_model()[0], torch.float32, DEVICE, "triton")
    layers = model.config.num_hidden_layers
    pool = KVPool(16, 4, layers, 2, 16, torch.float32, DEVICE)
    for t in [*pool.k, *pool.v]:
        t[1:].fill_(float("nan"))
    host = HostKVPool(pool, 8, "kernel")
    assert host.layerwise
    ids = random.Random(2).choices(range(256), k=20)
    logits = []
    with torch.inference_mode():
        model(ForwardBatch.build([ids[:16]], [0], [[3, 7, 1, 9]], [15], 4, DEVICE), pool)
        host.save([3, 7, 1, 9], [1, 2, 3, 4])
        extend = ForwardBatch.build([ids[16:]], [16], [[3, 7, 1, 9, 2]], [3], 4, DEVICE)
        logits.append(model.compute_logits(model(extend, pool)))
        host.wait_saves()
        with torch.cuda.stream(host.load_stream):
            torch.cuda._sleep(20_000_000)  # the load is still in flight when the forward is queued
        host.load([1, 2, 3, 4], [5, 6, 10, 11])
        assert pool.loads_pending
        extend = ForwardBatch.build([ids[16:]], [16], [[5, 6, 10, 11, 12]], [3], 4, DEVICE)
        logits.append(model.compute_logits(model(extend, pool)))
    assert not pool.loads_pending  # the last layer's wait ended it
    assert bool(torch.isfinite(logits[1]).all())
    torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)
