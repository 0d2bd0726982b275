"""One ZeroMQ socket wrapper for every direction (PUSH/PULL over ipc://).

The scheduler uses the blocking methods; the tokenizer process uses ``arecv`` (asyncio,
through zmq.asyncio). Each socket carries only messages of runtime.messages.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

import zmq
import zmq.asyncio

from radixlm.runtime import messages

__all__ = ["MsgSocket", "new_ipc_address"]


def new_ipc_address(name: str) -> str:
    """A fresh ipc:// endpoint in the temp directory (unique per call)."""
    path = os.path.join(tempfile.gettempdir(), f"radixlm-{name}-{uuid.uuid4().hex[:12]}")
    return f"ipc://{path}"


class MsgSocket:
    """A PUSH or PULL socket sending/receiving typed messages.

    ``bind=True`` binds the address, else connects. ``asyncio=True`` makes ``arecv``
    usable (zmq.asyncio context); the blocking ``recv`` is for plain threads.
    """

    def __init__(self, kind: int, address: str, bind: bool, asyncio: bool = False) -> None:
        self._ctx = zmq.asyncio.Context() if asyncio else zmq.Context()
        self.sock = self._ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self.sock.bind(address)
        else:
            self.sock.connect(address)
        self.address = address

    def send(self, msg: messages.Message) -> None:
        self.sock.send(messages.encode(msg), copy=False)

    def try_send(self, msg: messages.Message) -> bool:
        """Send without blocking; False (nothing sent) if ZeroMQ cannot queue it now (a
        PUSH whose peer is gone or not reading: its queue is full)."""
        try:
            self.sock.send(messages.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def listen(self, address: str) -> None:
        """Also bind ``address`` (a PULL that takes messages from its first endpoint and from
        the PUSH sockets connected here, fair-queued)."""
        self.sock.bind(address)

    def recv(self, timeout_ms: int | None = None, spin_s: float = 0.0) -> messages.Message | None:
        """Blocking receive; None if nothing arrived within ``timeout_ms`` (0 = poll).
        ``spin_s``: first poll without blocking for up to this many seconds, then block for
        ``timeout_ms``. A message that arrives while spinning is taken at once; one that
        arrives while blocked waits for ZeroMQ to wake the thread (one GenerateReq of 4096
        ids between two processes: 0.21-0.26 ms against 0.39-0.40 ms, CPU box, 2026-12-05)."""
        if timeout_ms is not None:
            ready = False
            if spin_s > 0:
                end = time.perf_counter() + spin_s
                while not (ready := bool(self.sock.poll(0, zmq.POLLIN))) and time.perf_counter() < end:
                    pass
            if not ready and not self.sock.poll(timeout_ms, zmq.POLLIN):
                return None
        return messages.decode(self.sock.recv(copy=False).bytes)

    def recv_all(self) -> list[messages.Message]:
        """Every message already waiting, without blocking."""
        out = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out.append(messages.decode(data.bytes))

    async def arecv(self) -> messages.Message:
        data = await self.sock.recv()
        return messages.decode(data)

    def asend_nowait(self, msg: messages.Message) -> None:
        """Send from asyncio code (PUSH never blocks while the peer keeps up)."""
        self.sock.send(messages.encode(msg))

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()
