"""Page records: the page-first byte layout in which KV pages leave the device pool.

Dimension letters: L layers, S page size (tokens per page), K kv heads, D head dim, G INT4
value group, n pages of one call.

The device pool (``KVPool``) is layer-first: one tensor per layer, a page spread over L
of them. A record holds one logical page's bytes of every layer side by side, so that a
page moves as one contiguous row (to a host row, a file, another replica's pool):

    float / fp8_e4m3 pools, per layer l = 0 .. L-1:
        K[l] [S, K, D]   V[l] [S, K, D]           (pool element bytes; V in the logical
                                                   [S, K, D] order even where the pool
                                                   stores it channel-major)
    int4 / mixed pools:
        per layer  k_codes [S, K, D/2] uint8   k_stat [2, K, D] fp16
                   v_codes [S, K, D/2] uint8   v_stat [S, K, 2, D/G] fp16
        flag       1 byte: 1 = the page was in an FP8 slot, 0 = INT4 only
        per layer  K [S, K, D] e4m3   V [S, K, D] e4m3   (zeros when the flag is 0)

Records are raw bytes: meaningful to a pool of the same shape, format, FP8 scales, channel
means and key rotation. ``PageRecords`` gathers pages into a staging tensor [n, page_bytes]
(one ``index_select`` per layer tensor, straight into the staging columns) and scatters one
back (one ``index_copy_`` per layer tensor), on the current stream; the host tier
(``host_pool.HostKVPool``) and the peer tier (``peer_link.PeerKVLink``) move the staging.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlm.runtime.memory.kv_pool import KVPool, kv_page_bytes

__all__ = ["PageRecords", "record_bytes"]

# (a pool tensor with the page / slot dim first, byte offset in a row, bytes per page): the
# tensor in its own dtype where the record's columns can be viewed in it, else as uint8
_Segment = tuple[torch.Tensor, int, int]


def record_bytes(pool: KVPool) -> int:
    """Bytes of one page record (module doc), all layers of one page.

    Float / FP8 pools: 2 x L x S x K x D x element bytes (``kv_page_bytes``). int4 / mixed:
    the INT4 page with its statistics (``kv_page_bytes``) + 1 flag byte + the FP8 page,
    2 x L x S x K x D. Arithmetic on the pool's shape only (reads no tensor)."""
    args = (pool.model_dtype, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size)
    if not pool.tiered:
        return kv_page_bytes(pool.kv_cache_dtype, *args)
    return kv_page_bytes(pool.kv_cache_dtype, *args) + 1 + kv_page_bytes("fp8_e4m3", *args)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as uint8, same storage (last dim x element size; any strides for 1-byte
    dtypes, last dim contiguous otherwise)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _segments(tensors: Sequence[torch.Tensor], offset: int, row_bytes: int) -> tuple[list[_Segment], int]:
    """Consecutive row segments for ``tensors`` from ``offset`` -> (segments, end offset).
    A contiguous tensor of 2+ byte elements whose columns are aligned in a row of
    ``row_bytes`` keeps its dtype (a copy of 4-byte elements is 4x fewer of them: the CPU's
    scatter of a 4K-token SmolLM2 record 6x faster than byte by byte), others go as bytes."""
    out = []
    for t in tensors:
        raw = _as_bytes(t)
        size = raw[0].numel()
        item = t.element_size()
        native = item > 1 and t.is_contiguous() and offset % item == 0 and row_bytes % item == 0
        out.append((t if native else raw, offset, size))
        offset += size
    return out, offset


def _columns(staging: torch.Tensor, segment: _Segment) -> torch.Tensor:
    """The columns of ``segment`` in records ``staging`` [n, page_bytes], shaped as n pages
    of the segment's tensor (a view)."""
    t, offset, size = segment
    cols = staging[:, offset:offset + size]
    if t.dtype != torch.uint8:
        cols = cols.view(t.dtype)
    return cols.view(staging.shape[0], *t.shape[1:])


class PageRecords:
    """Gather / scatter of ``pool``'s pages as records (module doc).

    ``page_bytes``: bytes of one record; ``flag_offset``: the FP8 flag byte's offset in a
    record of an int4 / mixed pool (-1 for float / FP8 pools, which have none)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.page_bytes = record_bytes(pool)
        layers = range(pool.num_layers)
        if pool.tiered:
            per_page = [t[layer] for layer in layers
                        for t in (pool.k_codes, pool.k_stat, pool.v_codes, pool.v_stat)]  # fmt: skip
            self._page_segments, self.flag_offset = _segments(per_page, 0, self.page_bytes)
            per_slot = [t[layer] for layer in layers for t in (pool.k, pool.v)]
            self._slot_segments, end = _segments(per_slot, self.flag_offset + 1, self.page_bytes)
        else:
            per_page = [t[layer] for layer in layers for t in (pool.k, pool.v)]
            self._page_segments, end = _segments(per_page, 0, self.page_bytes)
            self.flag_offset, self._slot_segments = -1, []
        assert end == self.page_bytes, (end, self.page_bytes)

    def layer_columns(self, layer: int) -> list[tuple[torch.Tensor, int]]:
        """Float / FP8 pools: layer ``layer``'s pool tensors (K, then V: [P, S, K, D]) with
        the byte offset of their columns in a record (a record holds layer l's K then V
        after layers 0 .. l-1). Raises ValueError for int4 / mixed pools."""
        if self.pool.tiered:
            raise ValueError("int4 / mixed records are not laid out layer by layer")
        pool = self.pool
        return [(t[layer], offset) for t, (_, offset, _) in
                zip((pool.k, pool.v), self._page_segments[2 * layer:2 * layer + 2], strict=True)]

    def gather(self, device_pages: Sequence[int], slots: Sequence[int] | None = None) -> torch.Tensor:
        """The records of ``device_pages`` as a new uint8 tensor [n, page_bytes] on the pool's
        device, enqueued on the current stream. ``slots`` (int4 / mixed pools only): each
        page's FP8 slot, 0 for none (the zeroed dummy slot); sets the flag bytes."""
        pool, n = self.pool, len(device_pages)
        staging = torch.empty((n, self.page_bytes), dtype=torch.uint8, device=pool.device)
        index = torch.tensor(device_pages, dtype=torch.int64).to(pool.device, non_blocking=True)
        for segment in self._page_segments:
            torch.index_select(segment[0], 0, index, out=_columns(staging, segment))
        if slots is not None:
            flags = torch.tensor([s > 0 for s in slots], dtype=torch.uint8)
            staging[:, self.flag_offset].copy_(flags.to(pool.device, non_blocking=True))
            index = torch.tensor(slots, dtype=torch.int64).to(pool.device, non_blocking=True)
            for segment in self._slot_segments:
                torch.index_select(segment[0], 0, index, out=_columns(staging, segment))
        return staging

    def scatter(self, staging: torch.Tensor, device_pages: Sequence[int], fp8_rows: Sequence[int] = (),
                slots: Sequence[int] = ()) -> None:
        """Write records ``staging`` (uint8 [n, page_bytes] on the pool's device) into
        ``device_pages`` (row i -> page i), and rows ``fp8_rows`` into FP8 ``slots`` (int4 /
        mixed pools), on the current stream. The caller checks the ids."""
        device, n = self.pool.device, len(device_pages)
        index = torch.tensor(device_pages, dtype=torch.int64).to(device, non_blocking=True)
        for segment in self._page_segments:
            segment[0].index_copy_(0, index, _columns(staging, segment))
        if not fp8_rows:
            return
        if len(fp8_rows) < n:
            staging = staging.index_select(0, torch.tensor(fp8_rows, dtype=torch.int64).to(device, non_blocking=True))
        index = torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
        for segment in self._slot_segments:
            segment[0].index_copy_(0, index, _columns(staging, segment))
