"""Host time of ForwardBatch.build on the CPU (device "cpu": no copies), old vs new package
(PYTHONPATH picks it): a 4096-token prefill, an eager mixed step of 64 decoding requests
(~300 pages each) + one 512-token chunk, and 8 new 200-token prompts. Median of 7 x 20."""

from __future__ import annotations

import random
import statistics
import timeit

from radixlm.runtime.executor.forward_batch import ForwardBatch

rng = random.Random(0)
S = 16


def case(lens: list[tuple[int, int]]) -> tuple:
    tokens, prefix, tables = [], [], []
    for start, n in lens:
        tokens.append([rng.randrange(3, 49000) for _ in range(n)])
        prefix.append(start)
        tables.append(rng.sample(range(1, 200000), -(-(start + n) // S)))
    total = sum(n for _, n in lens)
    rows, pos = [], 0
    for _, n in lens:
        pos += n
        rows.append(pos - 1)
    return tokens, prefix, tables, rows if len(rows) < total else list(range(total))


CASES = {
    "prefill 4096": case([(0, 4096)]),
    "mixed 64 decode (~300 pages) + 512 chunk": case([(rng.randrange(4000, 4800), 1) for _ in range(64)] + [(0, 512)]),
    "8 prompts x 200": case([(0, 200)] * 8),
}
for name, args in CASES.items():
    times = timeit.repeat(lambda args=args: ForwardBatch.build(*args, S, "cpu"), number=20, repeat=7)
    print(f"{name}: {statistics.median(times) / 20 * 1e6:.0f} us")
