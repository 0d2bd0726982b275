"""Cascade decode (``decode_attention(shared=)``) against the plain split-KV decode on
batches whose requests share cached prefixes.

Each case is G groups x M requests: a group's requests share a prefix of ``prefix`` keys
(the same pages, as the radix cache hands them out) and have ``suffix`` keys of their own
(question + generated tokens); the batch order is shuffled (the scheduler's order is not by
group). Llama-3-8B head shape (32 query heads, 8 kv heads, D 128), bf16, 16-token pages
scattered over a 4 GB pool. Per case, one layer's attention:

* ``plain_us``: the split kernel (+ merge) with ``decode_num_splits``, what a decode graph
  replays today;
* ``cascade_us``: plan on the device (``plan_shared_prefixes`` + ``SharedPrefixes.to``) and
  the split + prefix + merge kernels;
* ``distinct_us``: the plain kernel on the same lengths without shared pages (each request
  its own copy of the prefix): how much the L2 already shares between requests;
* ``plan_ms``: host time of the plan (numpy) and its host-to-device copy;
* relative error of the cascade output against the plain one.
GPU times are medians of CUDA-graph replays with L2 flushed (``bench_kernels.Timer``).

Usage (GPU):  python3 bench/kernels/bench_cascade.py --out $OUT
Smoke (CPU):  python bench/kernels/bench_cascade.py --smoke
Writes cascade_bench.json (and prints a table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import Timer, rel_err  # noqa: E402

from radixlm.kernels.decode_attention import (  # noqa: E402
    PREFIX_CONFIG,
    DecodeWorkspace,
    decode_attention,
    decode_num_splits,
    plan_shared_prefixes,
)

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
# (groups, requests per group, shared prefix keys, own keys per request)
CASES = [
    (64, 11, 2048, 256),  # the served shared-prefix workload mid-run (~700 running)
    (64, 16, 2048, 384),
    (8, 8, 2048, 256),
    (1, 128, 4096, 128),
    (32, 4, 512, 512),
    (128, 2, 1024, 256),
    (16, 64, 8192, 512),
]
SMOKE_CASES = [(2, 3, 64, 20)]


def build(groups: int, members: int, prefix: int, suffix: int, num_pages: int, shared: bool,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(page table [B, Pmax] int32, seq_lens [B] int32) of a shuffled batch."""
    batch = groups * members
    seq = prefix + suffix
    width = -(-seq // PAGE)
    perm = torch.randperm(num_pages - 1, generator=gen) + 1
    need = groups * (prefix // PAGE) + batch * (width - prefix // PAGE) if shared else batch * width
    assert need <= num_pages - 1, (need, num_pages)
    free = iter(perm.tolist())
    rows = []
    for _ in range(groups):
        common = [next(free) for _ in range(prefix // PAGE)]
        for _ in range(members):
            own = common if shared else [next(free) for _ in range(prefix // PAGE)]
            rows.append(own + [next(free) for _ in range(width - prefix // PAGE)])
    order = torch.randperm(batch, generator=gen).tolist()
    table = torch.tensor([rows[i] for i in order], dtype=torch.int32)
    return table, torch.full((batch,), seq, dtype=torch.int32)


def run_case(case: tuple[int, int, int, int], pools: tuple, timer: Timer, device: torch.device) -> dict:
    groups, members, prefix, suffix = case
    k_pool, v_pool = pools
    gen = torch.Generator().manual_seed(0)
    batch = groups * members
    q = torch.randn(batch, HEADS, DIM, generator=gen).to(device, torch.bfloat16)
    table, seq_lens = build(*case, k_pool.shape[0], True, gen)
    table_d, lens_d = table.to(device), seq_lens.to(device)
    splits = decode_num_splits(batch, KV_HEADS, prefix + suffix, device)
    out_plain = torch.empty_like(q)
    work = DecodeWorkspace.allocate(batch, HEADS, splits, DIM, device) if splits > 1 else None

    def plain() -> None:
        decode_attention(q, k_pool, v_pool, table_d, lens_d, DIM**-0.5, num_splits=splits, out=out_plain,
                         workspace=work)

    t0 = time.perf_counter()
    plan = plan_shared_prefixes(table.numpy(), seq_lens.numpy(), PAGE, HEADS // KV_HEADS)
    host_ms = (time.perf_counter() - t0) * 1e3
    assert plan is not None
    nsp = decode_num_splits(plan.chunk_rows.shape[0], KV_HEADS, int(plan.chunk_keys.max()), device, PREFIX_CONFIG)
    t0 = time.perf_counter()
    plan_d = plan.to(device, nsp)
    copy_ms = (time.perf_counter() - t0) * 1e3
    out_cascade = torch.empty_like(q)
    work_c = DecodeWorkspace.allocate(batch, HEADS, splits + nsp, DIM, device)

    def cascade() -> None:
        decode_attention(q, k_pool, v_pool, table_d, lens_d, DIM**-0.5, num_splits=splits, out=out_cascade,
                         workspace=work_c, shared=plan_d)

    row = {"groups": groups, "members": members, "batch": batch, "prefix": prefix, "suffix": suffix,
           "splits": splits, "chunks": int(plan.chunk_rows.shape[0]), "prefix_splits": nsp,
           "saved_keys": plan.saved_keys, "plan_host_ms": round(host_ms, 3), "plan_copy_ms": round(copy_ms, 3)}
    row["plain_us"] = timer.median_us(plain, graph=True)
    row["cascade_us"] = timer.median_us(cascade, graph=True)
    plain()
    cascade()
    row["rel_err"] = rel_err(out_cascade.float(), out_plain.float())
    if 2 * batch * (-(-(prefix + suffix) // PAGE)) < k_pool.shape[0]:
        d_table, _ = build(*case, k_pool.shape[0], False, gen)
        d_table = d_table.to(device)

        def distinct() -> None:
            decode_attention(q, k_pool, v_pool, d_table, lens_d, DIM**-0.5, num_splits=splits, out=out_plain,
                             workspace=work)

        row["distinct_us"] = timer.median_us(distinct, graph=True)
    kv_bytes = 2 * KV_HEADS * DIM * 2  # K + V per key, one layer
    row["plain_bytes_per_key"] = kv_bytes
    row["unique_gb"] = round((groups * prefix + batch * suffix) * kv_bytes / 1e9, 4)
    row["speedup"] = round(row["plain_us"] / row["cascade_us"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "cascade")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (interpreter)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pool_tokens = 2 * 1024 * 1024 if device.type == "cuda" else 4096
    shape = (pool_tokens // PAGE, PAGE, KV_HEADS, DIM)
    gen = torch.Generator(device=device).manual_seed(1)
    pools = tuple(torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
                  for _ in "kv")
    timer = Timer(device, 0.25)
    rows = []
    for case in SMOKE_CASES if args.smoke else CASES:
        row = run_case(case, pools, timer, device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    (args.out / "cascade_bench.json").write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))
    print(f"{'G x M':>9} {'prefix':>6} {'own':>5} {'plain us':>9} {'cascade us':>10} {'distinct us':>11} "
          f"{'speedup':>7} {'plan ms':>7}")
    for r in rows:
        print(f"{r['groups']:>4} x {r['members']:<3} {r['prefix']:>6} {r['suffix']:>5} {r['plain_us']:>9.1f} "
              f"{r['cascade_us']:>10.1f} {r.get('distinct_us', float('nan')):>11.1f} {r['speedup']:>7.2f} "
              f"{r['plan_host_ms'] + r['plan_copy_ms']:>7.2f}")


if __name__ == "__main__":
    main()
