"""Peer KV tier (L2) bytes: KV pages from one data parallel replica's device pool to
another's, over torch.distributed point-to-point ops (gloo on the CPU, NCCL on CUDA).

Dimension letters: n pages of one transfer, B = ``page_bytes`` (one page record,
``memory/page_records.py``: every layer's K and V of one page, page-first).

The replicas' schedulers (``--dp-size`` M, ``--tp-size`` 1) form their own process group
at start-up (``--enable-peer-kv`` only): the default group of each scheduler process,
ranks = dp ranks. Every unordered pair {i, j} gets two more groups of the same two ranks,
one per direction, so the transfers i -> j and j -> i never share an NCCL communicator or
stream: NCCL matches a pair's point-to-point ops in the order each side posts them, and a
send posted on each side before either posted its receive would deadlock one shared
stream. Within one direction the sender posts its sends in the order it answers, and the
receiver posts its receives in the order the answers reach it (one ZeroMQ socket, FIFO;
scheduler/peer.py), so they match. Gloo also gets a tag per transfer.

A send gathers the pages into a staging tensor [n, B] uint8 on the pool's device (on the
current stream: later kernels that rewrite the pages run after it, so the pages may be
unlocked and freed at once) and posts ``isend``; a receive allocates the staging tensor
and posts ``irecv``. Neither blocks the caller. Completion: NCCL works are polled
(``is_completed``: CUDA events); gloo works only complete inside ``wait()`` (their
``is_completed`` stays False until then, and a ``wait`` with a timeout that expires
leaves the work unusable), so one waiter thread per (peer, direction) calls ``wait()`` on
each work in posting order and flags it. A work that never completes (a peer stalled
forever) holds its staging tensor and its waiter thread, nothing else; the group's
timeout (``timeout_s``) finally fails it (gloo) or ends the process (NCCL's watchdog; the
server then stops, as for any dead replica).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from radixlm.runtime.memory.kv_pool import KVPool
from radixlm.runtime.memory.page_records import PageRecords

__all__ = ["PeerKVLink", "PeerTransfer"]

logger = logging.getLogger("radixlm.peer_link")


class PeerTransfer:
    """One posted send or receive of ``num_pages`` page records with replica ``peer``.

    ``staging``: uint8 [num_pages, page_bytes] on the pool's device (the received records
    once ``done()``); ``error()``: None, or what made it fail (valid once done)."""

    def __init__(self, peer: int, tag: int, staging: torch.Tensor, work: Any, polled: bool) -> None:
        self.peer, self.tag, self.staging, self.work = peer, tag, staging, work
        self.num_pages = staging.shape[0]
        self.posted = time.monotonic()
        self._polled = polled  # NCCL: poll the work; gloo: a waiter thread sets the event
        self._event = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        if self._polled:
            try:
                return self.work.is_completed()
            except Exception as exc:  # a failed NCCL work raises here
                self._error = exc
                return True
        return self._event.is_set()

    def error(self) -> BaseException | None:
        return self._error

    def _finish(self, error: BaseException | None) -> None:  # waiter thread
        self._error = error
        self._event.set()


class _Waiter:
    """A daemon thread that ``wait()``s on gloo works in posting order (module doc)."""

    def __init__(self, name: str) -> None:
        self.queue: queue.SimpleQueue[PeerTransfer] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            transfer = self.queue.get()
            try:
                transfer.work.wait()
                transfer._finish(None)  # noqa: SLF001
            except Exception as exc:  # timeout, peer gone: the transfer failed
                transfer._finish(exc)  # noqa: SLF001


class PeerKVLink:
    """Replica ``rank`` of ``size`` in the peer process group (module doc), moving pages of
    ``pool``. Joins the group at ``init_addr`` (host:port; every replica calls this at
    start-up; blocks until all have, at most ``timeout_s``) and makes the direction groups.

    ``page_bytes``: bytes of one page record. Raises ValueError for an int4 / mixed pool
    (its pages live in two representations; not supported by the peer tier) and
    RuntimeError if the rendezvous fails."""

    def __init__(self, rank: int, size: int, init_addr: str, pool: KVPool, timeout_s: float = 1800.0) -> None:
        if pool.tiered:
            raise ValueError("the peer KV tier does not move int4 / mixed pages")
        self.rank, self.size, self.pool = rank, size, pool
        self.records = PageRecords(pool)
        self.page_bytes = self.records.page_bytes
        self.device = pool.device
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        device_id = None
        if self.device.type == "cuda":  # NCCL binds the group to this process's GPU
            device_id = torch.device("cuda", torch.cuda.current_device() if self.device.index is None
                                     else self.device.index)
        dist.init_process_group(self.backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
                                timeout=timeout, device_id=device_id)
        self._groups: dict[tuple[int, int], Any] = {}
        for i in range(size):  # every rank makes every group, in the same order
            for j in range(i + 1, size):
                self._groups[i, j] = dist.new_group([i, j], timeout=timeout)
                self._groups[j, i] = dist.new_group([i, j], timeout=timeout)
        self._waiters: dict[tuple[int, str], _Waiter] = {}
        logger.info("peer KV tier: replica %d of %d (%s, rendezvous %s)", rank, size, self.backend, init_addr)

    # ------------------------------------------------------------------ start-up
    def check_identity(self, identity: str) -> None:
        """Every replica must hold pages of the same format (``identity``: e.g. the
        model's ``kv_identity()`` and the record size). A collective. RuntimeError naming
        the replicas that differ."""
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, identity)
        odd = [r for r, other in enumerate(everyone) if other != everyone[0]]
        if odd:
            raise RuntimeError(f"peer KV tier: replicas {odd} hold KV pages of another format than replica 0 "
                               "(model, dtype, KV dtype or page size differ)")

    def measure(self, max_bytes: int) -> tuple[float, float]:
        """Time transfers to this replica from every other one (a collective: every replica
        calls it; pairs in turn, each timed on its receiving side after a barrier, the
        first of two rounds a warm-up that also creates the NCCL communicators). Returns
        (bytes/s of a ``max_bytes`` transfer, seconds of a one-page transfer): the slowest
        peer's. ``max_bytes`` >= one page."""
        small, big = self.page_bytes, max(self.page_bytes, max_bytes)
        rates, latencies = [], []
        for src in range(self.size):
            for dst in range(self.size):
                if src == dst:
                    continue
                times = [self._timed(src, dst, nbytes) for nbytes in (small, small, big, big)]
                if self.rank == dst:  # the second of each pair: warmed up
                    latencies.append(times[1])
                    rates.append(big / max(times[3], 1e-9))
        dist.barrier()
        return min(rates), max(latencies)

    def _timed(self, src: int, dst: int, nbytes: int) -> float:
        """Seconds of one ``nbytes`` transfer src -> dst on the receiver (0.0 elsewhere)."""
        dist.barrier()
        if self.rank not in (src, dst):
            return 0.0
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._sync()
        start = time.perf_counter()
        if self.rank == src:
            work = dist.isend(buf, dst, group=self._groups[src, dst], tag=0)
        else:
            work = dist.irecv(buf, src, group=self._groups[src, dst], tag=0)
        work.wait()
        self._sync()
        return time.perf_counter() - start if self.rank == dst else 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ transfers
    @torch.inference_mode()
    def stage(self, device_pages: Sequence[int]) -> torch.Tensor:
        """The records of ``device_pages``, gathered into a new staging tensor [n, B] on the
        current stream: the pages may be rewritten or freed as soon as this returns."""
        self.pool.await_loads()  # pages a layer-wise host-tier load may still be writing
        return self.records.gather(device_pages)

    def post_send(self, dst: int, staging: torch.Tensor, tag: int) -> PeerTransfer:
        """Post the send of ``staging`` (from ``stage``) to replica ``dst``; returns at once.
        Raises what torch.distributed raises (the pairing with ``dst`` is then lost)."""
        work = dist.isend(staging, dst, group=self._groups[self.rank, dst], tag=self._tag(tag))
        return self._track(PeerTransfer(dst, tag, staging, work, self.backend == "nccl"), "send")

    @torch.inference_mode()
    def recv(self, src: int, num_pages: int, tag: int) -> PeerTransfer:
        """Post the receive of ``num_pages`` records from replica ``src`` into a new staging
        tensor. Returns at once (``done()`` says when they are in). Raises what allocation or
        torch.distributed raises."""
        staging = torch.empty((num_pages, self.page_bytes), dtype=torch.uint8, device=self.device)
        work = dist.irecv(staging, src, group=self._groups[src, self.rank], tag=self._tag(tag))
        return self._track(PeerTransfer(src, tag, staging, work, self.backend == "nccl"), "recv")

    def _tag(self, tag: int) -> int:
        """Gloo matches by tag too (a 31-bit one); NCCL has none: posting order only."""
        return tag & 0x7FFFFFFF if self.backend == "gloo" else 0

    def _track(self, transfer: PeerTransfer, kind: str) -> PeerTransfer:
        if self.backend == "gloo":
            key = (transfer.peer, kind)
            waiter = self._waiters.get(key)
            if waiter is None:
                waiter = self._waiters[key] = _Waiter(f"radixlm-peer-{kind}-{transfer.peer}")
            waiter.queue.put(transfer)
        return transfer

    @torch.inference_mode()
    def write(self, transfer: PeerTransfer, device_pages: Sequence[int], skip: int = 0) -> None:
        """Scatter received records ``skip .. skip + len(device_pages)`` of a done receive
        into ``device_pages`` (on the current stream, after the transfer on CUDA)."""
        if not device_pages:
            return
        if self.backend == "nccl":
            transfer.work.wait()  # the current stream waits for the NCCL stream
        self.pool.await_loads()  # a layer-wise host-tier load into pages reused since lands first
        self.records.scatter(transfer.staging[skip : skip + len(device_pages)], device_pages)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
