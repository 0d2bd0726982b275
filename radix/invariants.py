"""Structural invariants of ``RadixTree``, checked by ``RadixTree.check_invariants()``.

Walks the whole tree (O(nodes + heap)); meant for tests and for the scheduler's
debug-mode idle check. Raises AssertionError with a message naming the broken rule,
explicitly (not via ``assert``) so the check also runs under ``python -O``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlm.radix.tree import RadixTree, TreeNode


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def check_tree(tree: RadixTree) -> None:
    """Check every node, then the counters, then the eviction heap."""
    _check_root(tree)
    nodes = list(tree._iter_nodes())
    for node in nodes:
        _check_node(tree, node)
    _check_unique_pages(nodes)
    _check_counters(tree, nodes)
    _check_heap(tree, nodes)


def _check_root(tree: RadixTree) -> None:
    root = tree.root
    _require(root.parent is None, "root has a parent")
    _require(root.packed == b"" and root.pages == [] and root.copies is None, "root holds a key or pages")
    _require(root.prefix_len == 0, f"root prefix_len is {root.prefix_len}, expected 0")
    _require(root.lock_ref == 0, f"root lock_ref is {root.lock_ref}, expected 0")


def _check_node(tree: RadixTree, node: TreeNode) -> None:
    size, parent = tree.page_size, node.parent
    key = node.key
    where = f"node key={key[:8]}..."
    _require(len(key) > 0, f"{where}: empty key below the root")
    _require(len(key) % size == 0, f"{where}: key length {len(key)} not page-aligned")
    _require(node.npages * size == len(key), f"{where}: npages {node.npages} does not cover the key")
    if tree.tiers:
        _check_tiers(tree, node, where)
    else:
        _require(len(node.pages) == node.npages, f"{where}: pages do not cover the key")
    _require(node.dev_children == sum(bool(c.pages) for c in node.children.values()),
             f"{where}: dev_children {node.dev_children} is wrong")
    if parent is None:
        raise AssertionError(f"{where}: reachable node has no parent")
    _require(parent.children.get(key[:size]) is node, f"{where}: not under its first page")
    _require(
        node.prefix_len == parent.prefix_len + len(key),
        f"{where}: prefix_len {node.prefix_len} != parent's {parent.prefix_len} + key length",
    )
    _require(node.lock_ref >= 0, f"{where}: negative lock_ref {node.lock_ref}")
    _require(node.io_ref >= 0, f"{where}: negative io_ref {node.io_ref}")
    if parent is not tree.root:
        _require(parent.lock_ref >= node.lock_ref, f"{where}: lock_ref exceeds parent's")
        _require(parent.io_ref >= node.io_ref, f"{where}: io_ref exceeds parent's")


def _check_tiers(tree: RadixTree, node: TreeNode, where: str) -> None:
    """Tiered trees: pages on the device whole or not at all, prefix-closed there, a copy
    somewhere, one handle per page per copy, children-with-a-copy counts right."""
    parent = node.parent
    assert parent is not None
    _require(len(node.pages) in (0, node.npages), f"{where}: partly on the device")
    if node.pages and parent is not tree.root:
        _require(bool(parent.pages), f"{where}: on the device below a parent that is not")
    copies = node.copies or [None] * len(tree.tiers)
    _require(len(copies) == len(tree.tiers), f"{where}: copies list has the wrong length")
    _require(bool(node.pages) or any(c is not None for c in copies), f"{where}: cached nowhere")
    for tier, handles in enumerate(copies):
        if handles is not None:
            _require(len(handles) == node.npages, f"{where}: {tree.tiers[tier]} handles do not cover the key")
        count = sum(c.copy_in(tier) is not None for c in node.children.values())
        have = node.tier_children[tier] if node.tier_children else 0
        _require(have == count, f"{where}: {tree.tiers[tier]} children count {have} != {count}")


def _check_unique_pages(nodes: list[TreeNode]) -> None:
    seen: set[int] = set()
    for node in nodes:
        for page in node.pages:
            _require(page not in seen, f"page {page} appears twice in the tree")
            seen.add(page)


def _check_counters(tree: RadixTree, nodes: list[TreeNode]) -> None:
    cached = sum(len(node.pages) for node in nodes)
    protected = sum(len(node.pages) for node in nodes if node.lock_ref > 0)
    for tier, name in enumerate(tree.tiers):
        held = sum(node.npages for node in nodes if node.copy_in(tier) is not None)
        _require(tree.tier_pages(tier) == held, f"{name} pages {tree.tier_pages(tier)} != {held}")
    _require(tree._num_nodes == len(nodes), f"node count {tree._num_nodes} != {len(nodes)}")
    _require(tree.cached_pages == cached, f"cached_pages {tree.cached_pages} != {cached}")
    _require(tree.protected_pages == protected, f"protected {tree.protected_pages} != {protected}")
    _require(
        tree.evictable_pages + tree.protected_pages == tree.cached_pages,
        "evictable_pages + protected_pages != cached_pages",
    )


def _check_heap(tree: RadixTree, nodes: list[TreeNode]) -> None:
    """Every candidate leaf (unlocked, childless) has its newest entry in the heap."""
    live = tree._heap.live_ids()
    for node in nodes:
        if tree._is_candidate(node):
            _require(id(node) in live, f"candidate leaf {node.key[:8]} has no heap entry")
    for tier, name in enumerate(tree.tiers):
        live = tree._tier_heaps[tier].live_ids()
        for node in nodes:
            if tree._is_tier_candidate(node, tier):
                ref = node.tier_refs[tier] if node.tier_refs else None
                _require(id(ref) in live, f"{name} candidate {node.key[:8]} has no heap entry")
