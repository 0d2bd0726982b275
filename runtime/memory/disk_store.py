"""The disk tier (L4) of the KV cache: one file per KV page, found again after a restart.
Torch-free (stdlib only).

A page is keyed by a hash chain over token ids, ``key = page_key(parent_key, tokens)`` from
``ROOT_KEY``, so the same prefix of the same model gets the same keys in every process. A
page file lives at ``directory/<identity>/<key.hex()[:2]>/<key.hex()>.kvpage``::

    magic b"RLXKV", version u8, identity 64s (ASCII hex, zero-padded), key 16s, parent 16s,
    page_size u32, tokens page_size x u32, payload length u64      (the header, little-endian)
    payload                                                         (payload_bytes)
    crc32 u32 of header + payload                                   (the trailer)

CRC-32 rather than blake2b: on a 2 MiB payload ``zlib.crc32`` runs at ~4.2 GB/s against
~0.94 GB/s for ``blake2b(digest_size=16)`` (one core, CPython 3.11); it guards against torn
or rotted files, not against tampering (the cache folder is trusted).

Writes go to a temp file in the page's folder and are renamed onto the final name
(``os.replace``, atomic), so a reader never sees half a page. There is no fsync: after a
power loss a page may be torn, which the checksum catches on read (a miss).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KEY_BYTES", "ROOT_KEY", "DiskStore", "PageHeader", "page_key"]

logger = logging.getLogger("radixlm.disk_store")

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)
MAGIC = b"RLXKV"
VERSION = 1
IDENTITY_BYTES = 64
PAGE_SUFFIX = ".kvpage"
TEMP_SUFFIX = ".tmp"
# A temp file of another live process is left alone by index() until it is this old (s): a
# page write takes milliseconds, so an older one is a leftover whose pid was reused.
STALE_TEMP_S = 600.0
_TRAILER = struct.Struct("<I")
_HEX = frozenset("0123456789abcdefABCDEF")


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key (16 bytes) of the page holding ``tokens`` after the page keyed ``parent``
    (``ROOT_KEY`` for a sequence's first page): ``blake2b(parent + tokens as little-endian
    uint32, digest_size=16)``. ValueError: a parent not 16 bytes long, a token outside
    uint32."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    try:
        packed = struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be uint32: {e}") from None
    return hashlib.blake2b(parent + packed, digest_size=KEY_BYTES).digest()


@dataclass(frozen=True, slots=True)
class PageHeader:
    """What identifies one page: its key, its parent's key, and its ``page_size`` tokens."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


class _BadPage(Exception):
    """A page file that fails a check; the message is the reason logged."""


class DiskStore:
    """KV pages as files under ``directory/<identity>/`` (see the module docstring).

    ``identity``: a hex string (at most 64 characters) naming the model and KV format; the
    caller derives it. Pages of another identity live in another folder and are never read
    (the header repeats the identity, which is checked). ``page_size``: tokens per page.
    ``payload_bytes``: the KV bytes of one page. ``capacity_bytes``: the quota; the store
    does not enforce it, the caller (which owns the L4 index and its eviction order) keeps
    at most ``capacity_pages`` pages and ``delete``s to make room. ValueError on an argument
    out of range or a capacity below one page; OSError if the folder cannot be made or written.

    Threads: one writer (writes and deletes run in submission order) and ``read_threads``
    readers. Methods may be called from any thread; the counters (plain ints, read without
    a lock) are ``pages_written``, ``bytes_written`` (file bytes), ``pages_read``,
    ``bytes_read`` (file bytes of verified reads), ``read_misses`` (reads returning False),
    ``corrupt_pages`` (reads failing verification), ``write_failures``.
    """

    def __init__(
        self,
        directory: str | Path,
        identity: str,
        page_size: int,
        payload_bytes: int,
        capacity_bytes: int,
        read_threads: int = 2,
    ) -> None:
        if not identity or len(identity) > IDENTITY_BYTES or not set(identity) <= _HEX:
            raise ValueError(f"identity must be 1..{IDENTITY_BYTES} hex digits, got {identity!r}")
        if page_size < 1 or payload_bytes < 1 or read_threads < 1:
            raise ValueError(
                f"page_size ({page_size}), payload_bytes ({payload_bytes}) and read_threads "
                f"({read_threads}) must be >= 1"
            )
        self.identity = identity
        self.page_size = page_size
        self.payload_bytes = payload_bytes
        self._identity_field = identity.encode("ascii").ljust(IDENTITY_BYTES, b"\0")
        self._header = struct.Struct(f"<5sB{IDENTITY_BYTES}s{KEY_BYTES}s{KEY_BYTES}sI{page_size}IQ")
        self.header_bytes = self._header.size
        self.file_bytes = self.header_bytes + payload_bytes + _TRAILER.size
        self.capacity_pages = capacity_bytes // self.file_bytes
        if self.capacity_pages < 1:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} holds no page of {self.file_bytes} bytes"
            )
        self.root = Path(directory) / identity
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=self.root):  # OSError now, not at the first write
            pass
        # Temp files are named <key>.<pid>.<token>.tmp: index() tells ours, a live
        # process's and a dead writer's apart (the token also covers a reused pid).
        self._token = secrets.token_hex(4)
        self._temp_tag = f".{os.getpid()}.{self._token}{TEMP_SUFFIX}"

        self.writes_disabled = False
        self.pages_written = self.bytes_written = self.write_failures = 0
        self.pages_read = self.bytes_read = self.read_misses = self.corrupt_pages = 0
        self._count_lock = threading.Lock()  # several threads bump the counters
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="disk-store-write")
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="disk-store-read")
        self._closed = False

    # -- paths and header ---------------------------------------------------------------

    def path(self, key: bytes) -> Path:
        """The file of page ``key``."""
        name = key.hex()
        return self.root / name[:2] / (name + PAGE_SUFFIX)

    def _pack_header(self, h: PageHeader) -> bytes:
        return self._header.pack(
            MAGIC,
            VERSION,
            self._identity_field,
            h.key,
            h.parent,
            self.page_size,
            *h.tokens,
            self.payload_bytes,
        )

    def _unpack_header(self, raw: bytes | memoryview, key: bytes | None) -> PageHeader:
        """The header in ``raw`` (at least header_bytes long), checked against this store and
        against ``key`` when given; _BadPage with the reason otherwise."""
        magic, version, ident, hkey, parent, page_size, *rest = self._header.unpack_from(raw)
        tokens, length = tuple(rest[:-1]), rest[-1]
        if magic != MAGIC or version != VERSION:
            raise _BadPage(f"bad magic/version {magic!r}/{version}")
        if ident != self._identity_field:
            foreign = ident.rstrip(b"\0").decode("ascii", "replace")
            raise _BadPage(f"foreign identity {foreign!r}")
        if page_size != self.page_size or length != self.payload_bytes:
            raise _BadPage(
                f"page_size/payload length {page_size}/{length}, expected "
                f"{self.page_size}/{self.payload_bytes}"
            )
        if hkey != page_key(parent, tokens):
            raise _BadPage("key is not page_key(parent, tokens)")
        if key is not None and hkey != key:
            raise _BadPage(f"header key {hkey.hex()} is not the file's name")
        return PageHeader(hkey, parent, tokens)

    # -- start-up scan ------------------------------------------------------------------

    def index(self) -> list[PageHeader]:
        """Scan this identity's folder (at start-up, before submitting writes) and return the
        headers of the valid pages, in no particular order. Removes, logging each with its
        reason: temp files of writers that died mid-write, and page files whose size or
        header is wrong (truncated, foreign identity, bad magic/version, key not equal to
        ``page_key(parent, tokens)``, name not equal to the key). Reads headers only; a
        rotted payload is caught by ``submit_read``. Other files are left alone."""
        kept: list[PageHeader] = []
        now = time.time()
        for sub in [self.root, *(p for p in self.root.iterdir() if p.is_dir())]:
            for entry in os.scandir(sub):
                if not entry.is_file(follow_symlinks=False):
                    continue
                if entry.name.endswith(TEMP_SUFFIX):
                    if self._temp_is_stale(entry, now):
                        self._remove(Path(entry.path), "leftover temp file of a killed writer")
                elif sub != self.root and entry.name.endswith(PAGE_SUFFIX):
                    header = self._check_index_entry(Path(entry.path))
                    if header is not None:
                        kept.append(header)
        return kept

    def _check_index_entry(self, path: Path) -> PageHeader | None:
        try:
            bytes.fromhex(path.name.removesuffix(PAGE_SUFFIX))
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != self.file_bytes:
                    raise _BadPage(f"size {size} bytes, expected {self.file_bytes}")
                raw = f.read(self.header_bytes)
                if len(raw) != self.header_bytes:
                    raise _BadPage("truncated while reading")
                header = self._unpack_header(raw, None)
            if path != self.path(header.key):
                raise _BadPage(f"name does not match key {header.key.hex()}")
        except _BadPage as e:
            self._remove(path, str(e))
            return None
        except ValueError:  # bytes.fromhex: not a hex name
            self._remove(path, "name is not a key")
            return None
        except OSError as e:  # vanished meanwhile, unreadable: skip it
            logger.warning("disk store: skipping %s: %s", path, e)
            return None
        return header

    def _temp_is_stale(self, entry: os.DirEntry, now: float) -> bool:
        """A temp file is left alone while its writer may still be writing: this store's, or
        another live process's and younger than STALE_TEMP_S."""
        parts = entry.name.split(".")  # <key>.<pid>.<token>.tmp
        if len(parts) != 4 or not parts[1].isdigit():
            return True
        pid, token = int(parts[1]), parts[2]
        if token == self._token:
            return False
        if pid == os.getpid():  # a previous run with our pid (containers reuse pids)
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # PermissionError: alive, another user's
            pass
        try:
            return now - entry.stat().st_mtime > STALE_TEMP_S
        except OSError:
            return False

    def _remove(self, path: Path, reason: str) -> None:
        logger.warning("disk store: removing %s: %s", path, reason)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("disk store: cannot remove %s: %s", path, e)

    # -- writes and deletes (one writer thread, in submission order) --------------------

    def submit_write(
        self, header: PageHeader, payload: Callable[[], bytes | bytearray | memoryview]
    ) -> Future[bool]:
        """Write page ``header`` in the background; the future's result is True once the
        file is in place, False on any failure (it never holds an exception). ``payload()``
        is called on the writer thread (it may block, e.g. on a device->host copy) and must
        return a C-contiguous buffer of exactly ``payload_bytes`` bytes, else the write
        fails. On an OSError (ENOSPC, permissions, ...) the temp file is removed, the error
        is logged once and ``writes_disabled`` is set: this and every later write return
        False without calling ``payload`` (reads and deletes go on). ValueError (raised
        here) on a malformed header: a key not 16 bytes or not ``page_key(parent, tokens)``,
        or not ``page_size`` tokens."""
        if len(header.tokens) != self.page_size:
            raise ValueError(f"a page holds {self.page_size} tokens, got {len(header.tokens)}")
        if len(header.key) != KEY_BYTES or header.key != page_key(header.parent, header.tokens):
            raise ValueError("header.key is not page_key(header.parent, header.tokens)")
        if self.writes_disabled:
            self._count("write_failures")
            done: Future[bool] = Future()
            done.set_result(False)
            return done
        return self._track(self._writer.submit(self._write, header, payload))

    def _write(self, header: PageHeader, payload: Callable[[], object]) -> bool:
        if self.writes_disabled:
            self._count("write_failures")
            return False
        path = self.path(header.key)
        try:
            data = memoryview(payload()).cast("B")
            if data.nbytes != self.payload_bytes:
                raise ValueError(f"payload is {data.nbytes} bytes, expected {self.payload_bytes}")
            self._write_file(path, header, data)
        except Exception as e:
            self._count("write_failures")
            if isinstance(e, OSError):
                self.writes_disabled = True
                hint = " (disk full)" if e.errno == errno.ENOSPC else ""
                logger.error(
                    "disk store: writing %s failed%s: %s; disk writes disabled", path, hint, e
                )
            else:  # the payload callable failed or returned the wrong size: this page only
                logger.error("disk store: page %s not written: %r", header.key.hex(), e)
            return False
        self._count("pages_written", "bytes_written")
        return True

    def _write_file(self, path: Path, header: PageHeader, data: memoryview) -> None:
        """Write one page file: header, payload, CRC trailer into a temp file renamed to
        ``path``. On any error the temp file is removed and the error raised."""
        tmp = path.with_name(f"{path.stem}{self._temp_tag}")
        try:
            path.parent.mkdir(exist_ok=True)
            self._write_frame(tmp, header, data, sync=False)
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise

    def _write_frame(self, path: Path, header: PageHeader, data: memoryview, sync: bool) -> None:
        """Header, payload and CRC trailer into the file ``path`` (fsynced if ``sync``)."""
        head = self._pack_header(header)
        trailer = _TRAILER.pack(zlib.crc32(data, zlib.crc32(head)))
        with open(path, "wb") as f:
            f.write(head)
            f.write(data)
            f.write(trailer)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def delete(self, keys: Iterable[bytes]) -> None:
        """Remove the files of ``keys`` on the writer thread, after the writes submitted
        before; missing files are ignored, other OSErrors logged."""
        self._track(self._writer.submit(self._delete, list(keys)))

    def _delete(self, keys: list[bytes]) -> None:
        for key in keys:
            try:
                self.path(key).unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("disk store: cannot delete page %s: %s", key.hex(), e)

    # -- reads --------------------------------------------------------------------------

    def submit_read(
        self, key: bytes, out: memoryview | bytearray | Callable[[memoryview], object]
    ) -> Future[bool]:
        """Read and verify page ``key`` on a reader thread (size, magic, version, identity,
        key, CRC of header + payload). ``out``: a writable C-contiguous buffer of
        ``payload_bytes`` the payload is read straight into, or a callable given a read-only
        memoryview of the payload (a fresh buffer per read, safe to keep). The future's
        result is True on success; a missing, truncated, corrupt or foreign page is a miss:
        a warning with the reason, the file removed, result False (never an exception). On a
        miss a buffer ``out`` may hold partial data. A read of a key whose write is still
        queued sees the file as it is on disk (wait for the write's future first)."""
        return self._track(self._readers.submit(self._read, key, out))

    def _read(
        self, key: bytes, out: memoryview | bytearray | Callable[[memoryview], object],
        path: Path | None = None,
    ) -> bool:
        path = self.path(key) if path is None else path
        head = bytearray(self.header_bytes)
        tail = bytearray(_TRAILER.size)
        if callable(out):
            body = memoryview(bytearray(self.payload_bytes))
        else:
            try:
                body = memoryview(out).cast("B")
            except TypeError:  # not C-contiguous
                body = memoryview(b"")
            if body.readonly or body.nbytes != self.payload_bytes:
                logger.error(
                    "disk store: page %s not read: out is not a writable contiguous buffer "
                    "of %s bytes",
                    key.hex(),
                    self.payload_bytes,
                )
                self._count("read_misses")
                return False
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                try:
                    if st.st_size != self.file_bytes:
                        raise _BadPage(f"size {st.st_size} bytes, expected {self.file_bytes}")
                    for buf in (head, body, tail):
                        _read_exact(f, buf)
                    self._unpack_header(head, key)
                    crc = zlib.crc32(body, zlib.crc32(head))
                    if _TRAILER.unpack(tail)[0] != crc:
                        raise _BadPage("checksum mismatch")
                except _BadPage as e:
                    self._remove_if_same(path, st, str(e))
                    self._count("read_misses", "corrupt_pages")
                    return False
        except FileNotFoundError:
            logger.warning("disk store: page %s missing", key.hex())
            self._count("read_misses")
            return False
        except OSError as e:
            logger.warning("disk store: cannot read %s: %s", path, e)
            self._count("read_misses")
            return False
        if callable(out):
            try:
                out(body.toreadonly())
            except Exception:
                logger.exception("disk store: read callback of page %s failed", key.hex())
                self._count("read_misses")
                return False
        self._count("pages_read", "bytes_read")
        return True

    def _count(self, *counters: str) -> None:
        """Bump ``counters``: a ``bytes_*`` one by file_bytes, the others by 1."""
        with self._count_lock:
            for name in counters:
                step = self.file_bytes if name.startswith("bytes_") else 1
                setattr(self, name, getattr(self, name) + step)

    def _remove_if_same(self, path: Path, st: os.stat_result, reason: str) -> None:
        """Remove the bad file just read unless a write has meanwhile replaced it."""
        try:
            now = os.stat(path)
        except OSError:
            return
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            self._remove(path, reason)

    # -- lifetime -----------------------------------------------------------------------

    def _track(self, fut: Future) -> Future:
        with self._pending_lock:
            self._pending.add(fut)
        fut.add_done_callback(self._untrack)
        return fut

    def _untrack(self, fut: Future) -> None:
        with self._pending_lock:
            self._pending.discard(fut)

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every write, delete and read submitted so far. TimeoutError if they are
        not all done after ``timeout`` seconds (None: no limit)."""
        with self._pending_lock:
            pending = list(self._pending)
        _, not_done = wait_futures(pending, timeout)
        if not_done:
            raise TimeoutError(f"disk store: {len(not_done)} operations still running")

    def close(self) -> None:
        """Drain, then stop the threads; later submits raise RuntimeError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.drain()
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calibration --------------------------------------------------------------------

    def measure_read_bandwidth(self, pages: int = 16) -> float:
        """Payload bytes/s of reading ``pages`` page files the way a prefetch does. The files
        are written in this store's format (random payloads; keys chained from a random
        root), under temp-file names of this process (which ``index`` of another process
        sharing the folder leaves alone, and no index takes for pages), fsynced and dropped
        from the page cache where the OS allows (``posix_fadvise(POSIX_FADV_DONTNEED)``;
        elsewhere this measures cached reads); then all are read at once by the reader
        threads, with every check (size, header, CRC), each into a buffer of its own, and
        removed. The per-file costs (open, header, checksum, the hand-off to a reader
        thread) count, as in a prefetch, so a store of small pages measures slower than one
        large sequential read would. The read counters are left as they were.
        ValueError if ``pages`` < 1; OSError from the disk, or if a page does not read back."""
        if pages < 1:
            raise ValueError(f"pages must be >= 1, got {pages}")
        parent, files = os.urandom(KEY_BYTES), []
        for i in range(pages):
            tokens = tuple(range(i * self.page_size, (i + 1) * self.page_size))
            header = PageHeader(page_key(parent, tokens), parent, tokens)
            files.append((header, self.root / f"bandwidth-{i}{self._temp_tag}"))
            parent = header.key
        try:
            for header, path in files:
                self._write_frame(path, header, memoryview(os.urandom(self.payload_bytes)), sync=True)
                if hasattr(os, "posix_fadvise"):
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
            bufs = [bytearray(self.payload_bytes) for _ in files]
            start = time.perf_counter()
            reads = [self._track(self._readers.submit(self._read, h.key, buf, path))
                     for (h, path), buf in zip(files, bufs, strict=True)]
            ok = [f.result() for f in reads]  # every read ends before the files go
            elapsed = time.perf_counter() - start
            with self._count_lock:  # the counters count real pages only
                self.pages_read -= sum(ok)
                self.bytes_read -= sum(ok) * self.file_bytes
            if not all(ok):
                raise OSError(f"disk store: the bandwidth measurement's pages did not read back in {self.root}")
        finally:
            for _, path in files:
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
        return pages * self.payload_bytes / max(elapsed, 1e-9)

def _read_exact(f, buf: bytearray | memoryview) -> None:
    """Fill ``buf`` from the raw file ``f``; _BadPage if the file ends first."""
    view = memoryview(buf).cast("B")
    got = 0
    while got < view.nbytes:
        n = f.readinto(view[got:])
        if not n:
            raise _BadPage(f"truncated after {got} of {view.nbytes} bytes")
        got += n
