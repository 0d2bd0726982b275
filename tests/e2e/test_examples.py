"""The examples run end to end against a real server (the shared ``server`` fixture)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_multiturn.py"
TURN_LINE = re.compile(r"^conv (\d+) turn (\d+) prompt_tokens=(\d+) cached_tokens=(\d+) ttft=")


def test_sharegpt_multiturn_replays_and_reuses_the_history(server, idle_invariants):
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--url",
        server.url,
        "--num-conversations",
        "2",
        "--max-turns",
        "2",
        "--max-tokens",
        "8",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    turns = [
        tuple(map(int, m.groups())) for m in map(TURN_LINE.match, proc.stdout.splitlines()) if m
    ]
    assert sorted((conv, turn) for conv, turn, _, _ in turns) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for _, turn, prompt, cached in turns:
        assert 0 <= cached < prompt
        if turn == 2:  # the whole of turn 1 is a prefix of turn 2
            assert cached > 0, proc.stdout
    assert "summary: 2 conversations, 4 turns, 0 failed; prefix-cache hit rate" in proc.stdout
    idle_invariants(server)
