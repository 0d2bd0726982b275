"""Decode step time in-process: eager vs CUDA-graph replay, against the weight-bandwidth floor.

Builds a random-weight model of a real shape directly (no checkpoint on disk), a KV pool,
and B requests of ``--context`` tokens each; then times decode steps (forward + LM head +
greedy argmax, synchronised) eagerly and through ``CudaGraphRunner``. The floor is the
model's parameter bytes / the device's measured copy bandwidth (read + write of a 4 GiB
buffer, counted as 2x its size), the least time one decode step can take at batch 1
(``floor_ms`` over all parameters, as PERFORMANCE.md counts; ``read_floor_ms`` without the
embedding table, of which a step reads only B rows).

    python bench/kernels/decode_step.py --shape llama3-8b --batch 1 32 64 --out $OUT
    python bench/kernels/decode_step.py --kv-cache-dtype fp8_e4m3 [--kv-centred] --out $OUT

``--kv-cache-dtype fp8_e4m3`` runs FP8 pages with placeholder scales (speed does not
depend on their values); ``--kv-centred`` adds channel means, so the step also pays for
subtracting them in store_kv and adding ``v_mean`` back to every layer's output (in the
decode kernels' epilogue: the direct store or the split merge); ``--kv-rotated`` adds the
key rotation as well (the server's FP8 default: q @ R / D and k @ R inside the fused RoPE
kernel).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from radixlm.runtime.executor.attention import create_attention_backend
from radixlm.runtime.executor.cuda_graph_runner import CudaGraphRunner
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.models import LlamaForCausalLM
from radixlm.runtime.memory.kv_pool import KVPool


def copy_bandwidth(device: torch.device, gib: int = 4, reps: int = 20) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(gib * 2**30 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * reps / (time.perf_counter() - start)


def build_model(shape: dict, device: torch.device) -> LlamaForCausalLM:
    from transformers import LlamaConfig

    config = LlamaConfig(**shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, create_attention_backend("triton", device))
    model = model.to(torch.bfloat16).to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.02)
    return model.eval().requires_grad_(False)


def time_steps(step, steps: int) -> float:
    """Median seconds of ``step()`` over ``steps`` synchronised calls (after 3 warm-ups)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def measure_batch(
    model,
    runner: CudaGraphRunner,
    pool: KVPool,
    tables: list[list[int]],
    context: int,
    vocab: int,
    steps: int,
) -> dict:
    """Prefill B = len(tables) requests of ``context`` tokens, then time one decode step
    (forward + LM head + greedy ids to the host) eagerly and from the graph."""
    bs, page, device = len(tables), pool.page_size, pool.device
    model(ForwardBatch.build([[7] * context] * bs, [0] * bs, tables, [0], page, device), pool)
    positions, next_ids = [context] * bs, [i % vocab for i in range(bs)]

    def eager() -> None:
        batch = ForwardBatch.build(
            [[t] for t in next_ids], positions, tables, list(range(bs)), page, device
        )
        model.compute_logits(model(batch, pool)).argmax(-1).tolist()

    def graph() -> None:  # the graph includes the LM head
        runner.replay(next_ids, positions, tables).argmax(-1).tolist()

    device_time = device_ms(lambda: runner.replay(next_ids, positions, tables), steps)  # the graph (forward + LM head) alone, back to back
    return dict(batch=bs, eager_ms=time_steps(eager, steps) * 1e3, graph_ms=time_steps(graph, steps) * 1e3,
                graph_device_ms=device_time, kernels=kernel_breakdown(eager))


def device_ms(fn, steps: int) -> float:
    """Device ms per call of ``fn`` over ``steps`` back-to-back calls (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


@torch.inference_mode()
def graph_variants(model, pool: KVPool, tables: list[list[int]], context: int, max_pages: int, steps: int,
                   variants: dict[str, dict], rounds: int = 3) -> list[dict]:  # fmt: skip
    """Batch-1 graph device time (ms per step, the median of ``rounds`` interleaved rounds
    of ``steps`` back-to-back replays) per variant of kernels/gemv.py's module settings:
    ``variants`` maps a name to {attribute: value} set while its graph is captured (the
    model reads them at capture). The first variant is the reference of
    ``max_abs_diff_vs_first``."""
    from radixlm.kernels import gemv as gemv_mod

    page = pool.page_size
    model(ForwardBatch.build([[7] * context], [0], tables, [0], page, pool.device), pool)
    runners = {}
    for name, settings in variants.items():
        saved = {key: getattr(gemv_mod, key) for key in settings}
        for key, value in settings.items():
            setattr(gemv_mod, key, value)
        try:
            runners[name] = CudaGraphRunner(model, pool, 1, max_pages, torch.zeros(1, dtype=torch.int64, device=pool.device))
        finally:
            for key, value in saved.items():
                setattr(gemv_mod, key, value)
    times: dict[str, list[float]] = {name: [] for name in runners}
    logits = {}
    for _ in range(rounds):
        for name, runner in runners.items():
            logits[name] = runner.replay([11], [context], tables).clone()
            times[name].append(device_ms(lambda r=runner: r.replay([11], [context], tables), steps))
    ref = logits[next(iter(variants))]
    rows = [{"variant": name, "graph_device_ms": sorted(t)[len(t) // 2], "all_ms": t,
             "max_abs_diff_vs_first": (logits[name] - ref).abs().max().item()}
            for name, t in times.items()]  # fmt: skip
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def gemv_tile_variants() -> dict[str, dict]:
    """Tiles of the fused GEMVs (PROLOGUE_CONFIGS: RMSNorm(+RoPE/store) and SiLU prologues)."""
    from dataclasses import replace

    from radixlm.kernels.gemv import PROLOGUE_CONFIGS as base

    tiles = {"n16k256": (16, 256), "n8k512": (8, 512), "n32k256": (32, 256), "n16k512": (16, 512)}
    pairs = [(t, "n16k512") for t in tiles] + [("n32k256", t) for t in ("n8k512", "n32k256")]
    return {
        f"norm_{norm}_silu_{silu}": {"PROLOGUE_CONFIGS": dict(
            base,
            rmsnorm=replace(base["rmsnorm"], block_n=tiles[norm][0], block_k=tiles[norm][1]),
            silu_mul=replace(base["silu_mul"], block_n=tiles[silu][0], block_k=tiles[silu][1]),
        )}
        for norm, silu in pairs
    }  # fmt: skip


def kernel_breakdown(step, top: int = 12) -> dict:
    """Device time per kernel name over one eager step (torch.profiler), the top ones."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        if evt.device_time_total > 0:
            totals[evt.key[:80]] = [evt.device_time_total / 1e3, evt.count]
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {"total_ms": sum(v[0] for v in totals.values()), "launches": sum(v[1] for v in totals.values()),
            "top": ranked[:top]}


def main() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from gpu_e2e import SHAPES

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument(
        "--vocab", type=int, help="override the shape's vocabulary (Llama-3-8B: 128256)"
    )
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--kv-cache-dtype", choices=["bf16", "fp8_e4m3"], default="bf16")
    ap.add_argument("--kv-centred", action="store_true", help="fp8_e4m3 with channel means")
    ap.add_argument("--kv-rotated", action="store_true",
                    help="fp8_e4m3 with channel means and keys rotated (the fused RoPE kernel applies it)")
    ap.add_argument("--gemv-sweep", action="store_true",
                    help="batch 1: graph device time per tile of the fused GEMVs")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "decode_step",
                    help="output directory (default: bench/results/decode_step/)")
    args = ap.parse_args()
    device = torch.device("cuda")
    shape = dict(SHAPES[args.shape], **({"vocab_size": args.vocab} if args.vocab else {}))
    model = build_model(shape, device)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    read = params - (0 if model.tie_word_embeddings else embed.numel() * embed.element_size())
    bandwidth = copy_bandwidth(device)
    page = 16
    max_bs = max(args.batch)
    pages_per_req = -(-(args.context + args.steps + 8) // page)
    head_dim = shape["head_dim"]
    layers, kv_heads = shape["num_hidden_layers"], shape["num_key_value_heads"]
    quant: tuple = (None, None)
    if args.kv_cache_dtype == "fp8_e4m3":
        quant = (torch.full((layers, kv_heads), 0.02), torch.full((layers, kv_heads), 0.02))
        if args.kv_centred or args.kv_rotated:
            quant += (torch.zeros(layers, kv_heads, head_dim), torch.full((layers, kv_heads, head_dim), 0.01))
    pool = KVPool(max_bs * pages_per_req + 1, page, layers, kv_heads, head_dim, torch.bfloat16, device,
                  args.kv_cache_dtype, *quant, k_rotation="hadamard" if args.kv_rotated else None)  # fmt: skip
    tables = [
        list(range(1 + b * pages_per_req, 1 + (b + 1) * pages_per_req)) for b in range(max_bs)
    ]
    start = time.perf_counter()
    prev_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
    runner = CudaGraphRunner(model, pool, max_bs, shape["max_position_embeddings"] // page, prev_ids)
    capture_s = time.perf_counter() - start
    result = dict(
        shape=args.shape,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        param_bytes=params,
        copy_bandwidth_Bps=bandwidth,
        floor_ms=params / bandwidth * 1e3,
        read_bytes=read,
        read_floor_ms=read / bandwidth * 1e3,
        capture_s=capture_s,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_centred=args.kv_centred or args.kv_rotated,
        kv_rotated=args.kv_rotated,
        context=args.context,
        rows=[],
    )
    if args.gemv_sweep:
        result["gemv_sweep"] = graph_variants(model, pool, tables[:1], args.context,
                                              shape["max_position_embeddings"] // page, args.steps,
                                              gemv_tile_variants())  # fmt: skip
    for bs in args.batch:
        row = measure_batch(
            model, runner, pool, tables[:bs], args.context, shape["vocab_size"], args.steps
        )
        row["graph_over_floor"] = row["graph_ms"] / result["floor_ms"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    kv = "" if args.kv_cache_dtype == "bf16" else f"_{args.kv_cache_dtype}{'_centred' * (args.kv_centred or args.kv_rotated)}{'_rotated' * args.kv_rotated}"
    (args.out / f"decode_step_{args.shape}{kv}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
