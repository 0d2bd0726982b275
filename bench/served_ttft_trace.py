"""Where a served request's time to first token goes: timestamps of each stage, from the
client's send to its first streamed chunk, for a 4K-token prompt whose first 3968 tokens
are cached (128 new) and for a fresh 16-token prompt (20 of each, medians; the first two
of each dropped), then ``gpu_serving.prefix_ttft_4k`` three times. Environment variables:
TTRACE_N (requests, default 40), TTRACE_GAP (seconds between them, default 0.05),
TTRACE_PAIRS (``prefix_ttft_4k`` runs, default 3; 0 on the CPU, where its ratio means
nothing), TTRACE_CLIENT=httpx (the client this script used before 2026-12-05, json= inside
the clock; default ``gpu_e2e.stream_generate``, as gpu_serving.py).

The stages are marked by ``served_ttft_trace.diff`` (apply it to a scratch copy of the
tree, never commit it): each mark writes ``TTRACE <stage> <time.perf_counter()>`` to the
process's stderr (CLOCK_MONOTONIC: one clock for every process of the machine)::

    A_mw          BodyLimitMiddleware entered (HTTP parsed, before the body is read)
    H_route       /generate route entered (body parsed and validated by FastAPI)
    B_send        GenerateReq handed to ZeroMQ (tokenizer process)
    C_sched_recv  the scheduler handles it
    D_launch0/1   the scheduler's first launch of a step with it begins / returns
    E_flush       the scheduler sends a BatchOutput
    F_dispatch    the tokenizer process receives it
    G_chunk       the stream's generator has the chunk
    Z_first       the client reads the first data chunk

    git apply bench/served_ttft_trace.diff
    . bench/gpu_env.sh && python3 bench/served_ttft_trace.py MODEL_DIR $OUT/server.log [SERVER FLAGS] > $OUT/trace.json

Prints JSON: per prompt kind, the median milliseconds after the client's send at which
each stage was first reached; ``prefix_ttft_4k``: cold / cached TTFT and their ratio.
Results: BENCHMARKS.md ("Served TTFT: where the time goes").
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import stream_generate  # noqa: E402
from gpu_serving import prefix_ttft_4k  # noqa: E402

from radixlm.runtime.bench.server_process import ServerProcess  # noqa: E402


def main() -> None:
    model, log = sys.argv[1], Path(sys.argv[2])
    client = httpx.Client(timeout=600)
    with (
        log.open("w") as log_file,
        ServerProcess.launch(
            ["--model-path", model, *sys.argv[3:]], log=log_file, startup_timeout=900
        ) as srv,
    ):
        url = srv.url

        def generate(ids: list[int], n: int = 2) -> tuple[float, float]:
            body = {
                "input_ids": ids,
                "stream": True,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            }
            if os.environ.get("TTRACE_CLIENT") != "httpx":
                t0, stamps, _ = stream_generate(url, body)
                return t0, stamps[0]
            t0, first = time.perf_counter(), None
            with client.stream("POST", url + "/generate", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and first is None:
                        first = time.perf_counter()
            return t0, first

        rng, vocab = random.Random(7), 49000
        prefix = [rng.randrange(3, vocab) for _ in range(3968)]
        generate([rng.randrange(3, vocab) for _ in range(4096)])  # warm-up
        generate(prefix, 1)
        sent = []
        for k in range(int(os.environ.get("TTRACE_N", "40"))):
            time.sleep(float(os.environ.get("TTRACE_GAP", "0.05")))
            n = 128 if k % 2 == 0 else 16
            ids = (prefix if n == 128 else []) + [rng.randrange(3, vocab) for _ in range(n)]
            sent.append((n, *generate(ids)))
        ratios = [prefix_ttft_4k(url) for _ in range(int(os.environ.get("TTRACE_PAIRS", "3")))]
    marks = sorted((float(t), name) for line in log.read_text().splitlines() if line.startswith("TTRACE ")
                   for _, name, t in [line.split()])  # fmt: skip
    stages: dict[int, dict[str, list[float]]] = {}
    for n, t0, t1 in sent[4:]:
        seen: dict[str, float] = {}
        for t, name in marks:
            if t0 <= t <= t1 + 0.005 and name not in seen:
                seen[name] = (t - t0) * 1e3
        seen["Z_first"] = (t1 - t0) * 1e3
        for name, ms in seen.items():
            stages.setdefault(n, {}).setdefault(name, []).append(ms)
    out: dict = {str(n): {name: round(statistics.median(v), 3) for name, v in sorted(d.items(), key=lambda kv: statistics.median(kv[1]))}
                 for n, d in stages.items()}  # fmt: skip
    out["prefix_ttft_4k"] = [
        {k: v for k, v in r.items() if not k.endswith("output")} for r in ratios
    ]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
