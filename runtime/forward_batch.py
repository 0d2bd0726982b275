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

from dataclasses import dataclass

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
        flat_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for toks, start, table in zip(tokens, prefix_lens, page_tables, strict=True):
            end = start + len(toks)
            if len(table) * page_size < end:
                raise ValueError(f"page table of {len(table)} pages cannot hold {end} tokens")
            flat_ids.extend(toks)
            pos = range(start, end)
            positions.extend(pos)
            slots.extend(table[t // page_size] * page_size + t % page_size for t in pos)
        max_pages = max(len(t) for t in page_tables)
        table = torch.zeros((len(tokens), max_pages), dtype=torch.int32)
        for b, pages in enumerate(page_tables):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        cu = [0]
        for n in extend_lens:
            cu.append(cu[-1] + n)

        def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype), device)

        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
        writes = sink_writes or []
        return cls(
            input_ids=t(flat_ids, torch.int64),
            positions=t(positions, torch.int64),
            page_table=to_device(table, device),
            prefix_lens=t(prefix_lens, torch.int32),
            extend_lens=t(extend_lens, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            cu_extend=t(cu, torch.int32),
            out_slots=t(slots, torch.int64),
            logits_rows=t(logits_rows, torch.int64),
            page_size=page_size,
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=extend_lens,
            sink_slots=None if sink_slots is None else t(sink_slots, torch.int32),
            sink_rows=t([r for r, _ in writes], torch.int64) if writes else None,
            sink_write_slots=t([s for _, s in writes], torch.int64) if writes else None,
            logits_all=len(logits_rows) == len(flat_ids) and list(logits_rows) == list(range(len(flat_ids))),
        )
