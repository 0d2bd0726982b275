"""Page-aligned radix tree mapping token-id prefixes to opaque KV page ids.

Torch-free and allocator-free: the tree never allocates or frees pages itself. It only
records which page ids hold which token prefix and hands page ids back (from ``insert``
duplicates, ``evict`` and ``reset``) for the caller to free.

Terms: S = ``page_size``. Every node's key (the edge from its parent) is a tuple of token
ids whose length is a multiple of S, and the node holds one page id per S tokens:

    root
     |-- (a b)-> [a b | c d]  pages [p0 p1]
     |               `-- (e f)-> [e f]  pages [p2]
     `-- (x y)-> [x y]  pages [p3]

Children are keyed by the first page of their key, ``child.key[:S]``, shown as ``(a b)``.
Only whole pages are ever matched or stored: a trailing partial page is ignored.

Representation (for speed, see bench/scheduler/bench_radix.py): a node stores its key packed,
``node.packed`` = the token ids as 4-byte unsigned ints (``array("I")`` bytes), and
``node.key`` decodes it to a tuple. Comparing a node's key with a request's tokens is
then one ``bytes.startswith`` (a memcmp) instead of a per-token Python comparison, so
match + insert cost O(1) Python operations per node on the path plus C-speed work per
token (packing the request's tokens once; an ``array("I")`` argument is already packed).
Token ids must lie in [0, 2**32) (ValueError otherwise). Child dict keys stay tuples of
the first page's token ids (one ``struct.unpack_from``).

Split (S = 2). A match or insert of "a b c d q r" reaches node [a b c d e f] and stops
after "c d", which is a page boundary:

    before:  parent --[a b | c d | e f]--> node (p0 p1 p2)

    after:   parent --[a b | c d]--> upper (p0 p1) --[e f]--> node (p2)
                        ^ matched              ^ not matched

The new node always goes *above* the old one, so a caller's handle to ``node`` still ends
at the same token position (its ``prefix_len`` is unchanged); ``upper`` copies
``lock_ref``, ``last_access`` and ``hit_count``, so lock counts stay consistent across
splits.

Locking: ``inc_lock(node)``/``dec_lock(node)`` count references on every node of the path
node -> root. A node with ``lock_ref > 0`` is never evicted; since a parent's count is at
least each child's, a locked node's whole prefix stays cached. The root is never evicted
and never counted.

Eviction: candidates are unlocked leaves. They sit in a min-heap ordered by the eviction
policy's key (``radix.eviction``) with lazy invalidation: an entry is pushed when a node
*becomes* a candidate (new leaf, last lock released, last child evicted) and checked when
popped (still attached, still a leaf, still unlocked, newest entry for the node, key still
current). Each evicted leaf costs O(log n) amortised; stale entries are dropped by a
rebuild once they outnumber the nodes.

Listening: ``tree.listener`` (None by default) is told which prefixes may have changed
length, so a scheduler can keep the match lengths of waiting requests current without
re-matching them all (runtime/scheduler/waiting_order.py): ``edge_changed(parent, first_page)``
after the child of ``parent`` under ``first_page`` was added, split or removed;
``node_removed(node)`` just before a leaf is detached; ``reset()`` after ``reset``.
``peek_prefix`` is the read-only match it re-matches with.

Not thread-safe: one owner (the scheduler thread) calls every method.
"""

from __future__ import annotations

import struct
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixlm.radix.eviction import CandidateHeap, get_policy

Key = tuple[int, ...]
TOKEN_TYPECODE = "I"  # packed token id: unsigned int, 4 bytes on every CPython platform
TOKEN_BYTES = array(TOKEN_TYPECODE).itemsize
assert TOKEN_BYTES == 4


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as ``node.packed`` stores them. ValueError outside [0, 2**32).

    An ``array("I")`` is copied as is (a memcpy): a caller that matches and inserts the
    same sequence keeps it as one (``Req.token_array``) and pays the packing once.
    """
    if isinstance(tokens, array) and tokens.typecode == TOKEN_TYPECODE:
        return tokens.tobytes()
    try:
        return array(TOKEN_TYPECODE, tokens).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None


@dataclass(eq=False, slots=True)
class TreeNode:
    """One edge of the tree: its token ids (``packed``) and the page ids that hold them."""

    packed: bytes = b""  # the key's token ids, TOKEN_BYTES each (see the module docstring)
    pages: list[int] = field(default_factory=list)
    parent: TreeNode | None = field(default=None, repr=False)
    children: dict[Key, TreeNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: float = 0.0
    hit_count: int = 0
    prefix_len: int = 0  # tokens from the root to the end of ``key`` (the sequence's length)
    heap_seq: int = -1  # sequence number of this node's newest heap entry

    @property
    def key(self) -> Key:
        """The token ids of this edge, decoded from ``packed`` (O(len); for checks)."""
        return tuple(array(TOKEN_TYPECODE, self.packed))

    @property
    def num_tokens(self) -> int:
        return len(self.packed) // TOKEN_BYTES

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class MatchResult:
    """Longest cached page-aligned prefix: its pages, length, and deepest node."""

    pages: list[int]
    num_tokens: int  # == len(pages) * page_size
    node: TreeNode  # deepest matched node; the root when nothing matched


@dataclass(frozen=True, slots=True)
class PeekResult:
    """Read-only match (``peek_prefix``): where a token sequence hangs in the tree.

    ``node`` is the deepest node whose whole path is a prefix of the tokens;
    ``num_tokens`` (a multiple of S) also counts the whole pages matched inside the next
    child; ``next_page`` is the first page after ``node`` (the child's dict key whether
    or not that child exists), None when the tokens' whole pages end at ``node``.
    """

    node: TreeNode
    num_tokens: int
    next_page: Key | None


class TreeListener(Protocol):
    """Told about structural changes that can change match lengths (module docstring)."""

    def edge_changed(self, parent: TreeNode, first_page: Key) -> None: ...

    def node_removed(self, node: TreeNode) -> None: ...

    def reset(self) -> None: ...


@dataclass(frozen=True)
class InsertResult:
    """Outcome of ``insert``; see ``RadixTree.insert`` for freeing duplicates."""

    num_existing_tokens: int  # tokens of the key that were cached before the insert
    pages: list[int]  # the tree's page ids for the whole key after the insert
    node: TreeNode  # node ending exactly at the end of the key; the root for an empty key


class RadixTree:
    """Prefix cache over token ids whose values are page ids (see module docstring)."""

    def __init__(
        self,
        page_size: int,
        eviction_policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self._first_page = struct.Struct(f"={page_size}{TOKEN_TYPECODE}").unpack_from  # child dict key
        self.eviction_policy = eviction_policy
        self._policy = get_policy(eviction_policy)
        self._clock = clock
        self.listener: TreeListener | None = None
        self._init_state()

    def _init_state(self) -> None:
        self._root = TreeNode()
        self._heap = CandidateHeap(self._policy)  # unlocked leaves, lazily invalidated
        self._num_nodes = 0  # excluding the root
        self._cached = 0  # pages held by all nodes
        self._protected = 0  # pages held by nodes with lock_ref > 0

    # ------------------------------------------------------------------ queries

    @property
    def root(self) -> TreeNode:
        return self._root

    @property
    def cached_pages(self) -> int:
        """Total pages held by the tree."""
        return self._cached

    @property
    def evictable_pages(self) -> int:
        """Pages in nodes with ``lock_ref == 0`` (evictable now or once their children go)."""
        return self._cached - self._protected

    @property
    def protected_pages(self) -> int:
        """Pages in locked nodes (``lock_ref > 0``)."""
        return self._protected

    def all_pages(self) -> set[int]:
        """Every page id the tree holds. O(n); meant for tests and invariant checks."""
        return {page for node in self._iter_nodes() for page in node.pages}

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Find the longest cached prefix of ``tokens`` made of whole pages.

        ``tokens`` may have any length; a trailing partial page is ignored. Callers that
        must leave at least one token to compute pass ``tokens[:-1]``.
        Mutates: splits the last matched node when the match ends inside it (at a page
        boundary), sets ``last_access`` and bumps ``hit_count`` on every matched node.
        Does not lock: call ``inc_lock(result.node)`` to keep the prefix cached.
        """
        key = pack_tokens(tokens)
        key = key[: len(key) // self._page_bytes * self._page_bytes]  # whole pages only
        node, num_tokens, pages = self._walk(key, self._clock(), hit=True)
        return MatchResult(pages=pages, num_tokens=num_tokens, node=node)

    def peek_prefix(self, tokens: Sequence[int], start: TreeNode | None = None) -> PeekResult:
        """Like ``match_prefix`` but read-only: no split, no touch, no page list.

        ``start`` (default the root) resumes a walk at a node known to be on the tokens'
        path (an attached node whose ``prefix_len`` tokens are a prefix of ``tokens``),
        e.g. the ``node`` of an earlier peek, which stays valid across splits. O(nodes
        on the path) Python steps plus one memcmp per node.
        """
        key = pack_tokens(tokens)
        key = key[: len(key) // self._page_bytes * self._page_bytes]  # whole pages only
        node = self._root if start is None else start
        pos = node.prefix_len * TOKEN_BYTES
        while pos < len(key):
            first = self._first_page(key, pos)
            child = node.children.get(first)
            if child is None:
                return PeekResult(node, pos // TOKEN_BYTES, first)
            matched = self._common_len(child.packed, key, pos)
            if matched < len(child.packed):
                return PeekResult(node, (pos + matched) // TOKEN_BYTES, first)
            node, pos = child, pos + matched
        return PeekResult(node, pos // TOKEN_BYTES, None)

    def is_attached(self, node: TreeNode) -> bool:
        """True for the root and for nodes not evicted or dropped by ``reset``."""
        return node is self._root or node.parent is not None

    # ---------------------------------------------------------------- mutations

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Cache ``tokens`` (a whole number of pages) backed by ``pages``.

        The tree takes ownership only of the pages for the part that was not cached yet;
        for the cached part it keeps its own pages. ``result.pages`` holds the tree's
        page for every position, so the caller frees its duplicates with::

            result = tree.insert(tokens, my_pages)
            kept_pages = zip(my_pages, result.pages, strict=True)
            duplicates = [mine for mine, kept in kept_pages if mine != kept]
            allocator.free(duplicates)

        Pages the caller got from ``match_prefix`` compare equal and are not duplicates.
        Mutates: may split one node, adds at most one leaf, sets ``last_access`` along the
        path (``hit_count`` is unchanged). Locks nothing. The caller must not pass page
        ids the tree already holds for other positions (``check_invariants`` catches it).
        Raises ValueError if ``len(tokens)`` is not a multiple of ``page_size`` or
        ``len(pages) != len(tokens) // page_size``. An empty key returns the root.
        """
        self._check_insert_args(len(tokens), pages)
        key = pack_tokens(tokens)
        now = self._clock()
        node, num_existing, kept = self._walk(key, now, hit=False)
        new_pages = list(pages[num_existing // self.page_size :])
        if new_pages:
            node = self._add_leaf(node, key[num_existing * TOKEN_BYTES :], new_pages, now)
        return InsertResult(num_existing_tokens=num_existing, pages=kept + new_pages, node=node)

    def inc_lock(self, node: TreeNode) -> None:
        """Add one lock reference to every node on the path ``node`` -> root.

        Locked nodes (and hence their whole prefix) are never evicted. Locking the root
        is a no-op. Raises RuntimeError if ``node`` is not in this tree (e.g. evicted).
        """
        for step in self._path_to_root(node):
            if step.lock_ref == 0:
                self._protected += step.num_pages
            step.lock_ref += 1

    def dec_lock(self, node: TreeNode) -> None:
        """Release one reference taken by ``inc_lock(node)``.

        Nodes whose count drops to zero become evictable again. Unlocking the root is a
        no-op. Raises RuntimeError if ``node`` is unlocked (count would go below zero) or
        not in this tree; nothing is changed then.
        """
        path = self._path_to_root(node)
        if path and path[0].lock_ref <= 0:
            raise RuntimeError("dec_lock on a node that is not locked (lock_ref would be < 0)")
        for step in path:
            step.lock_ref -= 1
            if step.lock_ref == 0:
                self._protected -= step.num_pages
                self._push_if_candidate(step)

    def evict(self, num_pages: int) -> list[int]:
        """Evict unlocked leaves, lowest policy key first, until >= ``num_pages`` are freed.

        Whole leaves go, so more than ``num_pages`` may be freed; fewer are freed only when
        nothing evictable is left. A parent that becomes an unlocked leaf becomes a
        candidate in turn. Returns the freed page ids (the caller frees them). Handles to
        evicted nodes become invalid. O(log n) amortised per evicted leaf.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        freed: list[int] = []
        while len(freed) < num_pages:
            leaf = self._pop_candidate()
            if leaf is None:
                break
            freed.extend(self._remove_leaf(leaf))
        return freed

    def reset(self) -> list[int]:
        """Drop every node and return all page ids. RuntimeError if anything is locked.

        All node handles become invalid (locking one raises RuntimeError).
        """
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked pages")
        pages: list[int] = []
        for node in list(self._iter_nodes()):
            pages.extend(node.pages)
            node.parent = None
        self._init_state()
        if self.listener is not None:
            self.listener.reset()
        return pages

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken structural invariant."""
        from radixlm.radix.invariants import check_tree

        check_tree(self)

    # ---------------------------------------------------------- tree internals

    def _check_insert_args(self, num_tokens: int, pages: Sequence[int]) -> None:
        if num_tokens % self.page_size:
            raise ValueError(f"len(tokens)={num_tokens} is not a multiple of {self.page_size}")
        if len(pages) != num_tokens // self.page_size:
            raise ValueError(f"need {num_tokens // self.page_size} pages, got {len(pages)}")

    def _walk(self, key: bytes, now: float, hit: bool) -> tuple[TreeNode, int, list[int]]:
        """Descend while whole pages of the packed ``key`` match; split the last node if
        the match ends inside it. Returns (deepest matched node, matched token count,
        matched pages)."""
        node, pos, pages = self._root, 0, []  # pos: bytes of ``key`` matched
        first_page = self._first_page
        while pos < len(key):
            child = node.children.get(first_page(key, pos))
            if child is None:
                break
            matched = self._common_len(child.packed, key, pos)
            if matched < len(child.packed):
                child = self._split(child, matched // TOKEN_BYTES)
            self._touch(child, now, hit)
            pages.extend(child.pages)
            node, pos = child, pos + matched
        return node, pos // TOKEN_BYTES, pages

    def _common_len(self, node_key: bytes, key: bytes, start: int) -> int:
        """Bytes (whole pages) on which ``node_key`` and ``key[start:]`` agree.

        The first page is known to agree (it is the child's dict key). One memcmp
        settles the common case, a full match; otherwise a binary search over whole
        pages finds the first differing page with O(log(pages)) memcmps.
        """
        page = self._page_bytes
        limit = min(len(node_key), len(key) - start)
        if key.startswith(node_key[:limit] if limit < len(node_key) else node_key, start):
            return limit
        lo, hi = 1, limit // page - 1  # first lo pages agree; the first hi + 1 do not all agree
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key.startswith(node_key[lo * page : mid * page], start + lo * page):
                lo = mid
            else:
                hi = mid - 1
        return lo * page

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens; return the new upper node (see diagram)."""
        size, parent = self.page_size, node.parent
        cut = at * TOKEN_BYTES
        assert parent is not None and 0 < cut < len(node.packed) and at % size == 0
        upper = TreeNode(
            packed=node.packed[:cut],
            pages=node.pages[: at // size],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hit_count=node.hit_count,
            prefix_len=parent.prefix_len + at,
        )
        parent.children[self._first_page(upper.packed)] = upper
        node.packed, node.pages, node.parent = node.packed[cut:], node.pages[at // size :], upper
        upper.children[self._first_page(node.packed)] = node
        self._num_nodes += 1
        if self.listener is not None:
            self.listener.edge_changed(parent, self._first_page(upper.packed))
        return upper

    def _add_leaf(self, parent: TreeNode, key: bytes, pages: list[int], now: float) -> TreeNode:
        end = parent.prefix_len + len(key) // TOKEN_BYTES
        leaf = TreeNode(packed=key, pages=pages, parent=parent, last_access=now, prefix_len=end)
        parent.children[self._first_page(key)] = leaf
        if self.listener is not None:
            self.listener.edge_changed(parent, self._first_page(key))
        self._num_nodes += 1
        self._cached += len(pages)
        self._push_if_candidate(leaf)
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> list[int]:
        parent = leaf.parent
        assert parent is not None
        first = self._first_page(leaf.packed)
        if self.listener is not None:
            self.listener.node_removed(leaf)
            self.listener.edge_changed(parent, first)
        del parent.children[first]
        leaf.parent = None
        self._num_nodes -= 1
        self._cached -= leaf.num_pages
        self._push_if_candidate(parent)
        return leaf.pages

    @staticmethod
    def _touch(node: TreeNode, now: float, hit: bool) -> None:
        node.last_access = now
        if hit:
            node.hit_count += 1

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from ``node`` up to (excluding) the root; RuntimeError if detached."""
        path: list[TreeNode] = []
        step: TreeNode | None = node
        while step is not self._root:
            if step is None:
                raise RuntimeError("node is not in this tree (evicted, reset or foreign)")
            path.append(step)
            step = step.parent
        return path

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---------------------------------------------------------- eviction heap

    def _is_candidate(self, node: TreeNode) -> bool:
        attached = node.parent is not None  # false for the root and for evicted nodes
        return attached and node.is_leaf and node.lock_ref == 0

    def _push_if_candidate(self, node: TreeNode) -> None:
        if not self._is_candidate(node):
            return
        self._heap.push(node)
        if len(self._heap) > 2 * self._num_nodes + 64:  # mostly stale entries: compact
            self._heap.rebuild(n for n in self._iter_nodes() if self._is_candidate(n))

    def _pop_candidate(self) -> TreeNode | None:
        return self._heap.pop(self._is_candidate)
