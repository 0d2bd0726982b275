"""TokenizerManager's request lifecycle without a scheduler: what it sends, when, and what
closing a generation or releasing its ticket leaves behind (a recording socket stands in
for ZeroMQ; outputs are fed to ``_dispatch`` as the receive loop would)."""

from __future__ import annotations

import asyncio

import pytest

from radixlm.runtime import messages as m
from radixlm.runtime.tokenizer_manager import GenInput, InvalidRequest, TokenizerManager


class RecordingSocket:
    def __init__(self) -> None:
        self.sent: list[m.Message] = []

    def asend_nowait(self, msg: m.Message) -> None:
        self.sent.append(msg)


def make_tm(tok) -> tuple[TokenizerManager, RecordingSocket]:
    ready = m.SchedulerReady(max_total_tokens=4096, context_length=2048, page_size=16,
                             vocab_size=len(tok), model_dir="", device="cpu", dtype="float32",
                             kv_bytes=0)  # fmt: skip
    send = RecordingSocket()
    return TokenizerManager(tok, ready, send, None, "test", max_running_requests=4), send


def gen_input(tok, rid: str, n: int = 1) -> GenInput:
    gen = GenInput(input_ids=tok.encode("Hello"), sampling=m.SamplingParams(max_new_tokens=4), n=n)
    gen.rid = rid
    return gen


def test_start_sends_before_the_stream_is_read_and_release_aborts(tok) -> None:
    tm, send = make_tm(tok)
    ticket, generation = tm.start([gen_input(tok, "a", n=2)])
    # sent at start, before anything iterates the generation (a stream's body)
    assert [(type(x), x.rid) for x in send.sent] == [(m.GenerateReq, "a-0"), (m.GenerateReq, "a-1")]
    assert tm.held_samples == 2 and set(tm.queues) == {"a-0", "a-1"}
    ticket.release()  # the response ended before its body began: nothing may stay behind
    assert [(type(x), x.rid) for x in send.sent[2:]] == [(m.AbortReq, "a-0"), (m.AbortReq, "a-1")]
    assert tm.held_samples == 0 and tm.queues == {}
    ticket.release()  # idempotent
    assert len(send.sent) == 4 and tm.held_samples == 0


def test_a_finished_generation_aborts_nothing(tok) -> None:
    tm, send = make_tm(tok)
    ids = tok.encode(" world")

    async def run() -> list:
        ticket, generation = tm.start([gen_input(tok, "b")])
        tm._dispatch(m.BatchOutput(outputs=[
            m.ReqOutput(rid="b-0", new_token_ids=ids[:1], prompt_tokens=1),
            m.ReqOutput(rid="b-0", new_token_ids=ids[1:], finish_reason="length", prompt_tokens=1)]))  # fmt: skip
        chunks = [c async for _, c in generation]
        ticket.release()
        return chunks

    chunks = asyncio.run(run())
    assert "".join(c.text for c in chunks) == tok.decode(ids)
    assert [c.finish_reason for c in chunks] == [None, "length"]
    assert [type(x) for x in send.sent] == [m.GenerateReq]  # finished: no abort
    assert tm.held_samples == 0 and tm.queues == {}


def test_a_request_id_in_use_is_refused_before_anything_is_sent(tok) -> None:
    tm, send = make_tm(tok)
    ticket, _ = tm.start([gen_input(tok, "c")])
    with pytest.raises(InvalidRequest) as exc:
        tm.start([gen_input(tok, "c")])
    assert exc.value.param == "rid"
    assert len(send.sent) == 1 and tm.held_samples == 1  # the refused one holds no slot
    ticket.release()
    assert tm.held_samples == 0 and tm.queues == {}
