"""Client overhead alone (ms from the client clock start to the first data line; run from the checkout root): a raw asyncio server that answers a POST with one SSE chunk as soon as the body is read."""
import asyncio, http.client, json, socket, statistics, sys, threading, time, random
sys.path.insert(0, "bench")
import httpx, orjson

RESP = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
def chunk(b): return b"%x\r\n%s\r\n" % (len(b), b)
async def handle(reader, writer):
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:  # the client closed its connection
            return
        n = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
        await reader.readexactly(n)
        writer.write(RESP + chunk(b'data: {"text":"a","output_ids":[1],"meta_info":{"completion_tokens":1,"cached_tokens":0}}\n\n') + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
def serve(port_box):
    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_box.append(srv.sockets[0].getsockname()[1])
        await srv.serve_forever()
    asyncio.run(main())
box = []
threading.Thread(target=serve, args=(box,), daemon=True).start()
while not box: time.sleep(0.01)
url = f"http://127.0.0.1:{box[0]}"
ids = [random.randrange(3, 49152) for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)]
body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
_client = httpx.Client(timeout=600)
def hx():  # gpu_e2e.stream_generate before this session: httpx, json= inside the clock
    t0, first = time.perf_counter(), None
    with _client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    return first - t0
from gpu_e2e import stream_generate
def lean():  # gpu_e2e.stream_generate now
    t0, st, last = stream_generate(url, body); return st[0] - t0
def raw():
    c = http.client.HTTPConnection("127.0.0.1", box[0]); c.connect()
    data = orjson.dumps({**body, "stream": True})
    t0 = time.perf_counter()
    c.request("POST", "/generate", body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse(); first = None
    for line in r:
        if first is None and line.startswith(b"data: {"): first = time.perf_counter()
    c.close(); return first - t0
for name, fn in (("httpx", hx), ("stream_generate", lean), ("raw", raw)) * 3:
    xs = [fn() for _ in range(60)][10:]
    print(name, len(ids), "median ms %.3f" % (statistics.median(xs) * 1e3))
