"""Prometheus metrics of the tokenizer process (prometheus-client, one registry per app).

Request-level counters and latency histograms are observed here; scheduler-side numbers
(queue lengths, KV pool usage, prefix-cache hit rate) come from the scheduler's periodic
SchedulerStats message and are exported as gauges on each scrape. Names use the
``radixlm:`` prefix, as SGLang uses ``sglang:``.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from radixlm.runtime.messages import SchedulerStats

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"radixlm:{name}", doc, ("model_name", *extra), registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"radixlm:{name}", doc, ("model_name",), registry=r).labels(**label)

        self._requests = counter("requests_total", "Finished requests (samples).", ("finish_reason",))
        self.model_name = model_name
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of finished samples.").labels(**label)
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens.").labels(**label)
        self.cached_tokens = counter("cached_tokens_total", "Prompt tokens reused from the radix cache.").labels(**label)
        self.ttft = Histogram("radixlm:time_to_first_token_seconds", "Time to first token.",
                              ("model_name",), buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        self.e2e = Histogram("radixlm:e2e_request_latency_seconds", "End-to-end request latency.",
                             ("model_name",), buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        self.num_running = gauge("num_running_reqs", "Requests in the running batch.")
        self.num_waiting = gauge("num_queue_reqs", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage", "Fraction of KV pages in use (requests + radix tree).")
        self.kv_cached = gauge("kv_cache_cached_pages", "KV pages held by the radix tree.")
        self.kv_total = gauge("kv_cache_total_pages", "Allocatable KV pages.")
        self.hit_rate = gauge("cache_hit_rate", "Prefix-cache token hit rate: cached / prompt tokens.")
        self.preemptions = gauge("num_preemptions_total", "Requests preempted so far.")
        self.evicted = gauge("evicted_pages_total", "Radix-tree pages evicted so far.")
        self.swapped_out = gauge("num_swapped_out_total", "Preemptions that swapped KV to host memory.")
        self.recomputed = gauge("recomputed_tokens_total", "Tokens whose KV was computed again after a preemption.")
        self.forward_steps = gauge("forward_steps_total", "Forward passes launched.")
        self.decode_steps = gauge("decode_steps_total", "Forward passes where every request decodes one token.")
        self.busy = gauge("scheduler_busy_seconds_total",
                          "Scheduler loop time not spent waiting for the device or for messages "
                          "(handling requests, planning, launching, output, sending).")
        self.decode_busy = gauge("scheduler_decode_busy_seconds_total",
                                 "The part of scheduler_busy_seconds_total spent in steps that launched a "
                                 "decode pass (every request one token): divide by decode_steps_total for "
                                 "the host time of one decode step.")
        self.kv_waste = gauge("kv_cache_waste_tokens",
                              "KV slots held by running requests that hold no computed token "
                              "(partial last pages, pages grown ahead).")
        self.kv_waste_ratio = gauge("kv_cache_waste_ratio", "kv_cache_waste_tokens / KV slots in use.")
        self.sink_total = gauge("kv_sink_slots_total", "Exact attention-sink slots of an FP8 KV pool "
                                "(--kv-sink-slots; 0 without).")
        def tiered(name: str, doc: str, label_name: str) -> Gauge:
            return Gauge(f"radixlm:{name}", doc, ("model_name", label_name), registry=r)

        # Hierarchical cache (--hicache-*): cumulative values are the scheduler's totals.
        self.tier_hits = tiered("hicache_hit_tokens_total", "Prompt tokens reused, by the tier they "
                                "came from (device, host, disk).", "tier")
        self.tier_pages = tiered("hicache_pages_moved_total", "KV pages copied between tiers, by direction "
                                 "(device_to_host, host_to_device, host_to_disk, disk_to_host).", "direction")
        self.tier_bytes = tiered("hicache_bytes_moved_total", "Bytes copied between tiers, by direction.",
                                 "direction")
        self.tier_used = tiered("hicache_tier_used_pages", "Pages held in each lower tier (host, disk).", "tier")
        self.tier_capacity = tiered("hicache_tier_total_pages", "Capacity of each lower tier in pages.", "tier")
        self.prefetch = tiered("hicache_prefetch_total", "Disk prefetches of waiting requests, by outcome "
                               "(complete: every page arrived and verified; timeout: admitted first, the "
                               "rest recomputed; failed: a page was missing or failed verification, its "
                               "node recomputed).", "outcome")
        self.prefetch_failed = gauge("hicache_prefetch_failed_pages_total",
                                     "Disk pages that failed verification (dropped, recomputed).")
        self.prefetch_seconds = gauge("hicache_prefetch_seconds_total", "Summed prefetch wait (seconds): "
                                      "divide by hicache_prefetch_total for the mean load latency.")
        self.skipped_loads = gauge("hicache_skipped_load_pages_total", "Pages cached in a lower tier but "
                                   "recomputed: the cost model found recomputing faster, or a disk "
                                   "prefetch had not arrived when the request was admitted.")
        self.disk_skipped = gauge("hicache_disk_write_skipped_pages_total",
                                  "Pages not written to the disk tier (quota or disk full).")
        # Peer KV tier (--enable-peer-kv): the replicas' totals.
        self.peer_hits = gauge("peer_kv_hit_tokens_total", "Prompt tokens reused from KV pages copied from "
                               "another data parallel replica (also counted in cached_tokens_total).")
        self.peer_pages = tiered("peer_kv_pages_total", "KV pages copied between replicas, by direction "
                                 "(received, sent).", "direction")
        self.peer_bytes = tiered("peer_kv_bytes_total", "Bytes copied between replicas, by direction.", "direction")
        self.peer_fetches = tiered("peer_kv_fetches_total", "Fetches from a peer replica by outcome (loaded: "
                                   "pages arrived and were cached; none: the peer held none; failed).", "outcome")
        self.peer_timeouts = gauge("peer_kv_wait_timeouts_total", "Requests admitted before their peer fetch "
                                   "ended (they recomputed; the pages are cached when they come).")
        self.peer_skipped = gauge("peer_kv_skipped_total", "Hinted prefixes recomputed without asking the "
                                  "peer: the cost model, an unresponsive peer, or the replica's own lower tiers.")
        self.peer_seconds = gauge("peer_kv_fetch_seconds_total", "Summed request -> cached time of loaded "
                                  "fetches: divide by peer_kv_fetches_total{outcome=\"loaded\"}.")
        self.sink_used = gauge("kv_sink_slots_used", "Exact attention-sink slots claimed by a first token; "
                               "once all are, requests with a new first token read position 0 from FP8.")

    def observe_chunk(self, gen, chunk) -> None:
        """Count one SampleChunk of request ``gen`` (stateless: the start time is
        ``gen.created``; the first chunk with tokens carries all tokens so far)."""
        elapsed = time.perf_counter() - gen.created
        if chunk.token_ids and chunk.completion_tokens == len(chunk.token_ids):
            self.ttft.observe(elapsed)
        if chunk.finished:
            self._requests.labels(model_name=self.model_name, finish_reason=chunk.finish_reason).inc()
            self.prompt_tokens.inc(chunk.prompt_tokens)
            self.generation_tokens.inc(chunk.completion_tokens)
            self.cached_tokens.inc(chunk.cached_tokens)
            self.e2e.observe(elapsed)

    def _render_tiers(self, hc) -> None:
        name = self.model_name
        for tier, n in hc.hit_tokens.items():
            self.tier_hits.labels(model_name=name, tier=tier).set(n)
        for direction, n in hc.pages_moved.items():
            self.tier_pages.labels(model_name=name, direction=direction).set(n)
            self.tier_bytes.labels(model_name=name, direction=direction).set(n * hc.page_bytes)
        for tier, used, total in (("host", hc.host_pages_used, hc.host_pages_total),
                                  ("disk", hc.disk_pages_used, hc.disk_pages_total)):
            self.tier_used.labels(model_name=name, tier=tier).set(used)
            self.tier_capacity.labels(model_name=name, tier=tier).set(total)
        self.prefetch.labels(model_name=name, outcome="complete").set(hc.prefetch_hits)
        self.prefetch.labels(model_name=name, outcome="timeout").set(hc.prefetch_timeouts)
        self.prefetch.labels(model_name=name, outcome="failed").set(hc.prefetch_failed)
        self.prefetch_failed.set(hc.prefetch_failures)
        self.prefetch_seconds.set(hc.prefetch_seconds)
        self.skipped_loads.set(hc.skipped_loads)
        self.disk_skipped.set(hc.disk_writes_skipped)

    def _render_peer(self, peer) -> None:
        name = self.model_name
        self.peer_hits.set(peer.hit_tokens)
        for direction, n in (("received", peer.pages_received), ("sent", peer.pages_sent)):
            self.peer_pages.labels(model_name=name, direction=direction).set(n)
            self.peer_bytes.labels(model_name=name, direction=direction).set(n * peer.page_bytes)
        for outcome, n in (("loaded", peer.fetches_loaded), ("none", peer.fetches_none),
                           ("failed", peer.fetches_failed)):
            self.peer_fetches.labels(model_name=name, outcome=outcome).set(n)
        self.peer_timeouts.set(peer.waits_timed_out)
        self.peer_skipped.set(peer.skipped)
        self.peer_seconds.set(peer.fetch_seconds)

    def render(self, stats: SchedulerStats | None) -> tuple[bytes, str]:
        if stats is not None:
            self.num_running.set(stats.num_running)
            self.num_waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_used_pages / max(stats.kv_total_pages, 1))
            self.kv_cached.set(stats.kv_cached_pages)
            self.kv_total.set(stats.kv_total_pages)
            seen = stats.prefill_tokens_computed + stats.prefill_tokens_cached
            self.hit_rate.set(stats.prefill_tokens_cached / seen if seen else 0.0)
            self.preemptions.set(stats.num_preemptions)
            self.evicted.set(stats.num_evicted_pages)
            self.swapped_out.set(stats.num_swapped_out)
            self.recomputed.set(stats.prefill_tokens_recomputed)
            self.forward_steps.set(stats.forward_steps)
            self.decode_steps.set(stats.decode_steps)
            self.busy.set(stats.scheduler_busy_seconds)
            self.decode_busy.set(stats.scheduler_decode_busy_seconds)
            self.kv_waste.set(stats.kv_waste_tokens)
            used_slots = stats.kv_used_pages * stats.page_size
            self.kv_waste_ratio.set(stats.kv_waste_tokens / used_slots if used_slots else 0.0)
            self.sink_total.set(stats.kv_sink_slots_total)
            self.sink_used.set(stats.kv_sink_slots_used)
            if stats.hicache is not None:
                self._render_tiers(stats.hicache)
            if stats.peer is not None:
                self._render_peer(stats.peer)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
