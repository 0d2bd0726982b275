"""The 1000-prompt offline run through the real BatchPlanner with a step cost model (8B
bf16 on an H200 / H100 class GPU), to compare admission plans by makespan. A model, not a
measurement: a step of n tokens whose decode rows read kv cached tokens costs
max(W x (1 + n / 512), n x F) + kv x K + C ms (W the weight read, F 16 GFLOP per token at
650 TFLOP/s, K the KV bytes of a token at 4.3 TB/s, C small kernels). Run from the repo root:

    .venv/bin/python bench/gpu_results/s35/sim1000.py .gpu_tok .gpu_data/sharegpt_subset.jsonl
"""

import sys

from transformers import AutoTokenizer

from radixlm.radix import RadixTree
from radixlm.runtime.bench.datasets import sharegpt_requests
from radixlm.runtime.bench.sharegpt import iter_records
from radixlm.runtime.memory.page_allocator import PageAllocator
from radixlm.runtime.messages import SamplingParams
from radixlm.runtime.scheduler.planner import BatchPlanner
from radixlm.runtime.scheduler.prefix_cache import PrefixCache
from radixlm.runtime.scheduler.request import Req

PAGE = 16
W, F, K, C = 3.45, 16e9 / 650e12 * 1e3, 131072 / 4.3e12 * 1e3, 0.45  # ms, ms per token, ms per KV token, ms


def step_ms(n: int, kv: int) -> float:
    return max(W * (1 + n / 512), F * n) + K * kv + C


def run(prompts, outs, policy="lpm", max_running=1024, budget=16384, chunk=8192):
    cache = PrefixCache(PageAllocator(900_000 // PAGE), RadixTree(PAGE), PAGE)
    p = BatchPlanner(cache, max_prefill_tokens=budget, chunked_prefill_size=chunk, max_running_requests=max_running,
                     schedule_policy=policy, admit_batch=max(1, max_running // 8))
    reqs = [Req(rid=str(i), prompt_ids=list(pr), sampling=SamplingParams(max_new_tokens=o, ignore_eos=True),
                arrival=float(i)) for i, (pr, o) in enumerate(zip(prompts, outs, strict=True))]
    for r in reqs:
        p.add(r)
    t, steps, done = 0.0, 0, 0
    while done < len(reqs):
        d = p.plan()
        steps += 1
        t += step_ms(sum(it.num_tokens for it in d.items), sum(it.start for it in d.items if it.num_tokens == 1))
        for it in d.items:
            req, was = it.req, it.req.in_prefill
            req.num_computed += it.num_tokens
            if was and not req.in_prefill:
                cache.cache(req)
            if it.samples:
                req.output_ids.append(7)
                if len(req.output_ids) >= req.sampling.max_new_tokens:
                    req.finish("length")
                    p.remove(req)
                    done += 1
    return t / 1e3, steps


def main() -> None:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    reqs = sharegpt_requests(list(iter_records(sys.argv[2])), tok, 1000, 1)
    prompts, outs = [tok.encode(r.prompt) for r in reqs], [r.output_len for r in reqs]
    print(f"prompt tokens {sum(map(len, prompts))}, output tokens {sum(outs)}, longest reply {max(outs)}")
    for name, kw in [("default (lpm, budget 16384)", {}), ("lof, budget 16384", {"policy": "lof"}),
                     *((f"lof, budget {b}", {"policy": "lof", "budget": b}) for b in (128, 192, 256, 384, 512)),
                     ("lpm, budget 256", {"budget": 256})]:
        print(f"{name}: makespan %.2f s, %d steps" % run(prompts, outs, **kw), flush=True)


if __name__ == "__main__":
    main()
