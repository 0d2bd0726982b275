"""CPU cost of the radix tree per prompt token: ``match_prefix`` + ``insert``.

The target (BENCHMARKS.md, "Radix tree CPU cost"): match + insert <= 25 ns per prompt token, i.e.
<= 0.1 ms for a 4K prompt. What the scheduler does per request is one
``match_prefix(prompt[:-1])`` at admission and one ``insert(prompt + output, pages)``
when the request's KV is cached; both walk the same path, so the figure is
(time of both) / (prompt tokens).

Workload (seeded): G groups, each with a system prompt of ``--system-len`` tokens;
every prompt = its group's system prompt + a question of ``--question-len`` tokens
(2K-token prompts by default, page size 16). The tree is first filled with
``--prefill-prompts`` such prompts (10K+ nodes: one node per group prefix and one leaf
per question, plus splits), then ``--prompts`` fresh prompts are timed, each matched
then inserted (the insert adds one leaf). Three cases, each with two inputs:

* ``shared``: a new question on an existing group (the common case: long hit, one leaf).
* ``hit``: an exact repeat of a cached prompt (all hit; insert finds everything cached).
* ``miss``: a prompt from an unseen group (nothing matched, one new leaf).

Inputs: ``packed``, the scheduler's path: the prompt is packed once into ``array("I")``
(``Req.token_array``; the packing is inside the timed region) and both calls take
slices of it; ``list``, plain ``list[int]`` arguments that the tree packs on each call.
Token ids are fresh int objects, as decoded from a request message.

Timing: ``time.perf_counter_ns`` around the loop, min over ``--repeats`` runs (each run
on a fresh copy of the filled tree so inserts do not accumulate), divided by the total
prompt tokens. GC is disabled while timing. Output: a markdown table on stdout and, with
``--out DIR``, ``DIR/bench_radix.json``.

    .venv/bin/python bench/scheduler/bench_radix.py [--out bench/results]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import random
import sys
import time
from array import array
from pathlib import Path

from radixlm.radix import RadixTree

VOCAB = 49152


def _ids(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(VOCAB), k=n)


def build(args: argparse.Namespace) -> tuple[RadixTree, dict[str, list[list[int]]]]:
    """A filled tree and the prompts of each timed case."""
    rng = random.Random(args.seed)
    systems = [_ids(rng, args.system_len) for _ in range(args.groups)]
    tree = RadixTree(args.page_size)
    page = iter(range(1, 1 << 62))
    aligned = (args.system_len + args.question_len) // args.page_size * args.page_size
    cached = []
    for i in range(args.prefill_prompts):
        prompt = (systems[i % args.groups] + _ids(rng, args.question_len))[:aligned]
        match = tree.match_prefix(prompt)
        tree.insert(prompt, match.pages + [next(page) for _ in range(len(prompt) // args.page_size - len(match.pages))])
        cached.append(prompt)
    cases = {
        "shared": [systems[rng.randrange(args.groups)] + _ids(rng, args.question_len) for _ in range(args.prompts)],
        "hit": [cached[rng.randrange(len(cached))] for _ in range(args.prompts)],
        "miss": [_ids(rng, args.system_len + args.question_len) for _ in range(args.prompts)],
    }
    # Fresh int objects, as a request decoded from a message has: no identity shortcut
    # when tuple comparison meets the tree's own ints.
    return tree, {name: [array("q", p).tolist() for p in prompts] for name, prompts in cases.items()}


def time_case(tree: RadixTree, prompts: list[list[int]], repeats: int, page_size: int, packed: bool) -> dict:
    """Best-of-``repeats`` ns per prompt token for match + insert, and match alone.

    ``packed``: the request's tokens are packed once into ``array("I")`` (counted in
    the time) and both calls take slices of it, as the scheduler does through
    ``Req.token_array``; otherwise both calls get plain lists.
    """
    tokens = sum(len(p) for p in prompts)
    best_total = best_match = float("inf")
    for _ in range(repeats):
        work = copy.deepcopy(tree)
        pages = iter(range(1 << 40, 1 << 62))
        gc.disable()
        match_ns = 0
        start = time.perf_counter_ns()
        for prompt in prompts:
            t0 = time.perf_counter_ns()
            ids = array("I", prompt) if packed else prompt
            match = work.match_prefix(ids[:-1])
            match_ns += time.perf_counter_ns() - t0
            n = len(prompt) // page_size
            work.insert(ids[: n * page_size], match.pages + [next(pages) for _ in range(n - len(match.pages))])
        total = time.perf_counter_ns() - start
        gc.enable()
        best_total, best_match = min(best_total, total), min(best_match, match_ns)
    return {"ns_per_token": best_total / tokens, "match_ns_per_token": best_match / tokens,
            "us_per_prompt": best_total / len(prompts) / 1e3, "prompt_tokens": tokens // len(prompts)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--groups", type=int, default=256, help="system prompts in the filled tree")
    p.add_argument("--system-len", type=int, default=1920, help="system prompt tokens")
    p.add_argument("--question-len", type=int, default=128, help="question tokens per prompt")
    p.add_argument("--prefill-prompts", type=int, default=10000, help="prompts inserted before timing")
    p.add_argument("--prompts", type=int, default=500, help="timed prompts per case")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "bench" / "results",
                   help="write bench_radix.json here (default: bench/results/)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.setrecursionlimit(100_000)  # deepcopy of a deep tree
    tree, cases = build(args)
    nodes = sum(1 for _ in tree._iter_nodes())
    rows = {f"{name}, {kind}": time_case(tree, prompts, args.repeats, args.page_size, kind == "packed")
            for kind in ("packed", "list") for name, prompts in cases.items()}
    print(f"tree: {nodes} nodes, {tree.cached_pages} pages; page size {args.page_size}; "
          f"python {platform.python_version()}")
    print("| case, input | prompt tokens | match + insert ns/token | match ns/token | us/prompt |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['prompt_tokens']} | {r['ns_per_token']:.1f} | {r['match_ns_per_token']:.1f} "
              f"| {r['us_per_prompt']:.1f} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "tree_nodes": nodes,
                  "python": platform.python_version(), "cases": rows}
        (args.out / "bench_radix.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
