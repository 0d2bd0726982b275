"""Ray Serve routing on the CPU: the multi-turn ShareGPT replay (openai client, streamed,
greedy) through the ingress of ``--replicas`` SmolLM2 replicas, once with the prefix-cache-
aware router and once with Ray Serve's default power of two choices (the request header
``x-radixlm-routing`` picks the policy; same replicas, caches flushed between the runs).
Per policy: the prefix-cache hit rate (cached / prompt tokens over every turn) and TTFT;
then the router's added latency (``choose_replicas``, median over the cache-aware run) and
the ingress's prompt tokenization time.

    .venv/bin/python bench/serving/ray_router.py --conversations 40 --out bench/results/ray_router.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import httpx

from radixlm.runtime.bench.chat_replay import replay_chats, summarize
from radixlm.runtime.bench.datasets import multiturn_conversations
from radixlm.runtime.bench.server_process import free_port

ROOT = Path(__file__).resolve().parents[2]


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--turns", type=int, default=4, help="turns per conversation at most")
    p.add_argument("--output-len", type=int, default=24, help="reply tokens per turn")
    p.add_argument("--user-chars", type=int, default=400, help="user messages cut to this many characters")
    p.add_argument("--workers", type=int, default=4, help="conversations in flight")
    p.add_argument("--think-time", type=float, default=0.0, help="mean seconds a user waits before the next turn")
    p.add_argument("--deploy-args", default="", help="serve-ray flags, e.g. '--balance-abs 4'")
    p.add_argument("--server-args", default="--weight-dtype auto --log-level warning",
                   help="launch_server flags of every replica")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ray_router.json")
    args = p.parse_args()

    import ray
    from ray import serve

    from radixlm.runtime.deploy.app import build_app, parse_args

    convs = multiturn_conversations(None, args.conversations, seed=0, max_turns=args.turns, output_len=args.output_len)
    conversations = [[u[: args.user_chars] for u in c.users] for c in convs]
    os.environ["OMP_NUM_THREADS"] = "1"
    port = free_port()
    ray.init(num_cpus=2 * args.replicas + 2, include_dashboard=False, log_to_driver=False)
    result = {"started": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(), "cores": os.cpu_count(),
              "args": {k: str(v) for k, v in vars(args).items()}, "load_average": {}, "runs": {}}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = parse_args([*args.deploy_args.split(), "--replicas", str(args.replicas), "--",
                             *args.server_args.split()])
        serve.run(build_app(config), name="radixlm", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        while not httpx.get(f"{url}/radixlm/replicas", timeout=60).json()["tokenizer_loaded"]:
            httpx.post(f"{url}/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 1}, timeout=60)
            time.sleep(1)
        for policy in ("cache_aware", "pow2"):
            httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()
            result["load_average"][f"{policy}_start"] = os.getloadavg()
            start = time.perf_counter()
            turns = replay_chats(url, conversations, args.output_len, workers=args.workers,
                                 headers={"x-radixlm-routing": policy}, think_time_s=args.think_time)
            result["runs"][policy] = {**summarize(turns), "duration_s": time.perf_counter() - start}
            info = httpx.get(f"{url}/radixlm/replicas", timeout=60).json()
            result["runs"][policy]["router_decisions"] = info["router"]["decisions"]
            if policy == "cache_aware":
                result["router_median_decision_ms"] = info["router"]["median_decision_ms"]
                result["ingress_median_tokenize_ms"] = info["median_tokenize_ms"]
            print(policy, json.dumps(result["runs"][policy]), flush=True)
        result["load_average"]["end"] = os.getloadavg()
    finally:
        serve.shutdown()
        ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
