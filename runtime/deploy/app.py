"""The Ray Serve application: ``build_app`` (for ``serve run`` / ``serve deploy`` and a config
file) and ``radixlm serve-ray`` (a local Ray cluster, or ``--ray-address`` to join one).

    radixlm serve-ray --replicas 2 --http-port 8000 -- --weight-dtype auto --max-total-tokens 16384
    serve run radixlm.runtime.deploy.app:build_app replicas=2 server_args="--weight-dtype auto"
    serve deploy examples/ray_serve.yaml          # the same, on a running (multi-node) cluster

Two deployments: ``RadixLMServer`` (the replicas, deploy/replica.py; routed by
``PrefixCacheRouter``, deploy/router.py) and ``RadixLMIngress`` (HTTP, deploy/ingress.py).
``DeployConfig`` is the single source of the deployment's settings and their help text; the
CLI flags and the config file's ``args`` are its fields. Every flag after ``--`` (or any
flag ``serve-ray`` does not know) is a ``launch_server`` flag for each replica's server.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.deploy.protocol import ROUTING_POLICIES
from radixlm.runtime.deploy.replica import parse_server_args
from radixlm.runtime.deploy.routing import ROUTING_MODES

__all__ = ["DeployConfig", "build_app", "main"]

SERVER_DEPLOYMENT = "RadixLMServer"
INGRESS_DEPLOYMENT = "RadixLMIngress"
APP_NAME = "radixlm"


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DeployConfig:
    """How the replicas are deployed, scaled and routed (``radixlm serve-ray --help``)."""

    replicas: int = _opt(1, "Replicas (radixlm servers) to start; with --max-replicas: the initial count.")
    min_replicas: int | None = _opt(None, "Autoscaling: fewest replicas (default: --replicas).")
    max_replicas: int | None = _opt(
        None, "Autoscaling on queue length: most replicas. Ray Serve adds replicas while the requests "
        "in flight per replica exceed --target-ongoing-requests and removes them below it. Default: "
        "no autoscaling.")
    target_ongoing_requests: float = _opt(8.0, "Autoscaling: requests in flight per replica to aim for.")
    max_ongoing_requests: int = _opt(
        64, "Most requests one replica takes at once (Ray Serve queues the rest at the router).")
    routing: str = _opt(
        "cache_aware", "Default routing policy: cache_aware (the replica holding the longest prefix of "
        "the prompt, balanced against load) or pow2 (Ray Serve's default power of two choices). A "
        "request's x-radixlm-routing header picks its own.", ROUTING_POLICIES)
    routing_mode: str = _opt(
        "precise", "How the router knows the replicas' caches: precise (the servers' KV events) or "
        "approximate (its own tree of what it sent where; no events).", ROUTING_MODES)
    cache_threshold: float = _opt(
        0.5, "cache_aware: a cached prefix decides only when it covers more than this fraction of the prompt.")
    balance_abs: float = _opt(
        32, "cache_aware: loads are imbalanced (power of two choices decides) when the most loaded "
        "replica has more than this many more requests in flight than the least loaded ...")
    balance_rel: float = _opt(1.0001, "... and more than this many times as many.")
    replica_num_cpus: float = _opt(1.0, "CPUs Ray reserves per replica (its server's threads: OMP_NUM_THREADS).")
    replica_num_gpus: float = _opt(0.0, "GPUs Ray reserves per replica (--tp-size x --dp-size on CUDA).")
    health_check_period_s: float = _opt(2.0, "Seconds between health checks of each replica's server.")
    health_check_timeout_s: float = _opt(10.0, "A health check slower than this fails the replica.")
    http_host: str = _opt("127.0.0.1", "serve-ray: the HTTP proxy's bind address (0.0.0.0: every interface).")
    http_port: int = _opt(8000, "serve-ray: the HTTP proxy's port.")
    ray_address: str | None = _opt(None, "serve-ray: a running Ray cluster to join (default: start a local one).")
    server_args: tuple[str, ...] = _opt((), "launch_server flags for every replica's server.")

    def validate(self) -> None:
        """ValueError on inconsistent settings; also checks the server flags (ServerArgs)."""
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        low = self.min_replicas if self.min_replicas is not None else self.replicas
        if self.max_replicas is not None and not 0 <= low <= self.replicas <= self.max_replicas:
            raise ValueError("need 0 <= --min-replicas <= --replicas <= --max-replicas")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
        if self.routing_mode not in ROUTING_MODES:
            raise ValueError(f"--routing-mode must be one of {', '.join(ROUTING_MODES)}")
        if not 0 <= self.cache_threshold <= 1 or self.balance_abs < 0 or self.balance_rel < 1:
            raise ValueError("need 0 <= --cache-threshold <= 1, --balance-abs >= 0, --balance-rel >= 1")
        if self.target_ongoing_requests <= 0 or self.max_ongoing_requests < 1:
            raise ValueError("--target-ongoing-requests must be > 0 and --max-ongoing-requests >= 1")
        args = parse_server_args(list(self.server_args))
        if self.routing_mode == "precise" and args.disable_radix_cache:
            raise ValueError("--routing-mode precise needs the servers' radix cache (drop --disable-radix-cache)")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DeployConfig:
        """From a config file's ``args`` (or ``serve run`` key=value pairs, all strings):
        ``server_args`` may be a list or one shell-quoted string. ValueError on unknown keys."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(values) - set(fields)
        if unknown:
            raise ValueError(f"unknown radixlm deployment arguments: {', '.join(sorted(unknown))}")
        out: dict[str, Any] = {}
        for name, value in values.items():
            if name == "server_args":
                out[name] = tuple(shlex.split(value) if isinstance(value, str) else map(str, value))
            elif value is None or fields[name].default is None and value in ("", "None", "null"):
                out[name] = None
            else:
                kind = type(fields[name].default) if fields[name].default is not None else _optional_kind(name)
                out[name] = kind(value)
        config = cls(**out)
        config.validate()
        return config


def _optional_kind(name: str) -> type:
    return str if name == "ray_address" else int


def build_app(args: dict[str, Any] | DeployConfig | None = None) -> Any:
    """The Ray Serve application (``serve run radixlm.runtime.deploy.app:build_app``):
    ``args`` are ``DeployConfig`` fields (a dict from a config file or ``key=value`` pairs)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from radixlm.runtime.deploy.ingress import RadixLMIngress
    from radixlm.runtime.deploy.replica import RadixLMServer
    from radixlm.runtime.deploy.router import PrefixCacheRouter

    config = args if isinstance(args, DeployConfig) else DeployConfig.from_dict(args or {})
    scaling: dict[str, Any] = {"num_replicas": config.replicas}
    if config.max_replicas is not None:
        scaling = {"num_replicas": "auto", "autoscaling_config": AutoscalingConfig(
            min_replicas=config.min_replicas if config.min_replicas is not None else config.replicas,
            initial_replicas=config.replicas, max_replicas=config.max_replicas,
            target_ongoing_requests=config.target_ongoing_requests)}
    router = RequestRouterConfig(
        request_router_class=f"{PrefixCacheRouter.__module__}.{PrefixCacheRouter.__qualname__}",
        request_router_kwargs={"policy": config.routing, "mode": config.routing_mode,
                               "cache_threshold": config.cache_threshold, "balance_abs": config.balance_abs,
                               "balance_rel": config.balance_rel},
        request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0)
    server = serve.deployment(RadixLMServer).options(
        name=SERVER_DEPLOYMENT, max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.replica_num_cpus, "num_gpus": config.replica_num_gpus},
        health_check_period_s=config.health_check_period_s, health_check_timeout_s=config.health_check_timeout_s,
        graceful_shutdown_timeout_s=15, request_router_config=router, **scaling)
    ingress = serve.deployment(RadixLMIngress).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
    return ingress.bind(server.bind(list(config.server_args), config.routing_mode == "precise"), SERVER_DEPLOYMENT,
                        parse_server_args(list(config.server_args)).api_key)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv: list[str]) -> DeployConfig:
    """``serve-ray`` flags (DeployConfig's fields) then server flags; exit 2 on bad ones."""
    parser = argparse.ArgumentParser(prog="radixlm serve-ray", description=(
        "radixlm on Ray Serve: --replicas servers behind a prefix-cache-aware router. Flags after "
        "`--` (and flags not listed here) go to every replica's `launch_server`."))
    for f in dataclasses.fields(DeployConfig):
        if f.name == "server_args":
            continue
        kind = type(f.default) if f.default is not None else _optional_kind(f.name)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                            choices=f.metadata.get("choices"), help=f.metadata["help"])
    if "--" in argv:
        cut = argv.index("--")
        ours, server = argv[:cut], argv[cut + 1:]
        ns = parser.parse_args(ours)
    else:
        ns, server = parser.parse_known_args(argv)
    config = DeployConfig(**vars(ns), server_args=tuple(server))
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return config


def main(argv: list[str] | None = None) -> int:
    """``radixlm serve-ray``: start (or join) Ray, deploy, serve until SIGINT / SIGTERM, then
    delete the application (and stop a Ray it started). Returns the exit status."""
    import ray
    from ray import serve

    config = parse_args(list(sys.argv[1:] if argv is None else argv))
    ray.init(address=config.ray_address, ignore_reinit_error=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.http_host, "port": config.http_port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        print(f"radixlm on Ray Serve: http://{config.http_host}:{config.http_port} "
              f"({config.replicas} replicas, routing {config.routing}/{config.routing_mode})", flush=True)
        stop.wait()
    finally:
        serve.delete(APP_NAME)
        if config.ray_address is None:
            serve.shutdown()
            ray.shutdown()
    return 0
