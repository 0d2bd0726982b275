"""The prefix-cache simulator: exact hit counts on hand-built traces, Belady's MIN
against every policy and against exhaustive search, the trace generators, the CLI."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.radix import EVICTION_POLICIES
from radixlm.runtime.bench import cache_sim as cs
from radixlm.runtime.bench import cache_traces as ct
from radixlm.runtime.bench.cache_min import BELADY, PageTrace, belady, lock_schedule
from radixlm.runtime.bench.cache_model import ServiceModel
from radixlm.runtime.bench.cache_sim import replay
from radixlm.runtime.bench.cache_sim_tiers import replay_tiered
from radixlm.runtime.bench.cache_traces import TraceRequest


def make_trace(*requests: tuple[list[int], list[int]]) -> list[TraceRequest]:
    """Requests (prompt, output) arriving one second apart."""
    return [TraceRequest(float(t), tuple(p), tuple(o), 0) for t, (p, o) in enumerate(requests)]


def hits(trace: list[TraceRequest], page_size: int, capacity: int, policy: str) -> int:
    if policy == BELADY:
        return belady(PageTrace.build(trace, page_size), capacity).cached_tokens
    return replay(trace, page_size, capacity, policy).cached_tokens


# Page size 1, 4 pages; request rK arrives at t = K. The eviction that separates the
# policies is at r3:
#   r0 [1 2 3]+[9]  -> caches 1 2 3                 (match [1 2]: 0)
#   r1 [1 2 4]+[9]  -> 1 2 | 3, 4                   (match [1 2]: 2 hits, [1 2] hit once)
#   r2 [5 6]+[9]    -> evicts leaves 3 (t0), 4 (t1)  (match [5]: 0)
#   r3 [7 8]+[9]    -> needs 2 of {[1 2] t1 1 hit, [5 6] t2 0 hits}: lru and longest (tie
#                      on size) evict [1 2]; lfu, importance (both 2 tokens long; one
#                      hit is worth +10 s, more than the 1 s age difference) and Belady
#                      ([1 2] is used again at r4, [5 6] at r5) evict [5 6]
#   r4 [1 2 3]+[9]  -> 2 hits if [1 2] survived; then [7 8] or the rest goes
#   r5 [5 6 7]+[9]  -> [5 6] is gone under every policy: 0
TRACE_A = make_trace(
    ([1, 2, 3], [9]),
    ([1, 2, 4], [9]),
    ([5, 6], [9]),
    ([7, 8], [9]),
    ([1, 2, 3], [9]),
    ([5, 6, 7], [9]),
)


@pytest.mark.parametrize(
    "policy, expected",
    # continuation-odds has learned nothing yet (it refreshes after 64 new leaves): LRU
    [
        ("lru", 2),
        ("longest", 2),
        ("lfu", 4),
        ("importance", 4),
        ("continuation-odds", 2),
        (BELADY, 4),
    ],
)
def test_hit_counts_on_a_hand_computed_trace(policy: str, expected: int) -> None:
    assert hits(TRACE_A, page_size=1, capacity=4, policy=policy) == expected
    assert hits(TRACE_A, page_size=1, capacity=100, policy=policy) == 2 + 2 + 2


def test_replay_totals_and_evictions() -> None:
    result = replay(TRACE_A, page_size=1, capacity_pages=4, policy="lru")
    assert result.prompt_tokens == 3 + 3 + 2 + 2 + 3 + 3
    assert result.cached_tokens == 2
    # r2 evicts 3, 4; r3 evicts [1 2]; r4 evicts [5 6], [7 8]; r5 evicts [1 2 3]
    assert result.evicted_pages == 2 + 2 + 4 + 3
    assert result.hit_rate == pytest.approx(2 / 16)


def test_page_alignment_matches_the_server() -> None:
    # docs/SERVING.md: a repeated 32-token prompt reports 16 cached tokens, a 33-token one 32.
    for length, cached in [(32, 16), (33, 32), (16, 0), (17, 16)]:
        prompt = list(range(100, 100 + length))
        trace = make_trace((prompt, [7]), (prompt, [7]))
        for policy in [*EVICTION_POLICIES, BELADY]:
            assert hits(trace, page_size=16, capacity=64, policy=policy) == cached


def test_output_pages_are_cached_for_the_next_turn() -> None:
    # Turn 2's prompt extends turn 1's prompt + output; the last output token is never
    # computed, so only the whole pages of prompt + output[:-1] are cached.
    turn1 = (list(range(10)), list(range(10, 16)))  # 15 computed tokens -> 3 pages of 4
    turn2 = (list(range(20)), [1])  # match 19 tokens: 4 pages possible, 3 cached
    trace = make_trace(turn1, turn2)
    for policy in [*EVICTION_POLICIES, BELADY]:
        assert hits(trace, page_size=4, capacity=16, policy=policy) == 12


def test_request_longer_than_the_budget_is_cut_to_fit() -> None:
    trace = make_trace((list(range(40)), [0]), (list(range(40)), [0]))
    for policy in [*EVICTION_POLICIES, BELADY]:
        assert hits(trace, page_size=4, capacity=3, policy=policy) == 12


def test_page_trace_working_set_and_uses() -> None:
    pt = PageTrace.build(TRACE_A, page_size=1)
    # distinct inserted prefixes: 1 12 123 124 5 56 7 78 567 = 9
    assert pt.num_pages == 9
    assert [p.counted for p in pt.pages] == [2, 2, 1, 1, 2, 2]
    assert pt.events == [0, ~0, 1, ~1, 2, ~2, 3, ~3, 4, ~4, 5, ~5]  # instant: no overlap
    one = pt.paths[0][0]
    assert pt.uses[one] == [0, 2, 8]  # [1] is in the matched part of r0, r1, r4 (events)
    assert pt.depth[pt.paths[0][2]] == 2


# ----------------------------------------------------------------------------- Belady
def random_traces(max_requests: int) -> st.SearchStrategy[list[TraceRequest]]:
    """Prompts that share prefixes: one of three bases cut at a random length plus a
    short random tail; outputs of 1-3 tokens; alphabet of 3 tokens."""
    bases = st.lists(st.integers(0, 2), min_size=1, max_size=8)
    request = st.tuples(
        st.integers(0, 2),
        st.integers(0, 8),
        st.lists(st.integers(0, 2), max_size=3),
        st.lists(st.integers(0, 2), min_size=1, max_size=3),
    )

    @st.composite
    def build(draw: st.DrawFn) -> list[TraceRequest]:
        base = [draw(bases) for _ in range(3)]
        reqs = draw(st.lists(request, min_size=1, max_size=max_requests))
        return make_trace(*[(base[b][:cut] + tail + [0], out) for b, cut, tail, out in reqs])

    return build()


@settings(max_examples=150, deadline=None)
@given(trace=random_traces(10), page_size=st.sampled_from([1, 2]), data=st.data())
def test_belady_is_at_least_every_policy(trace, page_size, data) -> None:
    pt = PageTrace.build(trace, page_size)
    capacity = data.draw(st.integers(1, max(1, pt.num_pages)))
    best = belady(pt, capacity).cached_tokens
    for policy in EVICTION_POLICIES:
        assert best >= replay(trace, page_size, capacity, policy).cached_tokens, policy


def exhaustive_optimum(pt: PageTrace, capacity: int, device: int | None = None) -> int:
    """Most cached tokens over every eviction choice, at KV-page granularity: after each
    event the cache holds the pages running requests lock (``lock_schedule`` in a pool of
    ``device`` pages, default ``capacity``) and any subset of the other cached or just
    admitted pages that fits in ``capacity`` less the private pages held."""
    sched = lock_schedule(pt, capacity if device is None else device)
    k = pt.geo.kv_per_page

    def units(j: int, lo: int, hi: int) -> frozenset[tuple[int, int]]:
        return frozenset((p, u) for p in pt.paths[j][lo:hi] for u in range(k))

    running: dict[int, frozenset] = {}
    private, steps = 0, []
    for e in pt.events:
        j = e if e >= 0 else ~e
        if e >= 0:
            admitted = running[j] = units(j, 0, sched.resident[j])
            private += sched.granted[j]
        else:
            admitted = units(j, sched.resident[j], sched.final[j])
            del running[j]
            private -= sched.granted[j]
        steps.append((e, admitted, frozenset().union(*running.values()), capacity - private))

    def hit(j: int, cache: frozenset) -> int:
        wanted = [(p, u) for p in pt.paths[j][: pt.pages[j].counted] for u in range(k)]
        return len(list(itertools.takewhile(cache.__contains__, wanted)))

    @functools.cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(steps):
            return 0
        e, admitted, locked, budget = steps[i]
        gain = hit(e, cache) * pt.geo.page_size if e >= 0 and pt.scored[e] else 0
        rest = sorted((cache | admitted) - locked)
        keeps = (
            frozenset(kept)
            for size in range(min(budget - len(locked), len(rest)) + 1)
            for kept in itertools.combinations(rest, size)
        )
        return gain + max(best(i + 1, locked | kept) for kept in keeps)

    return best(0, frozenset())


def test_belady_evicts_a_page_that_is_reloaded_for_free_before_its_use() -> None:
    # Page size 1, 5 pages. Paths: r0 [0 1], r1 [2 3 4 5] (locked: one of 0 / 1 must go),
    # r2 [0] (reloads [0] without counting it), r3 [0 1 6] counts [0 1]. Evicting the
    # parent [0] and keeping [1] gives r3 two hits; evicting [1] gives one.
    trace = make_trace(([0], [0, 1]), ([1, 0], [0, 0, 1]), ([0], [2]), ([0, 0, 0], [1]))
    pt = PageTrace.build(trace, 1)
    assert pt.paths == [[0, 1], [2, 3, 4, 5], [0], [0, 1, 6]]
    assert belady(pt, 5).cached_tokens == 2 == exhaustive_optimum(pt, 5)


@settings(max_examples=150, deadline=None)
@given(trace=random_traces(6), page_size=st.sampled_from([1, 2]), data=st.data())
def test_belady_equals_the_exhaustive_optimum(trace, page_size, data) -> None:
    pt = PageTrace.build(trace, page_size)
    capacity = data.draw(st.integers(1, max(1, min(pt.num_pages, 6))))
    assert belady(pt, capacity).cached_tokens == exhaustive_optimum(pt, capacity)


# ----------------------------------------------------------------------------- traces
def test_shared_prefix_trace_reaches_its_theoretical_hit_rate() -> None:
    cfg = ct.SharedPrefixConfig(
        num_groups=3, prompts_per_group=4, system_prompt_len=32, question_len=16, output_len=8
    )
    trace = ct.shared_prefix(cfg, seed=1)
    assert len(trace) == 12 and len({r.session for r in trace}) == 3
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    pt = PageTrace.build(trace, 16)
    # (P - 1) S / (P (S + Q)) = 3 * 32 / (4 * 48)
    assert belady(pt, pt.num_pages).hit_rate == 0.5
    assert ct.shared_prefix(cfg, seed=1) == trace  # deterministic for a seed


def test_scan_mix_trace_shape() -> None:
    cfg = ct.ScanMixConfig(
        num_requests=200,
        num_documents=5,
        document_len=32,
        question_len=8,
        one_off_fraction=0.25,
        one_off_len=64,
        output_len=4,
    )
    trace = ct.scan_mix(cfg, seed=3)
    scans = [r for r in trace if r.session < 0]
    assert 25 <= len(scans) <= 75
    assert {len(r.prompt) for r in scans} == {64}
    assert {len(r.prompt) for r in trace if r.session >= 0} == {40}
    assert len({r.prompt[:32] for r in trace if r.session >= 0}) == 5
    assert ct.scan_mix(cfg, seed=3) == trace


def test_chat_pairs_join_roles_and_stop_at_others() -> None:
    messages = [
        {"from": "human", "value": "a"},
        {"from": "gpt", "value": "b"},
        {"from": "gpt", "value": "c"},
        {"from": "human", "value": "d"},
        {"from": "gpt", "value": "e"},
        {"from": "human", "value": "f"},
        {"from": "system", "value": "g"},
        {"from": "gpt", "value": "h"},
    ]
    assert ct._chat_pairs(messages) == [("a", "b\nc"), ("d", "e")]
    assert ct._chat_pairs(messages[1:]) == []  # must start with the user


@pytest.fixture
def word_tokenizer(tmp_path: Path) -> str:
    """A word-level tokenizer.json: one id per whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|im_start|>", "<|im_end|>", "system", "user", "assistant", "\n", "[UNK]"]
    words += [f"w{i}" for i in range(20)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.Split("\n", "isolated")]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path)


def test_conversation_turns_extend_each_other(word_tokenizer: str) -> None:
    chat = ct.ChatMLTokenizer(word_tokenizer)
    start, end, nl, user, asst = 0, 1, 5, 3, 4
    assert chat.system[:2] == (start, 2) and chat.system[-2:] == (end, nl)
    pairs = [("w1 w2", "w3"), ("w4", "w5 w6 w7"), ("w8 " * 30, "w9")]
    turns = ct._conversation_turns(pairs, chat, context_length=60)
    assert len(turns) == 2  # the third turn would exceed 60 tokens
    (p1, o1), (p2, o2) = turns
    assert p1 == chat.system + (start, user, nl, 8, 9, end, nl, start, asst, nl)
    assert o1 == (10, end)
    assert p2[: len(p1) + len(o1) + 1] == p1 + o1 + (nl,)
    assert p2[len(p1) + len(o1) + 1 :] == (start, user, nl, 11, end, nl, start, asst, nl)
    assert o2 == (12, 13, 14, end)


def fake_records() -> list[dict]:
    """ShareGPT-shaped records: chat "a" split by the dataset into a_0 and a_4."""

    def msgs(*pairs: tuple[str, str]) -> list[dict]:
        return [
            {"from": who, "value": text}
            for pair in pairs
            for who, text in zip(("human", "gpt"), pair, strict=True)
        ]

    return [
        {"id": "a_0", "conversations": msgs(("w1", "w2"), ("w3", "w4"))},
        {"id": "b_0", "conversations": msgs(("w5", "w6"))},
        {"id": "a_4", "conversations": msgs(("w7", "w8"))},
        {"id": "c_0", "conversations": [{"from": "gpt", "value": "w9"}]},
    ]


def test_conversations_join_split_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("radixlm.runtime.bench.sharegpt.iter_records", lambda path=None: iter(fake_records()))
    joined = [ct._chat_pairs(m) for m in ct._conversations(split_records=False)]
    assert joined == [[("w1", "w2"), ("w3", "w4"), ("w7", "w8")], [("w5", "w6")], []]
    split = [ct._chat_pairs(m) for m in ct._conversations(split_records=True)]
    assert split == [[("w1", "w2"), ("w3", "w4")], [("w5", "w6")], [("w7", "w8")], []]


def test_sharegpt_multiturn_interleaves_conversations(
    monkeypatch: pytest.MonkeyPatch, word_tokenizer: str
) -> None:
    monkeypatch.setattr("radixlm.runtime.bench.sharegpt.iter_records", lambda path=None: iter(fake_records()))
    cfg = ct.MultiTurnConfig(num_conversations=5, conversation_rate=1.0, think_time_s=30.0)
    trace = ct.sharegpt_multiturn(cfg, seed=4, tokenizer_dir=word_tokenizer)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    by_session = {s: [r for r in trace if r.session == s] for s in {r.session for r in trace}}
    assert sorted(len(turns) for turns in by_session.values()) == [1, 3]
    (turns,) = [t for t in by_session.values() if len(t) == 3]
    for before, after in itertools.pairwise(turns):
        assert (
            after.prompt[: len(before.prompt) + len(before.output)] == before.prompt + before.output
        )
    assert ct.sharegpt_multiturn(cfg, seed=4, tokenizer_dir=word_tokenizer) == trace


# ----------------------------------------------------------------------------- CLI
def test_cli_writes_jsonl_plot_and_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from radixlm.runtime.cli import main

    argv = [
        "bench",
        "cache-sim",
        "--traces",
        "shared-prefix",
        "scan-mix",
        "--capacities",
        "0.25",
        "1.0",
        "--policies",
        "lru",
        "lfu",
        "--seed",
        "2",
        "--gsp-num-groups",
        "4",
        "--gsp-prompts-per-group",
        "3",
        "--gsp-system-prompt-len",
        "64",
        "--gsp-question-len",
        "16",
        "--gsp-output-len",
        "16",
        "--scan-num-requests",
        "30",
        "--scan-num-documents",
        "3",
        "--scan-document-len",
        "64",
        "--scan-one-off-len",
        "128",
        "--output-dir",
        str(tmp_path),
        "--no-progress",
    ]
    main(argv)
    rows = [json.loads(line) for line in (tmp_path / "cache_sim.jsonl").read_text().splitlines()]
    traces = [r for r in rows if r["kind"] == "trace"]
    results = [r for r in rows if r["kind"] == "result"]
    assert [t["trace"] for t in traces] == ["shared-prefix", "scan-mix"]
    assert len(results) == 2 * 2 * 3  # traces x capacities x (lru, lfu, belady)
    gsp_full = [
        r for r in results if r["trace"] == "shared-prefix" and r["capacity_fraction"] == 1.0
    ]
    # (P - 1) S / (P (S + Q)) = 2 * 64 / (3 * 80), reached by every policy at 100%
    assert {round(r["hit_rate"], 6) for r in gsp_full} == {round(128 / 240, 6)}
    assert traces[0]["max_hit_rate"] == pytest.approx(128 / 240)
    assert (tmp_path / "cache_sim.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "| shared-prefix: capacity | lru | lfu | belady (optimum) |" in out
    assert "| 100% | 53.3% | 53.3% | 53.3% |" in out
    rerun = tmp_path / "again"
    main([*argv[:-3], "--output-dir", str(rerun), "--no-progress"])
    assert (rerun / "cache_sim.jsonl").read_text() == (tmp_path / "cache_sim.jsonl").read_text()


def test_cli_lists_the_bench_command(capsys: pytest.CaptureFixture) -> None:
    from radixlm.runtime.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench"])
    assert exit_info.value.code == 2
    assert "cache-sim" in capsys.readouterr().err


# ----------------------------------------------------------------------------- two tiers
TIER_WRITE_POLICIES = ("write_back", "write_through")


@settings(max_examples=150, deadline=None)
@given(
    trace=random_traces(12),
    page_size=st.sampled_from([1, 2]),
    write_policy=st.sampled_from(TIER_WRITE_POLICIES),
    data=st.data(),
)
def test_tiers_stay_under_belady_and_the_infinite_cache(trace, page_size, write_policy, data) -> None:
    """``cache_sim_tiers.replay_tiered``: the device hits stay under Belady at the device
    size, device + host hits under Belady at device + host (resident pages cut to the
    device), which stays under the infinite cache."""
    pt = PageTrace.build(trace, page_size)
    c1 = data.draw(st.integers(1, max(1, pt.num_pages)))
    c2 = data.draw(st.integers(0, pt.num_pages))
    infinite = belady(pt, max(1, pt.num_pages)).cached_tokens
    bound = belady(pt, c1 + c2, device_pages=c1).cached_tokens
    for policy in EVICTION_POLICIES:
        r = replay_tiered(trace, page_size, c1, c2, policy, write_policy)
        assert r.device_hit_tokens <= belady(pt, c1).cached_tokens, policy
        assert r.device_hit_tokens + r.host_hit_tokens <= bound <= infinite, policy


@settings(max_examples=80, deadline=None)
@given(trace=random_traces(6), page_size=st.sampled_from([1, 2]), data=st.data())
def test_belady_with_resident_pages_cut_is_the_exhaustive_optimum(trace, page_size, data) -> None:
    # The bound above is an optimum only if MIN stays exact when each request makes
    # fewer pages resident than the cache holds.
    pt = PageTrace.build(trace, page_size)
    capacity = data.draw(st.integers(1, max(1, min(pt.num_pages, 6))))
    resident = data.draw(st.integers(1, capacity))
    assert belady(pt, capacity, resident).cached_tokens == exhaustive_optimum(
        pt, capacity, resident
    )


# ----------------------------------------------------------------------------- timed model
class Durations:
    """A service model with a given duration (seconds) per arrival time."""

    def __init__(self, **by_arrival: float) -> None:
        self.by_arrival = {float(k[1:]): v for k, v in by_arrival.items()}

    def duration_s(self, req: TraceRequest) -> float:
        return self.by_arrival.get(req.arrival_s, 0.0)


def at(t: float, prompt: list[int]) -> TraceRequest:
    return TraceRequest(t, tuple(prompt), (9,), 0)


# Page size 1, 7 pages; each running request also holds one private page (its output
# token). r0 runs from t0 to t10, so its [1 2] stay locked although least recently used:
#   r0 t0  [1 2]      runs to t10: [1 2] locked, 1 private        (3 used)
#   r1 t1  [3 4]      runs to t2:  [3 4] cached, unlocked at t2   (6 used, then 5)
#   r2 t3  [5 6]      needs 2 + 1 private, 2 free: evicts one leaf. LRU's oldest leaf is
#                     [1 2] (t0), but it is locked: [3 4] goes (last used at t2).
#   r3 t11 [1 2 7]    hits [1 2]: 2
#   r4 t12 [3 4 8]    [3 4] is gone: 0
# The instant model (no locks, no private pages; 5 pages) evicts [1 2] at r2 instead, and
# [3 4] at r3: 0 hits. MIN (timed, 7 pages) evicts page 4 only at r2 (next used at r4,
# after [1 2]; deeper first) and hits [1 2] at r3 and [3] at r4: 3.
TRACE_T = [at(0, [1, 2]), at(1, [3, 4]), at(3, [5, 6]), at(11, [1, 2, 7]), at(12, [3, 4, 8])]
DURATIONS_T = Durations(t0=10, t1=1, t3=1, t11=1)


def test_running_requests_lock_their_pages() -> None:
    timed = replay(TRACE_T, 1, 7, "lru", DURATIONS_T)
    assert timed.cached_tokens == 2 and timed.overflow_pages == 0
    assert timed.evicted_pages == 2 + 2  # [3 4] at r2, [5 6] at r4
    assert replay(TRACE_T, 1, 5, "lru").cached_tokens == 0  # instant
    pt = PageTrace.build(TRACE_T, 1, DURATIONS_T)
    assert pt.events == [0, 1, ~1, 2, ~2, ~0, 3, ~3, 4, ~4]
    assert [p.private for p in pt.pages] == [1] * 5
    assert belady(pt, 7).cached_tokens == 3 == exhaustive_optimum(pt, 7)


def test_a_request_that_does_not_fit_beside_the_running_ones_is_cut() -> None:
    # 5 pages: r0 holds [1 2 3 4] locked and 1 private page until t4; r1 at t1 matches
    # [1 2] (2 hits) but gets neither its page [5] nor its private page (2 overflow);
    # r2 at t5 hits [1 2 3 4] (r1 cached only what it matched).
    trace = [at(0, [1, 2, 3, 4]), at(1, [1, 2, 5]), at(5, [1, 2, 3, 4, 6])]
    durations = Durations(t0=4, t1=3, t5=1)
    result = replay(trace, 1, 5, "lru", durations)
    assert result.cached_tokens == 2 + 4
    assert result.overflow_pages == 2 + 1  # r1: [5] and its private page; r2: its private page
    sched = lock_schedule(PageTrace.build(trace, 1, durations), 5)
    assert sched.resident == [4, 2, 5] and sched.granted == [1, 0, 0]


def test_timed_finish_caches_the_output_and_warmup_is_not_scored() -> None:
    # Turn 2 extends turn 1's prompt + output; in the timed model the output's pages are
    # cached when turn 1 finishes, from its private pages: ceil((4 + 4) / 2) = 4 KV pages,
    # 2 of them the prompt's.
    turn1 = TraceRequest(0.0, (1, 2, 3, 4), (5, 6, 7, 8), 0)
    turn2 = TraceRequest(9.0, (1, 2, 3, 4, 5, 6, 7, 8, 9, 9), (9,), 0)
    service = ServiceModel(prefill_tokens_per_s=4.0, decode_step_s=1.0)  # turn 1: 1 + 4 s
    assert service.duration_s(turn1) == 5.0
    pt = PageTrace.build([turn1, turn2], 2, service)
    assert [(p.arrival, p.inserted, p.private) for p in pt.pages] == [(2, 3, 2), (5, 5, 1)]
    result = replay([turn1, turn2], 2, 8, "lru", service)
    assert result.cached_tokens == 6  # pages [1 2] [3 4] [5 6] ([7 8]: its last token is never run)
    assert result.prompt_tokens == 4 + 10
    warm = replay([turn1, turn2], 2, 8, "lru", service, warmup_s=1.0)
    assert (warm.cached_tokens, warm.prompt_tokens) == (6, 10)
    assert belady(PageTrace.build([turn1, turn2], 2, service, warmup_s=1.0), 8).cached_tokens == 6


def timed_traces(max_requests: int):
    """``random_traces`` with a timed model (overlaps of up to a few requests) and, half
    the time, ids of 2-token blocks (each a page of 2 KV pages of 1 token)."""

    @st.composite
    def build(draw: st.DrawFn):
        trace = draw(random_traces(max_requests))
        blocks = draw(st.booleans())
        if blocks:
            trace = [dataclasses.replace(r, id_tokens=2) for r in trace]
        service = ServiceModel(draw(st.sampled_from([0.0, 1.0, 4.0])), draw(st.floats(0, 1.5)))
        return trace, service, 1 if blocks else draw(st.sampled_from([1, 2]))

    return build()


@settings(max_examples=150, deadline=None)
@given(case=timed_traces(10), data=st.data())
def test_timed_replay_agrees_with_the_lock_schedule_and_stays_under_belady(case, data) -> None:
    trace, service, page_size = case
    pt = PageTrace.build(trace, page_size, service)
    k = pt.geo.kv_per_page
    capacity = data.draw(st.integers(k, max(k, pt.working_set_pages + 2 * k)))
    sched = lock_schedule(pt, capacity)
    best = belady(pt, capacity).cached_tokens
    for policy in EVICTION_POLICIES:
        sim = cs._SingleTier(pt.geo, capacity, policy, timed=True)
        sim.run(trace, service)
        assert [sim.resident[j] for j in range(len(trace))] == sched.resident, policy
        assert [sim.granted[j] for j in range(len(trace))] == sched.granted, policy
        assert sim.private == 0 and not sim.tree.protected_pages
        sim.tree.check_invariants()
        assert best >= sim.cached_tokens, policy


@settings(max_examples=150, deadline=None)
@given(case=timed_traces(6), data=st.data())
def test_timed_belady_equals_the_exhaustive_optimum(case, data) -> None:
    trace, service, page_size = case
    pt = PageTrace.build(trace, page_size, service)
    k = pt.geo.kv_per_page
    capacity = data.draw(st.integers(k, max(k, min(pt.working_set_pages, 6))))
    assert belady(pt, capacity).cached_tokens == exhaustive_optimum(pt, capacity)


@settings(max_examples=100, deadline=None)
@given(case=timed_traces(10), write_policy=st.sampled_from(TIER_WRITE_POLICIES), data=st.data())
def test_timed_tiers_stay_under_belady(case, write_policy, data) -> None:
    trace, service, page_size = case
    pt = PageTrace.build(trace, page_size, service)
    k = pt.geo.kv_per_page
    c1 = data.draw(st.integers(k, max(k, pt.working_set_pages)))
    c2 = data.draw(st.integers(0, pt.working_set_pages))
    single = replay(trace, page_size, c1, "lru", service)
    for policy in EVICTION_POLICIES:
        r = replay_tiered(trace, page_size, c1, c2, policy, write_policy, service)
        assert r.device_hit_tokens <= belady(pt, c1).cached_tokens, policy
        assert r.hit_rate <= belady(pt, c1 + c2, c1).hit_rate + 1e-12, policy
        assert r.overflow_pages == single.overflow_pages
