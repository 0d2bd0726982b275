"""The HTTP app (FastAPI): ``create_app``, the native routes here, the OpenAI routes in
``openai_api``, the shared plumbing (errors, middlewares, SSE) in ``http_common``.

Native API (SGLang field names): ``POST /generate``, ``GET /health``,
``GET /health_generate``, ``GET /get_model_info``, ``GET /get_server_info`` (also
``GET /server_info``, SGLang's newer name), ``GET /version``, ``POST /flush_cache``,
``GET /metrics`` (Prometheus).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.messages import SchedulerStats
from radixlm.runtime.server.http_common import (
    CLIENT_CLOSED,
    SSE_DONE,
    VERSION,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HeldStream,
    OrjsonRoute,
    collect_until_disconnect,
    error_response,
    install_error_handlers,
    sse,
)
from radixlm.runtime.server.metrics import Metrics
from radixlm.runtime.server.openai_api import install_openai_routes
from radixlm.runtime.server.protocol import GenerateRequest
from radixlm.runtime.server.tokenizer_manager import (
    Generation,
    GenInput,
    InvalidRequest,
    SampleChunk,
    SchedulerDied,
    Ticket,
    TokenizerManager,
)
from radixlm.runtime.server.tool_calling import ToolPlan, plan_tools
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.text.grammar import grammar_of

__all__ = ["create_app", "flush_radix_cache", "model_info", "native_generate", "native_generate_stream"]


def create_app(tm: TokenizerManager, metrics: Metrics, args: ServerArgs, model_path: str) -> FastAPI:
    """The app serving ``tm`` with the settings ``args`` (``--api-key`` None = no key
    needed); ``model_path`` is the model as the user named it (``--model-path``, or the
    default model's GGUF file), reported by ``/get_model_info``."""
    app = FastAPI(title="radixlm", version=VERSION)
    app.router.route_class = OrjsonRoute  # before any route is added
    app.state.tm = tm
    app.state.metrics = metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    if args.api_key is not None:  # added last = outermost: a refused client is never read
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    install_error_handlers(app)
    _install_native_routes(app, tm, metrics, args.stream_output)
    _install_info_routes(app, tm, args, model_path)
    install_openai_routes(app, tm, metrics)
    return app


# --------------------------------------------------------------------------- native API
def _native_inputs(tm: TokenizerManager, req: GenerateRequest) -> list[tuple[list[int], str]]:
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        return [(tm.encode(t, "text"), "text") for t in texts]
    ids = req.input_ids
    batch = ids if ids and isinstance(ids[0], list) else [ids]
    return [(list(b), "input_ids") for b in batch]


def _native_gens(tm: TokenizerManager, req: GenerateRequest, plan: ToolPlan | None = None) -> list[GenInput]:
    inputs = _native_inputs(tm, req)
    if not inputs:
        raise InvalidRequest("the batch is empty", "text" if req.text is not None else "input_ids")
    rids = [req.rid] if isinstance(req.rid, str) else (req.rid or [None] * len(inputs))
    if len(rids) != len(inputs):
        raise InvalidRequest("rid must have one entry per prompt", "rid")
    sp = req.sampling_params
    sampling = sp.to_sampling()
    if plan is not None:
        sampling = msgspec.structs.replace(sampling, structural_tag=plan.grammar)
    gens = []
    for (ids, field), rid in zip(inputs, rids, strict=True):
        gen = GenInput(input_ids=ids, sampling=sampling, n=sp.n, return_logprob=req.return_logprob,
                       logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
                       top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                       stream=req.stream, data_parallel_rank=req.data_parallel_rank)
        if rid:
            gen.rid = rid
        gens.append(tm.validate(gen, field))
    return gens


def _tool_plan(tm: TokenizerManager, req: GenerateRequest) -> ToolPlan | None:
    """The tool calls of a native request (radixlm's extension: ``tools``, ``tool_choice``,
    ``parallel_tool_calls`` as on the chat route; the prompt is the caller's text)."""
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tm.tool_format)
    if plan is not None and grammar_of(req.sampling_params) is not None:
        raise InvalidRequest("tools constrain the output with their own grammar: give no regex, json_schema, "
                             "ebnf or structural_tag with them", "tools")
    return plan


class _NativeResult:
    """Accumulates one sample's chunks into SGLang's response shape."""

    def __init__(self, tm: TokenizerManager, gen: GenInput, index: int, with_text: bool,
                 plan: ToolPlan | None = None) -> None:
        self.tm, self.gen, self.index, self.with_text, self.plan = tm, gen, index, with_text, plan
        self.text, self.ids = "", []
        self.logprobs: list[float] = []
        self.top: list = []
        self.last: SampleChunk | None = None
        self.start = gen.created  # when the request was validated, not when results were gathered
        self._sent = (0, 0)  # (characters, tokens) already sent as segments (--stream-output)

    def add(self, c: SampleChunk) -> None:
        self.text += c.text
        self.ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.top += c.top_logprobs or []
        if c.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top = c.prompt_logprobs, c.prompt_top_logprobs
        self.last = c

    def _tok(self, tid: int) -> str | None:
        return self.tm.tokenizer.decode([tid]) if self.with_text else None

    def _triples(self, lps: list, ids: list[int]) -> list:
        return [[lp, t, self._tok(t)] for lp, t in zip(lps, ids, strict=False)]

    def _tops(self, tops: list) -> list:
        return [None if t is None else [[lp, i, self._tok(i)] for i, lp in t] for t in tops]

    def segment(self) -> dict[str, Any]:
        """``body()`` of what arrived since the last segment (``--stream-output``: disjoint
        ``text`` / ``output_ids`` / output logprobs; prompt logprobs in the first segment only;
        ``completion_tokens`` stays the total)."""
        out = self.body(self._sent)
        self._sent = (len(self.text), len(self.ids))
        return out

    def body(self, since: tuple[int, int] = (0, 0)) -> dict[str, Any]:
        """The response so far, from character / token ``since`` on (default: all of it)."""
        chars, toks = since
        c = self.last
        meta: dict[str, Any] = {
            "id": f"{self.gen.rid}-{self.index}" if self.gen.n > 1 else self.gen.rid,
            "prompt_tokens": c.prompt_tokens if c else len(self.gen.input_ids),
            "completion_tokens": len(self.ids),
            "cached_tokens": c.cached_tokens if c else 0,
            "finish_reason": _native_finish(c),
            **({"cached_tokens_per_tier": c.cached_tiers} if c and c.cached_tiers is not None else {}),
            "e2e_latency": time.perf_counter() - self.start,
        }
        if self.gen.return_logprob:  # input_* are empty without prompt logprobs (logprob_start_len -1)
            meta["output_token_logprobs"] = self._triples(self.logprobs[toks:], self.ids[toks:])
            start = self.gen.logprob_start_len
            plp = (getattr(self, "prompt_logprobs", None) or []) if since == (0, 0) else []
            meta["input_token_logprobs"] = self._triples(plp, self.gen.input_ids[start:]) if start >= 0 else []
            if self.gen.top_logprobs_num:
                ptop = (getattr(self, "prompt_top", None) or []) if since == (0, 0) else []
                meta["input_top_logprobs"] = self._tops(ptop)
                meta["output_top_logprobs"] = self._tops(self.top[toks:])
        if self.plan is not None and c is not None and c.finished:
            meta["tool_calls"] = self.plan.message(self.text)[1]
        if since == (0, 0):
            return {"text": self.text, "output_ids": self.ids, "meta_info": meta}
        return {"text": self.text[chars:], "output_ids": self.ids[toks:], "meta_info": meta}


def _native_finish(c: SampleChunk | None) -> dict[str, Any] | None:
    if c is None or c.finish_reason is None:
        return None
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched_stop}
    if c.finish_reason == "length":  # "message" says why when the KV pool, not a limit, cut it
        return {"type": "length", "length": c.completion_tokens, **({"message": c.error} if c.error else {})}
    return {"type": "abort", "message": c.error}


def _install_native_routes(app: FastAPI, tm: TokenizerManager, metrics: Metrics, stream_output: bool) -> None:
    @app.get("/health")
    async def health() -> Response:
        if tm.dead:
            return error_response(503, f"scheduler died: {tm.dead}", err_type="server_error")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once a one-token generation went through the scheduler (SGLang's deep
        health check); 503 if the scheduler is dead or the generation failed."""
        if tm.dead:
            return error_response(503, f"scheduler died: {tm.dead}", err_type="server_error")
        gens = _native_gens(tm, GenerateRequest(input_ids=[1], sampling_params={"max_new_tokens": 1}))
        chunks = [c async for c in tm.generate(gens[0])]
        if not chunks or chunks[-1].finish_reason not in ("stop", "length"):
            return error_response(503, "health generation failed", err_type="server_error")
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        await flush_radix_cache(tm)
        return Response("Cache flushed.\n", status_code=200)

    @app.get("/debug/check_invariants")
    async def check_invariants() -> dict[str, Any]:
        """Page/tree invariants checked in the scheduler now (200 even if violated)."""
        out = await tm.check_invariants()
        return {"ok": out.ok, "message": out.message, "num_live": out.num_live,
                "free_pages": out.free_pages, "cached_pages": out.cached_pages,
                "locked_pages": out.locked_pages, "violations": out.violations}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render(tm.stats)
        return Response(body, media_type=content_type)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        if body.stream:
            ticket, events = native_generate_stream(tm, metrics, body, stream_output)
            return HeldStream(_sse_stream(events), ticket)
        out = await native_generate(tm, metrics, body, lambda chunks: collect_until_disconnect(request, chunks))
        return Response(status_code=CLIENT_CLOSED) if out is None else JSONResponse(out)


async def flush_radix_cache(tm: TokenizerManager) -> None:
    """``/flush_cache``: empty the radix cache. Raises InvalidRequest (400) if the
    scheduler refuses (requests are running)."""
    out = await tm.flush_cache()
    if not out.success:
        raise InvalidRequest(f"cache not flushed: {out.message}")


async def _collect(chunks: AsyncIterator[SampleChunk]) -> list[SampleChunk] | None:
    return [c async for c in chunks]


async def native_generate(tm: TokenizerManager, metrics: Metrics, body: GenerateRequest,
                          collect: Callable[[AsyncIterator[SampleChunk]], Any] = _collect) -> Any:
    """The JSON of a non-streaming native ``/generate``: one result dict, or a list for a
    batch or ``n`` > 1. ``collect`` gathers one prompt's chunks (None: the client left;
    then this returns None). Raises InvalidRequest, QueueFull, SchedulerDied."""
    plan = _tool_plan(tm, body)
    gens = _native_gens(tm, body, plan)
    results = []
    with tm.admit(gens):  # the prompts of a batch run concurrently (batched by the scheduler)
        gathered = await asyncio.gather(*(collect(tm.generate(g)) for g in gens))
        if any(chunks is None for chunks in gathered):
            return None
        for gen, chunks in zip(gens, gathered, strict=True):
            res = [_NativeResult(tm, gen, i, body.return_text_in_logprobs, plan) for i in range(gen.n)]
            for c in chunks:
                res[c.index].add(c)
                metrics.observe_chunk(gen, c)
            results += [r.body() for r in res]
    single = len(gens) == 1 and gens[0].n == 1 and not isinstance(body.text, list) and not (
        body.input_ids and isinstance(body.input_ids[0], list))
    return results[0] if single else results


def native_generate_stream(tm: TokenizerManager, metrics: Metrics, body: GenerateRequest,
                           segments: bool = False) -> tuple[Ticket, AsyncIterator[dict[str, Any]]]:
    """A streaming native ``/generate``, sent to the scheduler now (``TokenizerManager.start``):
    its admission ticket (the caller releases it when the stream ends, however it ends;
    that aborts what is not finished) and its events (see ``_native_stream``; ``segments``:
    ``--stream-output``). Raises InvalidRequest, QueueFull, SchedulerDied."""
    plan = _tool_plan(tm, body)
    gens = _native_gens(tm, body, plan)
    ticket, generation = tm.start(gens)
    return ticket, _native_stream(tm, generation, gens, body, metrics, segments, plan)


async def _sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(events):  # a client gone: close now, which aborts the samples
        async for event in events:
            yield sse(event)
    yield SSE_DONE


def model_info(tm: TokenizerManager, args: ServerArgs, model_path: str) -> dict[str, Any]:
    """``/get_model_info``'s body (see that route)."""
    r = tm.ready
    return {"model_path": model_path, "tokenizer_path": args.tokenizer_path or r.model_dir,
            "model_dir": r.model_dir, "served_model_name": tm.model_name, "is_generation": True,
            "context_length": r.context_length, "page_size": r.page_size,
            "max_total_tokens": r.max_total_tokens, "device": r.device, "dtype": r.dtype,
            "stream_output": args.stream_output}  # how native streams read (the DSL's endpoint)


def _install_info_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs, model_path: str) -> None:
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        """SGLang's model info. ``model_path``: the model as given (``--model-path``, or the
        default model's GGUF file), so clients can pick a chat template by name;
        ``tokenizer_path``: the directory the tokenizer was loaded from; ``model_dir``: the
        Hugging Face directory the weights were loaded from (a GGUF's converted copy)."""
        return model_info(tm, args, model_path)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The radixlm version, as vLLM's and SGLang's ``/version``."""
        return {"version": VERSION}

    @app.get("/get_server_info")
    @app.get("/server_info")  # SGLang's newer name of the same route
    async def get_server_info() -> dict[str, Any]:
        """SGLang's server info: every setting except the API key, overridden by the
        values resolved at start-up (``device``, ``dtype``, ``context_length``,
        ``max_total_tokens``, ``cuda_graph_max_bs`` (null: no decode graphs),
        ``admit_batch_size``, ``idle_spin_ms``, ``disable_overlap_schedule``, ``weight_dtype`` (the decoder linears' kind, then the LM
        head's when it differs: "int4/int8"), and for the KV cache dtypes that use them
        ``kv_mixed_window_pages`` / ``kv_sink_slots``), ``hicache`` (with a hierarchical cache: tier
        sizes in pages, page bytes, the tiers' measured read bandwidths in bytes/s), ``peer_kv``
        (with --enable-peer-kv: the backend, the measured peer read bandwidth in bytes/s and
        one-page transfer in seconds, page bytes; replica 0's), the model info, ``max_total_num_tokens`` /
        ``max_req_input_len`` (SGLang's names), ``internal_states`` (per data parallel
        replica, the scheduler's last report: running/waiting requests, KV pool usage, prefix-cache hit rate,
        preemptions, ``peer``: the peer KV tier's counters, PeerStats), ``version`` and ``name`` ("radixlm": how clients such as ``radixlm bench
        serving`` tell this server from SGLang, whose info has the same keys)."""
        r = tm.ready
        resolved = {"cuda_graph_max_bs": r.cuda_graph_max_bs, "admit_batch_size": r.admit_batch_size,
                    "idle_spin_ms": r.idle_spin_ms, "disable_overlap_schedule": r.disable_overlap_schedule,
                    "weight_dtype": r.weight_dtype}
        if args.kv_cache_dtype == "mixed":
            resolved["kv_mixed_window_pages"] = args.mixed_window_pages
        if args.kv_cache_dtype == "fp8_e4m3":
            resolved["kv_sink_slots"] = args.sink_slots
        if r.hicache is not None:
            resolved["hicache"] = r.hicache
        if r.peer_kv is not None:
            resolved["peer_kv"] = r.peer_kv
        return {**args.public_dict(), **resolved, **model_info(tm, args, model_path),
                "max_total_num_tokens": r.max_total_tokens, "max_req_input_len": r.context_length - 1, "kv_cache_bytes": r.kv_bytes,
                "internal_states": [_internal_state(st) for st in tm.replica_stats()], "version": VERSION, "name": "radixlm"}


def _internal_state(stats: SchedulerStats | None) -> dict[str, Any]:
    """The scheduler's last ``SchedulerStats`` (empty before its first report) with SGLang's
    ``num_running_reqs``, ``num_waiting_reqs``, ``token_usage`` and ``cache_hit_rate``."""
    if stats is None:
        return {}
    seen = stats.prefill_tokens_computed + stats.prefill_tokens_cached
    return {"num_running_reqs": stats.num_running, "num_waiting_reqs": stats.num_waiting,
            "token_usage": stats.kv_used_pages / max(stats.kv_total_pages, 1),
            "cache_hit_rate": stats.prefill_tokens_cached / seen if seen else 0.0,
            **msgspec.structs.asdict(stats), "hicache": msgspec.to_builtins(stats.hicache),
            "peer": msgspec.to_builtins(stats.peer)}


async def _native_stream(tm: TokenizerManager, generation: Generation, gens: list[GenInput],
                         body: GenerateRequest, metrics: Metrics, segments: bool = False,
                         plan: ToolPlan | None = None) -> AsyncIterator[dict[str, Any]]:
    """SGLang-style stream events: each carries the cumulative ``text`` and ``output_ids``
    of one sample with its ``index`` (``segments``, SGLang's ``--stream-output``: only what
    is new since that sample's last event; a long reply then costs O(n), not O(n^2), to
    encode, send and parse); a failure mid-stream is a last ``{"error": ...}`` event (HTTP
    sends each as SSE, then ``data: [DONE]``). An event goes out whenever new token ids
    arrive, also while their text is held back (an incomplete UTF-8 character, a possible
    stop string): ``output_ids`` and a client's token timing follow the tokens."""
    bases = list(itertools.accumulate((gen.n for gen in gens), initial=0))
    res = [[_NativeResult(tm, gen, i, body.return_text_in_logprobs, plan) for i in range(gen.n)] for gen in gens]
    try:  # the prompts of a batch run concurrently; events interleave, each with its index
        async with contextlib.aclosing(generation) as chunks:  # closed with us: aborts now
            async for k, c in chunks:
                r = res[k][c.index]
                r.add(c)
                metrics.observe_chunk(gens[k], c)
                if c.text or c.token_ids or c.finished:
                    yield {**(r.segment() if segments else r.body()), "index": bases[k] + c.index}
    except SchedulerDied as exc:
        yield {"error": {"message": str(exc), "type": "server_error", "code": 503}}
    except InvalidRequest as exc:
        yield {"error": {"message": exc.message, "type": "invalid_request_error", "param": exc.param,
                         "code": 400}}


Handler = Callable[..., Any]
