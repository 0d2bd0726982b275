"""Data parallelism: route each request to one of M replicas (``--dp-size``).

The tokenizer process holds one PUSH socket per replica; every replica's outputs come back
on the one PULL socket. ``DPRouter`` has ``MsgSocket.asend_nowait``'s shape, so the
tokenizer manager sends through it unchanged:

* ``GenerateReq``: to the replica the policy picks; the sample stays there (its
  ``AbortReq`` follows it) until ``release``.
* anything else (flush, invariant checks): to every replica; the tokenizer manager merges
  the M replies.

Policies (``--dp-routing``):

* ``cache_aware`` (SGLang's router, ``sgl-router`` "cache_aware"): the router keeps, per
  replica, a radix tree (radix/tree.py) of the prompts it sent there, an approximation of
  that replica's prefix cache, trimmed to its KV capacity by LRU. If the loads (samples
  in flight) are imbalanced, ``max - min > BALANCE_ABS`` and ``max > BALANCE_REL * min``,
  the least loaded replica gets the request; else the replica whose tree matches the
  longest prefix, when that covers more than ``CACHE_THRESHOLD`` of the prompt; else the
  replica whose tree is smallest (most room to cache).
* ``round_robin``: replicas in turn (baseline: shared prefixes land anywhere).
"""

from __future__ import annotations

import itertools
from typing import Any

from radixlm.radix import RadixTree
from radixlm.runtime import messages as m
from radixlm.runtime.server_args import DP_ROUTING_POLICIES

__all__ = ["DP_ROUTING_POLICIES", "DPRouter"]

CACHE_THRESHOLD = 0.5  # sgl-router's defaults
BALANCE_ABS = 32
BALANCE_REL = 1.0001


class DPRouter:
    """Routes messages over ``socks`` (one per replica, in dp-rank order). ``capacity_tokens``:
    each replica's KV capacity (its tree is trimmed to it); ``page_size``: the radix pages."""

    def __init__(self, socks: list[Any], policy: str, capacity_tokens: int, page_size: int) -> None:
        if policy not in DP_ROUTING_POLICIES:
            raise ValueError(f"unknown --dp-routing {policy!r} (choices: {', '.join(DP_ROUTING_POLICIES)})")
        self.socks, self.policy = socks, policy
        self.num_replicas = len(socks)
        self.loads = [0] * len(socks)  # samples in flight per replica
        self.routed = [0] * len(socks)  # samples sent per replica, ever
        self.where: dict[str, int] = {}  # sample id -> replica
        self.trees = [RadixTree(page_size) for _ in socks]
        self.capacity_pages = max(1, capacity_tokens // page_size)
        self._page_ids = itertools.count(1)  # the trees' page ids: placeholders, never freed
        self._turn = itertools.count()

    # -------------------------------------------------------------- MsgSocket's shape
    def asend_nowait(self, msg: m.Message) -> None:
        if isinstance(msg, m.GenerateReq):
            replica = self.pick(msg.input_ids)
            self.where[msg.rid] = replica
            self.loads[replica] += 1
            self.routed[replica] += 1
            self.socks[replica].asend_nowait(msg)
        elif isinstance(msg, m.AbortReq):
            replica = self.where.get(msg.rid)
            if replica is not None:
                self.socks[replica].asend_nowait(msg)
        else:
            for sock in self.socks:
                sock.asend_nowait(msg)

    def release(self, rid: str) -> None:
        """The sample ``rid`` ended (finished or aborted): its replica's load drops."""
        replica = self.where.pop(rid, None)
        if replica is not None:
            self.loads[replica] -= 1

    def close(self) -> None:
        for sock in self.socks:
            sock.close()

    # -------------------------------------------------------------------- the policy
    def pick(self, ids: list[int]) -> int:
        """The replica for a prompt of ``ids`` (and, cache-aware, record it there)."""
        if self.policy == "round_robin":
            return next(self._turn) % self.num_replicas
        loads = self.loads
        if max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads):
            replica = loads.index(min(loads))
        else:
            matched = [tree.peek_prefix(ids).num_tokens for tree in self.trees]
            best = max(range(self.num_replicas), key=lambda i: (matched[i], -loads[i]))
            if matched[best] > CACHE_THRESHOLD * len(ids):
                replica = best
            else:
                replica = min(range(self.num_replicas), key=lambda i: (self.trees[i].cached_pages, loads[i]))
        self._remember(replica, ids)
        return replica

    def _remember(self, replica: int, ids: list[int]) -> None:
        tree = self.trees[replica]
        pages = len(ids) // tree.page_size
        tree.insert(ids[: pages * tree.page_size], [next(self._page_ids) for _ in range(pages)])
        over = tree.cached_pages - self.capacity_pages
        if over > 0:
            tree.evict(over)
