"""The hierarchical KV cache's controller: the tiers under the radix tree, seen from the
scheduler. Torch-free: it decides what moves where and records it; the host pool
(``memory.host_pool.HostKVPool``) and the disk store (``memory.disk_store.DiskStore``)
move the bytes.

    L1 device pool  --save (write policy)-->  L3 host pool (pinned)  --write-through-->  L4 disk
         ^                                          |   ^                                    |
         '------------- load (admission) -----------'   '-------- prefetch (waiting) --------'

Tiers are named in the tree (``RadixTree(tiers=("host", "disk"))``); a node's host copy
is a list of host rows (one per page), its disk copy a list of page keys (the token-prefix
hash chain, ``disk_store.page_key``). Lower copies are inclusive: a page loaded back to
the device keeps its host and disk copies.

* **Write policies** (``--hicache-write-policy``): ``write_through`` copies every page the
  tree takes to the host (when it is inserted); ``write_through_selective`` only pages of
  nodes matched at least ``--hicache-write-threshold`` times; ``write_back`` copies a page
  down only when the device evicts it (``RadixTree.on_demote``). Every page that reaches
  the host is written to the disk tier as well (in the background), so the disk holds what
  the host ever held, and survives a restart.
* **Loads** (``match_and_lock``): the matched tail's host pages get device pages now and
  their copy is issued before the next forward (``issue``: saves, then loads, on the host
  pool's save and load streams; the forward waits for the loads), when the cost model finds
  loading them faster than recomputing them.
* **Prefetch** (``prefetch``): a waiting request whose match goes on into disk-only pages
  starts reading them into host rows; admission waits for the reads, or for
  ``--hicache-prefetch-timeout-s``, then takes what has arrived and recomputes the rest.
* **Safety**: a read that fails verification (corrupt, truncated, foreign) drops the
  node and what hangs below it: a miss, recomputed. Locks cover pages in flight: loaded
  nodes are locked by their request, prefetched ones by the prefetch, host rows that a
  disk write reads by ``io_ref`` (and rows the tree drops meanwhile, with a device
  eviction of a subtree, are freed only when the write ends: it reads them in place).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.radix import RadixTree
from radixlm.radix.tree import TreeNode
from radixlm.runtime.memory.cost_model import TierCostModel
from radixlm.runtime.memory.disk_store import ROOT_KEY, PageHeader, page_key
from radixlm.runtime.memory.page_allocator import PageAllocator

__all__ = ["TierConfigError", "WRITE_POLICIES", "HiCache", "HiCacheStats"]

logger = logging.getLogger("radixlm.hicache")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HOST, DISK = 0, 1  # lower tier indices in the tree
DISK_RATE_WEIGHT_BYTES = 64 << 20  # a prefetch of this size weighs as much as the disk rate known before it


class TierConfigError(ValueError):
    """A ``--hicache-*`` setting this host cannot serve (a host tier no larger than the device
    pool or beyond the host's memory, a storage folder that cannot be written, a disk quota
    below one page): start-up stops with this message."""


@dataclass
class HiCacheStats:
    """Cumulative counters (pages unless named tokens / bytes / seconds)."""

    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    pages_moved: dict[str, int] = field(default_factory=lambda: {
        "device_to_host": 0, "host_to_device": 0, "host_to_disk": 0, "disk_to_host": 0})
    prefetch_hits: int = 0  # prefetches whose every page arrived before admission
    prefetch_timeouts: int = 0  # admitted before the prefetch finished
    prefetch_failed: int = 0  # ended with a page missing or failing verification (the node recomputed)
    prefetch_failures: int = 0  # pages that failed verification (dropped, recomputed)
    prefetch_seconds: float = 0.0  # summed start -> done (or timeout) of prefetches
    prefetch_count: int = 0
    skipped_loads: int = 0  # lower-tier pages matched but recomputed (cost model, or a prefetch not in time)
    disk_writes_skipped: int = 0  # pages not written: the quota or the disk was full


@dataclass
class _Prefetch:
    """A waiting request's disk reads: the nodes read, their host rows, the reads."""

    node: TreeNode  # deepest node read (locked for the prefetch)
    reads: list[tuple[TreeNode, list[int], list[Any]]]  # (node, host rows, futures)
    started: float
    tokens: int  # tokens being read
    timeout: float  # seconds admission waits: the flag's, at most what recomputing them takes
    ends: list[float] = field(default_factory=list)  # when each read ended (reader threads append)


class HiCache:
    """Tier bookkeeping for one scheduler (module docstring).

    ``tree``: a RadixTree made with ``tiers=("host",)`` or ``("host", "disk")``;
    ``host_pool``: moves bytes (``save(device_pages, rows)``, ``load(rows, device_pages)``,
    ``wait_saves()``, ``row(r)`` (also a disk read's buffer), ``adopt_row(r)``, ``num_pages``
    rows with row 0 unused); ``disk``: a DiskStore or None; ``costs``: when loading beats recomputing.
    ValueError for an unknown write policy or a tree whose tiers do not match.
    """

    def __init__(self, tree: RadixTree, host_pool: Any, disk: Any, costs: TierCostModel,
                 write_policy: str = "write_through", write_threshold: int = 2,
                 prefetch_timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; choose from {WRITE_POLICIES}")
        expected = ("host", "disk") if disk is not None else ("host",)
        if tree.tiers != expected:
            raise ValueError(f"tree tiers {tree.tiers} != {expected}")
        self.tree, self.host, self.disk, self.costs = tree, host_pool, disk, costs
        self.page_size = tree.page_size
        self.write_policy, self.write_threshold = write_policy, write_threshold
        self.prefetch_timeout_s, self.clock = prefetch_timeout_s, clock
        self.host_rows = PageAllocator(host_pool.num_pages)
        self.stats = HiCacheStats()
        self.saves: list[tuple[list[int], list[int]]] = []  # (device pages, host rows), to issue
        self.loads: list[tuple[list[int], list[int]]] = []  # (host rows, device pages), to issue
        self.disk_queue: list[TreeNode] = []  # nodes whose path goes to the disk after issue
        self.disk_writes: list[tuple[Any, TreeNode, list[int]]] = []  # (last page's future, node, rows read)
        self._writing: Counter[int] = Counter()  # host rows queued disk writes read (how many writes)
        self._deferred: set[int] = set()  # rows released by the tree while a write reads them: freed after it
        self.prefetches: dict[str, _Prefetch] = {}
        self._late: list[tuple[TreeNode, list[int], list[Any]]] = []  # reads a timeout left running
        self._disk_rows: set[int] = set()  # host rows filled from the disk (hit accounting)
        self._keep_disk = False  # reset: the tree forgets disk pages, the files stay
        self.info: dict[str, Any] = {}  # what /get_server_info shows (set by the scheduler)
        tree.on_release = self._release
        if write_policy == "write_back":
            tree.on_demote = self._save

    # ------------------------------------------------------------ start-up
    def index_disk(self) -> int:
        """Put the disk store's pages (an earlier process's) into the tree as disk-only
        nodes. Pages whose chain does not reach the root are deleted. Returns pages indexed."""
        if self.disk is None:
            return 0
        headers = {h.key: h for h in self.disk.index()}
        parents = {h.parent for h in headers.values()}
        indexed: set[bytes] = set()
        for leaf in [h for h in headers.values() if h.key not in parents]:  # every page is on a leaf's chain
            chain, key = [], leaf.key
            while key in headers and len(chain) <= len(headers):
                chain.append(headers[key])
                key = headers[key].parent
            if key != ROOT_KEY:  # a page of the chain is missing
                continue
            chain.reverse()
            self.tree.insert_copy([t for h in chain for t in h.tokens], DISK, [h.key for h in chain])
            indexed.update(h.key for h in chain)
        orphans = [k for k in headers if k not in indexed]
        if orphans:
            logger.warning("disk tier: %d pages whose prefix is missing removed", len(orphans))
            self.disk.delete(orphans)
        return len(indexed)

    # ------------------------------------------------------------ matching
    def load_tail(self, tail: tuple[TreeNode, ...], start_tokens: int,
                  alloc: Callable[[int], list[int] | None]) -> tuple[TreeNode | None, list[int], dict[str, int]]:
        """Promote the leading nodes of a match's ``tail`` (starting at token
        ``start_tokens``) that have a host copy and are worth loading: device pages from
        ``alloc`` (which may evict), ``set_device_pages``, and a load queued for ``issue``.
        The caller has locked ``tail[-1]``. Returns (deepest node loaded or None, device
        pages loaded, tokens per source tier: {"host": n, "disk": n} where disk counts
        pages a prefetch brought)."""
        loaded_node, pages, source = None, [], {"host": 0, "disk": 0}
        pos = start_tokens
        for i, node in enumerate(tail):
            rows = node.copy_in(HOST)
            tokens = node.npages * self.page_size
            if rows is None or not self.costs.worth_loading("host", pos, pos + tokens):
                self.stats.skipped_loads += sum(n.npages for n in tail[i:])
                break
            got = alloc(node.npages)
            if got is None:
                break
            self.tree.set_device_pages(node, got)
            self.loads.append((list(rows), got))
            pages.extend(got)
            from_disk = sum(r in self._disk_rows for r in rows) * self.page_size
            source["disk"] += from_disk
            source["host"] += tokens - from_disk
            loaded_node, pos = node, pos + tokens
        self.stats.pages_moved["host_to_device"] += len(pages)
        return loaded_node, pages, source

    def count_hits(self, device_tokens: int, source: dict[str, int]) -> None:
        self.stats.hit_tokens["device"] += device_tokens
        for tier, n in source.items():
            self.stats.hit_tokens[tier] += n

    def on_match(self, node: TreeNode) -> None:
        """write_through_selective: copy down the matched device path's nodes hit at least
        ``write_threshold`` times."""
        if self.write_policy != "write_through_selective":
            return
        for step in _path(node):
            if step.pages and step.copy_in(HOST) is None and step.hit_count >= self.write_threshold:
                self._save(step)

    def on_insert(self, node: TreeNode) -> None:
        """write_through: copy down every device node of the path without a host copy."""
        if self.write_policy != "write_through":
            return
        for step in reversed(list(_path(node))):  # parents first: their disk keys chain on
            if step.pages and step.copy_in(HOST) is None:
                self._save(step)

    # ------------------------------------------------------------ copies down
    def _save(self, node: TreeNode) -> bool:
        rows = self._alloc_rows(node.npages)
        if rows is None:
            return False
        self.tree.set_copy(node, HOST, rows)
        self.saves.append((list(node.pages), rows))
        self.stats.pages_moved["device_to_host"] += len(rows)
        if self.disk is not None and node.copy_in(DISK) is None:
            self.tree.inc_io(node)  # its host rows stay until the disk write has read them
            self.disk_queue.append(node)
        return True

    def _alloc_rows(self, n: int) -> list[int] | None:
        short = n - self.host_rows.num_free
        if short > 0:
            self.tree.evict_tier(HOST, short)
        return self.host_rows.alloc(n)

    def _release(self, tier: int, handles: list) -> None:
        if tier == HOST:
            # A row a queued disk write still reads (the node's io_ref does not stop a
            # device eviction from dropping a subtree with no lower copy) is freed after it.
            busy = {r for r in handles if self._writing[r] > 0}
            self._deferred |= busy
            self.host_rows.free([r for r in handles if r not in busy] if busy else handles)
            self._disk_rows.difference_update(handles)
        elif self.disk is not None and not self._keep_disk:
            self.disk.delete(handles)

    def reset(self) -> list[int]:
        """Flush the cache (``/flush_cache``, idle): device and host tiers are emptied, the
        disk tier persists and is indexed again. Returns the device pages to free."""
        self.drain()
        self._keep_disk = True
        try:
            pages = self.tree.reset()
        finally:
            self._keep_disk = False
        self.index_disk()
        return pages

    # ------------------------------------------------------------ I/O
    def issue(self) -> None:
        """Run the queued copies (saves first: a page may be saved then reused as a load
        target) and submit the queued disk writes. Called by the scheduler right before
        each launch, after planning. A saved device page may be evicted and rewritten at
        once: ``host.save`` makes later kernels wait for its gather."""
        if self.saves:
            device = [p for pages, _ in self.saves for p in pages]
            rows = [r for _, rows in self.saves for r in rows]
            self.saves = []
            self.host.save(device, rows)
        if self.loads:
            rows = [r for rows, _ in self.loads for r in rows]
            device = [p for _, pages in self.loads for p in pages]
            self.loads = []
            self.host.load(rows, device)
        if self.disk_queue:
            queue, self.disk_queue = self.disk_queue, []
            for node in queue:
                self._write_disk(node)

    def _write_disk(self, node: TreeNode) -> None:
        """Write the pages of ``node``'s path that have a host copy and no disk copy
        (``node`` itself, and ancestors split off it or not written yet) from their host
        rows; the tree records their keys now, ``node``'s io lock (taken by ``_save``)
        goes when the last write ends. Skipped pages: the quota or the disk is full."""
        if node.parent is None:
            return
        disk, key, last, written, read = self.disk, ROOT_KEY, None, 0, []
        for step in reversed(list(_path(node))):
            keys = step.copy_in(DISK)
            if keys is not None:
                key = keys[-1]
                continue
            tokens, chain, start = step.key, [], key
            for i in range(step.npages):
                key = page_key(key, tokens[i * self.page_size : (i + 1) * self.page_size])
                chain.append(key)
            rows = step.copy_in(HOST)
            if rows is None or not self._disk_room(step.npages):
                self.stats.disk_writes_skipped += step.npages if rows is not None else 0
                continue
            prev = [start, *chain[:-1]]
            for i, row in enumerate(rows):
                header = PageHeader(key=chain[i], parent=prev[i],
                                    tokens=tuple(tokens[i * self.page_size : (i + 1) * self.page_size]))
                last = disk.submit_write(header, self._payload(row))
            read += rows
            self.tree.set_copy(step, DISK, chain)
            written += step.npages
        self.stats.pages_moved["host_to_disk"] += written
        if last is None:
            self.tree.dec_io(node)
        else:
            self._writing.update(read)
            self.disk_writes.append((last, node, read))

    def _disk_room(self, pages: int) -> bool:
        disk = self.disk
        if disk.writes_disabled:
            return False
        room = disk.capacity_pages - self.tree.tier_pages(DISK)
        if room < pages:
            self.tree.evict_tier(DISK, pages - room)
            room = disk.capacity_pages - self.tree.tier_pages(DISK)
        return room >= pages

    def _payload(self, row: int) -> Callable[[], Any]:
        host = self.host

        def read() -> Any:  # on the disk writer thread
            host.wait_saves()
            return host.row(row)  # no copy: the row is not freed before the write is done (_release)

        return read

    def poll(self) -> None:
        """Take finished disk writes (release their io locks) and reads a timeout left."""
        if self._late:
            self.poll_late_reads()
        if self.disk_writes:
            still = []
            for future, node, rows in self.disk_writes:
                if not future.done():
                    still.append((future, node, rows))
                    continue
                if node.parent is not None:
                    self.tree.dec_io(node)
                self._writing.subtract(rows)
                done = {r for r in rows if self._writing[r] <= 0}
                for r in done:
                    del self._writing[r]
                done &= self._deferred
                if done:
                    self._deferred -= done
                    self.host_rows.free(sorted(done))
            self.disk_writes = still

    # ------------------------------------------------------------ prefetch
    def prefetch(self, rid: str, tail: tuple[TreeNode, ...], start_tokens: int) -> bool:
        """Start reading the disk-only nodes of a waiting request's match tail (after its
        host part) into host rows, if loading them beats recomputing. Returns True if a
        prefetch is running for ``rid`` (started now or before)."""
        if rid in self.prefetches:
            return True
        if self.disk is None:
            return False
        pos, reads, deepest, tokens = start_tokens, [], None, 0
        for node in tail:
            span = node.npages * self.page_size
            if node.copy_in(HOST) is None:
                keys = node.copy_in(DISK)
                if keys is None or not self.costs.worth_loading("disk", pos, pos + span):
                    break
                rows = self._alloc_rows(node.npages)
                if rows is None:
                    break
                reads.append((node, rows, None))
                tokens += span
            deepest, pos = node, pos + span
        if not reads:
            return False
        self.tree.inc_lock(deepest)
        self.host.wait_saves()  # a row freed just now may still be a save's target or a load's source
        timeout = self.prefetch_timeout_s
        if not self.costs.always_load:  # never wait longer than recomputing would take
            timeout = min(timeout, self.costs.compute.span_seconds(start_tokens, pos))
        pf = self.prefetches[rid] = _Prefetch(deepest, [], self.clock(), tokens, timeout)
        clock, ends = self.clock, pf.ends
        for node, rows, _ in reads:
            futures = [self.disk.submit_read(key, self.host.row(row)) for key, row in zip(node.copy_in(DISK), rows,
                                                                                        strict=True)]
            for f in futures:
                f.add_done_callback(lambda _, ends=ends: ends.append(clock()))
            pf.reads.append((node, rows, futures))
        return True

    def prefetch_ready(self, rid: str, cancel: bool = False) -> bool:
        """True when ``rid`` has no prefetch, or its prefetch ended (all read, timed out, or
        ``cancel``); then the read nodes have host copies (failed ones were dropped) and the
        prefetch's lock is gone. Reads still running at the end finish in the background."""
        pf = self.prefetches.get(rid)
        if pf is None:
            return True
        done = all(f.done() for _, _, futures in pf.reads for f in futures)
        waited = self.clock() - pf.started
        if not done and waited < pf.timeout and not cancel:
            return False
        del self.prefetches[rid]
        self.stats.prefetch_count += 1
        self.stats.prefetch_seconds += waited
        if done and all(f.result() for _, _, futures in pf.reads for f in futures):
            self.stats.prefetch_hits += 1
            pages = sum(len(rows) for _, rows, _ in pf.reads)
            self._observe_disk(pages * self.costs.page_bytes, max(pf.ends) - pf.started)
        elif done:
            self.stats.prefetch_failed += 1
        else:
            self.stats.prefetch_timeouts += 1
        self.tree.dec_lock(pf.node)
        for node, rows, futures in pf.reads:
            self._finish_read(node, rows, futures)
        return True

    def _observe_disk(self, nbytes: int, seconds: float) -> None:
        """Refine the cost model's disk read rate (bytes/s) with a prefetch that read
        ``nbytes`` in ``seconds`` (start to its last read's end, per-file costs included):
        an average weighted by bytes, a prefetch of DISK_RATE_WEIGHT_BYTES counting as much
        as everything before it. The start-up measurement reads files just written, which
        some storage serves faster than pages written long before."""
        rates = self.costs.read_bytes_per_s
        if seconds <= 0 or "disk" not in rates:
            return
        w = nbytes / (nbytes + DISK_RATE_WEIGHT_BYTES)
        rates["disk"] = (1 - w) * rates["disk"] + w * nbytes / seconds

    def cancel_prefetch(self, rid: str) -> None:
        """The request left (finished or aborted) while prefetching."""
        self.prefetch_ready(rid, cancel=True)

    def _finish_read(self, node: TreeNode, rows: list[int], futures: list[Any]) -> None:
        """A node's reads: all verified -> host copies; a failed one -> the node goes (a
        miss, recomputed); unfinished (a timeout) -> handed over when they finish. The
        node may have been split meanwhile: its rows then go to it and the ancestors
        split off it, last rows to the deepest."""
        if not all(f.done() for f in futures):
            self._late.append((node, rows, futures))
            return
        ok = [f.result() and self._adopt(row) for f, row in zip(futures, rows, strict=True)]
        if not all(ok):
            self.stats.prefetch_failures += ok.count(False)
            self.host_rows.free(rows)
            if node.parent is not None and node.lock_ref == 0 and node.io_ref == 0:
                self.tree.discard(node)
            return
        self.stats.pages_moved["disk_to_host"] += len(rows)
        while rows:
            mine, rows = rows[len(rows) - node.npages :], rows[: len(rows) - node.npages]
            if node.parent is None or node.copy_in(HOST) is not None or len(mine) != node.npages:
                self.host_rows.free(mine)
            else:
                self.tree.set_copy(node, HOST, mine)
                self._disk_rows.update(mine)
            if node.parent is None:
                self.host_rows.free(rows)
                return
            node = node.parent

    def _adopt(self, row: int) -> bool:
        """A row a disk read filled in place (its payload verified): taken by the host pool,
        or False if its FP8 flag byte is not 0 / 1 (a miss)."""
        try:
            self.host.adopt_row(row)
        except ValueError as e:
            logger.warning("disk tier: a read page is not usable: %s", e)
            return False
        return True

    def poll_late_reads(self) -> None:
        late, self._late = self._late, []
        for node, rows, futures in late:
            self._finish_read(node, rows, futures)

    # ------------------------------------------------------------ state
    def drain(self) -> None:
        """Wait for every queued copy and disk write (shutdown, tests)."""
        self.issue()
        self.host.wait_saves()
        if self.disk is not None:
            self.disk.drain()
        self.poll()

    def check_invariants(self) -> None:
        """Host rows: free + held by the tree + being prefetched + released but still read by
        a disk write == capacity, no row twice."""
        held = [r for n in self.tree._iter_nodes() for r in (n.copy_in(HOST) or ())]  # noqa: SLF001
        reading = [r for pf in self.prefetches.values() for _, rows, _ in pf.reads for r in rows]
        reading += [r for _, rows, _ in self._late for r in rows]
        used = held + reading + sorted(self._deferred)
        assert len(set(used)) == len(used), "a host row held twice"
        free = self.host_rows.free_pages()
        assert not free & set(used), "a host row both free and held"
        assert len(free) + len(used) == self.host_rows.capacity, (
            f"host rows leak: free {len(free)} + held {len(held)} + reading {len(reading)} + "
            f"waiting for a disk write {len(self._deferred)} != {self.host_rows.capacity}")


def _path(node: TreeNode):
    """``node`` and its ancestors, the root excluded."""
    while node.parent is not None:
        yield node
        node = node.parent
