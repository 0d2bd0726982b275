"""The hierarchical KV cache on a GPU, in process (``LocalServer``: the server without HTTP).

``ttft``: time to first token of a prompt of L tokens (4K, 16K, 32K) whose cached prefix
comes from the device pool (L1), the host tier (L3: pushed out of the device by filler
prompts first, ``--l3-reps`` times; a host tier of ``--ttft-host-gb`` holds them all, the
warm-ups flushed; once per ``--io-backends`` value; no disk tier, so no disk writes run
beside), the disk tier (L4: a server with a disk tier runs each prompt once and stops, then
a second server on the same storage folder, with the page files dropped from the OS page
cache; once with ``--hicache-load-policy cost_model``, which loads
only where loading beats recomputing by the bandwidths it measured, and once with
``always``), or nowhere (recompute: the prompt's first request). The first token is the
whole request here (``max_new_tokens`` 1, no HTTP), so TTFT = the request's latency. The
tiers' bandwidths measured at start-up are recorded.

``load``: host -> device load time of N pages (``--load-pages``; 256 pages of the 8B
shape = a 4K prefix, 512 MiB) with each ``--io-backends`` value, the pool alone (no model):
median of 5 loads, each timed to the device synchronising, and the bandwidth it gives.

``mooncake``: the Mooncake production trace's arrivals scaled to the GPU (a
``--mooncake-*`` window of it: one conversation in ``--mooncake-sample``, lengths x
``--mooncake-block-tokens`` / 512, replayed ``--mooncake-time-scale`` times faster), served
over HTTP (``launch_server`` per configuration, ``radixlm bench serving --dataset-name
mooncake``): throughput, TTFT p50 / p99 and the hit tokens per tier for the same
configurations as ``multiturn``. The trace file (``--mooncake-path``) is carried to the GPU
host.

``multiturn``: many conversations at once (SGLang's bench_multiturn shape): C clients,
each T turns of a Q-token question and an A-token answer, the prompt being the whole
history. Turns wait in one first-in first-out queue that ``--max-parallel`` workers serve:
every client's first turn is queued at the start, and a client's next turn joins the back
of the queue when its answer ends, so the clients rotate through the slots and every other
client's turn runs between two of one client's (with the defaults the histories in play,
up to 80 x 3.3K tokens, are 7x the 36,864-token device pool). Throughput and TTFT
p50 / p99 for the device pool only (L1), with a host tier holding the working set
(L1+L3), and with a smaller host tier plus the disk tier (L1+L3+L4).

    . bench/gpu_env.sh && python3 bench/kv_cache/hicache_gpu.py all --tokenizer-dir .gpu_tok --out $OUT

(``load``, ``ttft``, ``multiturn`` or ``mooncake`` for one part; the results:
``hicache_<part>.json``.)

Random bf16 weights of the Llama-3-8B shape (``e2e/gpu_e2e.py``), built once under
``--models-root``. On the CPU (``GPU_E2E_DEVICE=cpu``) use ``--shape tiny`` and small sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH / "e2e")]
from gpu_e2e import DEVICE, build_checkpoint, server_flags  # noqa: E402

from radixlm.runtime.engine import LocalServer  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402


def _settings(args: argparse.Namespace, **extra) -> dict:
    """The servers' settings (ServerArgs fields) beyond the model, device and log level."""
    return dict(dict(context_length=args.context_length, max_total_tokens=args.device_tokens,
                     max_prefill_tokens=16384, chunked_prefill_size=8192, max_running_requests=64), **extra)


def server(model: Path, args: argparse.Namespace, **extra) -> LocalServer:
    return LocalServer(ServerArgs(model_path=str(model), device=DEVICE, log_level="warning",
                                  **_settings(args, **extra)))


def tier_configs(args: argparse.Namespace, storage_dir: str) -> dict[str, dict]:
    """The tiers of each ``--configs`` name (ServerArgs fields)."""
    return {
        "L1": {},
        "L1+L3": dict(hicache_size_gb=args.host_gb),
        "L1+L3+L4": dict(hicache_size_gb=args.small_host_gb, hicache_storage_dir=storage_dir,
                         hicache_storage_size_gb=args.disk_gb),
    }


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def first_token(srv: LocalServer, prompt: list[int]) -> tuple[float, dict]:
    """Seconds to the first token (``max_new_tokens`` 1) and the response's meta_info."""
    start = time.perf_counter()
    out = srv.post("/generate", {"input_ids": prompt, "sampling_params": {
        "temperature": 0, "max_new_tokens": 1, "ignore_eos": True}})
    return time.perf_counter() - start, out["meta_info"]


def drop_page_cache(folder: Path) -> int:
    """Ask the OS to drop the page files from its page cache (clean pages: no root needed)."""
    n = 0
    for f in folder.rglob("*.kvpage"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def run_ttft(model: Path, args: argparse.Namespace, out: dict, save) -> None:
    rng = random.Random(0)
    store = Path(args.storage_dir)
    prompts = {n: ids(rng, n, args.vocab) for n in args.lengths}
    host = dict(hicache_size_gb=args.ttft_host_gb)
    tiers = dict(host, hicache_storage_dir=str(store), hicache_storage_size_gb=args.disk_gb)
    rows = out.setdefault("ttft", [])
    for io in args.io_backends:  # recompute, L1 and L3 with each way of loading host pages
        with server(model, args, hicache_io_backend=io, **host) as srv:  # no disk writes running beside
            out.setdefault("tiers_by_io_backend", {})[io] = srv.tm.ready.hicache
            for n in prompts:
                for _ in range(2):  # compile / warm up at this length
                    first_token(srv, ids(rng, n, args.vocab))
            srv.post("/flush_cache", {})  # the warm-ups leave the device and host tiers
            for n, prompt in prompts.items():
                for source in ("recompute", "L1"):
                    t, meta = first_token(srv, prompt)
                    rows.append(dict(tokens=n, source=source, io_backend=io, ttft_s=t,
                                     cached=meta["cached_tokens_per_tier"]))
                print(json.dumps(rows[-2:]), flush=True)
            for n, prompt in prompts.items():
                for _ in range(args.l3_reps):
                    first_token(srv, prompt)  # on the device again, so the host's LRU keeps it below
                    filled, size = 0, min(8192, args.context_length - 16, args.device_tokens // 2)
                    while filled < 1.25 * args.device_tokens:  # push the prompts' pages down to the host
                        first_token(srv, ids(rng, size, args.vocab))
                        filled += size
                    t, meta = first_token(srv, prompt)
                    rows.append(dict(tokens=n, source="L3", io_backend=io, ttft_s=t,
                                     cached=meta["cached_tokens_per_tier"]))
                    print(json.dumps(rows[-1]), flush=True)
            srv.post("/flush_cache", {})
            save(out)
    if args.l4_policies:  # a server with the disk tier writes the prompts' pages (closing waits for the writes)
        shutil.rmtree(store, ignore_errors=True)
        with server(model, args, **tiers) as srv:
            for prompt in prompts.values():
                first_token(srv, prompt)
    for policy in args.l4_policies:  # the cost model may find the disk slower than recomputing
        out.setdefault("page_files_dropped_from_page_cache", []).append(drop_page_cache(store))
        with server(model, args, hicache_load_policy=policy, **tiers) as srv:
            out.setdefault("l4_tiers", {})[policy] = srv.tm.ready.hicache
            for n, prompt in prompts.items():
                first_token(srv, ids(rng, n, args.vocab))  # graphs / kernels at this length
                t, meta = first_token(srv, prompt)
                rows.append(dict(tokens=n, source="L4", load_policy=policy, ttft_s=t,
                                 cached=meta["cached_tokens_per_tier"]))
                print(json.dumps(rows[-1]), flush=True)
            out.setdefault("l4_stats", {})[policy] = _stats(srv)
        save(out)
    shutil.rmtree(store, ignore_errors=True)


def run_load(args: argparse.Namespace, out: dict, save) -> None:
    import torch

    from radixlm.runtime.memory.host_pool import HostKVPool
    from radixlm.runtime.memory.kv_pool import KVPool

    layers, kv_heads, head_dim = 32, 8, 128  # the Llama-3-8B shape
    n = args.load_pages
    pool = KVPool(n + 1, 16, layers, kv_heads, head_dim, torch.bfloat16, DEVICE)
    rows = out.setdefault("load", [])
    for io in args.io_backends:
        host = HostKVPool(pool, n + 1, io)
        host.save(list(range(1, n + 1)), list(range(1, n + 1)))
        host.wait_saves()
        times = []
        sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
        for _ in range(6):  # the first compiles / warms up
            sync()
            start = time.perf_counter()
            host.load(list(range(1, n + 1)), list(range(1, n + 1)))
            pool.await_loads()
            sync()
            times.append(time.perf_counter() - start)
        t = statistics.median(times[1:])
        rows.append(dict(io_backend=io, layerwise=host.layerwise, pages=n, bytes=n * host.page_bytes, seconds=t,
                         gb_per_s=n * host.page_bytes / t / 1e9))
        print(json.dumps(rows[-1]), flush=True)
        del host
    save(out)


def _stats(srv: LocalServer) -> dict:
    time.sleep(0.6)  # the scheduler reports every 0.5 s
    stats = srv.tm.stats
    if stats is None or stats.hicache is None:
        return {}
    hc = stats.hicache
    return {f: getattr(hc, f) for f in hc.__struct_fields__}


def run_multiturn(model: Path, args: argparse.Namespace, out: dict, save) -> None:
    configs = tier_configs(args, str(args.storage_dir) + "-mt")
    for name in args.configs:
        with server(model, args, **configs[name]) as srv:
            first_token(srv, ids(random.Random(1), min(4096, args.device_tokens // 2), args.vocab))  # warm-up
            result = _conversations(srv, args)
            result["config"] = name
            result["hicache"] = _stats(srv)
            out.setdefault("multiturn", []).append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "hicache"}), flush=True)
            save(out)
        if "storage" in str(configs[name]):
            shutil.rmtree(configs[name]["hicache_storage_dir"], ignore_errors=True)


def _conversations(srv: LocalServer, args: argparse.Namespace) -> dict:
    """C clients of T turns each, rotating through ``--max-parallel`` workers (module doc);
    returns throughput and TTFT percentiles."""
    ttfts: list[float] = []
    prompt_tokens = output_tokens = cached = 0
    lock = threading.Lock()
    turns: queue.Queue = queue.Queue()  # (client, turns done, history); None stops a worker
    workers = args.max_parallel or args.clients
    finished = 0

    def turn(history: list[int]) -> list[int]:
        """One request over the whole history; returns the answer's tokens."""
        nonlocal prompt_tokens, output_tokens, cached
        start = time.perf_counter()
        first = None
        tokens: list[int] = []
        meta = {}
        for event in srv.stream("/generate", {"input_ids": history, "stream": True, "sampling_params": {
                "temperature": 0, "max_new_tokens": args.answer, "ignore_eos": True}}):
            if first is None and event.get("output_ids"):
                first = time.perf_counter() - start
            tokens = event.get("output_ids", tokens)
            meta = event.get("meta_info", meta)
        with lock:
            ttfts.append(first if first is not None else time.perf_counter() - start)
            prompt_tokens += len(history)
            output_tokens += len(tokens)
            cached += meta.get("cached_tokens", 0)
        return tokens

    def worker() -> None:
        nonlocal finished
        while (item := turns.get()) is not None:
            c, done, history = item
            history = history + ids(rngs[c], args.question, args.vocab)
            history += turn(history)
            if done + 1 < args.turns:
                turns.put((c, done + 1, history))
                continue
            with lock:
                finished += 1
                last = finished == args.clients
            if last:
                for _ in range(workers):
                    turns.put(None)

    rngs = [random.Random(100 + c) for c in range(args.clients)]
    for c in range(args.clients):
        turns.put((c, 0, []))
    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts.sort()
    return dict(clients=args.clients, max_parallel=args.max_parallel, turns=args.turns, question=args.question,
                answer=args.answer, device_tokens=args.device_tokens, wall_s=wall, requests=len(ttfts),
                output_tok_s=output_tokens / wall, prompt_tok_s=prompt_tokens / wall,
                cache_hit_rate=cached / max(prompt_tokens, 1),
                ttft_p50_s=statistics.median(ttfts), ttft_p99_s=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))])


def run_mooncake(model: Path, args: argparse.Namespace, out: dict, save) -> None:
    """The Mooncake trace's arrivals scaled to the GPU, served: per ``--configs`` entry a
    ``launch_server`` with those tiers and ``radixlm bench serving --dataset-name mooncake``
    against it (the ``--mooncake-*`` window; open loop at the trace's timestamps)."""
    import asyncio
    import math

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from radixlm.runtime.bench import serving
    from radixlm.runtime.bench.server_process import ServerProcess

    window = ["--dataset-name", "mooncake", "--dataset-path", str(args.mooncake_path),
              "--mooncake-start-s", str(args.mooncake_start_s), "--mooncake-duration-s", str(args.mooncake_duration_s),
              "--mooncake-sample", str(args.mooncake_sample), "--mooncake-time-scale", str(args.mooncake_time_scale),
              "--mooncake-block-tokens", str(args.mooncake_block_tokens)]
    store = str(args.storage_dir) + "-mooncake"
    configs = tier_configs(args, store)
    if DEVICE == "cuda":  # what the in-process servers of earlier parts left cached
        import torch

        torch.cuda.empty_cache()
    for name in args.configs:
        shutil.rmtree(store, ignore_errors=True)
        settings = _settings(args, **configs[name])
        flags = server_flags(model) + [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
        with open(args.out / f"mooncake_{name}.log", "w") as log, \
                ServerProcess.launch(flags, log, startup_timeout=900) as srv:
            warm = ids(random.Random(1), min(4096, args.device_tokens // 2), args.vocab)  # compiles, graphs
            httpx.post(f"{srv.url}/generate", json={"input_ids": warm, "sampling_params": {
                "max_new_tokens": 8, "ignore_eos": True}}, timeout=600).raise_for_status()
            httpx.post(f"{srv.url}/flush_cache", timeout=60)
            sargs = serving.parse_args(["--base-url", srv.url, *window])
            info = serving.discover_server(srv.url)
            tokenizer = serving.load_tokenizer(info.tokenizer)
            workload = serving.build_workload(sargs, tokenizer)
            outputs, wall, in_flight, numbers = asyncio.run(
                serving.run_benchmark(sargs, workload, math.inf, tokenizer, info))
            m = serving.compute_metrics(outputs, wall, in_flight)
            time.sleep(0.6)  # the scheduler reports every 0.5 s: the last requests' hits
            hits: dict[str, float] = {}
            for family in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics", timeout=30).text):
                for sample in family.samples:
                    if sample.name == "radixlm:hicache_hit_tokens_total":
                        hits[sample.labels["tier"]] = sample.value
            result = dict(config=name, requests=len(outputs), failed=m["failed"], wall_s=wall,
                          offered_s=max(r.arrival_s or 0.0 for r in workload), device_tokens=args.device_tokens,
                          output_tok_s=m["output_throughput"], prompt_tokens=m["total_input_tokens"],
                          cache_hit_rate=numbers["prefix_cache_hit_rate"], hit_tokens_per_tier=hits,
                          ttft_p50_s=_seconds(m["median_ttft_ms"]), ttft_p99_s=_seconds(m["p99_ttft_ms"]),
                          max_in_flight=in_flight, errors=sorted({o.error for o in outputs if not o.success})[:5])
            out.setdefault("mooncake", []).append(result)
            print(json.dumps(result), flush=True)
            save(out)
        shutil.rmtree(store, ignore_errors=True)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("load", "ttft", "multiturn", "mooncake", "all"))
    ap.add_argument("--load-pages", type=int, default=256)
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--context-length", type=int, default=34000)
    ap.add_argument("--device-tokens", type=int, default=36864, help="device KV pool (tokens)")
    ap.add_argument("--io-backends", nargs="+", default=["kernel", "direct"],
                    help="--hicache-io-backend values of the ttft part's recompute / L1 / L3 rows")
    ap.add_argument("--l4-policies", nargs="*", default=["cost_model", "always"],
                    help="--hicache-load-policy values of the L4 rows (none: no L4 rows)")
    ap.add_argument("--l3-reps", type=int, default=3, help="L3 measurements per prompt (fillers between)")
    ap.add_argument("--ttft-host-gb", type=float, default=16.0,
                    help="host tier of the ttft part: holds its prompts and fillers (~13 GB of 8B KV)")
    ap.add_argument("--host-gb", type=float, default=40.0, help="host tier holding the working set")
    ap.add_argument("--small-host-gb", type=float, default=8.0, help="host tier of the L1+L3+L4 run")
    ap.add_argument("--disk-gb", type=float, default=30.0)
    ap.add_argument("--storage-dir", default="/tmp/radixlm-kv")
    ap.add_argument("--multiturn-device-tokens", type=int, default=36864,
                    help="device KV pool (tokens) of the multi-turn runs")
    ap.add_argument("--clients", type=int, default=80)
    ap.add_argument("--max-parallel", type=int, default=16, help="requests in flight at most (0: every client)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--question", type=int, default=512)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--configs", nargs="+", default=["L1", "L1+L3", "L1+L3+L4"])
    ap.add_argument("--mooncake-path", type=Path,
                    default=BENCH.parent.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl")
    ap.add_argument("--mooncake-device-tokens", type=int, default=36864,
                    help="device KV pool (tokens) of the Mooncake runs")
    ap.add_argument("--mooncake-start-s", type=float, default=0.0, help="trace second the window starts at")
    ap.add_argument("--mooncake-duration-s", type=float, default=300.0, help="trace seconds replayed")
    ap.add_argument("--mooncake-sample", type=int, default=2, help="keep one conversation in this many")
    ap.add_argument("--mooncake-time-scale", type=float, default=4.0,
                    help="replay the window this many times faster than recorded")
    ap.add_argument("--mooncake-block-tokens", type=int, default=128,
                    help="tokens per 512-token hash block: lengths x this / 512 (128: the longest "
                         "prompt, 31.5K tokens, fits --context-length)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    if args.what in ("mooncake", "all") and not args.mooncake_path.is_file():
        ap.error(f"no Mooncake trace at {args.mooncake_path} (carry it and pass --mooncake-path)")
    model = None if args.what == "load" else build_checkpoint(args.shape, args.tokenizer_dir, args.models_root)[0]
    out: dict = {"shape": args.shape, "device": DEVICE, "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:  # after each part: a run cut short keeps what it measured
        (args.out / f"hicache_{args.what}.json").write_text(json.dumps(result, indent=1))

    try:
        if args.what in ("load", "all"):
            run_load(args, out, save)
        if args.what in ("ttft", "all"):
            run_ttft(model, args, out, save)
        if args.what in ("multiturn", "all"):
            args.device_tokens = args.multiturn_device_tokens
            run_multiturn(model, args, out, save)
        if args.what in ("mooncake", "all"):
            args.device_tokens = args.mooncake_device_tokens
            run_mooncake(model, args, out, save)
    finally:
        save(out)


if __name__ == "__main__":
    main()
