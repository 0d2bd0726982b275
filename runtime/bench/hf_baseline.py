"""The transformers baselines of ``radixlm bench serving`` (``--backend hf-generate`` and
``hf-generate-batch``), run in this process on ``--device``, offline: every request is
there at time 0.

* ``hf-generate``: ``model.generate`` (greedy, dynamic cache) over left-padded batches of
  ``--hf-batch-size`` requests in dataset order. A batch runs to its longest output length;
  a request counts only its own asked length (with ``ignore_eos``) or its tokens up to
  EOS, and finishes when its batch does.
* ``hf-generate-batch``: transformers' continuous batching (paged KV cache, requests
  join and leave the batch at every step) through ``ContinuousBatchingManager``, one
  ``add_request`` per request with its own ``max_new_tokens``; the manager's warm-up runs
  before the clock starts. Same API in transformers 5.17 and 5.2x:
  ``model.continuous_batching_context_manager(generation_config=...)``,
  ``manager.add_request(input_ids, request_id=, max_new_tokens=)``,
  ``manager.get_result(timeout=)`` -> ``GenerationOutput.generated_tokens``. The model is
  loaded with ``--hf-attn-implementation`` (default ``sdpa``; transformers before the
  ``paged|`` prefix was dropped needs ``paged|sdpa``).

Neither streams tokens to the benchmark: TTFT, TPOT and ITL are None (reported null).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from radixlm.runtime.bench.datasets import BenchRequest, RequestOutput, load_tokenizer

__all__ = ["run_hf", "load_model", "prompt_ids"]

PROGRESS_EVERY_S = 30.0  # generate_batch prints its progress this often (seconds)


def load_model(model_path: str, device: str, dtype: str, attn_implementation: str) -> Any:
    """The transformers causal LM of ``model_path`` on ``device`` in ``dtype``, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
    )
    return model.to(device).eval()


def prompt_ids(tokenizer: Any, requests: Sequence[BenchRequest]) -> list[list[int]]:
    """Token ids of each prompt (text prompts encoded as the server does, with special
    tokens)."""
    return [
        list(r.prompt) if not isinstance(r.prompt, str) else tokenizer.encode(r.prompt)
        for r in requests
    ]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _own_length(generated: list[int], asked: int, eos: set[int], ignore_eos: bool) -> int:
    """Tokens a request keeps of its batch's output: ``asked``, or up to its first EOS."""
    if ignore_eos:
        return asked
    for i, token in enumerate(generated[:asked]):
        if token in eos:
            return i + 1
    return min(asked, len(generated))


@torch.no_grad()
def run_generate(model: Any, ids: list[list[int]], requests: Sequence[BenchRequest],
                 batch_size: int, ignore_eos: bool, pad_id: int, eos: set[int],
                 device: str) -> tuple[list[RequestOutput], float]:
    """``model.generate`` over padded batches: (outputs, duration s)."""
    outputs: list[RequestOutput] = []
    _sync(device)
    start = time.perf_counter()
    for b in range(0, len(ids), batch_size):
        batch, reqs = ids[b : b + batch_size], requests[b : b + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in batch], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=device)
        new = max(r.output_len for r in reqs)
        seqs = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new,
                              min_new_tokens=new if ignore_eos else 0, do_sample=False,
                              pad_token_id=pad_id)
        _sync(device)
        done = time.perf_counter() - start
        for x, req, row in zip(batch, reqs, seqs[:, width:].tolist(), strict=True):
            outputs.append(RequestOutput(success=True, prompt_len=len(x), latency=done,
                                         output_len=_own_length(row, req.output_len, eos,
                                                                ignore_eos)))
    return outputs, time.perf_counter() - start


@torch.no_grad()
def run_generate_batch(model: Any, ids: list[list[int]], requests: Sequence[BenchRequest],
                       ignore_eos: bool, pad_id: int, eos: set[int], device: str,
                       cb_config: dict[str, int] | None = None) -> tuple[
                           list[RequestOutput], float]:
    """Continuous batching (``ContinuousBatchingManager``): (outputs, duration s).
    ``cb_config``: ``ContinuousBatchingConfig`` fields (e.g. ``num_blocks``,
    ``max_batch_tokens``); None lets transformers size the paged cache from free memory."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max(r.output_len for r in requests), do_sample=False,
        eos_token_id=-1 if ignore_eos else sorted(eos), pad_token_id=pad_id,
    )
    outputs = [RequestOutput(prompt_len=len(x)) for x in ids]
    kwargs = {}
    if cb_config:
        from transformers.generation import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb_config)
    with model.continuous_batching_context_manager(generation_config=config, **kwargs) as manager:
        _sync(device)
        start = time.perf_counter()
        for i, (x, req) in enumerate(zip(ids, requests, strict=True)):
            manager.add_request(x, request_id=f"bench-{i}", max_new_tokens=req.output_len)
        pending, done_tokens, report = len(ids), 0, start + PROGRESS_EVERY_S
        while pending:
            if time.perf_counter() > report:  # a long baseline run shows how far it got
                report += PROGRESS_EVERY_S
                print(f"generate_batch: {len(ids) - pending}/{len(ids)} requests finished, "
                      f"{done_tokens} output tokens, {time.perf_counter() - start:.0f} s", flush=True)
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    break
                continue
            if not result.is_finished():
                continue
            out = outputs[int(result.request_id.removeprefix("bench-"))]
            out.latency = time.perf_counter() - start
            out.success = result.error is None
            out.error = result.error or ""
            out.output_len = len(result.generated_tokens)
            done_tokens += out.output_len
            pending -= 1
        duration = time.perf_counter() - start
    for out in outputs:
        if not out.success and not out.error:
            out.error = "no result: the continuous batching loop stopped"
    return outputs, duration


def run_hf(args: argparse.Namespace, requests: Sequence[BenchRequest]) -> tuple[
        list[RequestOutput], float]:
    """Load ``args.model_path`` and run the ``args.backend`` baseline on ``requests``."""
    tokenizer = load_tokenizer(args.tokenizer or args.model_path)
    model = load_model(args.model_path, args.device, args.dtype, args.hf_attn_implementation)
    ids = prompt_ids(tokenizer, requests)
    eos_cfg = model.generation_config.eos_token_id
    eos = set(eos_cfg if isinstance(eos_cfg, list) else [] if eos_cfg is None else [eos_cfg])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ignore_eos = not args.disable_ignore_eos
    if args.backend == "hf-generate":
        return run_generate(model, ids, requests, args.hf_batch_size, ignore_eos, pad_id, eos,
                            args.device)
    cb = {"num_blocks": args.hf_cb_num_blocks, "max_batch_tokens": args.hf_cb_max_batch_tokens}
    cb = {k: v for k, v in cb.items() if v is not None}
    return run_generate_batch(model, ids, requests, ignore_eos, pad_id, eos, args.device, cb)
