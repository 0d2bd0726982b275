"""The DSL examples run end to end against the frontend tests' server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CALL = re.compile(r"^(calculate|answer): (.*) prompt_tokens=(\d+) cached_tokens=(\d+)$")
BRANCH = re.compile(r"^branch (\d): (.*) prompt_tokens=(\d+) cached_tokens=(\d+) judge_score=(-?[\d.]+)$")


def _run(name: str, url: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), "--url", url], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_tool_agent_calculates_and_reuses_the_conversation(dsl_server):
    out = _run("dsl_tool_agent.py", dsl_server.url)
    calls = [CALL.match(line).groups() for line in out.splitlines() if CALL.match(line)]
    calculations = [text for kind, text, _, _ in calls if kind == "calculate"]
    assert calculations[0] == "'37 * 41' -> 1517", out  # regex-constrained: the expression alone
    assert all(re.fullmatch(r"'[0-9+\-*/(). ]+' -> -?[\d.e+]+", c) for c in calculations), out
    assert [kind for kind, *_ in calls].count("answer") == 3, out  # one per question
    prompts = [int(p) for *_, p, _ in calls]
    assert prompts == sorted(prompts)  # one growing conversation
    assert all(int(cached) >= 16 for *_, cached in calls[1:]), out  # the history is reused


def test_json_extraction_outputs_validate(dsl_server):
    out = _run("dsl_json_extraction.py", dsl_server.url)
    assert "summary: 3/3 valid" in out, out
    assert "valid {'name': 'Maria Lopez', 'age': 34, 'city': 'Madrid'}" in out


def test_branch_and_judge_picks_one_candidate(dsl_server):
    out = _run("dsl_branch_and_judge.py", dsl_server.url)
    branches = [BRANCH.match(line).groups() for line in out.splitlines() if BRANCH.match(line)]
    assert [b[0] for b in branches] == ["0", "1", "2", "3"], out
    assert all(int(cached) > 0 for *_, cached, _ in branches), out  # the fork's shared prefix
    best = re.search(r"^best: (.*)$", out, re.M).group(1)
    assert best in [b[1] for b in branches], out
