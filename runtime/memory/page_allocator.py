"""The page allocator: page ids of one KV pool, handed out and taken back. Torch-free.

Page 0 is reserved as a dummy (padding for batched page tables and CUDA graphs), so a pool
of ``num_pages`` pages hands out ids 1..num_pages-1.
"""

from __future__ import annotations

__all__ = ["PageAllocator"]


class PageAllocator:
    """Hands out page ids 1..num_pages-1 (page 0 is the dummy page).

    Contract: ``alloc(n)`` returns exactly ``n`` distinct ids or ``None`` (nothing taken)
    when fewer than ``n`` are free; ``free(ids)`` gives ids back and raises ValueError on
    a double free (an id already free or repeated in ``ids``) or an id out of range, and
    then frees nothing. Not thread-safe (the scheduler owns it).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("a pool needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        # Pop from the end: low ids first, so tests see predictable ids.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = bytearray(num_pages)
        for p in self._free:
            self._is_free[p] = 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Allocatable pages (excludes the dummy page)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        ids = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        for p in ids:
            self._is_free[p] = 0
        return ids[::-1]

    def free(self, ids: list[int]) -> None:
        # Check every id before changing anything: a refused call frees nothing (marking
        # the ids before the bad one free in the bitmap only leaked them for good).
        seen: set[int] = set()
        for p in ids:
            if not 0 < p < self.num_pages:
                raise ValueError(f"page id {p} out of range")
            if self._is_free[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in ids:
            self._is_free[p] = 1
        self._free.extend(reversed(ids))

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def free_pages(self) -> set[int]:
        return set(self._free)

    def check_invariants(self) -> None:
        """Free list has no duplicates, never holds page 0, matches the free bitmap."""
        free = self._free
        assert len(set(free)) == len(free), "duplicate page in free list"
        assert 0 not in free, "dummy page 0 in free list"
        assert sum(self._is_free) == len(free), "free bitmap out of sync with free list"
