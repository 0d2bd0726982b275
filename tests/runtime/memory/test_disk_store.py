"""The disk tier (L4): page files written, found again after a restart, and every damaged,
foreign or half-written file turned into a miss and removed rather than read."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from radixlm.runtime.memory import disk_store
from radixlm.runtime.memory.disk_store import ROOT_KEY, DiskStore, PageHeader, page_key

IDENTITY = "ab12" * 8
PAGE = 4  # tokens per page
PAYLOAD = 4096


def make_store(tmp_path: Path, identity: str = IDENTITY, **kw) -> DiskStore:
    kw.setdefault("capacity_bytes", 1 << 30)
    return DiskStore(tmp_path / "cache", identity, PAGE, PAYLOAD, **kw)


def chain(n: int, seed: int = 0) -> list[PageHeader]:
    """n pages of one sequence: each page's parent is the page before."""
    rng = random.Random(seed)
    headers, parent = [], ROOT_KEY
    for _ in range(n):
        tokens = tuple(rng.randrange(1 << 32) for _ in range(PAGE))
        key = page_key(parent, tokens)
        headers.append(PageHeader(key, parent, tokens))
        parent = key
    return headers


def payload_of(header: PageHeader) -> bytes:
    """A payload that differs per page (and is not all zeros)."""
    return (header.key * (PAYLOAD // 16 + 1))[:PAYLOAD]


def write_all(store: DiskStore, headers: list[PageHeader]) -> None:
    futs = [store.submit_write(h, lambda h=h: payload_of(h)) for h in headers]
    assert [f.result(timeout=10) for f in futs] == [True] * len(headers)


def read(store: DiskStore, key: bytes) -> bytes | None:
    out = bytearray(PAYLOAD)
    return bytes(out) if store.submit_read(key, out).result(timeout=10) else None


def temp_files(store: DiskStore) -> list[Path]:
    return list(store.root.rglob("*.tmp"))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path)
    yield s
    s.close()


# -- keys ---------------------------------------------------------------------------------


def test_page_key_is_a_deterministic_chain():
    tokens = (1, 2, 3, 0xFFFFFFFF)
    want = hashlib.blake2b(ROOT_KEY + struct.pack("<4I", *tokens), digest_size=16).digest()
    assert page_key(ROOT_KEY, tokens) == page_key(ROOT_KEY, list(tokens)) == want
    assert len(want) == 16 and ROOT_KEY == bytes(16)
    assert chain(3) == chain(3)  # same prefix, same keys
    a, b = chain(2, seed=0), chain(2, seed=1)
    assert a[0].key != b[0].key
    # The same tokens after another parent give another key: the key names the whole prefix.
    assert page_key(a[0].key, a[1].tokens) != page_key(b[0].key, a[1].tokens)
    with pytest.raises(ValueError):
        page_key(b"short", tokens)
    with pytest.raises(ValueError):
        page_key(ROOT_KEY, (-1,))


# -- arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "identity, kw",
    [
        ("a" * 65, {}),  # longer than the 64-byte header field
        ("not-hex", {}),
        ("", {}),
        (IDENTITY, {"capacity_bytes": 100}),  # less than one page
        (IDENTITY, {"read_threads": 0}),
    ],
)
def test_bad_arguments_raise(tmp_path, identity, kw):
    with pytest.raises(ValueError):
        make_store(tmp_path, identity, **kw)


def test_sizes_and_layout(store):
    header_bytes = 6 + 64 + 16 + 16 + 4 + 4 * PAGE + 8
    assert store.file_bytes == header_bytes + PAYLOAD + 4
    assert store.capacity_pages == (1 << 30) // store.file_bytes
    (h,) = chain(1)
    write_all(store, [h])
    path = store.root / h.key.hex()[:2] / f"{h.key.hex()}.kvpage"
    assert store.path(h.key) == path and path.stat().st_size == store.file_bytes
    assert store.root == store.root.parent / IDENTITY


def test_malformed_header_is_refused(store):
    (h,) = chain(1)
    with pytest.raises(ValueError):
        store.submit_write(PageHeader(bytes(16), h.parent, h.tokens), lambda: payload_of(h))
    with pytest.raises(ValueError):
        store.submit_write(PageHeader(h.key, h.parent, h.tokens[:-1]), lambda: payload_of(h))


# -- round trip and restart ---------------------------------------------------------------


def test_write_read_round_trip_is_bitwise(store):
    headers = chain(3)
    write_all(store, headers)
    rng = random.Random(7)
    odd = PageHeader(page_key(ROOT_KEY, (9,) * PAGE), ROOT_KEY, (9,) * PAGE)
    odd_payload = rng.randbytes(PAYLOAD)
    assert store.submit_write(odd, lambda: memoryview(odd_payload)).result(timeout=10)

    for h in headers:
        assert read(store, h.key) == payload_of(h)
    into_view = memoryview(bytearray(PAYLOAD))
    assert store.submit_read(odd.key, into_view).result(timeout=10)
    assert bytes(into_view) == odd_payload
    got = []
    assert store.submit_read(headers[0].key, got.append).result(timeout=10)
    assert bytes(got[0]) == payload_of(headers[0]) and got[0].readonly

    assert (store.pages_written, store.bytes_written) == (4, 4 * store.file_bytes)
    assert (store.pages_read, store.bytes_read) == (5, 5 * store.file_bytes)
    assert store.read_misses == store.corrupt_pages == store.write_failures == 0
    assert temp_files(store) == []


def test_index_after_restart_finds_the_pages(tmp_path):
    headers = chain(5)
    with make_store(tmp_path) as first:
        write_all(first, headers)
    second = make_store(tmp_path)
    try:
        assert sorted(second.index(), key=lambda h: h.key) == sorted(headers, key=lambda h: h.key)
        assert read(second, headers[-1].key) == payload_of(headers[-1])
        # Another identity in the same directory sees none of them.
        with make_store(tmp_path, identity="cd34") as other:
            assert other.index() == []
            assert read(other, headers[0].key) is None
    finally:
        second.close()


def test_missing_page_is_a_miss(store):
    (h,) = chain(1)
    assert read(store, h.key) is None
    assert store.read_misses == 1 and store.corrupt_pages == 0


def test_bad_out_buffer_is_a_miss_not_an_exception(store):
    (h,) = chain(1)
    write_all(store, [h])
    assert not store.submit_read(h.key, bytearray(PAYLOAD - 1)).result(timeout=10)
    assert not store.submit_read(h.key, memoryview(bytes(PAYLOAD))).result(timeout=10)
    assert store.path(h.key).exists()  # the page is fine, the caller's buffer was not


# -- damaged and foreign files ------------------------------------------------------------


def flip_payload_byte(store: DiskStore, h: PageHeader, _other: PageHeader) -> None:
    path = store.path(h.key)
    data = bytearray(path.read_bytes())
    data[store.header_bytes + 100] ^= 0x01
    path.write_bytes(data)


def truncate(store: DiskStore, h: PageHeader, _other: PageHeader) -> None:
    path = store.path(h.key)
    path.write_bytes(path.read_bytes()[: store.file_bytes // 2])


def bad_magic(store: DiskStore, h: PageHeader, _other: PageHeader) -> None:
    path = store.path(h.key)
    path.write_bytes(b"XXXXX" + path.read_bytes()[5:])


def foreign_identity(store: DiskStore, h: PageHeader, _other: PageHeader) -> None:
    """The same page written by another model's store, copied in under the right name."""
    with DiskStore(store.root.parent, "ffff", PAGE, PAYLOAD, 1 << 30) as foreign:
        write_all(foreign, [h])
        shutil.copyfile(foreign.path(h.key), store.path(h.key))


def name_not_key(store: DiskStore, h: PageHeader, other: PageHeader) -> None:
    """A valid page file of ``other`` stored under ``h``'s name."""
    store.path(h.key).parent.mkdir(exist_ok=True)
    shutil.copyfile(store.path(other.key), store.path(h.key))


def tokens_not_key(store: DiskStore, h: PageHeader, _other: PageHeader) -> None:
    """A header whose tokens do not hash to its key, with a valid checksum."""
    path = store.path(h.key)
    data = bytearray(path.read_bytes()[:-4])
    data[6 + 64 + 32 + 4] ^= 0x01  # the first token
    path.write_bytes(data + struct.pack("<I", zlib.crc32(data)))


HEADER_DAMAGE = [truncate, bad_magic, foreign_identity, name_not_key, tokens_not_key]


@pytest.mark.parametrize("damage", [flip_payload_byte, *HEADER_DAMAGE])
def test_damaged_page_is_a_miss_and_removed(store, damage, caplog):
    h, other = chain(2)
    write_all(store, [h, other])
    damage(store, h, other)
    with caplog.at_level(logging.WARNING, logger="radixlm.disk_store"):
        assert read(store, h.key) is None
    assert not store.path(h.key).exists()
    assert store.corrupt_pages == 1 and store.read_misses == 1
    assert any("removing" in r.getMessage() for r in caplog.records)
    assert [x.key for x in store.index()] == [other.key]
    assert read(store, other.key) == payload_of(other)  # its neighbour is untouched


@pytest.mark.parametrize("damage", HEADER_DAMAGE)
def test_index_removes_damaged_page(tmp_path, damage, caplog):
    h, other = chain(2)
    with make_store(tmp_path) as first:
        write_all(first, [h, other])
        damage(first, h, other)
    with make_store(tmp_path) as store, caplog.at_level(logging.WARNING, "radixlm.disk_store"):
        assert [x.key for x in store.index()] == [other.key]
        assert not store.path(h.key).exists()
        assert any(str(store.path(h.key)) in r.getMessage() for r in caplog.records)


def test_index_removes_leftover_temp_files(tmp_path):
    """A writer killed mid-write leaves a partial temp file; the next start-up removes it,
    but not the temp file of a live process still writing."""
    (h,) = chain(1)
    with make_store(tmp_path) as first:
        write_all(first, [h])
        folder = first.path(h.key).parent
        partial = first.path(h.key).read_bytes()[:1000]
    dead = folder / f"{h.key.hex()}.{dead_pid()}.0badcafe.tmp"
    unnamed = folder / "junk.tmp"
    live = folder / f"{h.key.hex()}.{os.getppid()}.0badcafe.tmp"  # our parent is alive
    for p in (dead, unnamed, live):
        p.write_bytes(partial)
    with make_store(tmp_path) as store:
        assert [x.key for x in store.index()] == [h.key]
        assert not dead.exists() and not unnamed.exists()
        assert live.exists()
        old = time.time() - disk_store.STALE_TEMP_S - 60  # unless it is too old to be live
        os.utime(live, (old, old))
        store.index()
        assert not live.exists()


# -- write failures -----------------------------------------------------------------------


@pytest.mark.parametrize("size", [PAYLOAD - 1, PAYLOAD + 1, 0])
def test_wrong_payload_length_fails_the_write_only(store, size):
    h, nxt = chain(2)
    assert store.submit_write(h, lambda: bytes(size)).result(timeout=10) is False
    assert not store.path(h.key).exists() and temp_files(store) == []
    assert store.write_failures == 1 and not store.writes_disabled
    write_all(store, [nxt])  # later writes go on


def test_raising_payload_fails_the_write_only(store):
    h, nxt = chain(2)

    def boom() -> bytes:
        raise RuntimeError("device copy failed")

    assert store.submit_write(h, boom).result(timeout=10) is False
    assert not store.writes_disabled
    write_all(store, [nxt])


class _FullDisk:
    """A file that takes ``room`` bytes, then fails like a full disk."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if data.nbytes > self._room:
            self._f.write(data[: self._room])
            self._f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= data.nbytes
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def fail_in_write(monkeypatch):
    monkeypatch.setattr(disk_store, "open", lambda p, m: _FullDisk(open(p, m), 1000), raising=False)


def fail_in_replace(monkeypatch):
    def replace(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_store.os, "replace", replace)


@pytest.mark.parametrize("fail", [fail_in_write, fail_in_replace])
def test_disk_full_disables_writes_and_reads_go_on(store, monkeypatch, caplog, fail):
    old, h, later = chain(3)
    write_all(store, [old])
    fail(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="radixlm.disk_store"):
        assert store.submit_write(h, lambda: payload_of(h)).result(timeout=10) is False
        monkeypatch.undo()  # the disk has room again: writes stay off all the same
        called = []
        fut = store.submit_write(later, lambda: called.append(1) or payload_of(later))
        assert fut.result(timeout=10) is False and called == []
    assert store.writes_disabled and store.write_failures == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left" in errors[0].getMessage()
    assert temp_files(store) == []
    assert not store.path(h.key).exists() and not store.path(later.key).exists()
    assert read(store, old.key) == payload_of(old)  # reads still work
    store.delete([old.key])  # and deletes
    store.drain(timeout=10)
    assert not store.path(old.key).exists()


# -- deletes, concurrency, drain ----------------------------------------------------------


def test_delete_runs_in_order_with_writes(store):
    a, b, c = chain(3)
    write_all(store, [a, b])
    store.delete([a.key, c.key])  # c never written: ignored
    store.submit_write(c, lambda: payload_of(c))
    store.delete([c.key])
    store.submit_write(c, lambda: payload_of(c))  # written again after its delete
    store.drain(timeout=10)
    assert not store.path(a.key).exists()
    assert store.path(b.key).exists() and store.path(c.key).exists()
    assert {h.key for h in store.index()} == {b.key, c.key}
    assert read(store, a.key) is None


def test_concurrent_reads_of_many_keys(tmp_path):
    headers = chain(64, seed=3)
    with make_store(tmp_path, read_threads=4) as store:
        write_all(store, headers)
        outs = [bytearray(PAYLOAD) for _ in headers]
        futs = [store.submit_read(h.key, out) for h, out in zip(headers, outs, strict=True)]
        store.drain(timeout=10)
        assert all(f.result() for f in futs)
        assert all(out == payload_of(h) for h, out in zip(headers, outs, strict=True))
        assert store.pages_read == 64 and store.read_misses == 0


def test_drain_times_out_while_a_write_blocks(store):
    (h,) = chain(1)
    release = threading.Event()

    def slow_payload() -> bytes:
        release.wait(10)
        return payload_of(h)

    fut = store.submit_write(h, slow_payload)
    with pytest.raises(TimeoutError):
        store.drain(timeout=0.05)
    release.set()
    store.drain(timeout=10)
    assert fut.result() is True


def _files(store) -> list:
    return [p for p in store.root.rglob("*") if p.is_file()]


def test_measure_read_bandwidth_reads_page_files_as_a_prefetch_does(store, tmp_path, monkeypatch):
    """The measurement reads page files of distinct keys through the reader threads with
    every check (a valid page each: the real read succeeds), under temp-file names that
    another process's index leaves alone; it leaves no file behind and no count in the
    store's read counters."""
    seen = []
    read = store._read

    def spy(key, out, path=None):
        seen.append((key, path.name, sorted(p.name for p in _files(store)), other.index()))
        return read(key, out, path)

    other = make_store(tmp_path)
    other._token = "0" * 8
    monkeypatch.setattr(store, "_read", spy)
    with monkeypatch.context() as m:  # ``other`` indexes as another live process (ours is its peer)
        m.setattr(disk_store.os, "getpid", os.getppid)
        bps = store.measure_read_bandwidth(4)
    assert bps > 0
    assert len({key for key, *_ in seen}) == 4
    for _, name, present, indexed in seen:
        assert name.startswith("bandwidth-") and name.endswith(store._temp_tag)
        assert len(present) == 4 and indexed == []  # the other index took and removed nothing
    assert _files(store) == []
    assert (store.pages_read, store.bytes_read, store.read_misses) == (0, 0, 0)
    with pytest.raises(ValueError):
        store.measure_read_bandwidth(0)
    other.close()


def test_measure_read_bandwidth_raises_when_a_page_does_not_read_back(store, monkeypatch):
    """One read fails: every read still ends before the files are removed (no read of a
    vanished file), then OSError; the counters keep no trace of the good reads."""
    read, calls = store._read, []

    def flaky(key, out, path=None):
        calls.append(path.exists())
        return False if len(calls) == 1 else read(key, out, path)

    monkeypatch.setattr(store, "_read", flaky)
    with pytest.raises(OSError, match="did not read back"):
        store.measure_read_bandwidth(3)
    assert calls == [True, True, True]
    assert _files(store) == []
    assert (store.pages_read, store.bytes_read) == (0, 0)


# -- a writer killed for real -------------------------------------------------------------

CHILD = """
import os, sys, threading
from radixlm.runtime.memory.disk_store import ROOT_KEY, DiskStore, PageHeader, page_key
directory, identity, page, payload = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = DiskStore(directory, identity, page, payload, 1 << 34)
in_flight = threading.Semaphore(4)  # keep the writer thread busy writing, the queue short

def done(fut):
    if not fut.result():
        os._exit(1)  # the parent's readline sees the end of the pipe
    print("written", flush=True)
    in_flight.release()

parent, i = ROOT_KEY, 0
while True:
    tokens = tuple(range(i * page, (i + 1) * page))
    key = page_key(parent, tokens)
    in_flight.acquire()
    body = lambda key=key: (key * (payload // 16 + 1))[:payload]
    store.submit_write(PageHeader(key, parent, tokens), body).add_done_callback(done)
    parent, i = key, i + 1
"""


def test_writer_killed_with_sigkill_leaves_only_complete_pages(tmp_path):
    big = 1 << 20  # large pages, so the kill likely lands inside a write
    directory = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), IDENTITY, str(PAGE), str(big)],
        stdout=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(30, proc.kill)  # a hung child ends the readline below
    watchdog.start()
    try:
        confirmed = 0
        while confirmed < 5:
            assert proc.stdout.readline(), "child died"
            confirmed += 1
        time.sleep(0.01)  # let it start the next writes
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL

    with DiskStore(directory, IDENTITY, PAGE, big, 1 << 34) as store:
        headers = store.index()
        assert len(headers) >= confirmed
        assert temp_files(store) == []
        out = bytearray(big)
        for h in headers:
            assert store.submit_read(h.key, out).result(timeout=10)
            assert out == (h.key * (big // 16 + 1))[:big]
        # The pages form one chain from the root: every confirmed write is there.
        by_parent = {h.parent: h for h in headers}
        parent = ROOT_KEY
        for _ in headers:
            parent = by_parent[parent].key
