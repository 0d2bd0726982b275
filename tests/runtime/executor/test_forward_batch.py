"""ForwardBatch.build against the definitions of its fields, computed the slow way."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.executor.forward_batch import ForwardBatch


@st.composite
def batches(draw):
    """(tokens, prefix_lens, page_tables, logits_rows, page_size, sink_slots, sink_writes)."""
    page_size = draw(st.sampled_from([1, 4, 16]))
    b = draw(st.integers(1, 5))
    tokens, prefix_lens, tables = [], [], []
    for _ in range(b):
        n = draw(st.integers(1, 40))
        start = draw(st.integers(0, 50))
        tokens.append(draw(st.lists(st.integers(-1, 2**40), min_size=n, max_size=n)))
        prefix_lens.append(start)
        pages = -(-(start + n) // page_size) + draw(st.integers(0, 2))  # maybe wider than needed
        tables.append(draw(st.lists(st.integers(1, 10**6), min_size=pages, max_size=pages, unique=True)))
    total = sum(len(t) for t in tokens)
    rows = sorted(draw(st.sets(st.integers(0, total - 1), min_size=1)))
    sinks = draw(st.none() | st.lists(st.integers(-1, 100), min_size=b, max_size=b))
    writes = draw(st.lists(st.tuples(st.integers(0, total - 1), st.integers(0, 100)), max_size=3))
    return tokens, prefix_lens, tables, rows, page_size, sinks, writes


@settings(max_examples=150, deadline=None)
@given(batches())
def test_build_matches_the_fields_definitions(case) -> None:
    tokens, prefix_lens, tables, rows, size, sinks, writes = case
    batch = ForwardBatch.build(tokens, prefix_lens, tables, rows, size, "cpu", sinks, writes)
    positions = [p for start, toks in zip(prefix_lens, tokens, strict=True) for p in range(start, start + len(toks))]
    owner = [b for b, toks in enumerate(tokens) for _ in toks]
    assert batch.input_ids.tolist() == [t for toks in tokens for t in toks]
    assert batch.positions.tolist() == positions
    assert batch.out_slots.tolist() == [tables[b][p // size] * size + p % size
                                        for b, p in zip(owner, positions, strict=True)]
    width = max(len(t) for t in tables)
    assert batch.page_table.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert batch.prefix_lens.tolist() == prefix_lens
    assert batch.extend_lens.tolist() == [len(t) for t in tokens]
    assert batch.seq_lens.tolist() == [p + len(t) for p, t in zip(prefix_lens, tokens, strict=True)]
    assert batch.cu_extend.tolist() == [sum(len(t) for t in tokens[:b]) for b in range(len(tokens) + 1)]
    assert batch.logits_rows.tolist() == rows
    assert batch.logits_all == (rows == list(range(len(positions))))
    assert (batch.sink_slots is None) == (sinks is None)
    if sinks is not None:
        assert batch.sink_slots.tolist() == sinks and batch.sink_slots.dtype == torch.int32
    assert (batch.sink_rows is None) == (not writes)
    if writes:
        assert batch.sink_rows.tolist() == [r for r, _ in writes]
        assert batch.sink_write_slots.tolist() == [s for _, s in writes]
    for name, dtype in (("input_ids", torch.int64), ("positions", torch.int64), ("out_slots", torch.int64),
                        ("logits_rows", torch.int64), ("page_table", torch.int32), ("prefix_lens", torch.int32),
                        ("extend_lens", torch.int32), ("seq_lens", torch.int32), ("cu_extend", torch.int32)):
        t = getattr(batch, name)
        assert t.dtype == dtype and t.is_contiguous(), name


def test_build_refuses_a_short_table_and_an_empty_request() -> None:
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        ForwardBatch.build([[1, 2]], [3], [[7]], [1], 4, "cpu")
    with pytest.raises(ValueError, match="at least one new token"):
        ForwardBatch.build([[1], []], [0, 0], [[1], [2]], [0], 4, "cpu")


def test_an_input_written_in_place_changes_only_that_field() -> None:
    """The fields are views of shared buffers: the model runner writes in-flight input ids
    into ``input_ids`` (overlap), which must not touch the positions or slots next to it."""
    batch = ForwardBatch.build([[5, -1], [-1]], [0, 3], [[2], [3]], [1, 2], 4, "cpu")
    batch.input_ids[torch.tensor([1, 2])] = torch.tensor([8, 9])
    assert batch.input_ids.tolist() == [5, 8, 9]
    assert batch.positions.tolist() == [0, 1, 3] and batch.out_slots.tolist() == [8, 9, 15]
