"""Cascade decode (kernels/decode_attention.py ``plan_shared_prefixes`` + ``shared=``):
requests whose page tables share leading pages read them once per chunk.

The plan on hand-made page tables (groups by first page, balanced chunks, the least
shared prefix of a chunk, requests left out), then the kernels against
``reference.paged_attention`` under the interpreter: fp32, pages shared the way the radix
cache shares them (a later request's table starts with an earlier one's pages), GQA ratios
1 / 3 / 4, page sizes 4 and 16, 1 and 3 suffix splits, 1 and 2 prefix splits, outputs and
scratch poisoned with NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import (  # noqa: E402
    PREFIX_ROWS,
    DecodeConfig,
    DecodeWorkspace,
    decode_attention,
    plan_shared_prefixes,
    shared_prefix_bound,
)

SMALL = DecodeConfig(block_n=16, num_warps=2, num_stages=1)


def _table(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    return np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)


def test_the_plan_groups_rows_by_their_shared_leading_pages() -> None:
    shared = list(range(10, 16))  # 6 pages
    rows = [
        shared + [40, 41],  # 0: shares 6 pages with 1, 3
        [50, 51, 52],  # 1 page-set of its own
        shared + [42],  # 2
        shared[:4] + [60, 61, 62, 63],  # 3: shares 4 with the group's longest
        [70, 71, 72, 73, 74],  # 4: alone
        shared[:2] + [80],  # 5: 2 shared pages, under min_shared_pages
    ]
    lens = np.array([8 * 4 + 1, 3 * 4, 7 * 4 + 1, 8 * 4, 5 * 4 + 1, 3 * 4], dtype=np.int64)
    plan = plan_shared_prefixes(_table(rows), lens, page_size=4, group=4, min_shared_pages=3)
    assert plan is not None
    # one chunk: rows 0 and 2 (6 pages) then row 3 (4 pages): the chunk shares 4 pages
    assert plan.chunk_rows.shape == (1, PREFIX_ROWS // 4)
    assert plan.chunk_rows[0, :3].tolist() == [0, 2, 3] and (plan.chunk_rows[0, 3:] == -1).all()
    assert plan.chunk_keys.tolist() == [16]
    assert plan.skip_lens.tolist() == [16, 0, 16, 16, 0, 0]
    assert plan.saved_keys == 2 * 16


def test_a_page_that_holds_the_last_key_is_never_shared() -> None:
    # both tables name pages 1..4; request 1's last key sits in page 4 (its 13th key)
    rows = [[1, 2, 3, 4, 9], [1, 2, 3, 4]]
    plan = plan_shared_prefixes(_table(rows), np.array([18, 13]), page_size=4, group=1, min_shared_pages=1)
    assert plan is not None and plan.chunk_keys.tolist() == [12]  # (13 - 1) // 4 = 3 whole pages
    assert plan.skip_lens.tolist() == [12, 12]


def test_big_groups_are_cut_into_balanced_chunks_and_singles_are_dropped() -> None:
    members = PREFIX_ROWS // 8  # G = 8
    n = 2 * members + 1
    rows = [[7, 8, 9, 100 + i] for i in range(n)] + [[5, 6, 7, 8]]
    lens = np.array([4 * 16 + 1] * n + [65])
    plan = plan_shared_prefixes(_table(rows), lens, page_size=16, group=8, min_shared_pages=2)
    assert plan is not None
    sizes = sorted(int((r >= 0).sum()) for r in plan.chunk_rows)
    assert members == 8 and sizes == [5, 6, 6]  # 17 rows in chunks of at most 8
    assert plan.chunk_keys.tolist() == [48] * 3
    assert plan.skip_lens[-1] == 0  # the other first page: a group of one
    assert plan.saved_keys == (n - 3) * 48
    assert plan_shared_prefixes(_table(rows[-1:] + rows[:1]), np.array([65, 65]), 16, 8) is None


def test_a_page_every_prompt_starts_with_does_not_make_one_group() -> None:
    """A chat template's opening page (1) begins every table: two system prompts (pages
    10.. and 20..) still make two chunks, and prompts sharing only that page none."""
    rows = [[1, 10, 11, 12, 13, 50 + i] for i in range(3)] + [[1, 20, 21, 22, 23, 60 + i] for i in range(2)]
    rows += [[1, 30 + i, 40 + i] for i in range(4)]
    lens = np.array([len(r) * 4 for r in rows])
    plan = plan_shared_prefixes(_table(rows), lens, page_size=4, group=4, min_shared_pages=3)
    assert plan is not None and plan.chunk_keys.tolist() == [20, 20]
    assert sorted(sorted(r for r in c.tolist() if r >= 0) for c in plan.chunk_rows) == [[0, 1, 2], [3, 4]]
    assert plan.saved_keys == 3 * 20 and shared_prefix_bound(rows, 4, 3) >= plan.saved_keys
    assert shared_prefix_bound(rows[5:], 4, 2) == 0  # only page 1 in common


@st.composite
def _tables(draw):
    """Page tables as a radix cache hands them out: a few prefixes (page runs), each request
    taking some leading part of one (or none) and then pages of its own."""
    page_size = draw(st.sampled_from([1, 4, 16]))
    prefixes = [list(range(1000 * (i + 1), 1000 * (i + 1) + draw(st.integers(1, 12)))) for i in range(3)]
    tables, lens, fresh = [], [], 1
    for _ in range(draw(st.integers(1, 40))):
        base = draw(st.sampled_from([[], *prefixes]))
        take = draw(st.integers(0, len(base)))
        own = draw(st.integers(1, 5))
        pages = base[:take] + list(range(fresh, fresh + own))
        fresh += own
        tables.append(pages)
        lens.append(draw(st.integers((len(pages) - 1) * page_size + 1, len(pages) * page_size)))
    return tables, np.array(lens), page_size, draw(st.sampled_from([1, 3, 4, 8])), draw(st.integers(1, 3))


@settings(max_examples=150, deadline=None)
@given(_tables())
def test_every_chunk_shares_its_keys_and_the_bound_holds(case) -> None:
    tables, lens, page_size, group, least = case
    plan = plan_shared_prefixes(_table(tables), lens, page_size, group, min_shared_pages=least)
    bound = shared_prefix_bound(tables, page_size, least)
    if plan is None:
        return
    members = PREFIX_ROWS // {1: 1, 3: 4, 4: 4, 8: 8}[group]
    assert plan.chunk_rows.shape[1] == members and plan.saved_keys <= bound
    seen: list[int] = []
    saved = 0
    for rows, keys in zip(plan.chunk_rows.tolist(), plan.chunk_keys.tolist(), strict=True):
        rows = [r for r in rows if r >= 0]
        assert len(rows) >= 2 and keys >= least * page_size and keys % page_size == 0
        pages = keys // page_size
        assert all(tables[r][:pages] == tables[rows[0]][:pages] for r in rows)  # truly the same pages
        assert all(keys <= lens[r] - 1 for r in rows)  # the last key stays out
        assert all(plan.skip_lens[r] == keys for r in rows)
        seen += rows
        saved += (len(rows) - 1) * keys
    assert len(seen) == len(set(seen)) and saved == plan.saved_keys
    assert all(plan.skip_lens[r] == 0 for r in range(len(tables)) if r not in seen)


def _shared_case(paged_case, page_size: int, num_heads: int, num_kv_heads: int):
    """Seven decode requests; 1, 2, 5 start with request 0's pages, 6 with request 3's."""
    lens = [70, 75, 90, 40, 3, 66, 81]
    case = paged_case([(n - 1, 1) for n in lens], num_heads, num_kv_heads, 16, page_size, seed=page_size)
    table = case.page_table.clone()
    for row, src, pages in ((1, 0, 64 // page_size), (2, 0, 68 // page_size), (5, 0, 64 // page_size),
                            (6, 3, 36 // page_size)):  # fmt: skip
        table[row, :pages] = table[src, :pages]
    case.page_table = table
    return case


@pytest.mark.parametrize(("page_size", "num_heads", "num_kv_heads"), [(4, 8, 2), (16, 6, 2), (4, 4, 4)])
@pytest.mark.parametrize(("num_splits", "prefix_splits"), [(1, 1), (3, 2)])
def test_cascade_decode_matches_reference(paged_case, relerr, page_size, num_heads, num_kv_heads, num_splits,
                                          prefix_splits) -> None:  # fmt: skip
    case = _shared_case(paged_case, page_size, num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    plan = plan_shared_prefixes(case.page_table.cpu().numpy(), case.seq_lens.cpu().numpy(), page_size, group,
                                min_shared_pages=1)  # fmt: skip
    assert plan is not None and sorted(plan.skip_lens.nonzero().flatten().tolist()) == [0, 1, 2, 3, 5, 6]
    plan = plan.to(case.q.device, prefix_splits)
    batch, _, head_dim = case.q.shape
    out = torch.full_like(case.q, float("nan"))
    work = DecodeWorkspace.allocate(batch, num_heads, num_splits + prefix_splits, head_dim, case.q.device)
    work.partial_out.fill_(float("nan"))
    work.partial_lse.fill_(float("nan"))
    decode_attention(case.q, case.k_pool, case.v_pool, case.page_table, case.seq_lens, case.scale,
                     num_splits=num_splits, out=out, workspace=work, config=SMALL, shared=plan)  # fmt: skip
    ref = reference.paged_attention(case.q, case.k_pool, case.v_pool, case.page_table, case.prefix, case.extend,
                                    case.scale)  # fmt: skip
    assert relerr(out, ref) < 1e-5


def test_cascade_decode_refuses_fp8_pools(paged_case) -> None:
    case = _shared_case(paged_case, 4, 8, 2)
    plan = plan_shared_prefixes(case.page_table.cpu().numpy(), case.seq_lens.cpu().numpy(), 4, 4, min_shared_pages=1)
    pool = case.k_pool.nan_to_num(0.0).to(torch.float8_e4m3fn)
    scales = torch.ones(2, dtype=torch.float32, device=pool.device)
    with pytest.raises(AssertionError, match="float pools only"):
        decode_attention(case.q, pool, pool, case.page_table, case.seq_lens, case.scale, num_splits=1,
                         k_scale=scales, v_scale=scales, shared=plan.to(pool.device, 1))  # fmt: skip
