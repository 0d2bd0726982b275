"""KV page layout on one GPU: token-major pages [P, S, K, D] (each token's kv heads side by
side, a kv head's keys of one page 128 / 256 bytes apart at K x D stride) against
head-major pages [P, K, S, D] (a kv head's S keys of one page contiguous: 2 KB for FP8,
4 KB for bf16, D 128, page 16), read by the same decode / extend / store_kv kernels (they
take the pools' strides; a head-major pool is passed as its [P, S, K, D] permuted view).

Shape: Llama-3-8B attention (32 query heads, 8 kv heads, D 128), bf16 queries, page size
16, pages at a random permutation of the pool. For each layout and pool dtype (bf16,
fp8_e4m3 with per-head scales): decode at batch x context {32 x 32K, 128 x 8K, 32 x 8K,
8 x 8K, 1 x 2K} with the default launch parameters and the variants in DECODE_VARIANTS,
the FP8 exact sink, extend 4 x (8K cached + 2K new), store_kv of 32 and 8K tokens; every
head-major output is checked against the token-major one (same values, same kernel).
Times: bench_kernels.Timer (CUDA-graph replay, L2 flushed, median).

Usage (H200 host, ~4 min)::

    . bench/gpu_env.sh && python3 bench/kv_layout_gpu.py --out $OUT

Writes kv_layout_gpu.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kv_speed_gpu  # noqa: E402
from bench_kernels import Timer, rel_err  # noqa: E402
from kv_speed_gpu import HEAD_DIM, HEADS, KB, KV_HEADS, PAGE, fp8_sink, page_table  # noqa: E402

from radixlm.kernels.decode_attention import (  # noqa: E402
    decode_attention,
    decode_num_splits,
    default_decode_config,
)
from radixlm.kernels.extend_attention import extend_attention  # noqa: E402
from radixlm.kernels.store_kv import store_kv  # noqa: E402

DECODE_SHAPES = [(32, 32 * KB), (128, 8 * KB), (32, 8 * KB), (8, 8 * KB), (1, 2 * KB)]
# (pool, DecodeConfig fields replacing the default's); FP8 defaults: 64 keys / 2 warps / 3
# stages below batch 32, 32 keys / 1 warp / 3 stages / 8 programs per SM from 32.
DECODE_VARIANTS = [
    ("fp8", {"block_n": 16, "num_warps": 1, "num_stages": 4, "programs_per_sm": 8}),
    ("fp8", {"block_n": 64, "num_warps": 2, "num_stages": 3, "programs_per_sm": 4}),
    ("fp8", {"block_n": 64, "num_warps": 2, "num_stages": 4, "programs_per_sm": 8}),
    ("fp8", {"block_n": 128, "num_warps": 4, "num_stages": 2, "programs_per_sm": 4, "pages_ahead": False}),
    ("fp8", {"pages_ahead": False}),
    ("bf16", {"block_n": 32, "num_warps": 2}),
    ("bf16", {"num_stages": 3, "pages_ahead": True}),
]


def head_major(x: torch.Tensor) -> torch.Tensor:
    """The [P, S, K, D] view of a copy of ``x`` laid out [P, K, S, D] in memory."""
    return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def make_pools(num_tokens: int, device, gen) -> tuple[dict, int]:
    """{(layout, dtype): (k, v, k_scale, v_scale)} over the same random values
    (``kv_speed_gpu.make_pools``' bf16 and FP8 pools, and their head-major copies)."""
    speed_pools, pages = kv_speed_gpu.make_pools(num_tokens, device, gen)
    pools = {("token", "bf16"): speed_pools["base"][:4], ("token", "fp8"): speed_pools["fp8_e4m3"][:4]}
    for dt in ("bf16", "fp8"):
        a, b, s1, s2 = pools[("token", dt)]
        pools[("head", dt)] = (head_major(a), head_major(b), s1, s2)
    return pools, pages


def timed(timer: Timer, fn) -> float | str:
    try:
        return round(timer.median_us(fn, graph=True), 2)
    except Exception as exc:  # noqa: BLE001 - a variant may not compile; recorded
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def bench_decode(timer, pools, num_pages, batch, ctx, device, gen) -> dict:
    table = page_table(batch, ctx, num_pages, device, gen)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    sink = fp8_sink(batch, device, gen)
    row: dict = {"batch": batch, "context": ctx}
    outs = {}
    for (layout, dt), (k, v, ks, vs) in pools.items():
        base = default_decode_config(k.dtype, False, batch)
        runs = [("default", base)] + [(",".join(f"{a}={b}" for a, b in kw.items()), dataclasses.replace(base, **kw))
                                      for p, kw in DECODE_VARIANTS if p == dt]  # fmt: skip
        for name, config in runs:
            n = decode_num_splits(batch, KV_HEADS, ctx, device, config)
            out = torch.empty_like(q)

            def fn(k=k, v=v, ks=ks, vs=vs, c=config, n=n, o=out):
                return decode_attention(q, k, v, table, seq, HEAD_DIM**-0.5, num_splits=n, out=o, config=c,
                                        k_scale=ks, v_scale=vs)  # fmt: skip

            row[f"{layout}:{dt}:{name}"] = timed(timer, fn)
            if name == "default":
                outs[(layout, dt)] = fn().clone()
        if dt == "fp8":
            row[f"{layout}:fp8:sink"] = timed(timer, lambda k=k, v=v, ks=ks, vs=vs: decode_attention(
                q, k, v, table, seq, HEAD_DIM**-0.5, k_scale=ks, v_scale=vs, sink=sink))  # fmt: skip
    for dt in ("bf16", "fp8"):
        row[f"{dt}_head_vs_token_rel_err"] = rel_err(outs[("head", dt)], outs[("token", dt)])
    row["fp8_vs_bf16_rel_err"] = rel_err(outs[("head", "fp8")], outs[("token", "bf16")])
    for layout in ("token", "head"):
        row[f"{layout}_fp8_speedup"] = row[f"{layout}:bf16:default"] / row[f"{layout}:fp8:default"]
        row[f"{layout}_fp8_sink_speedup"] = row[f"{layout}:bf16:default"] / row[f"{layout}:fp8:sink"]
    row["fp8_head_vs_token_bf16"] = row["token:bf16:default"] / row["head:fp8:default"]
    return row


def bench_extend(timer, pools, num_pages, device, gen, batch=4, prefix=8 * KB, new=2 * KB) -> dict:
    table = page_table(batch, prefix + new, num_pages, device, gen)
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    cu = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)
    q = torch.randn(batch * new, HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    row: dict = {"batch": batch, "prefix": prefix, "new": new}
    outs = {}
    for (layout, dt), (k, v, ks, vs) in pools.items():
        def fn(k=k, v=v, ks=ks, vs=vs):
            return extend_attention(q, k, v, table, cu, prefix_lens, HEAD_DIM**-0.5, new, k_scale=ks, v_scale=vs)

        row[f"{layout}:{dt}"] = timed(timer, fn)
        outs[(layout, dt)] = fn().clone()
    for dt in ("bf16", "fp8"):
        row[f"{dt}_head_vs_token_rel_err"] = rel_err(outs[("head", dt)], outs[("token", dt)])
    return row


def bench_store(timer, pools, num_pages, tokens, device, gen) -> dict:
    slots = (torch.randperm((num_pages - 1) * PAGE, generator=gen)[:tokens] + PAGE).to(device)
    kv = torch.randn(tokens, 2 * KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    k, v = kv[:, :KV_HEADS], kv[:, KV_HEADS:]
    row: dict = {"tokens": tokens}
    for (layout, dt), (kp, vp, ks, vs) in pools.items():
        row[f"{layout}:{dt}"] = timed(timer, lambda kp=kp, vp=vp, ks=ks, vs=vs: store_kv(
            kp, vp, k, v, slots, k_scale=ks, v_scale=vs))  # fmt: skip
    # the written slots read back equal in both layouts
    page, off = slots // PAGE, slots % PAGE
    for dt in ("bf16", "fp8"):
        a, b = pools[("token", dt)][0], pools[("head", dt)][0]
        row[f"{dt}_store_equal"] = bool(torch.equal(a[page, off].view(torch.uint8), b[page, off].view(torch.uint8)))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=0.25, help="timing budget per measurement (seconds)")
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    cuda_gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.time()
    pools, num_pages = make_pools(max(b * c for b, c in DECODE_SHAPES) + 64 * PAGE, device, cuda_gen)
    timer = Timer(device, args.budget_s)
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "decode": [], "extend": None}
    for batch, ctx in DECODE_SHAPES:
        row = bench_decode(timer, pools, num_pages, batch, ctx, device, gen)
        report["decode"].append(row)
        print(json.dumps(row), flush=True)
    report["extend"] = bench_extend(timer, pools, num_pages, device, gen)
    print(json.dumps(report["extend"]), flush=True)
    report["store"] = [bench_store(timer, pools, num_pages, n, device, gen) for n in (32, 8 * KB)]
    print(json.dumps(report["store"]), flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_layout_gpu.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
