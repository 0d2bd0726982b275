"""The disk tier across a hard kill: a server writing KV pages to its storage folder is
killed with SIGKILL (its whole process group: HTTP and scheduler, mid-write), and a
server started on the same folder comes up clean: no temp file left, every page it
indexed readable, answers equal to a server without the tiers, idle invariants intact."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def _generate(url: str, ids: list[int]) -> dict:
    r = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}, timeout=300)
    r.raise_for_status()
    return r.json()


def test_sigkill_during_disk_writes_then_restart_is_clean(server_factory, server, tmp_path, idle_invariants) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 20000) for _ in range(600)] for _ in range(8)]
    store = tmp_path / "kv"
    flags = dict(max_total_tokens=2048, chunked_prefill_size=512, hicache_size_gb=0.5,
                 hicache_storage_dir=str(store))
    with server_factory(**flags) as srv:
        workers = [threading.Thread(target=lambda p=p: _try(srv.url, p)) for p in prompts]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 120
        while len(list(store.rglob("*.kvpage"))) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(srv.proc.pid, signal.SIGKILL)  # while requests run and pages are written
        srv.proc.wait(30)
        for w in workers:
            w.join(60)
    written = list(store.rglob("*.kvpage"))
    assert len(written) >= 10
    with server_factory(**flags) as srv:
        assert not list(store.rglob("*.tmp")), "a killed writer's temp file survived the restart"
        for p in prompts[:3]:
            out = _generate(srv.url, p)
            assert out["output_ids"] == _generate(server.url, p)["output_ids"]
        info = httpx.get(f"{srv.url}/get_server_info", timeout=30).json()
        assert info["hicache"]["disk_pages_indexed"] > 0
        assert info["hicache"]["read_bytes_per_s"]["disk"] > 0
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        assert 'radixlm:hicache_tier_total_pages{model_name="SmolLM2-135M-Instruct",tier="disk"}' in metrics
        idle_invariants(srv)


def _try(url: str, ids: list[int]) -> None:
    """A request to a server that may be killed under it: errors are expected."""
    try:
        _generate(url, ids)
    except (httpx.HTTPError, OSError):
        pass
