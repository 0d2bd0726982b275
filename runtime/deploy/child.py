"""The server process of a Ray Serve replica: ``launch_server`` that cannot outlive its replica.

    python -m radixlm.runtime.deploy.child PARENT_PID <launch_server flags>

A replica starts this in a new session (process group). A thread checks every 0.5 s that
the process's parent is still ``PARENT_PID``; when the replica is gone (killed by Ray, its
node's raylet, a crash: nothing ran its clean-up) the whole group, launcher and model
processes, is killed with SIGKILL, so no server is left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from radixlm.runtime.launch_server import main as launch_main

__all__ = ["main"]

CHECK_INTERVAL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(CHECK_INTERVAL_S)
        if os.getppid() != parent_pid:
            os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].isdigit():
        sys.exit("usage: python -m radixlm.runtime.deploy.child PARENT_PID [launch_server flags]")
    threading.Thread(target=_watch_parent, args=(int(argv[0]),), name="parent-watch", daemon=True).start()
    launch_main(argv[1:])


if __name__ == "__main__":
    main()
