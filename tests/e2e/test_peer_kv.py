"""The peer KV tier (--enable-peer-kv) end to end on the CPU, the longer runs (the fast
ones share tests/e2e/test_data_parallel.py's server).

* Load balance: the replica that holds a prompt's prefix is past the router's balance
  bound (``--dp-balance-abs 0`` and one long request running there), so the prompt goes
  to the other replica with a hint, which loads the prefix from the first instead of
  recomputing it. Every sample's greedy output is the same whichever replica and cache
  tier served it; with a host tier under both replicas (the received pages are written
  through like computed ones), invariants hold on both.
* SmolLM2-135M (the real model, fp32): a prompt loaded from the peer gives the greedy
  output of a single server computing it from scratch.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow

SAMPLING = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def _internal(url: str) -> list[dict]:
    time.sleep(0.6)  # the schedulers' stats are rate-limited (0.5 s)
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"]


def test_the_load_balance_overflow_loads_the_prefix_from_the_peer(server_factory, smollm2_dir, idle_invariants) -> None:
    rng = random.Random(46)
    prompt = rng.choices(range(3, 256), k=180)
    # SmolLM2 (not the tiny model, which writes its 256-token context in a blink): the holder
    # stays in flight for seconds
    holder = {"input_ids": rng.choices(range(3, 256), k=40), "data_parallel_rank": 0,
              "sampling_params": {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}}
    with server_factory(model_path=smollm2_dir, dp_size=2, dtype="float32",
                        max_total_tokens=8192, max_running_requests=2, enable_peer_kv=True, hicache_ratio=2,
                        dp_balance_abs=0, peer_kv_min_wait_s=3, peer_kv_timeout_s=3,
                        # the cost model's choice would follow the start-up rates of a busy box
                        hicache_load_policy="always") as srv:
        with srv.client() as client:
            def one(_: int = 0) -> dict:
                return client.post("/generate", json={"input_ids": prompt, "sampling_params": SAMPLING}).json()

            first = client.post("/generate", json={"input_ids": prompt, "data_parallel_rank": 0,
                                                   "sampling_params": SAMPLING}).json()
            with ThreadPoolExecutor(8) as pool:
                held = pool.submit(lambda: client.post("/generate", json=holder).json())
                deadline = time.monotonic() + 60
                while _internal(srv.url)[0]["num_running_reqs"] < 1:  # in flight on replica 0
                    assert time.monotonic() < deadline and not held.done(), "the holder never ran"
                overflow = one()  # loads 1 vs 0 are imbalanced: -> replica 1, hinted that 0 holds the prefix
                outs = [overflow, *pool.map(one, range(8))]
                assert not held.done() or held.result()["meta_info"]["completion_tokens"] == 200
        assert all(o["output_ids"] == first["output_ids"] for o in outs)
        assert overflow["meta_info"]["cached_tokens_per_tier"]["peer"] == 176, overflow["meta_info"]  # 11 pages
        assert all(o["meta_info"]["cached_tokens"] == 176 for o in outs)  # none recomputed it
        states = _internal(srv.url)
        assert sum(s["peer"]["fetches_loaded"] for s in states) >= 1
        assert sum(s["peer"]["hit_tokens"] for s in states) >= 176
        assert all(s["num_waiting_reqs"] == 0 for s in states)
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        assert "radixlm:peer_kv_hit_tokens_total" in metrics
        idle_invariants(srv)


def test_a_prompt_loaded_from_the_peer_matches_a_single_server(server_factory, smollm2_dir) -> None:
    rng = random.Random(47)
    prefix = rng.choices(range(100, 40000), k=300)
    prompt = prefix + rng.choices(range(100, 40000), k=24)
    body = {"input_ids": prompt, "sampling_params": SAMPLING}
    with server_factory(model_path=smollm2_dir, dtype="float32", max_total_tokens=4096) as single:
        with single.client() as client:
            reference = client.post("/generate", json=body).json()
    assert reference["meta_info"]["cached_tokens"] == 0
    with server_factory(model_path=smollm2_dir, dtype="float32", max_total_tokens=4096, dp_size=2,
                        enable_peer_kv=True, peer_kv_min_wait_s=10, peer_kv_timeout_s=10) as srv:
        with srv.client() as client:
            client.post("/generate", json={"input_ids": prefix, "data_parallel_rank": 0,
                                           "sampling_params": {"max_new_tokens": 1}}).raise_for_status()
            loaded = client.post("/generate", json={**body, "data_parallel_rank": 1}).json()
        assert loaded["meta_info"]["cached_tokens_per_tier"] == {"device": 0, "peer": 288}, loaded["meta_info"]
        assert loaded["output_ids"] == reference["output_ids"]
        info = httpx.get(f"{srv.url}/get_server_info", timeout=30).json()["peer_kv"]
        assert info["backend"] == "gloo" and info["read_bytes_per_s"] > 0 and info["page_bytes"] == 16 * 30 * 3 * 64 * 2 * 4
        report = srv.wait_idle_invariants()
        assert report["ok"] and report["locked_pages"] == 0, report
