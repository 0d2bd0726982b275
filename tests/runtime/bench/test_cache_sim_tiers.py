"""The two-tier cache replay (``cache_sim_tiers``): without a host tier it is the
single-tier replay; it reaches the infinite cache with a host as large as the working set;
the host budget holds. The Mooncake trace loader; the ``--tiers`` CLI. (On random traces:
under Belady at device + host, in test_cache_sim.py beside its trace strategy.)"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from radixlm.radix import EVICTION_POLICIES
from radixlm.runtime.bench import cache_traces as ct
from radixlm.runtime.bench.cache_min import PageTrace, belady
from radixlm.runtime.bench.cache_model import Geometry
from radixlm.runtime.bench.cache_sim import replay
from radixlm.runtime.bench.cache_sim_tiers import HOST, TieredCache, replay_tiered
from radixlm.runtime.bench.cache_traces import TraceRequest

WRITE_POLICIES = ("write_back", "write_through")
MOONCAKE = (
    Path(__file__).resolve().parents[3] / "../shared/data/traces/mooncake_conversation_trace.jsonl"
)
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"no {MOONCAKE}")


def chat_trace(seed: int, conversations: int = 40, vocab: int = 6) -> list[TraceRequest]:
    """Interleaved conversations on one of three system prompts: turn t + 1's prompt is
    turn t's prompt + output + a new user message; 1-5 turns, lengths of 1-12 tokens."""
    rng = random.Random(seed)
    ids = lambda n: tuple(rng.randrange(vocab) for _ in range(n))  # noqa: E731
    systems = [ids(8) for _ in range(3)]
    turns: list[tuple[float, tuple[int, ...], tuple[int, ...], int]] = []
    for c in range(conversations):
        now, history = rng.uniform(0, 100), rng.choice(systems)
        for _ in range(rng.randint(1, 5)):
            prompt, output = history + ids(rng.randint(1, 12)), ids(rng.randint(1, 12))
            turns.append((now, prompt, output, c))
            history, now = prompt + output, now + rng.expovariate(1 / 20)
    return [TraceRequest(*t) for t in sorted(turns)]


def max_pages(trace: list[TraceRequest], page_size: int) -> int:
    return max((len(r.prompt) + len(r.output) - 1) // page_size for r in trace)


# ----------------------------------------------------------------------------- (1)
@pytest.mark.parametrize("policy", list(EVICTION_POLICIES))
def test_without_a_host_tier_it_is_the_single_tier_replay(policy: str) -> None:
    trace = chat_trace(seed=1)
    for page_size, capacity in [(1, 20), (2, 15), (2, 60), (4, 10)]:
        single = replay(trace, page_size, capacity, policy)
        for write_policy in WRITE_POLICIES:
            tiered = replay_tiered(trace, page_size, capacity, 0, policy, write_policy)
            assert tiered.device_hit_tokens == single.cached_tokens, (page_size, capacity)
            assert tiered.host_hit_tokens == 0 and tiered.copied_pages == 0
            assert tiered.evicted_pages == single.evicted_pages


# ----------------------------------------------------------------------------- (3)
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_a_host_as_large_as_the_working_set_is_the_infinite_cache(write_policy: str) -> None:
    trace = chat_trace(seed=2)
    for page_size in (1, 2):
        pt = PageTrace.build(trace, page_size)
        infinite = belady(pt, pt.num_pages)
        smallest = max_pages(trace, page_size)  # no request is cut
        for c1 in (smallest, 2 * smallest):
            r = replay_tiered(trace, page_size, c1, pt.num_pages, "lru", write_policy)
            assert r.host_hit_tokens > 0
            assert r.device_hit_tokens + r.host_hit_tokens == infinite.cached_tokens
            assert r.hit_rate == pytest.approx(infinite.hit_rate)


# ----------------------------------------------------------------------------- (5)
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_host_never_holds_more_than_its_budget(policy: str, write_policy: str) -> None:
    trace = chat_trace(seed=3, conversations=60)
    released = 0
    for page_size, c1, c2 in [(1, 40, 30), (2, 20, 9), (2, 25, 1), (4, 6, 12)]:
        cache = TieredCache(Geometry.of(trace, page_size), c1, c2, policy, write_policy)
        for j, req in enumerate(trace):
            cache.arrive(j, req, scored=True)
            cache.finish(j, req)
            assert cache.tree.tier_pages(HOST) <= c2
            assert cache.tree.cached_pages <= c1
        cache.tree.check_invariants()
        r = cache.result()
        assert r.copied_pages - r.released_pages == cache.tree.tier_pages(HOST)
        released += r.released_pages
    assert released > 100  # the hosts were full (released: evicted there, or dropped)


# ----------------------------------------------------------------------------- (4)
@needs_mooncake
def test_mooncake_loader_on_the_first_lines() -> None:
    trace = ct.mooncake(MOONCAKE, max_requests=500)
    records = [json.loads(line) for line in itertools.islice(MOONCAKE.open(), 500)]
    assert len(trace) == 500
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert [r.arrival_s for r in trace] == [r["timestamp"] / 1000 for r in records]  # in order
    for req, rec in zip(trace, records, strict=True):
        assert len(req.prompt) == math.ceil(rec["input_length"] / 512) == len(rec["hash_ids"])
        assert req.prompt == tuple(rec["hash_ids"])
        full_last = rec["input_length"] % 512 == 0
        assert len(req.output) == full_last  # only whole blocks are inserted


@needs_mooncake
def test_mooncake_infinite_cache_hits_its_readme_block_rate() -> None:
    trace = ct.mooncake(MOONCAKE)
    pt = PageTrace.build(trace, page_size=16)
    assert len(pt.paths) == 12031
    assert pt.working_set_pages == 170_899 * 32  # whole blocks, 32 pages of 16 tokens each
    best = belady(pt, pt.working_set_pages)
    blocks = best.cached_tokens // 512
    assert round(blocks / sum(len(r.prompt) for r in trace), 3) == 0.366  # README: of blocks
    assert best.prompt_tokens == sum(r.input_tokens for r in trace)
    assert round(best.hit_rate, 3) == 0.373  # of tokens: partial last blocks never hit


def test_mooncake_loader_sorts_and_keeps_only_whole_blocks(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 2000, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 700, "output_length": 9, "hash_ids": [0, 2]},
        {"timestamp": 2000, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1, 3]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = ct.mooncake(path)
    assert [(r.arrival_s, r.prompt, r.output) for r in trace] == [
        (0.5, (0, 2), ()),
        (2.0, (0, 1), (0,)),  # a full last block: inserted
        (2.0, (0, 1, 3), ()),  # ties keep file order
    ]
    assert [(r.input_tokens, r.output_tokens) for r in trace] == [(700, 9), (1024, 5), (1500, 1)]
    # the second request hits block 0, the third blocks 0 and 1 (the full last block)
    result = replay(trace, 16, 10 * 32, "lru")
    assert result.cached_tokens == (1 + 2) * 512
    assert result.prompt_tokens == 700 + 1024 + 1500
    with pytest.raises(ValueError, match="not whole 24-token pages"):
        replay(trace, 24, 100, "lru")
    assert len(ct.mooncake(path, max_requests=2)) == 2
    with pytest.raises(FileNotFoundError, match="--mooncake-path"):
        ct.mooncake(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------- CLI
def test_cli_tiers_writes_jsonl_plot_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from radixlm.runtime.cli import main

    argv = [
        "bench", "cache-sim", "--tiers", "--traces", "shared-prefix",
        "--device-capacities", "0.25", "0.5", "--host-capacities", "0", "0.5", "1",
        "--gsp-num-groups", "4", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "64",
        "--gsp-question-len", "16", "--gsp-output-len", "16",
        "--output-dir", str(tmp_path), "--no-progress",
    ]  # fmt: skip
    main(argv)
    rows = [
        json.loads(line) for line in (tmp_path / "cache_sim_tiers.jsonl").read_text().splitlines()
    ]
    (info,) = [r for r in rows if r["kind"] == "trace"]
    results = [r for r in rows if r["kind"] == "tier_result"]
    assert len(results) == 2 * 3 and {r["policy"] for r in results} == {"lru"}
    for r in results:
        assert r["hit_rate"] <= r["belady_total_hit_rate"] + 1e-12 <= info["max_hit_rate"] + 2e-12
        if r["host_fraction"] == 1:  # (P - 1) S / (P (S + Q)) = 2 * 64 / (3 * 80)
            assert r["hit_rate"] == pytest.approx(128 / 240)
    assert (tmp_path / "cache_sim_tiers.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "| shared-prefix (lru, write_back): device | host | device hits |" in out
    with pytest.raises(SystemExit, match="no Mooncake trace"):
        main(["bench", "cache-sim", "--tiers", "--traces", "mooncake",
              "--mooncake-path", str(tmp_path / "missing.jsonl")])  # fmt: skip


def test_cli_timed_mooncake_scores_after_the_warmup(tmp_path: Path, capsys) -> None:
    from radixlm.runtime.cli import main

    rng = random.Random(7)
    lines, conversations = [], {}
    for i in range(200):  # conversations of 1-4 turns, each turn extending the last
        conv = rng.randrange(40)
        prev = conversations.get(conv, [0])
        ids = prev + [1000 * i + k for k in range(rng.randint(1, 3))]
        conversations[conv] = ids
        length = 512 * (len(ids) - 1) + rng.randint(1, 512)
        lines.append({"timestamp": 500 * i, "input_length": length,
                      "output_length": rng.randint(1, 300), "hash_ids": ids})  # fmt: skip
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["bench", "cache-sim", "--traces", "mooncake", "--mooncake-path", str(path),
            "--capacities", "0.05", "0.2", "--prefill-tokens-per-s", "2000",
            "--decode-step-ms", "20", "--warmup-s", "50", "--output-dir", str(tmp_path),
            "--no-progress"]  # fmt: skip
    main(argv)
    rows = [json.loads(x) for x in (tmp_path / "cache_sim.jsonl").read_text().splitlines()]
    (info,) = [r for r in rows if r["kind"] == "trace"]
    assert info["service"] == {"prefill_tokens_per_s": 2000.0, "decode_step_s": 0.02}
    assert info["page_size"] == 16 and info["working_set_pages"] % 32 == 0
    results = [r for r in rows if r["kind"] == "result"]
    assert len(results) == 2 * (len(EVICTION_POLICIES) + 1)
    scored = sum(line["input_length"] for line in lines if line["timestamp"] >= 50_000)
    assert {r["prompt_tokens"] for r in results} == {scored}
    for f in (0.05, 0.2):
        at = {r["policy"]: r for r in results if r["capacity_fraction"] == f}
        assert all(r["hit_rate"] <= at["belady"]["hit_rate"] + 1e-12 for r in at.values())
        assert all(r["cached_tokens"] % 512 == 0 for p, r in at.items() if p != "belady")
    assert "| 5% |" in capsys.readouterr().out


def test_the_host_tier_can_have_its_own_policy() -> None:
    from radixlm.radix.eviction import lru

    trace = chat_trace(seed=4, conversations=60)
    geo = Geometry.of(trace, 2)
    cache = TieredCache(geo, 20, 9, "lfu", "write_back", host_policy="lru")
    assert cache.tree._policy is not lru and cache.tree._tier_heaps[0]._policy is lru
    same = replay_tiered(trace, 2, 20, 9, "lfu", host_policy="lfu")
    assert same == replay_tiered(trace, 2, 20, 9, "lfu")
    mixed = replay_tiered(trace, 2, 20, 9, "lfu", host_policy="lru")
    assert mixed.host_hit_tokens != same.host_hit_tokens
