"""Random operation sequences on a tiered RadixTree (device + "host" + "disk") checked
against a naive model.

Naive model: ``where`` maps every cached page-aligned token prefix to the handle of its
last page in each place that holds it: {"device": page id, "host": handle, "disk":
handle}. Handles are unique integers, so whatever the tree gives back (device pages from
``evict``/``discard``, lower handles through ``on_release``) names exactly which prefix
left which place. After every operation the tree's content (per prefix, the handle in
each place, read off the nodes) must equal the model, and:

* a locked prefix never loses a copy; a prefix under ``inc_io`` never loses a lower copy;
* the device part is prefix-closed, every prefix is held somewhere, and a prefix that
  leaves the tree takes its descendants with it;
* ``match_prefix`` returns the device run and then the tail of lower-only nodes,
  exactly the model's longest run of held prefixes;
* ``insert`` gives a tail prefix the caller's page (promotion), keeps device pages;
* ``evict(n)`` frees >= n device pages or everything evictable; ``evict_tier`` likewise.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixlm.radix import EVICTION_POLICIES, RadixTree

Key = tuple[int, ...]
TIERS = ("host", "disk")
PLACES = ("device", *TIERS)
token_lists = st.lists(st.integers(0, 2), max_size=12)


class TieredTreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.where: dict[Key, dict[str, int]] = {}
        self.ids = itertools.count(1)
        self.locks: list[tuple[object, Key]] = []
        self.reading: list[tuple[object, Key]] = []
        self.released: list[tuple[str, int]] = []
        self.demote_ok = True

    @initialize(page_size=st.sampled_from([1, 2]), policy=st.sampled_from(sorted(EVICTION_POLICIES)))
    def make_tree(self, page_size: int, policy: str) -> None:
        ticks = itertools.count()
        self.size = page_size
        self.tree = RadixTree(page_size, policy, clock=lambda: float(next(ticks)), tiers=TIERS)
        self.tree.on_release = lambda tier, handles: self.released.extend((TIERS[tier], h) for h in handles)
        self.tree.on_demote = self._demote

    # ------------------------------------------------------------- helpers
    def _demote(self, node) -> bool:
        """Write-back: give a device-only node a host copy, unless told to refuse."""
        if not self.demote_ok:
            return False
        self.tree.set_copy(node, 0, [next(self.ids) for _ in range(node.npages)])
        self._sync_copies(node)
        return True

    def aligned(self, tokens: list[int]) -> Key:
        return tuple(tokens[: len(tokens) // self.size * self.size])

    def prefixes(self, key: Key) -> list[Key]:
        return [key[:end] for end in range(self.size, len(key) + 1, self.size)]

    def node_prefixes(self, node) -> list[Key]:
        """The page prefixes a node holds, from its path's token ids."""
        keys, step = [], node
        while step.parent is not None:
            keys.append(step.key)
            step = step.parent
        full = tuple(t for k in reversed(keys) for t in k)
        start = len(full) - len(node.key)
        return [full[:end] for end in range(start + self.size, len(full) + 1, self.size)]

    def _sync_copies(self, node) -> None:
        """Record in the model the lower copies the test just gave ``node``."""
        for tier, name in enumerate(TIERS):
            handles = node.copy_in(tier)
            if handles is not None:
                for prefix, handle in zip(self.node_prefixes(node), handles, strict=True):
                    self.where[prefix][name] = handle

    def tree_content(self) -> dict[Key, dict[str, int]]:
        out: dict[Key, dict[str, int]] = {}
        stack = [(self.tree.root, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                full = path + child.key
                for i, prefix in enumerate(self.prefixes(full)[len(path) // self.size :]):
                    places = {}
                    if child.pages:
                        places["device"] = child.pages[i]
                    for tier, name in enumerate(TIERS):
                        if child.copy_in(tier) is not None:
                            places[name] = child.copy_in(tier)[i]
                    out[prefix] = places
                stack.append((child, full))
        return out

    def protected(self, refs) -> set[Key]:
        out: set[Key] = set()
        for _node, key in refs:
            out.update(self.prefixes(key))
        return out

    def apply_removals(self, freed_pages: list[int]) -> None:
        """Update the model from what the tree gave back; check nothing protected went."""
        locked, reading = self.protected(self.locks), self.protected(self.reading)
        gone = {("device", p) for p in freed_pages} | set(self.released)
        self.released.clear()
        for prefix, places in list(self.where.items()):
            for place, handle in list(places.items()):
                if (place, handle) in gone:
                    assert prefix not in locked, f"locked prefix {prefix} lost its {place} copy"
                    assert place == "device" or prefix not in reading, f"{prefix} lost {place} while read"
                    del places[place]
                    gone.discard((place, handle))
            if not places:
                del self.where[prefix]
        assert not gone, f"the tree gave back handles it did not hold: {gone}"
        for prefix in self.where:  # a prefix that left took its descendants
            for parent in self.prefixes(prefix)[:-1]:
                assert parent in self.where, f"{prefix} held without its parent {parent}"

    # --------------------------------------------------------------- rules
    @rule(tokens=token_lists)
    def insert(self, tokens: list[int]) -> None:
        key = self.aligned(tokens)
        mine = [next(self.ids) for _ in range(len(key) // self.size)]
        result = self.tree.insert(key, mine)
        expected = []
        for prefix, page in zip(self.prefixes(key), mine, strict=True):
            places = self.where.setdefault(prefix, {})
            places.setdefault("device", page)  # a tail prefix takes the caller's page
            expected.append(places["device"])
        assert result.pages == expected

    @rule(tokens=token_lists, tier=st.integers(0, 1))
    def copy_down(self, tokens: list[int], tier: int) -> None:
        """Write-through of a matched path: every node on it without a copy gets one."""
        match = self.tree.match_prefix(tokens)
        node = match.tail[-1] if match.tail else match.node
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        for node in path:
            if node.copy_in(tier) is None:
                self.tree.set_copy(node, tier, [next(self.ids) for _ in range(node.npages)])
                self._sync_copies(node)

    @rule(tokens=token_lists)
    def match(self, tokens: list[int]) -> None:
        result = self.tree.match_prefix(tokens)
        run, tail = [], 0
        for prefix in self.prefixes(self.aligned(tokens)):
            places = self.where.get(prefix)
            if places is None:
                break
            if "device" in places and not tail:
                run.append(places["device"])
            else:
                assert "device" not in places, "device page after a lower-only one"
                tail += self.size
        assert result.pages == run
        assert result.num_tokens == len(run) * self.size
        assert result.tail_tokens == tail
        assert all(not n.pages for n in result.tail)

    @rule(tokens=token_lists)
    def promote(self, tokens: list[int]) -> None:
        """Load a match's tail onto the device, parents first (``set_device_pages``)."""
        for node in self.tree.match_prefix(tokens).tail:
            pages = [next(self.ids) for _ in range(node.npages)]
            self.tree.set_device_pages(node, pages)
            for prefix, page in zip(self.node_prefixes(node), pages, strict=True):
                self.where[prefix]["device"] = page

    @rule(tokens=token_lists)
    def lock(self, tokens: list[int]) -> None:
        match = self.tree.match_prefix(tokens)
        node = match.tail[-1] if match.tail else match.node
        self.tree.inc_lock(node)
        self.locks.append((node, self.aligned(tokens)[: node.prefix_len]))

    @rule(data=st.data())
    def unlock(self, data) -> None:
        if self.locks:
            node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
            self.tree.dec_lock(node)

    @rule(tokens=token_lists)
    def start_read(self, tokens: list[int]) -> None:
        match = self.tree.match_prefix(tokens)
        if match.tail:
            self.tree.inc_io(match.tail[-1])
            self.reading.append((match.tail[-1], self.aligned(tokens)[: match.tail[-1].prefix_len]))

    @rule()
    def end_read(self) -> None:
        if self.reading:
            self.tree.dec_io(self.reading.pop()[0])

    @rule(n=st.integers(0, 6), demote_ok=st.booleans())
    def evict(self, n: int, demote_ok: bool) -> None:
        self.demote_ok = demote_ok
        before = self.tree.evictable_pages
        freed = self.tree.evict(n)
        assert len(freed) >= n or self.tree.evictable_pages == 0 or before < n
        self.apply_removals(freed)

    @rule(tier=st.integers(0, 1), n=st.integers(0, 6))
    def evict_tier(self, tier: int, n: int) -> None:
        held = self.tree.tier_pages(tier)
        freed = self.tree.evict_tier(tier, n)
        assert freed >= min(n, 1) or held == 0 or self.locks or self.reading or freed == 0
        self.apply_removals([])

    @rule(tokens=token_lists, tier=st.integers(0, 1))
    def insert_copy(self, tokens: list[int], tier: int) -> None:
        key = self.aligned(tokens)
        handles = [next(self.ids) for _ in range(len(key) // self.size)]
        self.tree.insert_copy(key, tier, handles)
        for prefix, handle in zip(self.prefixes(key), handles, strict=True):
            self.where.setdefault(prefix, {}).setdefault(TIERS[tier], handle)

    @rule(tokens=token_lists)
    def discard_tail(self, tokens: list[int]) -> None:
        match = self.tree.match_prefix(tokens)
        if match.tail and not match.tail[0].lock_ref and not match.tail[0].io_ref:
            self.apply_removals(self.tree.discard(match.tail[0]))

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check_invariants()
        assert self.tree_content() == self.where
        assert self.tree.cached_pages == sum("device" in p for p in self.where.values())


TieredTreeMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_tiered_tree_matches_model = TieredTreeMachine.TestCase


def test_evict_demotes_and_match_crosses_tiers() -> None:
    """S = 2. "a b c d" on the device, with a host copy of "a b"; evicting the leaf
    "c d" without a lower copy and no write-back removes it; with write-back it moves to
    the host and a match returns the device run "a b" then the host tail "c d"."""
    tree = RadixTree(2, tiers=("host",))
    released: list = []
    tree.on_release = lambda tier, handles: released.extend(handles)
    tree.insert([1, 2, 3, 4], [10, 11])
    upper = tree.match_prefix([1, 2]).node
    tree.set_copy(upper, 0, ["h10"])
    assert tree.evict(1) == [11]  # the leaf, no lower copy, no on_demote: gone
    assert tree.match_prefix([1, 2, 3, 4]).num_tokens == 2
    tree.insert([1, 2, 3, 4], [10, 12])
    tree.on_demote = lambda node: tree.set_copy(node, 0, ["h12"]) or True
    assert tree.evict(1) == [12]
    match = tree.match_prefix([1, 2, 3, 4, 5])
    assert (match.pages, match.num_tokens, match.tail_tokens) == ([10], 2, 2)
    assert match.tail[0].copy_in(0) == ["h12"]
    assert tree.evict(1) == [10]  # "a b" has a host copy: it stays, cached below
    match = tree.match_prefix([1, 2, 3, 4])
    assert (match.num_tokens, match.tail_tokens) == (0, 4)
    tree.insert([1, 2, 3, 4], [20, 21])  # recomputed: promoted, not duplicates
    assert tree.match_prefix([1, 2, 3, 4]).pages == [20, 21]
    assert tree.evict_tier(0, 2) == 2 and sorted(released) == ["h10", "h12"]
    tree.check_invariants()
