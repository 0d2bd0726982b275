"""TokenizerManager's request lifecycle without a scheduler: what it sends, when, and what
closing a generation or releasing its ticket leaves behind (a recording socket stands in
for ZeroMQ; outputs are fed to ``_dispatch`` as the receive loop would)."""

from __future__ import annotations

import asyncio

import pytest

from radixlm.runtime import messages as m
from radixlm.runtime.server.tokenizer_manager import GenInput, InvalidRequest, TokenizerManager


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
    assert [type(x) for x in send.sent] == [m.GenerateReq, m.GenerateReq]
    sids = [x.rid for x in send.sent]
    assert [sid.split("#")[0] for sid in sids] == ["a-0", "a-1"] and len(set(sids)) == 2
    assert tm.held_samples == 2 and set(tm.queues) == set(sids) and tm.rids == {"a"}
    ticket.release()  # the response ended before its body began: nothing may stay behind
    assert [(type(x), x.rid) for x in send.sent[2:]] == [(m.AbortReq, sids[0]), (m.AbortReq, sids[1])]
    assert tm.held_samples == 0 and tm.queues == {} and tm.rids == set()
    ticket.release()  # idempotent
    assert len(send.sent) == 4 and tm.held_samples == 0


def test_a_finished_generation_aborts_nothing(tok) -> None:
    tm, send = make_tm(tok)
    ids = tok.encode(" world")

    async def run() -> list:
        ticket, generation = tm.start([gen_input(tok, "b")])
        sid = send.sent[0].rid
        tm._dispatch(m.BatchOutput(outputs=[
            m.ReqOutput(rid=sid, new_token_ids=ids[:1], prompt_tokens=1),
            m.ReqOutput(rid=sid, new_token_ids=ids[1:], finish_reason="length", prompt_tokens=1)]))  # fmt: skip
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


def test_repeated_rids_in_one_request_are_refused_before_anything_is_sent(tok) -> None:
    tm, send = make_tm(tok)
    with pytest.raises(InvalidRequest) as exc:
        tm.start([gen_input(tok, "d"), gen_input(tok, "d")])
    assert exc.value.param == "rid" and "distinct" in exc.value.message
    assert send.sent == [] and tm.held_samples == 0 and tm.queues == {} and tm.rids == set()


def test_outputs_of_an_aborted_sample_never_reach_a_request_reusing_its_rid(tok) -> None:
    """A client leaves and at once resends with the same rid: outputs the scheduler had
    already sent for the aborted sample must not show up in the new stream."""
    tm, send = make_tm(tok)
    ids = tok.encode(" one two")

    async def run() -> list:
        old, _ = tm.start([gen_input(tok, "e")])
        old_sid = send.sent[0].rid
        old.release()  # the client left: abort sent, queue entry gone
        ticket, generation = tm.start([gen_input(tok, "e")])  # same rid, at once
        new_sid = send.sent[-1].rid
        assert new_sid != old_sid
        tm._dispatch(m.BatchOutput(outputs=[  # the old sample's output, still in flight
            m.ReqOutput(rid=old_sid, new_token_ids=ids[:1], prompt_tokens=9)]))  # fmt: skip
        tm._dispatch(m.BatchOutput(outputs=[
            m.ReqOutput(rid=new_sid, new_token_ids=ids[1:], finish_reason="length", prompt_tokens=1)]))  # fmt: skip
        chunks = [c async for _, c in generation]
        ticket.release()
        return chunks

    chunks = asyncio.run(run())
    assert [(c.token_ids, c.prompt_tokens) for c in chunks] == [(ids[1:], 1)]
    assert tm.held_samples == 0 and tm.queues == {} and tm.rids == set()


def test_column_tokens_reach_the_stream_before_the_outputs_with_the_first_outputs_usage(tok) -> None:
    """BatchOutput's token columns (one plain token of a streamed request) become chunks
    like ReqOutputs do, ahead of the batch's outputs, with the prompt and cached token
    counts of the request's first output; through the wire format as sent."""
    tm, send = make_tm(tok)
    ids = tok.encode(" one two three four")
    assert len(ids) >= 4

    async def run() -> list:
        ticket, generation = tm.start([gen_input(tok, "f")])
        sid = send.sent[0].rid
        for batch in (
            m.BatchOutput(outputs=[m.ReqOutput(rid=sid, new_token_ids=ids[:1], prompt_tokens=5, cached_tokens=3)]),
            m.BatchOutput(token_rids=[sid], token_ids=[ids[1]]),
            # the request's last output and, in the columns, the token before it
            m.BatchOutput(outputs=[m.ReqOutput(rid=sid, new_token_ids=ids[3:], finish_reason="length",
                                               prompt_tokens=5, cached_tokens=3)],
                          token_rids=["gone", sid], token_ids=[9, ids[2]]),
        ):
            tm._dispatch(m.decode(m.encode(batch)))
        chunks = [c async for _, c in generation]
        ticket.release()
        return chunks

    chunks = asyncio.run(run())
    assert [c.token_ids for c in chunks] == [ids[:1], ids[1:2], ids[2:3], ids[3:]]
    assert "".join(c.text for c in chunks) == tok.decode(ids)
    assert [(c.prompt_tokens, c.cached_tokens) for c in chunks] == [(5, 3)] * 4
    assert [c.completion_tokens for c in chunks] == [1, 2, 3, len(ids)]
    assert [c.finish_reason for c in chunks] == [None, None, None, "length"]
    assert tm.held_samples == 0 and tm.queues == {}
