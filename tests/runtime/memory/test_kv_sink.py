"""Exact attention sink of FP8 pools (``KVPool`` doc): slots claimed per first token, the
values written, the flag, and the server path (ModelRunner + Scheduler, SmolLM2 on the CPU)."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.memory.kv_formats import DEFAULT_KV_SINK_SLOTS
from radixlm.runtime.memory.kv_pool import KVPool, key_rotation
from radixlm.runtime.server_args import ServerArgs

from ..executor.test_model import Session
from .test_kv_int4 import PROMPT, _serve


def _fp8_pool(sink_slots: int, means: bool = False) -> KVPool:
    k_scales, v_scales = torch.full((2, 3), 0.01), torch.full((2, 3), 0.02)
    k_means = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)) if means else None
    v_means = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2)) if means else None
    return KVPool(5, 4, 2, 3, 8, torch.float32, "cpu", "fp8_e4m3", k_scales, v_scales, k_means, v_means,
                  sink_slots=sink_slots)  # fmt: skip


def test_sink_slots_are_claimed_once_per_first_token_and_never_evicted() -> None:
    pool = _fp8_pool(2)
    assert pool.has_sink and pool.sink_k.shape == pool.sink_v.shape == (2, 2, 3, 8)
    assert pool.sink_slot(5, computes_position_0=False) == (-1, False)  # a cached prefix claims nothing
    assert pool.sink_slot(5, computes_position_0=True) == (0, True)  # this pass writes it
    assert pool.sink_slot(5, computes_position_0=True) == (0, False)  # a later prefill reads it
    assert pool.sink_slot(5, computes_position_0=False) == (0, False)
    assert pool.sink_slot(7, computes_position_0=True) == (1, True)
    assert pool.sink_full and pool.sink_slot(9, computes_position_0=True) == (-1, False)  # full: FP8 page
    assert pool.sink_lookup(7) == 1 and pool.sink_lookup(9) == -1
    pool.unclaim_sinks([5, 11])  # a failed pass gives its claims back (11 held none)
    assert pool.sink_lookup(5) == -1 and not pool.sink_full
    assert pool.sink_slot(9, computes_position_0=True) == (0, True) and pool.sink_full
    # Counted as metadata: scales + 2 x L x C x K x D float32 slots.
    assert pool.metadata_bytes == 2 * 2 * 3 * 4 + 2 * 2 * 2 * 3 * 8 * 4
    assert _fp8_pool(0).metadata_bytes == 2 * 2 * 3 * 4 and not _fp8_pool(0).has_sink
    bf16 = KVPool(5, 4, 2, 3, 8, torch.float32, "cpu", "bf16", sink_slots=4)  # float pages are exact already
    assert not bf16.has_sink and bf16.sink_slot(5, True) == (-1, False)
    with pytest.raises(ValueError, match="sink_slots must be >= 0"):
        _fp8_pool(-1)


def test_write_sink_stores_centred_scaled_float_values() -> None:
    pool = _fp8_pool(3, means=True)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(6, 3, 8, generator=gen), torch.randn(6, 3, 8, generator=gen)
    pool.write_sink(1, k, v, torch.tensor([4, 0]), torch.tensor([2, 0]))
    torch.testing.assert_close(pool.sink_k[1, 2], (k[4] - pool.k_mean[1]) / 0.01)
    torch.testing.assert_close(pool.sink_v[1, 0], (v[0] - pool.v_mean[1]) / 0.02)
    assert float(pool.sink_k[0].abs().sum()) == 0.0 and float(pool.sink_k[1, 1].abs().sum()) == 0.0


def test_kv_sink_slots_flag() -> None:
    assert ServerArgs(kv_cache_dtype="fp8_e4m3").sink_slots == DEFAULT_KV_SINK_SLOTS == 64
    assert ServerArgs(kv_cache_dtype="fp8_e4m3", kv_sink_slots=0).sink_slots == 0
    assert ServerArgs(kv_cache_dtype="mixed").sink_slots == 0 and ServerArgs().sink_slots == 0
    with pytest.raises(ValueError, match="--kv-sink-slots only applies to --kv-cache-dtype fp8_e4m3"):
        ServerArgs(kv_cache_dtype="int4", kv_sink_slots=8).validate()
    ServerArgs(kv_cache_dtype="bf16", kv_sink_slots=0).validate()  # off is accepted with any dtype
    with pytest.raises(ValueError, match="--kv-sink-slots must be >= 0"):
        ServerArgs(kv_cache_dtype="fp8_e4m3", kv_sink_slots=-1).validate()


@pytest.mark.slow
def test_server_keeps_the_first_tokens_kv_exact(smollm2_dir: str) -> None:
    """SmolLM2, fp8_e4m3, ModelRunner + Scheduler (torch backend): request a's prefill claims
    one slot for its first token and writes position 0's K/V there, exact: the same values a
    float pool gets from that token alone (at position 0 a token attends only to itself).
    b and c reuse a's cached pages and read the slot; their answers agree."""
    outputs, cached, runner = _serve(smollm2_dir, "fp8_e4m3", "cpu")
    pool = runner.pool
    assert pool.has_sink and not pool.sink_full
    assert pool.sink_lookup(PROMPT[0]) == 0 and pool.sink_lookup(PROMPT[1]) == -1  # one slot, a's
    assert cached["b"] >= 32 and cached["c"] >= 32 and outputs[1] == outputs[2], (cached, outputs)
    session = Session(runner.model, page_size=8)  # float32 pool
    session.step({0: ([PROMPT[0]], 0)})
    page = session.tables[0][0]
    for layer in (0, 17, 29):
        for sink, float_pool, scale, mean in ((pool.sink_k, session.pool.k, pool.k_scale, pool.k_mean),
                                              (pool.sink_v, session.pool.v, pool.v_scale, pool.v_mean)):
            raw = float_pool[layer][page, 0]  # [K, D]
            if sink is pool.sink_k and pool.k_rotation is not None:
                raw = raw @ key_rotation(raw.shape[-1])  # keys are stored rotated
            want = (raw - mean[layer]) / scale[layer][:, None]
            torch.testing.assert_close(sink[layer, 0], want, rtol=1e-4, atol=1e-3)
    # A pass that claims a slot and fails before writing it gives the slot back: the request
    # is aborted with an error and the next prefill with that first token claims it afresh.
    from radixlm.runtime import messages as m
    from radixlm.runtime.scheduler.scheduler import Scheduler

    sched = Scheduler(runner.args.replace(model_path="unused"), runner)
    forward = runner.model.forward
    runner.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    prompt = [9690, *PROMPT[1:20]]
    sched.handle(m.GenerateReq(rid="d", input_ids=prompt, sampling=m.SamplingParams(max_new_tokens=2, temperature=0.0)))
    for _ in range(3):
        sched._safe_step()
    assert [o.finish_reason for o in sched.outbox if o.rid == "d"][-1] is not None
    assert pool.sink_lookup(9690) == -1 and pool.sink_tokens == 1
    runner.model.forward = forward
    sched.handle(m.GenerateReq(rid="e", input_ids=prompt, sampling=m.SamplingParams(max_new_tokens=2, temperature=0.0)))
    for _ in range(4):
        sched._safe_step()
    assert pool.sink_lookup(9690) == 1 and float(pool.sink_k[0, 1].abs().sum()) > 0
    # /metrics reports the slots: 64 (the default), 2 claimed (a's and e's first tokens).
    from radixlm.runtime.server.metrics import Metrics

    stats = sched.stats()
    assert (stats.kv_sink_slots_total, stats.kv_sink_slots_used) == (64, 2)
    text = Metrics("m").render(stats)[0].decode()
    assert 'radixlm:kv_sink_slots_total{model_name="m"} 64.0' in text
    assert 'radixlm:kv_sink_slots_used{model_name="m"} 2.0' in text
    # Without slots the same requests run on FP8 position 0 (and still agree with each other).
    outputs0, _, runner0 = _serve(smollm2_dir, "fp8_e4m3", "cpu", kv_sink_slots=0)
    assert not runner0.pool.has_sink and outputs0[1] == outputs0[2]
