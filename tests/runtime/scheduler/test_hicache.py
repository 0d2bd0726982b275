"""The hierarchical KV cache end to end on the CPU: SmolLM2-135M-Instruct in process
(``LocalServer``), a device pool small enough that prefixes leave it, a host tier and a
real disk tier in a temporary folder.

Each test checks the outputs against a plain server's (the reference: same greedy
tokens whether the KV was loaded from a tier or computed), the per-tier split of
``cached_tokens`` (native ``meta_info.cached_tokens_per_tier``), and the page / lock /
host-row invariants when idle.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from radixlm.runtime.engine import LocalServer
from radixlm.runtime.server_args import ServerArgs

PAGE = 16


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(length)] for _ in range(n)]


def _args(model: str, **extra) -> ServerArgs:
    return ServerArgs(model_path=model, device="cpu", max_total_tokens=640, max_running_requests=4,
                      chunked_prefill_size=256, max_prefill_tokens=512, log_level="warning",
                      debug_invariants=True, **extra)


def _generate(server: LocalServer, ids: list[int], new: int = 6) -> dict:
    out = server.post("/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": new, "ignore_eos": True}})
    return out


def _stats(server: LocalServer, ready, timeout: float = 5.0):
    """The scheduler's hierarchical-cache stats once ``ready(stats)`` holds (they arrive
    every 0.5 s), or the last ones seen."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.tm.stats.hicache if server.tm.stats is not None else None
        if (stats is not None and ready(stats)) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _idle_ok(server: LocalServer) -> None:
    report = server._call(server.tm.check_invariants())
    assert report.ok, report.message
    assert not report.violations, report.violations


@pytest.fixture(scope="module")
def reference(smollm2_dir: str) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of each test prompt from a server without tiers (no cache reuse)."""
    prompts = _prompts(4, 300) + _prompts(1, 300, seed=9)
    with LocalServer(_args(smollm2_dir, disable_radix_cache=True)) as server:
        return {tuple(p): _generate(server, p)["output_ids"] for p in prompts}


def test_host_tier_reloads_an_evicted_prefix(smollm2_dir: str, reference) -> None:
    """Four 300-token prompts through a 640-token device pool: each evicts the earlier
    ones, which stay in the host tier. Asked again, the first prompt's cached pages come
    back from the host (all 18 whole pages of its first 299 tokens), the output is the
    reference's, and the host -> device counter moved them."""
    prompts = _prompts(4, 300)
    with LocalServer(_args(smollm2_dir, hicache_size_gb=0.2)) as server:
        for p in prompts:
            assert _generate(server, p)["output_ids"] == reference[tuple(p)]
        again = _generate(server, prompts[0])
        assert again["output_ids"] == reference[tuple(prompts[0])]
        meta = again["meta_info"]
        assert meta["cached_tokens"] == 299 // PAGE * PAGE
        tiers = meta["cached_tokens_per_tier"]
        assert tiers["host"] > 0 and sum(tiers.values()) == meta["cached_tokens"], tiers
        _idle_ok(server)
        want = tiers["host"] // PAGE
        stats = _stats(server, lambda st: st.pages_moved["host_to_device"] >= want)
        assert stats.pages_moved["host_to_device"] >= want
        assert stats.pages_moved["device_to_host"] > 0
        assert stats.hit_tokens["host"] >= tiers["host"]


@pytest.mark.slow
def test_write_back_demotes_on_eviction(smollm2_dir: str, reference) -> None:
    """write_back: nothing is copied down until the device evicts; the first prompt
    then still comes back from the host."""
    prompts = _prompts(4, 300)
    with LocalServer(_args(smollm2_dir, hicache_size_gb=0.2, hicache_write_policy="write_back")) as server:
        assert _generate(server, prompts[0])["output_ids"] == reference[tuple(prompts[0])]
        stats = _stats(server, lambda st: st.prefetch_count == 0, timeout=1.0)  # a fresh report
        assert stats.pages_moved["device_to_host"] == 0
        for p in prompts[1:]:
            _generate(server, p)
        again = _generate(server, prompts[0])
        assert again["output_ids"] == reference[tuple(prompts[0])]
        assert again["meta_info"]["cached_tokens_per_tier"]["host"] > 0
        _idle_ok(server)


def test_disk_tier_survives_a_restart(smollm2_dir: str, reference, tmp_path: Path) -> None:
    """Server A answers a prompt and stops; server B on the same storage folder finds the
    prompt's pages on disk (all 18 whole pages), reads them, and answers identically."""
    prompt = _prompts(1, 300, seed=9)[0]
    store = tmp_path / "kv"
    with LocalServer(_args(smollm2_dir, hicache_storage_dir=str(store))) as server:
        assert _generate(server, prompt)["output_ids"] == reference[tuple(prompt)]
    files = list(store.rglob("*.kvpage"))
    assert len(files) >= 299 // PAGE
    with LocalServer(_args(smollm2_dir, hicache_storage_dir=str(store))) as server:
        out = _generate(server, prompt)
        assert out["output_ids"] == reference[tuple(prompt)]
        meta = out["meta_info"]
        assert meta["cached_tokens"] == 299 // PAGE * PAGE
        assert meta["cached_tokens_per_tier"]["disk"] == meta["cached_tokens"]
        _idle_ok(server)


@pytest.mark.parametrize("damage", [
    pytest.param(d, marks=pytest.mark.slow) for d in ("corrupt", "truncate", "foreign")])
def test_damaged_page_files_are_misses(smollm2_dir: str, reference, tmp_path: Path, damage: str) -> None:
    """Every stored page damaged (a flipped payload byte, cut short, or another model's
    identity in the header): server B recomputes, answers identically, drops the files,
    and stays healthy."""
    prompt = _prompts(1, 300, seed=9)[0]
    store = tmp_path / "kv"
    with LocalServer(_args(smollm2_dir, hicache_storage_dir=str(store))) as server:
        _generate(server, prompt)
    files = sorted(store.rglob("*.kvpage"))
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "corrupt":
            data[len(data) // 2] ^= 0xFF
        elif damage == "truncate":
            data = data[: len(data) // 2]
        else:
            data[8:16] = b"f" * 8  # inside the identity field of the header
        f.write_bytes(bytes(data))
    with LocalServer(_args(smollm2_dir, hicache_storage_dir=str(store))) as server:
        out = _generate(server, prompt)
        assert out["output_ids"] == reference[tuple(prompt)]
        assert out["meta_info"]["cached_tokens_per_tier"]["disk"] == 0
        again = _generate(server, _prompts(1, 300, seed=3)[0])  # still serving
        assert len(again["output_ids"]) == 6
        _idle_ok(server)
    assert not any(f.exists() and f.read_bytes() == b"" for f in files)


@pytest.mark.slow
def test_tiny_disk_quota_keeps_serving(smollm2_dir: str, reference, tmp_path: Path) -> None:
    """A disk quota of 3 pages: writes beyond it evict older pages or are skipped; every
    answer is still the reference's and the folder never holds more than 3 pages."""
    store = tmp_path / "kv"
    with LocalServer(_args(smollm2_dir, hicache_storage_dir=str(store), hicache_storage_size_gb=3 * 740_000 / 2**30,
                           hicache_size_gb=0.2)) as server:
        for p in _prompts(4, 300):
            assert _generate(server, p)["output_ids"] == reference[tuple(p)]
        server._call(server.tm.check_invariants())
        _idle_ok(server)
        assert server.tm.ready.hicache["disk_pages"] == 3  # 737,280-byte pages (+ header) in 2.1 MiB
    assert len(list(store.rglob("*.kvpage"))) <= 3


@pytest.mark.parametrize(("flags", "message"), [
    (dict(hicache_size_gb=0.02), "must be larger than the device KV pool (41 pages"),
    (dict(hicache_size_gb=1e5), "of host memory available"),
    (dict(hicache_storage_dir="/proc/radixlm-kv"), "--hicache-storage-dir /proc/radixlm-kv: "),
    (dict(hicache_storage_dir="TMP", hicache_storage_size_gb=1e-4),
     "--hicache-storage-size-gb 0.0001: capacity_bytes 107374 holds no page"),
])
def test_tier_sizes_the_host_cannot_serve_stop_start_up_with_the_flag(smollm2_dir: str, tmp_path: Path, flags: dict,
                                                                      message: str) -> None:
    """A host tier no larger than the device pool (SGLang refuses it too: each device page is
    copied down, so it would keep dropping what it just took) or beyond the host's memory, a
    storage folder that cannot be made, a quota below one page file: start-up stops with a
    message naming the setting (TierConfigError, logged without a traceback)."""
    flags = {k: str(tmp_path / "kv") if v == "TMP" else v for k, v in flags.items()}
    with pytest.raises(RuntimeError, match="TierConfigError") as err:
        LocalServer(_args(smollm2_dir, **flags))
    assert message in str(err.value), str(err.value)
