"""Host-memory tier (L3) of the hierarchical KV cache: copies of device KV pages in CPU
memory, page-first.

Dimension letters: P pages, S page size (tokens per page), K kv heads, D head dim,
L layers, G INT4 value group, n pages of one call.

A host row holds one page record (``memory/page_records.py``: one logical page's bytes of
every layer side by side, page-first), so that a page moves to and from disk as one
contiguous record. Rows hold raw bytes only: they are meaningful to a pool of the same
shape, format, FP8 scales, channel means and key rotation. Exact sink slots
(``KVPool.sink_k``) are per first token id, not per page, and are not part of a record.

On CUDA the copies are batched and run on two streams of the host pool's own, so that
PCIe carries both directions at once and a load (which a forward waits for) never queues
behind saves (which nothing waits for): ``save_stream`` and ``load_stream`` (high
priority), as SGLang's HiCache controller does. A save gathers the pages of every layer
into one device staging buffer [n, page_bytes] (one ``index_select`` per layer tensor,
writing straight into the staging rows), then copies runs of consecutive host rows
device -> host. The host memory is pinned, so both directions are asynchronous. A load
waits only for the saves still in flight to one of its rows; a save waits for the loads
in flight (it may rewrite a row they read, or gather a page they write). A load
(``io_backend``, ``--hicache-io-backend``):

* ``direct`` (the default; always for int4 / mixed pools and the CPU): copies runs of
  consecutive host rows host -> device into a staging buffer, scatters it (one
  ``index_copy_`` per layer tensor), and the next forward waits for the whole load.
* ``kernel`` (float / FP8 pools on CUDA): layer by layer, one Triton launch per layer
  tensor reads the pages' columns straight from the pinned rows into the pool
  (``kernels.kv_transfer``: zero-copy over PCIe, no staging buffer), an event recorded
  after each layer; the forward waits for layer l's event before layer l writes or reads
  its pages (``KVPool.expect_loads`` / ``await_loads``), so the load of later layers
  overlaps the compute of earlier ones. A start-up probe falls back to ``direct`` where
  Triton cannot read pinned host memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from radixlm.runtime.memory.kv_pool import KVPool
from radixlm.runtime.memory.page_records import PageRecords, record_bytes

__all__ = ["IO_BACKENDS", "HostKVPool", "host_page_bytes"]

IO_BACKENDS = ("kernel", "direct")  # how a load moves (module doc)
logger = logging.getLogger("radixlm.hicache")


def host_page_bytes(pool: KVPool) -> int:
    """Bytes of one host row: one page record (``page_records.record_bytes``)."""
    return record_bytes(pool)


def _runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(i, j, rows[i]) for each maximal run ``rows[i:j]`` of consecutive increasing ids."""
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((start, i, rows[start]))
            start = i
    return runs


class HostKVPool:
    """Host copies of device KV pages in page-first layout (module doc).

    Row h of ``data`` (uint8 [num_pages, page_bytes]) holds one logical page's bytes of
    every layer, K then V per layer (for int4/mixed: the INT4 codes+stats of every layer,
    then a one-byte flag and, when the flag is 1, the page's FP8 K/V bytes of every
    layer). Pinned memory when the device pool is on CUDA. Row ids are allocated by the
    caller (e.g. a ``PageAllocator`` of ``num_pages``: row 0 unused); nothing here tracks
    which rows are in use.

    Ordering on CUDA (saves on ``save_stream``, loads on ``load_stream``): a save sees
    every kernel enqueued on the current stream before it and every load issued before it,
    and kernels enqueued after it see the pages only once they are gathered (so the pages
    may be freed at once); a load sees the current stream and the saves in flight to its
    rows; the next forward on the current stream sees a load. The caller must not read or
    rewrite a row being saved before ``wait_saves``, nor rewrite a row being loaded before
    ``wait_saves`` either. Since the current stream waits for a save's gather, which waits
    for the loads issued before it, a save between a layer-wise load and the forward that
    reads it would make that forward wait for the whole load: issue saves first
    (``HiCache.issue`` does).

    ``io_backend`` (``IO_BACKENDS``): how loads move (module doc); ``layerwise`` says
    whether loads go layer by layer (``kernel`` on CUDA for float / FP8 pools).

    Raises ValueError if ``num_pages`` < 1 or ``io_backend`` is unknown.
    """

    def __init__(self, device_pool: KVPool, num_pages: int, io_backend: str = "direct") -> None:
        if num_pages < 1:
            raise ValueError(f"a host KV pool needs at least 1 page, got {num_pages}")
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"unknown host KV I/O backend {io_backend!r}; choose from {IO_BACKENDS}")
        pool = self.pool = device_pool
        self.num_pages = num_pages
        self.records = PageRecords(pool)
        self.page_bytes = self.records.page_bytes
        self._flag_offset = self.records.flag_offset
        self.cuda = pool.device.type == "cuda"
        self.data = torch.empty((num_pages, self.page_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        self._flag = bytearray(num_pages)  # host mirror of each row's FP8 flag (tiered pools)
        self.save_stream = torch.cuda.Stream(pool.device) if self.cuda else None
        self.load_stream = torch.cuda.Stream(pool.device, priority=-1) if self.cuda else None
        self.save_event = torch.cuda.Event() if self.cuda else None  # recorded by each save
        self.load_event = torch.cuda.Event() if self.cuda else None  # recorded by each load
        self._saving: list[tuple[torch.cuda.Event, frozenset[int]]] = []  # saves maybe in flight: rows
        self._spare_events: list[torch.cuda.Event] = []  # of saves known done, for reuse
        self.layerwise = self.cuda and io_backend == "kernel" and not pool.tiered and self._kernel_reads_host()
        if self.layerwise:
            self._columns = [self.records.layer_columns(layer) for layer in range(pool.num_layers)]
            self._layer_events = [torch.cuda.Event() for _ in range(pool.num_layers)]

    @property
    def total_bytes(self) -> int:
        """Host memory of ``data``: num_pages x page_bytes."""
        return self.num_pages * self.page_bytes

    # ------------------------------------------------------------------ copies
    @torch.inference_mode()
    def save(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copy logical device pages -> host rows, ``device_pages[i]`` into row
        ``host_pages[i]`` (tiered pools: the INT4 page, and the FP8 slot's bytes when the
        page has one, as ``fp8_slot`` stands now on the host).

        On CUDA asynchronous, on ``save_stream`` after waiting for the current stream and
        the loads issued before: one ``index_select`` per layer tensor into a device
        staging buffer [n, page_bytes] (the current stream then waits for this device-side
        gather, so the pages, and a tiered pool's FP8 slots, may be rewritten, demoted or
        freed as soon as this returns), then one device -> host copy per run of
        consecutive host rows, which run on past the current stream and past later loads
        of other rows; records ``save_event`` (``wait_saves`` blocks on it).
        On CPU synchronous.
        Raises ValueError on lists of different lengths, an id out of range or a repeated
        host row."""
        n = self._check(device_pages, host_pages, repeated=host_pages, where="host rows")
        if n == 0:
            return
        pool = self.pool
        slots = None
        if pool.tiered:
            slots = [pool._slot_of.get(p, 0) for p in device_pages]  # 0: the zeroed dummy slot
            for h, s in zip(host_pages, slots, strict=True):
                self._flag[h] = s > 0
        if not self.cuda:
            staging = self._gather(device_pages, slots)
            self.data.index_copy_(0, torch.tensor(host_pages, dtype=torch.int64), staging)
            return
        self._in_flight_saves()  # forget the saves done (their events are reused)
        stream, event = self.save_stream, self._event()
        assert stream is not None and self.save_event is not None and self.load_event is not None
        current = torch.cuda.current_stream(pool.device)
        stream.wait_stream(current)
        stream.wait_event(self.load_event)  # the loads issued so far: their rows and pages come first
        with torch.cuda.stream(stream):  # staging allocated on (and freed to) this stream
            staging = self._gather(device_pages, slots)
            current.wait_stream(stream)  # later writes to the pages wait for the gather only
            for i, j, h in _runs(host_pages):
                self.data[h:h + j - i].copy_(staging[i:j], non_blocking=True)
            event.record(stream)
            self.save_event.record(stream)
        self._saving.append((event, frozenset(host_pages)))

    @torch.inference_mode()
    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        """Copy host rows -> logical device pages, row ``host_pages[i]`` into
        ``device_pages[i]``.

        Tiered pools: every page's INT4 codes and statistics are written; a page whose
        record has the FP8 flag gets an FP8 slot (``KVPool.assign_fp8_slots``, which may
        demote other full pages when slots run short) holding its FP8 bytes; the others
        lose any FP8 slot they had (``KVPool.release_fp8_slots``) and read as INT4.

        On CUDA on ``load_stream`` after waiting for the current stream (so slot moves and
        earlier readers of the pages come first) and for the saves still in flight to these
        rows (other saves run on beside it), records ``load_event`` after it.
        ``layerwise``: one ``kernels.kv_transfer`` launch per layer tensor, an event per
        layer handed to ``KVPool.expect_loads`` (the forward waits layer by layer).
        Otherwise one host -> device copy per run of consecutive host rows into a staging
        buffer, one ``index_copy_`` per layer tensor, and the current stream waits for the
        whole load. On CPU synchronous.
        Raises ValueError on lists of different lengths, an id out of range, a repeated
        device page or device page 0 (the dummy); RuntimeError if a tiered pool has fewer
        FP8 slots than flagged pages."""
        n = self._check(device_pages, host_pages, repeated=device_pages, where="device pages")
        if n == 0:
            return
        if 0 in device_pages:
            raise ValueError("device page 0 is the pool's zero dummy page; it cannot be loaded into")
        pool = self.pool
        fp8_rows: list[int] = []
        slots: list[int] = []
        if pool.tiered:
            fp8_rows = [i for i, h in enumerate(host_pages) if self._flag[h]]
            fp8_pages = [device_pages[i] for i in fp8_rows]
            pool.release_fp8_slots([p for i, p in enumerate(device_pages) if not self._flag[host_pages[i]]])
            pool.assign_fp8_slots(fp8_pages)
            slots = [pool._slot_of[p] for p in fp8_pages]
        if not self.cuda:
            staging = self.data.index_select(0, torch.tensor(host_pages, dtype=torch.int64))
            self._scatter(staging, device_pages, fp8_rows, slots)
            return
        stream = self.load_stream
        assert stream is not None and self.load_event is not None
        current = torch.cuda.current_stream(pool.device)
        stream.wait_stream(current)
        self._after_saves_to(host_pages)
        if self.layerwise:
            from radixlm.kernels.kv_transfer import load_page_columns  # Triton: CUDA hosts only

            with torch.cuda.stream(stream):  # index tensors allocated on (and freed to) this stream
                rows = torch.tensor(host_pages, dtype=torch.int64).to(pool.device, non_blocking=True)
                pages = torch.tensor(device_pages, dtype=torch.int64).to(pool.device, non_blocking=True)
                for columns, event in zip(self._columns, self._layer_events, strict=True):
                    for dst, offset in columns:
                        load_page_columns(self.data, rows, pages, dst, offset)
                    event.record(stream)
                self.load_event.record(stream)
            pool.expect_loads(self._layer_events)
            return
        with torch.cuda.stream(stream):
            staging = torch.empty((n, self.page_bytes), dtype=torch.uint8, device=pool.device)
            for i, j, h in _runs(host_pages):
                staging[i:j].copy_(self.data[h:h + j - i], non_blocking=True)
            self._scatter(staging, device_pages, fp8_rows, slots)
            self.load_event.record(stream)
        current.wait_stream(stream)

    def _event(self) -> torch.cuda.Event:
        """A CUDA event for one save: a spare one of a save known done, else a new one."""
        return self._spare_events.pop() if self._spare_events else torch.cuda.Event()

    def _after_saves_to(self, rows: Sequence[int]) -> None:
        """Make ``load_stream`` wait for the saves still in flight to any of ``rows`` (a page
        saved and then loaded back before its save landed)."""
        assert self.load_stream is not None
        for event, saved in self._in_flight_saves():
            if not saved.isdisjoint(rows):
                self.load_stream.wait_event(event)

    def _in_flight_saves(self) -> list[tuple[torch.cuda.Event, frozenset[int]]]:
        """The saves not known done (their events and rows); the others are forgotten and
        their events kept for reuse."""
        pending = []
        for event, rows in self._saving:
            if event.query():
                self._spare_events.append(event)
            else:
                pending.append((event, rows))
        self._saving = pending
        return pending

    def wait_saves(self) -> None:
        """Block until every save issued so far is in host memory, and every load issued so
        far has read its rows (so rows may be read or rewritten; a no-op on CPU)."""
        if self.save_event is not None:
            self.save_event.synchronize()
            self.load_event.synchronize()

    def _kernel_reads_host(self) -> bool:
        """Whether the load kernel can read this pinned memory on this device: one launch
        copying row 0 (unused, zeroed) into the zero dummy page 0's layer-0 K. A platform
        whose Triton refuses host pointers falls back to ``direct`` copies (logged)."""
        self.data[0].zero_()
        zero = torch.zeros(1, dtype=torch.int64, device=self.pool.device)
        try:
            from radixlm.kernels.kv_transfer import load_page_columns  # Triton: CUDA hosts only

            load_page_columns(self.data, zero, zero, self.records.layer_columns(0)[0][0], 0)
            torch.cuda.synchronize(self.pool.device)
        except (ImportError, ValueError, RuntimeError) as e:  # no Triton; "cannot be accessed from Triton"
            logger.warning("host KV tier: the load kernel cannot read pinned host memory here (%s); "
                           "loading with direct copies", e)
            return False
        return True

    # ---------------------------------------------------------------- raw rows
    def row(self, host_page: int) -> memoryview:
        """The page_bytes bytes of row ``host_page`` (format "B", a writable view of CPU
        memory, no copy), e.g. for a disk write, or a disk read's buffer (then
        ``adopt_row``); callers ``wait_saves()`` first.
        Raises IndexError for a row out of range."""
        self._check_row(host_page)
        return memoryview(self.data[host_page].numpy())

    def adopt_row(self, host_page: int) -> None:
        """Take row ``host_page`` as filled in place (``row(h)`` given to a disk read as its
        buffer, no copy): for int4 / mixed pools its FP8 flag byte is read into the host
        mirror. Raises IndexError for a row out of range, ValueError if the flag byte is
        neither 0 nor 1."""
        self._check_row(host_page)
        if self._flag_offset >= 0:
            flag = int(self.data[host_page, self._flag_offset])
            if flag not in (0, 1):
                raise ValueError(f"host KV row: FP8 flag byte {flag}, expected 0 or 1")
            self._flag[host_page] = flag

    # ----------------------------------------------------------------- helpers
    def _gather(self, device_pages: Sequence[int], slots: Sequence[int] | None) -> torch.Tensor:
        """Device staging [n, page_bytes] uint8 of the pages' records."""
        return self.records.gather(device_pages, slots)

    def _scatter(self, staging: torch.Tensor, device_pages: Sequence[int], fp8_rows: Sequence[int],
                 slots: Sequence[int]) -> None:
        """Staging [n, page_bytes] -> the pages (and rows ``fp8_rows`` -> FP8 ``slots``)."""
        self.records.scatter(staging, device_pages, fp8_rows, slots)

    def _check(self, device_pages: Sequence[int], host_pages: Sequence[int], repeated: Sequence[int],
               where: str) -> int:
        n = len(device_pages)
        if len(host_pages) != n:
            raise ValueError(f"{n} device pages but {len(host_pages)} host rows")
        if n == 0:
            return 0
        if min(device_pages) < 0 or max(device_pages) >= self.pool.num_pages:
            raise ValueError(f"device page out of range [0, {self.pool.num_pages})")
        if min(host_pages) < 0 or max(host_pages) >= self.num_pages:
            raise ValueError(f"host row out of range [0, {self.num_pages})")
        if len(set(repeated)) != n:
            raise ValueError(f"repeated {where}")
        return n

    def _check_row(self, host_page: int) -> None:
        if not 0 <= host_page < self.num_pages:
            raise IndexError(f"host row {host_page} out of range [0, {self.num_pages})")
