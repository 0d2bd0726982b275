"""Scheduler message handling and output on CPU with a stub model runner (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from radixlm.runtime import messages as m
from radixlm.runtime.model_runner import ItemResult
from radixlm.runtime.preemption import SwapCostModel
from radixlm.runtime.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs

EOS = 2


class StubRunner:
    """Samples ``next_token`` for every request that reaches the end of its sequence."""

    num_pages = 33  # 32 usable pages of 16 tokens
    tokenizer = None
    eos_token_ids = {EOS}
    context_length = 256

    pool = SimpleNamespace(bytes_per_token=1024)

    def __init__(self, next_token: int = 7, fail: bool = False) -> None:
        self.next_token, self.fail, self.calls = next_token, fail, 0

    def swap_cost_model(self) -> SwapCostModel:
        return SwapCostModel(kv_bytes_per_token=1024, params=10**6, num_layers=2, q_dim=64,
                             link_bytes_per_s=1e9, flops_per_s=1e10)

    def execute(self, decision):
        self.calls += 1
        if self.fail:
            raise RuntimeError("device error")
        return [ItemResult(next_id=self.next_token if it.samples else None, logprob=-0.5)
                for it in decision.items]


def make(runner: StubRunner, **args) -> Scheduler:
    return Scheduler(ServerArgs(**args), runner)


def gen(rid: str, n_prompt: int = 20, **sp) -> m.GenerateReq:
    return m.GenerateReq(rid=rid, input_ids=list(range(100, 100 + n_prompt)),
                         sampling=m.SamplingParams(**{"max_new_tokens": 4, **sp}))


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
    assert ServerArgs.parse(["--radix-eviction-policy", "importance"]).radix_eviction_policy == "importance"
    with pytest.raises(SystemExit) as exit_info:
        ServerArgs.parse(["--radix-eviction-policy", "fifo"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fifo'" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["lru", "lfu", "longest", "importance"])
def test_scheduler_builds_its_tree_with_the_eviction_policy(policy: str) -> None:
    scheduler = make(StubRunner(), radix_eviction_policy=policy)
    assert scheduler.cache.tree is not None and scheduler.cache.tree.eviction_policy == policy
    assert make(StubRunner(), radix_eviction_policy=policy, disable_radix_cache=True).cache.tree is None


def test_stats_report_kv_waste_and_prometheus_exports_it():
    from radixlm.runtime.metrics import Metrics

    s = make(StubRunner())
    s.handle(gen("a", n_prompt=20, max_new_tokens=8))  # 20 tokens in 2 pages of 16
    s._safe_step()
    stats = s.stats()
    assert (stats.kv_waste_tokens, stats.page_size) == (12, 16)  # 32 slots, 20 computed
    text = Metrics("m").render(stats)[0].decode()
    assert 'radixlm:kv_cache_waste_tokens{model_name="m"} 12.0' in text
    used = stats.kv_used_pages * 16
    assert f'radixlm:kv_cache_waste_ratio{{model_name="m"}} {12 / used}' in text
