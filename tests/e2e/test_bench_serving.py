"""``radixlm bench serving`` against the real SmolLM2 server: one tiny run per backend
and dataset; the JSONL records must be complete and consistent with what was asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import radixlm
from radixlm.runtime.cli import main


def _run(srv, tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "records.jsonl"
    before = len(out.read_text().splitlines()) if out.exists() else 0
    main(["bench", "serving", "--base-url", srv.url, "--disable-tqdm", "--output-file", str(out),
          *flags])
    lines = out.read_text().splitlines()
    assert len(lines) == before + 1
    return json.loads(lines[-1])


def _check_common(rec: dict, completed: int) -> None:
    assert rec["completed"] == completed and rec["failed"] == 0
    assert rec["duration_s"] > 0
    assert rec["output_throughput"] == pytest.approx(rec["total_output_tokens"] / rec["duration_s"])
    assert 0 < rec["median_ttft_ms"] <= rec["p99_ttft_ms"]
    assert rec["p99_ttft_ms"] <= rec["p99_e2e_latency_ms"]
    assert rec["mean_itl_ms"] > 0 and rec["mean_tpot_ms"] > 0
    assert 1 <= rec["max_concurrency_reached"] <= completed
    assert rec["kv_usage_max"] is None or 0 <= rec["kv_usage_max"] <= 1


def test_bench_serving_native_openai_chat_and_multiturn(server, tmp_path: Path,
                                                        idle_invariants) -> None:
    # native /generate, random token ids, fixed lengths with ignore_eos
    rec = _run(server, tmp_path, "--backend", "radixlm", "--dataset-name", "random",
               "--num-prompts", "6", "--random-input-len", "32", "--random-output-len", "8",
               "--random-range-ratio", "1.0", "--plot-dir", str(tmp_path / "plots"))
    _check_common(rec, 6)
    assert (rec["total_input_tokens"], rec["total_output_tokens"]) == (6 * 32, 6 * 8)
    assert rec["ignore_eos"] and rec["request_rate"] is None
    assert (tmp_path / "plots" / "radixlm_random_rateinf.png").exists()
    assert rec["server"] == {"name": "radixlm", "version": radixlm.__version__}
    assert rec["cache_flushed"] is None and rec["base_url"] == server.url
    assert rec["model_path"].endswith(".gguf")  # the info's model_path: the default model's file

    # /v1/completions, generated shared prefix: 2 groups x 4, Poisson arrivals, cap 3
    rec = _run(server, tmp_path, "--backend", "openai", "--dataset-name",
               "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group",
               "4", "--gsp-system-prompt-len", "64", "--gsp-question-len", "8",
               "--gsp-output-len", "4", "--request-rate", "20", "--max-concurrency", "3",
               "--flush-cache")
    _check_common(rec, 8)
    assert (rec["total_input_tokens"], rec["total_output_tokens"]) == (8 * 72, 8 * 4)
    assert rec["max_concurrency_reached"] <= 3 and rec["request_rate"] == 20
    assert rec["cache_flushed"] is True  # POST /flush_cache
    best = 3 * 64 / (4 * 72)  # every prompt but the first of its group reuses the system prompt
    assert 0 < rec["prefix_cache_hit_rate"] <= best + 1e-9

    # /v1/chat/completions, ShareGPT prompts, fixed output length
    rec = _run(server, tmp_path, "--backend", "openai-chat", "--dataset-name", "sharegpt",
               "--num-prompts", "3", "--sharegpt-output-len", "8")
    _check_common(rec, 3)
    assert rec["total_output_tokens"] == 24 and rec["total_input_tokens"] > 3 * 4

    # multi-turn: turn 2 re-sends turn 1 and its reply, so it hits the cache
    rec = _run(server, tmp_path, "--backend", "radixlm", "--dataset-name", "sharegpt-multiturn",
               "--num-prompts", "2", "--multiturn-max-turns", "2", "--multiturn-output-len", "6",
               "--multiturn-think-time", "0", "--flush-cache")
    assert 3 <= rec["completed"] <= 4 and rec["failed"] == 0  # a conversation may have 1 turn
    assert rec["total_output_tokens"] == 6 * rec["completed"]
    assert rec["prefix_cache_hit_rate"] > 0
    idle_invariants(server)
