"""radixlm on Ray Serve end to end (slow: a local Ray cluster, two SmolLM2 replicas of
float32 weights, one module-wide application): the multi-turn ShareGPT replay through the
ingress with the openai client keeps more prefix-cache hits with the cache-aware router
than with Ray Serve's default power of two choices, both in one run, and the greedy replies
equal a single server's; a replica whose server is killed mid-run ends every request (an
answer or an error), comes back, serves again, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from radixlm.runtime.bench.chat_replay import replay_chats, summarize
from radixlm.runtime.bench.datasets import multiturn_conversations
from radixlm.runtime.bench.server_process import ServerProcess, free_port

pytestmark = pytest.mark.slow
SERVER_FLAGS = ("--weight-dtype", "model", "--max-total-tokens", "16384", "--log-level", "warning")
CONVERSATIONS, TURNS, OUTPUT_LEN, USER_CHARS, PAGE = 4, 3, 12, 300, 16


def _server_processes() -> dict[int, int]:
    """pid -> process group of every replica server (deploy/child.py) on this machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            pgrp = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):
            continue
        if b"radixlm.runtime.deploy.child" in cmdline:
            out[int(entry.name)] = pgrp
    return out


def _group_members(pgrp: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgrp:
                    members.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return members


def _replicas(url: str) -> dict:
    return httpx.get(f"{url}/radixlm/replicas", timeout=60).raise_for_status().json()


@pytest.fixture(scope="module")
def ray_app(smollm2_dir):
    ray = pytest.importorskip("ray")
    from ray import serve

    from radixlm.runtime.deploy.app import DeployConfig, build_app

    before = set(_server_processes())
    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = DeployConfig(replicas=2, health_check_period_s=1.0, server_args=SERVER_FLAGS)
        serve.run(build_app(config), name="radixlm", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120  # the ingress loads the tokenizer on the first prompt
        while not _replicas(url)["tokenizer_loaded"]:
            httpx.post(f"{url}/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 1}, timeout=60)
            assert time.monotonic() < deadline
            time.sleep(1)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
    deadline = time.monotonic() + 30
    while set(_server_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not set(_server_processes()) - before, "replica servers left running after serve.shutdown"


@pytest.fixture(scope="module")
def conversations():
    convs = multiturn_conversations(None, 4 * CONVERSATIONS, seed=0, max_turns=TURNS, output_len=OUTPUT_LEN)
    chosen = [[u[:USER_CHARS] for u in c.users] for c in convs if len(c.users) == TURNS][:CONVERSATIONS]
    assert len(chosen) == CONVERSATIONS
    return chosen


def _later_turns(turns) -> list[tuple[bool, bool]]:
    """Per later turn: (whether its previous prompt's whole pages were a majority of its
    prompt, so cache-aware routing must follow them; whether it found them cached)."""
    out = []
    for prev, turn in zip(turns, turns[1:], strict=False):
        if turn.conversation == prev.conversation:
            history = prev.prompt_tokens // PAGE * PAGE
            out.append((history > 0.5 * turn.prompt_tokens, turn.cached_tokens >= history))
    return out


def test_cache_aware_routing_keeps_more_hits_than_pow2_with_single_server_outputs(ray_app, conversations,
                                                                                   monkeypatch) -> None:
    url = ray_app
    runs = {}
    for policy in ("cache_aware", "pow2"):
        httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()
        runs[policy] = replay_chats(url, conversations, OUTPUT_LEN, workers=1, headers={"x-radixlm-routing": policy})
    ca, p2 = summarize(runs["cache_aware"]), summarize(runs["pow2"])
    print("hit rates: cache-aware", ca, "pow2", p2)
    assert ca["failed"] == p2["failed"] == 0, (ca, p2)
    assert ca["turns"] == p2["turns"] == sum(len(c) for c in conversations)
    # one conversation at a time, so the loads stay balanced: cache-aware sends each turn to
    # its history when that is most of the prompt; pow2 picks either idle replica and loses
    # the history half the time (all 8 later turns landing right by chance: 1 run in 256)
    aware, random_ = _later_turns(runs["cache_aware"]), _later_turns(runs["pow2"])
    must = sum(majority for majority, _ in aware)
    assert must >= CONVERSATIONS, aware
    assert all(kept for majority, kept in aware if majority), [(r.prompt_tokens, r.cached_tokens)
                                                              for r in runs["cache_aware"]]
    assert not all(kept for _, kept in random_), [(r.prompt_tokens, r.cached_tokens) for r in runs["pow2"]]
    assert ca["hit_rate"] > p2["hit_rate"], (ca, p2)
    decisions = _replicas(url)["router"]["decisions"]
    assert decisions.get("prefix", 0) >= must, decisions
    assert [r.text for r in runs["cache_aware"]] == [r.text for r in runs["pow2"]]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with ServerProcess.launch(list(SERVER_FLAGS)) as single:
        reference = replay_chats(single.url, conversations, OUTPUT_LEN, workers=2)
    assert [r.text for r in reference] == [r.text for r in runs["cache_aware"]]
    assert all(r.text for r in reference)
    report = httpx.get(f"{url}/debug/check_invariants", timeout=60).json()
    assert report["ok"] and report["num_live"] == 0 and len(report["replicas"]) == 2, report


def _chat(url: str, results: list, stream: bool) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
            "max_tokens": 96, "temperature": 0, "stream": stream, "ignore_eos": True}
    try:
        with httpx.Client(timeout=180) as client:
            if stream:
                with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    text = "".join(r.iter_text())
                ok = r.status_code == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text
                results.append(("stream", r.status_code, ok, '"error"' in text))
            else:
                r = client.post(f"{url}/v1/chat/completions", json=body)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 96
                results.append(("plain", r.status_code, ok, "error" in r.json()))
    except Exception as exc:  # a hang would end here as a timeout: the test fails on it
        results.append(("exception", None, False, repr(exc)))


def test_a_killed_server_ends_every_request_and_its_replica_comes_back(ray_app) -> None:
    url = ray_app
    before = _replicas(url)
    victim = before["replicas"][0]
    pgrp = _server_processes()[victim["server_pid"]]
    results: list = []
    threads = [threading.Thread(target=_chat, args=(url, results, i % 2 == 0)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(2)  # the requests are running on both replicas
    retried = before["retried"]
    os.kill(victim["server_pid"], signal.SIGKILL)
    time.sleep(0.3)  # the victim's streams fail; Ray's health check has not noticed yet
    quick: list = []  # new requests in that window: the dead one's are retried on the other replica
    for i in range(3):
        r = httpx.post(f"{url}/v1/completions", json={"model": "default", "prompt": f"{i} quick", "max_tokens": 2},
                       timeout=180)
        quick.append((r.status_code, r.json().get("usage", {}).get("completion_tokens")))
    assert quick == [(200, 2)] * 3, quick
    assert _replicas(url)["retried"] > retried
    for t in threads:
        t.join(200)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(results) == 4 and not [r for r in results if r[0] == "exception"], results
    for _kind, status, ok, errored in results:  # an answer, or a clear error
        assert ok or errored or status == 503, results
    assert sum(ok for _, _, ok, _ in results) >= 1, results  # the other replica's finished
    deadline = time.monotonic() + 240
    while True:  # Ray's health check replaces the replica
        try:
            now = _replicas(url)
        except httpx.HTTPError:  # the proxy restarting (a box under heavy load): ask again
            assert time.monotonic() < deadline
            time.sleep(2)
            continue
        ids = {r["replica"] for r in now["replicas"]}
        if len(ids) == 2 and victim["replica"] not in ids and victim["replica"] not in now["router"]["replicas"]:
            break
        assert time.monotonic() < deadline, now
        time.sleep(2)
    assert set(now["router"]["replicas"]) == ids  # the router forgot the dead replica's prefixes
    assert not _group_members(pgrp), "the killed server's processes linger"
    later: list = []
    for i in range(4):
        _chat(url, later, stream=i % 2 == 0)
    assert all(ok for _, _, ok, _ in later), later
    assert len([p for p in _server_processes() if p != victim["server_pid"]]) >= 2
    bad = httpx.post(f"{url}/v1/chat/completions", json={"model": "default", "messages": [], "max_tokens": -1},
                     timeout=60)  # the server's own 400 comes through the ingress
    assert bad.status_code == 400 and bad.json()["error"]["param"] in ("max_tokens", "messages"), bad.text
