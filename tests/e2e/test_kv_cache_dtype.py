"""The server with an FP8 KV cache (SmolLM2, CPU): calibrated at start-up, answers, reuses
FP8 prefix pages through the radix cache with the same tokens, logs its capacity; and
refuses to start with an unusable scales file."""

from __future__ import annotations

import json

import pytest

PROMPT = "List three facts about the Moon. " * 8  # ~64 tokens
# SmolLM2's first answer token to the bare "What is the capital of France?" is a near-tie in
# a float32 cache ("The" 25.37 vs "L" 25.25), so any KV quantisation may flip it (it did, to
# "L'Étoile, la Cité, ...", for rotated fp8 / int4 / mixed caches, and "Which city is ..."
# (margin 0.09) flips for unrotated ones); this wording has a 1.49 margin.
QUESTION = "What is the capital of France? Answer in one sentence."


def _model_itemsize(log: str) -> int:
    """Bytes per element of the model dtype the server logged ('auto': float32 on the CPU,
    bfloat16 on CUDA)."""
    for name, size in (("torch.float32", 4), ("torch.bfloat16", 2), ("torch.float16", 2)):
        if f"model {name}" in log:
            return size
    raise AssertionError("the KV pool line names no model dtype")


def _twice_and_chat(srv):
    """The same greedy /generate twice (the second reuses the first's pages), then a chat."""
    with srv.client() as c:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        first = c.post("/generate", json=body).json()
        second = c.post("/generate", json=body).json()
        model = c.get("/v1/models").json()["data"][0]["id"]
        chat = c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 16, "temperature": 0}).json()  # fmt: skip
    return first, second, chat


def test_fp8_server_answers_and_shares_fp8_prefix_pages(server_factory, idle_invariants):
    with server_factory(kv_cache_dtype="fp8_e4m3", max_total_tokens=4096, log_level="info") as srv:
        first, second, chat = _twice_and_chat(srv)
        n = first["meta_info"]["prompt_tokens"]
        assert second["meta_info"]["cached_tokens"] == (n - 1) // 16 * 16
        assert second["output_ids"] == first["output_ids"] and len(first["output_ids"]) == 12
        assert "Paris" in chat["choices"][0]["message"]["content"]
        idle_invariants(srv)
        log = srv.log()
    assert "FP8 KV scales and channel means calibrated on 1627 tokens" in log
    assert "keys rotated: hadamard" in log
    # 4096 tokens x 30 layers x 3 kv heads x 64 x 2 (K, V) x 1 byte + the dummy page
    # + 720 B of scales + 46,080 B of channel means (30 x 3 x 64 x 2 x float32)
    # + 2,949,120 B of exact sink slots (64 x 30 x 3 x 64 x 2 x float32)
    # + the key rotation (R and R / D, 64 x 64 each in the model dtype: float32 on the CPU,
    # bfloat16 on CUDA)
    rotation = 2 * 64 * 64 * _model_itemsize(log)
    metadata = 720 + 46_080 + 2_949_120 + rotation
    assert f"4096 tokens, {47_370_240 + metadata} bytes" in log
    assert f"{metadata} bytes of metadata" in log
    assert "exact attention sink, 64 slots" in log


@pytest.mark.slow
def test_server_refuses_to_start_with_unusable_scales(server_factory, tmp_path):
    path = tmp_path / "scales.json"
    path.write_text(
        json.dumps({"format": "radixlm-kv-scales-v1", "k_scale": [[1.0]], "v_scale": [[1.0]]})
    )
    with pytest.raises(RuntimeError, match="k_scale must be 30 lists of 3 numbers") as failed:
        with server_factory(
            kv_cache_dtype="fp8_e4m3", kv_scales_path=str(path), max_total_tokens=4096
        ):
            pass
    assert "Traceback" not in str(failed.value)  # the user's file: the message, not a stack


@pytest.mark.slow
def test_mixed_server_answers_reuses_pages_and_logs_its_capacity(server_factory, idle_invariants):
    """mixed (time-decay INT4): answers, the radix cache serves the prompt's pages (some
    demoted to INT4 by then), and the start-up log gives tokens, bytes and the bf16 ratio."""
    with server_factory(kv_cache_dtype="mixed", max_total_tokens=4096, log_level="info") as srv:
        first, second, chat = _twice_and_chat(srv)
        n = first["meta_info"]["prompt_tokens"]
        assert second["meta_info"]["cached_tokens"] == (n - 1) // 16 * 16
        assert len(first["output_ids"]) == len(second["output_ids"]) == 12
        assert "Paris" in chat["choices"][0]["message"]["content"]
        idle_invariants(srv)
        log = srv.log()
    # 257 pages x 120960 B of INT4 pages + statistics, 257 FP8 slot pages (the pool is
    # small: every page may keep one) + 720 B of scales + 46,080 B of channel means
    # + 4 B per page of slot map + the key rotation (as above)
    rotation = 2 * 64 * 64 * _model_itemsize(log)
    assert f"4096 tokens, {78_504_788 + rotation} bytes" in log
    assert "7560 bytes/token = 0.328 of bf16" in log
    assert "257 FP8 slot pages" in log


def test_int4_server_refuses_swap_preemption(server_factory):
    with pytest.raises(RuntimeError, match="--preemption-mode swap is not supported with --kv-cache-dtype int4"):
        with server_factory(kv_cache_dtype="int4", preemption_mode="swap", max_total_tokens=4096):
            pass
