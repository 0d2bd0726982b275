"""Structured-generation overhead: decode speed with a JSON-schema grammar vs unconstrained.

For each batch size B, B concurrent streaming ``/generate`` requests of 128 output tokens
(same prompts both times), once unconstrained (``ignore_eos``) and once under a JSON
schema whose shortest valid output is far longer than 128 tokens (an array of 100
integers), so both run exactly 128 decode steps. Reports output tokens/s and the median
TPOT (time per output token after the first, from streamed timestamps); the mask
overhead is TPOT(schema) / TPOT(free) - 1, from the best of ``--repeats`` alternating runs
of each mode (the host is noisy). Usage:

    python bench/structured/bench_structured.py --model-path DIR_OR_GGUF --out $OUT [--device cuda]
    python bench/structured/bench_structured.py --shape smollm2 --tokenizer-dir .gpu_tok --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parents[1]  # bench/: its topic folders hold shared helpers
sys.path[:0] = [str(BENCH / d) for d in ("e2e",)]
from gpu_e2e import (  # noqa: E402
    DEVICE,
    SHAPES,
    build_checkpoint,
    load_real_model,
    server_flags,
    stream_generate,
)

from radixlm.runtime.bench.server_process import ServerProcess  # noqa: E402

SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 100,
    "maxItems": 100,
}
OUTPUT_LEN = 128


def _stream(url: str, prompt: str, sampling: dict) -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": OUTPUT_LEN, **sampling}}
    t0, stamps, last = stream_generate(url, body)
    tokens = last["meta_info"]["completion_tokens"]
    return {
        "ttft_s": stamps[0] - t0,
        "tpot_s": (stamps[-1] - stamps[0]) / max(tokens - 1, 1),
        "tokens": tokens,
        "finish": last["meta_info"]["finish_reason"]["type"],
        "text": last["text"],
    }


def run_batch(url: str, batch: int, sampling: dict) -> dict:
    prompts = [
        f"Request {i}: list one hundred numbers between 0 and 999 as a JSON array: "
        for i in range(batch)
    ]
    _stream(
        url, prompts[0], {**sampling, "max_new_tokens": 4}
    )  # warm-up (grammar compile, kernels)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        res = list(pool.map(lambda p: _stream(url, p, sampling), prompts))
    wall = time.perf_counter() - t0
    return {
        "batch": batch,
        "wall_s": wall,
        "output_tok_s": sum(r["tokens"] for r in res) / wall,
        "median_tpot_ms": 1e3 * statistics.median(r["tpot_s"] for r in res),
        "tokens": [r["tokens"] for r in res],
        "finish": sorted({r["finish"] for r in res}),
        "sample_text": res[0]["text"][:120],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--shape", choices=list(SHAPES))
    which.add_argument("--model-path")
    ap.add_argument("--tokenizer-dir", type=Path)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--server-args", default="")
    ap.add_argument(
        "--repeats", type=int, default=3, help="alternating runs per mode; the best is reported"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "bench_structured",
                    help="output directory (default: bench/results/bench_structured/)")
    args = ap.parse_args()
    import torch

    if args.model_path:
        model_dir, model = load_real_model(
            args.model_path, torch.bfloat16 if DEVICE == "cuda" else torch.float32
        )
    else:
        model_dir, model = build_checkpoint(
            args.shape, args.tokenizer_dir, Path("/tmp/models/bfloat16")
        )
    del model
    flags = server_flags(model_dir, args.server_args)
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"server_{Path(model_dir).name}.log", "w")  # noqa: SIM115 - closed below
    with log, ServerProcess.launch(flags, log=log, startup_timeout=600) as srv:
        for batch in args.batch_sizes:
            runs: dict[str, list[dict]] = {"free": [], "json_schema": []}
            for _ in range(args.repeats):  # alternate, so drift and warm-up hit both alike
                runs["free"].append(
                    run_batch(srv.url, batch, {"temperature": 0, "ignore_eos": True})
                )
                runs["json_schema"].append(
                    run_batch(srv.url, batch, {"temperature": 0, "json_schema": json.dumps(SCHEMA)})
                )
            free, constrained = (min(runs[k], key=lambda r: r["median_tpot_ms"]) for k in runs)
            row = {
                "batch": batch,
                "free": free,
                "json_schema": constrained,
                "tpot_ms_all_runs": {k: [r["median_tpot_ms"] for r in v] for k, v in runs.items()},
                "mask_overhead": constrained["median_tpot_ms"] / free["median_tpot_ms"] - 1,
            }
            print(
                json.dumps({k: row[k] for k in ("batch", "tpot_ms_all_runs", "mask_overhead")}),
                flush=True,
            )
            rows.append(row)
        invariants = httpx.get(f"{srv.url}/debug/check_invariants", timeout=60).json()
    result = {
        "model": str(model_dir),
        "device": DEVICE,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
        "invariants": invariants,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"bench_structured_{Path(model_dir).name}.json").write_text(
        json.dumps(result, indent=1)
    )


if __name__ == "__main__":
    main()
