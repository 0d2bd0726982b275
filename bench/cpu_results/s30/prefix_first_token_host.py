"""The scheduler's host time from handle to the first token of a 4096-token prompt whose
first 3968 tokens are cached, and of a fresh 16-token prompt, on the CPU: the CUDA-graph
path's host code (decode and extend graphs "replayed" as no-ops, profile_step.py's
HostOnlyGraphs with extend buffers) with a stub model (fixed hidden states and logits,
vocab 49152); medians of 30, the aten ops of one cached first token, and a cProfile.

    GPU_E2E_DEVICE=cpu .venv/bin/python bench/cpu_results/s30/prefix_first_token_host.py
"""

import collections
import cProfile
import io
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gpu_e2e import DEVICE, build_checkpoint
from profile_step import HostOnlyGraphs

from radixlm.runtime import messages as m
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.c = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.c[str(func)] += 1
        return func(*args, **(kwargs or {}))


class HostGraphsExt(HostOnlyGraphs):
    def __init__(self, runner, hidden, logits):
        n, pages = runner.args.max_running_requests, -(-runner.context_length // runner.page_size)
        self._buffers(runner.model, runner.pool, n, pages, runner._prev_ids, 256)
        NoGraph = type("NoGraph", (), {"replay": lambda self: None})
        self.graphs = {bs: NoGraph() for bs in self.batch_sizes}
        self.outputs = {bs: logits[:bs] for bs in self.batch_sizes}  # decode graphs: logits (since 3f25de9)
        self.ext_graphs = {t: NoGraph() for t in self.extend_sizes}
        self.ext_outputs = {t: hidden[:1] for t in self.extend_sizes}


model_dir, model = build_checkpoint(
    "tiny", Path(".gpu_tok"), Path("/tmp/models/bfloat16"), vocab=49152
)
vocab = model.config.vocab_size
del model
server = ServerArgs(
    model_path=str(model_dir),
    device=DEVICE,
    max_running_requests=64,
    max_total_tokens=64 * 1024,
    dtype="float32",
    context_length=8192,
)
runner = ModelRunner(server)
hidden = torch.zeros(4096, runner.config.hidden_size)
logits = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0))
runner.model.forward = lambda batch, pool: hidden[: batch.input_ids.shape[0]]
runner.model.compute_logits = lambda h, out=None: logits[: h.shape[0]]
runner.graph_runner = HostGraphsExt(runner, hidden, logits)
sched = Scheduler(server, runner)
rng = random.Random(7)
prefix = [rng.randrange(3, 49000) for _ in range(3968)]


def first(rid, ids, prof=None, ops=None):
    sched.handle(
        m.GenerateReq(
            rid=rid,
            input_ids=ids,
            stream=True,
            sampling=m.SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=0.0),
        )
    )
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    if ops:
        ops.__enter__()
    while True:
        sched._safe_step()
        if any(o.rid == rid and o.new_token_ids for o in sched.outbox):
            break
    if ops:
        ops.__exit__(None, None, None)
    if prof:
        prof.disable()
    t = time.perf_counter() - t0
    while sched.has_work:
        sched._safe_step()
    sched.outbox.clear()
    return t


first("w0", [rng.randrange(3, 49000) for _ in range(4096)])
first(
    "w1",
    prefix,
)
ts = {"cached": [], "fresh16": []}
for k in range(30):
    ts["cached"].append(first(f"c{k}", prefix + [rng.randrange(3, 49000) for _ in range(128)]))
    ts["fresh16"].append(first(f"f{k}", [rng.randrange(3, 49000) for _ in range(16)]))

for k, v in ts.items():
    print(k, "median ms", round(statistics.median(v) * 1e3, 3))
ops = Ops()
first("ops", prefix + [rng.randrange(3, 49000) for _ in range(128)], ops=ops)
print("aten ops cached first token:", sum(ops.c.values()))
print(ops.c.most_common(40))
ops = Ops()
first("ops16", [rng.randrange(3, 49000) for _ in range(16)], ops=ops)
print("aten ops fresh16:", sum(ops.c.values()))
prof = cProfile.Profile()
first("prof", prefix + [rng.randrange(3, 49000) for _ in range(128)], prof=prof)
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
print(s.getvalue()[:9000])
