"""ForwardBatch: everything one forward pass needs, as tensors.

Dimension letters: B requests, T new tokens in the pass (sum of extend lengths), N rows
whose logits are wanted, S page size, Pmax pages per request (padded).

A pass mixes requests freely: a decode request contributes 1 token, a prefill (or a
chunk of one) contributes many. For request b:

    positions:  0 ............ prefix_len ............ prefix_len + extend_len = seq_len
                |<- already in KV cache ->|<---- new tokens, computed now ---->|
                (radix-cache hit, earlier  (their K/V are written to the pages
                 chunks, earlier decodes)   at slot page_table[b, t // S] * S + t % S)

Token i of the flat ``input_ids`` belongs to request b where cu_extend[b] <= i < cu_extend[b+1].
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ForwardBatch", "to_device"]


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a CPU tensor to ``device`` without making the host wait for the device.

    A copy from pageable host memory makes the CUDA driver synchronise with the stream
    first (the host would wait for every kernel queued before it, which defeats overlap
    scheduling); the copy goes through pinned memory (PyTorch's caching host allocator)
    instead. On the CPU the tensor is returned as is.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _packed(parts: Sequence[Sequence[int]], typecode: str, device: torch.device | str) -> list[torch.Tensor]:
    """``parts`` as 1-D tensors (int64 for typecode "q", int32 for "i") on ``device``:
    views of one buffer, copied there at once (``to_device``)."""
    flat = array(typecode)
    for part in parts:
        flat.extend(part)
    if not flat:
        flat.append(0)  # torch.frombuffer needs a non-empty buffer; the views stay empty
    whole = to_device(torch.frombuffer(flat, dtype=torch.int64 if typecode == "q" else torch.int32), device)
    out, offset = [], 0
    for part in parts:
        out.append(whole[offset : offset + len(part)])
        offset += len(part)
    return out


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    page_table: torch.Tensor  # [B, Pmax] int32, padded with dummy page 0
    prefix_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32 = prefix_lens + extend_lens
    cu_extend: torch.Tensor  # [B+1] int32, cumulative extend lengths (cu_extend[0] = 0)
    out_slots: torch.Tensor  # [T] int64, flat KV slot (page * S + offset) of each new token
    logits_rows: torch.Tensor  # [N] int64, indices into [T] whose logits are computed
    page_size: int
    # Host copies for code that loops over requests (reference backend, sampling).
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # Exact attention sink (pools with sink slots, ``KVPool`` doc): the slot each request
    # reads position 0 from (-1: its FP8 page), and the sink slots this pass writes.
    sink_slots: torch.Tensor | None = None  # [B] int32
    sink_rows: torch.Tensor | None = None  # [W] int64, rows of [T] at position 0 to write
    sink_write_slots: torch.Tensor | None = None  # [W] int64, their slots
    # logits_rows is every row in order (0 .. T-1; a decode step): the model skips gathering them.
    logits_all: bool = False
    # The page table on the host, [B, Pmax] int32 (a view of the buffer copied to page_table):
    # cascade decode groups requests by their shared pages (``plan_shared_prefixes``).
    page_table_host: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        """True when every request contributes exactly one token (pure decode step)."""
        return all(n == 1 for n in self.extend_lens_cpu)

    @classmethod
    def build(
        cls,
        tokens: list[list[int]],
        prefix_lens: list[int],
        page_tables: list[list[int]],
        logits_rows: list[int],
        page_size: int,
        device: torch.device | str,
        sink_slots: list[int] | None = None,
        sink_writes: list[tuple[int, int]] | None = None,
    ) -> ForwardBatch:
        """Build from host lists: ``tokens[b]`` are request b's new token ids, which sit at
        positions ``prefix_lens[b] ..``; ``page_tables[b]`` must cover every position up to
        ``prefix_lens[b] + len(tokens[b])``; ``logits_rows`` index the flat token list.
        ``sink_slots[b]`` is request b's sink slot (-1 none) and ``sink_writes`` the
        (flat row at position 0, slot) pairs this pass writes (``KVPool.sink_slot``).

        Raises ValueError if a page table is too short or a request has no new tokens.
        """
        extend_lens = [len(t) for t in tokens]
        if any(n == 0 for n in extend_lens):
            raise ValueError("every request in a ForwardBatch needs at least one new token")
        # Every int64 vector goes into one host buffer and every int32 one (the page table
        # included) into another: two host-to-device copies, not one per field (each a
        # pinned block and a copy on CUDA). A request's KV slots are one range per page it
        # writes, not one Python expression per token (4096 tokens: 256 ranges).
        flat_ids, positions, slots = array("q"), array("q"), array("q")
        for toks, start, table in zip(tokens, prefix_lens, page_tables, strict=True):
            end = start + len(toks)
            if len(table) * page_size < end:
                raise ValueError(f"page table of {len(table)} pages cannot hold {end} tokens")
            flat_ids.extend(toks)
            positions.extend(range(start, end))
            first, last = start // page_size, (end - 1) // page_size
            for p in range(first, last + 1):
                base = table[p] * page_size - p * page_size  # slot of position t: base + t
                slots.extend(range(base + max(start, p * page_size), base + min(end, (p + 1) * page_size)))
        writes = sink_writes or []
        int64 = [flat_ids, positions, slots, logits_rows, [r for r, _ in writes], [s for _, s in writes]]
        b, max_pages = len(tokens), max(len(t) for t in page_tables)
        cu = [0]
        for n in extend_lens:
            cu.append(cu[-1] + n)
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
        int32 = [prefix_lens, extend_lens, seq_lens, cu, sink_slots or []]
        table_flat, pad = array("i"), [0] * max_pages
        for pages in page_tables:  # padded with the dummy page 0
            table_flat.extend(pages)
            table_flat.extend(pad[len(pages):])
        (ids_t, pos_t, slots_t, rows_t, sink_rows_t, sink_write_t), (
            prefix_t, extend_t, seq_t, cu_t, sink_t, table_t) = (
            _packed(int64, "q", device), _packed([*int32, table_flat], "i", device))
        return cls(
            input_ids=ids_t,
            positions=pos_t,
            page_table=table_t.view(b, max_pages),
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            seq_lens=seq_t,
            cu_extend=cu_t,
            out_slots=slots_t,
            logits_rows=rows_t,
            page_size=page_size,
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=extend_lens,
            sink_slots=None if sink_slots is None else sink_t,
            sink_rows=sink_rows_t if writes else None,
            sink_write_slots=sink_write_t if writes else None,
            logits_all=len(logits_rows) == len(flat_ids) and list(logits_rows) == list(range(len(flat_ids))),
            page_table_host=np.frombuffer(table_flat, dtype=np.int32).reshape(b, max_pages),
        )
