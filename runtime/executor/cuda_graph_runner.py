"""CUDA graphs for decode steps: capture the model's forward once per batch-size bucket,
replay it with new inputs copied into static buffers.

Why: an eager decode step launches ~15 kernels per layer from Python (two of them Triton
launches at 20-40 us of host time each), so small batches are bound by the host, not the
GPU. A replayed graph launches the whole forward in one call (SGLang / vLLM do the same).

Dimension letters: Bg the bucket's batch size, B the real batch (B <= Bg), Pmax the page
table width (context length / page size), E hidden size.

    static inputs, one host-to-device copy per step (the first Bg columns used):
      inputs [9, Bmax] int64 = input_ids, positions, out_slots, src_rows, table_rows,
        sink slots (exact attention sink, -1 none), and up to Bmax page-table writes
        (row, column, page id; padding (0, 0, 0) rewrites the dummy row's dummy entry)
      req_pages [R, Pmax] int32: one page-table row per request, only changed ids written
    graph(Bg):  req_pages[write rows, write columns] = write page ids  (all Bmax columns)
                ids = where(input_ids >= 0, input_ids, prev_ids[src_rows])
                seq_lens = positions + 1;  page_table = req_pages[table_rows]
                model.forward(batch of ids over the first Bg rows) -> hidden [Bg, E]
                logits[:Bg] = model.compute_logits(hidden)  (LM head, float32 [Bg, V])

A decode step's page-table writes (a request that grew a page: one each) ride in the same
copy as the other inputs and are applied inside the graph, up to Bmax of them; a run of
writes that does not fit (a new or re-admitted request's whole row) is written first,
outside, all such runs in one index copy.

``prev_ids`` is the model runner's buffer of the previous step's sampled ids: an input of
-1 is a token the host does not know yet (overlap scheduling), read there on the device.
The graph ends by writing its rows' greedy ids (argmax of the logits, first index on ties,
as ``sampling._choose``) into ``prev_ids``: a greedy multi-step window feeds them to its
next step as they are (``ModelRunner._launch_window``); a step that samples otherwise
overwrites its rows with its sampled ids before the next launch reads them.

A step of B requests replays the smallest bucket Bg >= B. Rows B..Bg-1 are padding: they
feed token 0 at position 0, write their K/V into slot 0 of the dummy page 0 (never handed
out) and attend over that one slot, so they cost compute but touch no real page. Page
table entries past a row's ``seq_len`` are never read, so a row's stale tail (after a
request's pages were replaced by fewer) is harmless.

The decode kernel's split count is fixed at capture from the bound ``Pmax * page_size``
(``decode_num_splits``), so one graph serves every sequence length; short sequences leave
the splits past their length empty. The LM head is in the graph: outside, its GEMM and the
float32 cast took ~0.14 ms of host time per step on the H200 host (8B shape, 2026-12-05),
a sixth of the scheduler's. Every bucket writes the rows of one shared float32 buffer
``logits`` [Bmax, V] (one per bucket would cost the sum of the buckets' rows: 1.2 GB for
the 8B vocabulary at Bmax 256). Requires the Triton attention backend (the torch
reference backend loops over requests on the host) and a CUDA device; sampling runs after
the replay, outside the graph.

Extend graphs (``max_extend_tokens`` > 0): one request extending T new tokens, 2 <= T <=
the largest of ``graph_extend_sizes`` (a short prompt, or the uncached tail of a prompt
whose prefix is in the radix tree: the cached-prefix TTFT). An eager pass launches ~11
kernels per layer (~19 ms of host time for the 8B shape on the H200 host, whatever T is);
the replay is one launch. The T tokens are padded to the bucket Tg >= T with tokens that
come *after* them: the extend kernel's causal mask hides them from the real queries,
they sit at position 0 (in range of the rotary table), write their K/V to the dummy slot
0, and only the hidden state of the last real token (row T - 1) is returned::

    static inputs, flat int64 [4 * Tmax + Pmax], one host-to-device copy of its first
      4 * Tmax + P values (P: the request's pages): [4, Tmax] input_ids, positions,
      out_slots (first Tg columns), (prefix_len, T - 1, page-table row, sink slot); then
      the request's page ids [Pmax]
    graph(Tg): req_pages[row] = page ids;  page_table = req_pages[row]
               prefix_lens = prefix_len; seq_lens = prefix_len + Tg; cu_extend = [0, Tg]
               model.forward -> hidden [1, E] of row T - 1

The extend graph writes the request's whole page-table row itself. An extend is mostly a
new request (its row written from scratch: the cached prefix's pages and the new ones),
and outside the graph that write was an index copy of its own (two more host-to-device
copies and a kernel) before the replay, on the cached-prefix TTFT's path. Entries past
the P pages keep an earlier extend's ids (a stale tail). The extend kernel reads page ids
up to the padded end, prefix_len + Tg, which can pass the P pages: those keys are the
padding's own or hidden by the causal mask from every real row, and the ids are pool
pages (or 0), so nothing real reads them. An extend whose padded end would pass Pmax *
page_size (a prompt ending near the context length) runs eagerly (``fits_extend``).

Sized at capture from the bound (prefix ``Pmax * page_size - Tg``), the split-KV extend
kernel (``extend_num_splits``) always runs, its grid fixed; splits past a prefix's length
are empty. Not used for int4 / mixed pools yet (their extend kernel has not been run under
capture; decode graphs do serve them).
"""

from __future__ import annotations

import logging
import time
from array import array
from bisect import bisect_left
from collections.abc import Hashable

import numpy as np
import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, to_device
from radixlm.runtime.memory.kv_pool import KVPool

__all__ = ["INPUT_ROWS", "CudaGraphRunner", "PageTableRows", "graph_batch_sizes", "graph_extend_sizes"]

INPUT_ROWS = 9  # rows of a decode step's static inputs (module docstring)

logger = logging.getLogger("radixlm.cuda_graph")


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Captured buckets: 1, 2, 4, 8, then every 8 up to 64, then every 16, up to ``max_bs``
    (always included). Padding wastes at most 7 rows below 64 and 15 above.

    Raises ValueError if ``max_bs`` < 1.
    """
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_bs + 1, 16)]
    sizes = [s for s in sizes if s < max_bs]
    return [*sizes, max_bs]


def graph_extend_sizes(max_tokens: int) -> list[int]:
    """Captured extend lengths for ``max_tokens``: powers of two from 16 below it, and
    ``max_tokens`` itself; [] for 0 (no extend graphs). Padding is at most half a bucket.

    Raises ValueError if ``max_tokens`` is negative or 1.
    """
    if max_tokens < 0 or max_tokens == 1:
        raise ValueError(f"max_tokens must be 0 or >= 2, got {max_tokens}")
    if max_tokens == 0:
        return []
    sizes = [s for s in (16, 32, 64, 128, 256, 512) if s < max_tokens]
    return [*sizes, max_tokens]


class CudaGraphRunner:
    """Decode-step graphs of ``model`` over ``pool``, one per bucket of ``graph_batch_sizes``.

    Args:
        model: a model with ``forward(batch, pool) -> hidden [N, E]`` (radixlm.runtime.executor.models)
            whose attention backend is the Triton one.
        pool: the KV pool the graphs read and write (its tensors must outlive the graphs).
        max_bs: the largest bucket (requests per decode step).
        max_pages: page table width Pmax (pages of the longest possible sequence).
        prev_ids: [R] int64 device buffer the -1 inputs are read from (``src_rows`` index it).
        max_extend_tokens: the largest one-request extend replayed from a graph (0: none;
            ``graph_extend_sizes``).

    Raises RuntimeError if the device is not CUDA.
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, max_bs: int, max_pages: int,
                 prev_ids: torch.Tensor, max_extend_tokens: int = 0, max_window: int = 1) -> None:
        if pool.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        self._buffers(model, pool, max_bs, max_pages, prev_ids, max_extend_tokens, max_window)
        self.capture_seconds = self._capture_all()

    def _buffers(self, model: torch.nn.Module, pool: KVPool, max_bs: int, max_pages: int,
                 prev_ids: torch.Tensor, max_extend_tokens: int, max_window: int = 1) -> None:
        """Every static buffer, on the pool's device (host staging pinned on CUDA); no
        capture (bench/scheduler/profile_step.py's host-only runner and the CPU tests stop
        here)."""
        device = pool.device
        pin = device.type == "cuda"
        self.model, self.pool, self.page_size = model, pool, pool.page_size
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs, self.max_pages = self.batch_sizes[-1], max_pages
        n = self.max_bs
        # Host inputs of a step, one [9, Bmax] int64 copy: ids (-1: in flight), positions,
        # KV slots, rows of prev_ids for the -1 ids, rows of the device page table, exact
        # sink slots (-1 none; pools with sink slots), page-table writes (row, column, id).
        self.inputs = torch.zeros((INPUT_ROWS, n), dtype=torch.int64, device=device)
        (self.input_ids, self.positions, self.out_slots, self.src_rows, self.table_rows,
         self.sink_rows, self.write_rows, self.write_cols, self.write_pages) = self.inputs.unbind(0)
        self.prev_ids = prev_ids
        # Derived on the device inside the graph.
        self.resolved_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.page_table = torch.zeros((n, max_pages), dtype=torch.int32, device=device)
        self.sink_slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(n, dtype=torch.int64, device=device)
        # The decode graphs' LM head output, float32 [Bmax, V]: bucket Bg writes rows :Bg.
        self.logits = torch.zeros((n, model.config.vocab_size), dtype=torch.float32, device=device)
        self.cu_extend = torch.arange(n + 1, dtype=torch.int32, device=device)
        # Page tables live on the device, one row per request (row 0: all dummy page 0),
        # updated incrementally: a step copies only the page ids that changed.
        self.num_table_rows = 2 * n + 1
        self.req_pages = torch.zeros((self.num_table_rows, max_pages), dtype=torch.int32, device=device)
        self.tables = PageTableRows(self.num_table_rows)
        # Pinned staging in two sets used in turn: a replay's copy may still be pending when
        # the host stages the next one (overlap), never when it stages the one after.
        self._staging = [torch.zeros((INPUT_ROWS, n), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        # Multi-step windows: the inputs of steps 1 .. W - 1 [W - 1, 9, Bmax], staged with
        # step 0's (two pinned sets in turn, as above), copied into ``inputs`` step by step.
        self.max_window = max_window
        self.window_inputs = torch.zeros((max(max_window - 1, 0), INPUT_ROWS, n), dtype=torch.int64, device=device)
        self._window_staging = [torch.zeros((max(max_window - 1, 0), INPUT_ROWS, n), dtype=torch.int64,
                                            pin_memory=pin) for _ in range(2)]
        self._window = (1, 1, 0, 0)  # (next step, steps, bucket, B) of the last replay's window
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # One-request extends: flat [4 * Tmax + Pmax] inputs (see the module docstring),
        # derived buffers.
        self.extend_sizes = graph_extend_sizes(max_extend_tokens)
        t = max([*self.extend_sizes, 4])  # row 3 holds 4 values
        self.ext_flat = torch.zeros(4 * t + max_pages, dtype=torch.int64, device=device)
        self.ext_inputs, self.ext_pages = self.ext_flat[: 4 * t].view(4, t), self.ext_flat[4 * t :]
        self.ext_prefix = torch.zeros(1, dtype=torch.int32, device=device)
        self.ext_seq_len = torch.ones(1, dtype=torch.int32, device=device)
        self.ext_row = torch.zeros(1, dtype=torch.int64, device=device)
        self.ext_table = torch.zeros((1, max_pages), dtype=torch.int32, device=device)
        self.ext_sink = torch.full((1,), -1, dtype=torch.int32, device=device)
        self._ext_staging = [torch.zeros(4 * t + max_pages, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._ext_turn = 0
        self.ext_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.ext_outputs: dict[int, torch.Tensor] = {}

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A ForwardBatch view over the first ``bs`` static rows, with host lengths set to
        the bound so the attention backend sizes its split-KV launch for any length."""
        bound = self.max_pages * self.page_size
        return ForwardBatch(
            input_ids=self.resolved_ids[:bs], positions=self.positions[:bs],
            page_table=self.page_table[:bs], prefix_lens=self.seq_lens[:bs] - 1,
            extend_lens=torch.ones(bs, dtype=torch.int32, device=self.input_ids.device),
            seq_lens=self.seq_lens[:bs], cu_extend=self.cu_extend[: bs + 1], out_slots=self.out_slots[:bs],
            logits_rows=self.logits_rows[:bs], page_size=self.page_size,
            prefix_lens_cpu=[bound - 1] * bs, extend_lens_cpu=[1] * bs,
            sink_slots=self.sink_slots[:bs] if self.pool.has_sink else None, logits_all=True,
        )  # fmt: skip

    def _static_extend_batch(self, tg: int) -> ForwardBatch:
        """A ForwardBatch over the static extend buffers for a bucket of ``tg`` tokens, host
        lengths at the bound (the split-KV extend path, sized for any prefix)."""
        device = self.ext_inputs.device
        bound = self.max_pages * self.page_size
        return ForwardBatch(
            input_ids=self.ext_inputs[0, :tg], positions=self.ext_inputs[1, :tg],
            page_table=self.ext_table, prefix_lens=self.ext_prefix,
            extend_lens=torch.full((1,), tg, dtype=torch.int32, device=device), seq_lens=self.ext_seq_len,
            cu_extend=torch.tensor([0, tg], dtype=torch.int32, device=device),
            out_slots=self.ext_inputs[2, :tg], logits_rows=self.ext_row, page_size=self.page_size,
            prefix_lens_cpu=[max(bound - tg, 0)], extend_lens_cpu=[tg],
            sink_slots=self.ext_sink if self.pool.has_sink else None,
        )  # fmt: skip

    def _extend_inputs(self, tg: int) -> None:
        """The extend graph's first ops: its batch's fields from the staged inputs, and the
        request's page-table row written."""
        meta = self.ext_inputs[3]
        self.ext_prefix.copy_(meta[0:1])
        self.ext_seq_len.copy_(meta[0:1] + tg)
        self.ext_row.copy_(meta[1:2])
        self.ext_table.copy_(self.ext_pages.to(torch.int32))  # [Pmax] into [1, Pmax]
        self.req_pages[meta[2:3]] = self.ext_table  # the request's row, for its decode steps
        self.ext_sink.copy_(meta[3:4])

    def _forward_extend(self, tg: int, batch: ForwardBatch) -> torch.Tensor:
        self._extend_inputs(tg)
        return self.model.forward(batch, self.pool)

    @torch.inference_mode()
    def _capture_all(self) -> float:
        start = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.input_ids.device)
        # largest first: smaller ones reuse its memory
        jobs = [(self.graphs, self.outputs, bs, self._forward, self._static_batch(bs))
                for bs in reversed(self.batch_sizes)]
        # the extend batches' own tensors (extend_lens, cu_extend) are read by the graphs
        self._ext_batches = {tg: self._static_extend_batch(tg) for tg in self.extend_sizes}
        jobs += [(self.ext_graphs, self.ext_outputs, tg, self._forward_extend, self._ext_batches[tg])
                 for tg in reversed(self.extend_sizes)]
        for graphs, outputs, size, forward, batch in jobs:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels, settle allocator and caches
                    forward(size, batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=stream):
                outputs[size] = forward(size, batch)
            graphs[size] = graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up passes' blocks (the [Bg, V] LM head output among them)
        seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (decode batch sizes %s, extend lengths %s) in %.1f s",
                    len(self.graphs) + len(self.ext_graphs), self.batch_sizes, self.extend_sizes, seconds)
        return seconds

    def _write_pages(self) -> None:
        """Apply the page-table writes ``replay`` staged (the first op of a decode graph)."""
        self.req_pages[self.write_rows, self.write_cols] = self.write_pages.to(torch.int32)

    def _forward(self, bs: int, batch: ForwardBatch) -> torch.Tensor:
        self._write_pages()
        ids = self.input_ids[:bs]
        self.resolved_ids[:bs] = torch.where(ids >= 0, ids, self.prev_ids[self.src_rows[:bs]])
        self.seq_lens[:bs] = self.positions[:bs] + 1
        self.page_table[:bs] = self.req_pages[self.table_rows[:bs]]
        self.sink_slots[:bs] = self.sink_rows[:bs]
        logits = self.model.compute_logits(self.model.forward(batch, self.pool), out=self.logits[:bs])
        rows = min(bs, self.prev_ids.shape[0])
        self.prev_ids[:rows] = logits[:rows].argmax(dim=-1)  # greedy ids (see the module docstring)
        return logits

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured batch size >= ``batch_size`` (None if none is)."""
        sizes = self.batch_sizes
        k = bisect_left(sizes, batch_size)
        return sizes[k] if k < len(sizes) else None

    def replay(self, input_ids: list[int], positions: list[int], page_tables: list[list[int]],
               src_rows: list[int] | None = None, keys: list[Hashable] | None = None,
               sink_slots: list[int] | None = None, steps: int = 1) -> torch.Tensor:
        """One decode step of B = len(input_ids) requests: request b feeds token
        ``input_ids[b]`` at ``positions[b]`` (its K/V goes to position ``positions[b]`` of
        the pages ``page_tables[b]``; it attends over positions 0..positions[b]). An input
        id of -1 is read from ``prev_ids[src_rows[b]]`` on the device. ``keys[b]``
        identifies request b across steps (its device page-table row is kept and only
        changed page ids are copied); default: a fresh row per step. ``sink_slots[b]``:
        request b's exact sink slot (pools with sink slots; -1 or omitted: none).

        The host inputs go through pinned buffers in two sets used in turn, so the caller
        must have waited on the stream for replay k (e.g. read its results) before replay
        k + 2 stages its inputs; the overlap scheduler keeps one step in flight at most.

        ``steps`` > 1 (at most ``max_window``): the first step of a multi-step window. The
        same copy also stages steps 1 .. steps - 1 (request b at ``positions[b] + i``, its
        input the previous step's sample of row b: ``prev_ids[b]``, no page-table writes:
        this step writes every page the window needs); ``replay_next`` replays them.

        Returns logits [B, V] float32 (the LM head's), a view of the graphs' output buffer
        that the next replay overwrites. Raises ValueError if B exceeds the largest bucket,
        ``steps`` the window, or a page table is too short (for every step) / too wide.
        """
        b = len(input_ids)
        bs = self.bucket(b)
        if bs is None or b == 0:
            raise ValueError(f"batch of {b} requests: captured sizes are 1..{self.max_bs}")
        if not 1 <= steps <= self.max_window:
            raise ValueError(f"{steps} steps: the window holds 1..{self.max_window}")
        size, max_pages, reach = self.page_size, self.max_pages, steps - 1
        slots = []
        for pos, table in zip(positions, page_tables, strict=True):
            page, width = pos // size, len(table)
            if (pos + reach) // size >= width or width > max_pages:
                raise ValueError(f"page table of {width} pages does not reach position {pos + reach}"
                                 if width <= max_pages else
                                 f"page table of {width} pages exceeds the captured width {max_pages}")
            slots.append(table[page] * size + pos % size)
        rows, writes = self._sync_tables(keys if keys is not None else [object() for _ in range(b)], page_tables,
                                         in_graph=self.max_bs)
        staging = self._staging[self._turn]
        self._turn ^= 1
        host = staging.numpy()
        host[:6, b:bs] = 0  # padding rows: token 0, position 0, dummy slot 0, dummy table row 0
        host[5, b:bs] = -1  # ... and no sink slot
        host[6:] = 0  # unused page-table writes: dummy row 0, column 0, page 0
        if writes:
            host[6:, : len(writes)] = list(zip(*writes, strict=True))
        host[0, :b] = input_ids
        host[1, :b] = positions
        host[2, :b] = slots
        host[3, :b] = src_rows if src_rows is not None else 0
        host[4, :b] = rows
        host[5, :b] = sink_slots if sink_slots is not None else -1
        self.inputs.copy_(staging, non_blocking=True)
        if steps > 1:
            self._stage_window(host, positions, page_tables, slots, steps, self._turn ^ 1)
        self._window = (1, steps, bs, b)
        self.pool.await_loads()  # a whole-model graph waits for every layer of a load in flight
        self.graphs[bs].replay()
        return self.outputs[bs][:b]

    def _stage_window(self, host: np.ndarray, positions: list[int], page_tables: list[list[int]],
                      slots: list[int], steps: int, turn: int) -> None:
        """Stage steps 1 .. steps - 1 of a window after step 0's inputs ``host`` (``replay``)
        and queue their copy to ``window_inputs``. A step's KV slot is the last one's + 1
        unless the position starts a page (looked up in the request's pages then)."""
        b, size = len(positions), self.page_size
        staging = self._window_staging[turn]
        later = staging.numpy()[: steps - 1]
        later[:] = host  # padding rows, table rows and sink slots as in step 0
        later[:, 6:] = 0  # no page-table writes: step 0 applied the window's
        later[:, 0, :b] = -1  # every input is the previous step's sample of its row
        later[:, 3, :b] = np.arange(b)
        ahead = np.arange(1, steps)[:, None]  # [steps - 1, 1]
        later[:, 1, :b] = np.asarray(positions) + ahead
        later[:, 2, :b] = np.asarray(slots) + ahead
        crossed = (np.asarray(positions) % size + ahead) >= size  # into a later page: look it up
        for i, j in np.argwhere(crossed).tolist():
            pos = positions[j] + i + 1
            later[i, 2, j] = page_tables[j][pos // size] * size + pos % size
        self.window_inputs[: steps - 1].copy_(staging[: steps - 1], non_blocking=True)

    def replay_next(self) -> torch.Tensor:
        """The next step of the window the last ``replay`` staged: its inputs copied from
        ``window_inputs`` on the device, the same bucket's graph replayed. The caller must
        have written the previous step's samples into ``prev_ids`` (rows 0 .. B - 1) first.

        Returns logits [B, V] float32 as ``replay``. Raises RuntimeError past the window's
        last step."""
        self.pool.await_loads()
        step, steps, bs, b = self._window
        if step >= steps:
            raise RuntimeError(f"step {step} of a window of {steps}: nothing staged")
        self.inputs.copy_(self.window_inputs[step - 1])
        self._window = (step + 1, steps, bs, b)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]

    def extend_bucket(self, num_tokens: int) -> int | None:
        """The smallest captured extend length >= ``num_tokens`` (None if none is)."""
        for tg in self.extend_sizes:
            if tg >= num_tokens:
                return tg
        return None

    def fits_extend(self, start: int, num_tokens: int) -> bool:
        """Whether an extend of ``num_tokens`` at ``start`` can replay a graph: a bucket
        holds it and, padded to that bucket, it ends within ``Pmax * page_size`` positions
        (the padding's keys are read through the page table too). A prompt ending near
        the context length can fail the second: it runs eagerly."""
        tg = self.extend_bucket(num_tokens) if num_tokens >= 2 else None
        return tg is not None and start + tg <= self.max_pages * self.page_size

    def replay_extend(self, input_ids: list[int], start: int, pages: list[int],
                      key: Hashable | None = None, sink_slot: int = -1) -> torch.Tensor:
        """One request extends T = len(input_ids) tokens (all known on the host) at
        positions ``start ..`` of its ``pages``, attending over positions 0 .. start + i;
        ``key`` as in ``replay``. Staging as in ``replay`` (two pinned sets in turn).

        Returns the hidden state [1, E] (model dtype) of its last token, a view of the
        graph's output buffer that the next replay of that bucket overwrites. Raises
        ValueError if T < 2, T exceeds the largest bucket, the page table is too short or
        too wide, or the padded extend would end past the captured width (``start + Tg >
        Pmax * page_size``: the padding's keys would index page-table columns beyond
        Pmax; ``fits_extend`` tells beforehand). ``sink_slot``: the request's exact sink
        slot (-1 none); the graph only reads it (a pass that writes a sink slot runs eagerly).
        """
        self.pool.await_loads()
        t = len(input_ids)
        tg = self.extend_bucket(t) if t >= 2 else None
        if tg is None:
            raise ValueError(f"extend of {t} tokens: captured extend lengths are 2..{max(self.extend_sizes, default=0)}")
        size, end = self.page_size, start + t
        if len(pages) * size < end:
            raise ValueError(f"page table of {len(pages)} pages does not reach position {end - 1}")
        if len(pages) > self.max_pages:
            raise ValueError(f"page table of {len(pages)} pages exceeds the captured width {self.max_pages}")
        if start + tg > self.max_pages * size:  # not fits_extend(start, t)
            raise ValueError(f"extend of {t} tokens at {start}, padded to {tg}, ends past the captured width "
                             f"of {self.max_pages * size} positions")
        row = self.tables.sync([key if key is not None else object()], [pages])[0][0]  # the graph writes it
        staging = self._ext_staging[self._ext_turn]
        self._ext_turn ^= 1
        flat = staging.numpy()
        tmax = self.ext_inputs.shape[1]
        host = flat[: 4 * tmax].reshape(4, tmax)
        host[:3, t:tg] = 0  # padding: token 0 at position 0, K/V into the dummy slot 0
        host[0, :t] = input_ids
        host[1, :t] = range(start, end)
        host[2, :t] = [pages[p // size] * size + p % size for p in range(start, end)]
        host[3, :4] = (start, t - 1, row, sink_slot)
        n = 4 * tmax + len(pages)
        flat[4 * tmax : n] = pages
        self.ext_flat[:n].copy_(staging[:n], non_blocking=True)
        self.ext_graphs[tg].replay()
        return self.ext_outputs[tg]

    def _sync_tables(self, keys: list[Hashable], page_tables: list[list[int]], in_graph: int = 0
                     ) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Device page-table row of each request, and up to ``in_graph`` (row, column, page
        id) writes that bring the rows up to date, left for the graph to apply: the changed
        runs that fit (a decode step: one page id per request that grew a page). The other
        runs (a new request's whole row) are written now, all in one index copy queued on
        the stream before the replay."""
        rows, runs = self.tables.sync(keys, page_tables)
        graph_writes: list[tuple[int, int, int]] = []
        index: list[int] = []
        values: list[int] = []
        width = self.req_pages.shape[1]
        for row, first, pages in runs:
            if len(graph_writes) + len(pages) <= in_graph:
                graph_writes.extend((row, first + i, page) for i, page in enumerate(pages))
            else:
                start = row * width + first
                index.extend(range(start, start + len(pages)))
                values.extend(pages)
        if index:  # array -> tensor without a per-element conversion
            device = self.req_pages.device
            flat = to_device(torch.frombuffer(array("q", index), dtype=torch.int64), device)
            self.req_pages.view(-1)[flat] = to_device(torch.frombuffer(array("i", values), dtype=torch.int32), device)
        return rows, graph_writes


class PageTableRows:
    """Host side of the incremental device page table: which row each request has and
    what the device holds in it, so a step copies only the page ids that changed.

    Rows 1..num_rows-1 are handed out (row 0 is the all-dummy padding row). When none is
    free, the rows of requests not in the current step are reclaimed; a request that comes
    back gets a new row written from scratch.
    """

    def __init__(self, num_rows: int) -> None:
        if num_rows < 2:
            raise ValueError(f"need at least 2 rows, got {num_rows}")
        self._row_of: dict[Hashable, int] = {}
        self._mirror: list[list[int]] = [[] for _ in range(num_rows)]
        self._free = list(range(num_rows - 1, 0, -1))

    def sync(self, keys: list[Hashable], page_tables: list[list[int]]
             ) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
        """(row per request, (row, first column, page ids) runs of writes that bring the
        device rows up to date). Usually no run, or a one-page run per request that grew a
        page; a request whose pages changed other than by appending (prefix pages swapped
        for the radix tree's copies, pages replaced after a preemption) has its whole row
        rewritten.

        Raises ValueError if the step has more requests than rows.
        """
        if len(keys) >= len(self._mirror):
            raise ValueError(f"{len(keys)} requests in one step, only {len(self._mirror) - 1} rows")
        rows, updates, in_use = [], [], None
        for key, pages in zip(keys, page_tables, strict=True):
            row = self._row_of.get(key)
            if row is None:
                if in_use is None:  # once per step: a wave of new requests is not quadratic
                    in_use = set(keys)
                row = self._take(in_use)
                self._row_of[key] = row
            mirror = self._mirror[row]
            if pages != mirror:
                appended = len(pages) >= len(mirror) and pages[: len(mirror)] == mirror
                start = len(mirror) if appended else 0
                updates.append((row, start, pages[start:]))
                self._mirror[row] = list(pages)
            rows.append(row)
        return rows, updates

    def _take(self, in_use: set) -> int:
        if not self._free:
            for key in [k for k in self._row_of if k not in in_use]:
                row = self._row_of.pop(key)
                self._mirror[row] = []
                self._free.append(row)
        return self._free.pop()
