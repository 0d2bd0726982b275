"""PeerKVLink (memory/peer_link.py) between two real processes over gloo: pages sent both
ways at once (each direction on its own group, posted before either side receives) land
bit for bit in the other pool, in other page ids, record by record; the measurement
gives a bandwidth and a latency; replicas with another KV format are refused."""

from __future__ import annotations

import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from radixlm.runtime.memory.kv_pool import KVPool

L, K, D, S, P = 2, 2, 8, 4, 9  # layers, kv heads, head dim, page size, pages


def _pool(rank: int) -> KVPool:
    pool = KVPool(P, S, L, K, D, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(rank)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=gen))
    return pool


def _worker(rank: int, addr: str, results) -> None:
    try:
        from radixlm.runtime.memory.peer_link import PeerKVLink

        pool = _pool(rank)
        link = PeerKVLink(rank, 2, addr, pool, timeout_s=60)
        link.check_identity("same")
        rate, latency = link.measure(1 << 20)
        assert rate > 0 and latency > 0
        # Both sides post their send first, then their receive: with one stream per pair
        # (NCCL) this would deadlock; each direction has its own group.
        mine = [3, 5, 7] if rank == 0 else [2, 4]
        send = link.post_send(1 - rank, link.stage(mine), tag=11 + rank)
        recv = link.recv(1 - rank, 2 if rank == 0 else 3, tag=12 - rank)
        while not (send.done() and recv.done()):
            pass
        assert send.error() is None and recv.error() is None
        into = [1, 6] if rank == 0 else [1, 6, 8]
        link.write(recv, into[1:], skip=1)  # the first record stays out
        link.write(recv, into[:1], skip=0)
        other = _pool(1 - rank)
        theirs = [2, 4] if rank == 0 else [3, 5, 7]
        for layer in range(L):
            assert torch.equal(pool.k[layer][into], other.k[layer][theirs])
            assert torch.equal(pool.v[layer][into], other.v[layer][theirs])
        try:
            link.check_identity(f"format-{rank}")
            results.put((rank, "identity mismatch not caught"))
            return
        except RuntimeError as exc:
            assert "replicas [1]" in str(exc), exc
        link.close()
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


@pytest.mark.slow  # two spawned torch processes: ~30 s on the shared 2-core box
def test_pages_cross_both_ways_bit_for_bit() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{sock.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, addr, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    assert outcomes == {0: "ok", 1: "ok"}, outcomes


def test_int4_pools_are_refused() -> None:
    from radixlm.runtime.memory.peer_link import PeerKVLink

    class Tiered:
        tiered = True

    with pytest.raises(ValueError, match="int4 / mixed"):
        PeerKVLink(0, 2, "127.0.0.1:1", Tiered())
