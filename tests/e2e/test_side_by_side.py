"""bench/serving/side_by_side.py end to end on the CPU: radixlm and a ``--radixlm-variant``
on random weights of the tiny shape (the SmolLM2 tokenizer), two short workloads, then
``report``. vLLM is not installed here; its GPU run is recorded in BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "serving" / "side_by_side.py"


@pytest.mark.slow
def test_side_by_side_runs_variants_and_reports(tmp_path: Path, smollm2_dir: str) -> None:
    from radixlm.runtime.bench.sharegpt import write_subset

    data = tmp_path / "sharegpt.jsonl"
    write_subset(data, 200)
    out = tmp_path / "out"
    run = [sys.executable, str(SCRIPT), "run", "--engines", "radixlm",
           "--radixlm-variant", "fcfs=--schedule-policy fcfs", "--workloads", "batch1", "sweep",
           "--shape", "tiny", "--tokenizer-dir", smollm2_dir, "--dataset-path", str(data),
           "--sweep-num-prompts", "4", "--sweep-rates", "50", "--models-root", str(tmp_path / "models"),
           "--radixlm-args", "--device cpu --max-total-tokens 8192", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "GPU_E2E_DEVICE": "cpu"}
    subprocess.run(run, cwd=REPO, env=env, check=True, timeout=900)

    info = json.loads((out / "engines.json").read_text())
    assert set(info) == {"host", "radixlm", "radixlm:fcfs"}
    for engine in ("radixlm", "radixlm:fcfs"):
        rec = info[engine]
        assert rec["errors"] == {} and rec["exit_code"] == 0, rec
        assert rec["start_cold_s"] > 0 and rec["start_warm_s"] > 0
        assert rec["compiled"] == {"start-cold": 0, "batch1": 0, "sweep": 0, "start-warm": 0}  # no GPU: no cubins
    records = [json.loads(line) for line in (out / "side_by_side.jsonl").read_text().splitlines()]
    tags = sorted(r["tag"] for r in records)
    assert tags == ["radixlm/batch1", "radixlm/sweep", "radixlm:fcfs/batch1", "radixlm:fcfs/sweep"]
    for r in records:
        assert r["failed"] == 0 and r["completed"] == (3 if r["tag"].endswith("batch1") else 4), r
        assert r["server"]["name"] == "radixlm"
    assert "--schedule-policy fcfs" in (out / "radixlm-fcfs_server.log").read_text()
    assert "--schedule-policy" not in (out / "radixlm_server.log").read_text()

    report = subprocess.run([sys.executable, str(SCRIPT), "report", "--out", str(out), "--plot", str(out / "s.png")],
                            cwd=REPO, check=True, timeout=120, capture_output=True, text=True).stdout
    header = report.splitlines()[0]
    assert header == "| metric | radixlm | radixlm:fcfs | radixlm / vLLM | radixlm:fcfs / vLLM |"
    assert "| batch1 rate inf: completed | 3 | 3 | n/a | n/a |" in report
    assert "| binaries compiled during batch1 | 0 | 0 | n/a | n/a |" in report
    assert (out / "s.png").stat().st_size > 10_000
