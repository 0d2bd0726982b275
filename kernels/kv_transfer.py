"""Triton page load from page-first records: one layer tensor's pages from host rows.

What: for i in 0..n-1, ``dst[pages[i]] = records[rows[i], offset : offset + B]`` read as
``dst``'s dtype in its logical [S, K, D] order, in one launch. ``records`` is the host
tier's pinned page-first rows (``memory.page_records``: all layers of one page side by
side), ``dst`` one layer's K or V pool tensor (layer-first). The kernel reads the pinned
host memory directly over PCIe (zero-copy: CUDA's unified virtual addressing maps pinned
pages into the device's address space), so a load needs no device staging buffer, and
one layer's pages can be loaded by themselves while the forward computes the layers
before it (``memory.host_pool.HostKVPool``, ``--hicache-io-backend kernel``). The same
idea as SGLang's HiCache "kernel" I/O backend; the layer-by-layer overlap as in
LMCache / SGLang's layer-wise KV transfer.

Dimension letters: R host rows, B bytes of one row (a page record), n pages of one call,
P device pages, S page size (tokens), K kv heads, D head dim.

Layout::

    records   [R, B]        uint8, C-contiguous (pinned host memory on CUDA)
    rows      [n]           int32 or int64, host row of each page
    pages     [n]           int32 or int64, device page of each row
    dst       [P, S, K, D]  any dtype; a contiguous page [S, K, D] (fast path: moved as
                            4-byte words), or a 1-byte dtype with any strides (an FP8 V pool
                            stored channel-major, ``reference.channel_major_pool``)

Grid: (n, blocks of 1024 words of one page); each program copies one block of one page.

Limits: ``offset`` + one page's bytes <= B; ``dst`` contiguous per page unless 1-byte.
Reference: ``PageRecords.scatter`` (index_copy from a device staging buffer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["load_page_columns"]

BLOCK = 1024  # words per program


@triton.jit
def _load_columns_kernel(
    Src, Rows, Pages, Dst, src_row, src_col, dst_page, stride_s, stride_k, stride_d,
    NUMEL: tl.constexpr, DIM_K: tl.constexpr, DIM_D: tl.constexpr, CONTIG: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    row = tl.load(Rows + i).to(tl.int64)
    page = tl.load(Pages + i).to(tl.int64)
    x = tl.load(Src + row * src_row + src_col + offs, mask=mask)
    if CONTIG:
        dst = Dst + page * dst_page + offs
    else:  # logical [S, K, D] order of the record -> the pool's strides
        s = offs // (DIM_K * DIM_D)
        k = (offs // DIM_D) % DIM_K
        d = offs % DIM_D
        dst = Dst + page * dst_page + s * stride_s + k * stride_k + d * stride_d
    tl.store(dst, x, mask=mask)


def load_page_columns(records: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, dst: torch.Tensor,
                      offset: int) -> None:
    """``dst[pages[i]] = records[rows[i], offset:offset + page bytes]`` viewed as ``dst``'s
    dtype and logical page shape [S, K, D] (module doc), enqueued on the current stream.

    ``records``: uint8 [R, B] C-contiguous, on the host (pinned, for a CUDA ``dst``) or on
    ``dst``'s device; ``rows`` / ``pages``: [n] int32 / int64 on ``dst``'s device; ``dst``:
    [P, S, K, D]; ``offset``: bytes into each row. The caller checks the ids.
    Raises ValueError if the columns do not fit in a row, or ``dst`` has pages that are not
    contiguous and an element of more than one byte."""
    n = rows.shape[0]
    if n == 0:
        return
    page = dst[0]  # [S, K, D]
    item = dst.element_size()
    nbytes = page.numel() * item
    row_bytes = records.shape[1]
    if offset < 0 or offset + nbytes > row_bytes:
        raise ValueError(f"columns [{offset}, {offset + nbytes}) do not fit a record of {row_bytes} bytes")
    contig = page.is_contiguous()
    if not contig and item != 1:
        raise ValueError("a pool tensor of non-contiguous pages needs 1-byte elements")
    raw = dst.view(torch.uint8)  # [P, S, K, D * item], the pool's strides in bytes
    src = records
    if contig and nbytes % 4 == 0 and offset % 4 == 0 and row_bytes % 4 == 0 and raw.shape[-1] % 4 == 0 \
            and raw.stride(0) % 4 == 0:
        src, raw = records.view(torch.int32), raw.view(torch.int32)  # 4-byte words: wider loads
    unit = raw.element_size()
    numel = nbytes // unit
    _, dim_k, dim_d = page.shape
    _load_columns_kernel[(n, triton.cdiv(numel, BLOCK))](
        src, rows, pages, raw, row_bytes // unit, offset // unit, raw.stride(0), raw.stride(1), raw.stride(2),
        raw.stride(3), NUMEL=numel, DIM_K=dim_k, DIM_D=dim_d, CONTIG=contig, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
