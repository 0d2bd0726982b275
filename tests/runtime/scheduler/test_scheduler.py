"""Scheduler message handling and output on CPU with a stub model runner (no model)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import msgspec
import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.radix.eviction import ContinuationOdds
from radixlm.runtime import messages as m
from radixlm.runtime.memory.cost_model import SwapCostModel
from radixlm.runtime.scheduler.decision import ItemResult, PendingStep
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs

EOS = 2


class StubRunner:
    """Samples ``next_token`` for every request that reaches the end of its sequence."""

    num_pages = 33  # 32 usable pages of 16 tokens
    tokenizer = None
    eos_token_ids = {EOS}
    context_length = 256

    pool = SimpleNamespace(bytes_per_token=1024, sink_slots=0, sink_tokens=0)  # a float pool: no exact sink
    device = SimpleNamespace(type="cuda")  # a device that computes on its own: overlap on by default

    def __init__(self, next_token: int = 7, fail: bool = False) -> None:
        self.next_token, self.fail, self.calls = next_token, fail, 0

    def swap_cost_model(self) -> SwapCostModel:
        return SwapCostModel(
            kv_bytes_per_token=1024,
            params=10**6,
            num_layers=2,
            q_dim=64,
            link_bytes_per_s=1e9,
            flops_per_s=1e10,
        )

    def launch(self, decision) -> PendingStep:
        self.calls += 1
        if self.fail:
            raise RuntimeError("device error")
        return PendingStep(
            decision.items,
            [
                ItemResult(next_id=self.next_token if it.samples else None, logprob=-0.5)
                for it in decision.items
            ],
        )


def make(runner: StubRunner, **args) -> Scheduler:
    return Scheduler(ServerArgs(**args), runner)


def gen(rid: str, n_prompt: int = 20, **sp) -> m.GenerateReq:
    return m.GenerateReq(
        rid=rid,
        input_ids=list(range(100, 100 + n_prompt)),
        sampling=m.SamplingParams(**{"max_new_tokens": 4, **sp}),
    )


def run(s: Scheduler) -> list[m.ReqOutput]:
    for _ in range(50):
        s._safe_step()
    s.check_invariants()
    out, s.outbox = s.outbox, []
    return out


def test_generates_max_new_tokens_then_finishes_with_length():
    s = make(StubRunner())
    s.handle(gen("a"))
    (out,) = run(s)
    assert out.rid == "a" and out.new_token_ids == [7, 7, 7, 7]
    assert out.finish_reason == "length" and out.prompt_tokens == 20 and out.cached_tokens == 0
    assert s.cache.cached_pages == 1  # 20 prompt + 3 fed outputs = 23 tokens -> 1 full page


def test_eos_stops_unless_ignored():
    s = make(StubRunner(next_token=EOS))
    s.handle(gen("a"))
    s.handle(gen("b", ignore_eos=True))
    outs = {o.rid: o for o in run(s)}
    assert outs["a"].new_token_ids == [EOS] and outs["a"].finish_reason == "stop"
    assert outs["a"].matched_stop == EOS
    assert outs["b"].new_token_ids == [EOS] * 4 and outs["b"].finish_reason == "length"


class ScriptedRunner(StubRunner):
    """Samples the tokens of ``script`` in turn, then EOS."""

    def __init__(self, script: list[int]) -> None:
        super().__init__()
        self.script = iter(script)

    def launch(self, decision) -> PendingStep:
        results = [ItemResult(next_id=next(self.script, EOS) if it.samples else None) for it in decision.items]
        return PendingStep(decision.items, results)


@pytest.mark.parametrize("params", [{}, {"ignore_eos": True}, {"min_new_tokens": 5}])
def test_a_completed_grammar_reports_its_stop_token_as_matched(params: dict):
    """The grammar outranks ignore_eos and min_new_tokens; either way the EOS it allowed
    is the matched stop (SGLang's FINISH_MATCHED_TOKEN), as for a plain EOS."""
    info = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_regex("ab")
    s = make(ScriptedRunner([0, 1, EOS]), debug_invariants=True)
    s._grammars = SimpleNamespace(get=lambda key: _done(compiled), matcher=xgr.GrammarMatcher)
    s.handle(gen("a", max_new_tokens=8, regex="ab", **params))
    (out,) = run(s)
    assert out.new_token_ids == [0, 1, EOS] and out.finish_reason == "stop"
    assert out.matched_stop == EOS and s.violations == []


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def test_second_request_reports_page_aligned_cached_tokens():
    s = make(StubRunner())
    s.handle(gen("a", n_prompt=40))
    run(s)
    s.handle(gen("b", n_prompt=40))
    (out,) = run(s)
    assert out.cached_tokens == 32  # (40 - 1) // 16 * 16


def test_max_new_tokens_zero_runs_and_caches_the_prompt_without_output():
    """As in SGLang, a max_new_tokens=0 request computes its prompt (so it lands in the
    radix cache: fork warm-up, cache_prefix) and finishes with no token."""
    runner = StubRunner()
    s = make(runner)
    s.handle(gen("a", n_prompt=40, max_new_tokens=0))
    (out,) = run(s)
    assert out.finish_reason == "length" and out.new_token_ids == [] and runner.calls == 1
    assert s.cache.cached_pages == 2  # 40 prompt tokens -> 2 full pages of 16
    s.handle(gen("b", n_prompt=40, max_new_tokens=4))
    (out,) = run(s)
    assert out.cached_tokens == 32


def test_abort_frees_pages_and_sends_nothing():
    s = make(StubRunner())
    s.handle(gen("a", max_new_tokens=100))
    s._safe_step()
    s.handle(m.AbortReq(rid="a"))
    assert run(s) == []
    assert not s.reqs and s.cache.tree.protected_pages == 0


def test_duplicate_rid_is_rejected():
    s = make(StubRunner())
    s.handle(gen("a", max_new_tokens=100))
    s.handle(gen("a"))
    first = s.outbox[0]
    assert first.finish_reason == "abort" and "duplicate" in first.error


def test_flush_refused_while_running_then_done_when_idle():
    s = make(StubRunner())
    s.handle(gen("a", max_new_tokens=100))
    s.handle(m.FlushCacheReq())
    assert s.control_out.pop().success is False
    s.handle(m.AbortReq(rid="a"))
    s.handle(m.FlushCacheReq())
    assert s.control_out.pop().success is True
    assert s.cache.cached_pages == 0


def test_step_failure_aborts_requests_with_error_and_keeps_serving():
    runner = StubRunner(fail=True)
    s = make(runner)
    s.handle(gen("a"))
    (out,) = run(s)
    assert out.finish_reason == "abort" and "device error" in out.error
    assert not s.reqs
    runner.fail = False
    s.handle(gen("b"))
    (out,) = run(s)
    assert out.finish_reason == "length" and len(out.new_token_ids) == 4


def test_radix_eviction_flag_parses_and_rejects_unknown_policies(capsys) -> None:
    assert ServerArgs.parse([]).radix_eviction_policy == "lru"
    assert (
        ServerArgs.parse(["--radix-eviction-policy", "importance"]).radix_eviction_policy
        == "importance"
    )
    with pytest.raises(SystemExit) as exit_info:
        ServerArgs.parse(["--radix-eviction-policy", "fifo"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fifo'" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["lru", "lfu", "longest", "importance", "continuation-odds"])
def test_scheduler_builds_its_tree_with_the_eviction_policy(policy: str) -> None:
    scheduler = make(StubRunner(), radix_eviction_policy=policy)
    assert scheduler.cache.tree is not None and scheduler.cache.tree.eviction_policy == policy
    if policy == "continuation-odds":  # a learned policy: the server's tree has its own model
        assert isinstance(scheduler.cache.tree._policy, ContinuationOdds)
    assert (
        make(StubRunner(), radix_eviction_policy=policy, disable_radix_cache=True).cache.tree
        is None
    )


class RecordingRunner(StubRunner):
    """StubRunner that records, per launch, (rid, tokens in flight, start) of each item."""

    def __init__(self, next_token: int = 7) -> None:
        super().__init__(next_token)
        self.launches: list[list[tuple[str, int, int]]] = []

    def launch(self, decision) -> PendingStep:
        self.launches.append([(it.req.rid, it.req.num_inflight, it.start) for it in decision.items])
        return super().launch(decision)


def test_overlap_feeds_the_token_in_flight_and_stops_at_max_new_tokens():
    runner = RecordingRunner()
    s = make(runner)
    s.handle(gen("a", max_new_tokens=4))
    (out,) = run(s)
    assert out.new_token_ids == [7, 7, 7, 7] and out.finish_reason == "length"
    # prefill (0..19), then decodes of positions 20, 21, 22 each launched while the token
    # they feed was still in flight; none past the 4th token (its length is known).
    assert [launch for launch in runner.launches if launch] == [
        [("a", 0, 0)],
        [("a", 1, 20)],
        [("a", 1, 21)],
        [("a", 1, 22)],
    ]
    assert s.cache.cached_pages == 1 and not s.has_work
    stats = s.stats()
    assert (stats.forward_steps, stats.decode_steps) == (4, 3) and stats.scheduler_busy_seconds > 0
    # the prefill step's busy time is not in the decode steps' share
    assert 0 < stats.scheduler_decode_busy_seconds < stats.scheduler_busy_seconds


@pytest.mark.parametrize("overlap", [True, False])
def test_eos_in_flight_costs_one_wasted_step_and_nothing_else(overlap: bool):
    runner = RecordingRunner(next_token=EOS)
    s = make(runner, disable_overlap_schedule=not overlap, debug_invariants=True)
    s.handle(gen("a", max_new_tokens=8))
    (out,) = run(s)
    assert out.new_token_ids == [EOS] and out.finish_reason == "stop"
    steps = [launch for launch in runner.launches if launch]
    assert steps == ([[("a", 0, 0)], [("a", 1, 20)]] if overlap else [[("a", 0, 0)]])
    assert (
        s.violations == [] and s.allocator.num_free == s.allocator.capacity - s.cache.cached_pages
    )


@pytest.mark.parametrize(
    "params", [{"repetition_penalty": 1.2}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.5}]
)
def test_penalties_read_each_token_before_the_next_step(params: dict):
    runner = RecordingRunner()
    s = make(runner)
    s.handle(gen("a", max_new_tokens=4, **params))
    s.handle(gen("b", max_new_tokens=4))
    outs = {o.rid: o for o in run(s)}
    assert outs["a"].new_token_ids == outs["b"].new_token_ids == [7, 7, 7, 7]
    assert all(inflight == 0 for launch in runner.launches for _, inflight, _ in launch)


def test_abort_of_a_request_in_flight_discards_its_results():
    runner = RecordingRunner()
    s = make(runner, debug_invariants=True)
    s.handle(gen("a", max_new_tokens=50))
    s.handle(gen("b", max_new_tokens=3))
    for _ in range(3):
        s._safe_step()
    assert s.inflight is not None and s.reqs["a"].num_inflight == 1
    s.handle(m.AbortReq(rid="a"))
    outs = run(s)
    assert [o.rid for o in outs if o.finish_reason] == ["b"]
    assert s.violations == [] and not s.has_work


def test_stats_report_kv_waste_and_prometheus_exports_it():
    from radixlm.runtime.server.metrics import Metrics

    s = make(StubRunner())
    s.handle(gen("a", n_prompt=20, max_new_tokens=8))  # 20 tokens in 2 pages of 16
    s._safe_step()
    stats = s.stats()
    assert (stats.kv_waste_tokens, stats.page_size) == (12, 16)  # 32 slots, 20 computed
    text = Metrics("m").render(stats)[0].decode()
    assert 'radixlm:kv_cache_waste_tokens{model_name="m"} 12.0' in text
    used = stats.kv_used_pages * 16
    assert f'radixlm:kv_cache_waste_ratio{{model_name="m"}} {12 / used}' in text


def test_a_prompt_is_cached_when_launched_so_the_next_plan_reuses_it_under_overlap():
    """Two requests with one 40-token prompt: lpm defers the second while the first computes
    the shared pages; the next plan comes before the first step's results are read
    (overlap), and must already find the 2 full pages cached."""
    s = make(StubRunner(), schedule_policy="lpm", debug_invariants=True)
    s.handle(gen("a", n_prompt=40))
    s.handle(gen("b", n_prompt=40))
    outs = {o.rid: o for o in run(s)}
    assert (outs["a"].cached_tokens, outs["b"].cached_tokens) == (0, 32)
    assert s.violations == []


def test_admission_batching_default_needs_cuda_graphs():
    """Batched admission pays only where decode steps replay CUDA graphs: off for a runner
    without them, the flag's value when given."""
    assert make(StubRunner()).planner.admit_batch == 1
    assert make(StubRunner(), admit_batch_size=5, admit_max_wait_steps=3).planner.admit_batch == 5
    runner = StubRunner()
    runner.graph_runner = object()
    assert make(runner, max_running_requests=256).planner.admit_batch == 32


class PerRequestRunner(StubRunner):
    """Request ``rid`` samples ``scripts[rid]`` in turn (then EOS), whatever else runs."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        super().__init__()
        self.scripts = {rid: iter(script) for rid, script in scripts.items()}

    def launch(self, decision) -> PendingStep:
        results = [ItemResult(next_id=next(self.scripts[it.req.rid], EOS) if it.samples else None, logprob=-0.5)
                   for it in decision.items]
        return PendingStep(decision.items, results)


@settings(max_examples=60, deadline=None)
@given(script=st.lists(st.sampled_from([EOS, 5, 6, 7]), min_size=1, max_size=14),
       stop_token_ids=st.lists(st.sampled_from([5, 6]), max_size=2), ignore_eos=st.booleans(),
       max_new_tokens=st.integers(1, 12), n_prompt=st.sampled_from([20, 244, 250]))
def test_the_per_token_fast_path_finishes_as_the_full_check(script, stop_token_ids, ignore_eos, max_new_tokens,
                                                             n_prompt):
    """A request with no grammar, logprobs, stop strings or min_new_tokens takes the
    scheduler's per-token fast path (Req.fast_stop_ids); the same request returning logprobs
    takes _append_token and StopChecker.check. Same tokens in: same output, finish reason
    and matched stop out (EOS, stop ids, ignore_eos, max_new_tokens, the 256-token context)."""
    s = make(PerRequestRunner({"fast": script, "full": script}))
    params = dict(stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, max_new_tokens=max_new_tokens)
    s.handle(gen("fast", n_prompt=n_prompt, **params))
    s.handle(msgspec.structs.replace(gen("full", n_prompt=n_prompt, **params), return_logprob=True))
    assert s.reqs["fast"].fast_stop_ids is not None and s.reqs["full"].fast_stop_ids is None
    outs: dict[str, list[m.ReqOutput]] = {}
    for out in run(s):
        outs.setdefault(out.rid, []).append(out)
    fast, full = outs["fast"], outs["full"]
    assert [t for o in fast for t in o.new_token_ids] == [t for o in full for t in o.new_token_ids]
    assert (fast[-1].finish_reason, fast[-1].matched_stop) == (full[-1].finish_reason, full[-1].matched_stop)
    assert fast[-1].finish_reason in ("stop", "length")


def test_a_loop_turn_counts_handling_and_sending_in_the_busy_time():
    """``serve_once`` (one turn of the server loop) adds the time spent handling messages
    and sending outputs to the busy counters, the decode share included when the step
    decoded: a send that takes 20 ms shows in both."""
    import time

    class SlowSend:
        def __init__(self) -> None:
            self.sent: list = []

        def send(self, msg) -> None:
            time.sleep(0.02)
            self.sent.append(msg)

    s, send = make(StubRunner()), SlowSend()
    streamed = msgspec.structs.replace(gen("a", max_new_tokens=4), stream=True)  # an output every step
    assert s.serve_once([streamed], send)  # prefill: not a decode step
    assert s.counters["decode_busy_s"] == 0 and s.counters["busy_s"] >= 0.02
    while s.counters["decode_steps"] == 0:
        s.serve_once([], send)
    assert s.counters["decode_busy_s"] >= 0.02  # its step's outputs were sent in the same turn
    assert any(isinstance(msg, m.BatchOutput) for msg in send.sent)


def test_a_streamed_plain_token_goes_in_the_columns_and_the_stream_adds_up_to_the_whole_output():
    """A streamed request's outputs of one plain token (not the first, not the last, no
    logprobs; also on the full per-token path, min_new_tokens here) are sent as
    BatchOutput's token columns; its first and last outputs, and every output of a request
    returning logprobs or streaming every 2 tokens, as ReqOutputs. Read columns first, each
    request's tokens add up to what an unstreamed request gets."""
    streamed = lambda rid, **kw: msgspec.structs.replace(gen(rid, max_new_tokens=6), stream=True, **kw)  # noqa: E731
    tokens: dict[str, list[int]] = {}
    kinds: dict[str, list[str]] = {}
    for interval in (1, 2):
        s = make(StubRunner(), stream_interval=interval)
        s.handle(streamed(f"plain{interval}"))
        s.handle(streamed(f"logprobs{interval}", return_logprob=True))
        full = streamed(f"full{interval}")  # min_new_tokens: the full per-token path
        s.handle(msgspec.structs.replace(full, sampling=msgspec.structs.replace(full.sampling, min_new_tokens=2)))
        assert s.reqs[f"full{interval}"].fast_stop_ids is None
        s.handle(gen(f"whole{interval}", max_new_tokens=6))
        for _ in range(30):
            s._safe_step()
            batch = s.take_outputs()
            if batch is None:
                continue
            for rid, token in zip(batch.token_rids, batch.token_ids, strict=True):
                tokens.setdefault(rid, []).append(token)
                kinds.setdefault(rid, []).append("column")
            for out in batch.outputs:
                assert out.prompt_tokens == 20
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
                kinds.setdefault(out.rid, []).append(out.finish_reason or "output")
        assert s.take_outputs() is None and not s.has_work
    assert all(ids == [7] * 6 for ids in tokens.values()) and len(tokens) == 8
    assert kinds["plain1"] == kinds["full1"] == ["output", *["column"] * 4, "length"]
    assert kinds["logprobs1"] == ["output"] * 5 + ["length"]
    assert kinds["plain2"] == kinds["logprobs2"] == kinds["full2"] == ["output", "output", "length"]
    assert kinds["whole1"] == kinds["whole2"] == ["length"]


def test_the_idle_loop_spins_only_until_idle_spin_s_after_its_last_work():
    """``run_forever`` asks ``recv`` to spin (poll without blocking) for what is left of
    ``idle_spin_s`` after the last turn with messages or work, not at all with work to do,
    and not once the window has passed; a message or a step opens a new window."""
    import threading
    import time

    class FakeRecv:
        def __init__(self, script: list) -> None:
            self.script, self.calls = script, []

        def recv(self, timeout_ms=None, spin_s=0.0):
            self.calls.append((timeout_ms, spin_s, time.perf_counter()))
            action = self.script.pop(0)
            if not self.script:
                stop.set()
            if action == "sleep":  # nothing arrives: the wait takes the spin and more
                time.sleep(0.06)
                return None
            return action

        def recv_all(self) -> list:
            return []

    class NullSend:
        def send(self, msg) -> None:
            pass

    stop = threading.Event()
    recv = FakeRecv(["sleep", "sleep", gen("a", max_new_tokens=2), None, None, None, "sleep", "sleep"])
    s = make(StubRunner())
    s.run_forever(recv, NullSend(), stop=stop, idle_spin_s=0.05)
    spins = [spin for _, spin, _ in recv.calls]
    timeouts = [t for t, _, _ in recv.calls]
    assert 0.04 < spins[0] <= 0.05  # the window opens at the start
    assert spins[1] <= 0  # 60 ms later: passed, so the wait blocks at once
    assert timeouts[3] == 0 and spins[3] == 0  # the request is running: no wait at all
    first_idle = timeouts.index(50, 3)  # the first idle turn after the request finished
    assert 0.04 < spins[first_idle] <= 0.05  # its last step opened a new window
    assert spins[-1] <= 0
    # with idle_spin_s 0 (an Engine's thread) it never spins
    stop.clear()
    recv = FakeRecv(["sleep", gen("b", max_new_tokens=1), None, None, "sleep"])
    make(StubRunner()).run_forever(recv, NullSend(), stop=stop)
    assert all(spin == 0 for _, spin, _ in recv.calls)


def test_idle_spin_defaults_to_20_ms_with_4_cores_or_more_and_follows_the_flag():
    from radixlm.runtime.scheduler.scheduler import idle_spin_s

    assert idle_spin_s(ServerArgs(), cores=2) == 0.0
    assert idle_spin_s(ServerArgs(), cores=4) == 0.02
    assert idle_spin_s(ServerArgs(idle_spin_ms=5), cores=2) == 0.005
    assert idle_spin_s(ServerArgs(idle_spin_ms=0), cores=16) == 0.0
    with pytest.raises(ValueError, match="idle-spin-ms"):
        ServerArgs(idle_spin_ms=-1).validate()


def test_usable_cores_honours_a_cgroup_quota(tmp_path):
    """A container limited to 2.5 CPUs on a many-core host counts 3, so no default spin."""
    import os

    from radixlm.runtime.executor.model_loader import usable_cores

    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("250000 100000\n")
    assert usable_cores(str(cpu_max)) == min(affinity, 3)
    cpu_max.write_text("50000 100000\n")
    assert usable_cores(str(cpu_max)) == 1
    cpu_max.write_text("max 100000\n")
    assert usable_cores(str(cpu_max)) == affinity
    assert usable_cores(str(tmp_path / "missing")) == affinity


@pytest.mark.parametrize(("running", "prefetching", "peer_busy", "expected"), [
    (False, True, False, 1),  # only disk prefetches awaited: block 1 ms, the reader threads need the GIL
    (False, False, True, 1),  # only a peer's pages awaited
    (False, False, False, 0),  # waiting requests to admit: no wait
    (True, True, False, 0),  # a step to run: no wait
])
def test_idle_loop_polls_instead_of_spinning_while_only_tier_reads_are_awaited(running, prefetching, peer_busy,
                                                                                 expected) -> None:
    fake = SimpleNamespace(
        has_work=True, grammar_waiting=False, inflight=None,
        planner=SimpleNamespace(running=[object()] if running else []),
        peer=SimpleNamespace(busy=peer_busy), hicache=SimpleNamespace(prefetches={"r": 1} if prefetching else {}))
    assert Scheduler.idle_timeout_ms.fget(fake) == expected
    fake.has_work = False
    assert Scheduler.idle_timeout_ms.fget(fake) == 50
