"""Host-memory KV tier (``host_pool``): record size, save / load round trips for every KV
cache format (bitwise, FP8 slots of tiered pools kept exactly where they were), raw rows
through a second host pool into a second device pool, slot pressure on load, argument
errors, and on a GPU the same round trip (pinned memory) and the order of the save and
load streams.

Dimension letters: L layers, K kv heads, D head dim, P pages, S page size.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.memory.host_pool import HostKVPool, host_page_bytes
from radixlm.runtime.memory.kv_pool import KVPool, value_group

L, K, D, P = 2, 2, 16, 24
KINDS = [("auto", torch.bfloat16, 4), ("fp16", torch.float32, 4), ("bf16", torch.float32, 4),
         ("fp8_e4m3", torch.float32, 4), ("fp8_e4m3", torch.float32, 3),  # channel-major V / row-major
         ("int4", torch.float32, 4), ("mixed", torch.float32, 4)]  # fmt: skip
KIND_IDS = [f"{kind}-S{s}" for kind, _, s in KINDS]


def _pool(kind: str, dtype: torch.dtype, page_size: int, device: str = "cpu", **kw) -> KVPool:
    scales = (torch.full((L, K), 0.01), torch.full((L, K), 0.02)) if kind not in ("auto", "fp16", "bf16") else ()
    return KVPool(P, page_size, L, K, D, dtype, device, kind, *scales, **kw)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A page's bytes as a contiguous CPU uint8 copy (any strides, any dtype)."""
    return (t if t.dtype == torch.uint8 else t.view(torch.uint8)).cpu().clone()


def _per_page(pool: KVPool) -> list[list[torch.Tensor]]:
    if pool.tiered:
        return [pool.k_codes, pool.k_stat, pool.v_codes, pool.v_stat]
    return [pool.k, pool.v]


def _fill_random(pool: KVPool, seed: int) -> None:
    """Random bytes in every page but the dummy (FP8 slots too), so any misplaced byte shows."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [t[layer] for t in _per_page(pool) for layer in range(L)]
    if pool.tiered:
        tensors += [t[layer] for t in (pool.k, pool.v) for layer in range(L)]
    for t in tensors:
        raw = t if t.dtype == torch.uint8 else t.view(torch.uint8)
        raw[1:].copy_(torch.randint(0, 256, raw[1:].shape, dtype=torch.uint8, generator=gen))


def _record(pool: KVPool, page: int) -> dict[str, torch.Tensor | int]:
    """Every byte a page owns: K/V (float / FP8), or INT4 codes+stats and the FP8 slot's
    K/V where it has one, and whether it has one."""
    out: dict[str, torch.Tensor | int] = {}
    for n, t in enumerate(_per_page(pool)):
        for layer in range(L):
            out[f"{n}/{layer}"] = _bytes(t[layer][page])
    if pool.tiered:
        slot = int(pool.fp8_slot[page])
        out["fp8"] = slot >= 0
        assert (slot >= 0) == (page in pool._slot_of)
        if slot >= 0:
            for layer in range(L):
                out[f"k8/{layer}"] = _bytes(pool.k[layer][slot])
                out[f"v8/{layer}"] = _bytes(pool.v[layer][slot])
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def _round_trip(kind: str, dtype: torch.dtype, page_size: int, device: str, io_backend: str = "kernel") -> None:
    pool = _pool(kind, dtype, page_size, device)
    src, dst = [3, 4, 5, 9, 12, 13], [20, 7, 8, 2, 15, 23]
    if pool.tiered:
        pool.assign_fp8_slots([4, 9, 13])  # the others stay INT4 only
        pool.assign_fp8_slots([20, 7])  # destinations holding slots: 20 loses its own, 7 keeps it
    _fill_random(pool, seed=10 * len(kind) + page_size)
    expected = [_record(pool, p) for p in src]
    if pool.tiered:
        assert [r["fp8"] for r in expected] == [False, True, False, True, False, True]

    host = HostKVPool(pool, 12, io_backend)
    assert host.layerwise == (device == "cuda" and io_backend == "kernel" and not pool.tiered)
    assert host.data.shape == (12, host_page_bytes(pool)) and host.data.dtype == torch.uint8
    assert host.data.is_pinned() == (device == "cuda")
    rows = [10, 1, 2, 6, 3, 8]  # runs [1, 2, 3] and [6], out of order
    host.save(src, rows)
    host.wait_saves()
    _fill_random(pool, seed=99)  # the device pages change after the save; the host rows do not
    host.load(rows, dst)
    assert pool.loads_pending == host.layerwise
    pool.await_loads()  # readers other than the forward wait for every layer
    for page, want in zip(dst, expected, strict=True):
        _assert_same(_record(pool, page), want)
    pool.check_invariants()

    # Raw rows (a disk tier's path) into a second host pool, loaded into a second device pool.
    other = _pool(kind, dtype, page_size, device)
    host2 = HostKVPool(other, 8, io_backend)
    rows2 = [7, 5, 4, 3, 1, 2]
    for h, h2 in zip(rows, rows2, strict=True):
        host2.row(h2)[:] = host.row(h)  # as a disk read fills a row in place
        host2.adopt_row(h2)
    dst2 = [1, 2, 3, 4, 5, 6]
    host2.load(rows2, dst2)
    other.await_loads()
    for page, want in zip(dst2, expected, strict=True):
        _assert_same(_record(other, page), want)
    other.check_invariants()


@pytest.mark.parametrize(("kind", "dtype", "page_size"), KINDS, ids=KIND_IDS)
def test_save_load_round_trip_is_bitwise(kind: str, dtype: torch.dtype, page_size: int) -> None:
    _round_trip(kind, dtype, page_size, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize(("kind", "dtype", "page_size"), KINDS, ids=KIND_IDS)
def test_save_load_round_trip_on_gpu(kind: str, dtype: torch.dtype, page_size: int, io_backend: str) -> None:
    _round_trip(kind, dtype, page_size, "cuda", io_backend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layerwise_load_is_awaited_layer_by_layer() -> None:
    """With the load stream held back (a long kernel queued on it first), a layer-wise load
    is still in flight when ``load`` returns; ``await_loads(layer)`` makes the current
    stream see that layer's pages, and the wait for the last layer ends the pending state."""
    pool = KVPool(64, 16, 4, 2, 64, torch.bfloat16, "cuda", "auto")
    host = HostKVPool(pool, 32, "kernel")
    assert host.layerwise
    for layer in range(4):
        pool.k[layer][1:9] = layer + 1.0
        pool.v[layer][1:9] = -(layer + 1.0)
    host.save(list(range(1, 9)), list(range(1, 9)))
    host.wait_saves()
    for layer in range(4):
        pool.k[layer][9:17] = 0.0
        pool.v[layer][9:17] = 0.0
    with torch.cuda.stream(host.load_stream):
        torch.cuda._sleep(20_000_000)  # hold the load stream back
    host.load(list(range(1, 9)), list(range(9, 17)))
    assert pool.loads_pending
    for layer in range(4):
        pool.await_loads(layer)
        assert bool((pool.k[layer][9:17] == layer + 1.0).all())
        assert bool((pool.v[layer][9:17] == -(layer + 1.0)).all())
        assert pool.loads_pending == (layer < 3)
    with pytest.raises(ValueError, match="load events"):
        pool.expect_loads([])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_copies_are_ordered_with_the_current_stream() -> None:
    """A save sees a kernel enqueued just before it, and a kernel enqueued just after it
    does not change what it saves; the current stream sees a load once it waited for the
    pool's loads (``await_loads``: every forward layer does for its own layer); many pages
    and layers in one batch."""
    pool = KVPool(64, 16, 4, 2, 64, torch.bfloat16, "cuda", "auto")
    host = HostKVPool(pool, 64, "kernel")
    pages = list(range(1, 41))
    for layer in range(4):
        torch.cuda._sleep(1_000_000)  # a slow kernel ahead of the writes on the current stream
        pool.k[layer][1:41] = layer + 1.0
        pool.v[layer][1:41] = -(layer + 1.0)
    host.save(pages, list(range(63, 23, -1)))  # 40 rows of one-row runs (descending)
    for layer in range(4):
        pool.k[layer][1:41] = -7.0  # rewritten at once: the save's gather comes first
        pool.k[layer][41:64].zero_()
        pool.v[layer][41:64].zero_()
    host.load(list(range(63, 40, -1)), list(range(41, 64)))  # rows of pages 1..23
    pool.await_loads()  # what every forward layer does for its own layer
    for layer in range(4):
        assert bool((pool.k[layer][41:64] == layer + 1.0).all())
        assert bool((pool.v[layer][41:64] == -(layer + 1.0)).all())
    host.wait_saves()
    record = host.row(63)  # page 1: K of layer 0 first
    assert len(record) == host.page_bytes == 2 * 4 * 16 * 2 * 64 * 2
    first_k = host.data[63, :16 * 2 * 64 * 2].view(torch.bfloat16)
    assert bool((first_k == 1.0).all()) and record[:2] == first_k[:1].view(torch.uint8).numpy().tobytes()


def _big_pool(io_backend: str = "direct") -> tuple[KVPool, HostKVPool]:
    """513 pages of the Llama-3-8B shape (2 MiB each: 32 layers, 8 kv heads, head dim 128,
    bf16) and a host tier of as many rows: a save of 512 pages copies 1 GiB device -> host."""
    pool = KVPool(520, 16, 32, 8, 128, torch.bfloat16, "cuda", "auto")
    return pool, HostKVPool(pool, 520, io_backend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_load_does_not_queue_behind_saves_of_other_rows() -> None:
    """Saves and loads run on two streams: a small load issued right after a 1 GiB save
    (512 pages) to other rows has landed while that save's device -> host copy still runs."""
    pool, host = _big_pool()
    pool.k[0][513:517] = 5.0
    host.save(list(range(513, 517)), list(range(513, 517)))
    host.wait_saves()
    pool.k[0][1:513] = 1.0
    host.save(list(range(1, 513)), list(range(1, 513)))
    host.load(list(range(513, 517)), [517, 518, 519, 1])  # page 1's gather came first
    host.load_event.synchronize()
    assert not host.save_event.query(), "the load waited for the save"
    assert bool((pool.k[0][517:520] == 5.0).all()) and bool((pool.k[0][1] == 5.0).all())
    host.wait_saves()
    assert bool((host.data[512, :2].view(torch.bfloat16) == 1.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_a_load_of_a_row_being_saved_waits_for_that_save(io_backend: str) -> None:
    """A page saved and loaded back from its row before the save landed (1 GiB ahead of it
    in the same copy) reads the saved bytes, not the row's old ones."""
    pool, host = _big_pool(io_backend)
    host.data.zero_()
    for layer in range(32):
        pool.k[layer][1:513] = layer + 1.0
        pool.v[layer][1:513] = -(layer + 1.0)
    host.save(list(range(1, 513)), list(range(1, 513)))
    host.load([512], [513])
    pool.await_loads()
    torch.cuda.current_stream().synchronize()
    for layer in range(32):
        assert bool((pool.k[layer][513] == layer + 1.0).all())
        assert bool((pool.v[layer][513] == -(layer + 1.0)).all())


def test_host_page_bytes_formula() -> None:
    for kind, dtype, elem in (("auto", torch.bfloat16, 2), ("auto", torch.float32, 4), ("fp16", torch.float32, 2),
                              ("bf16", torch.float32, 2), ("fp8_e4m3", torch.float32, 1)):  # fmt: skip
        for s in (3, 4):
            assert host_page_bytes(_pool(kind, dtype, s)) == 2 * L * s * K * D * elem
    g = value_group(D)
    for kind in ("int4", "mixed"):
        int4 = L * K * (2 * 4 * D // 2 + 2 * D * 2 + 4 * 2 * (D // g) * 2)  # codes, k stats, v stats
        assert host_page_bytes(_pool(kind, torch.float32, 4)) == int4 + 1 + 2 * L * 4 * K * D
    # Llama-3-8B shape in bf16 (L 32, K 8, D 128, S 16): a 2 MiB record; a 2-page pool
    # (the dummy and one page) is all that gets allocated.
    llama = KVPool(2, 16, 32, 8, 128, torch.bfloat16, "cpu", "auto")
    assert host_page_bytes(llama) == 2 * 32 * 16 * 8 * 128 * 2 == 2 * 1024 * 1024
    assert HostKVPool(llama, 3).total_bytes == 3 * 2 * 1024 * 1024


_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", _GPU])
def test_load_under_fp8_slot_pressure_demotes_other_pages(device: str) -> None:
    """A tiered pool whose 3 usable FP8 slots are all taken: loading 2 FP8 records demotes
    the 2 least recently written full pages to make room; records stay bitwise."""
    pool = _pool("int4", torch.float32, 4, device, num_fp8_pages=4)
    pool.assign_fp8_slots([5])
    pool.assign_fp8_slots([6])
    pool.assign_fp8_slots([7])
    _fill_random(pool, seed=3)
    expected = [_record(pool, p) for p in (5, 6, 7)]
    host = HostKVPool(pool, 4)
    host.save([6, 7], [2, 3])
    host.load([2, 3], [10, 11])
    assert pool.num_demoted == 2 and pool.num_fp8_pages_used == 3
    assert int(pool.fp8_slot[5]) == -1 and int(pool.fp8_slot[6]) == -1 and int(pool.fp8_slot[7]) >= 0
    _assert_same(_record(pool, 10), expected[1])
    _assert_same(_record(pool, 11), expected[2])
    pool.check_invariants()
    host.save([10, 11, 7], [0, 1, 3])
    with pytest.raises(RuntimeError, match="FP8 pages"):  # 4 flagged records, 3 slots
        host.load([0, 1, 3, 2], [12, 13, 14, 15])


def test_kv_pool_fp8_slot_bookkeeping() -> None:
    pool = _pool("mixed", torch.float32, 4, num_fp8_pages=8)
    pool.assign_fp8_slots([3, 4, 3])
    slot = int(pool.fp8_slot[3])
    pool.assign_fp8_slots([3])  # keeps its slot
    assert int(pool.fp8_slot[3]) == slot and pool.num_fp8_pages_used == 2
    assert pool._fill[3] == 4 and not pool._is_sink[3]
    pool.release_fp8_slots([3, 5])  # 5 has none
    assert int(pool.fp8_slot[3]) == -1 and pool.num_fp8_pages_used == 1
    pool.check_invariants()
    float_pool = _pool("bf16", torch.float32, 4)
    float_pool.assign_fp8_slots([1])  # no-ops
    float_pool.release_fp8_slots([1])


def test_argument_errors() -> None:
    pool = _pool("mixed", torch.float32, 4)
    host = HostKVPool(pool, 4)
    host.row(1)[host._flag_offset] = 2
    with pytest.raises(ValueError, match="flag byte"):
        host.adopt_row(1)
    host.row(1)[host._flag_offset] = 1
    host.adopt_row(1)
    assert host._flag[1] == 1
    with pytest.raises(IndexError):
        host.row(4)
    with pytest.raises(IndexError):
        host.adopt_row(4)
    with pytest.raises(ValueError, match="host rows"):
        host.save([1, 2], [1])
    with pytest.raises(ValueError, match="host row out of range"):
        host.save([1], [4])
    with pytest.raises(ValueError, match="device page out of range"):
        host.load([1], [P])
    with pytest.raises(ValueError, match="repeated host rows"):
        host.save([1, 2], [3, 3])
    with pytest.raises(ValueError, match="repeated device pages"):
        host.load([1, 2], [3, 3])
    with pytest.raises(ValueError, match="dummy"):
        host.load([1], [0])
    with pytest.raises(ValueError, match="at least 1 page"):
        HostKVPool(pool, 0)
    with pytest.raises(ValueError, match="I/O backend"):
        HostKVPool(pool, 4, "memcpy")
    assert not HostKVPool(_pool("bf16", torch.float32, 4), 4, "kernel").layerwise  # CPU: direct copies
    host.save([], [])  # nothing to do
    host.load([], [])
    host.wait_saves()  # a no-op on the CPU
