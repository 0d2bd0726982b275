"""Paged KV memory: the page allocator and the per-layer K/V page pools.

Dimension letters: P pages, S page size (tokens per page), K kv heads, D head dim,
L layers.

    KV pool, one layer:   k[P, S, K, D]   v[P, S, K, D]
    logical position t of a request  ->  page_table[t // S], slot t % S

    request tokens:  |<------------- seq_len ------------->|
    pages:           [ page a ][ page b ][ page c ][ pg d..  ]   (any page ids, any order)

Page 0 is reserved as a dummy (padding for batched page tables; never handed out), so a
pool of ``num_pages`` pages can store ``(num_pages - 1) * page_size`` tokens.
Memory per token = 2 (K and V) x L x K x D x bytes per element.

KV cache dtypes (``--kv-cache-dtype``, ``KV_CACHE_DTYPES``):

    auto / bf16 / fp16   k[P, S, K, D] in that float dtype (auto: the model dtype)
    fp8_e4m3             k[P, S, K, D] float8_e4m3fn + k_scale[layer] [K] float32, static
                         per layer and kv head, and k_mean[layer] [K, D] float32 channel
                         means (calibrated at start-up, or from a file):
                         stored = clamp((x - mean) / scale, +-448) in e4m3, read =
                         stored * scale; attention over centred keys equals attention over
                         the keys (softmax shift), over centred values it is the output
                         minus v_mean (``add_v_mean`` puts it back). v[P, S, K, D] is
                         stored channel-major ([P, K, D, S] in memory, zero-filled;
                         ``reference.channel_major_pool``: the kernels' P @ V operand
                         loads as contiguous bytes) when the page size is a power of two
    int4 / mixed         tiered: every logical page owns an INT4 page (KIVI: keys per channel
                         within the page, values per token in groups of G along D, asymmetric,
                         fp16 scale + zero-point, two codes per byte)
                             k_codes[P, S, K, D/2] uint8   k_stat[P, 2, K, D] fp16
                             v_codes[P, S, K, D/2] uint8   v_stat[P, S, K, 2, D/G] fp16
                         and pages not demoted yet live in FP8 slots (same format as fp8_e4m3)
                             k[F, S, K, D] float8_e4m3fn (slot 0 a zeroed dummy)
                         reached through fp8_slot[P] int32 (-1 = the page is INT4). New
                         tokens are written in FP8; ``end_pass`` demotes full pages to INT4:
                         int4 every full page, mixed all but the sequence's first page
                         (attention sink) and its last ``window_pages`` full pages.
                         See docs/KV_CACHE.md "Quantised KV cache".

Exact attention sink (fp8_e4m3 pools, ``sink_slots`` C > 0): position 0's K/V is kept
unquantised beside the pages, one slot per distinct first token id (at position 0 a token
attends only to itself, so its K/V depends on the token id alone):

    sink_k[L, C, K, D]  sink_v[L, C, K, D] float32 = (x - mean) / scale (the pages' units,
                        not rounded to e4m3); host map first token id -> slot

A slot is claimed by the first pass that computes position 0 with that token and written
by that pass's layers (``write_sink``, after store_kv); it is never evicted, so every
request starting with that token, cached prefix or not, reads the same values. When all C
slots are taken, later first tokens read their FP8 page as before. The kernels start the
online softmax of the split holding key 0 from the slot and mask key 0 in the tiles.
Source: KVQuant (Hooper et al., 2024) and IntactKV (Liu et al., 2024) keep the first
tokens' K/V in full precision.

Key rotation (quantised pools, ``k_rotation="hadamard"``, what calibration picks when D is
a power of two): after RoPE the model multiplies every key by R and every query by R / D
(``rotate_qk``), R = diag(signs) H_D the +-1 randomized Hadamard matrix
(``key_rotation``; R R^T = D I), so q . k is unchanged while each stored key channel
becomes a +-1 mix of all D channels. RoPE leaves a few channels of a head far larger than
the rest, and a float format's rounding error is relative to the element, so the score
error sum_i q_i k_i e_i is dominated by those channels; rotated, the energy is spread
evenly. Pages, channel means, scales and sink slots are all in the rotated space; values
are not rotated (their error averages out over the softmax weights; measured: no gain).
Entries +-1 and 1/D (D a power of two) are exact in bf16, so the product is orthogonal up
to the rounding of q R / D and k R themselves. Source: QuaRot (Ashkboos et al., 2024)
rotates keys after RoPE with an online Hadamard transform.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from radixlm.kernels import reference
from radixlm.runtime.memory.kv_formats import (
    INT4_VALUE_GROUP,
    KV_CACHE_DTYPES,
    KV_ROTATIONS,
    TIERED_KV,
)
from radixlm.runtime.memory.page_allocator import PageAllocator

__all__ = [
    "KVPool",
    "PassWrite",
    "kv_bytes_per_token",
    "kv_page_bytes",
    "key_rotation",
    "kv_storage_dtype",
    "tiered_fp8_pages",
]

PassWrite = tuple[Sequence[int], int, int]  # (page table row, first position, tokens) of one request
_FLOAT_KV = {"bf16": torch.bfloat16, "fp16": torch.float16}


def key_rotation(head_dim: int) -> torch.Tensor | None:
    """R [D, D] float32 with entries +-1: ``diag(signs) @ H_D``, H_D Sylvester's Hadamard
    matrix and signs[i] fixed by ``random.Random(0)`` (the same matrix on every machine and
    Python version), so ``R @ R.T == D * I``. None when ``head_dim`` is not a power of two
    (Sylvester's construction needs one). Source: QuaRot (Ashkboos et al., 2024)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    rng = random.Random(0)
    signs = torch.tensor([1.0 if rng.random() < 0.5 else -1.0 for _ in range(head_dim)])
    return signs[:, None] * h


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Element dtype of the K/V pages for ``--kv-cache-dtype`` (auto: the model dtype).

    Raises ValueError for a name not in ``KV_CACHE_DTYPES``."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in _FLOAT_KV:
        return _FLOAT_KV[kv_cache_dtype]
    if kv_cache_dtype == "fp8_e4m3" or kv_cache_dtype in TIERED_KV:
        return torch.float8_e4m3fn  # tiered pools: the element dtype of their FP8 slots
    raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}; choices: {', '.join(KV_CACHE_DTYPES)}")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes across all layers: 2 x L x K x D x elem size
    (page data only; per-layer FP8 scales are counted in ``KVPool.metadata_bytes``)."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def value_group(head_dim: int) -> int:
    """INT4 value group size G along D: ``min(INT4_VALUE_GROUP, D)``."""
    return min(INT4_VALUE_GROUP, head_dim)


def kv_page_bytes(
    kv_cache_dtype: str, model_dtype: torch.dtype, num_layers: int, num_kv_heads: int,
    head_dim: int, page_size: int,
) -> int:
    """Bytes one logical page takes across all layers, K and V, per-page metadata included.

    Float / FP8: S x ``kv_bytes_per_token``. int4 / mixed (the INT4 page every logical page
    owns): codes S x D / 2 for K and for V, key statistics 2 x D fp16 (scale and zero per
    channel), value statistics S x 2 x D/G fp16, per layer and kv head. The FP8 slots of
    tiered pools are extra (``tiered_fp8_pages``)."""
    if kv_cache_dtype not in TIERED_KV:
        dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
        return page_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    codes = 2 * page_size * head_dim // 2
    stats = 2 * head_dim * 2 + page_size * 2 * (head_dim // value_group(head_dim)) * 2
    return num_layers * num_kv_heads * (codes + stats)


def tiered_fp8_pages(
    kv_cache_dtype: str, window_pages: int, max_running_requests: int, max_prefill_tokens: int,
    page_size: int, context_length: int | None = None,
) -> int:
    """FP8 slots (dummy slot 0 included) a tiered pool needs so that slots never run out in
    normal operation: per running request the pages it keeps in FP8 (mixed: sink + window,
    at most the pages of ``context_length`` tokens: a longer window keeps nothing more)
    plus its page being filled and a page-boundary crossing, plus the pages one step's
    prefill tokens can fill. When they do run out, ``KVPool.begin_pass`` demotes the least
    recently written full FP8 pages early."""
    keep = window_pages + 1 if kv_cache_dtype == "mixed" else 0
    if context_length is not None:
        keep = min(keep, -(-context_length // page_size))
    return 1 + max_running_requests * (keep + 2) + -(-max_prefill_tokens // page_size)


class KVPool:
    """Per-layer K and V page pools, shape ``[P, S, K, D]`` each.

    ``k[layer]`` and ``v[layer]`` are plain tensors; attention backends write into and
    read from them through page tables. Page 0 is zero-filled padding; other pages hold garbage until written.

    ``dtype`` is the model dtype; ``kv_cache_dtype`` picks the page format (module doc).
    An FP8 pool needs ``k_scales``/``v_scales`` [L, K] float32, finite and > 0 (from
    ``radixlm.runtime.executor.kv_calibration``); ``k_scale[layer]``/``v_scale[layer]`` are then the
    [K] rows on the pool's device (None for float pools). ``k_means``/``v_means`` [L, K, D]
    float32 (optional, both or neither) are the channel means stored values are centred
    on; ``k_mean[layer]``/``v_mean[layer]`` the [K, D] rows (None without).
    ``k_rotation`` ("hadamard" or None; D a power of two) is the key rotation the scales
    and means were calibrated in: the model then rotates q and k after RoPE (module doc;
    calibration gives it to quantised pools, a float pool may take it too: exact, and
    of use only to tests). Raises ValueError on missing or unusable scales, means or
    rotation.

    Tiered pools (``int4``, ``mixed``; module doc) take the same FP8 scales for their FP8
    slots, ``num_fp8_pages`` F slots (default ``num_pages``: every page may stay FP8) and,
    for mixed, ``window_pages`` (full pages per sequence kept FP8 after the sink). ``k``/``v``
    are then the [F, S, K, D] FP8 slots; callers bracket every forward pass with
    ``begin_pass`` (gives the pages about to be written an FP8 slot) and ``end_pass``
    (demotes). ``attach_allocator`` lets the pool take back slots of freed pages.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        k_means: torch.Tensor | None = None,
        v_means: torch.Tensor | None = None,
        k_rotation: str | None = None,
        num_fp8_pages: int | None = None,
        window_pages: int = 2,
        sink_slots: int = 0,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.model_dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = kv_storage_dtype(kv_cache_dtype, dtype)  # element dtype of the pages
        self.device = torch.device(device)
        self.quantised = self.dtype == torch.float8_e4m3fn
        self.tiered = kv_cache_dtype in TIERED_KV
        self.k_scale: list[torch.Tensor | None] = [None] * num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * num_layers
        if self.quantised:
            for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
                _check_scales(name, scales, num_layers, num_kv_heads)
            assert k_scales is not None and v_scales is not None
            self.k_scale = list(k_scales.to(self.device, torch.float32).unbind(0))
            self.v_scale = list(v_scales.to(self.device, torch.float32).unbind(0))
        self.k_mean: list[torch.Tensor | None] = [None] * num_layers
        self.v_mean: list[torch.Tensor | None] = [None] * num_layers
        if k_means is not None or v_means is not None:
            _check_means(k_means, v_means, self.quantised, (num_layers, num_kv_heads, head_dim))
            self.k_mean = [m.contiguous() for m in k_means.to(self.device, torch.float32).unbind(0)]
            self.v_mean = [m.contiguous() for m in v_means.to(self.device, torch.float32).unbind(0)]
        self.k_rotation = k_rotation
        # (R / D for q, R for k), each [D, D] contiguous in the model dtype (rotate_qk; the
        # fused RoPE kernel takes them), or None.
        self.qk_rotation: tuple[torch.Tensor, torch.Tensor] | None = None
        if k_rotation is not None:
            rotation = key_rotation(head_dim)
            if k_rotation not in KV_ROTATIONS or rotation is None:
                raise ValueError(
                    f"k_rotation {k_rotation!r}: pools take one of {KV_ROTATIONS} with a "
                    f"power-of-two head dim (this pool: head dim {head_dim})"
                )
            rotation = rotation.to(self.device, dtype)
            self.qk_rotation = (rotation / head_dim, rotation)  # 1 / D is exact for a power of two
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        if self.tiered:
            self._init_tiered(min(num_fp8_pages or num_pages, num_pages), window_pages)
            shape = (self.num_fp8_pages, page_size, num_kv_heads, head_dim)
        self.k = [self._new(shape) for _ in range(num_layers)]
        if self.quantised and not self.tiered and page_size >= 2 and page_size & (page_size - 1) == 0:
            self.v = [reference.channel_major_pool(shape, self.device) for _ in range(num_layers)]
        else:
            self.v = [self._new(shape) for _ in range(num_layers)]
        # Exact attention sink (module doc): FP8 pools only (tiered pools keep the sink page FP8).
        if sink_slots < 0:
            raise ValueError(f"sink_slots must be >= 0, got {sink_slots}")
        self.sink_slots = sink_slots if self.quantised and not self.tiered else 0
        sink_shape = (num_layers, self.sink_slots, num_kv_heads, head_dim)
        self.sink_k = torch.zeros(sink_shape, dtype=torch.float32, device=self.device)
        self.sink_v = torch.zeros(sink_shape, dtype=torch.float32, device=self.device)
        self._sink_of: dict[int, int] = {}  # first token id -> slot
        self._sink_free = list(range(self.sink_slots - 1, -1, -1))  # unclaimed slots, lowest last
        self._loads: Sequence[torch.cuda.Event] | None = None  # a layer-wise load in flight (expect_loads)

    @property
    def has_sink(self) -> bool:
        """Whether this pool keeps position 0's K/V exact (an FP8 pool with sink slots)."""
        return self.sink_slots > 0

    def sink_slot(self, token: int, computes_position_0: bool) -> tuple[int, bool]:
        """(slot, write) for a request whose token at position 0 is ``token``: the slot its
        attention reads position 0 from (-1: its FP8 page), and whether this pass must write
        it (``write_sink``). A pass that computes position 0 claims a free slot for a new
        token; one that does not only finds an existing slot."""
        slot = self._sink_of.get(token)
        if slot is not None:
            return slot, False
        if not computes_position_0 or self.sink_full:
            return -1, False
        slot = self._sink_of[token] = self._sink_free.pop()
        return slot, True

    def unclaim_sinks(self, tokens: Sequence[int]) -> None:
        """Give back the slots a pass claimed for these first tokens (the pass failed before
        writing them), so no request reads a slot that was never written."""
        for token in tokens:
            slot = self._sink_of.pop(token, None)
            if slot is not None:
                self._sink_free.append(slot)

    def sink_lookup(self, token: int) -> int:
        """The sink slot of first token ``token`` (-1: none yet); claims nothing."""
        return self._sink_of.get(token, -1)

    @property
    def sink_tokens(self) -> int:
        """Sink slots claimed so far (distinct first tokens)."""
        return len(self._sink_of)

    @property
    def sink_full(self) -> bool:
        """Whether every sink slot is claimed (new first tokens read their FP8 page)."""
        return not self._sink_free

    def write_sink(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                   slots: torch.Tensor) -> None:
        """Write position 0's exact K/V into sink slots: ``k``/``v`` [T, K, D] the pass's
        new K/V of ``layer``, ``rows`` [W] int64 the rows at position 0, ``slots`` [W] int64
        their slots; stored as (x - mean) / scale in float32."""
        scale_k, scale_v = self.k_scale[layer], self.v_scale[layer]
        assert scale_k is not None and scale_v is not None, "write_sink needs an FP8 pool"
        for store, x, scale, mean in ((self.sink_k, k, scale_k, self.k_mean[layer]),
                                      (self.sink_v, v, scale_v, self.v_mean[layer])):
            x = x[rows].float()
            if mean is not None:
                x = x - mean
            store[layer].index_copy_(0, slots, x / scale[:, None])

    def _init_tiered(self, num_fp8_pages: int, window_pages: int) -> None:
        if num_fp8_pages < 2:
            raise ValueError("a tiered KV pool needs at least 2 FP8 pages (slot 0 is reserved)")
        if window_pages < 0:
            raise ValueError("--kv-mixed-window-pages must be >= 0")
        if self.head_dim % 2 or self.head_dim % value_group(self.head_dim):
            raise ValueError(f"INT4 KV needs an even head dim divisible by {value_group(self.head_dim)}")
        p, s, k, d = self.num_pages, self.page_size, self.num_kv_heads, self.head_dim
        self.num_fp8_pages = num_fp8_pages
        self.value_group = value_group(d)
        self.window_pages = window_pages if self.kv_cache_dtype == "mixed" else 0
        self.keep_sink = self.kv_cache_dtype == "mixed"

        def new(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            out = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
            for t in out:
                t[0].zero_()
            return out

        self.k_codes = new((p, s, k, d // 2), torch.uint8)
        self.v_codes = new((p, s, k, d // 2), torch.uint8)
        self.k_stat = new((p, 2, k, d), torch.float16)
        self.v_stat = new((p, s, k, 2, d // self.value_group), torch.float16)
        # Logical page -> FP8 slot (-1: INT4). The dummy page 0 reads the zeroed slot 0.
        self.fp8_slot = torch.full((p,), -1, dtype=torch.int32, device=self.device)
        self.fp8_slot[0] = 0
        self._slot_of: dict[int, int] = {}  # host mirror of fp8_slot >= 0, dummy excluded
        self._free_slots = list(range(num_fp8_pages - 1, 0, -1))
        self._fill = [0] * p  # tokens written in the page by its current owner
        self._stamp = [0] * p  # pass counter of the page's last write
        self._is_sink = bytearray(p)  # last written as the first page of its sequence
        self._clock = 0
        self._page_is_free: Callable[[int], bool] | None = None
        self.num_demoted = 0  # pages demoted so far (for tests and metrics)

    def _new(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Uninitialised pages (on the CPU untouched memory costs no RAM until a page is
        first written); the dummy page 0 is zeroed so padded reads are finite."""
        t = torch.empty(shape, dtype=self.dtype, device=self.device)
        t[0].zero_()
        return t

    @property
    def bytes_per_token(self) -> int:
        """Page bytes per token (K and V, all layers); metadata excluded for float / FP8,
        for int4 / mixed the INT4 page with its statistics (rounded up), FP8 slots excluded."""
        if self.tiered:
            page = kv_page_bytes(self.kv_cache_dtype, self.model_dtype, self.num_layers,
                                 self.num_kv_heads, self.head_dim, self.page_size)  # fmt: skip
            return -(-page // self.page_size)
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def metadata_bytes(self) -> int:
        """Bytes of scales beside the pages (FP8: 2 x L x K float32, 2 x L x K x D float32
        of channel means when centred, 2 x L x C x K x D float32 of sink slots, 2 x D x D of key
        rotation in the model dtype; tiered: those plus the fp8_slot map, 4 bytes per page;
        INT4 statistics are in ``bytes_per_token``)."""
        scales = 2 * self.num_layers * self.num_kv_heads * 4 if self.quantised else 0
        if self.k_mean[0] is not None:
            scales += 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
        scales += 2 * self.sink_k.numel() * 4
        if self.qk_rotation is not None:
            scales += sum(r.numel() * r.element_size() for r in self.qk_rotation)
        return scales + (4 * self.num_pages if self.tiered else 0)

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, K, D] after RoPE -> (q @ R / D, k @ R), new tensors in their
        dtype, for a pool with a key rotation (module doc; scores are unchanged); the
        inputs themselves otherwise."""
        if self.qk_rotation is None:
            return q, k
        return q @ self.qk_rotation[0], k @ self.qk_rotation[1]

    def add_v_mean(self, out: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention over centred values -> attention over the values, in place: ``out``
        [T, H, D] += v_mean[layer] of each head's kv head (h -> h // (H // K)); the
        attention weights of a query sum to one. A no-op for uncentred pools."""
        mean = self.v_mean[layer]
        if mean is not None:
            t, h, d = out.shape
            out.view(t, self.num_kv_heads, h // self.num_kv_heads, d).add_(mean[:, None, :])
        return out

    @property
    def fp8_slot_bytes(self) -> int:
        """Bytes of the FP8 slots of a tiered pool (0 otherwise)."""
        if not self.tiered:
            return 0
        return self.num_fp8_pages * self.page_size * kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, torch.float8_e4m3fn)

    # ------------------------------------------------------------ tiered pools
    def attach_allocator(self, allocator: PageAllocator) -> None:
        """Let ``begin_pass`` take back the FP8 slots of pages the allocator has freed."""
        self._page_is_free = allocator.is_free

    @property
    def num_fp8_pages_used(self) -> int:
        return len(self._slot_of) if self.tiered else 0

    def begin_pass(self, writes: Sequence[PassWrite]) -> None:
        """Give every page this pass writes an FP8 slot (tiered pools; a no-op otherwise).

        ``writes``: per request (page table row, first position written, tokens written).
        A page written here is fresh or the sequence's partly filled last page, so it either
        has a slot already or gets one. When free slots run out, slots of pages the
        allocator has freed are taken back, then the least recently written full FP8 pages
        (sinks last) are demoted early. Raises RuntimeError if this pass alone writes more
        pages than there are slots."""
        if not self.tiered:
            return
        size, need, busy = self.page_size, [], set()
        clock = self._clock = self._clock + 1
        for pages, start, count in writes:
            if count <= 0:
                continue
            for i in range(start // size, (start + count - 1) // size + 1):
                page = pages[i]
                busy.add(page)
                self._fill[page] = min(size, start + count - i * size)
                self._stamp[page] = clock
                self._is_sink[page] = i == 0
                if page not in self._slot_of:
                    need.append(page)
        if not need:
            return
        if len(need) > len(self._free_slots):
            self._make_room(len(need) - len(self._free_slots), busy)
        slots = [self._free_slots.pop() for _ in need]
        self._slot_of.update(zip(need, slots, strict=True))
        self._set_slots(need, slots)

    def end_pass(self, writes: Sequence[PassWrite], scan_all: Sequence[bool] | None = None) -> None:
        """Demote to INT4 the full FP8 pages of the pass's requests that are outside what
        the policy keeps (int4: nothing; mixed: the first page and the last
        ``window_pages`` full pages of the sequence). A no-op for other pools.

        ``scan_all[i]``: look at every page of write i's sequence (a request's first pass:
        FP8 pages of a radix-cached prefix another request left behind), else only at the
        pages near the window's edge (decode steps; O(1) per request). Default: writes of
        more than one token scan all."""
        if not self.tiered:
            return
        size, window, demote = self.page_size, self.window_pages, {}  # ordered set
        if scan_all is None:
            scan_all = [count > 1 for _, _, count in writes]
        for (pages, start, count), scan in zip(writes, scan_all, strict=True):
            end = start + count
            full = end // size
            first = 1 if self.keep_sink else 0
            if not scan:
                first = max(first, start // size - window - 1)
            for i in range(first, full - window):
                page = pages[i]
                if page in self._slot_of and self._fill[page] == size:
                    demote[page] = None
        if demote:
            self._demote(list(demote))

    def assign_fp8_slots(self, pages: Sequence[int]) -> None:
        """Give full logical ``pages`` an FP8 slot (tiered pools; a no-op otherwise), for a
        caller about to write their FP8 K/V itself (``HostKVPool.load``): pages that have a
        slot keep it; each page is marked full, just written and not a sink, as
        ``begin_pass`` would. The slot content is left as it is until the caller writes it.
        When free slots run out, slots are taken back as in ``begin_pass`` (this may enqueue
        demotions on the current stream). Raises RuntimeError if there are fewer slots than
        ``pages``."""
        if not self.tiered:
            return
        clock = self._clock = self._clock + 1
        need = []
        for page in dict.fromkeys(pages):
            self._fill[page] = self.page_size
            self._stamp[page] = clock
            self._is_sink[page] = False
            if page not in self._slot_of:
                need.append(page)
        if not need:
            return
        if len(need) > len(self._free_slots):
            self._make_room(len(need) - len(self._free_slots), set(pages))
        slots = [self._free_slots.pop() for _ in need]
        self._slot_of.update(zip(need, slots, strict=True))
        self._set_slots(need, slots)

    def release_fp8_slots(self, pages: Sequence[int]) -> None:
        """Free the FP8 slots of logical ``pages`` without demoting them (their FP8 content
        is dropped: for a caller about to write their INT4 pages itself); pages then read
        as INT4 (``fp8_slot`` -1). Pages without a slot are skipped; a no-op for pools that
        are not tiered."""
        if not self.tiered:
            return
        owned = [p for p in dict.fromkeys(pages) if p in self._slot_of]
        if owned:
            self._free_slots.extend(self._slot_of.pop(p) for p in owned)
            self._set_slots(owned, [-1] * len(owned))

    def check_invariants(self) -> None:
        """Tiered pools: every FP8 slot but the dummy is either free or owned by exactly one
        page, and the device ``fp8_slot`` map equals the host's (reads the device map:
        debug only). AssertionError otherwise; a no-op for other pools."""
        if not self.tiered:
            return
        owned = list(self._slot_of.values())
        assert len(set(owned)) == len(owned), "an FP8 slot owned by two pages"
        assert sorted(owned + self._free_slots) == list(range(1, self.num_fp8_pages)), "FP8 slots leaked"
        expected = [-1] * self.num_pages
        expected[0] = 0
        for page, slot in self._slot_of.items():
            expected[page] = slot
        assert self.fp8_slot.tolist() == expected, "device fp8_slot map out of sync with the host"

    def _make_room(self, n: int, busy: set[int]) -> None:
        freed = [p for p in self._slot_of if p not in busy and self._page_is_free and self._page_is_free(p)]
        for page in freed[:n]:
            self._free_slots.append(self._slot_of.pop(page))
        if freed[:n]:
            self._set_slots(freed[:n], [-1] * len(freed[:n]))
        n -= len(freed[:n])
        if n <= 0:
            return
        full = [p for p in self._slot_of if p not in busy and self._fill[p] == self.page_size]
        full.sort(key=lambda p: (self._is_sink[p], self._stamp[p]))
        if len(full) < n:
            raise RuntimeError(
                f"KV pool: {self.num_fp8_pages - 1} FP8 pages cannot hold one step's writes; "
                "raise the FP8 page count (lower --max-prefill-tokens or --max-running-requests)")
        self._demote(full[:n])

    def _set_slots(self, pages: list[int], slots: list[int]) -> None:
        index = torch.tensor(pages, dtype=torch.int64).to(self.device, non_blocking=True)
        values = torch.tensor(slots, dtype=torch.int32).to(self.device, non_blocking=True)
        self.fp8_slot.index_copy_(0, index, values)

    @torch.inference_mode()
    def _demote(self, pages: list[int]) -> None:
        """FP8 pages -> INT4, every layer (``reference.quantize_int4_pages`` of the
        dequantised FP8 bytes: a pure function of the page's content), then free the slots.
        On CUDA one Triton launch per layer (``kernels.demote_int4``, same result)."""
        slots = [self._slot_of.pop(p) for p in pages]
        index = torch.tensor(pages, dtype=torch.int64).to(self.device, non_blocking=True)
        sindex = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        for layer in range(self.num_layers if self.device.type == "cuda" else 0):
            from radixlm.kernels.demote_int4 import demote_pages  # one Triton launch per layer

            demote_pages(index, sindex, self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer],
                         self.k_codes[layer], self.k_stat[layer], self.v_codes[layer], self.v_stat[layer])
        for layer in range(self.num_layers if self.device.type != "cuda" else 0):
            k8 = _raw(self.k[layer]).index_select(0, sindex).view(torch.float8_e4m3fn)
            v8 = _raw(self.v[layer]).index_select(0, sindex).view(torch.float8_e4m3fn)
            k = reference.dequantize_fp8(k8, self.k_scale[layer])
            v = reference.dequantize_fp8(v8, self.v_scale[layer])
            k_codes, k_stat, v_codes, v_stat = reference.quantize_int4_pages(k, v, self.value_group)
            self.k_codes[layer].index_copy_(0, index, k_codes)
            self.k_stat[layer].index_copy_(0, index, k_stat)
            self.v_codes[layer].index_copy_(0, index, v_codes)
            self.v_stat[layer].index_copy_(0, index, v_stat)
        self.fp8_slot.index_fill_(0, index, -1)
        self._free_slots.extend(slots)
        self.num_demoted += len(pages)

    def dequantize_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiered pool: float32 (k, v) [n, S, K, D] of logical ``pages`` [n] of ``layer``
        (``reference.dequantize_tiered_pages``; the torch attention backend's read)."""
        return reference.dequantize_tiered_pages(
            pages, self.fp8_slot, self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer],
            self.k_codes[layer], self.k_stat[layer], self.v_codes[layer], self.v_stat[layer])  # fmt: skip

    def fp8_slots_of(self, out_slots: torch.Tensor) -> torch.Tensor:
        """Tiered pool: flat logical slot ids [T] int64 -> flat FP8 slot ids (where the
        new tokens are stored); every page written must have had ``begin_pass``."""
        size = self.page_size
        return self.fp8_slot[out_slots // size].long() * size + out_slots % size

    # ------------------------------------------------------- layer-wise loads
    def expect_loads(self, events: Sequence[torch.cuda.Event]) -> None:
        """A copy into some pages runs on another stream layer by layer (the host tier's
        ``--hicache-io-backend kernel``): layer l's pages are written once ``events[l]``
        (L events, recorded in layer order on one stream) has completed. The forward waits
        for each layer before the layer writes or reads its pages (``await_loads(layer)``),
        so layer l + 1 loads while layer l computes; other readers and writers of pages wait
        for the whole load. A new call replaces the events (a later load on the
        same stream completes after the earlier ones).
        Raises ValueError unless there is one event per layer."""
        if len(events) != self.num_layers:
            raise ValueError(f"{len(events)} load events for {self.num_layers} layers")
        self._loads = events

    @property
    def loads_pending(self) -> bool:
        """Whether a layer-wise load may still be in flight for the next forward (a step
        that replays a whole-model CUDA graph cannot wait layer by layer and skips it)."""
        return self._loads is not None

    def await_loads(self, layer: int | None = None) -> None:
        """Make the current stream wait for layer ``layer``'s pages of the load in flight
        (``expect_loads``), or for every layer (None: readers of pages other than the
        forward, e.g. a gather or a swap-out). A wait for every layer, or the forward's
        wait for its last layer, ends the load's pending state. A no-op when none is in
        flight (always on the CPU)."""
        events = self._loads
        if events is None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a CUDA graph capture while a layer-wise KV load is in flight")
        last = layer is None or layer == self.num_layers - 1
        torch.cuda.current_stream(self.device).wait_event(events[-1] if last else events[layer])
        if last:
            self._loads = None

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """Copy ``pages`` of every layer to host memory (pinned on CUDA, so the copy is
        asynchronous on the current stream) -> ``[layers, 2, n, S, K, D]`` in the pool
        dtype; [:, 0] is K, [:, 1] is V. Used to swap a preempted request out.
        Raises ValueError for int4 / mixed pools (swap is refused for them at start-up)."""
        self._check_swappable()
        self.await_loads()
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        shape = (self.num_layers, 2, len(pages), self.page_size, self.num_kv_heads, self.head_dim)
        host = torch.empty(shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        raw = _raw(host)  # FP8 pages move as their bytes (no index ops for float8 on CPU)
        for layer in range(self.num_layers):
            raw[layer, 0].copy_(_raw(self.k[layer]).index_select(0, index), non_blocking=True)
            raw[layer, 1].copy_(_raw(self.v[layer]).index_select(0, index), non_blocking=True)
        return host

    def write_pages(self, pages: list[int], host: torch.Tensor) -> None:
        """Inverse of ``read_pages``: ``host`` ``[layers, 2, len(pages), S, K, D]`` into
        ``pages``. Raises ValueError on a shape or dtype mismatch or an int4 / mixed pool."""
        self._check_swappable()
        self.await_loads()  # a layer-wise load into pages reused since must land first
        expected = (self.num_layers, 2, len(pages), self.page_size, self.num_kv_heads, self.head_dim)
        if tuple(host.shape) != expected:
            raise ValueError(f"host KV shape {tuple(host.shape)} != {expected}")
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        if host.dtype != self.dtype:
            raise ValueError(f"host KV dtype {host.dtype} != pool dtype {self.dtype}")
        raw = _raw(host)
        for layer in range(self.num_layers):
            _raw(self.k[layer]).index_copy_(0, index, raw[layer, 0].to(self.device, non_blocking=True))
            _raw(self.v[layer]).index_copy_(0, index, raw[layer, 1].to(self.device, non_blocking=True))

    def _check_swappable(self) -> None:
        if self.tiered:
            raise ValueError(f"KV swap is not supported for --kv-cache-dtype {self.kv_cache_dtype}")

    @property
    def total_bytes(self) -> int:
        """Pages (the dummy page included) plus metadata (and a tiered pool's FP8 slots)."""
        if self.tiered:
            page = kv_page_bytes(self.kv_cache_dtype, self.model_dtype, self.num_layers,
                                 self.num_kv_heads, self.head_dim, self.page_size)  # fmt: skip
            return page * self.num_pages + self.fp8_slot_bytes + self.metadata_bytes
        return self.bytes_per_token * self.num_pages * self.page_size + self.metadata_bytes


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of an FP8 tensor (same shape, uint8); float tensors unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _check_means(
    k_means: torch.Tensor | None, v_means: torch.Tensor | None, quantised: bool, shape: tuple[int, int, int]
) -> None:
    """ValueError unless both means are finite [L, K, D] tensors of an FP8-slot pool."""
    if not quantised:
        raise ValueError("KV channel means go with an fp8_e4m3 / int4 / mixed pool")
    for name, means in (("k_means", k_means), ("v_means", v_means)):
        if means is None:
            raise ValueError(f"KV channel means need both k_means and v_means; {name} is missing")
        if tuple(means.shape) != shape:
            raise ValueError(f"{name} shape {tuple(means.shape)} != (layers, kv heads, head dim) = {shape}")
        if not bool(torch.isfinite(means).all()):
            raise ValueError(f"{name} must be finite")


def _check_scales(name: str, scales: torch.Tensor | None, num_layers: int, num_kv_heads: int) -> None:
    """ValueError unless ``scales`` is a finite, positive [L, K] tensor."""
    if scales is None:
        raise ValueError(f"an fp8_e4m3 / int4 / mixed KV pool needs {name} (per-layer, per-kv-head); none given")
    if tuple(scales.shape) != (num_layers, num_kv_heads):
        raise ValueError(f"{name} shape {tuple(scales.shape)} != (layers, kv heads) = {(num_layers, num_kv_heads)}")
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise ValueError(f"{name} must be finite and > 0")
