"""The scheduler process: owns the model, the KV pool and the radix tree.

Request lifecycle (docs/ARCHITECTURE.md has the long form):
  1. receive a tokenized GenerateReq (already validated by the tokenizer process);
  2. the planner admits it: page-aligned prefix match in the radix tree, lock, page table
     starts with the shared pages (``cached_tokens`` = matched length);
  3. each step the planner advances requests under the token budget (chunked prefill,
     decode) and the model runner executes the decision (forward + sample);
  4. after its prompt is computed a request's full pages are inserted into the tree so
     concurrent requests share them; on finish the rest is inserted, unlocked and freed;
  5. under memory pressure unlocked leaves are evicted, then requests preempted.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from radixlm.radix import RadixTree
from radixlm.runtime import messages as m
from radixlm.runtime.executor.kv_calibration import KVScalesError
from radixlm.runtime.executor.model_loader import usable_cores
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.models import UnsupportedArchitecture
from radixlm.runtime.executor.parallel import COLLECTIVE_TIMEOUT, PeerPlacement, RankPlacement
from radixlm.runtime.executor.sampling import has_penalties
from radixlm.runtime.ipc import MsgSocket
from radixlm.runtime.kv_events import KVEventPublisher, KVEventRecorder
from radixlm.runtime.memory.page_allocator import PageAllocator
from radixlm.runtime.scheduler.decision import ItemResult, PendingStep
from radixlm.runtime.scheduler.hicache import HiCache, TierConfigError
from radixlm.runtime.scheduler.peer import PeerCache
from radixlm.runtime.scheduler.planner import BatchPlanner
from radixlm.runtime.scheduler.prefix_cache import PrefixCache
from radixlm.runtime.scheduler.request import Req
from radixlm.runtime.scheduler.stop_checker import StopChecker
from radixlm.runtime.scheduler.tensor_parallel import LeaderRunner, StepSender
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.text.grammar import GrammarCache, allows_a_token, grammar_of

__all__ = ["Scheduler", "run_scheduler_process"]

# start-up failures caused by the user's model or files: logged as their message, no traceback
_USER_ERRORS = (KVScalesError, UnsupportedArchitecture, TierConfigError)

logger = logging.getLogger("radixlm.scheduler")
STATS_INTERVAL_S = 0.5


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner) -> None:
        self.args = args
        self.runner = runner
        self.allocator = PageAllocator(runner.num_pages)
        tiered = getattr(runner.pool, "tiered", False)  # int4 / mixed KV (stub runners: none)
        if tiered:
            runner.pool.attach_allocator(self.allocator)  # their FP8 slots of freed pages come back
        tree = self.hicache = None
        if not args.disable_radix_cache:
            tiers = () if not args.hicache_enabled else ("host", "disk") if args.hicache_storage_dir else ("host",)
            tree = RadixTree(args.page_size, eviction_policy=args.radix_eviction_policy, tiers=tiers)
            if tiers:
                self.hicache = make_hicache(args, runner, tree)
        self.cache = PrefixCache(self.allocator, tree, args.page_size, self.hicache)
        self.planner = BatchPlanner(
            self.cache,
            max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            max_running_requests=args.max_running_requests,
            enable_prefix_reuse=not args.disable_radix_cache,
            preemption_policy=args.preemption_policy,
            importance_weights=args.importance_weight_values(),
            reserve_ratio_init=args.decode_reserve_ratio,
            reserve_ratio_min=args.decode_reserve_min_ratio,
            preemption_mode=args.preemption_mode,
            # int4 / mixed pools cannot swap (KVPool.read_pages): auto then always recomputes.
            swap_capacity_tokens=0 if tiered
            else int(args.swap_space_gb * 2**30) // runner.pool.bytes_per_token,
            swap_is_cheaper=runner.swap_cost_model().swap_is_cheaper,
            context_length=runner.context_length,
            schedule_policy=args.schedule_policy,
            schedule_max_wait_s=args.schedule_max_wait_s,
            schedule_max_passes=args.schedule_max_passes,
            admit_batch=_admit_batch(args, runner),
            admit_max_wait_steps=args.admit_max_wait_steps,
            # int4 / mixed pools track the pages each pass writes (KVPool.begin_pass): one step at a
            # time. The runner's buffers bound the window (the same args in a server).
            decode_window=1 if tiered else min(args.num_scheduler_steps, getattr(runner, "max_decode_window", 1)),
        )
        # Overlap hides the host's work behind the device's; on the CPU the forward pass runs
        # on the host, so overlapping only delays every token by a step (a whole decode step
        # added to each TTFT).
        self.overlap = (runner.device.type != "cpu" if args.disable_overlap_schedule is None
                        else not args.disable_overlap_schedule)
        self.inflight: PendingStep | None = None  # launched, results not read yet
        self._out_of_memory: list[Req] = []  # planned out of pages, finished after the step in flight
        self.stop_checker = StopChecker(runner.tokenizer, runner.eos_token_ids, runner.context_length)
        self.reqs: dict[str, Req] = {}
        self.outbox: list[m.ReqOutput] = []
        # Streamed outputs of one plain token: BatchOutput's columns (see BatchOutput).
        self.token_rids: list[str] = []
        self.token_ids: list[int] = []
        self.control_out: list[Any] = []
        self.counters = dict(prefill_computed=0, prefill_cached=0, decode=0, recomputed=0, steps=0, decode_steps=0,
                             busy_s=0.0, decode_busy_s=0.0)
        self._decode_step = False  # the step being run launched a pure decode pass
        self._waited = 0.0  # seconds the current step waited for the device
        self._last_stats = 0.0
        self.violations: list[str] = []
        self._grammars: GrammarCache | None = None  # built on the first grammar request
        self.grammar_waiting: list[tuple[Req, Future]] = []  # compiling off the loop
        self._penalised: set[Req] = set()  # live requests with a penalty (see _needs_tokens)
        self.dp_rank = 0  # this replica's index with data parallelism (its stats carry it)
        self.peer: PeerCache | None = None  # the peer KV tier (attach_peer)
        self.kv_publisher: KVEventPublisher | None = None  # --kv-events-endpoint (attach_kv_events)

    def attach_peer(self, link: Any, outboxes: dict[int, Any], rate: float, latency: float) -> None:
        """Turn on the peer KV tier (``--enable-peer-kv``): ``link`` a ``PeerKVLink`` of this
        replica, ``outboxes`` sockets to the other replicas' schedulers by dp rank, ``rate``
        and ``latency`` the measured peer read bandwidth (bytes/s) and one-page transfer
        time (s), added to the tiers' cost model under ``peer``."""
        costs = self.hicache.costs if self.hicache is not None else self.runner.tier_costs()
        costs = dataclasses.replace(costs, read_bytes_per_s={**costs.read_bytes_per_s, "peer": rate},
                                    latency_s={**costs.latency_s, "peer": latency},
                                    always_load=self.args.hicache_load_policy == "always")
        if self.hicache is not None:
            self.hicache.costs = costs
            self.hicache.info["read_bytes_per_s"] = costs.read_bytes_per_s
        self.peer = PeerCache(self.dp_rank, self.cache, link, outboxes, costs, self.args.peer_kv_timeout_s,
                              self.args.peer_kv_min_wait_s)
        self.peer.info = {"backend": link.backend, "read_bytes_per_s": rate, "latency_s": latency,
                          "page_bytes": link.page_bytes, "recompute_flops_per_s": costs.compute.flops_per_s,
                          "timeout_s": self.args.peer_kv_timeout_s, "min_wait_s": self.args.peer_kv_min_wait_s}
        self.cache.peer = self.peer

    def attach_kv_events(self, publisher: KVEventPublisher) -> None:
        """Publish the radix cache's block events through ``publisher`` from now on (one
        batch per loop turn that changed the tree, sent before that turn's outputs)."""
        self.kv_publisher = publisher
        self.cache.events = KVEventRecorder(self.args.page_size)

    # ----------------------------------------------------------------- messages
    def handle(self, msg: Any) -> None:
        if isinstance(msg, m.GenerateReq):
            self._on_generate(msg)
        elif isinstance(msg, m.AbortReq):
            self._on_abort(msg.rid)
        elif isinstance(msg, m.FlushCacheReq):
            ok = not self.reqs and self.cache.flush()
            reason = "" if ok else "requests are running; flush when idle"
            self.control_out.append(m.FlushCacheOut(success=ok, message=reason))
        elif isinstance(msg, m.CheckInvariantsReq):
            self.control_out.append(self._invariants_report())
        elif isinstance(msg, m.PeerFetchReq | m.PeerFetchOut) and self.peer is not None:
            if isinstance(msg, m.PeerFetchReq):
                self.peer.on_request(msg)
            else:
                self.peer.on_answer(msg)
        else:
            logger.warning("unexpected message %s", type(msg).__name__)

    def _on_generate(self, msg: m.GenerateReq) -> None:
        if msg.rid in self.reqs:
            self.outbox.append(m.ReqOutput(rid=msg.rid, new_token_ids=[], finish_reason="abort",
                                           error=f"duplicate request id {msg.rid!r}"))
            return
        req = Req.from_message(msg, arrival=time.monotonic())
        self.reqs[req.rid] = req
        if has_penalties(req.sampling):
            self._penalised.add(req)
        # max_new_tokens == 0 still runs the prompt (it is scored and cached, as SGLang's
        # frontend relies on for fork warm-up / cache_prefix); no token is appended.
        grammar = grammar_of(req.sampling)
        if grammar is None and not req.return_logprob:
            self.stop_checker.set_fast_path(req)
            # min_new_tokens bans ids per step (model_runner._sampling_info): one step at a time
            req.multi_step = (req.sampling.seed is None and not has_penalties(req.sampling)
                              and req.sampling.min_new_tokens == 0)
        if grammar is not None:
            self.grammar_waiting.append((req, self.grammars.get(grammar)))
            return
        self.planner.add(req)

    @property
    def grammars(self) -> GrammarCache:
        if self._grammars is None:
            self._grammars = GrammarCache(self.runner.tokenizer, self.runner.vocab_size, self.runner.eos_token_ids)
        return self._grammars

    def _poll_grammars(self) -> None:
        """Queue the requests whose grammar finished compiling (or fail them)."""
        still = []
        for req, future in self.grammar_waiting:
            if req.finished:
                continue
            if not future.done():
                still.append((req, future))
                continue
            try:
                req.grammar = self.grammars.matcher(future.result())
            except Exception as exc:  # the tokenizer process checked it: should not happen
                req.finish("abort", error=f"grammar failed to compile: {exc}")
                self._finish(req)
                continue
            self.planner.add(req)
        self.grammar_waiting = still

    def _on_abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is not None:
            req.finish("abort", error="aborted by the client")
            self._finish(req)

    # ----------------------------------------------------------------- one step
    def step(self) -> bool:
        """Plan and launch one forward pass and process the previous one's results.
        Returns False if there was nothing to do.

        Overlap scheduling (SGLang's overlap scheduler): the step planned now is launched
        before the host reads the tokens the step in flight samples, so planning, page
        bookkeeping and output processing run while the device computes. A request whose
        token is still in flight decodes it from the device (``Req.num_inflight``); one that
        turns out finished costs one wasted token. A grammar request's mask needs that
        token: the model runner reads it from the previous launch while the new forward
        pass runs (``ModelRunner._grammar_for_step``). Repetition / frequency / presence
        penalties need every token on the host first: then the step in flight is read
        before planning.
        """
        start, self._waited, self._decode_step = time.perf_counter(), 0.0, False
        try:
            return self._step()
        finally:
            busy = time.perf_counter() - start - self._waited
            self.counters["busy_s"] += busy
            if self._decode_step:
                self.counters["decode_busy_s"] += busy

    def _step(self) -> bool:
        if self.grammar_waiting:
            self._poll_grammars()
        self.cache.take_arrivals()  # peer pages, before the plan frees and hands out pages
        collected = False
        if self.inflight is not None and self._needs_tokens():
            self._collect()
            collected = True
        decision = self.planner.plan()
        self.cache.issue()  # tier copies planned (hierarchical cache) go before the launch
        # Out of pages: finished once the step in flight is read, so the tokens it samples
        # for them (a whole window's, with --num-scheduler-steps) are kept, not dropped.
        self._out_of_memory = decision.out_of_memory
        if self.inflight is None:
            self._fail_out_of_memory()
        if decision.swap_out or decision.swap_in:
            self.runner.apply_swaps(decision)
        launched = None
        if decision.items:
            steps = decision.decode_steps  # > 1: a multi-step window, that many forward passes
            self.counters["steps"] += steps
            self._decode_step = all(it.num_tokens == 1 and it.samples for it in decision.items)
            self.counters["decode_steps"] += steps if self._decode_step else 0
            launched = self.runner.launch(decision)
            self._advance(launched)
        if self.inflight is not None:
            self._collect()
            collected = True
        self._fail_out_of_memory()
        self.inflight = launched
        if launched is not None and not self.overlap:
            self._collect()
        if self.args.debug_invariants and (launched is not None or collected):
            self._debug_check("after step")
        return launched is not None or collected

    def _fail_out_of_memory(self) -> None:
        """Finish the requests the last plan found no pages for (the planner released them),
        unless the tokens read since finished them."""
        for req in self._out_of_memory:
            if req.finish_reason is None:
                req.finish("length", error="KV cache pool is full")
                self._finish(req)
        self._out_of_memory = []

    def _needs_tokens(self) -> bool:
        """True if a live request's next step may need its previous token on the host (a
        penalty counts the tokens; waiting requests included, which only costs overlap)."""
        return bool(self._penalised)

    def _advance(self, step: PendingStep) -> None:
        """Bookkeeping of a launched step, before its results are known: computed tokens
        advance, sampled tokens are in flight. Records what the results will need."""
        was_prefill, ends_prefill, recomputed = [], [], 0
        extra = step.decode_steps - 1  # a window: each item feeds its sampled tokens back
        for item in step.items:
            req = item.req
            start, n_prompt, high = req.num_computed, len(req.prompt_ids), req.max_computed
            end = start + item.num_tokens + extra
            if high > start:  # recomputed after a preemption
                recomputed += min(high, end) - start
            if high < end:
                req.max_computed = end
            req.num_computed = end
            if item.samples:
                req.num_inflight += 1 + extra
            prefill = start < n_prompt
            ends = prefill and n_prompt <= end
            was_prefill.append(prefill)
            ends_prefill.append(ends)
            if ends:
                # Share the prompt's pages now, not when the results are read: a waiting
                # request with the same prefix may be planned before that (overlap) and
                # must find it cached. The KV is still being computed, but every later
                # step that reads it runs after this one on the device.
                self.cache.cache(req)
        self.counters["recomputed"] += recomputed
        step.was_prefill, step.ends_prefill = was_prefill, ends_prefill

    def _safe_step(self) -> bool:
        """step(), but an exception (a bug, a device error) fails the requests in flight
        with an error instead of killing the server; their pages are freed."""
        try:
            return self.step()
        except Exception as exc:  # report and keep serving
            if getattr(self.runner, "tp", None) is not None:  # the other ranks wait in a collective
                logger.exception("scheduler step failed with tensor parallelism: stopping")
                raise
            logger.exception("scheduler step failed; aborting %d requests", len(self.planner.running))
            self.inflight = None
            stranded = list(self.planner.running) + [r for r in self.planner.waiting if r.num_inflight]
            stranded += [r for r in self._out_of_memory if r.finish_reason is None]
            self._out_of_memory = []
            for req in stranded:
                req.finish("abort", error=f"internal error: {type(exc).__name__}: {exc}")
                self._finish(req)
            return True

    def _collect(self) -> None:
        """Wait for the step in flight and process its results."""
        step, self.inflight = self.inflight, None
        results = step.collect()
        self._waited += step.wait_seconds
        self._process_results(step, results)

    def _process_results(self, step: PendingStep, results: list[ItemResult]) -> None:
        if step.decode_steps > 1:
            self._process_window(step, results)
            return
        counters, interval = self.counters, self.args.stream_interval
        token_rids, token_ids = self.token_rids, self.token_ids
        decoded = 0
        for item, res, was_prefill, ends_prefill in zip(step.items, results, step.was_prefill,
                                                        step.ends_prefill, strict=True):
            req = item.req
            if req.finish_reason is not None:  # finished or aborted after this step was launched: discard
                continue
            if was_prefill:
                counters["prefill_computed"] += item.num_tokens
            else:
                decoded += item.num_tokens
            if res.prompt_logprobs is not None:
                req.prompt_logprobs.extend(res.prompt_logprobs)
                req.prompt_top_logprobs.extend(res.prompt_top_logprobs or [None] * len(res.prompt_logprobs))
            if ends_prefill and not req.output_ids:  # first pass through the prompt
                counters["prefill_cached"] += req.cached_tokens
            token = res.next_id
            if token is not None:
                self._take_token(req, token, res)
            if req.finish_reason is not None:
                self._finish(req)
            elif req.stream and len(req.output_ids) - req.num_sent >= interval:
                sent = req.num_sent
                # One plain token (this step's; see BatchOutput): the columns.
                if sent and len(req.output_ids) == sent + 1 and not req.return_logprob:
                    token_rids.append(req.rid)
                    token_ids.append(token)
                    req.num_sent = sent + 1
                else:
                    self._emit(req)
        counters["decode"] += decoded

    def _process_window(self, step: PendingStep, results: list[ItemResult]) -> None:
        """A multi-step window's results: each item's tokens in order (``res.window_ids``),
        through the per-token checks of a single step; a request that finishes inside the
        window drops the tokens after its finishing one. A streamed request gets one output
        of all its new tokens per window."""
        counters, decoded, interval = self.counters, 0, self.args.stream_interval
        for item, res, was_prefill in zip(step.items, results, step.was_prefill, strict=True):
            req = item.req
            if req.finish_reason is not None:  # finished or aborted after the window was launched
                continue
            tokens, out = res.window_ids, req.output_ids
            known = len(out)
            if was_prefill:  # its first step fed the prompt's last token (the rest was cached)
                counters["prefill_computed"] += 1
                if not out:
                    counters["prefill_cached"] += req.cached_tokens
            stop_ids = req.fast_stop_ids
            if stop_ids is not None and len(out) + len(tokens) < req.output_limit and stop_ids.isdisjoint(tokens):
                out.extend(tokens)  # the fast path's outcome for every token: none ends it
                req.num_inflight -= len(tokens)
                tokens = ()
            for token in tokens:
                self._take_token(req, token)
                if req.finish_reason is not None:
                    break
            # Each token kept came from one step's input; those after a stop are not counted.
            decoded += len(out) - known - was_prefill
            if req.finish_reason is not None:
                self._finish(req)  # num_inflight 0: the tokens after the finishing one are dropped
            elif req.stream and len(out) - req.num_sent >= interval:
                self._emit(req)
        counters["decode"] += decoded

    def _take_token(self, req: Req, token: int, res: ItemResult | None = None) -> None:
        """A token read back for ``req`` (one of its tokens in flight): appended and checked
        (``res``: its logprobs, if any). A request on the fast path (``Req.fast_stop_ids``)
        gets ``_append_token``'s outcome without its checks."""
        req.num_inflight -= 1
        stop_ids = req.fast_stop_ids
        if stop_ids is None:
            self._append_token(req, res if res is not None else ItemResult(token))
            return
        out = req.output_ids
        out.append(token)
        if token in stop_ids:
            req.finish("stop", token)
        elif len(out) >= req.output_limit:
            req.finish("length")

    def _append_token(self, req: Req, res: ItemResult) -> None:
        if req.sampling.max_new_tokens == 0:  # prompt scoring only
            req.finish("length")
            return
        req.output_ids.append(res.next_id)
        if req.return_logprob:
            req.output_logprobs.append(res.logprob)
            if req.top_logprobs_num:
                req.output_top_logprobs.append(res.top_logprobs or [])
        if req.grammar is not None:
            token, accepted = (req.grammar_ahead.pop(0) if req.grammar_ahead
                               else (res.next_id, req.grammar.accept_token(res.next_id)))
            if token != res.next_id or not accepted:
                req.output_ids.pop()  # the rejected token is not output, nor its logprobs
                kept = len(req.output_ids)
                del req.output_logprobs[kept:], req.output_top_logprobs[kept:]
                if token == res.next_id and not allows_a_token(req.grammar, self.grammars.vocab_size):
                    req.finish("abort", error="the request's grammar allows no token of the model's vocabulary "
                                              f"after {len(req.output_ids)} generated tokens (it needs text "
                                              "that no sequence of tokens spells)")
                else:
                    req.finish("abort", error=f"internal error: token {res.next_id} rejected by the request's grammar")
                return
        verdict = self.stop_checker.check(req)
        if verdict is not None:
            req.finish(*verdict)
        elif req.grammar is not None and req.grammar.is_terminated():
            # The grammar is complete and took a stop token (an EOS, also under ignore_eos or
            # min_new_tokens): reported as matched, as SGLang does.
            req.finish("stop", req.output_ids[-1])

    def _finish(self, req: Req) -> None:
        # Tokens still in flight are dropped; their KV positions may be computed already.
        req.num_inflight = 0
        req.num_computed = min(req.num_computed, req.num_known)
        self.planner.remove(req)
        self.reqs.pop(req.rid, None)
        self._penalised.discard(req)
        if req.finish_reason != "abort" or req.error != "aborted by the client":
            self._emit(req)

    def _emit(self, req: Req) -> None:
        num_out = len(req.output_ids)
        new = slice(req.num_sent, num_out)
        out = m.ReqOutput(
            rid=req.rid,
            new_token_ids=req.output_ids[new],
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            cached_tiers=req.cached_tiers,
            finish_reason=req.finish_reason,
            matched_stop=req.matched_stop,
            error=req.error,
        )
        if req.return_logprob:
            out.new_logprobs = req.output_logprobs[new]
            if req.top_logprobs_num:
                out.new_top_logprobs = req.output_top_logprobs[new]
            if not req.prompt_logprobs_sent and req.wants_prompt_logprobs:
                out.prompt_logprobs = req.prompt_logprobs
                out.prompt_top_logprobs = req.prompt_top_logprobs if req.top_logprobs_num else None
                req.prompt_logprobs_sent = True
        req.num_sent = num_out
        self.outbox.append(out)

    # ----------------------------------------------------------------- stats / checks
    def stats(self) -> m.SchedulerStats:
        return m.SchedulerStats(
            dp_rank=self.dp_rank,
            num_running=len(self.planner.running),
            num_waiting=len(self.planner.waiting),
            kv_total_pages=self.allocator.capacity,
            kv_used_pages=self.cache.used_pages,
            kv_cached_pages=self.cache.cached_pages,
            prefill_tokens_computed=self.counters["prefill_computed"],
            prefill_tokens_cached=self.counters["prefill_cached"],
            decode_tokens=self.counters["decode"],
            num_preemptions=self.planner.num_preemptions,
            num_evicted_pages=self.cache.num_evicted_pages,
            num_swapped_out=self.planner.num_swapped_out,
            prefill_tokens_recomputed=self.counters["recomputed"],
            forward_steps=self.counters["steps"],
            decode_steps=self.counters["decode_steps"],
            scheduler_busy_seconds=self.counters["busy_s"],
            scheduler_decode_busy_seconds=self.counters["decode_busy_s"],
            kv_waste_tokens=self.cache.waste_tokens(self.planner.running),
            page_size=self.args.page_size,
            kv_sink_slots_total=self.runner.pool.sink_slots,
            kv_sink_slots_used=self.runner.pool.sink_tokens,
            hicache=self._hicache_stats(),
            peer=msgspec.structs.replace(self.peer.stats) if self.peer is not None else None,
        )

    def _hicache_stats(self) -> m.HiCacheStats | None:
        hc = self.hicache
        if hc is None:
            return None
        st, tree = hc.stats, hc.tree
        return m.HiCacheStats(
            host_pages_total=hc.host_rows.capacity, host_pages_used=tree.tier_pages(0),
            disk_pages_total=hc.disk.capacity_pages if hc.disk is not None else 0,
            disk_pages_used=tree.tier_pages(1) if hc.disk is not None else 0,
            hit_tokens=dict(st.hit_tokens), pages_moved=dict(st.pages_moved), page_bytes=hc.host.page_bytes,
            prefetch_hits=st.prefetch_hits, prefetch_timeouts=st.prefetch_timeouts, prefetch_failed=st.prefetch_failed,
            prefetch_failures=st.prefetch_failures, prefetch_seconds=st.prefetch_seconds,
            prefetch_count=st.prefetch_count, skipped_loads=st.skipped_loads,
            disk_writes_skipped=st.disk_writes_skipped)

    def check_invariants(self) -> None:
        """Raise AssertionError if page accounting, the radix tree or (int4 / mixed) the FP8
        slots of the KV pool are inconsistent."""
        self.cache.check_invariants(self.planner.live)
        if getattr(self.runner.pool, "tiered", False):
            self.runner.pool.check_invariants()

    def _debug_check(self, when: str) -> None:
        try:
            self.check_invariants()
        except AssertionError as exc:  # log and record, never kill the server
            logger.error("invariant violated %s: %s", when, exc)
            self.violations.append(f"{when}: {exc}")

    def _invariants_report(self) -> m.CheckInvariantsOut:
        try:
            self.check_invariants()
            ok, message = True, ""
        except AssertionError as exc:
            ok, message = False, str(exc)
        tree = self.cache.tree
        return m.CheckInvariantsOut(
            ok=ok, message=message, num_live=len(self.planner.live), free_pages=self.allocator.num_free,
            cached_pages=self.cache.cached_pages, locked_pages=tree.protected_pages if tree else 0,
            violations=list(self.violations))

    @property
    def has_work(self) -> bool:
        return bool(self.planner.running or self.planner.waiting or self.inflight is not None)

    @property
    def idle_timeout_ms(self) -> int:
        """How long the loop may block on messages: 0 with work, 1 ms when the only work is
        requests waiting for a peer's pages or a disk prefetch (their arrival is polled: no
        busy wait that would take the GIL and the core the copy or the disk reader threads
        need), a few ms while grammars compile on their thread (no busy wait), else 50."""
        if self.has_work:
            idle = not self.planner.running and self.inflight is None
            waits = ((self.peer is not None and self.peer.busy)
                     or (self.hicache is not None and bool(self.hicache.prefetches)))
            return 1 if idle and waits else 0
        return 5 if self.grammar_waiting else 50

    # ----------------------------------------------------------------- event loop
    def run_forever(self, recv: MsgSocket, send: MsgSocket, parent_pid: int | None = None,
                    stop: threading.Event | None = None, idle_spin_s: float = 0.0) -> None:
        """Serve ``recv`` until the parent process is gone or ``stop`` is set (checked
        every loop, at least every 50 ms). ``idle_spin_s``: with no work (and no grammar
        compiling), poll for messages without blocking until this long after the last turn
        that had messages or work (``MsgSocket.recv``'s ``spin_s``; ``--idle-spin-ms``), then
        block."""
        last_work = time.perf_counter()
        while stop is None or not stop.is_set():
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.error("parent process is gone; exiting")
                return
            timeout = self.idle_timeout_ms
            spin = 0.0  # not while a grammar compiles: its thread needs the GIL
            if timeout and idle_spin_s and not self.grammar_waiting:
                spin = last_work + idle_spin_s - time.perf_counter()
            msg = recv.recv(timeout_ms=timeout, spin_s=spin)
            msgs = ([msg] if msg is not None else []) + recv.recv_all()
            worked = self.serve_once(msgs, send)
            if worked or msgs:
                last_work = time.perf_counter()
            if not worked and not self.has_work and self.args.debug_invariants and msgs:
                self._debug_check("when idle")

    def serve_once(self, msgs: list[Any], send: Any) -> bool:
        """One turn of the loop: handle ``msgs``, run one step (``_safe_step``), send its
        outputs with ``send.send`` (a MsgSocket: encoded and queued). The seconds spent
        handling and sending are added to the busy counters as well as the step's own, so
        ``scheduler_decode_busy_seconds`` holds all the loop's host time of a decode step
        but the wait for messages. Returns what the step returned."""
        start = time.perf_counter()
        for msg in msgs:
            self.handle(msg)
        handled = time.perf_counter() - start
        worked = self._safe_step()
        start = time.perf_counter()
        self._flush(send)
        extra = handled + time.perf_counter() - start
        self.counters["busy_s"] += extra
        if self._decode_step:
            self.counters["decode_busy_s"] += extra
        return worked

    def close(self) -> None:
        """Stop the grammar compiler's worker thread, the KV event publisher (after the batches
        queued so far) and the disk tier's I/O threads (after the writes queued so far; the
        model is freed with the object)."""
        if self._grammars is not None:
            self._grammars.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        if self.hicache is not None:
            self.hicache.drain()
            if self.hicache.disk is not None:
                self.hicache.disk.close()

    def take_outputs(self) -> m.BatchOutput | None:
        """The outputs made since the last call, as sent to the tokenizer process (None if
        there are none)."""
        if not self.outbox and not self.token_rids:
            return None
        batch = m.BatchOutput(outputs=self.outbox, token_rids=self.token_rids, token_ids=self.token_ids)
        self.outbox, self.token_rids, self.token_ids = [], [], []
        return batch

    def _flush(self, send: MsgSocket) -> None:
        if self.kv_publisher is not None and (events := self.cache.events.take()):
            self.kv_publisher.publish(events)  # before the outputs: a router sees the blocks first
        batch = self.take_outputs()
        if batch is not None:
            send.send(batch)
        for msg in self.control_out:
            send.send(msg)
        self.control_out = []
        now = time.monotonic()
        if now - self._last_stats > STATS_INTERVAL_S:
            send.send(self.stats())
            self._last_stats = now


def make_hicache(args: ServerArgs, runner: ModelRunner, tree: RadixTree) -> HiCache:
    """The hierarchical cache under ``tree``: a host pool of ``args.hicache_host_bytes``,
    the disk store of ``--hicache-storage-dir`` (indexed: an earlier process's pages are
    matchable), bandwidths measured (``ModelRunner.tier_costs``). TierConfigError when the
    host tier would not be larger than the device pool (as SGLang's HiCache requires: every
    device page is copied down, so a smaller host tier keeps dropping what it just took), or
    would take more than the host's available memory, or when the storage folder cannot be
    created and written, or its quota holds no page."""
    from radixlm.runtime.memory.disk_store import DiskStore
    from radixlm.runtime.memory.host_pool import HostKVPool, host_page_bytes

    page_bytes = host_page_bytes(runner.pool)
    host_bytes = args.hicache_host_bytes(runner.pool.total_bytes)
    rows = host_bytes // page_bytes
    device_pages = runner.pool.num_pages
    if rows <= device_pages:
        raise TierConfigError(
            f"the host KV tier ({rows} pages, {host_bytes / 2**30:.3g} GiB) must be larger than the device KV "
            f"pool ({device_pages} pages, {runner.pool.total_bytes / 2**30:.3g} GiB): raise --hicache-size-gb, "
            "or give --hicache-ratio > 1")
    available = _available_host_bytes()
    if available is not None and rows * page_bytes > available:
        raise TierConfigError(
            f"the host KV tier needs {rows * page_bytes / 2**30:.3g} GiB, more than the "
            f"{available / 2**30:.3g} GiB of host memory available: lower --hicache-size-gb / --hicache-ratio")
    host = HostKVPool(runner.pool, rows + 1, args.hicache_io_backend)  # row 0 unused (PageAllocator)
    disk = None
    if args.hicache_storage_dir is not None:
        try:
            disk = DiskStore(args.hicache_storage_dir, runner.kv_identity(), args.page_size, page_bytes,
                             int(args.hicache_storage_size_gb * 2**30))
        except OSError as exc:
            raise TierConfigError(f"--hicache-storage-dir {args.hicache_storage_dir}: "
                                  f"{exc.strerror or exc}") from exc
        except ValueError as exc:  # a quota below one page file
            raise TierConfigError(f"--hicache-storage-size-gb {args.hicache_storage_size_gb}: {exc}") from exc
    costs = runner.tier_costs(host, disk)
    if args.hicache_load_policy == "always":
        costs = dataclasses.replace(costs, always_load=True)
    hicache = HiCache(tree, host, disk, costs, args.hicache_write_policy, args.hicache_write_threshold,
                      args.hicache_prefetch_timeout_s)
    indexed = hicache.index_disk()
    logger.info("hierarchical cache: host tier %d pages (%.2f GiB, %s), disk tier %s; page %d bytes; "
                "read bandwidth %s; prefill %.3g TFLOP/s; write policy %s", rows, rows * page_bytes / 2**30,
                "pinned" if host.cuda else "CPU memory",
                f"{disk.capacity_pages} pages in {disk.root}, {indexed} indexed" if disk else "off",
                page_bytes, {k: f"{v / 1e9:.2f} GB/s" for k, v in costs.read_bytes_per_s.items()},
                costs.compute.flops_per_s / 1e12, args.hicache_write_policy)
    hicache.info = {
        "host_pages": rows, "disk_pages": disk.capacity_pages if disk else 0, "page_bytes": page_bytes,
        "disk_pages_indexed": indexed, "read_bytes_per_s": costs.read_bytes_per_s,
        "recompute_flops_per_s": costs.compute.flops_per_s, "write_policy": args.hicache_write_policy,
        "load_policy": args.hicache_load_policy, "io_backend": "kernel" if host.layerwise else "direct"}
    return hicache


def _available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def join_peers(scheduler: Scheduler, placement: PeerPlacement, recv: MsgSocket) -> list[MsgSocket]:
    """The peer KV tier of ``scheduler`` (``--enable-peer-kv``): join the replicas' process
    group at ``placement.dist_init_addr`` (every replica does, at start-up; the group's
    timeout is the tensor parallel groups' 30 minutes: NCCL's watchdog ends a process whose
    op waits that long), check that every replica holds pages of one format, measure the peer
    bandwidth (64 MiB on CUDA, 16 MiB on the CPU) and a one-page transfer, take the peers'
    messages on ``recv`` (which also binds this replica's inbox) and connect to theirs.
    Returns the sockets made (to close). RuntimeError if the replicas' formats differ."""
    from radixlm.runtime.memory.peer_link import PeerKVLink

    runner = scheduler.runner
    link = PeerKVLink(placement.rank, placement.size, placement.dist_init_addr, runner.pool,
                      COLLECTIVE_TIMEOUT.total_seconds())
    link.check_identity(f"{runner.kv_identity()}|{link.page_bytes}")
    rate, latency = link.measure((64 if link.device.type == "cuda" else 16) << 20)
    recv.listen(placement.inboxes[placement.rank])
    outboxes = {r: MsgSocket(zmq.PUSH, addr, bind=False) for r, addr in enumerate(placement.inboxes)
                if r != placement.rank}
    scheduler.attach_peer(link, outboxes, rate, latency)
    logger.info("peer KV tier: %s, read bandwidth %.2f GB/s, one page (%d bytes) in %.3f ms", link.backend,
                rate / 1e9, link.page_bytes, latency * 1e3)
    return list(outboxes.values())


def _admit_batch(args: ServerArgs, runner: ModelRunner) -> int:
    """--admit-batch-size, or its default: batch admissions only where decode steps replay
    CUDA graphs (eager decode steps cost as much host time as a mixed one)."""
    if args.admit_batch_size is not None:
        return args.admit_batch_size
    graphs = getattr(runner, "graph_runner", None) is not None  # stub runners in tests: none
    return max(1, args.max_running_requests // 8) if graphs else 1


def freeze_startup_objects() -> None:
    """Collect, then move every object alive now into the collector's permanent generation
    (``gc.freeze``), as vLLM and SGLang do after start-up. The imports and the model leave
    ~500K tracked objects (8B shape, the H200 host); every full collection traversed them
    all while serving: 0.3 s each, two in a 1000-request run (bench/serving/offline_trace.py).
    Frozen objects are never collected; objects made later are, as before. In an Engine
    (the scheduler on a thread of the user's process) the user's objects are frozen too.
    Shutdown calls ``gc.unfreeze()``: objects still frozen at exit are never freed, and
    nanobind (triton's bindings) then reports them as leaked."""
    gc.collect()
    gc.freeze()


def serve_scheduler(args: ServerArgs, recv_addr: str, send_addr: str, parent_pid: int | None = None,
                    stop: threading.Event | None = None, idle_spin_s: float = 0.0,
                    placement: RankPlacement | None = None, dp_rank: int = 0,
                    peer: PeerPlacement | None = None) -> bool:
    """Connect to the tokenizer side at ``recv_addr``/``send_addr``, load the model, report
    ``SchedulerReady`` (or ``SchedulerError``, then return False), then serve until the
    parent process is gone or ``stop`` is set. Runs in the scheduler process, or on a
    thread of the user's process (``runtime.engine``: ``idle_spin_s`` 0, as a spinning
    thread would hold the GIL against the caller's). ``idle_spin_s``: ``run_forever``'s.
    ``placement``: tensor parallel rank 0 of a replica (the other ranks follow its steps,
    scheduler/tensor_parallel.py); ``dp_rank``: the replica's index (data parallelism);
    ``peer``: where it sits among the replicas for the peer KV tier (``join_peers``)."""
    send = MsgSocket(zmq.PUSH, send_addr, bind=False)
    recv = MsgSocket(zmq.PULL, recv_addr, bind=False)
    peer_socks: list[MsgSocket] = []
    try:
        try:
            runner = ModelRunner(args, placement)
            if runner.tp is not None:
                runner = LeaderRunner(runner, StepSender(placement.step_addrs))
            scheduler = Scheduler(args, runner)
            scheduler.dp_rank = dp_rank
            if args.kv_events_endpoint is not None:
                scheduler.attach_kv_events(KVEventPublisher(
                    args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_topic, dp_rank))
            if peer is not None:
                peer_socks = join_peers(scheduler, peer, recv)
        except Exception as exc:  # report start-up failures instead of dying silently
            if isinstance(exc, _USER_ERRORS):  # the user's file or model: the message says what
                logger.error("scheduler failed to start: %s", exc)
            else:
                logger.exception("scheduler failed to start")
            send.send(m.SchedulerError(message=f"{type(exc).__name__}: {exc}"))
            time.sleep(0.5)  # linger 0: let the message leave before the socket closes
            return False
        freeze_startup_objects()
        ready = runner.ready_message()
        ready.admit_batch_size, ready.idle_spin_ms = scheduler.planner.admit_batch, idle_spin_s * 1e3
        ready.disable_overlap_schedule = not scheduler.overlap
        ready.weight_dtype = "/".join(dict.fromkeys(runner.weight_dtype))  # linears[/LM head]
        ready.hicache = scheduler.hicache.info if scheduler.hicache is not None else None
        ready.peer_kv = scheduler.peer.info if scheduler.peer is not None else None
        send.send(ready)
        try:
            scheduler.run_forever(recv, send, parent_pid, stop, idle_spin_s)
        finally:
            scheduler.close()
            gc.unfreeze()
        return True
    finally:
        for sock in peer_socks:
            sock.close()
        recv.close()
        send.close()


def idle_spin_s(args: ServerArgs, cores: int | None = None) -> float:
    """The scheduler process's idle spin in seconds: ``--idle-spin-ms``, or by default 20 ms
    where the process may use 4 or more cores (``cores``: default ``usable_cores()``) and
    none on fewer: on the 2-core CPU box a spinning scheduler slowed the HTTP process
    sharing the other core (a 4096-id request reached its first launch 0.4-2.8 ms later than
    with the spin off, 3 rounds)."""
    if args.idle_spin_ms is not None:
        return args.idle_spin_ms / 1e3
    if cores is None:
        cores = usable_cores()
    return 0.02 if cores >= 4 else 0.0


def run_scheduler_process(args: ServerArgs, recv_addr: str, send_addr: str, parent_pid: int | None = None,
                          placement: RankPlacement | None = None, dp_rank: int = 0,
                          peer: PeerPlacement | None = None) -> None:
    """Entry point of the scheduler child process (``placement``, ``dp_rank``, ``peer``: as
    ``serve_scheduler``'s)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s scheduler %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns shutdown: it drains
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # HTTP requests first, then kills us
    if not serve_scheduler(args, recv_addr, send_addr, parent_pid, idle_spin_s=idle_spin_s(args),
                           placement=placement, dp_rank=dp_rank, peer=peer):
        os._exit(1)
