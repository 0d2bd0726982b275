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

Tiers (hierarchical KV cache, docs/KV_CACHE.md "Hierarchical cache"): a tree made with
``tiers=("host", "disk")`` also records, per node, copies of its pages in lower memory
tiers as opaque per-page handles (``node.copies[i]``: a list of ``num_pages`` handles for
``tiers[i]``, or None). The device pages (``node.pages``) may then be absent (``[]``):
the node is cached only below. Rules:

* every attached node holds its pages somewhere (device or at least one lower tier);
* device residency is prefix-closed: a node with device pages has a parent with device
  pages (or the root), so a request's page table starts with one device run;
* ``match_prefix`` returns the device run (``pages``, ``num_tokens``, ``node``) and the
  matched nodes after it (``tail``), each cached in some lower tier;
* ``insert`` walks through tail nodes giving them the caller's device pages (a recomputed
  or loaded prefix is promoted), so they are not duplicates;
* device eviction takes unlocked nodes without device children: a node with a lower copy
  only loses its device pages (it stays matchable), one without asks ``on_demote`` (the
  cache controller may give it a lower copy: write-back), else it goes with its subtree;
* ``evict_tier(i, n)`` takes unlocked nodes with ``io_ref == 0`` and no child holding a
  copy in tier i; a node that has another copy only loses this one, else it goes with its
  subtree. Lower-tier handles that leave the tree go to ``on_release(tier index,
  handles)`` (the owner frees them); device pages are returned, as without tiers.
* locks (``lock_ref``) protect every tier's copies of the path; ``io_ref`` (per node, set
  by the owner with ``inc_io``/``dec_io``) protects only lower copies being read.

Reuse gaps and ghosts: every node records ``reuse_gap``, the clock seconds between its last
use and the match before that (``_touch``); a new leaf takes its parent's when the parent
was matched at most once (the leaf is then a conversation's next turn, not a branch off a
shared system prompt). When the policy asks for it (``uses_ghosts``, e.g. ``reuse-gap``),
the tree also remembers the last use of up to ``GHOST_RECORDS`` removed nodes, keyed by
(``prefix_len``, last page's token ids), oldest forgotten first; a new leaf whose key passes
the end of a remembered prefix takes the time since that prefix's last use as its gap (the
deepest such end; O(pages of the leaf) lookups). A key's last page at a given length stands
for the whole prefix, so two prefixes that differ only before their last page share a record.

Not thread-safe: one owner (the scheduler thread) calls every method.
"""

from __future__ import annotations

import math
import struct
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixlm.radix.eviction import CandidateHeap, get_policy

Key = tuple[int, ...]
TOKEN_TYPECODE = "I"  # packed token id: unsigned int, 4 bytes on every CPython platform
TOKEN_BYTES = array(TOKEN_TYPECODE).itemsize
assert TOKEN_BYTES == 4
GHOST_RECORDS = 1 << 16  # removed prefixes whose last use is remembered ("Ghosts")


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
    reuse_gap: float = math.inf  # clock seconds between its last use and the match before (see _touch)
    heap_seq: int = -1  # sequence number of this node's newest heap entry
    npages: int = 0  # pages of the key (len(pages) when on the device)
    dev_children: int = 0  # children holding device pages
    copies: list | None = field(default=None, repr=False)  # per lower tier: handles or None
    tier_children: list[int] | None = field(default=None, repr=False)  # per lower tier: children with a copy
    tier_refs: list | None = field(default=None, repr=False)  # per lower tier: its heap entry proxy
    io_ref: int = 0  # lower-tier copies being read (never evicted from lower tiers while > 0)

    @property
    def key(self) -> Key:
        """The token ids of this edge, decoded from ``packed`` (O(len); for checks)."""
        return tuple(array(TOKEN_TYPECODE, self.packed))

    @property
    def num_tokens(self) -> int:
        return len(self.packed) // TOKEN_BYTES

    @property
    def num_pages(self) -> int:
        """Pages of the key, wherever they live."""
        return self.npages

    @property
    def on_device(self) -> bool:
        return bool(self.pages)

    def copy_in(self, tier: int) -> list | None:
        """This node's handles in lower tier ``tier`` (an index into ``tree.tiers``), or None."""
        return self.copies[tier] if self.copies is not None else None

    @property
    def is_leaf(self) -> bool:
        return not self.children


class _TierRef:
    """A node's entry in one lower tier's eviction heap: each heap keeps its own
    ``heap_seq``; the policy reads every other field from the node."""

    __slots__ = ("node", "heap_seq")

    def __init__(self, node: TreeNode) -> None:
        self.node = node
        self.heap_seq = -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)


@dataclass(frozen=True)
class MatchResult:
    """Longest cached page-aligned prefix: its device pages, length, and deepest device
    node; ``tail``: the matched nodes after it, cached only in lower tiers (tiered trees)."""

    pages: list[int]
    num_tokens: int  # == len(pages) * page_size: the device run
    node: TreeNode  # deepest matched node on the device; the root when none
    tail: tuple[TreeNode, ...] = ()  # path order; each node's pages are in some lower tier

    @property
    def tail_tokens(self) -> int:
        return self.tail[-1].prefix_len - self.node.prefix_len if self.tail else 0


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
        tiers: Sequence[str] = (),
        tier_eviction_policy: str | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if len(set(tiers)) != len(tiers):
            raise ValueError(f"tier names must be distinct, got {tuple(tiers)}")
        self.page_size = page_size
        self.tiers = tuple(tiers)  # lower tiers, fastest first (module docstring)
        # Owner hooks (tiered trees): on_release(tier, handles) frees lower-tier handles that
        # leave the tree; on_demote(node) may give a device-only node a lower copy before
        # its device pages go (write-back); returns whether it did.
        self.on_release: Callable[[int, list], None] | None = None
        self.on_demote: Callable[[TreeNode], bool] | None = None
        self._page_bytes = page_size * TOKEN_BYTES
        self._first_page = struct.Struct(f"={page_size}{TOKEN_TYPECODE}").unpack_from  # child dict key
        self.eviction_policy = eviction_policy
        self.tier_eviction_policy = tier_eviction_policy or eviction_policy  # lower tiers' order
        self._policy = get_policy(eviction_policy)
        self._clock = clock
        self.listener: TreeListener | None = None
        # Last uses of removed prefixes (see "Ghosts"), kept only for a policy that reads
        # reuse_gap: (prefix_len, last page packed) -> last_access, oldest first.
        self._ghosts: OrderedDict[tuple[int, bytes], float] | None = (
            OrderedDict() if getattr(self._policy, "uses_ghosts", False) else None
        )
        self._init_state()

    def _init_state(self) -> None:
        self._root = TreeNode()
        self._heap = CandidateHeap(self._policy)  # unlocked leaves, lazily invalidated
        self._rekey_on_match = getattr(self._policy, "rekey_on_match", False)
        self._num_nodes = 0  # excluding the root
        self._cached = 0  # pages held by all nodes
        self._protected = 0  # device pages held by nodes with lock_ref > 0
        # One policy instance per lower tier (a learned policy's statistics are per tier).
        self._tier_heaps = [CandidateHeap(get_policy(self.tier_eviction_policy)) for _ in self.tiers]
        self._tier_pages = [0] * len(self.tiers)  # pages with a copy per lower tier

    # ------------------------------------------------------------------ queries

    @property
    def root(self) -> TreeNode:
        return self._root

    @property
    def cached_pages(self) -> int:
        """Device pages held by the tree."""
        return self._cached

    def tier_pages(self, tier: int) -> int:
        """Pages with a copy in lower tier ``tier`` (an index into ``tiers``)."""
        return self._tier_pages[tier]

    @property
    def evictable_pages(self) -> int:
        """Device pages in nodes with ``lock_ref == 0`` (evictable now or once their children go)."""
        return self._cached - self._protected

    @property
    def protected_pages(self) -> int:
        """Device pages in locked nodes (``lock_ref > 0``)."""
        return self._protected

    def all_pages(self) -> set[int]:
        """Every device page id the tree holds. O(n); meant for tests and invariant checks."""
        return {page for node in self._iter_nodes() for page in node.pages}

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Find the longest cached prefix of ``tokens`` made of whole pages.

        ``tokens`` may have any length; a trailing partial page is ignored. Callers that
        must leave at least one token to compute pass ``tokens[:-1]``.
        Mutates: splits the last matched node when the match ends inside it (at a page
        boundary), sets ``last_access`` and bumps ``hit_count`` on every matched node.
        Does not lock: call ``inc_lock(result.node)`` to keep the prefix cached.
        A tiered tree goes on past the device run (``result.tail``).
        """
        key = pack_tokens(tokens)
        key = key[: len(key) // self._page_bytes * self._page_bytes]  # whole pages only
        now = self._clock()
        node, num_tokens, pages = self._walk(key, now, hit=True)
        if self._rekey_on_match:  # its key may have fallen: the heap entry must follow
            self._push_if_candidate(node)
        if not self.tiers:
            return MatchResult(pages=pages, num_tokens=num_tokens, node=node)
        tail = []
        for child in self._walk_tail(key, node, num_tokens * TOKEN_BYTES):
            self._touch(child, now, True)
            tail.append(child)
        return MatchResult(pages=pages, num_tokens=num_tokens, node=node, tail=tuple(tail))

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
        if self.tiers:  # nodes cached only below take the caller's pages (promotion)
            for child in self._walk_tail(key, node, num_existing * TOKEN_BYTES):
                first = num_existing // self.page_size
                self.set_device_pages(child, list(pages[first : first + child.npages]))
                self._touch(child, now, False)
                kept.extend(child.pages)
                node, num_existing = child, child.prefix_len
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
                self._protected += len(step.pages)
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
                self._protected -= len(step.pages)
                self._push_if_candidate(step)
                if self.tiers:
                    self._push_tier_candidates(step)

    def evict(self, num_pages: int) -> list[int]:
        """Evict device pages of unlocked nodes without device children, lowest policy key
        first, until >= ``num_pages`` are freed.

        Whole nodes go, so more than ``num_pages`` may be freed; fewer are freed only when
        nothing evictable is left. A parent left without device children becomes a
        candidate in turn. Returns the freed page ids (the caller frees them). Without
        tiers the node leaves the tree (handles to it become invalid); a tiered tree keeps
        a node that has (or, through ``on_demote``, gets) a lower copy, cached below.
        O(log n) amortised per evicted node.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        freed: list[int] = []
        while len(freed) < num_pages:
            node = self._pop_candidate()
            if node is None:
                break
            if not self.tiers:
                freed.extend(self._remove_leaf(node))
            elif self._has_lower_copy(node) or (self.on_demote is not None and self.on_demote(node)):
                freed.extend(self._drop_device_pages(node))
            else:
                freed.extend(self._remove_subtree(node))
        return freed

    # ------------------------------------------------------------ lower tiers
    def set_device_pages(self, node: TreeNode, pages: list[int]) -> None:
        """Give a node cached only in lower tiers device pages (it was loaded or
        recomputed). Its parent must be on the device (or the root). ValueError otherwise."""
        parent = node.parent
        if node.pages or parent is None or len(pages) != node.npages:
            raise ValueError("set_device_pages needs an attached node without device pages and one page per page")
        if parent is not self._root and not parent.pages:
            raise ValueError("set_device_pages: the parent is not on the device (load parents first)")
        node.pages = pages
        self._cached += len(pages)
        if node.lock_ref > 0:
            self._protected += len(pages)
        parent.dev_children += 1
        self._push_if_candidate(node)

    def set_copy(self, node: TreeNode, tier: int, handles: list) -> None:
        """Record that lower tier ``tier`` holds ``node``'s pages (one handle per page).
        ValueError if it already has a copy there or the handle count is wrong."""
        if len(handles) != node.npages or node.parent is None:
            raise ValueError(f"set_copy: need {node.npages} handles for an attached node, got {len(handles)}")
        if node.copies is None:
            node.copies = [None] * len(self.tiers)
        if node.copies[tier] is not None:
            raise ValueError(f"set_copy: the node already has a copy in {self.tiers[tier]}")
        node.copies[tier] = list(handles)
        self._tier_pages[tier] += node.npages
        parent = node.parent
        if parent is not self._root:
            self._tier_children(parent)[tier] += 1
        self._push_tier_candidate(node, tier)

    def drop_copy(self, node: TreeNode, tier: int) -> list:
        """Forget ``node``'s copy in lower tier ``tier`` and return its handles (the caller
        frees them). ValueError if it has none there or it is the node's only copy."""
        handles = node.copy_in(tier)
        if handles is None:
            raise ValueError(f"drop_copy: no copy in {self.tiers[tier]}")
        if not node.pages and sum(c is not None for c in node.copies) == 1:
            raise ValueError("drop_copy: the node's only copy (use discard)")
        self._unset_copy(node, tier)
        return handles

    def insert_copy(self, tokens: Sequence[int], tier: int, handles: Sequence) -> TreeNode:
        """Cache ``tokens`` (whole pages) in lower tier ``tier`` only: nodes on the path
        without a copy there take theirs from ``handles`` (one per page), missing ones are
        added without device pages. Returns the node ending at the end of the key (the
        root for an empty key). Used to index a persistent tier at start-up and by the
        simulator. Handles of pages already held there are not taken: the caller may
        check ``node.copy_in(tier)`` of the path."""
        self._check_insert_args(len(tokens), handles)
        key = pack_tokens(tokens)
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(self._first_page(key, pos))
            if child is None:
                break
            matched = self._common_len(child.packed, key, pos)
            if matched < len(child.packed):
                child = self._split(child, matched // TOKEN_BYTES)
            if child.copy_in(tier) is None:
                first = pos // self._page_bytes
                self.set_copy(child, tier, list(handles[first : first + child.npages]))
            node, pos = child, pos + matched
        if pos < len(key):
            leaf = self._add_leaf(node, key[pos:], [], self._clock(), npages=(len(key) - pos) // self._page_bytes)
            self.set_copy(leaf, tier, list(handles[pos // self._page_bytes :]))
            node = leaf
        return node

    def evict_tier(self, tier: int, num_pages: int) -> int:
        """Free >= ``num_pages`` pages of lower tier ``tier`` (fewer only when nothing
        there is evictable): unlocked nodes with ``io_ref == 0`` and no child holding a copy
        there, lowest policy key first. A node with another copy keeps it; one without
        leaves the tree with its subtree. Every freed handle goes to ``on_release``.
        Returns the pages freed in ``tier``."""
        heap, freed = self._tier_heaps[tier], 0
        while freed < num_pages:
            ref = heap.pop(lambda r, t=tier: self._is_tier_candidate(r.node, t))
            if ref is None:
                break
            node = ref.node
            freed += node.npages
            if node.pages or sum(c is not None for c in node.copies) > 1:
                self._release(tier, self._unset_copy(node, tier))
            else:
                self._remove_subtree(node)
        return freed

    def discard(self, node: TreeNode) -> list[int]:
        """Remove an unlocked node and its subtree (e.g. its only copy turned out corrupt);
        lower handles go to ``on_release``, device pages are returned. RuntimeError if it
        or a descendant is locked or being read."""
        if node.parent is None:
            raise RuntimeError("discard: node is not in this tree")
        if node.lock_ref or any(n.io_ref for n in self._subtree(node)):
            raise RuntimeError("discard: node is locked or being read")
        return self._remove_subtree(node)

    def inc_io(self, node: TreeNode) -> None:
        """Protect the lower copies of the path ``node`` -> root from ``evict_tier`` while
        they are read (counted like ``inc_lock``, so splits keep it; device pages stay
        evictable)."""
        for step in self._path_to_root(node):
            step.io_ref += 1

    def dec_io(self, node: TreeNode) -> None:
        """Release one ``inc_io(node)``. RuntimeError if not held."""
        path = self._path_to_root(node)
        if path and path[0].io_ref <= 0:
            raise RuntimeError("dec_io on a node that is not being read")
        for step in path:
            step.io_ref -= 1
            if step.io_ref == 0:
                self._push_tier_candidates(step)

    def reset(self) -> list[int]:
        """Drop every node and return all device page ids (lower handles go to
        ``on_release``). RuntimeError if anything is locked.

        All node handles become invalid (locking one raises RuntimeError).
        """
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked pages")
        pages: list[int] = []
        for node in list(self._iter_nodes()):
            pages.extend(node.pages)
            for tier, handles in enumerate(node.copies or ()):
                if handles is not None:
                    self._release(tier, handles)
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
            if child is None or not child.pages:  # not on the device: a tiered tree's tail
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

    def _walk_tail(self, key: bytes, node: TreeNode, pos: int) -> Iterator[TreeNode]:
        """Tiered trees: the matched nodes after ``node`` (which ends at byte ``pos`` of
        ``key``), none of them on the device; splits the last one where the match ends.
        A caller may give each yielded node device pages before the next is taken."""
        first_page = self._first_page
        while pos < len(key):
            child = node.children.get(first_page(key, pos))
            if child is None or child.pages:  # a device child after a non-device node: impossible
                return
            matched = self._common_len(child.packed, key, pos)
            if matched < len(child.packed):
                child = self._split(child, matched // TOKEN_BYTES)
            yield child
            node, pos = child, pos + matched

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens; return the new upper node (see diagram)."""
        size, parent = self.page_size, node.parent
        cut = at * TOKEN_BYTES
        assert parent is not None and 0 < cut < len(node.packed) and at % size == 0
        head = at // size
        upper = TreeNode(
            packed=node.packed[:cut],
            pages=node.pages[:head],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hit_count=node.hit_count,
            prefix_len=parent.prefix_len + at,
            reuse_gap=node.reuse_gap,
            npages=head,
            dev_children=1 if node.pages else 0,
        )
        if node.copies is not None:  # each copy splits as the pages do
            upper.copies = [c[:head] if c is not None else None for c in node.copies]
            node.copies = [c[head:] if c is not None else None for c in node.copies]
            upper.tier_children = [int(c is not None) for c in node.copies]
            for tier, handles in enumerate(upper.copies):
                if handles is not None:
                    self._push_tier_candidate(upper, tier)  # not a candidate while node holds a copy
        upper.io_ref = node.io_ref
        parent.children[self._first_page(upper.packed)] = upper
        node.packed, node.pages, node.parent = node.packed[cut:], node.pages[head:], upper
        node.npages -= head
        upper.children[self._first_page(node.packed)] = node
        self._num_nodes += 1
        if self.listener is not None:
            self.listener.edge_changed(parent, self._first_page(upper.packed))
        return upper

    def _add_leaf(self, parent: TreeNode, key: bytes, pages: list[int], now: float, npages: int | None = None) -> TreeNode:
        end = parent.prefix_len + len(key) // TOKEN_BYTES
        # a conversation's next turn: the gap of the prefix it extends, unless that prefix is
        # shared (matched more than once: a system prompt) -- see _touch; or the gap since a
        # removed prefix that ends inside the new key was last used ("Ghosts")
        gap = parent.reuse_gap if parent.hit_count <= 1 else math.inf
        if self._ghosts is not None:
            seen = self._ghost_use(parent.prefix_len, key)
            gap = gap if seen is None else now - seen
        leaf = TreeNode(packed=key, pages=pages, parent=parent, last_access=now, prefix_len=end,
                        reuse_gap=gap, npages=len(pages) if npages is None else npages)
        parent.children[self._first_page(key)] = leaf
        if pages:
            parent.dev_children += 1
        if self.listener is not None:
            self.listener.edge_changed(parent, self._first_page(key))
        self._num_nodes += 1
        self._cached += len(pages)
        self._push_if_candidate(leaf)
        return leaf

    def _ghost_use(self, start: int, key: bytes) -> float | None:
        """Last use of the deepest removed prefix ending at a page boundary inside ``key``
        (which starts at token ``start``), or None. O(pages of ``key``)."""
        step = self._page_bytes
        for end in range(len(key), 0, -step):
            seen = self._ghosts.get((start + end // TOKEN_BYTES, key[end - step : end]))
            if seen is not None:
                return seen
        return None

    def _add_ghost(self, node: TreeNode) -> None:
        """Remember a removed node's last use, forgetting the oldest record past
        ``GHOST_RECORDS``."""
        ghosts, key = self._ghosts, (node.prefix_len, node.packed[-self._page_bytes :])
        ghosts[key] = node.last_access
        ghosts.move_to_end(key)
        if len(ghosts) > GHOST_RECORDS:
            ghosts.popitem(last=False)

    def _remove_leaf(self, leaf: TreeNode) -> list[int]:
        """Detach a node without children; its lower copies go to ``on_release``; returns
        its device pages."""
        parent = leaf.parent
        assert parent is not None and not leaf.children
        if self._ghosts is not None:
            self._add_ghost(leaf)
        first = self._first_page(leaf.packed)
        if self.listener is not None:
            self.listener.node_removed(leaf)
            self.listener.edge_changed(parent, first)
        for tier, handles in enumerate(leaf.copies or ()):
            if handles is not None:
                self._release(tier, self._unset_copy(leaf, tier))
        del parent.children[first]
        leaf.parent = None
        self._num_nodes -= 1
        if leaf.pages:
            self._cached -= len(leaf.pages)
            parent.dev_children -= 1
        self._push_if_candidate(parent)
        return leaf.pages

    def _remove_subtree(self, node: TreeNode) -> list[int]:
        """Detach ``node`` and everything under it (deepest first); returns device pages."""
        pages: list[int] = []
        for step in reversed(list(self._subtree(node))):
            pages.extend(self._remove_leaf(step))
        return pages

    def _subtree(self, node: TreeNode) -> Iterator[TreeNode]:
        """``node`` and its descendants, parents before children."""
        stack = [node]
        while stack:
            step = stack.pop()
            yield step
            stack.extend(step.children.values())

    def _drop_device_pages(self, node: TreeNode) -> list[int]:
        """A tiered node keeps its lower copies and gives its device pages back."""
        pages, node.pages = node.pages, []
        self._cached -= len(pages)
        parent = node.parent
        assert parent is not None
        parent.dev_children -= 1
        self._push_if_candidate(parent)
        return pages

    def _has_lower_copy(self, node: TreeNode) -> bool:
        return node.copies is not None and any(c is not None for c in node.copies)

    def _unset_copy(self, node: TreeNode, tier: int) -> list:
        handles = node.copies[tier]
        node.copies[tier] = None
        self._tier_pages[tier] -= node.npages
        parent = node.parent
        if parent is not None and parent is not self._root:
            parent.tier_children[tier] -= 1
            self._push_tier_candidate(parent, tier)
        return handles

    def _release(self, tier: int, handles: list) -> None:
        if self.on_release is not None and handles:
            self.on_release(tier, handles)

    def _tier_children(self, node: TreeNode) -> list[int]:
        if node.tier_children is None:
            node.tier_children = [0] * len(self.tiers)
        return node.tier_children

    @staticmethod
    def _touch(node: TreeNode, now: float, hit: bool) -> None:
        """Mark ``node`` used at ``now``; a match (``hit``) also records ``reuse_gap``, the
        time since its last use (an insert's or a match's): for a conversation's prefix,
        the time between the end of one turn and the arrival of the next. A new leaf
        inherits the gap of the prefix it extends when that prefix was matched at most
        once (``_add_leaf``): the leaf is then that conversation's next turn."""
        if hit:
            node.reuse_gap = now - node.last_access
            node.hit_count += 1
        node.last_access = now

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
        return attached and not node.dev_children and node.lock_ref == 0 and bool(node.pages)

    def _push_if_candidate(self, node: TreeNode) -> None:
        if not self._is_candidate(node):
            return
        self._heap.push(node)
        if len(self._heap) > 2 * self._num_nodes + 64:  # mostly stale entries: compact
            self._heap.rebuild(n for n in self._iter_nodes() if self._is_candidate(n))

    def _pop_candidate(self) -> TreeNode | None:
        return self._heap.pop(self._is_candidate)

    def _is_tier_candidate(self, node: TreeNode, tier: int) -> bool:
        return (node.parent is not None and node.lock_ref == 0 and node.io_ref == 0
                and node.copies is not None and node.copies[tier] is not None
                and not (node.tier_children and node.tier_children[tier]))

    def _push_tier_candidate(self, node: TreeNode, tier: int) -> None:
        if not self._is_tier_candidate(node, tier):
            return
        if node.tier_refs is None:
            node.tier_refs = [_TierRef(node) for _ in self.tiers]
        heap = self._tier_heaps[tier]
        heap.push(node.tier_refs[tier])
        if len(heap) > 2 * self._num_nodes + 64:  # mostly stale entries: compact
            heap.rebuild(n.tier_refs[tier] for n in self._iter_nodes() if self._is_tier_candidate(n, tier))

    def _push_tier_candidates(self, node: TreeNode) -> None:
        for tier in range(len(self.tiers)):
            self._push_tier_candidate(node, tier)
