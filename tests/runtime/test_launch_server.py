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


def test_a_tp_size_the_model_cannot_split_is_refused_before_any_process_starts(tmp_path) -> None:
    """SmolLM2's shape (9 heads, 3 KV heads, MLP 1536): 3 splits, 2 (heads) and 9 (MLP
    width) do not; 12 heads and 8 KV heads do not split by 6 (KV heads); each named with
    the flag."""
    import json

    from radixlm.runtime.launch_server import launch_server, tp_shape_problem
    from radixlm.runtime.server_args import ServerArgs

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}))

    def problem(tp: int) -> str | None:
        return tp_shape_problem(ServerArgs(model_path=str(tmp_path), tp_size=tp, device="cpu"))

    assert problem(1) is None and problem(3) is None
    assert problem(2) == f"--tp-size 2: tensor parallel size 2 does not divide the attention heads (9) of {tmp_path}"
    assert "does not divide the MLP width (1536)" in problem(9)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 8}))
    assert "does not divide the KV heads (8)" in problem(6)
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}))
    assert launch_server(ServerArgs(model_path=str(tmp_path), tp_size=2, device="cpu")) == 2
