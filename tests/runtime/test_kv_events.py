"""runtime/kv_events.py: the block hash, the wire format (vLLM's), the recorder, publisher
-> subscriber over real ZeroMQ sockets (replay of a late start, of a gap, a restart), and
the block index a router matches prompts against."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import tempfile
import threading
import time
import uuid

import msgspec
import pytest
import zmq

from radixlm.runtime import kv_events as kv


def _ipc(name: str) -> str:
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'radixlm-test-{name}-{uuid.uuid4().hex[:8]}')}"


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_page_hash_is_sha256_of_the_parent_and_the_packed_tokens():
    first = int.from_bytes(hashlib.sha256(bytes(8) + struct.pack("<4I", 1, 2, 3, 4)).digest()[:8], "big")
    second = int.from_bytes(hashlib.sha256(first.to_bytes(8, "big") + struct.pack("<4I", 5, 6, 7, 2**32 - 1))
                            .digest()[:8], "big")
    assert kv.page_hash(None, [1, 2, 3, 4]) == first
    assert kv.block_hashes([1, 2, 3, 4, 5, 6, 7, 2**32 - 1, 9], 4) == [first, second]  # partial page: none
    assert kv.block_hashes([1, 2, 3], 4) == []
    with pytest.raises(ValueError, match="token ids"):
        kv.page_hash(None, [-1, 0, 0, 0])


def test_the_wire_format_is_vllms():
    """A batch is a msgpack array [ts, events, rank]; events are maps tagged by "type" with
    vLLM's field names, the optional ones present as nil."""
    rec = kv.KVEventRecorder(2)
    rec.stored([7, 8, 9, 10], [3, 4])
    rec.removed([4])
    rec.cleared()
    batch = kv.EventBatch(ts=12.5, events=rec.take(), data_parallel_rank=1)
    h = kv.block_hashes([7, 8, 9, 10], 2)
    raw = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(raw) == [12.5, [
        {"type": "BlockStored", "block_hashes": h, "parent_block_hash": None, "token_ids": [7, 8, 9, 10],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [h[1]], "medium": "GPU"},
        {"type": "AllBlocksCleared"}], 1]
    assert kv.decode_batch(raw) == batch


def test_the_recorder_announces_only_new_pages_in_runs():
    rec = kv.KVEventRecorder(2)
    rec.stored([1, 2, 3, 4], [10, 11])
    rec.stored([1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13])  # extends the path: one run of two
    rec.stored([1, 2, 9, 9], [10, 20])  # a branch after the first page
    rec.removed([13, 99])  # 99: never announced
    events = rec.take()
    h = kv.block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)
    branch = kv.block_hashes([1, 2, 9, 9], 2)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events[:3]] == [
        (h[:2], None, [1, 2, 3, 4]), (h[2:], h[1], [5, 6, 7, 8]), (branch[1:], h[0], [9, 9])]
    assert events[3] == kv.BlockRemoved(block_hashes=[h[3]], medium="GPU")
    assert rec.held_hashes() == {*h[:3], branch[1]}
    assert rec.take() == []


def _stream(endpoint: str, replay: str | None):
    got: list[kv.EventBatch] = []
    lock = threading.Lock()

    def on_batch(batch: kv.EventBatch) -> None:
        with lock:
            got.append(batch)

    return got, kv.KVEventSubscriber(endpoint, on_batch, replay)


def _stored(i: int) -> kv.BlockStored:
    return kv.BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[i], block_size=1, lora_id=None,
                          medium="GPU", lora_name=None)


def test_a_late_subscriber_gets_every_batch_in_order_through_the_replay():
    endpoint, replay = _ipc("pub"), _ipc("replay")
    pub = kv.KVEventPublisher(endpoint, replay, topic="kv", data_parallel_rank=0)
    try:
        for i in range(5):
            pub.publish([_stored(i)])
        time.sleep(0.1)  # sent before anyone listens: lost on PUB, kept for replay
        got, sub = _stream(endpoint, replay)
        _wait(lambda: len(got) == 6)
        pub.publish([_stored(5)])
        _wait(lambda: len(got) == 7)
        sub.close()
    finally:
        pub.close()
    assert isinstance(got[0].events[0], kv.AllBlocksCleared)  # seq 0: the start
    assert [b.events[0].block_hashes for b in got[1:]] == [[i] for i in range(6)]
    assert sub.next_seq == 7 and sub.missed == 0


def test_a_gap_is_filled_from_the_replay():
    """A hand-driven publisher: the subscriber's first replay gets seq 0, then live seq 3
    shows a gap; its replay request from 1 gets 1, 2, 3; live 4 follows. Applied in order,
    each once."""
    endpoint, replay = _ipc("pub"), _ipc("replay")
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(endpoint)
    router.bind(replay)
    payload = {i: msgspec.msgpack.encode(kv.EventBatch(ts=float(i), events=[_stored(i)])) for i in range(5)}

    def answer(start: int, upto: int) -> None:
        assert router.poll(5000)
        client, _, asked = router.recv_multipart()
        assert int.from_bytes(asked, "big") == start
        for seq in range(start, upto + 1):
            router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload[seq]))
        router.send_multipart((client, b"", kv.END_SEQ, b""))

    got, sub = _stream(endpoint, replay)
    try:
        answer(0, 0)
        _wait(lambda: len(got) == 1)
        time.sleep(0.2)  # the SUB connection is up
        pub.send_multipart((b"", (3).to_bytes(8, "big"), payload[3]))
        answer(1, 3)
        _wait(lambda: len(got) == 4)
        pub.send_multipart((b"", (4).to_bytes(8, "big"), payload[4]))
        _wait(lambda: len(got) == 5)
    finally:
        sub.close()
        pub.close(0)
        router.close(0)
        ctx.term()
    assert [b.ts for b in got] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sub.missed == 0 and sub.next_seq == 5


def test_a_restarted_publisher_is_followed_from_its_new_start():
    endpoint, replay = _ipc("pub"), _ipc("replay")
    pub = kv.KVEventPublisher(endpoint, replay)
    got, sub = _stream(endpoint, replay)
    try:
        _wait(lambda: len(got) == 1)
        time.sleep(0.2)
        pub.publish([_stored(1)])
        pub.publish([_stored(2)])
        _wait(lambda: len(got) == 3)
        pub.close()
        pub = kv.KVEventPublisher(endpoint, replay)  # a restarted server: seq 0 again
        time.sleep(0.3)  # its seq 0 went out before the SUB reconnected: seq 1 shows the gap
        pub.publish([_stored(3)])
        _wait(lambda: len(got) == 5, timeout=10)
    finally:
        sub.close()
        pub.close()
    kinds = [type(b.events[0]).__name__ for b in got]
    assert kinds == ["AllBlocksCleared", "BlockStored", "BlockStored", "AllBlocksCleared", "BlockStored"]
    assert got[-1].events[0].block_hashes == [3]


def test_publisher_offsets_the_port_per_data_parallel_rank_and_reports_a_taken_port():
    assert kv.offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert kv.offset_endpoint("ipc:///tmp/x", 1) == "ipc:///tmp/x_dp1"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pub = kv.KVEventPublisher(f"tcp://*:{port}")
    try:
        with pytest.raises(zmq.ZMQError, match="in use"):
            kv.KVEventPublisher(f"tcp://*:{port}")
    finally:
        pub.close()


def test_block_index_matches_the_longest_prefix_per_group():
    index = kv.KVBlockIndex(group=lambda source: source[0])
    a = kv.block_hashes(list(range(8)), 2)  # 4 pages
    b = kv.block_hashes([0, 1, 2, 3, 9, 9], 2)  # shares 2 pages with a

    def stored(hashes, tokens, parent=None):
        return kv.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=2,
                              lora_id=None, medium="GPU", lora_name=None)

    index.apply(("r1", 0), kv.EventBatch(ts=0, events=[stored(a, list(range(8)))]))
    index.apply(("r2", 1), kv.EventBatch(ts=0, events=[stored(b, [0, 1, 2, 3, 9, 9])]))
    assert index.match(a) == {"r1": 4, "r2": 2}
    assert index.match(b) == {"r1": 2, "r2": 3}
    index.apply(("r1", 0), kv.EventBatch(ts=0, events=[kv.BlockRemoved(block_hashes=[a[1]], medium="GPU")]))
    assert index.match(a) == {"r1": 1, "r2": 2}  # r1 lost page 1: its run stops there
    index.apply(("r2", 1), kv.EventBatch(ts=0, events=[kv.AllBlocksCleared()]))
    assert index.match(b) == {"r1": 1}
    index.drop(("r1", 0))
    assert index.match(a) == {} and index.sources() == []
