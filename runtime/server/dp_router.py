"""Data parallelism: route each request to one of M replicas (``--dp-size``).

The tokenizer process holds one PUSH socket per replica; every replica's outputs come back
on the one PULL socket. ``DPRouter`` has ``MsgSocket.asend_nowait``'s shape, so the
tokenizer manager sends through it unchanged:

* ``GenerateReq``: to the replica the policy picks; the sample stays there (its
  ``AbortReq`` follows it) until ``release``.
* anything else (flush, invariant checks): to every replica; the tokenizer manager merges
  the M replies.

Policies (``--dp-routing``):

* ``cache_aware`` (SGLang's router; the policy is radix/routing.py's ``CacheAwarePolicy``,
  shared with the Ray Serve router): per replica a radix tree of the prompts sent there,
  trimmed to its KV capacity. Imbalanced loads (samples in flight): the least loaded
  replica; else the longest cached prefix when it covers more than half the prompt; else
  the replica with the fewest cached pages.
* ``round_robin``: replicas in turn (baseline: shared prefixes land anywhere).

A request's ``data_parallel_rank`` (SGLang's field) overrides the policy. With the peer KV
tier (``peer_hints``, ``--enable-peer-kv``) the router keeps the trees under either policy
and, when the replica it picked matches a shorter prefix than another one (by a page or
more), tells it where the longer one went: ``GenerateReq.peer_rank`` / ``peer_tokens``. That
replica's scheduler may then fetch the pages from there (scheduler/peer.py) instead of
recomputing them; the hint is never trusted (the other replica may have evicted them).
"""

from __future__ import annotations

import itertools
from typing import Any

from radixlm.radix.routing import BALANCE_ABS, CacheAwarePolicy
from radixlm.runtime import messages as m
from radixlm.runtime.server_args import DP_ROUTING_POLICIES

__all__ = ["BALANCE_ABS", "DP_ROUTING_POLICIES", "DPRouter"]


class DPRouter:
    """Routes messages over ``socks`` (one per replica, in dp-rank order). ``capacity_tokens``:
    each replica's KV capacity (its tree is trimmed to it); ``page_size``: the radix pages;
    ``peer_hints``: attach peer KV hints (module doc); ``balance_abs``: cache_aware's load
    imbalance bound (samples in flight, ``--dp-balance-abs``)."""

    def __init__(self, socks: list[Any], policy: str, capacity_tokens: int, page_size: int,
                 peer_hints: bool = False, balance_abs: int = BALANCE_ABS) -> None:
        if policy not in DP_ROUTING_POLICIES:
            raise ValueError(f"unknown --dp-routing {policy!r} (choices: {', '.join(DP_ROUTING_POLICIES)})")
        self.socks, self.policy, self.peer_hints = socks, policy, peer_hints
        self.num_replicas = len(socks)
        self.loads = [0] * len(socks)  # samples in flight per replica
        self.routed = [0] * len(socks)  # samples sent per replica, ever
        self.where: dict[str, int] = {}  # sample id -> replica
        self.cache_policy = CacheAwarePolicy(page_size, capacity_tokens, balance_abs=balance_abs)
        for replica in range(len(socks)):
            self.cache_policy.add(replica)
        self._turn = itertools.count()

    # -------------------------------------------------------------- MsgSocket's shape
    def asend_nowait(self, msg: m.Message) -> None:
        if isinstance(msg, m.GenerateReq):
            replica, hint = self.route(msg.input_ids, msg.data_parallel_rank)
            if hint is not None:
                msg.peer_rank, msg.peer_tokens = hint
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

    @property
    def trees(self) -> dict:
        """Replica -> the radix tree of the prompts sent there (cache-aware, or with hints)."""
        return self.cache_policy.trees

    def close(self) -> None:
        for sock in self.socks:
            sock.close()

    # -------------------------------------------------------------------- the policy
    def pick(self, ids: list[int], requested: int | None = None) -> int:
        """The replica for a prompt of ``ids`` (``route``'s, without the hint)."""
        return self.route(ids, requested)[0]

    def route(self, ids: list[int], requested: int | None = None) -> tuple[int, tuple[int, int] | None]:
        """The replica for a prompt of ``ids`` (``requested``: the client's choice, in range)
        and, with ``peer_hints``, (replica, tokens) of another replica whose tree matches at
        least a page more of it (None otherwise). Records the prompt in the chosen
        replica's tree (cache-aware, or with hints)."""
        matched = None
        if requested is not None:
            replica = requested
        elif self.policy == "round_robin":
            replica = next(self._turn) % self.num_replicas
        else:
            matched = self.cache_policy.matched(ids)
            choice = self.cache_policy.choose(ids, dict(enumerate(self.loads)), matched)
            replica = choice.replica if choice.replica is not None else self.loads.index(min(self.loads))
        hint = None
        if self.peer_hints:
            if matched is None:
                matched = self.cache_policy.matched(ids)
            source = max(range(self.num_replicas), key=lambda i: matched[i])
            if matched[source] >= matched[replica] + self.cache_policy.page_size:
                hint = (source, matched[source])
        if self.policy == "cache_aware" or self.peer_hints:
            self.cache_policy.record(replica, ids)
        return replica, hint
