"""TokenizerManager: the tokenizer process's side of the scheduler connection.

It tokenizes (and applies chat templates), validates requests against the context
length and the KV pool, sends GenerateReq over ZeroMQ, receives the scheduler's token
outputs and detokenizes them incrementally per sample (UTF-8 safe, stop strings held
back). ``generate`` yields SampleChunk objects; a request with ``n`` samples becomes n
scheduler requests ``rid-0 .. rid-(n-1)`` whose seeds are ``seed + i``.

Closing the ``generate`` iterator early (client disconnect, error) aborts every sample
that has not finished, so the scheduler frees its pages.

Admission (``--max-queued-requests``): a generation request holds one slot per sample
(prompts x n) from ``admit`` until its ticket is released (the response ended, however it
ended); slots beyond ``--max-running-requests`` are the queue. The count lives here, in
the one asyncio thread that accepts requests, so it is exact for that definition
(never stale, no race); the scheduler may hold more requests waiting when the KV pool,
not the running limit, bounds its batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from radixlm.runtime import messages as m
from radixlm.runtime.ipc import MsgSocket
from radixlm.runtime.text.detokenizer import IncrementalDetokenizer
from radixlm.runtime.text.tool_parsers import get_parser

__all__ = ["TokenizerManager", "GenInput", "Generation", "SampleChunk", "InvalidRequest", "SchedulerDied",
           "QueueFull", "Ticket", "check_unicode_in"]

logger = logging.getLogger("radixlm.tokenizer")
LOG_TEXT_CHARS = 2000  # --log-requests logs at most this many characters of each text


class InvalidRequest(ValueError):
    """A request the server refuses (HTTP 400). ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _check_unicode(text: str, field_name: str) -> None:
    """Reject strings that are not valid Unicode text (lone UTF-16 surrogates, which JSON
    escapes like "\\ud800" can produce): they cannot be tokenized or sent on."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{field_name} is not valid Unicode: {exc.reason} at index {exc.start}",
                             field_name) from exc


def check_unicode_in(value: object, field_name: str) -> None:
    """``_check_unicode`` on every string inside ``value`` (decoded JSON: dicts, lists).
    Raises InvalidRequest naming ``field_name``."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            _check_unicode(node, field_name)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)


def _clip(text: str) -> str:
    """``text`` cut to LOG_TEXT_CHARS characters for the log."""
    if len(text) <= LOG_TEXT_CHARS:
        return text
    return f"{text[:LOG_TEXT_CHARS]}...(+{len(text) - LOG_TEXT_CHARS} chars)"


class SchedulerDied(RuntimeError):
    """The scheduler process is gone; in-flight requests fail with this."""


class QueueFull(RuntimeError):
    """A request that would make the queue longer than --max-queued-requests (HTTP 429)."""

    retry_after_s = 1  # the Retry-After header of the 429


class Ticket:
    """Queue slots held by one HTTP request (see ``TokenizerManager.admit``). ``release``
    is idempotent and also ends the generation started under the ticket
    (``TokenizerManager.start``: its unfinished samples are aborted); ``with ticket:``
    releases on exit."""

    def __init__(self, owner: TokenizerManager, samples: int) -> None:
        self.owner, self.samples, self.released = owner, samples, False
        self.generation: Generation | None = None

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.owner.held_samples -= self.samples
            if self.generation is not None:
                self.generation.close()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class GenInput:
    input_ids: list[int]
    sampling: m.SamplingParams
    n: int = 1
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.perf_counter)
    data_parallel_rank: int | None = None  # the replica to run on (data parallelism); None: the router's pick


@dataclass
class SampleChunk:
    """New output of sample ``index`` (text and ids since its previous chunk)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    cached_tiers: dict[str, int] | None = None  # cached_tokens by tier (hierarchical cache)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Sample:
    def __init__(self, index: int, sid: str, detok: IncrementalDetokenizer) -> None:
        self.index = index
        self.sid = sid  # the scheduler's id of this sample, unique in the process
        self.detok = detok
        self.completion_tokens = 0
        self.prompt_tokens = self.cached_tokens = 0  # from the first output (BatchOutput)
        self.cached_tiers: dict[str, int] | None = None
        self.done = False
        self.text = ""  # kept only with --log-requests


class Generation:
    """The samples of some requests, already sent to the scheduler: an async iterator of
    (k, chunk) for the samples of ``gens[k]`` as they arrive, until all have finished.
    ``close()`` / ``aclose()`` (idempotent; also at the end of the iteration) forgets them
    and aborts those not finished. Made by ``TokenizerManager.generate_all``."""

    def __init__(self, tm: TokenizerManager, gens: list[GenInput]) -> None:
        self.tm, self.queue = tm, asyncio.Queue()
        self.started: list[tuple[str, list[_Sample]]] = []
        self.flat: list[tuple[int, _Sample]] = []  # queue index -> (gen index, sample)
        self.closed = False
        try:
            for k, gen in enumerate(gens):
                samples: list[_Sample] = []
                self.started.append((gen.rid, samples))
                tm._start_samples(gen, self.queue, samples, len(self.flat))
                self.flat += [(k, sample) for sample in samples]
        except BaseException:
            self.close()
            raise
        self.remaining = len(self.flat)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, SampleChunk]:
        if self.closed or not self.remaining:
            self.close()
            raise StopAsyncIteration
        try:
            index, out = await self.queue.get()
            if out is None:
                raise SchedulerDied(self.tm.dead or "scheduler stopped")
            k, sample = self.flat[index]
            chunk = self.tm._to_chunk(sample, out)
        except BaseException:
            self.close()
            raise
        if chunk.finished:
            self.remaining -= 1
        return k, chunk

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for rid, samples in self.started:
                self.tm._end_samples(rid, samples)

    async def aclose(self) -> None:
        self.close()


class TokenizerManager:
    def __init__(self, tokenizer, ready: m.SchedulerReady, send: MsgSocket, recv: MsgSocket,
                 model_name: str, log_requests: bool = False, max_running_requests: int = 64,
                 max_queued_requests: int | None = None, tool_call_parser: str = "auto") -> None:
        self.tokenizer = tokenizer
        # the format of tool calls (runtime/text/tool_parsers.py); "auto": from the chat template
        self.tool_format = get_parser(tool_call_parser, getattr(tokenizer, "chat_template", None))
        self.ready = ready
        self.send = send
        self.recv = recv
        self.model_name = model_name
        self.log_requests = log_requests
        self.max_running_requests = max_running_requests
        self.max_queued_requests = max_queued_requests
        self.held_samples = 0  # slots held by admitted tickets
        self.context_length = ready.context_length
        self.max_total_tokens = ready.max_total_tokens
        # Outputs are routed by sample id ``<rid>-<i>#<serial>``, unique in the process, so
        # outputs still in flight for an aborted sample never reach a newer request that
        # reuses its rid; ``rids`` holds the request ids of the live generations.
        self.queues: dict[str, tuple[asyncio.Queue, int]] = {}
        self.rids: set[str] = set()
        self._serial = itertools.count()
        self.control_waiters: dict[type, list[asyncio.Future]] = {}
        self.stats: m.SchedulerStats | None = None
        self.dead: str | None = None
        # Data parallelism: ``send`` is a DPRouter (server/dp_router.py) over this many
        # replicas; their stats and control replies are merged (``merge_stats``).
        self.num_replicas = getattr(send, "num_replicas", 1)
        self._release = getattr(send, "release", None)  # the router's load bookkeeping
        self._replica_stats: dict[int, m.SchedulerStats] = {}
        self._control_parts: dict[type, list] = {}

    # ----------------------------------------------------------------- receive loop
    async def recv_loop(self) -> None:
        while True:
            msg = await self.recv.arecv()
            try:
                self._dispatch(msg)
            except Exception:  # never let one bad message stop every request's output
                logger.exception("failed to dispatch %s", type(msg).__name__)

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.BatchOutput):
            queues = self.queues
            for rid, token in zip(msg.token_rids, msg.token_ids, strict=True):  # first (BatchOutput)
                entry = queues.get(rid)
                if entry is not None:
                    entry[0].put_nowait((entry[1], token))
            for out in msg.outputs:
                entry = queues.get(out.rid)
                if entry is not None:
                    entry[0].put_nowait((entry[1], out))
        elif isinstance(msg, m.SchedulerStats):
            if self.num_replicas == 1:
                self.stats = msg
            else:
                self._replica_stats[msg.dp_rank] = msg
                self.stats = merge_stats(list(self._replica_stats.values()))
        elif isinstance(msg, m.FlushCacheOut | m.CheckInvariantsOut):
            if self.num_replicas > 1:  # one reply per replica: answer once all came
                parts = self._control_parts.setdefault(type(msg), [])
                parts.append(msg)
                if len(parts) < self.num_replicas:
                    return
                msg = _merge_replies(self._control_parts.pop(type(msg)))
            waiters = self.control_waiters.pop(type(msg), [])
            for fut in waiters:
                if not fut.done():
                    fut.set_result(msg)

    def replica_stats(self) -> list[m.SchedulerStats | None]:
        """Each replica's last stats, by dp rank (one entry without data parallelism)."""
        if self.num_replicas == 1:
            return [self.stats]
        return [self._replica_stats.get(i) for i in range(self.num_replicas)]

    def fail_all(self, reason: str) -> None:
        """The scheduler died: wake every waiting request with an error."""
        self.dead = reason
        for queue, index in list(self.queues.values()):
            queue.put_nowait((index, None))
        for waiters in self.control_waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(SchedulerDied(reason))

    # ----------------------------------------------------------------- tokenization
    def encode(self, text: str, field_name: str = "prompt") -> list[int]:
        _check_unicode(text, field_name)
        return self.tokenizer.encode(text, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        check_unicode_in(messages, "messages")  # else the tokenizer's own TypeError text
        check_unicode_in(tools, "tools")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt,
                tokenize=True, return_dict=False,
            )
        except Exception as exc:  # jinja errors from the template are the caller's fault
            raise InvalidRequest(f"cannot apply the chat template: {exc}", "messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ----------------------------------------------------------------- validation
    def validate(self, gen: GenInput, field_name: str = "prompt") -> GenInput:
        """Check a request against the model and the pool; clamp max_new_tokens to the
        context (documented policy). Raises InvalidRequest."""
        n = len(gen.input_ids)
        if n == 0:
            raise InvalidRequest("prompt is empty", field_name)
        _check_unicode(gen.rid, "rid")
        if gen.rid in self.rids:
            raise InvalidRequest(f"request id {gen.rid!r} is already in use", "rid")
        for stop in gen.sampling.stop:
            _check_unicode(stop, "stop")
        for pattern in gen.sampling.stop_regex:
            _check_unicode(pattern, "stop_regex")
        vocab = self.ready.vocab_size
        if min(gen.input_ids) < 0 or max(gen.input_ids) >= vocab:  # 4096 ids: 0.10 ms (per-id loop: 0.18)
            raise InvalidRequest(f"token ids must be in [0, {vocab})", field_name)
        if n >= self.context_length:
            raise InvalidRequest(
                f"prompt has {n} tokens; the model's context length is {self.context_length} "
                "(prompt + at least 1 generated token must fit)", field_name)
        page = self.ready.page_size
        if -(-(n + 1) // page) * page > self.max_total_tokens:
            raise InvalidRequest(
                f"prompt has {n} tokens, which exceeds the KV cache capacity of "
                f"{self.max_total_tokens} tokens", field_name)
        room = self.context_length - n
        if gen.sampling.max_new_tokens > room:
            gen.sampling = msgspec.structs.replace(gen.sampling, max_new_tokens=room)
        if gen.logprob_start_len >= n:
            gen.logprob_start_len = n - 1
        if gen.data_parallel_rank is not None and not 0 <= gen.data_parallel_rank < self.num_replicas:
            raise InvalidRequest(f"data_parallel_rank must be in [0, {self.num_replicas}) (--dp-size)",
                                 "data_parallel_rank")
        return gen

    # ----------------------------------------------------------------- admission
    def admit(self, gens: list[GenInput]) -> Ticket:
        """Hold one queue slot per sample of ``gens`` (the prompts of one HTTP request)
        until the returned ticket is released. Raises InvalidRequest (``rid``) if a request
        id repeats among ``gens``; QueueFull if the slots held beyond
        --max-running-requests would then exceed --max-queued-requests (a request is always
        admitted when no slot is held)."""
        if len({g.rid for g in gens}) != len(gens):
            raise InvalidRequest("request ids must be distinct within a request", "rid")
        samples = sum(g.n for g in gens)
        limit = self.max_queued_requests
        queued = self.held_samples + samples - self.max_running_requests
        if limit is not None and self.held_samples and queued > limit:
            raise QueueFull(f"the server's request queue is full: {queued} requests would wait, the "
                            f"limit is {limit}; retry after {QueueFull.retry_after_s} s")
        self.held_samples += samples
        return Ticket(self, samples)

    # ----------------------------------------------------------------- generation
    async def generate(self, gen: GenInput) -> AsyncIterator[SampleChunk]:
        """Yield chunks of every sample until all have finished. Raises SchedulerDied,
        InvalidRequest (request id in use)."""
        async with contextlib.aclosing(self.generate_all([gen])) as chunks:
            async for _, chunk in chunks:
                yield chunk

    def generate_all(self, gens: list[GenInput]) -> Generation:
        """Send the samples of every ``gens[k]`` to the scheduler now, all at once (the
        prompts of a batch run concurrently when streamed too); the returned Generation
        yields (k, chunk) as they arrive. Closing it aborts the samples not finished.
        Raises SchedulerDied, InvalidRequest (request id in use)."""
        if self.dead:
            raise SchedulerDied(self.dead)
        for gen in gens:
            if gen.rid in self.rids:  # raced past validate()
                raise InvalidRequest(f"request id {gen.rid!r} is already in use", "rid")
        return Generation(self, gens)

    def start(self, gens: list[GenInput]) -> tuple[Ticket, Generation]:
        """``admit`` then ``generate_all`` for a streamed response: the samples reach the
        scheduler before the response starts (a first token sooner by the time the HTTP
        layer takes to start a stream), and releasing the ticket (however the response
        ends, even before its body began) closes the generation. Raises QueueFull,
        SchedulerDied, InvalidRequest."""
        ticket = self.admit(gens)
        try:
            ticket.generation = self.generate_all(gens)
        except BaseException:
            ticket.release()
            raise
        return ticket, ticket.generation

    def _start_samples(self, gen: GenInput, queue: asyncio.Queue, samples: list[_Sample], base: int) -> None:
        """Register and send every sample (its outputs go to ``queue`` as ``base + i``);
        ``samples`` grows as they are sent, so the caller's cleanup covers a failure half-way."""
        self.rids.add(gen.rid)
        for i in range(gen.n):
            sid = f"{gen.rid}-{i}#{next(self._serial)}"
            sp = gen.sampling
            if sp.seed is not None and i:
                sp = msgspec.structs.replace(sp, seed=sp.seed + i)
            detok = IncrementalDetokenizer(
                self.tokenizer, gen.input_ids, skip_special_tokens=sp.skip_special_tokens,
                stop=sp.stop, include_stop_str_in_output=sp.include_stop_str_in_output,
                stop_regex=sp.stop_regex)
            samples.append(_Sample(i, sid, detok))
            self.queues[sid] = (queue, base + i)
            self.send.asend_nowait(m.GenerateReq(
                rid=sid, input_ids=gen.input_ids, sampling=sp, return_logprob=gen.return_logprob,
                logprob_start_len=gen.logprob_start_len, top_logprobs_num=gen.top_logprobs_num,
                stream=gen.stream, data_parallel_rank=gen.data_parallel_rank))
        if self.log_requests:
            prompt = _clip(self.tokenizer.decode(gen.input_ids))
            logger.info("request %s: %d prompt tokens, n=%d, %s, prompt %r", gen.rid, len(gen.input_ids), gen.n,
                        gen.sampling, prompt)

    def _end_samples(self, rid: str, samples: list[_Sample]) -> None:
        self.rids.discard(rid)
        for s in samples:
            self.queues.pop(s.sid, None)
            if not s.done and not self.dead:
                self.send.asend_nowait(m.AbortReq(rid=s.sid))
            if self._release is not None:
                self._release(s.sid)

    def _to_chunk(self, sample: _Sample, out: m.ReqOutput | int) -> SampleChunk:
        """The chunk of ``out``: a ReqOutput, or one plain token (BatchOutput's columns)."""
        if type(out) is int:
            out = m.ReqOutput(rid=sample.sid, new_token_ids=[out], prompt_tokens=sample.prompt_tokens,
                              cached_tokens=sample.cached_tokens, cached_tiers=sample.cached_tiers)
        else:
            sample.prompt_tokens, sample.cached_tokens = out.prompt_tokens, out.cached_tokens
            sample.cached_tiers = out.cached_tiers
        text = sample.detok.push(out.new_token_ids)
        sample.completion_tokens += len(out.new_token_ids)
        if out.finish_reason is not None:
            text += sample.detok.finish()
            sample.done = True
        if self.log_requests:
            sample.text += text
            if sample.done:
                logger.info("request %s finished (%s, %d tokens): %r", out.rid, out.finish_reason,
                            sample.completion_tokens, _clip(sample.text))
        return SampleChunk(
            index=sample.index, text=text, token_ids=list(out.new_token_ids),
            logprobs=out.new_logprobs, top_logprobs=out.new_top_logprobs,
            prompt_logprobs=out.prompt_logprobs, prompt_top_logprobs=out.prompt_top_logprobs,
            finish_reason=out.finish_reason, matched_stop=out.matched_stop,
            prompt_tokens=out.prompt_tokens, completion_tokens=sample.completion_tokens,
            cached_tokens=out.cached_tokens, error=out.error, cached_tiers=out.cached_tiers,
        )

    # ----------------------------------------------------------------- control
    async def _control(self, req, reply_type: type, timeout: float = 30.0):
        if self.dead:
            raise SchedulerDied(self.dead)
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters.setdefault(reply_type, []).append(fut)
        self.send.asend_nowait(req)
        return await asyncio.wait_for(fut, timeout)

    async def flush_cache(self) -> m.FlushCacheOut:
        return await self._control(m.FlushCacheReq(), m.FlushCacheOut)

    async def check_invariants(self) -> m.CheckInvariantsOut:
        return await self._control(m.CheckInvariantsReq(), m.CheckInvariantsOut)


def merge_stats(parts: list[m.SchedulerStats]) -> m.SchedulerStats:
    """The replicas' latest stats as one: counts and seconds summed, the peer KV tier's too
    (``page_size`` and the hierarchical cache's stats are the first replica's)."""
    first = parts[0]
    sums = {f: sum(getattr(p, f) for p in parts) for f in first.__struct_fields__
            if f not in ("dp_rank", "page_size", "hicache", "peer")}
    peers = [p.peer for p in parts if p.peer is not None]
    if peers:
        sums["peer"] = m.PeerStats(**{f: (max if f == "page_bytes" else sum)(getattr(p, f) for p in peers)
                                      for f in m.PeerStats.__struct_fields__})
    return msgspec.structs.replace(first, **sums)


def _merge_replies(parts: list) -> m.FlushCacheOut | m.CheckInvariantsOut:
    """The replicas' replies to one control request as one (ok only if every replica's is)."""
    if isinstance(parts[0], m.FlushCacheOut):
        return m.FlushCacheOut(success=all(p.success for p in parts),
                               message="; ".join(p.message for p in parts if p.message))
    return m.CheckInvariantsOut(
        ok=all(p.ok for p in parts), message="; ".join(p.message for p in parts if p.message),
        num_live=sum(p.num_live for p in parts), free_pages=sum(p.free_pages for p in parts),
        cached_pages=sum(p.cached_pages for p in parts), locked_pages=sum(p.locked_pages for p in parts),
        violations=[v for p in parts for v in p.violations])
