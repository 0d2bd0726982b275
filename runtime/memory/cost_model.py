"""Load or recompute: the cost model that decides whether KV computed once is worth moving
to a lower memory tier and back (a preempted request's swap) rather than computed again.
Torch-free: inputs are byte and FLOP counts, outputs seconds."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DEVICE_RATES", "SwapCostModel", "TierCostModel"]


# (host link bytes/s one way, sustained FLOP/s of a prefill) by device type. CUDA: the
# H200 host's pinned copies (55 GB/s) and an 8B prefill in transformers (4096 tokens in
# 145 ms ~ 450 TFLOP/s), both from PERFORMANCE.md, rounded down. CPU: a memcpy of a few
# GB/s and ~50 GFLOP/s for a 2-core fp32 forward (both conservative guesses).
DEVICE_RATES: dict[str, tuple[float, float]] = {"cuda": (50e9, 4e14), "cpu": (5e9, 5e10)}


@dataclass(frozen=True)
class SwapCostModel:
    """Swap or recompute a preempted request's ``n`` computed tokens?

    swap: ``2 * n * kv_bytes_per_token / link_bytes_per_s`` (out now, back on resume);
    recompute: ``(2 * params * n + 2 * layers * q_heads * head_dim * n**2) / flops_per_s``
    (the weight matmuls, plus causal attention's QK^T and PV over n^2/2 pairs). Both in
    seconds. It ignores that the radix tree may still hold the page-aligned part at resume
    (then recompute costs less), so it leans towards swapping.
    """

    kv_bytes_per_token: int
    params: int
    num_layers: int
    q_dim: int  # query heads x head dim
    link_bytes_per_s: float
    flops_per_s: float

    def swap_seconds(self, tokens: int) -> float:
        return 2 * tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def recompute_seconds(self, tokens: int) -> float:
        return self.span_seconds(0, tokens)

    def span_seconds(self, start: int, end: int) -> float:
        """Seconds to compute positions [start, end) given the KV of [0, start): the weight
        matmuls of end - start tokens, and attention of each to its prefix (QK^T and PV
        over (end^2 - start^2) / 2 pairs, 4 x q_dim FLOPs a pair, every layer)."""
        n = end - start
        flops = 2 * self.params * n + 2 * self.num_layers * self.q_dim * (end * end - start * start)
        return flops / self.flops_per_s

    def swap_is_cheaper(self, tokens: int) -> bool:
        return self.swap_seconds(tokens) < self.recompute_seconds(tokens)


@dataclass(frozen=True)
class TierCostModel:
    """Load a cached span from a lower tier or recompute it? (hierarchical KV cache, peer tier)

    load ``host``: ``pages * page_bytes / read_bytes_per_s["host"]`` (host -> device);
    load ``disk``: that plus ``pages * page_bytes / read_bytes_per_s["disk"]`` (disk -> host
    first); load ``peer``: ``pages * page_bytes / read_bytes_per_s["peer"]`` (another data
    parallel replica's device pool -> this one's, one hop); each plus ``latency_s[tier]``
    (a fixed cost per load, 0 where absent; the peer tier's is the time of a one-page
    transfer); recompute: ``compute.span_seconds(start, end)``. Seconds throughout; the
    rates are measured at start-up (``ModelRunner.tier_costs``, ``PeerKVLink.measure``;
    /get_server_info shows them). A tier whose rate (or a hop's) is missing from
    ``read_bytes_per_s`` is never worth loading. ``always_load`` (``--hicache-load-policy
    always``): every tier with a rate is worth loading, whatever it costs.
    """

    compute: SwapCostModel
    page_bytes: int
    page_size: int
    read_bytes_per_s: dict[str, float]
    latency_s: dict[str, float] = field(default_factory=dict)
    always_load: bool = False

    def load_seconds(self, tier: str, tokens: int) -> float:
        nbytes = -(-tokens // self.page_size) * self.page_bytes
        rates = self.read_bytes_per_s
        hops = ("disk", "host") if tier == "disk" else (tier,)
        if any(hop not in rates for hop in hops):
            return float("inf")
        return self.latency_s.get(tier, 0.0) + sum(nbytes / rates[hop] for hop in hops)

    def worth_loading(self, tier: str, start: int, end: int) -> bool:
        """Whether loading positions [start, end) from ``tier`` beats recomputing them (with
        ``always_load``: whether ``tier`` can be loaded from at all)."""
        load = self.load_seconds(tier, end - start)
        return load < float("inf") if self.always_load else load < self.compute.span_seconds(start, end)
