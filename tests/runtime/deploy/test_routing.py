"""The Ray Serve router's logic without Ray running (deploy/routing.py over radix/routing.py),
the ingress's prompt tokenization and metrics merge, and the deployment's config."""

from __future__ import annotations

import pytest

from radixlm.radix.routing import CacheAwarePolicy
from radixlm.runtime import kv_events as kv
from radixlm.runtime.deploy.routing import ReplicaRouting

PAGE = 4


class FakeSubscriber:
    """Stands for KVEventSubscriber: the test feeds its batches."""

    made: list[FakeSubscriber] = []

    def __init__(self, endpoint, on_batch, replay=None, topic=""):
        self.endpoint, self.on_batch, self.received, self.closed = endpoint, on_batch, 0, False
        FakeSubscriber.made.append(self)

    def feed(self, *events) -> None:
        self.on_batch(kv.EventBatch(ts=0.0, events=list(events)))
        self.received += 1

    def close(self) -> None:
        self.closed = True


def _stored(ids: list[int]) -> kv.BlockStored:
    return kv.BlockStored(block_hashes=kv.block_hashes(ids, PAGE), parent_block_hash=None,
                          token_ids=ids[: len(ids) // PAGE * PAGE], block_size=PAGE, lora_id=None, medium="GPU",
                          lora_name=None)


def _meta(name: str) -> dict:
    return {"page_size": PAGE, "max_total_tokens": 64,
            "kv_events": [{"endpoint": f"tcp://{name}:1", "replay": f"tcp://{name}:2", "dp_rank": 0}]}


@pytest.fixture
def routing():
    FakeSubscriber.made.clear()
    now = [0.0]
    r = ReplicaRouting(subscribe=FakeSubscriber, clock=lambda: now[0], balance_abs=2)
    r.sync({"a": _meta("a"), "b": _meta("b")})
    r.now = now
    return r


def test_precise_routing_follows_the_events(routing):
    sub_a, sub_b = FakeSubscriber.made
    prompt = list(range(16))  # 4 pages
    sub_b.feed(_stored(prompt[:12]))
    sub_a.feed(_stored([99] * 8))
    d = routing.decide(prompt + [5], ["a", "b"])
    assert (d.ranks, d.reason, d.matched_tokens) == ([["b"], ["a"]], "prefix", 12)
    sub_b.feed(kv.BlockRemoved(block_hashes=kv.block_hashes(prompt[:12], PAGE)[1:], medium="GPU"))
    d = routing.decide(prompt + [5], ["a", "b"])  # b keeps 1 page of 17 tokens: below half
    assert (d.ranks[0], d.reason) == (["b"], "room")  # equal loads; b holds 1 block, a 2
    routing.started("b", None)
    assert routing.decide(prompt + [5], ["a", "b"]).ranks[0] == ["a"]  # room goes by load first
    sub_b.feed(kv.AllBlocksCleared())
    assert routing.index.group_blocks("b") == 0


def test_a_just_routed_prompt_counts_until_its_events_arrive(routing):
    prompt = list(range(20))
    routing.started("a", prompt)
    d = routing.decide(prompt + [1, 2, 3], ["a", "b"])  # no event yet: provisional blocks
    assert (d.ranks[0], d.reason, d.matched_tokens) == (["a"], "prefix", 20)
    routing.finished("a")
    routing.now[0] = 10.0  # past provisional_s without events: forgotten
    FakeSubscriber.made[0].feed(_stored([7] * 4))
    FakeSubscriber.made[1].feed(_stored([8] * 4))
    assert routing.decide(prompt + [1, 2, 3], ["a", "b"]).reason == "room"


def test_imbalanced_loads_and_pow2_policy_leave_the_choice_to_power_of_two(routing):
    prompt = list(range(16))
    assert routing.decide(prompt, ["a", "b"], policy="pow2").ranks is None
    assert routing.decide(None, ["a", "b"]).ranks is None
    for _ in range(3):
        routing.started("a", None)
    d = routing.decide(prompt, ["a", "b"])
    assert (d.ranks, d.reason) == (None, "imbalanced")  # 3 - 0 > balance_abs 2


def test_a_removed_replica_is_forgotten(routing):
    sub_a = FakeSubscriber.made[0]
    sub_a.feed(_stored(list(range(16))))
    routing.started("a", list(range(16)))
    routing.sync({"b": _meta("b")})
    assert "a" not in routing.inflight and "a" not in routing.cache.trees
    assert routing.index.group_blocks("a") == 0
    assert routing.decide(list(range(16)), ["b"]).ranks == [["b"]]
    routing.sync({"b": _meta("b"), "c": {}})  # metadata not known yet: no events, no cache view
    assert not routing.subscribers["c"]
    routing.sync({"b": _meta("b"), "c": _meta("c")})
    assert FakeSubscriber.made[-1].endpoint == "tcp://c:1" and len(routing.subscribers["c"]) == 1


def test_in_flight_counts_match_requests_by_id_whatever_order_ray_reports():
    """Ray may report a fast request completed before routed, and reports requests it
    rejected before routing as completed: neither leaves a count behind."""
    r = ReplicaRouting(subscribe=FakeSubscriber)
    r.sync({"a": _meta("a"), "b": _meta("b")})
    r.started("a", None, "1")
    r.started("b", None, "2")
    assert r.inflight == {"a": 1, "b": 1}
    r.finished("b", "3")  # completed before it was reported routed
    r.started("b", None, "3")
    r.finished("a", "9")  # a rejected request: never routed
    assert r.inflight == {"a": 1, "b": 1}
    r.finished("a", "1")
    r.finished("b", "2")
    assert r.inflight == {"a": 0, "b": 0}
    r.started("a", None, "4")
    r.remove("a")  # a dead replica's open requests go with it
    r.finished("a", "4")
    r.sync({"a": _meta("a"), "b": _meta("b")})
    assert r.inflight == {"a": 0, "b": 0}


def test_approximate_mode_uses_the_prompt_trees():
    r = ReplicaRouting(mode="approximate", subscribe=FakeSubscriber)
    r.sync({"a": _meta("a"), "b": _meta("b")})
    r.started("b", list(range(16)))
    r.finished("b")
    assert r.decide(list(range(16)) + [1], ["a", "b"]).ranks == [["b"], ["a"]]
    assert not r.subscribers.get("a")


def test_cache_aware_policy_trims_its_trees_to_the_capacity():
    ticks = iter(range(100))
    policy = CacheAwarePolicy(page_size=2, capacity_tokens=8)  # 4 pages
    policy.add("x")
    policy.trees["x"]._clock = lambda: float(next(ticks))
    policy.record("x", list(range(8)))  # 4 pages
    policy.record("x", [50, 51, 52, 53, 54])  # 2 more: the older prompt's leaf goes (LRU, whole)
    assert policy.trees["x"].cached_pages == 2
    assert policy.matched([50, 51, 52, 53]) == {"x": 4} and policy.matched(list(range(8))) == {"x": 0}
    assert policy.choose([1, 2], {"x": 0, "y": 0}).replica == "y"  # room: y has none
    with pytest.raises(ValueError, match="no replica"):
        policy.choose([1], {})


def test_prompt_ids_tokenize_as_the_server_does(smollm2_dir):
    from transformers import AutoTokenizer

    from radixlm.runtime.deploy.ingress import prompt_ids

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = [{"role": "user", "content": "hi"}]
    chat = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt_ids(tok, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}') == list(chat)
    assert prompt_ids(tok, "/generate", b'{"text": ["a b", "c"]}') == tok.encode("a b")
    assert prompt_ids(tok, "/generate", b'{"input_ids": [[5, 6], [7]]}') == [5, 6]
    assert prompt_ids(tok, "/v1/completions", b'{"prompt": "x y"}') == tok.encode("x y")
    for bad in (b"{", b"[]", b'{"messages": "x"}', b'{"prompt": [-1]}'):
        assert prompt_ids(tok, "/v1/chat/completions" if b"messages" in bad else "/v1/completions", bad) is None
    assert prompt_ids(tok, "/v1/models", b"") is None


def test_metrics_of_the_replicas_are_summed_and_usage_averaged():
    from radixlm.runtime.deploy.ingress import merge_metrics

    one = ('# HELP radixlm:prompt_tokens_total p\n# TYPE radixlm:prompt_tokens_total counter\n'
           'radixlm:prompt_tokens_total{model_name="m"} 10.0\n# TYPE radixlm:kv_cache_usage gauge\n'
           'radixlm:kv_cache_usage{model_name="m"} 0.2\n')
    two = one.replace("10.0", "30.0").replace("0.2", "0.6")
    merged = merge_metrics([one, two])
    assert 'radixlm:prompt_tokens_total{model_name="m"} 40.0' in merged
    assert 'radixlm:kv_cache_usage{model_name="m"} 0.4' in merged
    assert merged.count("# TYPE radixlm:prompt_tokens_total counter") == 1


def test_deploy_config_from_a_config_file_and_the_cli():
    from radixlm.runtime.deploy.app import DeployConfig, parse_args

    cfg = DeployConfig.from_dict({"replicas": "2", "max_replicas": 4, "server_args": "--page-size 32 --log-level warning"})
    assert (cfg.replicas, cfg.max_replicas, cfg.server_args) == (2, 4, ("--page-size", "32", "--log-level", "warning"))
    with pytest.raises(ValueError, match="unknown radixlm deployment arguments: nope"):
        DeployConfig.from_dict({"nope": 1})
    with pytest.raises(ValueError, match="bad launch_server flags"):
        DeployConfig.from_dict({"server_args": ["--page-size", "x"]})
    with pytest.raises(ValueError, match="--min-replicas <= --replicas <= --max-replicas"):
        DeployConfig.from_dict({"replicas": 3, "max_replicas": 2})
    cli = parse_args(["--replicas", "3", "--routing", "pow2", "--", "--tp-size", "1"])
    assert (cli.replicas, cli.routing, cli.server_args) == (3, "pow2", ("--tp-size", "1"))
    assert parse_args(["--replicas", "2", "--page-size", "8"]).server_args == ("--page-size", "8")
    with pytest.raises(SystemExit):
        parse_args(["--routing", "random"])


def test_the_application_scales_on_queue_length_and_routes_by_prefix():
    """build_app wires DeployConfig into Ray Serve's options (no cluster needed to build)."""
    from radixlm.runtime.deploy.app import DeployConfig, build_app

    app = build_app(DeployConfig(replicas=2, max_replicas=4, target_ongoing_requests=3, routing_mode="approximate",
                                 health_check_period_s=1.5, server_args=("--page-size", "32")))
    ingress = app._bound_deployment
    server = ingress.init_args[0]._bound_deployment
    config = server._deployment_config
    scaling = config.autoscaling_config
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (2, 2, 4)
    assert scaling.target_ongoing_requests == 3
    router = config.request_router_config
    assert router.request_router_class == "radixlm.runtime.deploy.router.PrefixCacheRouter"
    assert router.request_router_kwargs == {"policy": "cache_aware", "mode": "approximate", "cache_threshold": 0.5,
                                            "balance_abs": 32, "balance_rel": 1.0001}
    assert config.health_check_period_s == 1.5
    assert ingress.init_args[0]._bound_deployment.init_args == (["--page-size", "32"], False)
    fixed = build_app(DeployConfig(replicas=3))._bound_deployment.init_args[0]._bound_deployment._deployment_config
    assert fixed.num_replicas == 3 and fixed.autoscaling_config is None


def test_serve_ray_refuses_bad_flags_before_starting_ray(capsys):
    from radixlm.runtime.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["serve-ray", "--replicas", "0"])
    assert exc.value.code == 2 and "--replicas must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve-ray", "--", "--kv-events-endpoint", "nope"])
    assert exc.value.code == 2 and "bad launch_server flags" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    assert "serve-ray" in capsys.readouterr().out


def test_the_replicas_route_checks_the_servers_api_key():
    """GET /radixlm/replicas is answered by the ingress itself (not a server), so it checks
    the servers' --api-key as their routes do."""
    import asyncio
    from collections import deque

    from starlette.requests import Request

    from radixlm.runtime.deploy.ingress import RadixLMIngress

    ingress = object.__new__(RadixLMIngress)  # no Ray: the route's own logic
    ingress.api_key, ingress.server_deployment, ingress.tokenizer = "k3y", "none", None
    ingress.retried, ingress.tokenize_seconds = 0, deque()

    async def no_replicas(method, req):
        return []

    ingress._each = no_replicas

    def status(header: bytes | None) -> int:
        headers = [(b"authorization", header)] if header is not None else []
        request = Request({"type": "http", "method": "GET", "path": "/radixlm/replicas", "headers": headers})
        return asyncio.run(RadixLMIngress.replicas(ingress, request)).status_code

    assert [status(None), status(b"Bearer nope"), status(b"Bearer k3y")] == [401, 401, 200]
    ingress.api_key = None
    assert status(None) == 200
