"""GPU end-to-end check and measurements: radixlm server vs transformers, same weights.

Builds a random-weight bf16 Hugging Face checkpoint of a real model shape (``--shape``), or
takes a real model (``--model-path``: an HF directory or a GGUF file, converted as the server
does), starts ``radixlm launch_server --device cuda`` on it, and reports:
  * prompt logprobs of radixlm vs transformers (SDPA, same bf16 weights) on the same
    prompts: max / mean |delta|;
  * greedy tokens: agreement until the first near-tie (transformers' top-2 logit margin
    below ``--tie-margin`` at that step) — a divergence after a near-tie is numerics; with
    ``--fp32-reference`` also where radixlm and transformers-bf16 each leave fp32 greedy;
  * decode throughput at batch 1 and 32 (fixed output length, ``ignore_eos``), TPOT from
    streamed timestamps;
  * TTFT of a 4K-token prompt cold vs with its first 3968 tokens cached.
Results go to ``--out`` as JSON. Usage (on the GPU host, radixlm importable):

    python bench/e2e/gpu_e2e.py --shape smollm2 --tokenizer-dir tok/ --out $OUT
    python bench/e2e/gpu_e2e.py --model-path SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT

With a real model the accuracy prompts are chat-templated questions (``QUESTIONS``), not
random ids.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson
import torch

from radixlm.runtime.bench.server_process import ServerProcess

DEVICE = os.environ.get("GPU_E2E_DEVICE", "cuda")  # "cpu" for a dry run of this script

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    # SmolLM2-135M-Instruct's real configuration.
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    # Llama-3-8B's shape (vocab cut to the carried tokenizer's 49152 so every id decodes).
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def server_flags(model_dir: Path, extra: str = "") -> list[str]:
    """launch_server flags for a benchmark server on ``model_dir`` (plus ``extra``)."""
    return ["--model-path", str(model_dir), "--device", DEVICE, "--log-level", "warning", *extra.split()]


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast the parameters only, as ``from_pretrained(dtype=...)`` leaves a model.

    ``model.to(bfloat16)`` would also round the rotary ``inv_freq`` buffer to bf16, which
    moves every RoPE angle (by ~0.4 rad at position 200 for the fastest frequency) and made
    an earlier reference (and its fp32 copy) drift from the real model.
    """
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def build_checkpoint(
    shape: str, tokenizer_dir: Path, root: Path, dtype: torch.dtype = torch.bfloat16,
    vocab: int | None = None,
):
    """Random weights (std 0.02, as Llama's init) saved with save_pretrained in ``dtype``;
    ``vocab`` overrides the shape's vocabulary size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = root / (shape if vocab is None else f"{shape}-v{vocab}")
    overrides = {} if vocab is None else {"vocab_size": vocab}
    config = LlamaConfig(**{**SHAPES[shape], **overrides}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = cast_parameters(LlamaForCausalLM(config), dtype).eval()
    if not (out / "config.json").exists():
        model.save_pretrained(out)
        for f in tokenizer_dir.iterdir():
            if (
                f.name not in ("config.json", "generation_config.json")
                and f.suffix != ".safetensors"
            ):
                shutil.copy(f, out / f.name)
    return out, model


QUESTIONS = [
    "What is the capital of France, and why is it famous?",
    "Explain in two sentences how a hash table works.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.",
]


def load_real_model(model_path: str, dtype: torch.dtype):
    """(HF directory the server will use, transformers model on DEVICE in ``dtype``)."""
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.executor.model_loader import resolve_model_path

    model_dir = Path(resolve_model_path(model_path))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
    return model_dir, model


def chat_prompts(model_dir: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for q in (QUESTIONS * n)[:n]
    ]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' logprob of each prompt token given the ones before it: [L-1] float32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=DEVICE)).logits[0].float()
    targets = torch.tensor(ids[1:], device=DEVICE)[:, None]
    return torch.log_softmax(logits, -1)[:-1].gather(1, targets)[:, 0].cpu()


def _greedy(model, ids: list[int], new_tokens: int) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """transformers greedy continuation (stops at EOS) and the logits of each step."""
    out = model.generate(
        torch.tensor([ids], device=DEVICE),
        max_new_tokens=new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(ids) :].tolist(), out.scores


def _divergence(ours: list[int], ref: list[int], ref_scores) -> tuple[int | None, float | None]:
    """(first position where ``ours`` leaves ``ref``, ref's top-2 logit margin there); ``ref``
    may be shorter (it stopped at EOS), ``ours`` ran with ignore_eos."""
    k = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    if k is None:
        return None, None
    top2 = ref_scores[k][0].float().topk(2).values
    return k, (top2[0] - top2[1]).item()


def compare_logits(
    url: str, model, ids_list: list[list[int]], new_tokens: int, tie_margin: float, model32=None
) -> dict:
    """radixlm prompt logprobs + greedy tokens vs transformers on the same weights. With
    ``model32`` (the same weights in fp32) also the bf16 noise floor: transformers-bf16 vs
    fp32 and radixlm vs fp32, for the prompt logprobs and the greedy continuations. Greedy
    runs are compared up to transformers' EOS (radixlm runs with ignore_eos)."""
    diffs, floor, ours32 = [], [], []
    div, div32_ours, div32_hf = [], [], []
    with httpx.Client(base_url=url, timeout=600) as c:
        for ids in ids_list:
            r = c.post(
                "/generate",
                json={
                    "input_ids": ids,
                    "return_logprob": True,
                    "logprob_start_len": 0,
                    "sampling_params": {
                        "max_new_tokens": new_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                },
            ).json()
            ours = torch.tensor([t[0] for t in r["meta_info"]["input_token_logprobs"][1:]])
            ref = _ref_logprobs(model, ids)
            diffs.append((ours - ref).abs())
            ref_ids, ref_scores = _greedy(model, ids, new_tokens)
            div.append(_divergence(r["output_ids"], ref_ids, ref_scores))
            if model32 is not None:
                ref32 = _ref_logprobs(model32, ids)
                floor.append((ref - ref32).abs())
                ours32.append((ours - ref32).abs())
                ids32, scores32 = _greedy(model32, ids, new_tokens)
                div32_ours.append(_divergence(r["output_ids"], ids32, scores32))
                div32_hf.append(_divergence(ref_ids, ids32, scores32))
    d = torch.cat(diffs)
    extra = {}
    if floor:
        extra = {
            "transformers_bf16_vs_fp32_mean_abs_diff": torch.cat(floor).mean().item(),
            "radixlm_vs_transformers_fp32_mean_abs_diff": torch.cat(ours32).mean().item(),
            "greedy_radixlm_vs_fp32": div32_ours,
            "greedy_transformers_bf16_vs_fp32": div32_hf,
        }
    diverged = [(k, m) for k, m in div if k is not None]
    return {
        **extra,
        "prompts": len(ids_list),
        "prompt_logprob_max_abs_diff": d.max().item(),
        "prompt_logprob_mean_abs_diff": d.mean().item(),
        "greedy_identical": len(div) - len(diverged),
        "first_divergence_positions": [k for k, _ in diverged],
        "margins_at_divergence": [m for _, m in diverged],
        "divergences_at_near_tie": sum(m < tie_margin for _, m in diverged),
        "tie_margin": tie_margin,
    }


def stream_generate(url: str, body: dict) -> tuple[float, list[float], dict]:
    """POST a streaming ``/generate``: (send time, arrival time of each data chunk, the
    last chunk parsed), times from ``time.perf_counter`` in seconds. The last chunk's
    ``output_ids`` and ``text`` are the whole output: a server with ``--stream-output``
    sends disjoint segments, which are joined here (its last chunk holds only the last).

    The body is encoded (orjson) and the connection opened before the clock starts, and
    the stream is read with ``http.client``: httpx (json.dumps, h11's pure-Python parsing)
    added 0.3-0.8 ms to the TTFT of a 4096-id prompt on the CPU box, 0.1 ms for 16 ids
    (timed against a stub server that answers at once). Thread-safe: one connection per call."""
    parts = urlsplit(url)
    data = orjson.dumps({**body, "stream": True})
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    try:
        conn.connect()
        t0, stamps, lines = time.perf_counter(), [], []
        conn.request("POST", "/generate", body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        for line in r:  # lines of the chunked SSE body
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
                lines.append(line)
    finally:
        conn.close()
    if not stamps:
        raise RuntimeError(f"no data chunk from {url}/generate (HTTP {r.status})")
    chunks = [orjson.loads(line[6:]) for line in lines]
    last = chunks[-1]
    if len(last["output_ids"]) < last["meta_info"]["completion_tokens"]:  # segments
        last["output_ids"] = [i for c in chunks for i in c["output_ids"]]
        last["text"] = "".join(c["text"] for c in chunks)
    return t0, stamps, last


def stream_one(url: str, ids: list[int], out_len: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True},
    }
    t0, stamps, _ = stream_generate(url, body)
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return {"ttft_s": ttft, "tpot_s": tpot, "latency_s": stamps[-1] - t0}


def decode_throughput(url: str, batch: int, in_len: int, out_len: int, vocab: int) -> dict:
    ids = prompts(batch, in_len, vocab, seed=100 + batch)
    stream_one(url, ids[0], 4)  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        res = list(pool.map(lambda p: stream_one(url, p, out_len), ids))
    wall = time.perf_counter() - t0
    tpots = sorted(r["tpot_s"] for r in res)
    return {
        "batch": batch,
        "in_len": in_len,
        "out_len": out_len,
        "wall_s": wall,
        "output_tokens_per_s": batch * out_len / wall,
        "median_tpot_ms": 1e3 * tpots[len(tpots) // 2],
        "decode_tokens_per_s": batch / tpots[len(tpots) // 2],
    }


def prefix_ttft(url: str, vocab: int) -> dict:
    base = prompts(1, 4096, vocab, seed=7)[0]
    httpx.post(f"{url}/flush_cache", timeout=60)
    cold = stream_one(url, base, 2)["ttft_s"]
    warm_ids = base[:3968] + prompts(1, 128, vocab, seed=8)[0]
    warm = stream_one(url, warm_ids, 2)["ttft_s"]
    return {"cold_ttft_s": cold, "cached_3968_ttft_s": warm, "ratio": warm / cold}


def hf_decode(model, batch: int, in_len: int, out_len: int, vocab: int) -> dict:
    ids = torch.tensor(prompts(batch, in_len, vocab, seed=200 + batch), device=DEVICE)
    model.generate(ids[:, :16], max_new_tokens=4, do_sample=False)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {
        "batch": batch,
        "in_len": in_len,
        "out_len": out_len,
        "wall_s": wall,
        "output_tokens_per_s": batch * out_len / wall,
    }


def measure(url: str, model, vocab: int, args: argparse.Namespace, result: dict) -> None:
    result["model_info"] = httpx.get(f"{url}/get_model_info").json()
    model32 = None
    if args.fp32_reference:
        import copy

        model32 = copy.deepcopy(model).float()
    ids_list = (
        chat_prompts(Path(args.model_path_resolved), args.num_prompts)
        if args.model_path
        else prompts(args.num_prompts, 200, vocab, seed=1)
    )
    result["accuracy"] = compare_logits(url, model, ids_list, 32, args.tie_margin, model32)
    del model32
    print(json.dumps(result["accuracy"]), flush=True)
    if not args.skip_perf:
        result["prefix_ttft"] = prefix_ttft(url, vocab)
        result["radixlm_decode"] = [decode_throughput(url, b, 512, 128, vocab) for b in (1, 32)]
        result["hf_generate"] = [hf_decode(model, b, 512, 128, vocab) for b in (1, 32)]
    result["invariants"] = httpx.get(f"{url}/debug/check_invariants", timeout=60).json()


def main() -> None:
    ap = argparse.ArgumentParser()
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--shape", choices=list(SHAPES), help="random weights of this shape")
    which.add_argument("--model-path", help="a real model: HF directory or GGUF file")
    ap.add_argument("--tokenizer-dir", type=Path, help="tokenizer files for --shape")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "gpu_e2e",
                    help="output directory (default: bench/results/gpu_e2e/)")
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--tie-margin", type=float, default=0.1)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--skip-perf", action="store_true")
    ap.add_argument(
        "--fp32-reference",
        action="store_true",
        help="also compare with the same weights in fp32 (the bf16 noise floor)",
    )
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    t0 = time.time()
    dtype = getattr(torch, args.dtype)
    if args.model_path:
        model_dir, model = load_real_model(args.model_path, dtype)
        args.model_path_resolved, args.shape = str(model_dir), model_dir.name
        vocab = model.config.vocab_size
    else:
        if args.tokenizer_dir is None:
            ap.error("--shape needs --tokenizer-dir")
        model_dir, model = build_checkpoint(
            args.shape, args.tokenizer_dir, args.models_root / args.dtype, dtype
        )
        vocab = SHAPES[args.shape]["vocab_size"]
    print(f"checkpoint ready in {time.time() - t0:.0f} s", flush=True)
    flags = server_flags(model_dir, f"--dtype {args.dtype} {args.server_args}")
    result = {
        "shape": args.shape,
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "server_args": args.server_args,
    }
    with ServerProcess.launch(flags, startup_timeout=300) as srv:
        measure(srv.url, model, vocab, args, result)
        result["server_exit_code"] = srv.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_e2e_{args.shape}_{args.dtype}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
