"""Batched token sampling: penalties, temperature, top-k, top-p, min-p, then one argmax.

Dimension letters: B rows (one per request) in the batch, V vocabulary size, K number
of top logprobs asked for, N flattened (row, token) pairs for the penalties.

Pipeline, vectorised over the batch (no Python loop over rows in the arithmetic)::

    raw logits [B, V] f32 --+--> log_softmax --> logprob of the chosen id (+ top-K): "raw",
                            |                     i.e. before penalties and temperature (vLLM)
                            +--> penalties --+--> greedy rows (temperature < 1e-5): argmax
                                             |
                                             +--> / temperature --> softmax --> top-k
                                                  --> top-p --> min-p --> argmax(p / q)

* Banned ids (``min_new_tokens``, vLLM's ``min_tokens``, SGLang's min-new-tokens
  penalizer): a row's ``banned_ids`` (its EOS and stop token ids while it has fewer than
  ``min_new_tokens`` outputs) get logit -inf before everything else, greedy rows included.
* Penalties. Repetition penalty (Keskar et al. 2019, CTRL), HF / vLLM semantics: for every
  token seen in prompt + output, a positive logit is divided by the penalty and a negative
  one multiplied. Then frequency / presence penalties, OpenAI semantics, output tokens
  only: ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``.
* top-k keeps the k largest logits (top_k <= 0 is off).
* top-p is nucleus sampling (Holtzman et al. 2019, "The Curious Case of Neural Text
  Degeneration"): keep the smallest prefix of the descending distribution, renormalised
  after top-k (as vLLM), whose mass reaches p; the most likely token is always kept.
* min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"): drop tokens with
  ``p < min_p * p_max``. The ratio to p_max survives renormalisation and the top token
  is always kept, so min-p gives the same mask before or after top-k / top-p.
* Sampling is the exponential race, i.e. the Gumbel-max trick in ratio form: with
  ``q_i ~ Exp(1)`` i.i.d., ``argmax_i p_i / q_i`` is token i with probability
  ``p_i / sum(p)``. Masked tokens have p = 0 and never win; probs need no renormalising;
  one argmax replaces torch.multinomial. (Only the frequency / presence penalty's
  ``torch.unique`` waits for the device; the scheduler reads next_ids right after anyway.)

Seeds (regression case C14). A seeded row's noise for step ``step`` is a counter-based
hash of (``_mix_seed(seed, step)``, token index) computed on the device for all seeded rows
at once (``_seeded_noise``), so it depends only on (seed, step, V): not on
batch size, position in the batch, batch-mates, or the unseeded generator. The same seed
gives the same token only for the same logits: if the model's forward pass changes the
logits (a different batch size picking a different GEMM kernel, another GPU, another
dtype), the sample may change. Unseeded rows take one ``[Nu, V]`` draw from
``generator_for_unseeded`` (the device's default generator when None).

Cost caveats: seeded rows used to cost ~1.2 ms of CPU time each per step (a CPU
mt19937 per row, measured on the H200 host at V = 152064); the counter-based hash is a
handful of elementwise device ops for all of them. Building a batch flattens the
penalised rows' token ids in Python (about 18 ms for 64 rows x 2.5k ids); a scheduler
with long prompts and repetition penalty should cache those tensors per request.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from radixlm.runtime.executor.forward_batch import to_device

__all__ = ["SampleResult", "SamplingBatch", "SamplingInfo", "apply_penalties", "has_penalties", "sample"]

GREEDY_EPS = 1e-5  # temperature below this means greedy
_TOP_K_OFF = sys.maxsize  # rank limit that never masks
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingInfo:
    """One request's sampling parameters for this step, as plain Python values.

    ``step`` is how many tokens the request has sampled so far (keys seeded noise).
    ``output_ids`` are the tokens generated so far (frequency / presence penalties);
    ``prompt_ids`` + ``output_ids`` are the seen tokens for the repetition penalty.
    ``banned_ids`` may not be sampled at this step (logit -inf): a request's EOS and stop
    token ids while it has fewer than ``min_new_tokens`` outputs.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    step: int = 0
    output_ids: Sequence[int] = ()
    prompt_ids: Sequence[int] = ()
    banned_ids: Sequence[int] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")

        # The row's values as SamplingBatch.build lays them out, computed once per object (a
        # stateless request keeps its SamplingInfo across steps): floats (temperature, 1.0
        # when greedy; top_p, inf when off; min_p; the three penalties), ints (top_k,
        # _TOP_K_OFF when off; greedy).
        greedy = self.temperature < GREEDY_EPS
        object.__setattr__(self, "_floats", (
            1.0 if greedy else self.temperature, self.top_p if self.top_p < 1.0 else float("inf"), self.min_p,
            self.repetition_penalty, self.frequency_penalty, self.presence_penalty))
        object.__setattr__(self, "_ints", (self.top_k if self.top_k > 0 else _TOP_K_OFF, int(greedy)))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of a batch as device tensors, plus host-side flags.

    Build with :meth:`build` once per step. Rows whose feature is off hold neutral values,
    and the ``use_*`` flags let :func:`sample` skip a stage no row needs (no sort when no
    row uses top-k or top-p).
    """

    greedy: Tensor  # [B] bool
    temperatures: Tensor  # [B] f32, 1.0 on greedy rows (never divides by zero)
    top_ks: Tensor  # [B] int64, _TOP_K_OFF where off
    top_ps: Tensor  # [B] f32, inf where off (top_p == 1 never drops a tail token)
    min_ps: Tensor  # [B] f32, 0.0 where off
    repetition_penalties: Tensor  # [B] f32
    frequency_penalties: Tensor  # [B] f32
    presence_penalties: Tensor  # [B] f32
    seen_rows: Tensor  # [Ns] int64, (row, token) pairs of prompt + output, rows with rep. penalty
    seen_ids: Tensor  # [Ns] int64
    output_rows: Tensor  # [No] int64, (row, token) pairs of output, rows with freq/pres penalty
    output_ids: Tensor  # [No] int64
    banned_rows: Tensor  # [Nb] int64, (row, token) pairs that may not be sampled this step
    banned_ids: Tensor  # [Nb] int64
    unseeded_rows: Tensor  # [Nu] int64, sampled (non-greedy) rows without a seed
    seeded_rows: tuple[int, ...]  # sampled rows with a seed
    seed_keys: tuple[int, ...]  # _mix_seed(seed, step) of each seeded row
    max_token_id: int  # largest id in seen_ids / output_ids / banned_ids, -1 if none
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    # The per-row parameters stacked as copied: [6, B] f32 (temperatures .. presence
    # penalties) and [2, B] int64 (top_ks, greedy); the fields above are views of their rows.
    row_floats: Tensor = field(repr=False, default=None)
    row_ints: Tensor = field(repr=False, default=None)

    @property
    def size(self) -> int:
        return self.greedy.shape[0]

    @property
    def device(self) -> torch.device:
        return self.greedy.device

    @classmethod
    def build(cls, params: Sequence[SamplingInfo], device: torch.device | str) -> SamplingBatch:
        device = torch.device(device)
        sampled = [i for i, p in enumerate(params) if not p._ints[1]]
        seen_rows, seen_ids, seen_max = _flatten_ids(params, _rep_wanted, _seen_ids, device)
        out_rows, out_ids, out_max = _flatten_ids(params, _freq_pres_wanted, _output_ids, device)
        ban_rows, ban_ids, ban_max = _flatten_ids(params, _banned_wanted, _banned_ids, device)

        # Two host-to-device copies for the per-row parameters (a step's host time is
        # mostly per-call overhead): floats [6, B] and ints [2, B], unbound into rows; the
        # rows' values were laid out by SamplingInfo, transposed here by zip (no per-row
        # Python beyond two list comprehensions).
        floats = to_device(torch.tensor(list(zip(*[p._floats for p in params], strict=True)),
                                        dtype=torch.float32), device)
        ints = to_device(torch.tensor(list(zip(*[p._ints for p in params], strict=True)), dtype=torch.int64), device)
        return cls._assemble(params, sampled, floats, ints,
                             (seen_rows, seen_ids, out_rows, out_ids, ban_rows, ban_ids),
                             max(seen_max, out_max, ban_max))

    def take(self, rows: Sequence[int], params: Sequence[SamplingInfo]) -> SamplingBatch:
        """The batch whose row i is this batch's row ``rows[i]`` (``params[i]`` its info, the
        same values): two index ops on the device instead of a rebuild from Python values (a
        large decode batch loses a member nearly every step). Only for stateless rows (no
        penalty, seed or banned id: nothing that changes per step); ``params`` are not
        checked for it.

        Raises ValueError if this batch has a penalised, seeded or banning row.
        """
        if self.seen_ids.numel() or self.output_ids.numel() or self.banned_ids.numel() or self.seeded_rows:
            raise ValueError("take() needs rows without penalties, seeds or banned ids")
        index = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        sampled = [i for i, p in enumerate(params) if not p._ints[1]]
        empty = self.seen_ids[:0]
        return self._assemble(params, sampled, self.row_floats[:, index], self.row_ints[:, index],
                              (empty,) * 6, -1)

    @classmethod
    def _assemble(cls, params: Sequence[SamplingInfo], sampled: list[int], floats: Tensor, ints: Tensor,
                  token_ids: tuple[Tensor, ...], max_token_id: int) -> SamplingBatch:
        """The batch from its stacked rows on the device (``row_floats`` / ``row_ints``), the
        rows' infos, the sampled (non-greedy) rows and the flattened (row, id) pairs (seen,
        output and banned)."""
        seen_rows, seen_ids, out_rows, out_ids, ban_rows, ban_ids = token_ids
        device = floats.device
        temperatures, top_ps, min_ps, rep, freq, pres = floats.unbind(0)
        seeded = [i for i in sampled if params[i].seed is not None]
        unseeded = [i for i in sampled if params[i].seed is None]
        return cls(
            greedy=ints[1].bool(),
            temperatures=temperatures,
            top_ks=ints[0],
            top_ps=top_ps,
            min_ps=min_ps,
            repetition_penalties=rep,
            frequency_penalties=freq,
            presence_penalties=pres,
            seen_rows=seen_rows,
            seen_ids=seen_ids,
            output_rows=out_rows,
            output_ids=out_ids,
            banned_rows=ban_rows,
            banned_ids=ban_ids,
            unseeded_rows=to_device(torch.tensor(unseeded, dtype=torch.int64), device),
            seeded_rows=tuple(seeded),
            seed_keys=tuple(_mix_seed(params[i].seed, params[i].step) for i in seeded),
            max_token_id=max_token_id,
            all_greedy=not sampled,
            use_top_k=any(params[i].top_k > 0 for i in sampled),
            use_top_p=any(params[i].top_p < 1.0 for i in sampled),
            use_min_p=any(params[i].min_p > 0.0 for i in sampled),
            row_floats=floats,
            row_ints=ints,
        )


@dataclass(frozen=True)
class SampleResult:
    """Output of :func:`sample`. Logprobs are of the raw logits (before penalties and
    temperature). ``top_ids`` / ``top_logprobs`` are set only when asked for, sorted by
    descending logprob."""

    next_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] f32, log_softmax(raw logits)[b, next_ids[b]]; None if not asked for
    top_ids: Tensor | None = None  # [B, K] int64
    top_logprobs: Tensor | None = None  # [B, K] f32


def sample(
    logits: Tensor,
    batch: SamplingBatch,
    generator_for_unseeded: torch.Generator | None = None,
    top_k_logprobs: int = 0,
    logits_mask: Callable[[Tensor], None] | None = None,
    want_logprobs: bool = True,
) -> SampleResult:
    """Sample one token per row. ``logits``: [B, V] (computed in f32; not modified).
    ``logits_mask`` (structured generation) edits the penalised logits in place before
    the choice; the returned logprobs stay the raw ones. ``want_logprobs`` False (no row
    returns logprobs, ``top_k_logprobs`` 0): the [B, V] log-softmax is skipped and
    ``logprobs`` is None (the chosen ids do not depend on it)."""
    _check_inputs(logits, batch, top_k_logprobs)
    logits = logits.float()
    processed = apply_penalties(logits, batch)
    if logits_mask is not None:
        processed = processed.clone() if processed is logits else processed
        logits_mask(processed)
    next_ids = _choose(processed, batch, generator_for_unseeded)
    if not want_logprobs and top_k_logprobs == 0:
        return SampleResult(next_ids, None)
    raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    result = SampleResult(next_ids, raw_logprobs.gather(1, next_ids[:, None]).squeeze(1))
    if top_k_logprobs == 0:
        return result
    top = raw_logprobs.topk(top_k_logprobs, dim=-1)  # sorted descending
    return SampleResult(result.next_ids, result.logprobs, top.indices, top.values)


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Banned ids (-inf), repetition, then frequency / presence penalties. [B, V] f32 -> new
    [B, V] f32 (``logits`` itself when no row has any).

    Touches only the (row, token) pairs that carry a penalty: O(N), no dense [B, V] masks.
    """
    if not (batch.seen_ids.numel() or batch.output_ids.numel() or batch.banned_ids.numel()):
        return logits
    logits = logits.clone()
    if batch.banned_ids.numel():
        logits[batch.banned_rows, batch.banned_ids] = float("-inf")
    if batch.seen_ids.numel():
        _repetition_penalty_(logits, batch.seen_rows, batch.seen_ids, batch.repetition_penalties)
    if batch.output_ids.numel():
        _frequency_presence_penalty_(logits, batch)
    return logits


def _repetition_penalty_(logits: Tensor, rows: Tensor, ids: Tensor, penalties: Tensor) -> None:
    """In place, HF semantics: seen positive logits / penalty, negative ones * penalty.

    Duplicate (row, id) pairs all write the same value, computed from the unpenalised logit.
    """
    seen = logits[rows, ids]  # [Ns]
    penalty = penalties[rows]  # [Ns]
    logits[rows, ids] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _frequency_presence_penalty_(logits: Tensor, batch: SamplingBatch) -> None:
    """In place, OpenAI semantics: logit -= count * frequency_penalty + presence_penalty."""
    vocab = logits.shape[1]
    keys = batch.output_rows * vocab + batch.output_ids  # [No] flat (row, token) key
    keys, counts = torch.unique(keys, return_counts=True)  # [Nu] distinct pairs
    rows, ids = keys // vocab, keys % vocab
    penalty = counts * batch.frequency_penalties[rows] + batch.presence_penalties[rows]
    logits[rows, ids] -= penalty


def _check_inputs(logits: Tensor, batch: SamplingBatch, top_k_logprobs: int) -> None:
    if logits.dim() != 2 or logits.shape[0] != batch.size:
        raise ValueError(f"logits must be [B={batch.size}, V], got {tuple(logits.shape)}")
    if logits.device != batch.device:
        raise ValueError(f"logits on {logits.device}, batch on {batch.device}")
    if batch.max_token_id >= logits.shape[1]:
        raise ValueError(f"token id {batch.max_token_id} out of vocab {logits.shape[1]}")
    if not 0 <= top_k_logprobs <= logits.shape[1]:
        raise ValueError(f"top_k_logprobs must be in [0, V], got {top_k_logprobs}")


def _choose(logits: Tensor, batch: SamplingBatch, generator: torch.Generator | None) -> Tensor:
    """Penalised logits [B, V] f32 -> token ids [B] int64, greedy or sampled per row."""
    greedy_ids = logits.argmax(dim=-1)  # [B]; first index on ties
    if batch.all_greedy:
        return greedy_ids
    probs = torch.softmax(logits / batch.temperatures[:, None], dim=-1)  # [B, V]
    probs = probs.masked_fill(_filter_mask(probs, batch), 0.0)
    q = _exponential_noise(batch, logits.shape[1], generator)  # [B, V]
    sampled_ids = (probs / q).argmax(dim=-1)  # exponential race
    return torch.where(batch.greedy, greedy_ids, sampled_ids)


def _filter_mask(probs: Tensor, batch: SamplingBatch) -> Tensor:
    """[B, V] bool, True where top-k, top-p or min-p drops the token."""
    drop = torch.zeros_like(probs, dtype=torch.bool)
    if batch.use_top_k or batch.use_top_p:
        drop = _top_k_top_p_mask(probs, batch.top_ks, batch.top_ps)
    if batch.use_min_p:
        p_max = probs.amax(dim=-1, keepdim=True)  # [B, 1]; top token survives every filter
        drop |= probs < batch.min_ps[:, None] * p_max
    return drop


def _top_k_top_p_mask(probs: Tensor, top_ks: Tensor, top_ps: Tensor) -> Tensor:
    """[B, V] bool drop mask. Top-p sees the distribution renormalised after top-k.

    In sorted order (rank r, descending probability), a token is dropped when
    ``r >= top_k`` or when the renormalised mass *before* it already exceeds top_p,
    so rank 0 is always kept.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    ranks = torch.arange(probs.shape[1], device=probs.device)  # [V]
    drop_sorted = ranks[None, :] >= top_ks[:, None]  # [B, V]
    sorted_probs = sorted_probs.masked_fill(drop_sorted, 0.0)
    mass_before = (sorted_probs.cumsum(dim=-1) - sorted_probs) / sorted_probs.sum(-1, keepdim=True)
    drop_sorted |= mass_before > top_ps[:, None]
    return torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)  # back to vocab order


def _exponential_noise(
    batch: SamplingBatch, vocab: int, generator: torch.Generator | None
) -> Tensor:
    """[B, V] f32 of Exp(1) noise on sampled rows (1.0 on greedy rows), clamped above 0."""
    q = torch.ones(batch.size, vocab, device=batch.device)
    if batch.unseeded_rows.numel():
        draw_device = generator.device if generator is not None else batch.device
        draw = torch.empty(batch.unseeded_rows.numel(), vocab, device=draw_device)
        q[batch.unseeded_rows] = draw.exponential_(generator=generator).to(batch.device)
    if batch.seeded_rows:
        rows = to_device(torch.tensor(batch.seeded_rows), batch.device)
        keys = to_device(torch.tensor([_as_int64(k) for k in batch.seed_keys], dtype=torch.int64), batch.device)
        q[rows] = _seeded_noise(keys, vocab)
    return q.clamp_min_(torch.finfo(torch.float32).tiny)  # q = 0 would give p / 0


def _seeded_noise(keys: Tensor, vocab: int) -> Tensor:
    """[Ns, V] f32 Exp(1) noise, on ``keys``' device, a function of (key, vocab) alone.

    Counter-based: the uniform of (key, i) is the top 24 bits of splitmix64's finaliser
    (Steele et al. 2014) of ``key + (i + 1) * golden gamma`` in wrapping int64 arithmetic
    (logical right shifts by masking), so every row is one vectorised expression on the
    device, with no host generator and no loop over rows.
    """
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)  # [V]
    x = keys[:, None] + counters[None, :] * _GAMMA  # [Ns, V], wraps mod 2^64
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    uniform = _shr(x, 40).to(torch.float32) * 2.0**-24  # [0, 1), exact
    return -torch.log1p(-uniform)  # inverse CDF of Exp(1); finite since uniform < 1


def _shr(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _as_int64(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA, _MIX1, _MIX2 = (_as_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _mix_seed(seed: int, step: int) -> int:
    """A well-spread 64-bit generator seed for (seed, step): splitmix64 applied twice."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def has_penalties(p: Any) -> bool:
    """True if sampling parameters ``p`` (a SamplingInfo or the request's SamplingParams)
    carry a repetition, frequency or presence penalty: the row needs its tokens every step."""
    return _rep_wanted(p) or _freq_pres_wanted(p)


def _rep_wanted(p: SamplingInfo) -> bool:
    return p.repetition_penalty != 1.0


def _freq_pres_wanted(p: SamplingInfo) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _banned_wanted(p: SamplingInfo) -> bool:
    return bool(p.banned_ids)


def _banned_ids(p: SamplingInfo) -> list[int]:
    return list(p.banned_ids)


def _seen_ids(p: SamplingInfo) -> list[int]:
    return [*p.prompt_ids, *p.output_ids]


def _output_ids(p: SamplingInfo) -> list[int]:
    return list(p.output_ids)


def _flatten_ids(
    params: Sequence[SamplingInfo],
    wanted: Callable[[SamplingInfo], bool],
    ids_of: Callable[[SamplingInfo], list[int]],
    device: torch.device,
) -> tuple[Tensor, Tensor, int]:
    """(rows, ids, max id or -1): every id of ``ids_of(p)`` for wanted rows, [N] int64 each."""
    per_row = [(row, ids_of(p)) for row, p in enumerate(params) if wanted(p)]
    if not per_row:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, -1
    flat = chain.from_iterable(row_ids for _, row_ids in per_row)
    ids = torch.tensor(list(flat), dtype=torch.int64)  # [N]
    rows = torch.tensor([row for row, _ in per_row], dtype=torch.int64)
    lengths = torch.tensor([len(row_ids) for _, row_ids in per_row], dtype=torch.int64)
    rows = rows.repeat_interleave(lengths)
    max_id = int(ids.max()) if ids.numel() else -1  # host side: sample() need not sync
    return to_device(rows, device), to_device(ids, device), max_id
