"""MsgSocket: typed messages over ZeroMQ ipc, the blocking receive with and without a spin."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from radixlm.runtime import messages as m
from radixlm.runtime.ipc import MsgSocket, new_ipc_address


@pytest.fixture
def pair() -> Iterator[tuple[MsgSocket, MsgSocket]]:
    """A PUSH socket connected to a bound PULL socket over a fresh ipc address; closed after."""
    addr = new_ipc_address("test")
    pull = MsgSocket(zmq.PULL, addr, bind=True)
    push = MsgSocket(zmq.PUSH, addr, bind=False)
    yield push, pull
    push.close()
    pull.close()


def _req(rid: str, n: int = 4096) -> m.GenerateReq:
    return m.GenerateReq(rid=rid, input_ids=list(range(n)), sampling=m.SamplingParams(max_new_tokens=3))


def test_messages_arrive_whole_and_in_order_with_and_without_a_spin(pair) -> None:
    push, pull = pair
    for spin in (0.0, 0.05):
        push.send(_req("a"))
        push.send(_req("b", 3))
        got = pull.recv(timeout_ms=1000, spin_s=spin)
        assert got == _req("a")
        rest, deadline = [], time.monotonic() + 1.0  # "b" may still be in ZeroMQ's I/O thread
        while not rest and time.monotonic() < deadline:
            rest = pull.recv_all()
        assert rest == [_req("b", 3)]
        assert pull.recv_all() == []


def test_a_spin_returns_none_after_the_spin_and_the_timeout_when_nothing_arrives(pair) -> None:
    _, pull = pair
    start = time.perf_counter()
    assert pull.recv(timeout_ms=20, spin_s=0.03) is None
    assert time.perf_counter() - start >= 0.045  # 30 ms spinning, then 20 ms blocked (timer slack)
    start = time.perf_counter()
    assert pull.recv(timeout_ms=0, spin_s=0.0) is None  # a plain poll: no wait
    assert time.perf_counter() - start < 0.02


def test_a_message_sent_during_the_spin_is_taken_before_the_spin_ends(pair) -> None:
    push, pull = pair
    timer = threading.Timer(0.02, lambda: push.send(_req("late", 16)))
    start = time.perf_counter()
    timer.start()
    got = pull.recv(timeout_ms=1000, spin_s=2.0)
    elapsed = time.perf_counter() - start
    timer.join()
    assert got == _req("late", 16)
    assert 0.015 <= elapsed < 1.0  # not the whole 2 s spin
