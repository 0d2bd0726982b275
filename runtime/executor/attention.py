"""Attention backends: how one layer stores new K/V into the paged pool and attends.

The model is generic over the backend: every attention layer calls
``backend.forward(q, k, v, layer_id, batch, pool)``. Backends are registered by name in
``ATTENTION_BACKENDS``; its keys (plus "auto") are the CLI choices of
``--attention-backend``.

Dimension letters: T new tokens in the pass, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.kernels import reference
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.memory.kv_pool import KVPool

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "LayerAttention",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "attention_backend_choices",
    "create_attention_backend",
]


# Fewest leading decode rows for which a mixed pass launched from Python splits its attention
# (``_split_mixed``): the second launch costs ~0.1-0.15 ms of host time per layer, which a few
# decode rows do not repay (8B on an H100, 2026-12-05: ~250 decode rows gained ~12 ms a step,
# <50 lost ~2; 4a7db11:BENCHMARKS.md). A pass whose launches are replayed
# (``static_layers``) splits from one (BENCHMARKS.md "Piecewise CUDA graphs").
MIXED_SPLIT_MIN_DECODES = 64
# Cascade decode (``TritonAttentionBackend._cascade``): used when it saves at least this many
# key reads per kv head and layer (sum over chunks of (members - 1) x shared keys). Below
# it the prefix kernel's launch and the merge of one more slot cost about what they save.
CASCADE_MIN_SAVED_KEYS = 16384
# ... and only over prefixes of at least this many keys: one layer of 32 x 4 requests sharing
# 512 keys took as long either way, 128 x 2 sharing 1024 keys 1.08x less with it, 64 x 11
# sharing 2048 2.2x less (8B heads on an H100, bench/kernels/bench_cascade.py).
CASCADE_MIN_SHARED_KEYS = 1024


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One layer's attention settings, set by the model family at construction
    (``AttentionBackend.set_layer``).

    ``scale``: softmax scale (None: ``D ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
    ``softcap``: attention-logit soft-capping ``cap * tanh(s / cap)`` (Gemma 2) or None.
    ``window``: sliding window W, a query at position p sees keys p - W + 1 .. p (Mistral,
    Gemma 2/3 local layers, Phi-3), or None (full causal attention).
    """

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None


_PLAIN = LayerAttention()


class AttentionBackend(ABC):
    """Paged attention for one forward pass, called once per layer.

    Contract of ``forward``:
      * write ``k``/``v`` of the new tokens into ``pool.k[layer_id]`` / ``pool.v[layer_id]``
        at ``batch.out_slots`` (flat slot = page * S + offset);
      * return, for every new token, causal attention over its request's whole sequence
        (cached prefix pages + the new tokens up to itself), softmax scale ``D ** -0.5``,
        GQA head mapping ``h -> h // (H // K)``;
      * inputs may be strided views (last dim contiguous); output is [T, H, D], q's dtype,
        written into ``out`` when given (contiguous rows, last dim contiguous) and returned;
      * FP8-slot pools with channel means store centred K/V (``KVPool`` doc) and add
        ``v_mean`` back to the output (``KVPool.add_v_mean``);
      * pools with an exact attention sink: write ``batch.sink_rows`` into their slots
        (``KVPool.write_sink``) after the pages, and read position 0 of request b from
        slot ``batch.sink_slots[b]`` where it is >= 0 (``_sink``).

    ``prepare(batch, pool)`` is called once per forward pass before layer 0, so a backend
    can build per-batch metadata (split sizes, CUDA-graph buffers) once, not per layer.

    Layers with ``LayerAttention`` settings (``set_layer``) use their scale, soft-capping and
    sliding window instead of the plain causal ``D ** -0.5`` attention above.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.layers: dict[int, LayerAttention] = {}  # layer id -> settings (absent: plain)

    def set_layer(self, layer_id: int, settings: LayerAttention) -> None:
        """Use ``settings`` for layer ``layer_id`` (the model calls it for every layer at
        construction)."""
        self.layers[layer_id] = settings

    def layer(self, layer_id: int) -> LayerAttention:
        """The settings of layer ``layer_id`` (plain attention unless ``set_layer`` said otherwise)."""
        return self.layers.get(layer_id, _PLAIN)

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer attends alike (one recorded launch can serve them all)."""
        return len(set(self.layers.values())) <= 1

    @property
    def needs_reference(self) -> bool:
        """Whether some layer may need the reference path on the Triton backend (soft-capping,
        or a sliding window: the Triton kernels implement neither yet)."""
        return any(s.softcap is not None or s.window is not None for s in self.layers.values())

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:  # noqa: B027 - optional hook
        """Per-pass setup hook; the default does nothing."""

    def cascade_worth(self, page_tables: list[list[int]], pool: KVPool) -> bool:
        """Whether a decode step over these requests' page tables may take cascade decode
        (the model runner then runs it eagerly rather than from a decode graph). Default: no."""
        return False

    def static_layers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      batch: ForwardBatch, pool: KVPool) -> Callable[[int], None]:
        """Every layer's attention of one pass (after ``prepare``) whose queries and outputs
        live in static buffers (the piecewise CUDA graphs): returns ``attend(layer_id)``,
        which writes layer ``layer_id``'s attention of ``q`` [T, H, D] (holding that layer's
        queries; its K / V, ``k`` / ``v`` [T, K, D], already stored in the pool) into ``out``
        [T, H, D]. Call it for layers 0, 1, ... in order. The default calls ``forward``."""

        def attend(layer_id: int) -> None:
            self.forward(q, k, v, layer_id, batch, pool, kv_stored=True, out=out)

        return attend

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        pool: KVPool,
        kv_stored: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, K, D] -> attention output [T, H, D]. Writes k / v into the
        pool at ``batch.out_slots`` first, unless ``kv_stored`` (the caller did; float pools
        without an attention sink only)."""


class TorchAttentionBackend(AttentionBackend):
    """Reference backend in plain PyTorch (``radixlm.kernels.reference``); runs anywhere.

    Tiered pools (int4 / mixed): new tokens go to their pages' FP8 slots; every layer then
    dequantises the pages the batch's page table names (``KVPool.dequantize_pages``) into a
    compact float32 pool and attends over that with the page table renumbered (``prepare``).
    """

    def __init__(self, device: torch.device | str) -> None:
        super().__init__(device)
        self._pages: torch.Tensor | None = None  # tiered: unique pages of the batch [U]
        self._table: torch.Tensor | None = None  # page table renumbered into them [B, Pmax]

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        if not pool.tiered:
            return
        pages, inverse = torch.unique(batch.page_table.long(), return_inverse=True)
        self._pages, self._table = pages, inverse.to(torch.int32)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        pool: KVPool,
        kv_stored: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_pool, v_pool = pool.k[layer_id], pool.v[layer_id]
        k_scale, v_scale = pool.k_scale[layer_id], pool.v_scale[layer_id]
        means = pool.k_mean[layer_id], pool.v_mean[layer_id]
        page_table = batch.page_table
        if pool.tiered:
            slots = pool.fp8_slots_of(batch.out_slots)
            reference.store_kv(k_pool, v_pool, k, v, slots, k_scale, v_scale, *means)
            assert self._pages is not None and self._table is not None, "prepare() not called"
            k_pool, v_pool = pool.dequantize_pages(layer_id, self._pages)  # [U, S, K, D] float32
            page_table, k_scale, v_scale = self._table, None, None
        elif not kv_stored:
            reference.store_kv(k_pool, v_pool, k, v, batch.out_slots, k_scale, v_scale, *means)
        sink = _sink(k, v, layer_id, batch, pool)
        result = _reference_attention(q, k_pool, v_pool, page_table, k_scale, v_scale, sink, batch,
                                      self.layer(layer_id))  # fmt: skip
        result = pool.add_v_mean(result, layer_id)
        return result if out is None else out.copy_(result)


def _reference_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                         k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, sink: reference.Sink | None,
                         batch: ForwardBatch, settings: LayerAttention) -> torch.Tensor:  # fmt: skip
    """``kernels.reference`` paged attention of q [T, H, D] over one layer's pools -> [T, H, D]
    (decode rows batched, extends per request) with the layer's scale, soft-cap and window."""
    scale = settings.scale or q.shape[-1] ** -0.5
    extra = {"softcap": settings.softcap, "window": settings.window}
    if batch.is_decode:
        seq_lens = [p + 1 for p in batch.prefix_lens_cpu]
        return reference.paged_decode_attention(q, k_pool, v_pool, page_table, seq_lens, scale, k_scale, v_scale,
                                                sink, **extra)  # fmt: skip
    return reference.paged_attention(q, k_pool, v_pool, page_table, batch.prefix_lens_cpu, batch.extend_lens_cpu,
                                     scale=scale, k_scale=k_scale, v_scale=v_scale, sink=sink, **extra)


class TritonAttentionBackend(AttentionBackend):
    """Triton paged kernels (``radixlm.kernels.{store_kv,decode_attention,extend_attention}``).

    Layers with soft-capping, and sliding-window layers in a pass whose longest sequence
    exceeds the window, attend through ``kernels.reference`` after the Triton K/V store (the
    kernels have neither feature yet): correct, slow, and not CUDA-graph safe (the model
    runner captures no graphs for such models, ``needs_reference``).

    Per layer: store_kv, then the split-KV decode kernel for a pure decode step or the
    extend kernel otherwise (a mixed step with many leading decodes: both, ``_split_mixed``).
    Decode rows whose page tables share long prefixes (requests that matched the same cached
    prefix) take cascade decode (``_cascade``): each chunk of up to 16 of them reads the
    shared pages once. The split count comes from the batch's host-side lengths once
    per pass (no device sync): decode's in ``prepare``, the extend's (``extend_num_splits``:
    short extends over a long cached prefix take the split-KV extend path) in the first
    layer, which knows the query heads; that layer allocates the scratch, the others reuse it. Runs on CUDA; on CPU only under
    ``TRITON_INTERPRET=1``.
    """

    def __init__(self, device: torch.device | str) -> None:
        super().__init__(device)
        if not _triton_available():
            raise ImportError("the triton attention backend needs the 'triton' package")
        from radixlm.kernels import decode_attention as decode
        from radixlm.kernels import extend_attention as extend
        from radixlm.kernels.store_kv import store_kv

        self._decode, self._extend_mod, self._store_kv = decode, extend, store_kv
        self._num_splits: int | None = 1
        self._max_seq = 0
        self._workspace: Any = None
        self._mixed: _MixedSplit | None = None  # a mixed pass's two launches (prepare)
        self._shared: Any = None  # this pass's cascade decode plan (first layer), or False: none
        # Cascade decode for decode rows whose pages share prefixes (``_cascade``);
        # ``--disable-cascade-attention`` turns it off.
        self.enable_cascade = True

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        self._workspace = None
        self._mixed = None
        self._shared = None
        max_seq = max(
            p + e for p, e in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True)
        )
        self._max_seq = max_seq
        self._num_splits = None  # extend: set by the first layer (it knows the query heads)
        if batch.is_decode:
            config = self._decode.default_decode_config(pool.dtype, pool.tiered, batch.batch_size)  # the kernel's
            self._num_splits = self._decode.decode_num_splits(
                batch.batch_size, pool.num_kv_heads, max_seq, self.device, config
            )
        else:
            self._mixed = self._split_mixed(batch, pool)

    def static_layers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      batch: ForwardBatch, pool: KVPool) -> Callable[[int], None]:
        """As the base class, launched once: layer 0 runs ``forward`` while its kernel
        launches are recorded (``radixlm.kernels.launch``), later layers replay them with
        their own K / V pools swapped in (the query / output buffers, grid, split counts and
        the batch's tensors are the pass's). That skips Triton's Python launch path and the
        wrappers' checks for 2-4 kernels a layer: a paced mixed step of the 8B shape launched
        ~1.4-1.8x faster (H100 hosts, 2026-12-06; BENCHMARKS.md "Piecewise CUDA graphs"). Float
        pools without an attention sink only (a scale, channel mean or sink differs per layer);
        others take the base class's ``forward`` per layer."""
        if pool.quantised or pool.tiered or pool.has_sink or not self.uniform_layers or self.needs_reference:
            return super().static_layers(q, k, v, out, batch, pool)
        from radixlm.kernels.launch import record

        if self._mixed is None and not batch.is_decode:  # a replayed split costs microseconds
            self._mixed = self._split_mixed(batch, pool, min_decodes=1)

        launches: list = []
        slots: list = []
        stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else None

        def attend(layer_id: int) -> None:
            pools = (pool.k[layer_id], pool.v[layer_id])
            if not launches:
                with record() as recorded:
                    self.forward(q, k, v, layer_id, batch, pool, kv_stored=True, out=out)
                launches.extend(recorded)
                slots.extend(r.positions(pools) for r in recorded)
                return
            for r, where in zip(launches, slots, strict=True):
                r.replay(where, pools, stream)

        return attend

    def _split_mixed(self, batch: ForwardBatch, pool: KVPool, min_decodes: int | None = None) -> _MixedSplit | None:
        """A mixed pass whose first d requests decode one token each (the planner schedules
        running requests first) and whose others extend: their attention as two launches,
        the decode kernel over the d rows and the extend kernel over the rest. The extend
        kernel's programs are per query head and BLOCK_M rows, so a decode row there reads
        its keys once per head of its group and computes a mostly empty tile: a step of 200-299
        decodes and <= 384 prompt tokens took 35.8 ms, 23.8 ms with the decode rows split off
        (8B on an H100, 2026-12-05; 4a7db11:BENCHMARKS.md; the split as adopted:
        BENCHMARKS.md "Piecewise CUDA graphs"). None (the one extend launch) below ``min_decodes`` (default
        ``MIXED_SPLIT_MIN_DECODES``) leading decodes, and for FP8 / INT4 pools and pools with an
        attention sink (float pools only)."""
        lens = batch.extend_lens_cpu
        d = 0
        while d < len(lens) and lens[d] == 1:
            d += 1
        least = MIXED_SPLIT_MIN_DECODES if min_decodes is None else min_decodes
        if d < least or pool.quantised or pool.tiered or pool.has_sink:
            return None
        dec_seq = max(batch.prefix_lens_cpu[:d]) + 1
        config = self._decode.default_decode_config(pool.dtype, False, d)
        splits = self._decode.decode_num_splits(d, pool.num_kv_heads, dec_seq, self.device, config)
        ext_seq = max(p + e for p, e in zip(batch.prefix_lens_cpu[d:], lens[d:], strict=True))
        return _MixedSplit(d, splits, batch.cu_extend[d:] - d, max(lens[d:]), ext_seq)

    def _scratch(self, rows: int, num_heads: int, head_dim: int, slots: int | None = None) -> Any:
        """The [rows, H, slots, D] split scratch of this pass (slots: N by default; None
        when 1)."""
        slots = slots or self._num_splits
        shape = (rows, num_heads, slots)
        work = self._workspace
        if slots > 1 and (work is None or tuple(work.partial_lse.shape) != shape):
            self._workspace = self._decode.DecodeWorkspace.allocate(  # [rows, H, slots, D] scratch
                rows, num_heads, slots, head_dim, self.device
            )
        return self._workspace

    def cascade_worth(self, page_tables: list[list[int]], pool: KVPool) -> bool:
        """An upper bound on what cascade decode saves over prefixes of at least
        ``CASCADE_MIN_SHARED_KEYS`` (``decode_attention.shared_prefix_bound``, ~0.3 us a
        request) reaches ``CASCADE_MIN_SAVED_KEYS``, on a pool it serves."""
        if not self.enable_cascade or pool.quantised or pool.tiered or pool.has_sink or len(page_tables) < 2:
            return False
        return (self._decode.shared_prefix_bound(page_tables, pool.page_size, _cascade_min_pages(pool))
                >= CASCADE_MIN_SAVED_KEYS)

    def _cascade(self, batch: ForwardBatch, pool: KVPool, rows: int, num_heads: int) -> Any:
        """The cascade decode plan of decode rows 0..rows-1 of this pass
        (``decode_attention.plan_shared_prefixes``, on the device, with the prefix kernel's
        split count), or None: disabled, a quantised / tiered / sink pool, no host page
        table, or fewer than ``CASCADE_MIN_SAVED_KEYS`` key reads saved. Planned once per
        pass, by the first layer (it knows the query heads)."""
        if self._shared is None:
            self._shared = False
            if (self.enable_cascade and rows >= 2 and batch.page_table_host is not None and not pool.quantised
                    and not pool.tiered and not pool.has_sink):
                seq = [p + 1 for p in batch.prefix_lens_cpu[:rows]]
                plan = self._decode.plan_shared_prefixes(batch.page_table_host[:rows], seq, pool.page_size,
                                                         num_heads // pool.num_kv_heads,
                                                         _cascade_min_pages(pool))  # fmt: skip
                if plan is not None and plan.saved_keys >= CASCADE_MIN_SAVED_KEYS:
                    longest = int(plan.chunk_keys.max())
                    splits = self._decode.decode_num_splits(plan.chunk_rows.shape[0], pool.num_kv_heads, longest,
                                                            self.device, self._decode.PREFIX_CONFIG)  # fmt: skip
                    self._shared = plan.to(self.device, splits)
        return self._shared or None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        pool: KVPool,
        kv_stored: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_pool, v_pool = pool.k[layer_id], pool.v[layer_id]
        k_scale, v_scale = pool.k_scale[layer_id], pool.v_scale[layer_id]
        slots, tiered = batch.out_slots, None
        if pool.tiered:  # new tokens go to FP8 slots; the kernels also read INT4 pages
            slots = pool.fp8_slots_of(batch.out_slots)
            tiered = self._decode.TieredPages(
                pool.fp8_slot, pool.k_codes[layer_id], pool.k_stat[layer_id],
                pool.v_codes[layer_id], pool.v_stat[layer_id],
            )  # fmt: skip
        if not kv_stored:
            self._store_kv(k_pool, v_pool, k, v, slots, k_scale, v_scale,
                           pool.k_mean[layer_id], pool.v_mean[layer_id])  # fmt: skip
        sink = _sink(k, v, layer_id, batch, pool)
        settings = self.layer(layer_id)
        if settings.softcap is not None or (settings.window is not None and self._max_seq > settings.window):
            if tiered is not None:
                raise NotImplementedError("soft-capping / sliding windows with int4 or mixed KV pages")
            result = _reference_attention(q, k_pool, v_pool, batch.page_table, k_scale, v_scale, sink, batch, settings)
            result = pool.add_v_mean(result, layer_id)
            return result if out is None else out.copy_(result)
        if not pool.quantised:
            q = q.to(k_pool.dtype)
        scale = settings.scale or q.shape[-1] ** -0.5
        if self._mixed is not None:
            return self._forward_mixed(q, k_pool, v_pool, batch, pool, scale, out)
        if self._num_splits is None:
            self._num_splits = self._extend_mod.extend_num_splits(
                batch.batch_size, q.shape[1], pool.num_kv_heads, max(batch.extend_lens_cpu),
                self._max_seq, self.device,
            )  # fmt: skip
        shared = self._cascade(batch, pool, batch.batch_size, q.shape[1]) if batch.is_decode else None
        work = self._scratch(q.shape[0], q.shape[1], q.shape[2],
                             None if shared is None else self._num_splits + shared.num_splits)
        if not batch.is_decode:  # channel means: decode adds v_mean in its epilogue
            out = self._extend_mod.extend_attention(
                q, k_pool, v_pool, batch.page_table, batch.cu_extend, batch.prefix_lens,
                scale, max_extend_len=max(batch.extend_lens_cpu), k_scale=k_scale, v_scale=v_scale,
                num_splits=self._num_splits, workspace=work, tiered=tiered, sink=sink, out=out,
            )  # fmt: skip
            return pool.add_v_mean(out, layer_id)
        return self._decode.decode_attention(
            q, k_pool, v_pool, batch.page_table, batch.seq_lens, scale,
            num_splits=self._num_splits, workspace=work, k_scale=k_scale, v_scale=v_scale,
            tiered=tiered, v_mean=pool.v_mean[layer_id], sink=sink, out=out, shared=shared,
        )  # fmt: skip

    def _forward_mixed(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch,
                       pool: KVPool, scale: float, out: torch.Tensor | None) -> torch.Tensor:
        """``forward``'s attention for a ``_split_mixed`` pass: the decode rows :d, then the
        extend rows, into one [T, H, D] output (``out`` when given)."""
        mixed = self._mixed
        d, (rows, heads, head_dim) = mixed.decode_rows, q.shape
        if mixed.ext_splits is None:  # first layer: it knows the query heads
            mixed.ext_splits = self._extend_mod.extend_num_splits(
                batch.batch_size - d, heads, pool.num_kv_heads, mixed.max_extend, mixed.ext_seq, self.device)
            shared = self._cascade(batch, pool, d, heads)
            dec_slots = mixed.dec_splits + (0 if shared is None else shared.num_splits)
            if dec_slots > 1:
                mixed.dec_work = self._decode.DecodeWorkspace.allocate(d, heads, dec_slots, head_dim,
                                                                       self.device)  # fmt: skip
            if mixed.ext_splits > 1:
                mixed.ext_work = self._decode.DecodeWorkspace.allocate(rows - d, heads, mixed.ext_splits, head_dim,
                                                                       self.device)  # fmt: skip
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q is a view of the QKV rows
        self._decode.decode_attention(
            q[:d], k_pool, v_pool, batch.page_table[:d], batch.seq_lens[:d], scale, num_splits=mixed.dec_splits,
            out=out[:d], workspace=mixed.dec_work, shared=self._shared or None)  # fmt: skip
        self._extend_mod.extend_attention(
            q[d:], k_pool, v_pool, batch.page_table[d:], mixed.cu_extend, batch.prefix_lens[d:], scale,
            max_extend_len=mixed.max_extend, out=out[d:], num_splits=mixed.ext_splits, workspace=mixed.ext_work)
        return out


@dataclass(slots=True)
class _MixedSplit:
    """A mixed pass's two attention launches (``TritonAttentionBackend._split_mixed``)."""

    decode_rows: int  # d: requests (and rows) 0..d-1 decode one token each
    dec_splits: int  # the decode kernel's split count for them
    cu_extend: torch.Tensor  # [B - d + 1] int32, the extend requests' cumulative lengths from 0
    max_extend: int
    ext_seq: int  # longest extend request's sequence (host)
    ext_splits: int | None = None  # set by the first layer
    dec_work: Any = None
    ext_work: Any = None


def _cascade_min_pages(pool: KVPool) -> int:
    """``CASCADE_MIN_SHARED_KEYS`` in whole pages of ``pool``."""
    return -(-CASCADE_MIN_SHARED_KEYS // pool.page_size)


def _sink(k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch, pool: KVPool
          ) -> reference.Sink | None:
    """The exact attention sink of this layer (None when the pool keeps none or the batch
    carries no slots), after writing the pass's position-0 K/V (k/v [T, K, D]) into the
    slots it claimed."""
    if not pool.has_sink or batch.sink_slots is None:
        return None
    if batch.sink_rows is not None:
        pool.write_sink(layer_id, k, v, batch.sink_rows, batch.sink_write_slots)
    return reference.Sink(pool.sink_k[layer_id], pool.sink_v[layer_id], batch.sink_slots)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,
}


def attention_backend_choices() -> tuple[str, ...]:
    """Names accepted by ``create_attention_backend`` (for CLI ``choices``)."""
    return ("auto", *ATTENTION_BACKENDS)


def _auto_backend(device: torch.device) -> str:
    """The backend "auto" resolves to: triton on CUDA when triton imports, else torch."""
    if device.type == "cuda" and _triton_available():
        return "triton"
    return "torch"


def create_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Instantiate the backend registered as ``name`` ("auto" picks one for ``device``).

    Raises ValueError for an unknown name, listing the choices.
    """
    device = torch.device(device)
    if name == "auto":
        name = _auto_backend(device)
    if name not in ATTENTION_BACKENDS:
        choices = ", ".join(attention_backend_choices())
        raise ValueError(f"unknown attention backend {name!r}; choices: {choices}")
    return ATTENTION_BACKENDS[name](device)
