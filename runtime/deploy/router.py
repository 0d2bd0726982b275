"""``PrefixCacheRouter``: Ray Serve's request-router interface (``ray.serve.request_router``)
over ``ReplicaRouting`` (deploy/routing.py).

Set on the server deployment with ``RequestRouterConfig(request_router_class=PrefixCacheRouter,
request_router_kwargs={"policy": ..., "mode": ...})`` (deploy/app.py does); it then routes
every call a ``DeploymentHandle`` makes to that deployment, in the caller's process (here
the ingress). Per call, with a ``ProxyRequest`` as the first argument:

* ``pin`` set: that replica only (admin calls sent to each replica);
* policy ``pow2``, no ``routing_ids``, or imbalanced loads: Ray Serve's own power of two
  choices (``PowerOfTwoChoicesRequestRouter.choose_replicas``, the default router's choice;
  each chosen replica goes to the request it was chosen for, not FIFO), among the replicas
  not in ``exclude``;
* else the ranks of ``ReplicaRouting.decide``: the replica holding the longest prefix (or
  with the most room), then the others by load; Ray Serve takes the first rank whose
  replica accepts (below ``max_ongoing_requests``).

Replicas come from ``update_replicas`` (their ``replica_metadata`` names the KV event
endpoints); a replica that leaves or dies is forgotten with its blocks. The time spent in
``choose_replicas`` is kept in ``decision_seconds`` (the router's added latency).
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Any

from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from radixlm.runtime.deploy import routing as routing_state
from radixlm.runtime.deploy.protocol import ProxyRequest
from radixlm.runtime.deploy.routing import ReplicaRouting

__all__ = ["PrefixCacheRouter", "live_routers"]


def live_routers() -> dict[str, PrefixCacheRouter]:
    """This process's routers by deployment name (the ingress reads the replica list). The
    registry lives in deploy/routing.py: Ray Serve ships this class by value (cloudpickle),
    so a dict of this module's would be a copy."""
    return dict(routing_state.LIVE_ROUTERS)


def _proxy_request(pending: PendingRequest | None) -> ProxyRequest | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], ProxyRequest):
        return None
    return pending.args[0]


class PrefixCacheRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Prefix-cache-aware routing for radixlm replicas (module docstring). Not FIFO (as Ray's
    own ``PrefixCacheAffinityRouter``): Ray Serve's ``FIFOMixin`` hands a chosen replica to the
    oldest waiting request, which would send one prompt to the replica chosen for another's
    prefix (and a pinned call elsewhere); without it each choice goes to its own request."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``kwargs``: ``ReplicaRouting``'s (``policy``, ``mode``, ``cache_threshold``,
        ``balance_abs``, ``balance_rel``, ``provisional_s``)."""
        self.routing = ReplicaRouting(**kwargs)
        self.decision_seconds: deque[float] = deque(maxlen=100_000)
        self.reasons: dict[str, int] = {}
        routing_state.LIVE_ROUTERS[self._deployment_id.name] = self

    def replica_ids(self) -> list[str]:
        """The unique ids of the replicas routed to now."""
        return sorted(rid.unique_id for rid in self._replica_id_set)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.routing.sync({r.replica_id.unique_id: r.replica_metadata for r in replicas})
        for r in replicas:
            self.routing.update_stats(r.replica_id.unique_id, r.routing_stats or {})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.routing.remove(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        start = time.perf_counter()
        req = _proxy_request(pending_request)
        if req is not None and req.pin is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == req.pin]]
        candidates = candidate_replicas
        if req is not None and req.exclude:
            candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in req.exclude] or candidates
        by_id = {r.replica_id.unique_id: r for r in candidates}
        decision = self.routing.decide(req.routing_ids if req else None, list(by_id), req.policy if req else None)
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        if decision.ranks is not None:
            ranks = [[by_id[r] for r in rank] for rank in decision.ranks]
        elif len(candidates) == len(candidate_replicas):
            ranks = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        else:
            ranks = [random.sample(candidates, min(2, len(candidates)))]
        self.decision_seconds.append(time.perf_counter() - start)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        req = _proxy_request(pending_request)  # every call counts in flight until completed
        ids = req.routing_ids if req is not None and req.pin is None else None
        self.routing.started(replica_id.unique_id, ids, pending_request.metadata.internal_request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.routing.finished(replica_id.unique_id, internal_request_id)
