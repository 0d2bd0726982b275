"""Quality of the CPU weight kinds (``--weight-dtype``) against float32, on SmolLM2-135M-Instruct.

For each kind (``model`` = float32, ``bfloat16``, ``int8``, ``int4``, ``auto`` = what the
default GGUF stores: int4 linears, int8 LM head), one in-process server (``LocalServer``):

* perplexity of held-out ShareGPT text: replies of conversations the benchmarks do not use
  (records from ``--offset`` on), the first ``--tokens`` tokens of each, scored as prompt
  logprobs (``return_logprob``, ``logprob_start_len`` 0; the first token unscored);
* greedy agreement with float32: the first user turns of other records (chat template),
  ``--new-tokens`` greedy tokens each; the mean fraction of a reply identical to float32's
  before the first difference, and the share of replies identical throughout.

The float32 weights are the GGUF's own values dequantised (what ``model`` serves), so the
int4 rows measure re-packing (bfloat16 scales and activations), not 4-bit quantisation of a
float model.

    .venv/bin/python bench/cpu/weight_quality.py --out bench/cpu/figures/weight_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

KINDS = ("model", "bfloat16", "int8", "int4", "auto")


def held_out(offset: int, num_texts: int, num_prompts: int) -> tuple[list[str], list[list[dict]]]:
    """(reply texts for perplexity, first-turn messages for greedy agreement)."""
    from radixlm.runtime.bench.sharegpt import iter_records

    texts, prompts = [], []
    for i, rec in enumerate(iter_records()):
        if i < offset:
            continue
        turns = rec.get("conversations") or []
        human = [t["value"] for t in turns if t.get("from") == "human" and t.get("value")]
        reply = [t["value"] for t in turns if t.get("from") == "gpt" and t.get("value")]
        if len(texts) < num_texts and reply and len(reply[0]) > 400:
            texts.append(reply[0])
        elif len(prompts) < num_prompts and human and len(human[0]) < 2000:
            prompts.append([{"role": "user", "content": human[0]}])
        if len(texts) >= num_texts and len(prompts) >= num_prompts:
            break
    return texts, prompts


def measure(kind: str, texts: list[str], prompts: list[list[dict]], args: argparse.Namespace) -> dict:
    from radixlm.runtime.engine import LocalServer
    from radixlm.runtime.server_args import ServerArgs

    t0 = time.perf_counter()
    with LocalServer(ServerArgs(device="cpu", weight_dtype=kind, log_level="warning",
                                disable_radix_cache=True)) as srv:
        tok = srv.tm.tokenizer
        nll, scored = 0.0, 0
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False)[: args.tokens]
            out = srv.post("/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
            lps = [t[0] for t in out["meta_info"]["input_token_logprobs"] if t[0] is not None]
            nll -= sum(lps)
            scored += len(lps)
        replies = []
        for messages in prompts:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out = srv.post("/generate", {"text": text, "sampling_params": {
                "max_new_tokens": args.new_tokens, "temperature": 0}})
            replies.append(out["output_ids"])
    return {"kind": kind, "perplexity": math.exp(nll / scored), "scored_tokens": scored, "replies": replies,
            "seconds": time.perf_counter() - t0}


def agreement(replies: list[list[int]], reference: list[list[int]]) -> dict:
    prefix, identical = [], 0
    for ours, ref in zip(replies, reference, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
        prefix.append(same / max(len(ref), 1))
        identical += ours == ref
    return {"greedy_prefix_agreement": sum(prefix) / len(prefix), "greedy_identical": identical / len(replies)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--offset", type=int, default=5000, help="first ShareGPT record used (held out)")
    ap.add_argument("--texts", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=512, help="tokens scored per text at most")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench/results/weight_quality.json"))
    args = ap.parse_args()
    texts, prompts = held_out(args.offset, args.texts, args.prompts)
    rows = [measure(kind, texts, prompts, args) for kind in dict.fromkeys(["model", *args.kinds])]
    reference = rows[0]["replies"]
    for row in rows:
        row.update(agreement(row.pop("replies"), reference))
        print(f"{row['kind']:>9}: perplexity {row['perplexity']:.3f} over {row['scored_tokens']} tokens, "
              f"greedy prefix agreement {row['greedy_prefix_agreement']:.3f}, identical {row['greedy_identical']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args) | {"out": str(args.out)},
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
