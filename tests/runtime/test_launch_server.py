"""The launcher's account of dead model processes (``launch_server._dead``)."""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.launch_server import _dead


@dataclass
class _Proc:
    name: str
    pid: int
    exitcode: int | None

    def is_alive(self) -> bool:
        return self.exitcode is None


def test_all_running_is_none() -> None:
    assert _dead([_Proc("radixlm-scheduler", 1, None), _Proc("radixlm-tp1", 2, None)]) is None


def test_the_killed_rank_is_named_first_not_the_peer_that_failed_after_it() -> None:
    """SIGKILL of rank 2 makes rank 1's all-reduce fail (exit 1) within the watchdog's
    0.5 s: the reason names rank 2 first, and rank 1 too."""
    procs = [_Proc("radixlm-scheduler", 1, None), _Proc("radixlm-tp1", 2, 1), _Proc("radixlm-tp2", 3, -9)]
    assert _dead(procs) == "radixlm-tp2 (pid 3) exited with code -9; radixlm-tp1 (pid 2) exited with code 1"


def test_one_dead_process() -> None:
    assert _dead([_Proc("radixlm-scheduler-dp1", 7, -9)]) == "radixlm-scheduler-dp1 (pid 7) exited with code -9"
