"""Where the scheduler process's host time goes: the real Scheduler + ModelRunner in one
process (no HTTP), B streaming requests decoding, a cProfile of N steps.

    python bench/profile_step.py --shape smollm2 --tokenizer-dir tok/ --batch 64 --out $OUT [--json-schema]

Prints ms per step (wall) and the top functions by own time and by cumulative time; on a
GPU the device work is queued asynchronously, so the profile is the host's share.

``--stub-model`` replaces the forward pass and the LM head with fixed outputs, so on the
CPU (``GPU_E2E_DEVICE=cpu``, eager path: no CUDA graphs) the step time is the scheduler's
and the model runner's host work alone (plus sampling over ``--vocab`` logits)::

    GPU_E2E_DEVICE=cpu python bench/profile_step.py --shape tiny --vocab 512 --stub-model \
        --tokenizer-dir tok/ --batch 64 --no-profile --out /tmp/prof
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured import SCHEMA  # noqa: E402
from gpu_e2e import DEVICE, build_checkpoint  # noqa: E402

from radixlm.runtime import messages as m  # noqa: E402
from radixlm.runtime.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--tokenizer-dir", type=Path, required=True)
    ap.add_argument("--models-root", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json-schema", action="store_true",
                    help="every request under bench_structured.py's JSON schema (no ignore_eos)")
    ap.add_argument("--no-profile", action="store_true", help="time the steps without cProfile")
    ap.add_argument("--disable-overlap-schedule", action="store_true",
                    help="read each step's tokens before planning the next (the server flag)")
    ap.add_argument("--vocab", type=int, help="override the shape's vocabulary size")
    ap.add_argument("--stub-model", action="store_true",
                    help="fixed hidden states and logits instead of the model (host work alone)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model_dir, model = build_checkpoint(args.shape, args.tokenizer_dir, args.models_root / "bfloat16",
                                        vocab=args.vocab)
    vocab = model.config.vocab_size
    del model
    server = ServerArgs(model_path=str(model_dir), device=DEVICE, max_running_requests=args.batch,
                        max_total_tokens=args.batch * 1024,
                        disable_overlap_schedule=args.disable_overlap_schedule,
                        dtype="bfloat16" if DEVICE == "cuda" else "float32")
    runner = ModelRunner(server)
    if args.stub_model:
        hidden = torch.zeros(4096, runner.config.hidden_size, device=DEVICE)
        logits = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        runner.model.forward = lambda batch, pool: hidden[: batch.input_ids.shape[0]]
        runner.model.compute_logits = lambda h: logits[: h.shape[0]]
    sched = Scheduler(server, runner)
    rng = random.Random(0)
    schema = json.dumps(SCHEMA) if args.json_schema else None
    for i in range(args.batch):
        sched.handle(m.GenerateReq(
            rid=f"r{i}", input_ids=[rng.randrange(3, min(vocab, 40000)) for _ in range(300)], stream=True,
            sampling=m.SamplingParams(max_new_tokens=args.steps + 50, ignore_eos=not args.json_schema,
                                      temperature=0.0, json_schema=schema)))
    for _ in range(10):  # grammar compile, prefill, warm-up
        sched._safe_step()
        sched.outbox.clear()
        while sched.grammar_waiting:
            time.sleep(0.01)
            sched._safe_step()
    prof = cProfile.Profile()
    start = time.perf_counter()
    if not args.no_profile:
        prof.enable()
    for _ in range(args.steps):
        sched._safe_step()
        sched.outbox.clear()
    prof.disable()
    wall_ms = (time.perf_counter() - start) / args.steps * 1e3
    text = io.StringIO()
    if not args.no_profile:
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(35)
    tag = ("_json" if args.json_schema else "") + ("_nooverlap" if args.disable_overlap_schedule else "") + (
        "_noprof" if args.no_profile else "") + ("_stub" if args.stub_model else "")
    how = "not profiled" if args.no_profile else "profiled"
    report = f"batch {args.batch}{tag}: {wall_ms:.2f} ms per step ({how})\n{text.getvalue()}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_step_{args.shape}_b{args.batch}{tag}.txt").write_text(report)
    print(report[:6000])


if __name__ == "__main__":
    main()
