"""Host time of the page-table writes a step does outside the decode graph (CPU, no model):
a new 4K request's 264-page row (the cached-prefix TTFT's extend replay) and a wave of 30
new 33-page rows in one decode step (Bmax 64). Run with the tree to measure first on
PYTHONPATH (see mkold.sh); prints the best of 5 repeats per call, microseconds."""

import timeit

import torch

from radixlm.runtime.executor.cuda_graph_runner import CudaGraphRunner
from radixlm.runtime.memory.kv_pool import KVPool

pool = KVPool(2048, 16, 1, 1, 8, torch.float32, "cpu")
runner = CudaGraphRunner.__new__(CudaGraphRunner)
runner._buffers(None, pool, max_bs=64, max_pages=512, prev_ids=torch.zeros(64, dtype=torch.int64),
                max_extend_tokens=0)
PAGES = list(range(1, 265))


def one_row() -> None:
    runner._sync_tables([object()], [PAGES])


def wave() -> None:
    runner._sync_tables([object() for _ in range(30)], [list(range(1 + 40 * i, 34 + 40 * i)) for i in range(30)],
                        in_graph=64)


for name, fn, number in (("one 264-page row", one_row, 3000), ("wave of 30 x 33 pages (decode, Bmax 64)", wave, 500)):
    best = min(timeit.repeat(fn, number=number, repeat=5)) / number
    print(f"{name}: {best * 1e6:.1f} us")
