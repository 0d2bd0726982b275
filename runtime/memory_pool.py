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
                         per layer and kv head (calibrated at start-up, or from a file):
                         stored = clamp(x / scale, +-448) in e4m3, read = stored * scale
"""

from __future__ import annotations

import torch

__all__ = ["KV_CACHE_DTYPES", "KVPool", "PageAllocator", "kv_bytes_per_token", "kv_storage_dtype"]

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8_e4m3")
_FLOAT_KV = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PageAllocator:
    """Hands out page ids 1..num_pages-1 (page 0 is the dummy page).

    Contract: ``alloc(n)`` returns exactly ``n`` distinct ids or ``None`` (nothing taken)
    when fewer than ``n`` are free; ``free(ids)`` gives ids back and raises ValueError on
    a double free (an id already free or repeated in ``ids``) or an id out of range, and
    then frees nothing. Not thread-safe (the scheduler owns it).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("a pool needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        # Pop from the end: low ids first, so tests see predictable ids.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = bytearray(num_pages)
        for p in self._free:
            self._is_free[p] = 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Allocatable pages (excludes the dummy page)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        ids = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        for p in ids:
            self._is_free[p] = 0
        return ids[::-1]

    def free(self, ids: list[int]) -> None:
        # Check every id before changing anything: a refused call frees nothing (marking
        # the ids before the bad one free in the bitmap only leaked them for good).
        seen: set[int] = set()
        for p in ids:
            if not 0 < p < self.num_pages:
                raise ValueError(f"page id {p} out of range")
            if self._is_free[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in ids:
            self._is_free[p] = 1
        self._free.extend(reversed(ids))

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def free_pages(self) -> set[int]:
        return set(self._free)

    def check_invariants(self) -> None:
        """Free list has no duplicates, never holds page 0, matches the free bitmap."""
        free = self._free
        assert len(set(free)) == len(free), "duplicate page in free list"
        assert 0 not in free, "dummy page 0 in free list"
        assert sum(self._is_free) == len(free), "free bitmap out of sync with free list"


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Element dtype of the K/V pages for ``--kv-cache-dtype`` (auto: the model dtype).

    Raises ValueError for a name not in ``KV_CACHE_DTYPES``."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in _FLOAT_KV:
        return _FLOAT_KV[kv_cache_dtype]
    if kv_cache_dtype == "fp8_e4m3":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}; choices: {', '.join(KV_CACHE_DTYPES)}")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes across all layers: 2 x L x K x D x elem size
    (page data only; per-layer FP8 scales are counted in ``KVPool.metadata_bytes``)."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Per-layer K and V page pools, shape ``[P, S, K, D]`` each.

    ``k[layer]`` and ``v[layer]`` are plain tensors; attention backends write into and
    read from them through page tables. Page 0 is zero-filled padding; other pages hold garbage until written.

    ``dtype`` is the model dtype; ``kv_cache_dtype`` picks the page format (module doc).
    An FP8 pool needs ``k_scales``/``v_scales`` [L, K] float32, finite and > 0 (from
    ``radixlm.runtime.kv_calibration``); ``k_scale[layer]``/``v_scale[layer]`` are then the
    [K] rows on the pool's device (None for float pools). Raises ValueError on missing or
    unusable scales.
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
        self.k_scale: list[torch.Tensor | None] = [None] * num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * num_layers
        if self.quantised:
            for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
                _check_scales(name, scales, num_layers, num_kv_heads)
            assert k_scales is not None and v_scales is not None
            self.k_scale = list(k_scales.to(self.device, torch.float32).unbind(0))
            self.v_scale = list(v_scales.to(self.device, torch.float32).unbind(0))
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [self._new(shape) for _ in range(num_layers)]
        self.v = [self._new(shape) for _ in range(num_layers)]

    def _new(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Uninitialised pages (on the CPU untouched memory costs no RAM until a page is
        first written); the dummy page 0 is zeroed so padded reads are finite."""
        t = torch.empty(shape, dtype=self.dtype, device=self.device)
        t[0].zero_()
        return t

    @property
    def bytes_per_token(self) -> int:
        """Page bytes per token (K and V, all layers), metadata excluded."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def metadata_bytes(self) -> int:
        """Bytes of scales beside the pages (FP8: 2 x L x K float32)."""
        return 2 * self.num_layers * self.num_kv_heads * 4 if self.quantised else 0

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """Copy ``pages`` of every layer to host memory (pinned on CUDA, so the copy is
        asynchronous on the current stream) -> ``[layers, 2, n, S, K, D]`` in the pool
        dtype; [:, 0] is K, [:, 1] is V. Used to swap a preempted request out."""
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
        ``pages``. Raises ValueError on a shape or dtype mismatch."""
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

    @property
    def total_bytes(self) -> int:
        """Pages (the dummy page included) plus metadata."""
        return self.bytes_per_token * self.num_pages * self.page_size + self.metadata_bytes


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of an FP8 tensor (same shape, uint8); float tensors unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _check_scales(name: str, scales: torch.Tensor | None, num_layers: int, num_kv_heads: int) -> None:
    """ValueError unless ``scales`` is a finite, positive [L, K] tensor."""
    if scales is None:
        raise ValueError(f"an fp8_e4m3 KV pool needs {name} (per-layer, per-kv-head); none given")
    if tuple(scales.shape) != (num_layers, num_kv_heads):
        raise ValueError(f"{name} shape {tuple(scales.shape)} != (layers, kv heads) = {(num_layers, num_kv_heads)}")
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise ValueError(f"{name} must be finite and > 0")
