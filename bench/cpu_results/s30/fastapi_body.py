"""FastAPI's handling of a 4096-id /generate body (an ASGI call, no socket) against
``model_validate_json`` on the raw body; with the argument ``orjson``, the app's routes are
``OrjsonRoute`` (what the server runs; the argument was added in session 32, whose
fastapi_body.txt used it). Run from the checkout root."""

import asyncio
import json
import random
import statistics
import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixlm.runtime.server.protocol import GenerateRequest

rng = random.Random(7)
body = json.dumps(
    {
        "input_ids": [rng.randrange(3, 49000) for _ in range(4096)],
        "stream": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
    }
).encode()
app = FastAPI()
if sys.argv[1:] == ["orjson"]:
    from radixlm.runtime.server.http_server import OrjsonRoute
    app.router.route_class = OrjsonRoute


@app.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    return Response(b"ok")


@app.post("/raw")
async def raw(request: Request) -> Response:
    GenerateRequest.model_validate_json(await request.body())
    return Response(b"ok")


async def call(path):
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "app": app,
    }
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(10)

    async def send(msg):
        pass

    await app(scope, receive, send)


async def main():
    for path in ["/generate", "/raw"] * 3:
        ts = []
        for _ in range(300):
            t = time.perf_counter()
            await call(path)
            ts.append(time.perf_counter() - t)
        print(path, round(statistics.median(ts) * 1e3, 3), round(min(ts) * 1e3, 3))


asyncio.run(main())
