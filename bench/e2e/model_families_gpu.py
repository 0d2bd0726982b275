"""Qwen3-8B dense and Qwen3-30B-A3B MoE served end to end (random weights, real shapes), and
the fused MoE kernel against the GPU's measured ceilings.

Per ``--shape`` (a config.json of the real shape plus the carried tokenizer files; the server
runs ``--load-format dummy``, so no 16 / 61 GB checkpoint is written):
1. ``radixlm launch_server`` on it; decode at batch 1 and 64 (random 512-token prompts, 256
   output tokens, ``radixlm bench serving``), then the 1000-prompt ShareGPT offline run
   (request rate inf) — the steps of ``bench/serving/gpu_serving.py``'s ``Runner``;
2. the batch-1 decode time per token (median ITL) against its floor: the active weight bytes
   of one token (attention, norms, the router, k experts per MoE layer, the LM head) / the
   measured copy bandwidth;
3. MoE shapes only, in process (``--moe-sweep``: each tile config of ``MOE_SWEEP`` too, to tune
   ``default_moe_config``): ``kernels.fused_moe.fused_moe`` for one layer of the shape at
   T = 1 .. 4096 tokens (routing from random logits), CUDA-graph replay, L2 flushed: achieved
   TFLOP/s (6 T k E F) against the measured bf16 matmul ceiling and bytes/s (the weights of
   the experts hit + activations) against the measured copy bandwidth; the T = 1 step against
   its floor (k experts' weight bytes / bandwidth); relative error against
   ``reference.fused_moe`` (< 1e-2 in bf16).

Writes ``--out``/``model_families_<shape>.json`` (+ ``serving.jsonl``, ``server.log``).

    . bench/gpu_env.sh && python3 bench/e2e/model_families_gpu.py --shape qwen3-30b-a3b \\
        --tokenizer-dir .gpu_tok --dataset-path .gpu_data/sharegpt_subset.jsonl --out $OUT

CPU dry run (tiny shapes, Triton interpreter, a few prompts):

    GPU_E2E_DEVICE=cpu TRITON_INTERPRET=1 .venv/bin/python bench/e2e/model_families_gpu.py \\
        --shape tiny-qwen3-moe --tokenizer-dir ~/.cache/radixlm/models/SmolLM2-135M-Instruct.Q4_1-* \\
        --dataset-path sharegpt_subset.jsonl --num-prompts 4 --decode-batches 1 2 \\
        --decode-prompts 2 --moe-tokens 1 4 --server-args "--max-total-tokens 4096"
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH / d) for d in ("e2e", "serving", "kernels")]
from bench_kernels import Timer, measure_ceilings  # noqa: E402
from gpu_e2e import DEVICE, server_flags  # noqa: E402
from gpu_serving import Runner  # noqa: E402

from radixlm.kernels import reference  # noqa: E402
from radixlm.runtime.bench.server_process import ServerProcess  # noqa: E402

_QWEN3_COMMON = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=128, bos_token_id=1, eos_token_id=2)
SHAPES: dict[str, tuple[str, dict]] = {
    # Qwen/Qwen3-8B config.json
    "qwen3-8b": ("Qwen3ForCausalLM", dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288,
                                          num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8)),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts, 8 per token, expert F 768
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", dict(
        _QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "tiny-qwen3": ("Qwen3ForCausalLM", dict(_QWEN3_COMMON, vocab_size=49152, hidden_size=64, head_dim=16,
                                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2)),
    "tiny-qwen3-moe": ("Qwen3MoeForCausalLM", dict(
        _QWEN3_COMMON, vocab_size=49152, hidden_size=64, head_dim=16, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
}  # fmt: skip


def write_config(shape: str, tokenizer_dir: Path, root: Path) -> Path:
    """config.json of ``shape`` + the tokenizer files; the server fills random weights."""
    arch, cfg = SHAPES[shape]
    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    model_type = "qwen3_moe" if "Moe" in arch else "qwen3"
    (out / "config.json").write_text(json.dumps(dict(cfg, architectures=[arch], model_type=model_type,
                                                     torch_dtype="bfloat16"), indent=1))  # fmt: skip
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name not in ("config.json", "generation_config.json") and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def active_weight_bytes(shape: str, dtype_bytes: int = 2) -> dict[str, int]:
    """Weight bytes one decode token reads: per layer attention (q, k, v, o), q/k norms, the
    MLP (dense: 3 E F; MoE: router + k experts' 3 E F), plus the LM head (the embedding row
    is negligible)."""
    _, c = SHAPES[shape]
    e, d = c["hidden_size"], c["head_dim"]
    attn = e * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    if "num_experts" in c:
        mlp = e * c["num_experts"] + c["num_experts_per_tok"] * 3 * e * c["moe_intermediate_size"]
    else:
        mlp = 3 * e * c["intermediate_size"]
    layers = c["num_hidden_layers"] * (attn + mlp + 2 * e + 2 * d)
    return {"layers": layers * dtype_bytes, "lm_head": e * c["vocab_size"] * dtype_bytes,
            "total": (layers + e * c["vocab_size"]) * dtype_bytes}  # fmt: skip


# Tile candidates of --moe-sweep (block_m, block_n, block_k, warps, stages): small row blocks and
# narrow / wide column blocks for decode, larger ones for prefill.
MOE_SWEEP = [(16, 32, 64, 4, 4), (16, 32, 128, 4, 4), (16, 64, 64, 4, 3), (16, 64, 128, 4, 4), (16, 128, 64, 4, 3),
             (16, 128, 128, 8, 3), (32, 64, 64, 4, 3), (32, 64, 128, 4, 4), (32, 128, 64, 4, 3), (64, 64, 64, 4, 3),
             (64, 128, 64, 8, 3), (64, 128, 128, 8, 3), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3)]  # fmt: skip


def bench_moe_kernel(shape: str, tokens: list[int], timer: Timer, ceil: dict, sweep: bool = False) -> list[dict]:
    """The fused MoE kernel on one layer of ``shape`` at each T (module docstring, step 3);
    ``sweep``: also each tile config of ``MOE_SWEEP`` at each T (``sweep_us``: config -> us,
    ``best``: the fastest), to tune ``default_moe_config``."""
    from radixlm.kernels.fused_moe import MoeConfig, fused_moe

    _, c = SHAPES[shape]
    e, f, x, k = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["num_experts_per_tok"]
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = (torch.randn(x, 2 * f, e, generator=g, device=DEVICE) * e**-0.5).to(dtype)
    w2 = (torch.randn(x, e, f, generator=g, device=DEVICE) * f**-0.5).to(dtype)
    rows = []
    for t in tokens:
        h = torch.randn(t, e, generator=g, device=DEVICE).to(dtype)
        weights, ids = reference.moe_route(torch.randn(t, x, generator=g, device=DEVICE), k, True)
        out = fused_moe(h, w13, w2, weights, ids)
        ref = reference.fused_moe(h, w13, w2, weights, ids)
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        us = timer.median_us(lambda h=h, w=weights, i=ids: fused_moe(h, w13, w2, w, i), graph=True)
        hit = int(torch.unique(ids).numel())
        weight_bytes = hit * 3 * e * f * h.element_size()
        act_bytes = t * e * h.element_size() * 2 + t * k * (3 * f + e) * h.element_size() * 2
        flop = 6 * t * k * e * f
        row = {"tokens": t, "experts_hit": hit, "us": us, "graph": timer.last_mode, "rel_err_vs_reference": rel,
               "tflop_per_s": flop / us * 1e-6, "tflop_fraction_of_ceiling": flop / (us * 1e-6) / ceil["matmul_flop_per_s"],
               "bytes_per_s": (weight_bytes + act_bytes) / (us * 1e-6),
               "bandwidth_fraction_of_ceiling": (weight_bytes + act_bytes) / (us * 1e-6) / ceil["copy_bytes_per_s"]}  # fmt: skip
        if t == 1:
            floor_us = k * 3 * e * f * h.element_size() / ceil["copy_bytes_per_s"] * 1e6
            row.update(floor_us=floor_us, time_over_floor=us / floor_us)
        if sweep:
            row["sweep_us"] = {}
            for cand in MOE_SWEEP:
                config = MoeConfig(*cand)
                run = lambda h=h, w=weights, i=ids, config=config: fused_moe(h, w13, w2, w, i, config)  # noqa: E731
                row["sweep_us"]["/".join(map(str, cand))] = timer.median_us(run, graph=True)
            row["best"] = min(row["sweep_us"], key=row["sweep_us"].get)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), required=True)
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    ap.add_argument("--dataset-path", required=True, help="ShareGPT JSON / JSON lines")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "model_families")
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--server-args", default="")
    ap.add_argument("--num-prompts", type=int, default=1000, help="offline ShareGPT requests")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--decode-prompts", type=int, default=0, help="prompts per decode run (default 2 x batch, 3 at batch 1)")
    ap.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=540.0, help="a step that would start after this is skipped")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--moe-sweep", action="store_true", help="also time each tile config of MOE_SWEEP at each T")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"shape": args.shape, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}
    timer = Timer(torch.device(DEVICE), budget_s=0.5)
    ceil = measure_ceilings(type("S", (), {"device": torch.device(DEVICE)})(), timer)
    result["ceilings"] = ceil
    result["active_weight_bytes"] = active_weight_bytes(args.shape)
    result["batch1_decode_floor_ms"] = result["active_weight_bytes"]["total"] / ceil["copy_bytes_per_s"] * 1e3
    if "num_experts" in SHAPES[args.shape][1]:
        result["moe_kernel"] = bench_moe_kernel(args.shape, args.moe_tokens, timer, ceil, args.moe_sweep)
    if not args.skip_serving:
        run = Runner(args)
        model_dir = write_config(args.shape, args.tokenizer_dir, args.models_root)
        flags = server_flags(model_dir, f"--dtype {'bfloat16' if DEVICE == 'cuda' else 'float32'} "
                                        f"--load-format dummy {args.server_args}")  # fmt: skip
        with open(args.out / "server.log", "w") as log, \
                ServerProcess.launch(flags, log=log, startup_timeout=900) as srv:  # fmt: skip
            url = ["--base-url", srv.url, "--flush-cache"]
            for bs in args.decode_batches:
                n = args.decode_prompts or (3 if bs == 1 else 2 * bs)
                run.bench(f"decode-batch{bs}", *url, *run.random(n, bs))
            run.bench("sharegpt-offline", *url, *run.sharegpt(args.num_prompts))
        summary = run.write_summary()
        result["serving"] = summary
        # the median gap between tokens (from id counts), not TPOT: with random weights the
        # stream can hold ids back for long runs of bytes that complete no UTF-8 character,
        # which delays the first event and shrinks (e2e - TTFT) / tokens
        itl = (summary["runs"].get("decode-batch1") or [{}])[0].get("median_itl_ms")
        if itl:
            result["batch1_decode_itl_over_floor"] = itl / result["batch1_decode_floor_ms"]
    path = args.out / f"model_families_{args.shape}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "serving"}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
