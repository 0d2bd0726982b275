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


AGENT = EXAMPLE.parent / "agent_tools.py"
AGENT_LINE = re.compile(r"^conv (\d+) turn (\d+) tool_choice=(\w+) prompt_tokens=(\d+) cached_tokens=(\d+) (call|answer)=")


def test_agent_tools_runs_its_tool_loop_and_reuses_the_history(server, idle_invariants):
    """examples/agent_tools.py in its short mode: each conversation's first turn calls a
    tool (under "required"), the tool result goes back, and every later turn finds more of
    the conversation in the cache than the turn before."""
    cmd = [sys.executable, str(AGENT), "--url", server.url, "--num-conversations", "2", "--questions", "1",
           "--max-steps", "2", "--max-tokens", "56", "--max-answer-tokens", "12"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    turns = [m.groups() for m in map(AGENT_LINE.match, proc.stdout.splitlines()) if m]
    by_conv: dict[str, list[tuple]] = {}
    for conv, turn, choice, prompt, cached, kind in turns:
        by_conv.setdefault(conv, []).append((int(turn), choice, int(prompt), int(cached), kind))
    assert sorted(by_conv) == ["0", "1"], proc.stdout
    for conv_turns in by_conv.values():
        assert [(t, c, k) for t, c, _, _, k in conv_turns] == [(1, "required", "call"), (2, "none", "answer")]
        (_, _, p1, c1, _), (_, _, p2, c2, _) = conv_turns
        assert 0 <= c1 < p1 < p2 and c1 < c2 < p2, proc.stdout
        assert c2 >= p1 // 16 * 16  # the whole first prompt's pages came from the cache
    assert "summary: 2 conversations, 4 turns, 2 tool calls" in proc.stdout
    idle_invariants(server)
