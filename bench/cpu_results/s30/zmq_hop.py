import asyncio
import multiprocessing as mp
import os
import random
import statistics
import time

import zmq
import zmq.asyncio

from radixlm.runtime import messages as m
from radixlm.runtime.ipc import new_ipc_address


def child(addr, back, n, busy):
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.connect(addr)
    o = ctx.socket(zmq.PUSH)
    o.connect(back)
    for _ in range(n):
        if busy:
            while True:
                try:
                    data = s.recv(zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    pass
        else:
            s.poll(50, zmq.POLLIN)
            data = s.recv(copy=False)
        msg = m.decode(data.bytes)
        t = time.perf_counter()
        o.send(repr(t - float(msg.rid)).encode())


async def parent(n, size, busy, asy):
    addr, back = new_ipc_address("a"), new_ipc_address("b")
    ctx = zmq.asyncio.Context() if asy else zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.bind(addr)
    actx = zmq.asyncio.Context()
    rb = actx.socket(zmq.PULL)
    rb.bind(back)
    p = mp.get_context("spawn").Process(target=child, args=(addr, back, n, busy))
    p.start()
    rng = random.Random(1)
    ids = [rng.randrange(3, 49000) for _ in range(size)]
    res = []
    for _ in range(n):
        await asyncio.sleep(0.02)
        s.send(
            m.encode(
                m.GenerateReq(
                    rid=repr(time.perf_counter()), input_ids=ids, sampling=m.SamplingParams()
                )
            )
        )
        r = await rb.recv()
        res.append(float(r) * 1e3)
    p.join()
    res = res[3:]
    print(
        f"size {size} busy {busy} asyncio-sender {asy}: median {statistics.median(res):.3f} min {min(res):.3f}",
        flush=True,
    )


def pchild(r, w, n):
    for _ in range(n):
        d = os.read(r, 64)
        t = time.perf_counter()
        os.write(w, repr(t - float(d)).encode())


def pipes(n):
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    p = mp.get_context("fork").Process(target=pchild, args=(r1, w2, n))
    p.start()
    res = []
    for _ in range(n):
        time.sleep(0.02)
        os.write(w1, repr(time.perf_counter()).encode())
        res.append(float(os.read(r2, 64)) * 1e3)
    p.join()
    res = res[3:]
    print(f"raw pipe: median {statistics.median(res):.3f} min {min(res):.3f}")


if __name__ == "__main__":
    pipes(40)
    for size in (16, 4096):
        for busy in (False, True):
            for asy in (True, False):
                asyncio.run(parent(40, size, busy, asy))
