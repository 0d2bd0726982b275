"""Where does a bf16 forward drift from fp32? radixlm vs transformers, layer by layer.

Builds one random-weight Llama of a real shape (std 0.02, Llama's init) in bf16, the same
weights upcast to fp32 as the reference, and runs random-id prompts through:
  * transformers bf16 (SDPA), transformers bf16 (eager attention);
  * radixlm bf16 with each attention backend, and variants that isolate one numeric
    choice: q/k/v and gate/up as separate GEMMs instead of merged ones, and cuBLAS
    bf16 reduced-precision split-K reductions switched off.
For each it reports the mean |delta logprob| of the prompt tokens against the fp32
reference, and the relative error ||h - h32|| / ||h32|| of the hidden state after
selected layers. In-process, no server. Usage (GPU host, radixlm importable):

    python bench/e2e/bf16_drift.py --shape llama3-8b --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from radixlm.runtime.executor.attention import create_attention_backend
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.models import LlamaForCausalLM
from radixlm.runtime.memory.kv_pool import KVPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import DEVICE, SHAPES, cast_parameters, prompts  # noqa: E402


def build_models(shape: str):
    """(transformers bf16, transformers fp32 copy, config) with the same random weights; the
    rotary ``inv_freq`` buffers stay float32 as ``from_pretrained`` leaves them."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        hf16 = cast_parameters(HFLlama(config), torch.bfloat16).eval()
    hf32 = copy.deepcopy(hf16).float()
    return hf16, hf32, config


def ours_from(hf: torch.nn.Module, config, backend: str) -> LlamaForCausalLM:
    """radixlm's model with ``hf``'s weights and dtype."""
    dtype = next(hf.parameters()).dtype
    with torch.device("meta"):
        model = LlamaForCausalLM(config, create_attention_backend(backend, torch.device(DEVICE)))
    model = model.to(dtype).to_empty(device=DEVICE)
    model.load_weights(hf.state_dict().items())
    return model.eval().requires_grad_(False)


def _split_linear(linear: torch.nn.Linear, sizes: list[int]) -> None:
    """Make a merged Linear run as separate GEMMs (one per shard), concatenated."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        ws = linear.weight.split(sizes, dim=0)
        bs = linear.bias.split(sizes) if linear.bias is not None else [None] * len(sizes)
        return torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs, strict=True)], dim=-1)

    linear.forward = forward


def unmerge(model: LlamaForCausalLM) -> LlamaForCausalLM:
    for layer in model.model.layers:
        _split_linear(layer.self_attn.qkv_proj, layer.self_attn.split_sizes)
        _split_linear(layer.mlp.gate_up_proj, [model.config.intermediate_size] * 2)
    return model


def _run_hooked(layers, forward) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits [T, V] float32 from ``forward()``, each layer's output [T, E] float32)."""
    hidden: list[torch.Tensor] = []

    def hook(_module, _inputs, out) -> None:
        out = out[0] if isinstance(out, tuple) else out
        hidden.append(out.reshape(-1, out.shape[-1]).float())

    hooks = [layer.register_forward_hook(hook) for layer in layers]
    try:
        with torch.inference_mode():
            logits = forward()
    finally:
        for h in hooks:
            h.remove()
    return logits, hidden


def ours_run(model: LlamaForCausalLM, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cfg, page = model.config, 16
    pages = -(-len(ids) // page)
    pool = KVPool(
        pages + 1,
        page,
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        next(model.parameters()).dtype,
        DEVICE,
    )
    batch = ForwardBatch.build(
        [ids], [0], [list(range(1, pages + 1))], list(range(len(ids))), page, DEVICE
    )
    return _run_hooked(model.model.layers, lambda: model.compute_logits(model(batch, pool)))


def hf_run(model, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.tensor([ids], device=DEVICE)
    return _run_hooked(model.model.layers, lambda: model(x).logits[0].float())


def prompt_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    targets = torch.tensor(ids[1:], device=logits.device)[:, None]
    return torch.log_softmax(logits, -1)[:-1].gather(1, targets)[:, 0]


@contextlib.contextmanager
def reduced_precision_reduction(enabled: bool):
    old = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--backends", default="triton,torch" if DEVICE == "cuda" else "torch")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results" / "bf16_drift",
                    help="output directory (default: bench/results/bf16_drift/)")
    args = ap.parse_args()
    t0 = time.time()
    hf16, hf32, config = build_models(args.shape)
    ids_list = prompts(args.num_prompts, args.prompt_len, config.vocab_size, seed=1)
    refs = [hf_run(hf32, ids) for ids in ids_list]
    num_layers = config.num_hidden_layers
    report_layers = sorted(
        {0, 1, 3, 7, num_layers // 2 - 1, num_layers - 1} & set(range(num_layers))
    )

    def score(name: str, run) -> dict:
        dl, rel = [], [[] for _ in report_layers]
        for ids, (ref_logits, ref_hidden) in zip(ids_list, refs, strict=True):
            logits, hidden = run(ids)
            dl.append((prompt_logprobs(logits, ids) - prompt_logprobs(ref_logits, ids)).abs())
            for j, layer in enumerate(report_layers):
                rel[j].append(
                    ((hidden[layer] - ref_hidden[layer]).norm() / ref_hidden[layer].norm()).item()
                )
        row = {
            "variant": name,
            "mean_abs_dlogprob": torch.cat(dl).mean().item(),
            "rel_err_after_layer": {
                str(layer + 1): sum(r) / len(r) for layer, r in zip(report_layers, rel, strict=True)
            },
        }
        print(json.dumps(row), flush=True)
        return row

    rows = [score("transformers bf16 sdpa", lambda ids: hf_run(hf16, ids))]
    # What the earlier gpu_e2e reference did: model.to(bf16), which also rounds inv_freq.
    rotary = hf16.model.rotary_emb
    exact_inv_freq = rotary.inv_freq
    rotary.inv_freq = exact_inv_freq.to(torch.bfloat16).float()
    rows.append(
        score("transformers bf16 sdpa, inv_freq rounded to bf16", lambda ids: hf_run(hf16, ids))
    )
    rotary.inv_freq = exact_inv_freq
    hf16.set_attn_implementation("eager")
    rows.append(score("transformers bf16 eager", lambda ids: hf_run(hf16, ids)))
    hf16.set_attn_implementation("sdpa")
    for backend in args.backends.split(","):
        ours = ours_from(hf16, config, backend)
        rows.append(score(f"radixlm bf16 {backend}", lambda ids, m=ours: ours_run(m, ids)))
        if backend == args.backends.split(",")[0]:
            split = unmerge(ours_from(hf16, config, backend))
            rows.append(
                score(
                    f"radixlm bf16 {backend}, unmerged GEMMs", lambda ids, m=split: ours_run(m, ids)
                )
            )
            del split
            if DEVICE == "cuda":
                with reduced_precision_reduction(False):
                    rows.append(
                        score(
                            f"radixlm bf16 {backend}, no reduced-precision reduction",
                            lambda ids, m=ours: ours_run(m, ids),
                        )
                    )
                    rows.append(
                        score(
                            "transformers bf16 sdpa, no reduced-precision reduction",
                            lambda ids: hf_run(hf16, ids),
                        )
                    )
        del ours
    ours32 = ours_from(hf32, config, "torch")
    rows.append(
        score("radixlm fp32 torch (implementation check)", lambda ids: ours_run(ours32, ids))
    )
    result = {
        "shape": args.shape,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "wall_s": time.time() - t0,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"bf16_drift_{args.shape}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
