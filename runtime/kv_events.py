"""KV cache events: which prefix blocks a server's radix cache stores and drops, published
over ZeroMQ in vLLM's KV event format, so that a router in front of several servers (ours in
``runtime/deploy/``, llm-d's KV cache indexer, ...) knows which server holds which prefix.

Wire format (vLLM's ``vllm/distributed/kv_events.py``; docs/SERVING.md "KV events"):

    PUB multipart:  [topic (utf-8), seq (8 bytes, big-endian unsigned), payload]
    payload:        msgpack array [ts (float, Unix seconds), [event, ...], data_parallel_rank]
    event:          msgpack map tagged by "type":
      {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
       "token_ids": [t, ...], "block_size": S, "lora_id": nil, "medium": "GPU", "lora_name": nil}
      {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU"}
      {"type": "AllBlocksCleared"}

A block is one KV page of S = ``--page-size`` tokens. ``BlockStored`` lists a run of
consecutive pages of one path of the radix tree (``token_ids`` holds the run's S x n
tokens), the first one's parent being ``parent_block_hash`` (nil at the root). The block
hash chains the page's tokens to its parent's hash (``page_hash``), so equal hashes mean
equal whole prefixes, and a consumer hashes a prompt the same way to look its pages up.
``medium`` is always "GPU": the device KV pool, also on a CPU-only server (as vLLM's CPU
backend reports it); the lower tiers of the hierarchical cache are not published.

Sequence numbers start at 0 with an ``AllBlocksCleared`` batch when the server starts, so a
consumer that sees seq 0 again knows the server restarted with an empty cache. The replay
socket (ROUTER) answers ``[b"", start_seq (8 bytes)]`` (from a DEALER; a REQ socket sends
the empty frame itself) with ``[b"", seq, payload]`` for every batch still buffered with
seq >= start_seq, then ``[b"", -1 (8 bytes, signed), b""]``.

Pieces: ``page_hash`` / ``block_hashes`` (the hash), the msgspec structs and ``decode_batch``,
``KVEventRecorder`` (the scheduler's: page ids in and out of the tree -> events),
``KVEventPublisher`` (PUB + replay ROUTER on a thread), and for consumers
``KVEventSubscriber`` (SUB with gap and restart handling over the replay socket) and
``KVBlockIndex`` (which source holds which block; longest prefix per source).
Torch-free; needs pyzmq and msgspec.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import msgspec
import zmq

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVBlockIndex", "KVEventPublisher",
           "KVEventRecorder", "KVEventSubscriber", "MEDIUM_DEVICE", "block_hashes", "decode_batch",
           "offset_endpoint", "page_hash"]

logger = logging.getLogger("radixlm.kv_events")
MEDIUM_DEVICE = "GPU"  # vLLM's name for the device KV pool (its CPU backend reports it too)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message
_ROOT = bytes(8)  # the parent of a first page, in the hash


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """One published payload -> ``EventBatch``. msgspec.DecodeError on anything else."""
    return _decoder.decode(payload)


# ----------------------------------------------------------------------------- hashing
def page_hash(parent: int | None, tokens: Sequence[int] | array) -> int:
    """The block hash of one page: the first 8 bytes (big-endian, unsigned) of
    SHA-256(parent's hash as 8 bytes big-endian, or 8 zero bytes at the root || the page's
    token ids as 4-byte little-endian unsigned ints). ValueError for ids outside [0, 2**32)."""
    packed = tokens.tobytes() if isinstance(tokens, array) and tokens.typecode == "I" else _pack(tokens)
    head = _ROOT if parent is None else parent.to_bytes(8, "big")
    return int.from_bytes(hashlib.sha256(head + packed).digest()[:8], "big")


def _pack(tokens: Sequence[int]) -> bytes:
    try:
        out = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if out.itemsize != 4 or array("I", [1]).tobytes() != b"\x01\x00\x00\x00":  # pragma: no cover
        raise RuntimeError("page_hash needs 4-byte little-endian unsigned ints")
    return out.tobytes()


def block_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """The hashes of the whole pages of ``tokens`` (a trailing partial page has none), as the
    server publishes them for the same tokens."""
    packed = array("I", tokens) if not isinstance(tokens, array) else tokens
    out: list[int] = []
    parent = None
    for start in range(0, len(packed) - page_size + 1, page_size):
        parent = page_hash(parent, packed[start : start + page_size])
        out.append(parent)
    return out


# ----------------------------------------------------------------------------- producer side
class KVEventRecorder:
    """Turns the prefix cache's page movements into events (scheduler/prefix_cache.py calls
    it). It remembers the hash of every device page the tree holds (page id -> hash), so a
    removal needs only page ids. Not thread-safe: the scheduler thread owns it."""

    def __init__(self, page_size: int, medium: str = MEDIUM_DEVICE) -> None:
        self.page_size = page_size
        self.medium = medium
        self._hash: dict[int, int] = {}
        self._events: list[Event] = []

    def stored(self, tokens: Sequence[int] | array, pages: Sequence[int]) -> None:
        """The tree now holds ``pages`` (page ids, in path order from the root) for the first
        ``len(pages)`` pages of ``tokens``. Pages it had not announced yet (new, or loaded
        back from a lower tier) become ``BlockStored`` events, one per run of them."""
        size = self.page_size
        parent: int | None = None
        run: list[int] = []
        run_start, run_parent = 0, None
        for i, page in enumerate(pages):
            h = self._hash.get(page)
            if h is None:
                h = self._hash[page] = page_hash(parent, tokens[i * size : (i + 1) * size])
                if not run:
                    run_start, run_parent = i, parent
                run.append(h)
            elif run:
                self._store_run(tokens, run, run_start, run_parent)
                run = []
            parent = h
        if run:
            self._store_run(tokens, run, run_start, run_parent)

    def _store_run(self, tokens: Sequence[int] | array, run: list[int], start: int, parent: int | None) -> None:
        size = self.page_size
        ids = tokens[start * size : (start + len(run)) * size]
        self._events.append(BlockStored(block_hashes=run, parent_block_hash=parent, block_size=size,
                                        token_ids=ids.tolist() if isinstance(ids, array) else list(ids),
                                        lora_id=None, medium=self.medium, lora_name=None))

    def removed(self, pages: Sequence[int]) -> None:
        """``pages`` left the device pool's tree (evicted): a ``BlockRemoved`` of their hashes."""
        hashes = [self._hash.pop(page) for page in pages if page in self._hash]
        if hashes:
            self._events.append(BlockRemoved(block_hashes=hashes, medium=self.medium))

    def cleared(self) -> None:
        """The tree was emptied (flush): ``AllBlocksCleared``."""
        self._hash.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[Event]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def held_hashes(self) -> set[int]:
        """The hashes of every page announced and not removed (for checks)."""
        return set(self._hash.values())


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Replica ``data_parallel_rank``'s endpoint: a tcp port + rank, an ipc path + ``_dp<rank>``
    (as vLLM's ``offset_endpoint_port``)."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


class KVEventPublisher:
    """Publishes event batches on a PUB socket (``endpoint``) and keeps the last
    ``buffer_batches`` for the replay ROUTER socket (``replay_endpoint``, optional). An
    endpoint with ``*`` or an ipc:// path is bound, else connected (vLLM's rule). Binding
    happens here, so a taken port raises ``zmq.ZMQError`` at start-up; sending and replay
    run on a daemon thread. The first batch (seq 0) is an ``AllBlocksCleared``."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 data_parallel_rank: int = 0, buffer_batches: int = 10_000, hwm: int = 100_000) -> None:
        self.endpoint = offset_endpoint(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(replay_endpoint, data_parallel_rank) if replay_endpoint else None
        self.rank = data_parallel_rank
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            _bind_or_connect(self._pub, self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
        self._seq = 0
        self.publish([AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, name="radixlm-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        """Queue one batch (stamped now, with this publisher's rank); returns at once."""
        self._queue.put(EventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank))

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                batch = False
            if batch is None:
                return
            if batch is not False:
                self._send(batch)
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()

    def _send(self, batch: EventBatch) -> None:
        payload = _encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # at the high-water mark: subscribers catch up through the replay
            logger.warning("KV event batch %d dropped at the high-water mark", seq)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("malformed KV event replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _bind_or_connect(sock: zmq.Socket, endpoint: str) -> None:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


# ----------------------------------------------------------------------------- consumer side
class KVEventSubscriber:
    """Follows one publisher on a daemon thread and hands every batch to
    ``on_batch(batch)`` once, in sequence order.

    With a ``replay_endpoint`` it first asks for everything still buffered (from seq 0), and
    again from the first missing seq whenever a gap shows (a batch lost at a high-water
    mark, a slow start). A seq already applied but with other contents means the server
    restarted (numbering from 0 again): the subscriber follows it from its start, whose
    ``AllBlocksCleared`` resets the consumer's view. Without replay, gaps are counted in
    ``missed``. ``close()`` stops the thread (within ~0.1 s)."""

    REPLAY_TIMEOUT_S = 2.0
    REMEMBER = 4096  # (seq, payload digest) of the last batches applied: duplicates vs a restart

    def __init__(self, endpoint: str, on_batch: Callable[[EventBatch], None], replay_endpoint: str | None = None,
                 topic: str = "") -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.on_batch = on_batch
        self.next_seq = 0  # the next batch to apply
        self.received = 0  # batches applied
        self.missed = 0  # batches skipped without replay
        self.restarts = 0  # times the publisher was seen starting over
        self._applied: dict[int, bytes] = {}  # seq -> _stamp(payload), the last REMEMBER applied
        self._topic = topic.encode()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="radixlm-kv-subscriber", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self.endpoint)
        try:
            if self.replay_endpoint:
                self._replay(0)
            while not self._stop.is_set():
                if sub.poll(100):
                    self._on_message(sub.recv_multipart())
        except Exception:  # a consumer must not die silently
            logger.exception("KV event subscriber of %s failed", self.endpoint)
        finally:
            sub.close(linger=0)
            self._ctx.term()

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            logger.warning("malformed KV event message (%d frames) from %s", len(frames), self.endpoint)
            return
        seq = int.from_bytes(frames[1], "big")
        if seq < self.next_seq:
            if self._applied.get(seq) == _stamp(frames[2]):
                return  # applied already (through a replay)
            self._restarted()  # a lower number with other contents: a new publisher
        if seq > self.next_seq and self.replay_endpoint:
            self._replay(self.next_seq)
            if seq < self.next_seq:
                return
        if seq > self.next_seq:
            self.missed += seq - self.next_seq
        self._apply(seq, frames[2])

    def _restarted(self) -> None:
        """The publisher restarted (its numbering began again): follow it from its start.
        Without replay its first batch (``AllBlocksCleared``) may be lost: one is made up."""
        logger.info("KV event publisher %s restarted", self.endpoint)
        self.next_seq = 0
        self._applied.clear()
        self.restarts += 1
        if not self.replay_endpoint:
            self.on_batch(EventBatch(ts=time.time(), events=[AllBlocksCleared()]))

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            logger.warning("undecodable KV event batch %d from %s: %s", seq, self.endpoint, exc)
        else:
            self.on_batch(batch)
            self.received += 1
        self._applied[seq] = _stamp(payload)
        if len(self._applied) > self.REMEMBER:
            del self._applied[next(iter(self._applied))]
        self.next_seq = seq + 1

    def _replay(self, start: int) -> bool:
        """Ask for the buffered batches from ``start``; apply those not seen. False when the
        publisher did not answer in time."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.REPLAY_TIMEOUT_S
            while time.monotonic() < deadline and not self._stop.is_set():
                if not dealer.poll(50):
                    continue
                frames = dealer.recv_multipart()
                if len(frames) != 3 or frames[1] == END_SEQ:
                    return True
                seq = int.from_bytes(frames[1], "big")
                if seq >= self.next_seq:
                    if seq > self.next_seq:
                        self.missed += seq - self.next_seq  # older than the buffer
                    self._apply(seq, frames[2])
            return False
        finally:
            dealer.close(linger=0)


def _stamp(payload: bytes) -> bytes:
    """What tells two batches of one seq apart (a restarted publisher reuses the numbers)."""
    return hashlib.blake2b(payload, digest_size=8).digest()


class KVBlockIndex:
    """Which sources hold which blocks, built from event batches; thread-safe (the
    subscribers' threads write, the router reads).

    A source is any hashable key (e.g. ``(replica_id, data_parallel_rank)``); ``group(source)``
    maps it to the unit a match is reported for (default: the source itself), so a block
    held by any data parallel rank of a replica counts for the replica."""

    def __init__(self, group: Callable[[Hashable], Hashable] = lambda source: source) -> None:
        self._group = group
        self._holders: dict[int, set[Hashable]] = {}  # block hash -> sources
        self._held: dict[Hashable, set[int]] = {}  # source -> block hashes
        self._lock = threading.Lock()

    def apply(self, source: Hashable, batch: EventBatch) -> None:
        """Apply one batch published by ``source``."""
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    held = self._held.setdefault(source, set())
                    for h in event.block_hashes:
                        self._holders.setdefault(h, set()).add(source)
                        held.add(h)
                elif isinstance(event, BlockRemoved):
                    held = self._held.get(source, set())
                    for h in event.block_hashes:
                        self._forget(source, h)
                        held.discard(h)
                else:
                    self._drop_locked(source)

    def drop(self, source: Hashable) -> None:
        """Forget every block of ``source`` (its server is gone)."""
        with self._lock:
            self._drop_locked(source)

    def _drop_locked(self, source: Hashable) -> None:
        for h in self._held.pop(source, ()):
            self._forget(source, h)

    def _forget(self, source: Hashable, h: int) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(source)
            if not holders:
                del self._holders[h]

    def num_blocks(self, source: Hashable) -> int:
        with self._lock:
            return len(self._held.get(source, ()))

    def group_blocks(self, group: Hashable) -> int:
        """Distinct blocks held by the sources of ``group``."""
        with self._lock:
            held = [h for s, h in self._held.items() if self._group(s) == group]
        return len(set().union(*held)) if len(held) > 1 else len(held[0]) if held else 0

    def groups_of(self, h: int) -> set[Hashable]:
        """The groups holding block ``h``."""
        with self._lock:
            return {self._group(s) for s in self._holders.get(h, ())}

    def held(self, source: Hashable) -> set[int]:
        """A copy of the block hashes ``source`` holds."""
        with self._lock:
            return set(self._held.get(source, ()))

    def sources(self) -> list[Hashable]:
        with self._lock:
            return [s for s, held in self._held.items() if held]

    def match(self, hashes: Sequence[int]) -> dict[Hashable, int]:
        """Per group: how many of ``hashes`` (a prompt's ``block_hashes``, in order) it
        holds from the first one on without a break. Groups that hold none are absent."""
        matched: dict[Hashable, int] = {}
        alive: set[Hashable] | None = None
        with self._lock:
            for i, h in enumerate(hashes):
                holders = self._holders.get(h)
                if not holders:
                    break
                groups = {self._group(s) for s in holders}
                alive = groups if alive is None else alive & groups
                if not alive:
                    break
                for g in alive:
                    matched[g] = i + 1
        return matched

