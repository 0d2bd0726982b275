"""The peer KV tier (L2) controller: one data parallel replica loads a cached prefix from
another replica's device pool instead of recomputing it. Torch-free: it decides and keeps
the protocol; ``memory.peer_link.PeerKVLink`` moves the bytes (torch.distributed), the
replicas' schedulers exchange ``PeerFetchReq`` / ``PeerFetchOut`` over ZeroMQ.

    router: B gets a request; A was sent a longer prefix of it -> hint (A, tokens)
    B (asking)                                         A (serving)
    arrival: own match m < hint, cost model says load
      lock own prefix, PeerFetchReq(xfer, tokens[:end], start=m) ---->
      the request waits (prefetch_ready False)         next loop turn: match its own tree
                                                       (never trusts the hint), lock, gather
                                   <---- PeerFetchOut(xfer, n pages) the pages, unlock,
                                                       answer, post the send (or: 0 pages)
      next loop turn: post the receive (always, even if it no longer wants them)
      a step's start (``poll``, before planning) finds it complete: alloc n pages,
      scatter, insert into the radix tree (as if computed; write-through to the host tier
      as any insert); the request is admitted and matches them: cached_tokens counts
      them, cached_tiers["peer"] says so. Requests arriving meanwhile whose prefix the
      fetch brings wait for it too (the router hints only the first).

Both sides post their point-to-point op at a loop-turn boundary and neither ever blocks
on the other: the ops are asynchronous and polled (``PeerTransfer.done``). A request
waits for its fetch at most ``min(timeout_s, max(recompute estimate, min_wait_s))``,
then is admitted and recomputes what is missing; the pages, when they come, are still
inserted (cache for the next request). Its own prefix is locked only while some request
waits. Failure handling, all ending in a recompute:

* A holds fewer pages than hinted (evicted): it sends what it has from ``start``, or none;
* A does not answer (stalled): the waiters time out; while a fetch to A is unanswered for
  longer than ``timeout_s``, no new fetch is sent to A (``skipped``);
* an answer to a fetch B no longer knows (forgotten after ``PEER_FORGET_S``): B still
  posts the receive (the two sides' ops must pair up in order) and drops the bytes;
* a send or receive that cannot be posted (no memory): the link with that peer is marked
  broken and answers none from then on, in both directions (the pairing is lost);
* B cannot fit the pages (no free or evictable pages), or lost its own prefix while no
  request waited: the bytes are dropped (``fetches_failed``).
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.radix.tree import TreeNode
from radixlm.runtime import messages as m
from radixlm.runtime.memory.cost_model import TierCostModel

__all__ = ["PEER_FORGET_S", "PEER_MAX_FETCH_BYTES", "PEER_MAX_INFLIGHT_BYTES", "PeerCache"]

logger = logging.getLogger("radixlm.peer")
PEER_FORGET_S = 600.0  # an unanswered fetch nobody waits for is forgotten after this
PEER_MAX_FETCH_BYTES = 512 << 20  # pages of one fetch (the staging tensor on each side)
PEER_MAX_INFLIGHT_BYTES = 1 << 30  # per peer: sends not yet received (serving), fetches in flight (asking)


@dataclass(eq=False)
class _Fetch:
    """One request to a peer for the pages of ``tokens[start:end]``."""

    xfer: int
    peer: int
    tokens: array  # the prefix up to ``end`` (packed token ids)
    start: int  # tokens this replica held (device run) when it asked
    end: int
    asked: float
    deadline: float  # waiters are admitted after this
    waiters: set[str] = field(default_factory=set)  # rids of the requests waiting for it
    node: TreeNode | None = None  # locked while someone waits: the own prefix, then the inserted one
    state: str = "asked"  # asked -> copying (receive posted) -> done
    transfer: Any = None  # PeerTransfer while copying
    inserted: tuple[int, int] | None = None  # token span the received pages added to the tree


class PeerCache:
    """The peer tier of replica ``rank`` (module doc).

    ``cache``: the scheduler's ``PrefixCache`` (its tree, ``alloc``, ``insert_loaded``);
    ``link``: moves pages (``stage(pages)``, ``post_send(dst, staging, tag)``,
    ``recv(src, n, tag)``, ``write(transfer, pages, skip)``, ``page_bytes``; transfers have
    ``done()``, ``error()``, ``num_pages``); ``outboxes``: dp rank -> a socket with
    ``try_send(msg) -> bool`` to that replica's scheduler; ``costs``: a ``TierCostModel``
    with a ``peer`` rate; ``timeout_s``, ``min_wait_s``: ``--peer-kv-timeout-s``,
    ``--peer-kv-min-wait-s`` (the wait rule in the module doc).
    """

    def __init__(self, rank: int, cache: Any, link: Any, outboxes: dict[int, Any], costs: TierCostModel,
                 timeout_s: float = 1.0, min_wait_s: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.cache, self.link, self.outboxes = rank, cache, link, outboxes
        self.costs, self.timeout_s, self.min_wait_s, self.clock = costs, timeout_s, min_wait_s, clock
        self.page_size = cache.page_size
        self.max_fetch_pages = max(1, PEER_MAX_FETCH_BYTES // link.page_bytes)
        self.stats = m.PeerStats(page_bytes=link.page_bytes)
        self.fetches: dict[int, _Fetch] = {}  # by xfer
        self.waiting: dict[str, int] = {}  # rid -> xfer it waits for
        self.sending: list[Any] = []  # PeerTransfers posted to peers, not yet done
        self.draining: list[Any] = []  # receives of answers nobody wants any more
        self.broken: set[int] = set()  # peers whose op pairing is lost
        self._xfer = itertools.count(1)
        self.info: dict[str, Any] = {}  # what /get_server_info shows (set by the scheduler)

    # ------------------------------------------------------------ asking side
    def start(self, req: Any, max_tokens: int) -> bool:
        """A request arrives: wait for a fetch in flight that brings pages of its prefix
        (hinted or not: the router hints only the first request it sends away from a
        prefix), or, with a hint (``req.peer_rank``, ``req.peer_tokens``), ask that peer for
        the pages of the hinted prefix past this replica's own device run, when loading them
        beats recomputing them. Returns True if ``req`` now waits for a fetch."""
        if req.rid in self.waiting:
            return False
        if self.fetches and (f := self._covering(req, max_tokens)) is not None:
            self._wait(req, f)
            return True
        peer, S = req.peer_rank, self.page_size
        if peer < 0 or peer == self.rank or peer not in self.outboxes:
            return False
        end = min(req.peer_tokens, max_tokens) // S * S
        if end < S:
            return False
        tree = self.cache.tree
        match = tree.match_prefix(req.token_array(end))
        own = match.num_tokens
        if end - own < S:
            return False  # it holds the hinted prefix itself
        end = min(end, own + self.max_fetch_pages * S)
        if (match.tail or peer in self.broken or not self.costs.worth_loading("peer", own, end)
                or self._unresponsive(peer)):
            self.stats.skipped += 1  # own lower tiers serve it (hierarchical cache), or not worth it
            return False
        tokens = req.token_array(end)
        if self._inflight_bytes(peer) + (end - own) // S * self.link.page_bytes > PEER_MAX_INFLIGHT_BYTES:
            self.stats.skipped += 1
            return False
        xfer = next(self._xfer)
        if not self.outboxes[peer].try_send(m.PeerFetchReq(xfer=xfer, src=self.rank, tokens=tokens.tolist(),
                                                           start=own)):
            self.stats.skipped += 1
            return False
        now = self.clock()
        wait = min(self.timeout_s, max(self.costs.compute.span_seconds(own, end), self.min_wait_s))
        f = _Fetch(xfer, peer, tokens, own, end, now, now + wait)
        if own:
            tree.inc_lock(match.node)  # its own prefix stays for the insert
            f.node = match.node
        self.fetches[xfer] = f
        self.stats.fetches += 1
        self._wait(req, f)
        return True

    def _covering(self, req: Any, max_tokens: int) -> _Fetch | None:
        """A fetch in flight whose pages extend ``req``'s own device run: same tokens up to
        the fetch's end (or ``req``'s), past the fetch's start and past the run."""
        now, S = self.clock(), self.page_size
        for f in self.fetches.values():
            if f.state == "done" or f.deadline <= now:
                continue
            k = min(f.end, max_tokens // S * S)
            if k > f.start and req.token_array(k) == f.tokens[:k]:
                if self.cache.tree.peek_prefix(f.tokens[:k]).num_tokens < k:
                    return f
        return None

    def _wait(self, req: Any, f: _Fetch) -> None:
        f.waiters.add(req.rid)
        self.waiting[req.rid] = f.xfer
        if f.node is None and f.start:  # its waiters had all left: lock its own prefix again
            match = self.cache.tree.match_prefix(f.tokens[: f.start])
            if match.num_tokens == f.start:
                self.cache.tree.inc_lock(match.node)
                f.node = match.node

    def ready(self, req: Any) -> bool:
        """True when ``req`` waits for no fetch: none started, or its fetch ended (inserted
        by ``poll``, none, failed) or passed its deadline. Then ``req.peer_span`` holds the
        tokens the fetch inserted (for ``cached_tiers``), and the lock of a fetch nobody
        waits for any more is released."""
        xfer = self.waiting.get(req.rid)
        if xfer is None:
            return True
        f = self.fetches.get(xfer)
        if f is not None and f.state != "done" and self.clock() < f.deadline:
            return False
        self._release(req, f, timed_out=f is not None and f.state != "done")
        return True

    def cancel(self, req: Any) -> None:
        """The request left (finished or aborted) while it waited."""
        xfer = self.waiting.get(req.rid)
        if xfer is not None:
            self._release(req, self.fetches.get(xfer), timed_out=False)

    def _release(self, req: Any, f: _Fetch | None, timed_out: bool) -> None:
        del self.waiting[req.rid]
        if f is None:
            return
        f.waiters.discard(req.rid)
        if f.inserted is not None:
            req.peer_span = f.inserted
        if timed_out:
            self.stats.waits_timed_out += 1
        if not f.waiters:
            self._unlock(f)
            if f.state == "done":
                del self.fetches[f.xfer]

    def _unlock(self, f: _Fetch) -> None:
        if f.node is not None:
            self.cache.tree.dec_lock(f.node)
            f.node = None

    def on_answer(self, msg: m.PeerFetchOut) -> None:
        """A peer answered: post the receive of its pages (whether or not the fetch is still
        wanted: its send is posted and the pairing must hold), or end the fetch (none)."""
        f = self.fetches.get(msg.xfer)
        if f is not None and f.peer != msg.src:
            f = None  # not ours (cannot happen: xfer ids are this replica's)
        if msg.num_pages <= 0:
            if f is not None and f.state == "asked":
                self.stats.fetches_none += 1
                self._done(f)
            return
        try:
            transfer = self.link.recv(msg.src, msg.num_pages, msg.xfer)
        except Exception:  # no memory for the staging: the pairing with this peer is lost
            logger.exception("peer KV tier: cannot receive %d pages from replica %d; link marked broken",
                             msg.num_pages, msg.src)
            self.broken.add(msg.src)
            if f is not None:
                self.stats.fetches_failed += 1
                self._done(f)
            return
        if f is None or f.state != "asked" or msg.start != f.start:
            self.draining.append(transfer)
            return
        f.transfer, f.state = transfer, "copying"

    def _poll_fetch(self, f: _Fetch) -> None:
        transfer = f.transfer
        if not transfer.done():
            return
        f.transfer = None
        error = transfer.error()
        if error is not None:
            logger.warning("peer KV tier: receive from replica %d failed: %s", f.peer, error)
            self.stats.fetches_failed += 1
        else:
            self._insert(f, transfer)
        self._done(f)

    def _insert(self, f: _Fetch, transfer: Any) -> None:
        n = transfer.num_pages
        end = f.start + n * self.page_size
        self.stats.pages_received += n
        try:
            node, first = self.cache.insert_loaded(f.tokens[:end], f.start, n,
                                                   lambda pages, skip: self.link.write(transfer, pages, skip))
        except Exception:  # writing the pages failed (a device error): dropped, recomputed
            logger.exception("peer KV tier: cannot insert %d pages from replica %d", n, f.peer)
            node, first = None, 0
        if node is None:
            self.stats.fetches_failed += 1  # no room, or its own prefix went meanwhile
            return
        self.stats.fetches_loaded += 1
        self.stats.tokens_inserted += end - first
        self.stats.fetch_seconds += self.clock() - f.asked
        if first < end:
            f.inserted = (first, end)
        if f.waiters:  # the waiters' lock moves to the inserted prefix
            self.cache.tree.inc_lock(node)
            self._unlock(f)
            f.node = node

    def _done(self, f: _Fetch) -> None:
        f.state = "done"
        if not f.waiters:
            self._unlock(f)
            self.fetches.pop(f.xfer, None)

    def _unresponsive(self, peer: int) -> bool:
        """A fetch to ``peer`` has waited for its answer longer than ``timeout_s``."""
        now = self.clock()
        return any(f.peer == peer and f.state == "asked" and now - f.asked > self.timeout_s
                   for f in self.fetches.values())

    def _inflight_bytes(self, peer: int) -> int:
        pages = sum((f.end - f.start) // self.page_size for f in self.fetches.values()
                    if f.peer == peer and f.state != "done")
        return pages * self.link.page_bytes

    # ------------------------------------------------------------ serving side
    def on_request(self, msg: m.PeerFetchReq) -> None:
        """A peer asks for pages: match the tokens in this replica's tree (device pages
        only), lock, gather the pages from ``msg.start`` on, unlock, answer, post the send.
        Answers none when nothing past ``start`` is cached, the link is broken, or the
        sends not yet received by that peer pass ``PEER_MAX_INFLIGHT_BYTES``."""
        peer, S = msg.src, self.page_size
        outbox = self.outboxes.get(peer)
        if outbox is None:
            logger.warning("peer KV tier: request from unknown replica %d", peer)
            return
        reason, pages, node = "", [], None
        if peer in self.broken:
            reason = "link broken"
        elif msg.start < 0 or msg.start % S:
            reason = "start is not page aligned"
        elif sum(t.num_pages for t in self.sending if t.peer == peer) * self.link.page_bytes >= PEER_MAX_INFLIGHT_BYTES:
            reason = "busy"
        else:
            match = self.cache.tree.match_prefix(msg.tokens)
            first = msg.start // S
            pages = match.pages[first : first + self.max_fetch_pages]
            node = match.node
            if not pages:
                reason = "not cached"
        if reason:
            self.stats.requests_refused += 1
            outbox.try_send(m.PeerFetchOut(xfer=msg.xfer, src=self.rank, start=msg.start, num_pages=0, reason=reason))
            return
        tree = self.cache.tree
        tree.inc_lock(node)  # for the copy: the gather reads the pages
        try:
            staging = self.link.stage(pages)
        except Exception:
            logger.exception("peer KV tier: cannot stage %d pages for replica %d", len(pages), peer)
            staging = None
        finally:
            tree.dec_lock(node)  # the gather is enqueued: later writes to the pages run after it
        answer = m.PeerFetchOut(xfer=msg.xfer, src=self.rank, start=msg.start,
                                num_pages=len(pages) if staging is not None else 0,
                                reason="" if staging is not None else "no memory")
        if not outbox.try_send(answer) or staging is None:
            self.stats.requests_refused += 1
            return  # nothing posted: the pairing holds
        try:
            self.sending.append(self.link.post_send(peer, staging, msg.xfer))
        except Exception:  # the peer will post a receive that never pairs
            logger.exception("peer KV tier: cannot send to replica %d; link marked broken", peer)
            self.broken.add(peer)
            return
        self.stats.requests_served += 1
        self.stats.pages_sent += len(pages)

    # ------------------------------------------------------------ each loop turn
    def poll(self) -> None:
        """Finish fetches whose pages arrived (insert them), drop finished sends and drained
        receives, forget unanswered fetches nobody waits for after ``PEER_FORGET_S``.
        Called at the start of a scheduler step, before planning: the pages it takes may
        then be any free page (a page freed by this step's plan may still be read, by a
        swap-out or the hierarchical cache's save, before the step's forward pass)."""
        for f in [f for f in self.fetches.values() if f.state == "copying"]:
            self._poll_fetch(f)
        if self.sending:
            still = []
            for t in self.sending:
                if not t.done():
                    still.append(t)
                elif t.error() is not None:
                    logger.warning("peer KV tier: send to replica %d failed: %s", t.peer, t.error())
            self.sending = still
        if self.draining:
            self.draining = [t for t in self.draining if not t.done()]
        now = self.clock()
        for f in [f for f in self.fetches.values() if f.state == "asked" and not f.waiters]:
            if now - f.asked > PEER_FORGET_S:
                del self.fetches[f.xfer]

    @property
    def busy(self) -> bool:
        """Requests wait for fetches (the scheduler polls for them instead of spinning)."""
        return bool(self.waiting)

    @property
    def holds_locks(self) -> bool:
        return any(f.node is not None for f in self.fetches.values())

    def check_invariants(self) -> None:
        """Waiters and fetches agree; a fetch holds a lock only while someone waits, and
        only on an attached node. Raises AssertionError."""
        for rid, xfer in self.waiting.items():
            f = self.fetches.get(xfer)
            assert f is not None and rid in f.waiters, f"peer fetch {xfer}: waiter {rid} not recorded"
        for f in self.fetches.values():
            assert all(self.waiting.get(rid) == f.xfer for rid in f.waiters), f"peer fetch {f.xfer}: stray waiter"
            assert f.node is None or (f.waiters and f.node.lock_ref > 0 and self.cache.tree.is_attached(f.node)), (
                f"peer fetch {f.xfer}: lock held without waiters or on a detached node")
            assert (f.state == "copying") == (f.transfer is not None), f"peer fetch {f.xfer}: state {f.state}"
