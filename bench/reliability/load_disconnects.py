"""Load with client disconnects on loopback: nothing lost, nothing leaked.

    .venv/bin/python bench/reliability/load_disconnects.py                        # 500 requests, own servers
    .venv/bin/python bench/reliability/load_disconnects.py --requests 80 --output /tmp/load.json
    .venv/bin/python bench/reliability/load_disconnects.py --url http://127.0.0.1:30000 --server-pid 1234

Plan (seeded, ``make_plan``): ``--requests`` requests over ``--prompts`` distinct prompts,
each a shared prefix (one of ``--prefixes``, ~100 tokens) plus a distinct question; each
request picks an API (``/generate``, ``/v1/completions``, ``/v1/chat/completions``),
streaming or not, greedy (temperature 0), ``max_new_tokens`` fixed per prompt. A random
``--disconnect-fraction`` of them are cut by the client at a random point:

    streaming      before_first_token  close after a random delay: before the response
                                       headers (before_first_byte) or after them, before
                                       any token; if a token comes first, cut mid_stream
                   mid_stream          close after a random number of token events
    non-streaming  client_timeout      give up after a random delay (before the reply)

(a planned cut that comes too late is not a disconnect: the request completes and is
checked like the others; the summary counts disconnects by what happened).
All requests are sent at once (``--concurrency`` caps those in flight).

Checks afterwards (``summarize``):
- no HTTP 5xx and no error event; lost requests (neither completed nor cut by us: an
  error status, a stream without ``[DONE]``, ``finish_reason`` abort, a transport error,
  a timeout) = 0;
- the server goes idle: running and waiting gauges of /metrics back to 0, and
  /debug/check_invariants reports no live request, no lock, no violation, and
  ``free + cached == capacity`` (pages leaked = capacity - free - cached = 0);
- resident memory (VmRSS of the server process and its children, from /proc) after the
  load, idle, compared with the idle level measured after a warm-up before it;
- every completed request equals its reference: the same request (API, prompt, max
  tokens) sent alone, non-streaming, with top-2 logprobs, after /flush_cache, on a
  server with the radix cache disabled (the case definition of 'reference output'; the
  script starts one after the load server stops, or uses ``--reference-url`` / the
  ``--url`` server). A difference counts as numerics (a near-tie, reported, not a
  failure) only if the reference's top-2 logprob margin at the first differing token is
  below ``--tie-tolerance`` (rule of case C01); any other difference is a mismatch.
  ``prompt_tokens`` must match exactly.

The summary (printed, and written to ``--output``) holds the figures; exit status 1 if a
check failed. tests/e2e/test_load_disconnects.py runs the same functions, smaller.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from radixlm.runtime.bench.server_process import ServerProcess

APIS = ("generate", "completions", "chat")
PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
CUTS = ("before_first_token", "mid_stream", "client_timeout")
DEFAULT_SERVER_ARGS = "--max-total-tokens 8192 --chunked-prefill-size 512 --debug-invariants"
IDLE_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class LoadConfig:
    requests: int = 500
    concurrency: int = 0  # 0: all at once
    disconnect_fraction: float = 0.25
    seed: int = 0
    prefixes: int = 4
    prompts: int = 48
    max_new_tokens: int = 24  # per prompt: drawn from [max_new_tokens // 2, max_new_tokens]
    max_cut_delay_s: float = 8.0
    tie_tolerance: float = 0.02
    rss_tolerance_mib: float = 64.0  # idle memory after the load may exceed the level before by this
    request_timeout_s: float = 900.0


@dataclass(frozen=True)
class Spec:
    """One planned request. ``cut``: None or the planned disconnect; ``cut_delay_s``
    (before_first_token, client_timeout) or ``cut_events`` (mid_stream) say when."""

    index: int
    api: str
    stream: bool
    prompt: int  # index into the prompt list
    max_new_tokens: int
    cut: str | None = None
    cut_delay_s: float = 0.0
    cut_events: int = 0


_WORDS = ("amber birch cobalt dune ember fjord garnet harbor indigo juniper kelp lantern "
          "meadow nickel orchid pepper quartz raven saffron tundra").split()


def make_prompts(cfg: LoadConfig) -> list[tuple[str, str]]:
    """``cfg.prompts`` (prefix, question) pairs: a few long shared prefixes (~100 tokens,
    several KV pages) and a distinct question each."""
    rng = random.Random(cfg.seed)
    prefixes = []
    for p in range(cfg.prefixes):
        facts = " ".join(f"Shelf {i} holds the {rng.choice(_WORDS)} box number {rng.randrange(100)}."
                         for i in range(8))
        prefixes.append(f"Warehouse {p} inventory. {facts}")
    return [(prefixes[i % cfg.prefixes],
             f"Question {i}: which box is on shelf {rng.randrange(8)}, and what is {rng.choice(_WORDS)}?")
            for i in range(cfg.prompts)]


def make_plan(cfg: LoadConfig) -> list[Spec]:
    rng = random.Random(cfg.seed + 1)
    lengths = [rng.randint(max(cfg.max_new_tokens // 2, 2), cfg.max_new_tokens) for _ in range(cfg.prompts)]
    cut = set(rng.sample(range(cfg.requests), round(cfg.requests * cfg.disconnect_fraction)))
    specs = []
    for i in range(cfg.requests):
        prompt, api, stream = rng.randrange(cfg.prompts), rng.choice(APIS), rng.random() < 0.5
        spec = Spec(i, api, stream, prompt, lengths[prompt])
        if i in cut:
            kind = rng.choice(CUTS)
            spec = Spec(i, api, kind != "client_timeout", prompt, lengths[prompt], kind,
                        cut_delay_s=rng.uniform(0, cfg.max_cut_delay_s),
                        cut_events=rng.randint(1, max(lengths[prompt] - 1, 1)))
        specs.append(spec)
    return specs


def request_body(spec: Spec, prompts: list[tuple[str, str]], reference: bool = False) -> dict[str, Any]:
    """The JSON body of ``spec``; ``reference``: non-streaming with top-2 logprobs."""
    prefix, question = prompts[spec.prompt]
    stream = spec.stream and not reference
    if spec.api == "generate":
        body: dict[str, Any] = {"text": f"{prefix}\n{question}", "stream": stream,
                                "sampling_params": {"max_new_tokens": spec.max_new_tokens, "temperature": 0}}
        if reference:
            body.update(return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
        return body
    body = {"model": "default", "max_tokens": spec.max_new_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if spec.api == "completions":
        body["prompt"] = f"{prefix}\n{question}"
        if reference:
            body["logprobs"] = 2
    else:
        body["messages"] = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
        if reference:
            body.update(logprobs=True, top_logprobs=2)
    return body


# ----------------------------------------------------------------------------- client
@dataclass
class Outcome:
    """What happened to one request. ``status``: completed | disconnected | lost."""

    index: int
    status: str = "lost"
    kind: str | None = None  # disconnect kind, as it happened
    http_status: int | None = None
    text: str = ""
    output_ids: list[int] | None = None  # /generate only
    finish: str | None = None
    prompt_tokens: int | None = None
    token_events: int = 0
    done: bool = False  # streams: data: [DONE] seen
    error: str | None = None
    server_error: bool = False  # HTTP 5xx, or an error event with a 5xx code
    latency_s: float = 0.0


def _finish_of(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else value


def _add_event(out: Outcome, api: str, event: dict[str, Any]) -> None:
    """Fold one SSE event into ``out`` (/generate events are cumulative)."""
    if api == "generate":
        had = len(out.output_ids or [])
        out.text, out.output_ids = event["text"], event["output_ids"]
        out.token_events += len(out.output_ids) > had
        out.finish = _finish_of(event["meta_info"]["finish_reason"]) or out.finish
        out.prompt_tokens = event["meta_info"]["prompt_tokens"]
        return
    if event.get("usage"):
        out.prompt_tokens = event["usage"]["prompt_tokens"]
    for choice in event["choices"]:
        delta = (choice["delta"].get("content") or "") if api == "chat" else choice["text"]
        out.text += delta
        out.token_events += bool(delta)
        out.finish = choice["finish_reason"] or out.finish


def _read_body(out: Outcome, api: str, body: dict[str, Any]) -> None:
    if api == "generate":
        out.text, out.output_ids = body["text"], body["output_ids"]
        out.finish = _finish_of(body["meta_info"]["finish_reason"])
        out.prompt_tokens = body["meta_info"]["prompt_tokens"]
        return
    choice = body["choices"][0]
    out.text = choice["message"]["content"] if api == "chat" else choice["text"]
    out.finish = choice["finish_reason"]
    out.prompt_tokens = body["usage"]["prompt_tokens"]


def _settle(out: Outcome, stream: bool) -> None:
    """A request that got its whole answer is completed; anything else not cut by us is lost."""
    if out.status == "disconnected":
        return
    whole = out.http_status == 200 and out.finish in ("stop", "length") and (out.done or not stream)
    out.status = "completed" if whole and out.error is None else "lost"
    if out.status == "lost" and out.error is None:
        out.error = f"HTTP {out.http_status}, finish {out.finish!r}, [DONE] {out.done}"


def _cut(out: Outcome, kind: str) -> None:
    out.status, out.kind = "disconnected", kind


async def _stream(client: httpx.AsyncClient, spec: Spec, body: dict[str, Any], out: Outcome) -> None:
    early = spec.cut == "before_first_token"
    try:
        async with asyncio.timeout(spec.cut_delay_s if early else None):
            await _read_stream(client, spec, body, out)
    except TimeoutError:  # cut before the first token: before or after the response headers
        _cut(out, "before_first_byte" if out.http_status is None else "before_first_token")


async def _read_stream(client: httpx.AsyncClient, spec: Spec, body: dict[str, Any], out: Outcome) -> None:
    async with client.stream("POST", PATHS[spec.api], json=body) as r:
        out.http_status = r.status_code
        out.server_error = r.status_code >= 500
        if r.status_code != 200:
            out.error = (await r.aread()).decode(errors="replace")[:300]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                return
            event = orjson.loads(line[6:])
            if "error" in event:
                out.error = f"error event: {event['error']}"
                out.server_error |= int(event["error"].get("code") or 0) >= 500
                continue
            _add_event(out, spec.api, event)
            # A planned early cut whose first token came first is made now, mid-stream.
            cut_at = 1 if spec.cut == "before_first_token" else spec.cut_events
            if spec.cut in ("before_first_token", "mid_stream") and out.token_events >= cut_at:
                return _cut(out, "mid_stream")


async def _unary(client: httpx.AsyncClient, spec: Spec, body: dict[str, Any], out: Outcome) -> None:
    try:
        async with asyncio.timeout(spec.cut_delay_s if spec.cut == "client_timeout" else None):
            r = await client.post(PATHS[spec.api], json=body)
    except TimeoutError:
        return _cut(out, "client_timeout")
    out.http_status = r.status_code
    out.server_error = r.status_code >= 500
    if r.status_code != 200:
        out.error = r.text[:300]
        return
    _read_body(out, spec.api, r.json())


async def send_one(client: httpx.AsyncClient, spec: Spec, prompts: list[tuple[str, str]]) -> Outcome:
    out = Outcome(spec.index)
    start = time.perf_counter()
    try:
        body = request_body(spec, prompts)
        await (_stream if spec.stream else _unary)(client, spec, body, out)
    except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:  # transport or protocol failure
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - start
    _settle(out, spec.stream)
    return out


async def run_load(url: str, specs: list[Spec], prompts: list[tuple[str, str]], cfg: LoadConfig) -> list[Outcome]:
    """Send every request (all at once, or ``cfg.concurrency`` at a time)."""
    limit = cfg.concurrency or len(specs)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit + 8, max_keepalive_connections=limit + 8)
    async with httpx.AsyncClient(base_url=url, timeout=cfg.request_timeout_s, limits=limits) as client:
        async def one(spec: Spec) -> Outcome:
            async with sem:
                return await send_one(client, spec, prompts)

        return list(await asyncio.gather(*(one(s) for s in specs)))


# ----------------------------------------------------------------------------- server state
def scrape_metrics(url: str) -> dict[str, float]:
    """Prometheus samples by bare metric name (labels dropped, values summed)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in children.read_text().split()]
            except FileNotFoundError:  # exited meanwhile
                pass
    return found


def rss_mib(pid: int) -> dict[int, float]:
    """VmRSS (MiB) of ``pid`` and each of its descendants, from /proc."""
    out = {}
    for p in _descendants(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except FileNotFoundError:  # exited meanwhile
            continue
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        out[p] = int(m.group(1)) / 1024 if m else 0.0
    return out


def wait_idle(url: str, timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
    """Wait until the scheduler reports no live request and the /metrics gauges show no
    running or waiting request; returns the last reports and the time it took."""
    start = time.monotonic()
    while True:
        inv = httpx.get(f"{url}/debug/check_invariants", timeout=60).json()
        m = scrape_metrics(url)
        running, waiting = m["radixlm:num_running_reqs"], m["radixlm:num_queue_reqs"]
        idle = inv["num_live"] == 0 and running == 0 and waiting == 0
        if idle or time.monotonic() - start > timeout:
            capacity = int(m["radixlm:kv_cache_total_pages"])
            return {"idle": idle, "seconds": round(time.monotonic() - start, 2), "invariants": inv,
                    "running": running, "waiting": waiting, "capacity_pages": capacity,
                    "pages_leaked": capacity - inv["free_pages"] - inv["cached_pages"],
                    "preemptions": m["radixlm:num_preemptions_total"],
                    "evicted_pages": m["radixlm:evicted_pages_total"]}
        time.sleep(0.25)


def touch_kv_pool(url: str, prompt_tokens: int = 256, parallel: int = 8) -> int:
    """Write every KV page once, so that the idle memory level includes the whole pool
    (on the CPU it is allocated uninitialised and becomes resident as pages are first
    used). Sends distinct prompts of ``prompt_tokens`` tokens (``parallel`` at a time)
    until as many pages as the pool holds were handed out: the radix tree keeps finished
    prompts, so fresh pages come from the free list until it is empty (with the radix
    cache off pages are reused and only part of the pool is touched). Then /flush_cache.
    Returns the number of pages written."""
    from transformers import AutoTokenizer

    info = httpx.get(f"{url}/get_model_info", timeout=60).json()
    page, pages = info["page_size"], info["max_total_tokens"] // info["page_size"]
    tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])
    n = min(prompt_tokens, info["max_total_tokens"] // parallel - page)
    count = -(-pages // -(-(n + 1) // page))
    rng = random.Random(-1)
    bodies = [{"input_ids": tok.encode(" ".join(f"{rng.choice(_WORDS)} {rng.randrange(10**6)}"
                                                for _ in range(n)))[:n],
               "sampling_params": {"max_new_tokens": 1}} for _ in range(count)]
    with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(parallel) as pool:
        for r in pool.map(lambda b: client.post("/generate", json=b), bodies):
            r.raise_for_status()
        client.post("/flush_cache").raise_for_status()
    return count * -(-(n + 1) // page)


def warm_up(url: str, prompts: list[tuple[str, str]], cfg: LoadConfig) -> None:
    """One request per API and mode, concurrently (first-use allocations before the
    idle memory level is taken)."""
    specs = [Spec(i, api, stream, i % cfg.prompts, 4) for i, (api, stream) in
             enumerate((a, s) for a in APIS for s in (False, True))]
    outcomes = asyncio.run(run_load(url, specs, prompts, cfg))
    bad = [o for o in outcomes if o.status != "completed"]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


# ----------------------------------------------------------------------------- references
@dataclass
class Reference:
    text: str
    tokens: list[str]  # per generated token, its text
    ids: list[int] | None  # /generate only
    margins: list[float | None]  # top-1 minus top-2 logprob per position
    prompt_tokens: int


def _margin(values: list[float]) -> float | None:
    top = sorted(values, reverse=True)
    return top[0] - top[1] if len(top) >= 2 else None


def _parse_reference(api: str, body: dict[str, Any]) -> Reference:
    if api == "generate":
        meta = body["meta_info"]
        return Reference(body["text"], [t[2] for t in meta["output_token_logprobs"]], body["output_ids"],
                         [_margin([e[0] for e in top]) for top in meta["output_top_logprobs"]],
                         meta["prompt_tokens"])
    choice, prompt_tokens = body["choices"][0], body["usage"]["prompt_tokens"]
    if api == "completions":
        lp = choice["logprobs"]
        return Reference(choice["text"], lp["tokens"], None,
                         [_margin(list(t.values())) for t in lp["top_logprobs"]], prompt_tokens)
    content = choice["logprobs"]["content"]
    return Reference(choice["message"]["content"], [c["token"] for c in content], None,
                     [_margin([t["logprob"] for t in c["top_logprobs"]]) for c in content], prompt_tokens)


def _key(spec: Spec) -> tuple[str, int, int]:
    return spec.api, spec.prompt, spec.max_new_tokens


def compute_references(url: str, specs: list[Spec], outcomes: list[Outcome],
                       prompts: list[tuple[str, str]]) -> dict[tuple[str, int, int], Reference]:
    """Each distinct completed request sent alone (after /flush_cache), one at a time."""
    refs: dict[tuple[str, int, int], Reference] = {}
    with httpx.Client(base_url=url, timeout=600) as client:
        for spec, out in zip(specs, outcomes, strict=True):
            if out.status != "completed" or _key(spec) in refs:
                continue
            client.post("/flush_cache").raise_for_status()
            r = client.post(PATHS[spec.api], json=request_body(spec, prompts, reference=True))
            r.raise_for_status()
            refs[_key(spec)] = _parse_reference(spec.api, r.json())
    return refs


def _first_difference(out: Outcome, ref: Reference) -> int:
    """Index of the first generated token where ``out`` leaves the reference."""
    if out.output_ids is not None:
        return next((i for i, (a, b) in enumerate(zip(out.output_ids, ref.ids, strict=False)) if a != b),
                    min(len(out.output_ids), len(ref.ids)))
    common = next((i for i, (a, b) in enumerate(zip(out.text, ref.text, strict=False)) if a != b),
                  min(len(out.text), len(ref.text)))
    pos = 0
    for k, tok in enumerate(ref.tokens):  # the reference token holding character ``common``
        pos += len(tok)
        if pos > common:
            return k
    return len(ref.tokens)


def compare(spec: Spec, out: Outcome, ref: Reference, tolerance: float) -> dict[str, Any] | None:
    """None if ``out`` equals the reference; else a record with ``verdict`` near_tie
    (reference top-2 margin below ``tolerance`` where they part) or mismatch."""
    same_ids = out.output_ids is None or out.output_ids == ref.ids
    if out.text == ref.text and same_ids and out.prompt_tokens == ref.prompt_tokens:
        return None
    pos = _first_difference(out, ref)
    margin = ref.margins[pos] if pos < len(ref.margins) else None
    tie = margin is not None and margin < tolerance and out.prompt_tokens == ref.prompt_tokens
    return {"index": spec.index, "api": spec.api, "stream": spec.stream, "prompt": spec.prompt,
            "verdict": "near_tie" if tie else "mismatch", "position": pos, "reference_margin": margin,
            "prompt_tokens": [out.prompt_tokens, ref.prompt_tokens], "text": out.text, "reference": ref.text}


# ----------------------------------------------------------------------------- summary
@dataclass
class LoadResult:
    """The load phase: outcomes plus the server's state before and after."""

    outcomes: list[Outcome]
    wall_s: float
    idle: dict[str, Any]
    rss_idle_before_mib: float | None = None
    rss_peak_mib: float | None = None
    rss_idle_after_mib: float | None = None
    prepare_s: float = 0.0  # warm-up and KV pool touch
    rss_processes_before: dict[str, float] = field(default_factory=dict)
    rss_processes_after: dict[str, float] = field(default_factory=dict)


async def _sample_rss(pid: int, peak: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], sum(rss_mib(pid).values()))
        await asyncio.sleep(0.5)


async def _load_with_rss(url: str, specs: list[Spec], prompts: list[tuple[str, str]], cfg: LoadConfig,
                         pid: int | None) -> tuple[list[Outcome], float | None]:
    if pid is None:
        return await run_load(url, specs, prompts, cfg), None
    peak, stop = [0.0], asyncio.Event()
    sampler = asyncio.ensure_future(_sample_rss(pid, peak, stop))
    try:
        return await run_load(url, specs, prompts, cfg), peak[0]
    finally:
        stop.set()
        await sampler


def run_load_phase(url: str, cfg: LoadConfig, server_pid: int | None = None) -> LoadResult:
    """Warm up, take the idle memory level, run the load, wait for idle, take it again."""
    prompts, specs = make_prompts(cfg), make_plan(cfg)
    start = time.perf_counter()
    warm_up(url, prompts, cfg)
    wait_idle(url)
    if server_pid:
        touch_kv_pool(url)
    before = rss_mib(server_pid) if server_pid else {}
    prepared = time.perf_counter()
    outcomes, peak = asyncio.run(_load_with_rss(url, specs, prompts, cfg, server_pid))
    wall = time.perf_counter() - prepared
    idle = wait_idle(url)
    result = LoadResult(outcomes, wall, idle, sum(before.values()) if server_pid else None, peak,
                        prepare_s=prepared - start)
    if server_pid:
        time.sleep(1.0)  # let the last responses' buffers go
        after = rss_mib(server_pid)
        result.rss_idle_after_mib = sum(after.values())
        result.rss_processes_before = {str(p): round(v, 1) for p, v in before.items()}
        result.rss_processes_after = {str(p): round(v, 1) for p, v in after.items()}
    return result


def summarize(cfg: LoadConfig, load: LoadResult, refs: dict[tuple[str, int, int], Reference]) -> dict[str, Any]:
    specs = make_plan(cfg)
    outs = load.outcomes
    status = Counter(o.status for o in outs)
    diffs = [d for s, o in zip(specs, outs, strict=True) if o.status == "completed"
             and (d := compare(s, o, refs[_key(s)], cfg.tie_tolerance)) is not None]
    inv = load.idle["invariants"]
    r = lambda x: None if x is None else round(x, 1)  # noqa: E731
    summary = {
        "config": asdict(cfg),
        "requests_sent": len(outs),
        "by_api": dict(Counter(f"{s.api}{'-stream' if s.stream else ''}" for s in specs)),
        "completed": status["completed"],
        "disconnected": status["disconnected"],
        "disconnected_by_kind": dict(Counter(o.kind for o in outs if o.kind)),
        "planned_cuts": sum(s.cut is not None for s in specs),
        "lost": status["lost"],
        "http_5xx": sum(o.server_error for o in outs),
        "lost_examples": [asdict(o) for o in outs if o.status == "lost"][:5],
        "finish_reasons": dict(Counter(o.finish for o in outs if o.status == "completed")),
        "wall_s": round(load.wall_s, 1),
        "prepare_s": round(load.prepare_s, 1),
        "latency_max_s": round(max(o.latency_s for o in outs), 1),
        "idle_after_s": load.idle["seconds"],
        "idle": load.idle["idle"],
        "running_after": load.idle["running"],
        "waiting_after": load.idle["waiting"],
        "pages_leaked": load.idle["pages_leaked"],
        "capacity_pages": load.idle["capacity_pages"],
        "locked_pages_after": inv["locked_pages"],
        "invariants_ok": inv["ok"],
        "invariant_violations": inv["violations"][:5],
        "preemptions": load.idle["preemptions"],
        "evicted_pages": load.idle["evicted_pages"],
        "references": len(refs),
        "checked_outputs": status["completed"],
        "output_mismatches": sum(d["verdict"] == "mismatch" for d in diffs),
        "near_ties": sum(d["verdict"] == "near_tie" for d in diffs),
        "differences": diffs,
        "rss_idle_before_mib": r(load.rss_idle_before_mib),
        "rss_peak_mib": r(load.rss_peak_mib),
        "rss_idle_after_mib": r(load.rss_idle_after_mib),
        "rss_processes_before_mib": load.rss_processes_before,
        "rss_processes_after_mib": load.rss_processes_after,
    }
    summary["passed"] = failures(summary) == []
    return summary


def failures(summary: dict[str, Any]) -> list[str]:
    """The checks of the module docstring that failed."""
    before, after = summary["rss_idle_before_mib"], summary["rss_idle_after_mib"]
    tolerance = summary["config"]["rss_tolerance_mib"]
    checks = {
        "memory above its idle level": before is None or after <= before + tolerance,
        "lost requests": summary["lost"] == 0,
        "HTTP 5xx": summary["http_5xx"] == 0,
        "server not idle": summary["idle"],
        "pages leaked": summary["pages_leaked"] == 0,
        "locks held": summary["locked_pages_after"] == 0,
        "invariants": summary["invariants_ok"] and not summary["invariant_violations"],
        "output mismatches": summary["output_mismatches"] == 0,
    }
    return [name for name, ok in checks.items() if not ok]


# ----------------------------------------------------------------------------- main
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = LoadConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="in flight at once; 0: all")
    p.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--prefixes", type=int, default=d.prefixes, help="shared prompt prefixes")
    p.add_argument("--prompts", type=int, default=d.prompts, help="distinct prompts")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--max-cut-delay", type=float, default=d.max_cut_delay_s,
                   help="seconds; disconnect delays are drawn from [0, this]")
    p.add_argument("--tie-tolerance", type=float, default=d.tie_tolerance,
                   help="top-2 logprob margin below which a differing greedy token is numerics")
    p.add_argument("--rss-tolerance-mib", type=float, default=d.rss_tolerance_mib,
                   help="allowed growth of the server's idle RSS over the load")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="launch_server flags of both servers")
    p.add_argument("--url", help="load this running server instead of starting one")
    p.add_argument("--server-pid", type=int, help="with --url: its launcher's pid, for memory figures")
    p.add_argument("--reference-url", help="reference server (default: a fresh one with the radix "
                                           "cache off; with --url, that server)")
    p.add_argument("--output", help="write the JSON summary here")
    return p.parse_args(argv)


def _config(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(requests=args.requests, concurrency=args.concurrency,
                      disconnect_fraction=args.disconnect_fraction, seed=args.seed, prefixes=args.prefixes,
                      prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                      max_cut_delay_s=args.max_cut_delay, tie_tolerance=args.tie_tolerance,
                      rss_tolerance_mib=args.rss_tolerance_mib)


def _log_errors(path: Path) -> list[str]:
    return [line for line in path.read_text(errors="replace").splitlines()
            if " ERROR " in line or line.startswith("Traceback")]


def _own_servers(cfg: LoadConfig, args: argparse.Namespace) -> tuple[LoadResult, dict, dict[str, Any]]:
    flags = shlex.split(args.server_args)
    logs = [Path(tempfile.gettempdir()) / f"radixlm-load-{name}.log" for name in ("load", "reference")]
    with open(logs[0], "w") as log, ServerProcess.launch(["--log-level", "warning", *flags], log=log) as srv:
        load = run_load_phase(srv.url, cfg, srv.proc.pid)
        load_exit = srv.stop()
    print(f"load done in {load.wall_s:.0f} s; computing references", flush=True)
    ref_flags = ["--log-level", "warning", *flags, "--disable-radix-cache"]
    with open(logs[1], "w") as log, ServerProcess.launch(ref_flags, log=log) as ref:
        refs = compute_references(ref.url, make_plan(cfg), load.outcomes, make_prompts(cfg))
    extra = {"server_args": args.server_args, "server_exit_code": load_exit, "server_logs": [str(p) for p in logs],
             "server_log_errors": [e for p in logs for e in _log_errors(p)][:10]}
    return load, refs, extra


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    cfg = _config(args)
    if args.url:
        load = run_load_phase(args.url, cfg, args.server_pid)
        refs = compute_references(args.reference_url or args.url, make_plan(cfg), load.outcomes,
                                  make_prompts(cfg))
        extra: dict[str, Any] = {"url": args.url}
    else:
        load, refs, extra = _own_servers(cfg, args)
    summary = {**summarize(cfg, load, refs), **extra}
    summary["failures"] = failures(summary)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if not summary["failures"] and not summary.get("server_log_errors") else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
