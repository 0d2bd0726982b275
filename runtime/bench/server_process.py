"""Run ``radixlm launch_server`` as a child process: for examples, benchmarks and tests.

    with ServerProcess.launch(["--page-size", "16"], log=f) as srv:
        httpx.get(f"{srv.url}/health")
        code = srv.stop()   # SIGTERM: drains in-flight requests, exit status 0

The child runs in its own session (process group), so ``stop`` reaches the scheduler
too when SIGTERM is not enough. Only the standard library is used here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

__all__ = ["ServerProcess", "free_port"]

STARTUP_TIMEOUT_S = 900.0  # the first-ever start converts the GGUF checkpoint
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    """A currently free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str

    @classmethod
    @contextlib.contextmanager
    def launch(cls, flags: list[str], log: IO[str] | None = None,
               startup_timeout: float = STARTUP_TIMEOUT_S) -> Iterator[ServerProcess]:
        """Start a server on a free loopback port with ``flags``, wait until /health is
        200 (RuntimeError with the exit code if it dies or times out), stop it on exit.
        No ``--host`` is added: the server's default bind address (127.0.0.1) applies
        unless ``flags`` set one."""
        port = free_port()
        cmd = [sys.executable, "-m", "radixlm.runtime.launch_server", *flags, "--port", str(port)]
        out = log if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        server = cls(proc, f"http://127.0.0.1:{port}")
        try:
            server.wait_healthy(startup_timeout)
            yield server
        finally:
            server.stop()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} during start-up")
            if self.healthy():
                return
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM the server (it drains requests and stops its scheduler) and wait; kill
        the whole process group if it does not exit in time. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # nothing of the group may outlive it
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode
