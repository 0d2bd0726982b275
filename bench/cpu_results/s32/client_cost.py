"""The client's own cost: ms from the client's clock start to the first data line, against a
stub server (asyncio, one thread) that answers a POST with one SSE chunk as soon as the body
is read. Three clients: httpx as ``gpu_e2e.stream_generate`` was before session 32 (json=
inside the clock), ``stream_generate`` now (orjson, http.client), bare http.client. Run from
the checkout root; the argument is the number of prompt ids (default 4096)::

    .venv/bin/python bench/cpu_results/s32/client_cost.py 4096
"""

from __future__ import annotations

import asyncio
import http.client
import random
import statistics
import sys
import threading
import time

import httpx
import orjson

sys.path.insert(0, "bench")
from gpu_e2e import stream_generate  # noqa: E402

RESP = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = b'data: {"text":"a","output_ids":[1],"meta_info":{"completion_tokens":1,"cached_tokens":0}}\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:  # the client closed its connection
            return
        length = next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(int(length.split(b":")[1]))
        writer.write(RESP + chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


def serve(port: list[int]) -> None:
    async def main() -> None:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.append(srv.sockets[0].getsockname()[1])
        await srv.serve_forever()

    asyncio.run(main())


def main() -> None:
    port: list[int] = []
    threading.Thread(target=serve, args=(port,), daemon=True).start()
    while not port:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port[0]}"
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    ids = [random.randrange(3, 49152) for _ in range(n)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    client = httpx.Client(timeout=600)

    def httpx_old() -> float:
        t0, first = time.perf_counter(), None
        with client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter()
        return first - t0

    def stream_generate_now() -> float:
        t0, stamps, _ = stream_generate(url, body)
        return stamps[0] - t0

    def bare() -> float:
        conn = http.client.HTTPConnection("127.0.0.1", port[0])
        conn.connect()
        data = orjson.dumps({**body, "stream": True})
        t0, first = time.perf_counter(), None
        conn.request("POST", "/generate", body=data, headers={"Content-Type": "application/json"})
        for line in conn.getresponse():
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter()
        conn.close()
        return first - t0

    for name, fn in (("httpx", httpx_old), ("stream_generate", stream_generate_now), ("raw", bare)) * 3:
        times = [fn() for _ in range(60)][10:]
        print(name, n, "median ms %.3f" % (statistics.median(times) * 1e3))


if __name__ == "__main__":
    main()
