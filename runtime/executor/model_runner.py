"""ModelRunner: owns the model and the KV pool; executes a ScheduleDecision.

Phases of one step: ``prepare`` (ForwardBatch from the decision, choosing which rows
need logits), ``forward`` (model over the pages), ``sample`` (next tokens of requests
that reached the end of their sequence) and ``prompt_logprobs`` (rows of prompts that
asked for them).

Which rows get logits, for an item feeding positions [start, start + n) of a prompt of
length P with ``logprob_start_len`` = s (logits at position p score token p + 1):

    positions:   start ................................ start+n-1
    prompt rows: p with s <= p+1 < P          (token p+1's prompt logprob)
    sample row:  start+n-1, if start+n == seq_len  (next token)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime import messages as m
from radixlm.runtime.executor.attention import TritonAttentionBackend
from radixlm.runtime.executor.cuda_graph_runner import CudaGraphRunner
from radixlm.runtime.executor.forward_batch import ForwardBatch, to_device
from radixlm.runtime.executor.kv_calibration import (
    CALIBRATION_TEXT,
    KVScales,
    calibrate_kv_scales,
    load_kv_scales,
)
from radixlm.runtime.executor.model_loader import (
    cpu_threads,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from radixlm.runtime.executor.models.decoder import local_heads
from radixlm.runtime.executor.parallel import RankPlacement, TPGroup
from radixlm.runtime.executor.piecewise_cuda_graph import PiecewiseGraphs, pool_fits
from radixlm.runtime.executor.sampling import (
    SampleResult,
    SamplingBatch,
    SamplingInfo,
    has_penalties,
    sample,
)
from radixlm.runtime.executor.weight_quant import quantize_linears, resolve_weight_dtype
from radixlm.runtime.memory.cost_model import DEVICE_RATES, SwapCostModel, TierCostModel
from radixlm.runtime.memory.kv_formats import TIERED_KV
from radixlm.runtime.memory.kv_pool import KVPool, kv_page_bytes, tiered_fp8_pages
from radixlm.runtime.memory.page_records import record_bytes
from radixlm.runtime.scheduler.decision import (
    ItemResult,
    PendingStep,
    ScheduleDecision,
    ScheduleItem,
)
from radixlm.runtime.scheduler.request import Req
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.text.grammar import GrammarMasker

__all__ = ["ModelRunner"]

logger = logging.getLogger("radixlm.model_runner")
CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768


class ModelRunner:
    def __init__(self, args: ServerArgs, placement: RankPlacement | None = None) -> None:
        """``placement``: this process's rank (tensor / data parallelism); None: the whole
        model in this process. With tensor parallelism every rank builds a runner over its
        slice of the model and its own KV pool (its kv heads, the same pages); rank 0
        samples (``launch``), the others run the same steps (``follow``)."""
        from transformers import AutoTokenizer

        self.args = args
        self.placement = placement = placement or RankPlacement()
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and (placement.gpu_id or placement.tp_size > 1):  # this rank's GPU
            self.device = torch.device("cuda", placement.gpu_id)
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":  # the forward pass runs here: every core the process may use
            torch.set_num_threads(cpu_threads())
        self.tp = (TPGroup(placement.tp_rank, placement.tp_size, placement.dist_init_addr, self.device)
                   if placement.tp_size > 1 else None)
        self.model_dir = resolve_model_path(args.model_path, args.model_cache_dir)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.model = load_model(self.model_dir, self.dtype, self.device, args.attention_backend, args.load_format,
                                tp=self.tp)
        if isinstance(self.model.attn_backend, TritonAttentionBackend):
            self.model.attn_backend.enable_cascade = not args.disable_cascade_attention
        self.num_params = sum(p.numel() for p in self.model.parameters())  # before packing any weights
        self.weight_dtype = resolve_weight_dtype(args.weight_dtype, args.model_path, self.device)
        if self.weight_dtype[0] != "model":
            summary = quantize_linears(self.model, *self.weight_dtype)
            logger.info("weights: linears %s, LM head %s: %.0f MB -> %.0f MB", *self.weight_dtype,
                        summary["bytes_before"] / 1e6, summary["bytes_after"] / 1e6)
        self.config = self.model.config
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or self.model_dir)
        self.eos_token_ids = _eos_token_ids(self.model_dir, self.config, self.tokenizer)
        self.context_length = args.context_length or int(self.config.max_position_embeddings)
        self.vocab_size = int(self.config.vocab_size)
        self.grammar_masker = GrammarMasker(self.vocab_size, self.device)  # buffers made on first use
        self.page_size = args.page_size
        cfg = self.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads, self.num_kv_heads = local_heads(cfg, self.tp)  # this rank's (all without TP)
        scales = self._kv_scales()
        self.num_fp8_pages = (tiered_fp8_pages(args.kv_cache_dtype, args.mixed_window_pages,
                                               args.max_running_requests, args.max_prefill_tokens, self.page_size,
                                               self.context_length)
                              if args.kv_cache_dtype in TIERED_KV else None)
        # Exact sink slots: one per distinct first token, so more than the vocabulary never helps.
        self.sink_slots = min(args.sink_slots, self.vocab_size)
        self.num_pages = self._size_pool()
        if self.tp is not None:  # one page id names the same tokens on every rank
            self.num_pages = self.tp.min_int(self.num_pages)
        self.pool = KVPool(self.num_pages, self.page_size, cfg.num_hidden_layers, self.num_kv_heads,
                           self.head_dim, self.dtype, self.device, args.kv_cache_dtype, *scales,
                           num_fp8_pages=self.num_fp8_pages, window_pages=args.mixed_window_pages,
                           sink_slots=self.sink_slots)
        self.generator = torch.Generator(self.device).manual_seed(args.random_seed)
        pool = self.pool
        bf16_page = kv_page_bytes("bf16", self.dtype, cfg.num_hidden_layers, self.num_kv_heads,
                                  self.head_dim, self.page_size)
        page = kv_page_bytes(args.kv_cache_dtype, self.dtype, cfg.num_hidden_layers, self.num_kv_heads,
                             self.head_dim, self.page_size)
        logger.info("KV pool: %d pages x %d tokens = %d tokens, %d bytes = %.1f MiB incl. %d bytes of "
                    "metadata (kv cache %s in %s, %d bytes/token = %.3f of bf16 with its scales; model %s, %s)",
                    self.num_pages - 1, self.page_size, (self.num_pages - 1) * self.page_size, pool.total_bytes,
                    pool.total_bytes / 2**20, pool.metadata_bytes, args.kv_cache_dtype,
                    "int4 + fp8 slots" if pool.tiered else str(pool.dtype).removeprefix("torch."),
                    pool.bytes_per_token, page / bf16_page, self.dtype, self.device)
        if pool.has_sink:
            logger.info("KV pool: exact attention sink, %d slots (first tokens) of position-0 K/V in float32, "
                        "%d bytes (in the metadata)", pool.sink_slots, 2 * pool.sink_k.numel() * 4)
        if pool.tiered:
            logger.info("KV pool: %d FP8 slot pages (%d bytes) for pages not demoted to INT4 yet "
                        "(%s); whole pool %.3f of a bf16 pool of as many tokens", pool.num_fp8_pages,
                        pool.fp8_slot_bytes, f"window {pool.window_pages} pages + sink" if pool.keep_sink
                        else "pages being filled", pool.total_bytes / (bf16_page * self.num_pages))
        # The last launch's sampled ids stay on the device: the next launch may feed them
        # before the host has read them (overlap scheduling). _prev_rows: request -> row.
        # A step samples at most one row per running request.
        self._prev_ids = torch.zeros(args.max_running_requests, dtype=torch.int64, device=self.device)
        self._prev_rows: dict[Req, int] = {}
        self._last_launch: PendingStep | None = None
        cuda = self.device.type == "cuda"
        self._ready_events = [torch.cuda.Event() for _ in range(2)] if cuda else []
        # Pinned host buffers the sampled ids are copied into, one per event (used in turn):
        # a new pinned block per step costs the caching host allocator's bookkeeping.
        self._host_ids = [torch.empty(args.max_running_requests, dtype=torch.int64, pin_memory=True)
                          for _ in range(2)] if cuda else []
        self._ready_turn = 0
        # Multi-step windows (--num-scheduler-steps): a window's ids [steps, B] on the device,
        # contiguous in a flat [W * R] buffer, read back in one copy per window into pinned
        # buffers used in turn as above.
        self.max_decode_window = window = args.num_scheduler_steps  # the longest window launch() takes
        self._window_ids = (torch.zeros(window * args.max_running_requests, dtype=torch.int64, device=self.device)
                            if window > 1 else None)
        self._window_host = [torch.empty(window * args.max_running_requests, dtype=torch.int64, pin_memory=True)
                             for _ in range(2)] if cuda and window > 1 else []
        # see _sampling_batch: (requests, (their SamplingBatch, request -> row, any grammar))
        self._sampling_cache: tuple[tuple[Req, ...], tuple[SamplingBatch, dict[Req, int], bool]] | None = None
        self._sink_claims: list[int] = []  # first tokens whose sink slots the last prepare() claimed
        self.graph_runner = self._make_graph_runner()
        self.piecewise = self._make_piecewise()
        self._warm_up_attention()

    def _warm_up_attention(self) -> None:
        """Compile the attention kernels of eager steps (Triton backend on CUDA) before
        serving: the long-extend kernel per config, the split-KV extend path, and for float
        pools the decode path of mixed steps (every merge binary). Otherwise the first
        cached-prefix request, or the first mixed step with a new decode split count, pays
        Triton's JIT (seconds) in the TTFT / ITL of every request in flight."""
        if self.device.type != "cuda" or not isinstance(self.model.attn_backend, TritonAttentionBackend):
            return
        from radixlm.kernels.decode_attention import warm_up_decode_path
        from radixlm.kernels.extend_attention import warm_up_extend_path, warm_up_split_path

        start = time.perf_counter()
        pool = self.pool
        q_dtype = self.dtype if pool.quantised else pool.dtype
        scales = (pool.k_scale[0], pool.v_scale[0], pool.sink_k[0] if pool.has_sink else None)
        splits: list[int] = []
        decode_splits: list[int] = []
        if not pool.tiered:  # tiered (int4 / mixed) pools take neither path: one tiered extend kernel
            warm_up_extend_path(pool.k[0], self.num_heads, q_dtype, *scales, v_pool=pool.v[0])
            splits = warm_up_split_path(pool.k[0], self.num_heads, q_dtype, self.context_length, *scales,
                                        v_pool=pool.v[0])
        if not (pool.quantised or pool.tiered or pool.has_sink):  # the pools of the mixed decode split
            decode_splits = warm_up_decode_path(pool.k[0], self.num_heads, q_dtype, self.context_length,
                                                cascade=self.model.attn_backend.enable_cascade)  # fmt: skip
        torch.cuda.synchronize(self.device)
        logger.info("attention compiled (split-KV extend N %s, decode N %s, cascade slots -N) in %.1f s",
                    splits, decode_splits, time.perf_counter() - start)

    def _make_graph_runner(self) -> CudaGraphRunner | None:
        """Decode CUDA graphs on a CUDA device with the Triton backend, unless disabled."""
        args = self.args
        if (args.disable_cuda_graph or self.device.type != "cuda"
                or not isinstance(self.model.attn_backend, TritonAttentionBackend)):
            return None
        if self.model.attn_backend.needs_reference:  # soft-capping / sliding windows: not capturable yet
            logger.warning("CUDA graphs off: this model's soft-capping or sliding-window layers attend "
                           "through the PyTorch reference on the Triton backend (docs/MODELS.md)")
            return None
        max_bs = args.cuda_graph_max_bs or args.max_running_requests
        max_pages = -(-self.context_length // self.page_size)
        # int4 / mixed: extend graphs not used yet (their extend kernel untested under capture)
        max_extend = 0 if self.pool.tiered else min(args.cuda_graph_max_extend_tokens, self.context_length)
        return CudaGraphRunner(self.model, self.pool, max_bs, max_pages, self._prev_ids,
                               max_extend_tokens=max_extend if max_extend >= 2 else 0,
                               max_window=args.num_scheduler_steps)

    def _make_piecewise(self) -> PiecewiseGraphs | None:
        """Piecewise CUDA graphs for the other steps, where the decode graphs run and the pool
        fits (``pool_fits``: float pages in the model dtype), unless their flag is 0."""
        tokens = self.args.piecewise_cuda_graph_max_tokens
        if (self.graph_runner is None or not tokens or not pool_fits(self.pool, self.dtype)
                or not self.model.model.fused):  # fmt: skip
            return None
        return PiecewiseGraphs(self.model, self.pool, tokens)

    def _kv_scales(self) -> KVScales | tuple[None, None]:
        """FP8 KV scales [L, K] and channel means [L, K, D] from --kv-scales-path or a
        calibration pass ((None, None) for float caches). Raises KVScalesError (the server
        does not start) when unusable."""
        args, cfg = self.args, self.config
        if args.kv_cache_dtype not in ("fp8_e4m3", *TIERED_KV):
            return None, None
        if args.kv_scales_path:
            scales = load_kv_scales(args.kv_scales_path, cfg.num_hidden_layers, self.num_kv_heads,
                                    self.head_dim)
            logger.info("FP8 KV scales loaded from %s (keys rotated: %s)", args.kv_scales_path,
                        scales.k_rotation or "no")
            return scales
        ids = self.tokenizer(CALIBRATION_TEXT.read_text())["input_ids"]
        scales = calibrate_kv_scales(self.model, ids, self.page_size, self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the calibration pool is not counted as used by _size_pool
        logger.info("FP8 KV scales and channel means calibrated on %d tokens of %s: scales K %.3g..%.3g, "
                    "V %.3g..%.3g; keys rotated: %s", len(ids), CALIBRATION_TEXT.name, scales.k_scale.min(),
                    scales.k_scale.max(), scales.v_scale.min(), scales.v_scale.max(),
                    scales.k_rotation or "no (head dim not a power of two)")
        return scales

    def _size_pool(self) -> int:
        """Pages (including the dummy page 0) from --max-total-tokens or the memory fraction."""
        cfg, args = self.config, self.args
        page = kv_page_bytes(args.kv_cache_dtype, self.dtype, cfg.num_hidden_layers, self.num_kv_heads,
                             self.head_dim, self.page_size)
        per_token = -(-page // self.page_size)  # int4 / mixed: INT4 page + statistics
        fp8_bytes = 0  # tiered pools' FP8 slots and FP8 pools' sink slots come out of the budget first
        if self.num_fp8_pages:
            fp8_bytes = self.num_fp8_pages * kv_page_bytes("fp8_e4m3", self.dtype, cfg.num_hidden_layers,
                                                           self.num_kv_heads, self.head_dim, self.page_size)
        fp8_bytes += 2 * self.sink_slots * cfg.num_hidden_layers * self.num_kv_heads * self.head_dim * 4
        tokens = args.max_total_tokens
        source = "--max-total-tokens"
        if tokens is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * args.mem_fraction_static - (total - free) - fp8_bytes
            tokens = int(budget // per_token)
            logger.info("KV pool sizing: --mem-fraction-static %.2f x %.2f GiB device memory - %.2f GiB "
                        "in use (weights, CUDA context) = %.2f GiB for KV / %d bytes per token = %d tokens",
                        args.mem_fraction_static, total / 2**30, (total - free) / 2**30, budget / 2**30,
                        per_token, max(tokens, 0))
            source = "--mem-fraction-static"
        if tokens is None:
            tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
            source = "the CPU default (set --max-total-tokens)"
        logger.info("KV pool capacity from %s: %d tokens x %d bytes per token", source, tokens, per_token)
        pages = tokens // self.page_size
        if pages < 1:
            raise RuntimeError(f"no memory left for the KV cache ({per_token} bytes per token)")
        return pages + 1

    def ready_message(self) -> m.SchedulerReady:
        return m.SchedulerReady(
            max_total_tokens=(self.num_pages - 1) * self.page_size, context_length=self.context_length,
            page_size=self.page_size, vocab_size=self.vocab_size, model_dir=str(self.model_dir),
            device=str(self.device), dtype=str(self.dtype).removeprefix("torch."), kv_bytes=self.pool.total_bytes,
            cuda_graph_max_bs=None if self.graph_runner is None else self.graph_runner.max_bs,
        )

    # ----------------------------------------------------------------- one step
    @torch.inference_mode()
    def swap_cost_model(self) -> SwapCostModel:
        """The swap-vs-recompute cost model of this model on this device."""
        cfg = self.model.config
        link, flops = DEVICE_RATES["cuda" if self.device.type == "cuda" else "cpu"]
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return SwapCostModel(
            kv_bytes_per_token=self.pool.bytes_per_token,
            params=self.num_params,
            num_layers=cfg.num_hidden_layers,
            q_dim=cfg.num_attention_heads * head_dim,
            link_bytes_per_s=link,
            flops_per_s=flops,
        )

    def kv_identity(self) -> str:
        """Hex name of this model's KV format for the disk tier (``--hicache-storage-dir``):
        a blake2b over the architecture config, a fingerprint of the weights (every
        tensor's name, shape, dtype and 64 evenly strided values), the model dtype, the KV
        cache dtype, the page size, and the KV scales / means / rotation of quantised
        pools. Pages stored under another identity are never read."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(self.config.to_dict(), sort_keys=True, default=str).encode())
        for name, param in sorted(self.model.state_dict().items()):
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu()
            h.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            h.update(sample.numpy().tobytes())
        h.update(f"{self.dtype}|{self.args.kv_cache_dtype}|{self.page_size}|{self.pool.k_rotation}".encode())
        for tensors in (self.pool.k_scale, self.pool.v_scale, self.pool.k_mean, self.pool.v_mean):
            for t in tensors:
                if t is not None:
                    h.update(t.float().cpu().numpy().tobytes())
        return h.hexdigest()

    def tier_costs(self, host_pool: Any = None, disk: Any = None) -> TierCostModel:
        """The load-vs-recompute model of the KV tiers, measured now: the tiers' read
        bandwidths in bytes/s (host -> device: loading up to 64 MiB of pages from
        ``host_pool`` into pages 1..n, free at start-up; disk -> host:
        ``disk.measure_read_bandwidth``; neither without a hierarchical cache) and the
        recompute rate in FLOP/s (``prefill_flops_per_s``). Page bytes: one page record
        (``memory.page_records.record_bytes``). The peer tier's rate is added by the
        scheduler (``PeerKVLink.measure``)."""
        rates = {}
        if host_pool is not None:
            pages = max(1, min(host_pool.num_pages - 1, self.num_pages - 1, (64 << 20) // host_pool.page_bytes))
            rows, device_pages = list(range(1, pages + 1)), list(range(1, pages + 1))
            for _ in range(2):  # the first round warms up (staging buffers, streams)
                self._sync()
                start = time.perf_counter()
                host_pool.load(rows, device_pages)
                self.pool.await_loads()  # a layer-wise load: no forward consumes this one
                self._sync()
                rates["host"] = pages * host_pool.page_bytes / max(time.perf_counter() - start, 1e-9)
            if disk is not None:
                rates["disk"] = disk.measure_read_bandwidth(max(1, min(16, (64 << 20) // host_pool.page_bytes)))
        compute = self.swap_cost_model()
        compute = dataclasses.replace(compute, flops_per_s=self.prefill_flops_per_s(compute))
        return TierCostModel(compute, record_bytes(self.pool), self.page_size, rates)

    @torch.inference_mode()
    def prefill_flops_per_s(self, compute: SwapCostModel) -> float:
        """FLOP/s of one prefill of 2048 tokens (CUDA; 128 on the CPU), by
        ``compute.span_seconds``' FLOP count, timed on its second run (the first compiles),
        in a float pool of its own (as KV calibration does)."""
        cfg = self.config
        n = min(2048 if self.device.type == "cuda" else 128, self.context_length - 1)
        pages = -(-n // self.page_size)
        pool = KVPool(pages + 1, self.page_size, cfg.num_hidden_layers, self.num_kv_heads, self.head_dim,
                      self.dtype, self.device)
        ids = [(17 * i) % self.vocab_size for i in range(n)]
        batch = ForwardBatch.build([ids], [0], [list(range(1, pages + 1))], [n - 1], self.page_size, self.device)
        for _ in range(2):
            self._sync()
            start = time.perf_counter()
            self.model.forward(batch, pool)
            self._sync()
            seconds = max(time.perf_counter() - start, 1e-9)
        del pool
        return compute.span_seconds(0, n) * compute.flops_per_s / seconds

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def apply_swaps(self, decision: ScheduleDecision) -> None:
        """Swap-outs (pool pages -> host, kept on the request) then swap-ins (host ->
        newly allocated pages), before the step's forward pass writes any page."""
        for req, pages in decision.swap_out:
            req.swap_handle = self.pool.read_pages(pages)
        for swap in decision.swap_in:
            self.pool.write_pages(swap.pages, swap.req.swap_handle[:, :, swap.first_page :])
            swap.req.swap_handle = None

    def execute(self, decision: ScheduleDecision) -> list[ItemResult]:
        """Run one step and wait for its results (``launch(decision).collect()``)."""
        return self.launch(decision).collect()

    def launch(self, decision: ScheduleDecision) -> PendingStep:
        """Queue one step's forward pass and sampling on the device and return without
        waiting for them (on CUDA); ``collect()`` on the result waits and reads them.

        An item may feed a token that is still being sampled by the previous launch (its
        request's ``num_inflight`` > 0, the overlap scheduler): that input is taken on the
        device from the previous launch's sampled ids, so the host never waits for it.

        On CUDA, step k's sampled ids land in one of two pinned host buffers, used in turn:
        the caller must ``collect()`` step k before launch k + 2 (the scheduler collects the
        step in flight right after the next launch), or step k's ids are overwritten. A
        multi-step window (``decision.decode_steps`` > 1) counts as one launch
        (``_launch_window``).
        """
        items = decision.items
        if decision.decode_steps > 1:
            return self._launch_window(items, decision.decode_steps)
        # Whether any item may score prompt tokens (``_prompt_positions``): rarely, so a step
        # without logprob requests skips the per-item checks.
        scoring = any(it.req.return_logprob for it in items)
        logits, rows, reqs = self._logits(items, scoring)
        step = PendingStep(items)
        if scoring:
            step.results = [ItemResult() for _ in items]
            self._prompt_logprobs(items, rows or [([], i) for i in range(len(items))], logits, step.results)
        self._sample(items, rows, logits, step, scoring, reqs)
        self._last_launch = step
        return step

    def follow(self, decision: ScheduleDecision) -> None:
        """Tensor parallel ranks other than 0: run rank 0's step on this rank's slice (the
        same forward passes and collectives as its ``launch``) and take the tokens it
        sampled (a broadcast) as the inputs of the next step; nothing is sampled here."""
        items, steps = decision.items, decision.decode_steps
        if steps > 1:
            b = len(items)
            _, _, graph_reqs = self._logits(items, False, steps)
            for i in range(steps):
                if i:
                    if graph_reqs is not None:
                        self.graph_runner.replay_next()
                    else:
                        self._logits([ScheduleItem(it.req, it.start + i, 1, True) for it in items], False)
                self.tp.broadcast(self._prev_ids[:b])
                self._prev_rows = {it.req: j for j, it in enumerate(items)}
            return
        _, rows, _ = self._logits(items, any(it.req.return_logprob for it in items))
        picks = range(len(items)) if rows is None else [i for i, (_, r) in enumerate(rows) if r is not None]
        if picks:
            self.tp.broadcast(self._prev_ids[: len(picks)])
            self._prev_rows = {items[i].req: k for k, i in enumerate(picks)}

    def _logits(self, items: list[ScheduleItem], scoring: bool, steps: int = 1
                ) -> tuple[torch.Tensor, list[tuple[list[int], int | None]] | None, list[Req] | None]:
        """One forward pass over ``items``: logits [N, V] float32, each item's (prompt-logprob
        rows, sample row) or None when item i samples row i, and the items' requests when
        the decode graph ran (None otherwise). ``scoring``: some item may score prompt
        tokens. ``steps`` > 1: the first step of a multi-step window; the decode graph, if
        it takes the step, stages the later steps' inputs too (``CudaGraphRunner.replay``)."""
        writes = [(it.req.pages, it.start, it.num_tokens) for it in items] if self.pool.tiered else []
        self.pool.begin_pass(writes)  # int4 / mixed: FP8 slots for the pages written
        reqs = None  # the decode graph's requests, one sampled row each, in order
        hidden = logits = None
        graph = self._replay_decode(items, scoring, steps)
        if graph is not None:  # the decode graph computes the logits too
            logits, reqs = graph
        else:
            inputs, inflight = self._inputs(items)
            hidden = self._replay_extend(items, inputs, inflight)
        rows = None  # a graph's rows: every item samples from its one row, in order
        if hidden is None and logits is None:
            batch, rows = self.prepare(items, inputs)
            if inflight:
                flat = to_device(torch.tensor([i for i, _ in inflight]), self.device)
                src = to_device(torch.tensor([r for _, r in inflight]), self.device)
                batch.input_ids[flat] = self._prev_ids[src]
            try:
                pieces = self.piecewise  # only for pools without a sink (pool_fits)
                if pieces is not None and batch.num_tokens <= pieces.max_tokens:
                    hidden = pieces.forward(batch)
                else:
                    hidden = self.model.forward(batch, self.pool)
            except BaseException:
                self.pool.unclaim_sinks(self._sink_claims)  # never written: no request may read them
                raise
        if writes:  # int4 / mixed: demote pages that left the FP8 window (all of a prompt's)
            self.pool.end_pass(writes, [it.num_tokens > 1 or it.start < len(it.req.prompt_ids) for it in items])
        if logits is None:
            logits = self.model.compute_logits(hidden)  # [N, V] float32
        return logits, rows, reqs

    def _launch_window(self, items: list[ScheduleItem], steps: int) -> PendingStep:
        """A multi-step window (runtime/scheduler/planner.py's docstring): ``steps`` decode steps
        of the same B requests launched back to back, each step's sampled ids feeding the
        next on the device (``_prev_ids``), and one PendingStep whose ``collect()`` reads the
        steps x B ids (``ItemResult.window_ids``). The planner grew every request's pages
        for the window; no item returns logprobs or has a grammar. The first step replays
        the decode graph, which stages every step's inputs in the same host-to-device copy,
        and each later step copies its inputs on the device and replays
        (``CudaGraphRunner.replay_next``). A greedy batch (no penalty: none in a window)
        takes the ids the graph wrote into ``_prev_ids`` as they are, so per later step the
        host launches the input copy, the graph and one copy of the ids; otherwise it samples
        and copies the ids there too. A batch no graph takes (CPU, eager) runs each step as
        an ordinary decode pass reading its inputs from the last."""
        b, reqs = len(items), [it.req for it in items]
        sb, rows_of, _ = self._sampling_batch(reqs)
        window = self._window_ids[: steps * b].view(steps, b)
        logits, _, graph_reqs = self._logits(items, False, steps)
        greedy = graph_reqs is not None and sb.all_greedy and not (
            sb.seen_ids.numel() or sb.output_ids.numel() or sb.banned_ids.numel())
        for i in range(steps):
            if i:
                if graph_reqs is not None:
                    logits = self.graph_runner.replay_next()
                else:
                    logits, _, _ = self._logits([ScheduleItem(it.req, it.start + i, 1, True) for it in items], False)
            if greedy:  # the graph's argmax rows, already the next step's inputs
                ids = self._prev_ids[:b]
            else:
                ids = sample(logits[:b], sb, self.generator, want_logprobs=False).next_ids
                self._prev_ids[:b].copy_(ids)  # the next step's inputs (and the next launch's)
            if self.tp is not None:
                self.tp.broadcast(self._prev_ids[:b])
            self._prev_rows = rows_of
            window[i].copy_(ids)
        step = PendingStep(items, picks=list(range(b)), decode_steps=steps)
        flat = self._window_ids[: steps * b]
        if self.device.type == "cuda":  # one copy to the host per window; wait in collect()
            self._ready_turn ^= 1
            host = self._window_host[self._ready_turn][: steps * b]
            host.copy_(flat, non_blocking=True)
            step.sampled = SampleResult(host, None)
            step.ready = self._ready_events[self._ready_turn]
            step.ready.record()
        else:
            step.sampled = SampleResult(flat.clone(), None)
        self._last_launch = step
        return step

    def _sampling_batch(self, reqs: list[Req]) -> tuple[SamplingBatch, dict[Req, int], bool]:
        """The SamplingBatch of these rows, each request's row, and whether any request has a
        grammar. When no row carries per-step state (a seed's step, the tokens a penalty
        counts), a batch of the same requests in the same order as the last one reuses all
        three (a steady decode batch builds them once, not once per step) and a batch of
        some of them indexes the last SamplingBatch on the device (``SamplingBatch.take``: a
        large batch loses a member nearly every step)."""
        key, cache = tuple(reqs), self._sampling_cache
        if cache is not None and cache[0] == key:
            return cache[1]
        stateless = all(req.sampling_info is not None for req in reqs)
        if stateless and cache is not None:  # the rows of the last batch, some gone: index it
            last_rows = cache[1][1]
            rows = [last_rows.get(req, -1) for req in reqs]
            sb = cache[1][0].take(rows, [req.sampling_info for req in reqs]) if -1 not in rows else None
        else:
            sb = None
        if sb is None:
            eos = self.eos_token_ids
            sb = SamplingBatch.build([req.sampling_info or _sampling_info(req, eos) for req in reqs], self.device)
            stateless = stateless or all(req.sampling_info is not None for req in reqs)  # set by the build
        batch = (sb, {req: i for i, req in enumerate(reqs)}, any(req.grammar is not None for req in reqs))
        self._sampling_cache = (key, batch) if stateless else None
        return batch

    def _grammar_for_step(self, req: Req) -> Any:
        """The request's grammar matcher, advanced past its token in flight if it has one:
        that token is read from the previous launch (waiting for it while this step's
        forward pass runs) and accepted now; the scheduler later consumes the verdict from
        ``req.grammar_ahead``. None (no mask) if the grammar is absent, refused the token or
        is complete: then the request finishes with that token and this row is discarded."""
        matcher = req.grammar
        if matcher is None or req.num_inflight <= len(req.grammar_ahead):
            return matcher
        prev = self._last_launch
        results = prev.collect()
        token = results[prev.picks[self._prev_rows[req]]].next_id
        accepted = bool(matcher.accept_token(token))
        req.grammar_ahead.append((token, accepted))
        return matcher if accepted and not matcher.is_terminated() else None

    def _inputs(self, items: list[ScheduleItem]) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """Each item's input token ids, and (flat index, row of the previous launch's
        samples) of the inputs not known yet on the host (written as -1 in the ids)."""
        inputs, inflight, base = [], [], 0
        for it in items:
            req, start, n = it.req, it.start, it.num_tokens
            ids = req.tokens(start, start + n)  # a new list
            if len(ids) < n:  # only the last one can be in flight
                inflight.append((base + n - 1, self._inflight_row(req, start, len(ids) == n - 1)))
                ids.append(-1)
            inputs.append(ids)
            base += n
        return inputs, inflight

    def _inflight_row(self, req: Req, start: int, only_last_missing: bool) -> int:
        """The row of the previous launch's samples that holds ``req``'s input token in flight.
        Raises RuntimeError if more than that token is missing or the last launch did not
        sample for ``req`` (a scheduler bug)."""
        row = self._prev_rows.get(req)
        if not only_last_missing or row is None:
            raise RuntimeError(f"request {req.rid}: input tokens missing at {start}")
        return row

    def _replay_decode(self, items: list[ScheduleItem], scoring: bool, steps: int = 1
                       ) -> tuple[torch.Tensor, list[Req]] | None:
        """Logits [B, V] float32 from a CUDA graph and the items' requests, if this step is a
        pure decode step that fits one (one token per item, each sampling, no prompt
        logprobs: none if not ``scoring``); else None. Reads each item's input token itself
        (``_inputs`` for one token per item, in the same loop as the rest). ``steps``: as
        ``CudaGraphRunner.replay``'s."""
        runner = self.graph_runner
        if runner is None or len(items) > runner.max_bs:
            return None
        input_ids, src, positions, tables, reqs, prev_rows = [], [], [], [], [], self._prev_rows
        for it in items:
            if it.num_tokens != 1 or not it.samples or (scoring and self._prompt_positions(it)):
                return None
            req, start = it.req, it.start
            out, k = req.output_ids, start - len(req.prompt_ids)
            if k < len(out):  # known on the host
                input_ids.append(out[k] if k >= 0 else req.prompt_ids[start])
                src.append(0)
            else:  # in flight: read from the previous launch's samples on the device
                row = prev_rows.get(req)
                input_ids.append(-1)
                src.append(row if row is not None else self._inflight_row(req, start, True))
            positions.append(start)
            tables.append(req.pages)
            reqs.append(req)
        pool = self.pool
        if self.model.attn_backend.cascade_worth(tables, pool):  # eager, with cascade decode
            return None
        sinks = [pool.sink_lookup(req.prompt_ids[0]) for req in reqs] if pool.has_sink else None
        return runner.replay(input_ids, positions, tables, src, reqs, sinks, steps), reqs

    def _replay_extend(self, items: list[ScheduleItem], inputs: list[list[int]],
                       inflight: list[tuple[int, int]]) -> torch.Tensor | None:
        """The hidden state [1, E] of the last token from an extend CUDA graph if this step
        is one request extending 2..max tokens known on the host that fit a graph padded
        (``CudaGraphRunner.fits_extend``), sampling after the last and scoring no prompt
        token; else None."""
        runner = self.graph_runner
        if runner is None or not runner.extend_sizes or len(items) != 1 or inflight or self.pool.loads_pending:
            return None  # a host-tier load in flight: the eager / piecewise path overlaps it layer by layer
        it = items[0]
        if not it.samples or not runner.fits_extend(it.start, it.num_tokens) or self._prompt_positions(it):
            return None
        sink = -1
        if self.pool.has_sink:
            sink = self.pool.sink_lookup(it.req.prompt_ids[0])
            if sink < 0 and it.start == 0 and not self.pool.sink_full:
                return None  # this pass claims and writes a sink slot: the eager path does that
        return runner.replay_extend(inputs[0], it.start, it.req.pages, it.req, sink)

    def prepare(self, items: list[ScheduleItem], inputs: list[list[int]] | None = None
                ) -> tuple[ForwardBatch, list[tuple[list[int], int | None]]]:
        """ForwardBatch + for each item (its prompt-logprob rows, its sample row)."""
        tokens, rows, flat, base = [], [], [], 0
        for k, it in enumerate(items):
            tokens.append(inputs[k] if inputs is not None else it.req.tokens(it.start, it.start + it.num_tokens))
            prompt_rows = [base + p - it.start for p in self._prompt_positions(it)]
            sample_row = base + it.num_tokens - 1 if it.samples else None
            rows.append((list(range(len(flat), len(flat) + len(prompt_rows))),
                         None if sample_row is None else len(flat) + len(prompt_rows)))
            flat += prompt_rows + ([sample_row] if sample_row is not None else [])
            base += it.num_tokens
        sinks = self._sinks(items)
        writes, self._sink_claims = None, []
        if sinks is not None:  # rows at position 0 whose sink slot this pass claims
            writes, base = [], 0
            for it, (slot, write) in zip(items, sinks, strict=True):
                if write:
                    writes.append((base, slot))
                    self._sink_claims.append(it.req.prompt_ids[0])
                base += it.num_tokens
        batch = ForwardBatch.build(tokens, [it.start for it in items], [it.req.pages for it in items],
                                   flat, self.page_size, self.device,
                                   None if sinks is None else [slot for slot, _ in sinks], writes)
        return batch, rows

    def _sinks(self, items: list[ScheduleItem]) -> list[tuple[int, bool]] | None:
        """Per item (sink slot, whether this pass writes it) if the pool keeps an exact
        attention sink (``KVPool.sink_slot``), else None. An item starting at position 0
        computes it and may claim a slot."""
        pool = self.pool
        if not pool.has_sink:
            return None
        return [pool.sink_slot(it.req.prompt_ids[0], it.start == 0) for it in items]

    @staticmethod
    def _prompt_positions(it: ScheduleItem) -> range:
        """Positions whose logits score a prompt token not yet scored (a recompute after
        preemption does not score twice)."""
        req = it.req
        if not req.wants_prompt_logprobs:
            return range(0)
        next_token = req.logprob_start_len + len(req.prompt_logprobs)
        first = max(next_token, it.start + 1) - 1
        last = min(it.start + it.num_tokens, len(req.prompt_ids) - 1)
        return range(first, last)

    def _prompt_logprobs(self, items: list[ScheduleItem], rows, logits: torch.Tensor,
                         results: list[ItemResult]) -> None:
        for it, (prompt_rows, _), res in zip(items, rows, results, strict=True):
            positions = self._prompt_positions(it)
            req = it.req
            # The first prompt token has no logprob: once, from the item that starts at 0 (with
            # overlap a later step may launch before this one's logprobs are recorded).
            lead = ([None] if req.wants_prompt_logprobs and req.logprob_start_len == 0 and it.start == 0
                    and not req.prompt_logprobs else [])
            if not positions and not lead:
                continue
            lps = torch.log_softmax(logits[prompt_rows], dim=-1)  # [n, V]
            targets = torch.tensor([req.prompt_ids[p + 1] for p in positions], device=lps.device)
            chosen = lps.gather(1, targets[:, None]).squeeze(1).tolist() if len(positions) else []
            res.prompt_logprobs = lead + chosen
            if req.top_logprobs_num:
                res.prompt_top_logprobs = [None] * len(lead) + _top(lps, req.top_logprobs_num)

    def _sample(self, items: list[ScheduleItem], rows, logits: torch.Tensor, step: PendingStep,
                want_logprobs: bool, reqs: list[Req] | None = None) -> None:
        """Sample every item's row; ``rows``: per item (its prompt-logprob rows, its sample
        row or None), or None when item i samples row i of ``logits`` (``reqs``: the items'
        requests, if already listed). ``want_logprobs``: some item returns logprobs (else
        the sampled tokens' logprobs are not computed)."""
        if rows is None:  # item i samples row i
            picks = list(range(len(items)))
            reqs, sample_rows = reqs or [it.req for it in items], picks
        else:
            picks = [i for i, (_, r) in enumerate(rows) if r is not None]
            reqs, sample_rows = [items[i].req for i in picks], [rows[i][1] for i in picks]
        if not picks:
            return
        # Top logprobs only reach a request that returns logprobs (Scheduler._append_token).
        top_k = max(req.top_logprobs_num for req in reqs) if want_logprobs else 0
        sb, rows_of, grammar = self._sampling_batch(reqs)
        mask = None
        if grammar:
            matchers = [self._grammar_for_step(req) for req in reqs]
            if any(m is not None for m in matchers):
                mask = partial(self.grammar_masker.apply, matchers=matchers)
        if sample_rows is picks or sample_rows == list(range(sample_rows[0], sample_rows[0] + len(sample_rows))):
            chosen = logits[sample_rows[0] : sample_rows[0] + len(sample_rows)]  # a view: no index copy
        else:
            chosen = logits[to_device(torch.tensor(sample_rows), self.device)]
        out = sample(chosen, sb, self.generator, top_k_logprobs=top_k, logits_mask=mask,
                     want_logprobs=want_logprobs)
        self._prev_ids[: len(picks)].copy_(out.next_ids)  # inputs of the next launch (overlap)
        if self.tp is not None:  # the other ranks feed rank 0's tokens (``follow``)
            self.tp.broadcast(self._prev_ids[: len(picks)])
        self._prev_rows = rows_of
        step.picks, step.sampled = picks, out
        if self.device.type == "cuda":  # start the copies to the host now, wait in collect()
            # Two events and two pinned id buffers in turn: a new event's record() cost 42 us
            # of host time per step on the H200 host (creating it included). Step k's buffer
            # and event are reused by launch k + 2, after step k was collected (the scheduler
            # collects the step in flight right after the next launch; collect() reads the
            # buffer once).
            self._ready_turn ^= 1
            host_ids = self._host_ids[self._ready_turn][: len(picks)]
            host_ids.copy_(out.next_ids, non_blocking=True)
            step.sampled = SampleResult(host_ids, *(t.to("cpu", non_blocking=True) if t is not None else None
                                                    for t in (out.logprobs, out.top_ids, out.top_logprobs)))
            step.ready = self._ready_events[self._ready_turn]
            step.ready.record()


def _top(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    top = logprobs.topk(k, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]


def _sampling_info(req: Req, eos_token_ids: Iterable[int]) -> SamplingInfo:
    """The request's SamplingInfo for this step. While it has fewer than ``min_new_tokens``
    outputs, its stop token ids and (unless ``ignore_eos``) ``eos_token_ids`` are banned,
    unless a grammar constrains it (the grammar's EOS outranks min_new_tokens, as SGLang's). A
    request with no per-step state (no seed, no penalty, nothing banned) keeps its one in
    ``req.sampling_info``: a batch whose members change every step (large batches: some
    request finishes every step) rebuilds its SamplingBatch from cached rows, not from new
    validated objects."""
    sp = req.sampling
    step = len(req.output_ids) + req.num_inflight
    banned = ()
    if step < sp.min_new_tokens and req.grammar is None:
        banned = tuple({*sp.stop_token_ids, *(() if sp.ignore_eos else eos_token_ids)})
    info = SamplingInfo(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty, frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty, seed=sp.seed, step=step,
        output_ids=req.output_ids, prompt_ids=req.prompt_ids, banned_ids=banned,
    )
    if sp.seed is None and not has_penalties(sp) and not banned:
        req.sampling_info = info
    return info


def _eos_token_ids(model_dir: str, config, tokenizer) -> set[int]:
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    gen_cfg = Path(model_dir) / "generation_config.json"
    if gen_cfg.exists():
        add(json.loads(gen_cfg.read_text()).get("eos_token_id"))
    return ids
