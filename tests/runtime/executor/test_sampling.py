"""Tests for radixlm.runtime.executor.sampling: greedy, seeds (C14), filters, penalties, logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from radixlm.runtime.executor.sampling import (
    SamplingBatch,
    SamplingInfo,
    apply_penalties,
    sample,
)

KNOWN_P = [0.5, 0.3, 0.15, 0.05]  # small known distribution, V = 4


def _sample(logits, infos, gen_seed=0, **kwargs):
    gen = torch.Generator(device=logits.device).manual_seed(gen_seed)
    batch = SamplingBatch.build(infos, logits.device)
    return sample(logits, batch, gen, **kwargs)


def _known_rows(n, device="cpu"):
    """[n, 4] logits whose softmax is KNOWN_P (shifted by a constant, which softmax ignores)."""
    return torch.tensor(KNOWN_P, device=device).log().add(3.0).expand(n, -1).contiguous()


def _frequencies(ids, vocab):
    return (torch.bincount(ids.cpu(), minlength=vocab).double() / ids.numel()).tolist()


def _seeded_sequence(row_logits, info_for_step, steps, position=0, mates=()):
    """Token ids of one seeded row over `steps`, placed at `position` among `mates`."""
    out = []
    for step in range(steps):
        infos = [m(step) for m in mates]
        infos.insert(position, info_for_step(step))
        logits = torch.randn(
            len(infos), row_logits.shape[0], generator=torch.Generator().manual_seed(step)
        )
        logits[position] = row_logits
        out.append(_sample(logits, infos, gen_seed=100 + step).next_ids[position].item())
    return out


# --- greedy ------------------------------------------------------------------------------


def test_greedy_equals_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    res = _sample(logits, [SamplingInfo(temperature=0.0)] * 8)
    assert torch.equal(res.next_ids, logits.argmax(-1))
    assert res.next_ids.dtype == torch.int64 and res.next_ids.shape == (8,)


def test_banned_ids_are_never_chosen_and_only_on_their_rows():
    """min_new_tokens' ban (EOS / stop ids): greedy rows take the best id left, sampled rows
    never draw a banned id, rows without bans and the returned logprobs are untouched."""
    logits = _known_rows(4000)  # id 0 is the argmax (p 0.5)
    infos = [SamplingInfo(temperature=0.0, banned_ids=(0,)), SamplingInfo(temperature=0.0),
             SamplingInfo(temperature=1.0, banned_ids=(0, 2))] + [SamplingInfo(temperature=1.0, banned_ids=(1,))] * 3997
    res = _sample(logits, infos)
    assert res.next_ids[:2].tolist() == [1, 0]
    assert res.next_ids[2].item() in (1, 3)
    drawn = res.next_ids[3:]
    assert not (drawn == 1).any()
    freq = _frequencies(drawn, 4)  # renormalised without id 1: 0.5 / 0.7, 0.15 / 0.7, 0.05 / 0.7
    assert freq[0] == pytest.approx(0.5 / 0.7, abs=0.03) and freq[2] == pytest.approx(0.15 / 0.7, abs=0.03)
    assert res.logprobs[0].item() == pytest.approx(math.log(0.3), abs=1e-5)  # raw, not renormalised
    batch = SamplingBatch.build(infos[:2], "cpu")
    assert batch.banned_rows.tolist() == [0] and batch.banned_ids.tolist() == [0]
    with pytest.raises(ValueError, match="banned ids"):
        batch.take([1, 0], infos[1::-1])
    with pytest.raises(ValueError, match="out of vocab"):
        _sample(logits[:1], [SamplingInfo(banned_ids=(4,))])


def test_without_logprobs_the_same_tokens_are_chosen_and_none_computed():
    """want_logprobs=False (no row returns logprobs) skips the log-softmax: the same ids for
    greedy, seeded and unseeded rows under penalties, and logprobs None; top-k logprobs
    still come when asked for."""
    logits = torch.randn(6, 60, generator=torch.Generator().manual_seed(11))
    infos = [SamplingInfo(temperature=0.0), SamplingInfo(temperature=0.8, seed=5, step=2),
             SamplingInfo(temperature=1.2, top_p=0.9), SamplingInfo(temperature=0.7, top_k=7, min_p=0.05),
             SamplingInfo(temperature=1.0, repetition_penalty=1.3, output_ids=[3, 4, 4], prompt_ids=[1, 2]),
             SamplingInfo(temperature=0.0, frequency_penalty=0.5, output_ids=[int(logits[5].argmax())])]
    full = _sample(logits, infos, gen_seed=4)
    lean = _sample(logits, infos, gen_seed=4, want_logprobs=False)
    assert torch.equal(full.next_ids, lean.next_ids) and lean.logprobs is None
    want = torch.log_softmax(logits, -1).gather(1, full.next_ids[:, None]).squeeze(1)
    torch.testing.assert_close(full.logprobs, want)
    top = _sample(logits, infos, gen_seed=4, want_logprobs=False, top_k_logprobs=3)
    assert torch.equal(top.next_ids, full.next_ids) and top.top_ids.shape == (6, 3)
    torch.testing.assert_close(top.logprobs, want)


def test_tiny_temperature_is_greedy():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    res = _sample(logits, [SamplingInfo(temperature=1e-6)] * 4)
    assert torch.equal(res.next_ids, logits.argmax(-1))


def test_greedy_row_unaffected_by_other_rows():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    mates = [
        SamplingInfo(temperature=1.0),
        SamplingInfo(temperature=2.0, top_k=5, seed=9),
        SamplingInfo(temperature=0.7, top_p=0.5, min_p=0.1),
        SamplingInfo(temperature=1.0, repetition_penalty=1.5, output_ids=(1, 2)),
    ]
    expected = logits[0].argmax().item()
    for gen_seed in range(5):
        res = _sample(logits, [SamplingInfo(temperature=0.0), *mates], gen_seed=gen_seed)
        assert res.next_ids[0].item() == expected


def test_all_greedy_batch_ignores_generator():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    batch = SamplingBatch.build([SamplingInfo(temperature=0.0)] * 3, "cpu")
    assert batch.all_greedy
    assert torch.equal(sample(logits, batch, None).next_ids, logits.argmax(-1))


# --- seeds (regression case C14) -------------------------------------------------------


def test_seeded_row_independent_of_position_and_batchmates():
    row = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 0.3  # near flat

    def seeded(step):
        return SamplingInfo(temperature=1.0, top_p=0.95, seed=1234, step=step)

    alone = _seeded_sequence(row, seeded, steps=20)
    mates = (
        lambda step: SamplingInfo(temperature=1.0),  # unseeded: consumes the generator
        lambda step: SamplingInfo(temperature=0.0),
        lambda step: SamplingInfo(temperature=0.8, top_k=3, seed=77, step=step),
    )
    for position in (0, 1, 3):
        assert _seeded_sequence(row, seeded, 20, position, mates) == alone
    assert _seeded_sequence(row, seeded, 20, 1, mates[:1]) == alone
    assert len(set(alone)) > 5  # the seed drives real sampling, not a constant


def test_different_seeds_give_different_sequences():
    flat = torch.zeros(1000)

    def sequence(seed):
        return _seeded_sequence(flat, lambda step: SamplingInfo(seed=seed, step=step), 20)

    a, b = sequence(1), sequence(2)
    assert a == sequence(1)
    assert a != b
    assert sum(x == y for x, y in zip(a, b, strict=True)) <= 2  # near-independent draws on V = 1000


def test_unseeded_rows_reproducible_with_same_generator():
    logits = torch.zeros(6, 500)
    infos = [SamplingInfo()] * 6
    a, b = _sample(logits, infos, gen_seed=3), _sample(logits, infos, gen_seed=3)
    assert torch.equal(a.next_ids, b.next_ids)
    assert not torch.equal(a.next_ids, _sample(logits, infos, gen_seed=4).next_ids)


# --- filters -------------------------------------------------------------------------


def test_top_k_1_equals_greedy():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(6))
    res = _sample(logits, [SamplingInfo(temperature=1.5, top_k=1)] * 16)
    assert torch.equal(res.next_ids, logits.argmax(-1))


def test_tiny_top_p_equals_greedy():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(7))
    res = _sample(logits, [SamplingInfo(temperature=1.5, top_p=1e-6)] * 16)
    assert torch.equal(res.next_ids, logits.argmax(-1))


def test_temperature_1_matches_distribution():
    res = _sample(_known_rows(5000), [SamplingInfo(temperature=1.0)] * 5000)
    for got, want in zip(_frequencies(res.next_ids, 4), KNOWN_P, strict=True):
        assert abs(got - want) < 0.03


def test_temperature_half_squares_probabilities():
    res = _sample(_known_rows(5000), [SamplingInfo(temperature=0.5)] * 5000)
    squared = [p * p for p in KNOWN_P]
    for got, want in zip(_frequencies(res.next_ids, 4), squared, strict=True):
        assert abs(got - want / sum(squared)) < 0.03  # [0.685, 0.247, 0.062, 0.007]


def test_min_p_masks_low_probability_tokens():
    # threshold 0.2 * 0.5 = 0.1: token 3 (p = 0.05) is masked, token 2 (p = 0.15) is not.
    res = _sample(_known_rows(2000), [SamplingInfo(min_p=0.2)] * 2000)
    freqs = _frequencies(res.next_ids, 4)
    assert freqs[3] == 0.0
    for got, want in zip(freqs[:3], KNOWN_P[:3], strict=True):
        assert abs(got - want / 0.95) < 0.04


def test_top_k_keeps_k_largest():
    res = _sample(_known_rows(5000), [SamplingInfo(top_k=2)] * 5000)
    freqs = _frequencies(res.next_ids, 4)
    assert freqs[2] == freqs[3] == 0.0
    assert abs(freqs[0] - 0.625) < 0.03


@pytest.mark.parametrize("top_p, kept", [(0.7, 2), (0.85, 3), (0.96, 4)])
def test_top_p_keeps_smallest_nucleus(top_p, kept):
    # mass before each token: 0, 0.5, 0.8, 0.95 -> dropped once it exceeds top_p
    res = _sample(_known_rows(3000), [SamplingInfo(top_p=top_p)] * 3000)
    freqs = _frequencies(res.next_ids, 4)
    assert all(f > 0 for f in freqs[:kept])
    assert all(f == 0.0 for f in freqs[kept:])


def test_top_p_sees_distribution_renormalised_after_top_k():
    # after top_k=2: [0.625, 0.375]; mass before token 1 is 0.625 > 0.6 -> only token 0.
    res = _sample(_known_rows(500), [SamplingInfo(top_k=2, top_p=0.6)] * 500)
    assert torch.equal(res.next_ids, torch.zeros(500, dtype=torch.int64))


def test_filters_are_per_row():
    infos = [SamplingInfo(top_k=1), SamplingInfo(), SamplingInfo(min_p=0.2)] * 1000
    ids = _sample(_known_rows(3000), infos).next_ids.view(1000, 3)
    assert ids[:, 0].eq(0).all()
    assert ids[:, 1].eq(3).any()  # unfiltered row reaches the tail
    assert not ids[:, 2].eq(3).any()


# --- penalties -------------------------------------------------------------------------


def _penalised(logits_row, **info):
    logits = torch.tensor([logits_row])
    return apply_penalties(logits, SamplingBatch.build([SamplingInfo(**info)], "cpu"))[0].tolist()


def test_repetition_penalty_hf_semantics():
    # seen = prompt (0, 4) + output (1, 1): positive logits / 2, negative * 2, once each.
    got = _penalised(
        [2.0, -2.0, 1.0, -1.0, 0.5], repetition_penalty=2.0, prompt_ids=(0, 4), output_ids=(1, 1)
    )
    assert got == [1.0, -4.0, 1.0, -1.0, 0.25]


def test_frequency_and_presence_penalties_use_output_only():
    got = _penalised(
        [1.0, 1.0, 1.0, 1.0],
        frequency_penalty=0.5,
        presence_penalty=0.25,
        prompt_ids=(1,),
        output_ids=(0, 0, 0, 2),
    )
    assert got == pytest.approx([1.0 - 1.5 - 0.25, 1.0, 1.0 - 0.5 - 0.25, 1.0])


def test_negative_presence_penalty_encourages():
    assert _penalised([0.0, 0.0], presence_penalty=-1.0, output_ids=(1,)) == [0.0, 1.0]


def test_repetition_then_frequency_order():
    # 3.0 / 1.5 = 2.0, then - 2 * 0.5 - 0.5 = 0.5
    got = _penalised(
        [3.0, 0.0],
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        output_ids=(0, 0),
    )
    assert got == pytest.approx([0.5, 0.0])


def test_penalties_are_per_row():
    logits = torch.tensor([[2.0, 1.0], [2.0, 1.0]])
    infos = [SamplingInfo(repetition_penalty=4.0, output_ids=(0,)), SamplingInfo(output_ids=(0,))]
    got = apply_penalties(logits, SamplingBatch.build(infos, "cpu"))
    assert got.tolist() == [[0.5, 1.0], [2.0, 1.0]]


def test_penalties_match_dense_reference():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(3, 40, generator=gen) * 3
    outputs = [torch.randint(0, 40, (25,), generator=gen).tolist() for _ in range(3)]
    infos = [
        SamplingInfo(
            repetition_penalty=1.7,
            frequency_penalty=0.3,
            presence_penalty=0.6,
            prompt_ids=(0, 1, 2),
            output_ids=tuple(outputs[0]),
        ),
        SamplingInfo(output_ids=tuple(outputs[1])),  # no penalty: untouched
        SamplingInfo(repetition_penalty=0.5, presence_penalty=-0.4, output_ids=tuple(outputs[2])),
    ]
    expected = logits.clone()
    for row, info in enumerate(infos):
        seen = set(info.prompt_ids) | set(info.output_ids)
        for tok in range(40):
            x = expected[row, tok].item()
            if tok in seen:
                r = info.repetition_penalty
                x = x / r if x > 0 else x * r
            count = info.output_ids.count(tok)
            x -= count * info.frequency_penalty + (count > 0) * info.presence_penalty
            expected[row, tok] = x
    got = apply_penalties(logits, SamplingBatch.build(infos, "cpu"))
    torch.testing.assert_close(got, expected)


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    info = SamplingInfo(temperature=0.0, repetition_penalty=2.0, output_ids=(0,))
    assert _sample(logits, [info]).next_ids.tolist() == [1]


# --- logprobs ----------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_at_chosen_id():
    logits = torch.randn(6, 80, generator=torch.Generator().manual_seed(8))
    infos = [
        SamplingInfo(temperature=0.0, repetition_penalty=1.3, output_ids=(5, 6)),
        SamplingInfo(temperature=0.7, top_k=10),
        SamplingInfo(temperature=1.3, top_p=0.8, seed=3),
        SamplingInfo(temperature=1.0, frequency_penalty=1.0, output_ids=(1, 1, 1)),
        SamplingInfo(temperature=2.0, min_p=0.05),
        SamplingInfo(),
    ]
    res = _sample(logits, infos)
    expected = torch.log_softmax(logits, -1).gather(1, res.next_ids[:, None]).squeeze(1)
    torch.testing.assert_close(res.logprobs, expected)
    assert res.logprobs.dtype == torch.float32
    assert res.top_ids is None and res.top_logprobs is None


def test_top_logprobs_sorted_descending():
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(9))
    res = _sample(logits, [SamplingInfo()] * 4, top_k_logprobs=5)
    assert res.top_ids.shape == res.top_logprobs.shape == (4, 5)
    assert (res.top_logprobs[:, :-1] >= res.top_logprobs[:, 1:]).all()
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(res.top_logprobs, raw.gather(1, res.top_ids))
    assert torch.equal(res.top_ids[:, 0], logits.argmax(-1))
    assert math.isclose(res.top_logprobs[0, 0].item(), raw[0].max().item(), rel_tol=1e-6)


def test_logits_not_modified():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(10))
    before = logits.clone()
    _sample(logits, [SamplingInfo(repetition_penalty=2.0, output_ids=(1,), top_k=3)] * 3)
    assert torch.equal(logits, before)


# --- validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2.0},
        {"repetition_penalty": 0.0},
        {"step": -1},
    ],
)
def test_invalid_info_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingInfo(**kwargs)


def test_bad_inputs_rejected():
    batch = SamplingBatch.build([SamplingInfo(output_ids=(7,), presence_penalty=1.0)], "cpu")
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 10), batch)
    with pytest.raises(ValueError, match="out of vocab"):
        sample(torch.zeros(1, 5), batch)


# --- CUDA ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_properties_and_cpu_seeds():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(11)).cuda()
    res = _sample(logits, [SamplingInfo(temperature=0.0)] * 8, top_k_logprobs=3)
    assert torch.equal(res.next_ids, logits.argmax(-1))
    assert res.next_ids.device.type == "cuda"
    # Flat logits give bit-identical uniform probs on both devices, and seeded noise is an
    # integer hash (then one log1p) on either device, so a seeded row picks the same token.
    infos = [SamplingInfo(), SamplingInfo(seed=5, step=3, top_k=50), SamplingInfo(temperature=0)]
    flat = torch.zeros(3, 1000)
    cpu_id = _sample(flat, infos).next_ids[1].item()
    assert _sample(flat.cuda(), infos).next_ids[1].item() == cpu_id
    assert _sample(flat[1:2].cuda(), infos[1:2]).next_ids[0].item() == cpu_id
    from radixlm.runtime.executor.sampling import _seeded_noise

    keys = torch.tensor([12345, -987654321])
    torch.testing.assert_close(_seeded_noise(keys.cuda(), 5000).cpu(), _seeded_noise(keys, 5000), rtol=1e-6, atol=0)
    counts = _frequencies(_sample(_known_rows(5000, "cuda"), [SamplingInfo()] * 5000).next_ids, 4)
    assert all(abs(got - want) < 0.03 for got, want in zip(counts, KNOWN_P, strict=True))


def test_seeded_noise_is_exponential_and_a_function_of_the_key_only() -> None:
    """The counter-based seeded noise: Exp(1) moments and uniform deciles over 10^6 draws,
    the same values for the same key whatever the other rows, distinct keys independent."""
    from radixlm.runtime.executor.sampling import _as_int64, _mix_seed, _seeded_noise

    keys = torch.tensor([_as_int64(_mix_seed(s, t)) for s, t in [(1, 0), (1, 1), (2, 0), (2**63 + 5, 9)]])
    vocab = 250_000
    noise = _seeded_noise(keys, vocab)  # [4, V]
    assert noise.shape == (4, vocab) and noise.dtype == torch.float32 and (noise > 0).all()
    torch.testing.assert_close(_seeded_noise(keys[2:3], vocab)[0], noise[2], rtol=0, atol=0)
    flat = noise.flatten().double()
    assert abs(flat.mean().item() - 1.0) < 0.005 and abs(flat.var().item() - 1.0) < 0.02
    uniform = 1 - torch.exp(-flat)
    deciles = torch.histc(uniform, bins=10, min=0, max=1) / flat.numel()
    assert (deciles - 0.1).abs().max().item() < 0.002
    corr = torch.corrcoef(noise.double())[0, 1:]
    assert corr.abs().max().item() < 0.01


def test_take_equals_a_build_of_the_chosen_rows():
    """SamplingBatch.take (the model runner's path when a stateless batch loses members)
    gives field for field what a build from those rows' infos gives, in any row order."""
    params = [SamplingInfo(temperature=t, top_p=p, top_k=k, min_p=m)
              for t, p, k, m in [(0.0, 1.0, -1, 0.0), (0.7, 0.9, 5, 0.0), (1.0, 1.0, 0, 0.1), (0.5, 0.5, 3, 0.05)]]
    full = SamplingBatch.build(params, "cpu")
    for rows in ([0, 2], [3, 1, 0], [1], [2, 3], [0]):
        chosen = [params[i] for i in rows]
        taken, built = full.take(rows, chosen), SamplingBatch.build(chosen, "cpu")
        for f in dataclasses.fields(SamplingBatch):
            a, b = getattr(taken, f.name), getattr(built, f.name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (rows, f.name)
    assert full.take([0], params[:1]).all_greedy and not full.take([0, 1], params[:2]).all_greedy


def test_take_refuses_penalised_seeded_or_banning_batches():
    for info in (SamplingInfo(repetition_penalty=1.2, prompt_ids=[1, 2]), SamplingInfo(temperature=1.0, seed=3),
                 SamplingInfo(banned_ids=(2,))):
        with pytest.raises(ValueError, match="penalties, seeds or banned ids"):
            SamplingBatch.build([info, SamplingInfo()], "cpu").take([0], [info])
