"""Piecewise CUDA graphs for the steps the decode graphs do not take: prefill chunks and
mixed batches of decodes and prefill chunks, up to ``max_tokens`` tokens (vLLM's piecewise
CUDA graphs, SGLang's ``--enable-piecewise-cuda-graph``).

Why: such a step runs the model eagerly, ~11 launches per layer from Python: a mixed step of
the 8B shape spent 18-30 ms of host time launching on the H100 host, 6-11 ms with these
graphs (BENCHMARKS.md "Piecewise CUDA graphs"). A step of a few hundred tokens needs less of
the device, so it waits for the host, and a server that paces prefill into its decode steps
(``--max-prefill-tokens`` below the running batch), or simply admits requests while others
decode, pays that at every such step. The attention of a mixed step depends on every
request's lengths (its grid, split count and page tables) and stays eager; everything
between two attentions is one graph, captured once per token bucket.

Dimension letters: L layers, T the step's tokens, Tg its bucket (the smallest captured size
>= T), E hidden size, H / K query / kv heads, D head dim.

    static inputs  [3, Tmax] int64: input ids, positions, KV slots (rows T..Tg-1: 0)
    static buffers qkv [Tmax, (H + 2K) * D], residual [Tmax, E], o [Tmax, H * D],
                   hidden [Tmax, E] (the model dtype)
    piece 0 (graph):    x = embed(ids); qkv, residual = layer 0's RMSNorm + QKV projection;
                        RoPE on q, k at the positions; K / V stored at the slots
    attention i (eager): o[:T] = layer i's attention over q, k, v [:T] (K / V already stored;
                        the backend's ``static_layers``: the Triton backend records layer
                        0's kernel launches and replays them for the others, pools swapped)
    piece i, 1..L-1:    layer i-1's output projection of o, its RMSNorm + MLP; layer i's
                        RMSNorm + QKV, RoPE, K / V stored (as piece 0)
    piece L:            layer L-1's output projection and MLP; hidden = final RMSNorm

So a step launches L + 1 graphs and L attentions (2-4 replayed kernels each) instead of ~11 L
kernels. Padding rows T..Tg-1 feed token 0 at position 0 and store their K / V into slot 0
of the dummy page 0 (never handed out); the attention reads rows :T only, and every op in
the pieces works row by row, so padding changes no real row (their ``o`` rows hold stale,
finite values). All buckets share one memory pool, captured largest first.

Takes a step when the model runs its fused kernels (the Triton backend) on CUDA, the KV pool
holds float pages in the model's dtype with no attention sink or key rotation (the pieces
store K / V themselves, as the batch-1 QKV epilogue does), and T <= ``max_tokens``; other
steps (FP8 / INT4 pools among them) stay eager.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.memory.kv_pool import KVPool

__all__ = ["PiecewiseGraphs", "piecewise_sizes", "pool_fits"]

logger = logging.getLogger("radixlm.cuda_graph")


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Captured token buckets for ``max_tokens``: every 16 up to 256, every 64 up to 512,
    every 128 up to 1024, every 256 beyond, and ``max_tokens`` itself (padding at most 15
    tokens below 256, a fifth of the step above); [] for 0.

    Raises ValueError if ``max_tokens`` is negative or between 1 and 15.
    """
    if max_tokens < 0 or 0 < max_tokens < 16:
        raise ValueError(f"max_tokens must be 0 or >= 16, got {max_tokens}")
    sizes = [*range(16, 257, 16), *range(320, 513, 64), *range(640, 1025, 128), *range(1280, max_tokens, 256)]
    return [*(s for s in sizes if s < max_tokens), max_tokens] if max_tokens else []


def pool_fits(pool: KVPool, dtype: torch.dtype) -> bool:
    """Whether the pieces may store K / V into ``pool`` (float pages of ``dtype``, no sink or
    key rotation)."""
    return (not pool.quantised and not pool.tiered and not pool.has_sink and pool.qk_rotation is None
            and pool.dtype == dtype)


class PiecewiseGraphs:
    """The pieces of ``model`` (a fused ``models.CausalLM``) over ``pool``, captured for
    every bucket of ``piecewise_sizes(max_tokens)``.

    Args:
        model: a model on CUDA whose ``model.model.fused`` is True (the Triton backend).
        pool: the KV pool the pieces write (``pool_fits``).
        max_tokens: the largest step taken (>= 16).
        capture: False leaves the graphs out and runs each piece eagerly in ``forward``
            (the CPU tests of the decomposition, under the Triton interpreter).

    Raises ValueError if the model is not fused or the pool does not fit.
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, max_tokens: int, capture: bool = True) -> None:
        inner = model.model
        if not inner.fused:
            raise ValueError("piecewise CUDA graphs need the fused kernels (the Triton attention backend)")
        if not pool_fits(pool, inner.embed_tokens.weight.dtype):
            raise ValueError("piecewise CUDA graphs need a float KV pool in the model dtype, no sink or rotation")
        self.model, self.pool = model, pool
        self.layers, self.num_layers = inner.layers, len(inner.layers)
        self.sizes = piecewise_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        cfg, dtype, device = model.config, inner.embed_tokens.weight.dtype, pool.device
        attn = self.layers[0].self_attn
        n = self.max_tokens
        self.inputs = torch.zeros((3, n), dtype=torch.int64, device=device)  # ids, positions, slots
        self.qkv = torch.zeros((n, sum(attn.split_sizes)), dtype=dtype, device=device)
        self.residual = torch.zeros((n, cfg.hidden_size), dtype=dtype, device=device)
        self.o = torch.zeros((n, attn.num_heads * attn.head_dim), dtype=dtype, device=device)
        self.hidden = torch.zeros((n, cfg.hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_seconds = self._capture_all() if capture else 0.0

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest captured size >= ``num_tokens`` (None past the largest)."""
        i = bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """``model.forward(batch, pool)`` through the pieces: hidden states [N, E] of
        ``batch.logits_rows`` (all T rows when ``batch.logits_all``), a view of the static
        buffer valid until the next call.

        Raises ValueError if the batch has more tokens than the largest bucket or carries
        exact-sink slots.
        """
        t = batch.num_tokens
        tg = self.bucket(t)
        if tg is None or batch.sink_slots is not None:
            raise ValueError(f"a step of {t} tokens (sink slots: {batch.sink_slots is not None}) "
                             f"is not taken by the piecewise graphs (up to {self.max_tokens} tokens, no sink)")
        inputs = self.inputs
        inputs[:, t:tg] = 0
        inputs[0, :t] = batch.input_ids
        inputs[1, :t] = batch.positions
        inputs[2, :t] = batch.out_slots
        self.model.attn_backend.prepare(batch, self.pool)
        graphs = self.graphs.get(tg)
        attn = self.layers[0].self_attn
        q, k, v = attn.heads(self.qkv[:t])  # views of the static buffers: the same every layer
        attend = attn.attn_backend.static_layers(q, k, v, self.o[:t].view(q.shape), batch, self.pool)
        for i in range(self.num_layers):  # piece i stores layer i's K / V, then its attention reads them
            self.pool.await_loads(i)  # layer i's pages of a host-tier load in flight
            self._run(i, tg, graphs)
            attend(i)
        self._run(self.num_layers, tg, graphs)
        hidden = self.hidden[:t]
        return hidden if batch.logits_all else hidden[batch.logits_rows]

    def _run(self, piece: int, tg: int, graphs: list[torch.cuda.CUDAGraph] | None) -> None:
        if graphs is None:  # not captured (CPU): the piece itself
            self._piece(piece, tg)
        else:
            graphs[piece].replay()

    def _piece(self, piece: int, tg: int) -> None:
        """Piece ``piece`` (module docstring) over the first ``tg`` rows of the buffers."""
        inner, pool = self.model.model, self.pool
        if piece == 0:
            x, residual = inner.embed_tokens(self.inputs[0, :tg]), None
        else:
            x, residual = self.layers[piece - 1].after_attention(self.o[:tg], self.residual[:tg])
        if piece == self.num_layers:
            norm = inner.norm
            self.hidden[:tg] = _fused_add_rmsnorm(x, residual, norm.weight, norm.eps)
            return
        layer = self.layers[piece]
        qkv, residual = layer.qkv_fused(x, residual)
        q, k, v = layer.self_attn.heads(qkv)
        layer.self_attn.qk_norm_(q, k)
        layer.self_attn.rope_(q, k, self.inputs[1, :tg], pool)
        _store_kv(pool.k[piece], pool.v[piece], k, v, self.inputs[2, :tg])
        self.qkv[:tg] = qkv
        self.residual[:tg] = residual

    @torch.inference_mode()
    def _capture_all(self) -> float:
        start = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.pool.device)
        for tg in reversed(self.sizes):  # largest first: smaller ones reuse its memory
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels, settle allocator and cuBLAS workspaces
                    for piece in range(self.num_layers + 1):
                        self._piece(piece, tg)
            torch.cuda.current_stream().wait_stream(stream)
            graphs = []
            for piece in range(self.num_layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool, stream=stream):
                    self._piece(piece, tg)
                graphs.append(graph)
            self.graphs[tg] = graphs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        seconds = time.perf_counter() - start
        logger.info("captured %d piecewise CUDA graphs (%d pieces x token buckets %s) in %.1f s",
                    sum(map(len, self.graphs.values())), self.num_layers + 1, self.sizes, seconds)
        return seconds


def _fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from radixlm.kernels.fused_ops import fused_add_rmsnorm

    return fused_add_rmsnorm(x, residual, weight, eps)[0]


def _store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slots: torch.Tensor) -> None:
    from radixlm.kernels.store_kv import store_kv

    store_kv(k_pool, v_pool, k, v, slots)
