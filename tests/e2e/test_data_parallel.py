"""Data parallelism end to end on the CPU: two replicas of a tiny random Llama behind one
HTTP process. A multi-turn replay (each turn: the history, the server's own reply, a new
user message) keeps its prefix-cache hits with cache-aware routing and loses many of them
with round-robin; both replicas serve; a killed replica stops the server (non-zero, no hang).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import httpx
import pytest

CONVERSATIONS, TURNS = 3, 4  # an odd count: round-robin moves each conversation every turn
SYSTEM, USER, REPLY = 48, 16, 8  # tokens


def replay(url: str) -> tuple[int, int]:
    """Play the conversations turn by turn, in order; (prompt tokens, cached tokens) summed
    over turns after the first (the first turn of each has nothing to reuse)."""
    rng = random.Random(0)
    histories = [rng.choices(range(3, 256), k=SYSTEM) for _ in range(CONVERSATIONS)]
    prompt = cached = 0
    with httpx.Client(base_url=url, timeout=120) as client:
        for turn in range(TURNS):
            for history in histories:
                history += rng.choices(range(3, 256), k=USER)
                out = client.post("/generate", json={"input_ids": history, "sampling_params": {
                    "temperature": 0, "max_new_tokens": REPLY, "ignore_eos": True}}).raise_for_status().json()
                history += out["output_ids"]
                if turn:
                    prompt += out["meta_info"]["prompt_tokens"]
                    cached += out["meta_info"]["cached_tokens"]
    return prompt, cached


def _served_tokens(url: str) -> list[int]:
    states = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"]
    return [s.get("prefill_tokens_computed", 0) + s.get("prefill_tokens_cached", 0) for s in states]


@pytest.fixture(scope="module")
def dp2_server(server_factory, tiny_model_dir, smollm2_dir) -> Iterator:
    with server_factory(model_path=tiny_model_dir("llama"), tokenizer_path=smollm2_dir, dp_size=2,
                        dtype="float32", max_total_tokens=4096, max_running_requests=4) as srv:
        yield srv


def test_cache_aware_replay_keeps_its_prefix_hits_on_both_replicas(dp2_server, idle_invariants) -> None:
    prompt, cached = replay(dp2_server.url)
    # ideal: every later turn reuses its whole history but the last partial page
    assert cached / prompt > 0.75, (cached, prompt)
    time.sleep(0.6)  # the schedulers' stats are rate-limited (0.5 s)
    served = _served_tokens(dp2_server.url)
    assert len(served) == 2 and all(n > 0 for n in served), served
    idle_invariants(dp2_server)


def test_a_dead_replica_stops_the_server(dp2_server, kill_model_process) -> None:
    """Last in this module: SIGKILL replica 0's scheduler; the server exits non-zero."""
    count, log = kill_model_process(dp2_server, 0)
    assert count == 2
    assert "exited with code -9" in log


@pytest.mark.slow
def test_round_robin_loses_hits(server_factory, tiny_model_dir, smollm2_dir) -> None:
    """The same replay through round-robin: each turn lands on the other replica, which
    holds only the history up to two turns before (measured: 432 cached tokens of 1008
    against 768 cache-aware)."""
    with server_factory(model_path=tiny_model_dir("llama"), tokenizer_path=smollm2_dir, dp_size=2,
                        dp_routing="round_robin", dtype="float32", max_total_tokens=4096) as srv:
        prompt_rr, cached_rr = replay(srv.url)
    with server_factory(model_path=tiny_model_dir("llama"), tokenizer_path=smollm2_dir, dp_size=2,
                        dtype="float32", max_total_tokens=4096) as srv:
        prompt_ca, cached_ca = replay(srv.url)
    assert prompt_rr == prompt_ca
    assert cached_rr < 0.6 * cached_ca, (cached_rr, cached_ca, prompt_ca)
