"""One GenerateReq from an asyncio PUSH (as the tokenizer process sends) to a MsgSocket.recv
in another process (as the scheduler receives), with and without spin_s: median / min ms
from send to decoded, 40 messages sent 5 ms apart (the first 3 dropped)."""
import asyncio
import multiprocessing as mp
import random
import statistics
import time

import zmq
import zmq.asyncio

from radixlm.runtime import messages as m
from radixlm.runtime.ipc import MsgSocket, new_ipc_address


def child(addr, back, n, spin):
    s = MsgSocket(zmq.PULL, addr, bind=False)
    o = zmq.Context().socket(zmq.PUSH)
    o.connect(back)
    for _ in range(n):
        msg = None
        while msg is None:
            msg = s.recv(timeout_ms=50, spin_s=spin)
        o.send(repr(time.perf_counter() - float(msg.rid)).encode())


async def parent(n, size, spin, gap):
    addr, back = new_ipc_address("a"), new_ipc_address("b")
    s = zmq.asyncio.Context().socket(zmq.PUSH)
    s.bind(addr)
    rb = zmq.asyncio.Context().socket(zmq.PULL)
    rb.bind(back)
    p = mp.get_context("spawn").Process(target=child, args=(addr, back, n, spin))
    p.start()
    rng = random.Random(1)
    ids = [rng.randrange(3, 49000) for _ in range(size)]
    res = []
    for _ in range(n):
        await asyncio.sleep(gap)
        s.send(m.encode(m.GenerateReq(rid=repr(time.perf_counter()), input_ids=ids, sampling=m.SamplingParams())))
        res.append(float(await rb.recv()) * 1e3)
    p.join()
    res = res[3:]
    print(f"size {size} spin_s {spin} gap {gap}: median {statistics.median(res):.3f} min {min(res):.3f}", flush=True)


if __name__ == "__main__":
    for _ in range(2):
        for size in (16, 4096):
            for spin in (0.0, 1.0):
                asyncio.run(parent(40, size, spin, 0.005))
