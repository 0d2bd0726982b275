"""The Ray Serve router's state and decisions, without Ray (``router.py`` plugs it into Ray
Serve's request-router interface; tests drive it directly).

Per replica (by its unique id) it knows:

* its cache: precise mode follows the server's KV events (``KVEventSubscriber`` per data
  parallel rank into one ``KVBlockIndex``); a block the router sent there in the last
  ``provisional_s`` seconds counts as held until the events catch up (a turn that follows
  its answer at once). Approximate mode (or a replica without events) uses the policy's
  tree of the prompts sent there (radix/routing.py);
* its load: the requests this router has in flight there (``started`` / ``finished``),
  and the ``kv_usage`` of its last routing stats.

A prompt no replica holds enough of goes to the least loaded replica (ties: fewer cached
blocks, then lower KV usage): new conversations spread by load while the old ones stay
with their caches (radix/routing.py's ``room_by="load"``; the in-process DP router takes the
emptiest cache instead).

``decide`` returns the ranks Ray Serve tries in order (each rank: the replicas it may pick
from, the shortest queue first), or None for power of two choices: policy ``pow2``, no
prompt, or loads imbalanced (radix/routing.py's test).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.radix.routing import BALANCE_ABS, BALANCE_REL, CACHE_THRESHOLD, CacheAwarePolicy
from radixlm.runtime.deploy.protocol import ROUTING_POLICIES
from radixlm.runtime.kv_events import EventBatch, KVBlockIndex, KVEventSubscriber, block_hashes

__all__ = ["ROUTING_MODES", "Decision", "ReplicaRouting"]

ROUTING_MODES = ("precise", "approximate")
PROVISIONAL_S = 5.0
EARLY_COMPLETIONS = 4096  # request ids remembered as completed before they were reported routed
LIVE_ROUTERS: dict[str, Any] = {}  # deployment name -> this process's PrefixCacheRouter (router.py)


@dataclass(frozen=True)
class Decision:
    """``ranks``: replica ids, most preferred rank first (None: power of two choices);
    ``reason``: "pow2", "imbalanced", "prefix", "room"; ``matched_tokens``: the chosen
    replica's cached prefix of the prompt."""

    ranks: list[list[str]] | None
    reason: str
    matched_tokens: int = 0


class ReplicaRouting:
    """Router state (module docstring). ``policy``: the default (``ROUTING_POLICIES``);
    ``mode``: ``ROUTING_MODES``; thresholds as radix/routing.py's. ``subscribe`` makes a
    subscriber (tests pass a fake). ValueError on an unknown policy or mode."""

    def __init__(self, policy: str = "cache_aware", mode: str = "precise", cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs: float = BALANCE_ABS, balance_rel: float = BALANCE_REL,
                 provisional_s: float = PROVISIONAL_S,
                 subscribe: Callable[..., KVEventSubscriber] = KVEventSubscriber,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing mode must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
        self.policy, self.mode = policy, mode
        self._thresholds = dict(cache_threshold=cache_threshold, balance_abs=balance_abs, balance_rel=balance_rel)
        self.cache: CacheAwarePolicy | None = None  # made when the first replica's page size is known
        self.index = KVBlockIndex(group=lambda source: source[0])
        self.subscribers: dict[str, list[KVEventSubscriber]] = {}
        self.inflight: dict[str, int] = {}
        self._open: dict[str, str] = {}  # request id -> replica: routed, not completed yet
        self._early: OrderedDict[str, None] = OrderedDict()  # request ids completed before routed
        self.meta: dict[str, dict] = {}  # replica -> its record_replica_metadata
        self.kv_usage: dict[str, float] = {}
        self.provisional: dict[int, dict[str, float]] = {}  # block hash -> replica -> expiry
        self.provisional_s = provisional_s
        self._subscribe, self._clock = subscribe, clock
        self._lock = threading.Lock()  # provisional (the subscribers never touch it; Ray may call from threads)

    # ------------------------------------------------------------------ replicas
    def sync(self, replicas: dict[str, dict]) -> None:
        """The replicas now running, with their ``record_replica_metadata`` (page size, KV
        capacity, KV event endpoints): new ones are followed, gone ones forgotten."""
        for replica in [r for r in self.inflight if r not in replicas]:
            self.remove(replica)
        for replica, meta in replicas.items():
            if replica in self.inflight and not self.meta.get(replica) and meta:  # its metadata came late
                load = self.inflight[replica]
                self.remove(replica)
                self.add(replica, meta)
                self.inflight[replica] = load
            elif replica not in self.inflight:
                self.add(replica, meta)

    def add(self, replica: str, meta: dict) -> None:
        self.meta[replica] = meta
        if self.cache is None and meta.get("page_size"):
            self.cache = CacheAwarePolicy(meta["page_size"], meta.get("max_total_tokens") or 2**20, room_by="load",
                                          **self._thresholds)
        self.inflight.setdefault(replica, 0)
        if self.cache is not None:
            self.cache.add(replica)
        if self.mode == "precise":
            subs = []
            for ep in meta.get("kv_events") or ():
                source = (replica, ep.get("dp_rank", 0))
                subs.append(self._subscribe(ep["endpoint"], self._applier(source), ep.get("replay"),
                                            topic=ep.get("topic", "")))
            self.subscribers[replica] = subs

    def _applier(self, source: tuple[str, int]) -> Callable[[EventBatch], None]:
        return lambda batch: self.index.apply(source, batch)

    def remove(self, replica: str) -> None:
        """Forget ``replica``: its subscribers stop, its blocks and tree go."""
        for sub in self.subscribers.pop(replica, ()):
            threading.Thread(target=sub.close, daemon=True).start()  # joins its thread: not on the loop
        for source in [s for s in self.index.sources() if s[0] == replica]:
            self.index.drop(source)
        self.inflight.pop(replica, None)
        for rid in [rid for rid, r in self._open.items() if r == replica]:
            del self._open[rid]
        self.meta.pop(replica, None)
        self.kv_usage.pop(replica, None)
        if self.cache is not None:
            self.cache.drop(replica)
        with self._lock:
            for holders in self.provisional.values():
                holders.pop(replica, None)

    def update_stats(self, replica: str, stats: dict) -> None:
        if "kv_usage" in stats:
            self.kv_usage[replica] = float(stats["kv_usage"])

    # ------------------------------------------------------------------ requests
    def started(self, replica: str, ids: Sequence[int] | None, request_id: str | None = None) -> None:
        """A request with prompt ``ids`` went to ``replica``. With ``request_id`` it counts
        in flight until ``finished`` names the same id, whichever of the two Ray reports
        first (a fast request may complete before it is reported routed)."""
        if request_id is None or self._early.pop(request_id, False) is False:
            if request_id is not None:
                self._open[request_id] = replica
            self.inflight[replica] = self.inflight.get(replica, 0) + 1
        if not ids or self.cache is None:
            return
        self.cache.record(replica, ids)
        if self.mode == "precise":
            expiry = self._clock() + self.provisional_s
            with self._lock:
                for h in block_hashes(ids, self.cache.page_size):
                    self.provisional.setdefault(h, {})[replica] = expiry

    def finished(self, replica: str, request_id: str | None = None) -> None:
        """A request to ``replica`` ended (answered, failed, or rejected before it was
        routed: Ray reports those too; an id not routed yet is remembered, the last
        ``EARLY_COMPLETIONS`` of them, so that its ``started`` does not count it)."""
        if request_id is not None:
            replica = self._open.pop(request_id, None)
            if replica is None:
                self._early[request_id] = None
                while len(self._early) > EARLY_COMPLETIONS:
                    self._early.popitem(last=False)
                return
        if self.inflight.get(replica, 0) > 0:
            self.inflight[replica] -= 1

    def decide(self, ids: Sequence[int] | None, candidates: Sequence[str], policy: str | None = None) -> Decision:
        """Where a prompt of ``ids`` should go among ``candidates`` (module docstring)."""
        if (policy or self.policy) == "pow2" or not ids or self.cache is None or not candidates:
            return Decision(None, "pow2")
        loads = {r: self.inflight.get(r, 0) for r in candidates}
        matched, cached = self._caches(ids, candidates)
        choice = self.cache.choose(ids, loads, matched, cached)
        if choice.replica is None:
            return Decision(None, choice.reason)
        rest = sorted((r for r in candidates if r != choice.replica), key=lambda r: loads[r])
        return Decision([[choice.replica], rest] if rest else [[choice.replica]], choice.reason, choice.matched_tokens)

    def _caches(self, ids: Sequence[int], candidates: Sequence[str]) -> tuple[dict[str, int], dict[str, float]]:
        """Per candidate: tokens of ``ids`` cached, and cached pages (ties: lower KV usage)."""
        size = self.cache.page_size
        tree_matched = self.cache.matched(ids)
        matched, cached = {}, {}
        for r in candidates:
            tree = self.cache.trees.get(r)
            followed = self.mode == "precise" and any(s.received for s in self.subscribers.get(r, ()))
            cached[r] = (self.index.group_blocks(r) if followed else tree.cached_pages if tree else 0) \
                + min(self.kv_usage.get(r, 0.0), 0.999)
            matched[r] = 0 if followed else tree_matched.get(r, 0)
        if self.mode == "precise":
            hashes = block_hashes(ids, size)
            for r, blocks in self._precise_match(hashes, [r for r in candidates if matched[r] == 0]).items():
                matched[r] = blocks * size
        return matched, cached

    def _precise_match(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        """Blocks of ``hashes`` each replica holds from the first on: by its events, or sent
        there within ``provisional_s``."""
        held = self.index.match(hashes)
        now = self._clock()
        out = {}
        with self._lock:
            for r in replicas:
                n = held.get(r, 0)
                while n < len(hashes) and (self.provisional.get(hashes[n], {}).get(r, 0.0) > now
                                           or r in self.index.groups_of(hashes[n])):
                    n += 1
                out[r] = n
            if len(self.provisional) > 65536:
                self._sweep(now)
        return out

    def _sweep(self, now: float) -> None:
        for h in [h for h, holders in self.provisional.items() if max(holders.values(), default=0.0) <= now]:
            del self.provisional[h]

    def describe(self) -> dict[str, Any]:
        """Per replica: requests in flight, KV usage, blocks known from events and event
        batches received; the page size the policy uses (None before a replica reported)."""
        return {"page_size": self.cache.page_size if self.cache else None, "replicas": {
            r: {"inflight": n, "kv_usage": self.kv_usage.get(r), "blocks": self.index.group_blocks(r),
                "event_batches": sum(s.received for s in self.subscribers.get(r, ()))}
            for r, n in self.inflight.items()}}

    def close(self) -> None:
        for replica in list(self.subscribers):
            for sub in self.subscribers.pop(replica):
                sub.close()
