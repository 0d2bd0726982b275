"""Preemption (and eviction) policies under memory pressure, one server per variant with a
small KV pool, so prefixes are evicted and running requests preempted. Workloads:

* ``multiturn`` (default): the multi-turn ShareGPT replay of
  ``examples/sharegpt_multiturn.py`` (imported, one implementation);
* ``mooncake``: the Mooncake production trace at its own timestamps through
  ``radixlm bench serving --dataset-name mooncake`` (a window of it, scaled down:
  ``--serving-args`` takes that command's ``--mooncake-*`` flags).

Per variant: TTFT p50 / p99 (s), output tokens/s over the replay's wall time, prefix-cache
hit rate (cached / prompt tokens), requests completed / failed, and from ``/metrics`` the
preemptions, swap-outs, recomputed tokens (KV computed again after a preemption) and
evicted pages; the load average before and after. Same requests, same order, for every
variant. Results: JSON under bench/results/ and a markdown table on stdout. Examples
(CPU, SmolLM2):

    .venv/bin/python bench/cache/bench_policies.py --max-total-tokens 3072 --concurrency 8 \\
        --variants lru:recompute lru:swap longest:auto importance:auto
    .venv/bin/python bench/cache/bench_policies.py --workload mooncake --max-total-tokens 2048 \\
        --serving-args "--mooncake-start-s 600 --mooncake-duration-s 300 --mooncake-sample 4 \\
        --mooncake-time-scale 3 --mooncake-block-tokens 16"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("cpu",)]
from bench_cpu import RESULTS_DIR, ROOT, _with_server, environment, replay  # noqa: E402

METRICS = {
    "radixlm:num_preemptions_total": "preemptions",
    "radixlm:num_swapped_out_total": "swapped_out",
    "radixlm:recomputed_tokens_total": "recomputed_tokens",
    "radixlm:evicted_pages_total": "evicted_pages",
}


def scrape(url: str) -> dict[str, float]:
    """The scheduler counters of ``METRICS`` from ``/metrics`` (waits for a fresh sample:
    the scheduler publishes stats every ~0.5 s)."""
    time.sleep(1.0)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in METRICS:
                out[METRICS[sample.name]] = sample.value
    return out


def _percentile(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def run_variant(url: str, cfg: Any, name: str) -> dict[str, Any]:
    print(f"--- {name}", flush=True)
    start = time.perf_counter()
    results, summary = replay.run_replay(url, cfg, progress=True)
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    return {
        "variant": name,
        "turns": len(results),
        "failed": summary.failed,
        "wall_s": wall,
        "output_tok_s": sum(r.completion_tokens for r in ok) / wall,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "hit_rate": summary.hit_rate,
        "best_hit_rate": summary.best_hit_rate,
        **scrape(url),
    }


def run_variant_mooncake(url: str, serving_argv: list[str], name: str) -> dict[str, Any]:
    """One ``radixlm bench serving --dataset-name mooncake`` run against ``url``."""
    from radixlm.runtime.bench import serving

    print(f"--- {name}", flush=True)
    load_before = os.getloadavg()
    args = serving.parse_args(["--base-url", url, "--dataset-name", "mooncake", *serving_argv])
    server = serving.discover_server(url)
    tokenizer = serving.load_tokenizer(server.tokenizer)
    workload = serving.build_workload(args, tokenizer)
    outputs, wall, in_flight, numbers = asyncio.run(
        serving.run_benchmark(args, workload, math.inf, tokenizer, server)
    )
    m = serving.compute_metrics(outputs, wall, in_flight)
    return {
        "variant": name,
        "turns": len(outputs),
        "failed": m["failed"],
        "wall_s": wall,
        "output_tok_s": m["output_throughput"],
        "ttft_p50_s": m["median_ttft_ms"] / 1000,
        "ttft_p99_s": m["p99_ttft_ms"] / 1000,
        "hit_rate": numbers["prefix_cache_hit_rate"],
        "prompt_tokens": m["total_input_tokens"],
        "max_in_flight": in_flight,
        "running_reqs_max": numbers["running_reqs_max"],
        "loadavg": [load_before, os.getloadavg()],
        **scrape(url),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| variant (preemption policy:mode[:eviction]) | requests | failed | TTFT p50 s | TTFT p99 s | "
        "output tok/s | hit rate | preemptions | swapped out | recomputed tokens | evicted pages |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['turns']} | {r['failed']} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
            f"{r['output_tok_s']:.1f} | {r['hit_rate']:.3f} | {r.get('preemptions', 0):.0f} | "
            f"{r.get('swapped_out', 0):.0f} | {r.get('recomputed_tokens', 0):.0f} | {r.get('evicted_pages', 0):.0f} |"
        )
    return "\n".join(lines)


def variant_flags(variant: str) -> list[str]:
    """``policy:mode[:eviction]`` -> launch_server flags."""
    parts = variant.split(":")
    flags = ["--preemption-policy", parts[0], "--preemption-mode", parts[1]]
    if len(parts) > 2:
        flags += ["--radix-eviction-policy", parts[2]]
    return flags


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--variants",
        nargs="+",
        default=["lru:recompute", "lru:swap", "longest:auto", "importance:auto"],
    )
    p.add_argument("--max-total-tokens", type=int, default=3072, help="KV pool size (tokens)")
    p.add_argument("--server-args", default="", help="extra launch_server flags for every server")
    p.add_argument("--workload", choices=["multiturn", "mooncake"], default="multiturn")
    p.add_argument(
        "--serving-args",
        default="",
        help="mooncake: flags of `radixlm bench serving` (its --mooncake-* window and scale)",
    )
    replay.add_replay_args(p)
    args = p.parse_args(argv)
    cfg = replay.config_from_args(args)
    env = environment()
    rows = []
    for variant in args.variants:
        extra = f"--max-total-tokens {args.max_total_tokens} {' '.join(variant_flags(variant))} {args.server_args}"
        if args.workload == "mooncake":
            fn = lambda url, v=variant: run_variant_mooncake(url, shlex.split(args.serving_args), v)  # noqa: E731
        else:
            fn = lambda url, v=variant: run_variant(url, cfg, v)  # noqa: E731
        rows.append(_with_server(extra, f"radixlm-policies-{variant.replace(':', '-')}.log", fn))
    env["loadavg_end"] = __import__("os").getloadavg()
    stamp = env["date"].replace(":", "").replace("-", "")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"bench_policies-{stamp}.json"
    out.write_text(json.dumps({"env": env, "args": vars(args), "rows": rows}, indent=1))
    print(
        f"\ncommit {env['commit']}, {env['date']}, load {env['loadavg_start']} -> {env['loadavg_end']}\n"
    )
    print(table(rows))
    print(f"\nresults: {out.relative_to(ROOT)}")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
