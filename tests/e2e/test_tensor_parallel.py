"""Tensor parallelism end to end on the CPU (gloo): a server with ``--tp-size`` against the
same weights served whole, in float32: greedy tokens identical, logprobs within 1e-4,
the same ``cached_tokens``; the OpenAI client and the DSL unchanged against a TP server.

Fast tier: TP 2 on a tiny random Llama (3 processes). Slow tier: TP 2 on a tiny Qwen2 (q/k/v
biases), TP 3 on the real SmolLM2-135M (9 query heads, 3 KV heads: one KV head per rank).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from radixlm.frontend import RuntimeEndpoint, function, gen
from radixlm.runtime.engine import LocalServer
from radixlm.runtime.server_args import ServerArgs

NEW_TOKENS = 16
TOL = 1e-4


def _prompts(vocab: int, n: int = 3, length: int = 40) -> list[list[int]]:
    rng = random.Random(0)
    return [rng.choices(range(3, vocab), k=length) for _ in range(n)]


def _body(ids: list[int]) -> dict:
    # prompt logprobs from position 32: the radix cache may serve the two pages before it
    return {"input_ids": ids, "return_logprob": True, "logprob_start_len": 32,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}


def _served(post, prompts: list[list[int]]) -> list[dict]:
    """Each prompt twice (the second from the radix cache): per request its tokens,
    output / prompt logprobs and cached_tokens."""
    out = []
    for ids in prompts + prompts:
        meta = post(_body(ids))["meta_info"]
        out.append({"tokens": [t[1] for t in meta["output_token_logprobs"]],
                    "logprobs": [t[0] for t in meta["output_token_logprobs"]],
                    "prompt_logprobs": [t[0] for t in meta["input_token_logprobs"][1:]],
                    "cached": meta["cached_tokens"]})
    return out


def _reference(model_dir: str, tokenizer: str, prompts: list[list[int]]) -> list[dict]:
    args = ServerArgs(model_path=model_dir, tokenizer_path=tokenizer, device="cpu", dtype="float32",
                      weight_dtype="model", max_total_tokens=4096, max_running_requests=4, log_level="warning")
    with LocalServer(args) as local:
        return _served(lambda body: local.post("/generate", body), prompts)


def _assert_same(tp: list[dict], ref: list[dict]) -> None:
    for got, want in zip(tp, ref, strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["cached"] == want["cached"]
        for key in ("logprobs", "prompt_logprobs"):
            assert len(got[key]) == len(want[key])
            assert max(abs(a - b) for a, b in zip(got[key], want[key], strict=True)) < TOL, key
    assert [r["cached"] for r in tp] == [0, 0, 0, 16, 16, 16]  # the match stops before logprob_start_len


def _tp_post(srv):
    client = srv.client()
    return lambda body: client.post("/generate", json=body).raise_for_status().json()


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tp2_server(server_factory, tiny_llama, smollm2_dir) -> Iterator:
    with server_factory(model_path=tiny_llama, tokenizer_path=smollm2_dir, tp_size=2, dtype="float32",
                        max_total_tokens=4096, max_running_requests=4) as srv:
        yield srv


def test_tp2_llama_matches_tp1(tp2_server, tiny_llama, smollm2_dir, idle_invariants) -> None:
    prompts = _prompts(256)
    _assert_same(_served(_tp_post(tp2_server), prompts), _reference(tiny_llama, smollm2_dir, prompts))
    idle_invariants(tp2_server)


def test_tp2_serves_the_openai_client_and_concurrent_requests(tp2_server, idle_invariants) -> None:
    """Token prompts through the official client (the tiny model's vocabulary is 256
    ids), several at once: each the same as alone."""
    client = openai.OpenAI(base_url=f"{tp2_server.url}/v1", api_key="none", timeout=120)
    prompts = _prompts(256, n=4, length=24)
    alone = [client.completions.create(model="default", prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]
    batch = client.completions.create(model="default", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone
    assert batch.usage.completion_tokens == 32
    info = httpx.get(f"{tp2_server.url}/get_server_info", timeout=30).json()
    assert info["tp_size"] == 2 and info["dp_size"] == 1
    idle_invariants(tp2_server)


@function
def _story(s):
    s += "Once upon a time,"
    s += gen("a", max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.slow
def test_tp2_qwen2_matches_tp1(server_factory, tiny_model_dir, smollm2_dir) -> None:
    model = tiny_model_dir("qwen2")
    prompts = _prompts(256)
    with server_factory(model_path=model, tokenizer_path=smollm2_dir, tp_size=2, dtype="float32",
                        max_total_tokens=4096, max_running_requests=4) as srv:
        got = _served(_tp_post(srv), prompts)
    _assert_same(got, _reference(model, smollm2_dir, prompts))


@pytest.mark.slow
def test_tp3_smollm2_matches_tp1_with_openai_and_dsl(server_factory, smollm2_dir, idle_invariants) -> None:
    """The real SmolLM2 split over 3 ranks (3 query heads and 1 KV head each): the same
    greedy tokens and logprobs as whole; the OpenAI chat client and the DSL unchanged."""
    prompts = _prompts(49152)
    ref = _reference(smollm2_dir, smollm2_dir, prompts)
    local_args = ServerArgs(model_path=smollm2_dir, device="cpu", dtype="float32", weight_dtype="model",
                            max_total_tokens=4096, log_level="warning")
    with LocalServer(local_args) as local:
        ref_story = local.post("/generate", {"text": "Once upon a time,", "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})["text"]
        chat_ids = local.tm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        ref_chat = local.post("/generate", {"input_ids": chat_ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": 12}})["text"]
    with server_factory(model_path=smollm2_dir, tp_size=3, dtype="float32", max_total_tokens=4096,
                        max_running_requests=4) as srv:
        _assert_same(_served(_tp_post(srv), prompts), ref)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", timeout=300)
        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == ref_chat
        assert _story.run(backend=RuntimeEndpoint(srv.url))["a"] == ref_story
        idle_invariants(srv)


def test_a_dead_rank_stops_the_server(tp2_server, kill_model_process) -> None:
    """Last in this module: SIGKILL one of the two ranks; the server exits non-zero (no
    hang), naming the process that died."""
    count, log = kill_model_process(tp2_server)
    assert count == 2
    assert "exited with code -9" in log


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_on_two_gpus_with_cuda_graphs(server_factory, tiny_llama, smollm2_dir) -> None:
    """NCCL with the decode, extend and piecewise CUDA graphs capturing the collectives:
    the same greedy tokens as one GPU (float32; logprobs within 1e-3: NCCL's sums are
    ordered differently)."""
    prompts = _prompts(256)
    flags = dict(model_path=tiny_llama, tokenizer_path=smollm2_dir, device="cuda", dtype="float32",
                 max_total_tokens=4096, max_running_requests=4)
    with server_factory(**flags) as srv:
        ref = _served(_tp_post(srv), prompts)
    with server_factory(tp_size=2, **flags) as srv:
        got = _served(_tp_post(srv), prompts)
    for a, b in zip(got, ref, strict=True):
        assert a["tokens"] == b["tokens"] and a["cached"] == b["cached"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < 1e-3
