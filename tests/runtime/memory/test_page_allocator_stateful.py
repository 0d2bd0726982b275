"""Random alloc / free sequences on PageAllocator checked against a naive model.

Naive model: ``owned`` is the set of page ids handed out and not given back; every
other id in 1..num_pages-1 is free. ``alloc(n)`` must return n distinct free ids (or
None and take nothing when fewer are free); ``free`` of an owned id gives it back; a
double free, an id out of range (including the dummy page 0) or a repeated id raises
ValueError and changes nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm.runtime.memory.page_allocator import PageAllocator


class PageAllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc: PageAllocator | None = None
        self.owned: set[int] = set()

    @initialize(num_pages=st.integers(2, 12))
    def make_allocator(self, num_pages: int) -> None:
        self.alloc = PageAllocator(num_pages)
        self.all_ids = set(range(1, num_pages))

    @property
    def free(self) -> set[int]:
        return self.all_ids - self.owned

    # --------------------------------------------------------------------- rules

    @rule(n=st.integers(0, 14))
    def alloc_pages(self, n: int) -> None:
        ids = self.alloc.alloc(n)
        if n > len(self.free):
            assert ids is None
            return
        assert ids is not None and len(ids) == n
        assert len(set(ids)) == n, f"duplicate ids {ids}"
        assert set(ids) <= self.free, f"{ids} not all free (free: {self.free})"
        self.owned |= set(ids)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_owned(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.owned)), min_size=1, unique=True))
        self.alloc.free(ids)
        self.owned -= set(ids)

    @rule(data=st.data())
    def free_invalid(self, data: st.DataObject) -> None:
        """A list with one bad id (anywhere) is refused whole: nothing is freed."""
        size = self.alloc.num_pages
        bad = data.draw(st.one_of(
            st.sampled_from([0, -1, size, size + 5]),  # dummy page, out of range
            st.sampled_from(sorted(self.free)) if self.free else st.just(0),  # double free
        ))
        good = data.draw(st.lists(st.sampled_from(sorted(self.owned)), unique=True)) if self.owned else []
        ids = data.draw(st.permutations(good + [bad]))
        with pytest.raises(ValueError):
            self.alloc.free(ids)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_same_id_twice_in_one_call(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(sorted(self.owned)))
        with pytest.raises(ValueError, match="double free"):
            self.alloc.free([page, page])

    # ---------------------------------------------------------------- invariants

    @invariant()
    def allocator_matches_model(self) -> None:
        if self.alloc is None:
            return
        self.alloc.check_invariants()
        assert self.alloc.free_pages() == self.free
        assert self.alloc.num_free == len(self.free)
        assert self.alloc.num_free + len(self.owned) == self.alloc.capacity
        assert all(self.alloc.is_free(p) == (p not in self.owned) for p in self.all_ids)


PageAllocatorMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_page_allocator_against_model = PageAllocatorMachine.TestCase


@pytest.mark.parametrize("bad_call", [[1, 1], [1, 2, 2], [2, 1, 0], [1, 5], [2, 3]])
def test_refused_free_frees_nothing(bad_call: list[int]) -> None:
    """Regression (found by the machine above): ``free`` used to mark the ids before the
    bad one free in the bitmap without returning them to the free list, so a refused call
    leaked those pages for good (and a later free of them raised "double free")."""
    alloc = PageAllocator(5)
    assert alloc.alloc(2) == [1, 2]  # 3 and 4 stay free
    with pytest.raises(ValueError):
        alloc.free(bad_call)
    alloc.check_invariants()
    assert alloc.free_pages() == {3, 4}
    assert not alloc.is_free(1) and not alloc.is_free(2)
    alloc.free([1, 2])
    alloc.check_invariants()
    assert alloc.free_pages() == {1, 2, 3, 4}
