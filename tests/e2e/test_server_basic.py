"""Basic end-to-end behaviour of a real server: native and OpenAI APIs, prefix reuse."""

from __future__ import annotations

import json

import openai
import pytest

from radixlm.frontend import RuntimeEndpoint, function, gen
from radixlm.runtime.cli import main as cli_main

PROMPT = "List three facts about the Moon. " * 8  # ~64 tokens


def _generate(client, **body):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_same_prompt_twice_reuses_pages_and_gives_same_tokens(server, idle_invariants):
    with server.client() as c:
        server.flush()
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        first = _generate(c, **body)
        second = _generate(c, **body)
    n = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == (n - 1) // 16 * 16
    assert second["output_ids"] == first["output_ids"]
    assert len(first["output_ids"]) == 12
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    idle_invariants(server)


def test_openai_client_chat_and_completions(server, idle_invariants):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    models = client.models.list()
    name = models.data[0].id
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    assert 0 < chat.usage.completion_tokens <= 16
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    stream = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == chat.choices[0].message.content
    comp = client.completions.create(model=name, prompt="The capital of France is", max_tokens=8, temperature=0)
    comp_stream = client.completions.create(model=name, prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in comp_stream) == comp.choices[0].text
    assert comp.usage.prompt_tokens == 5 and comp.usage.completion_tokens == 8
    idle_invariants(server)


def test_generate_stream_is_cumulative_and_ends_with_done(server, idle_invariants):
    body = {"text": "Count: one, two,", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    with server.client() as c:
        full = _generate(c, **body)
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    texts = [e["text"] for e in events]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert texts[-1] == full["text"]
    assert events[-1]["output_ids"] == full["output_ids"]
    idle_invariants(server)


@pytest.mark.slow
def test_stream_output_sends_disjoint_segments(server_factory, idle_invariants, tmp_path):
    """--stream-output (SGLang's): each native event carries only the new text, ids and
    output logprobs; they concatenate to the non-streamed response. The bench client reads
    the flag from /get_server_info and counts every token once."""
    body = {"text": "Count: one, two,", "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    with server_factory(stream_output=True, max_total_tokens=4096) as srv, srv.client() as c:
        assert c.get("/get_server_info").json()["stream_output"] is True
        full = _generate(c, **body)
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        events = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert len(events) > 1
        assert "".join(e["text"] for e in events) == full["text"]
        assert sum((e["output_ids"] for e in events), []) == full["output_ids"]
        assert [len(e["output_ids"]) for e in events] == [1] * 12  # one token per event here
        logprobs = sum((e["meta_info"]["output_token_logprobs"] for e in events), [])
        assert logprobs == full["meta_info"]["output_token_logprobs"]
        assert events[0]["meta_info"]["input_token_logprobs"] == full["meta_info"]["input_token_logprobs"]
        assert all(e["meta_info"]["input_token_logprobs"] == [] for e in events[1:])
        assert [e["meta_info"]["completion_tokens"] for e in events] == list(range(1, 13))
        out = tmp_path / "records.jsonl"
        cli_main(["bench", "serving", "--base-url", srv.url, "--disable-tqdm", "--output-file", str(out),
                  "--backend", "radixlm", "--dataset-name", "random", "--num-prompts", "4",
                  "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1.0"])
        rec = json.loads(out.read_text().splitlines()[-1])
        assert rec["completed"] == 4 and rec["total_output_tokens"] == 32
        assert rec["mean_itl_ms"] > 0
        # the DSL's endpoint reads stream_output from /get_model_info and joins the segments
        endpoint = RuntimeEndpoint(srv.url)
        reference = _story.run(backend=endpoint)["a"]
        pieces = list(_story.run(backend=endpoint, stream=True).text_iter("a"))
        assert len(pieces) > 1 and "".join(pieces) == reference
        idle_invariants(srv)


@function
def _story(s):
    s += "Once upon a time,"
    s += gen("a", max_tokens=12, temperature=0, ignore_eos=True)


def _sse_payloads(c, path: str, body: dict) -> list[dict]:
    with c.stream("POST", path, json=body) as r:
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]


def test_streamed_batch_runs_its_prompts_concurrently(server, idle_invariants):
    """A streamed batch of prompts (native /generate, /v1/completions) sends every prompt
    to the scheduler at once: each prompt's first event comes before any prompt's last
    (they used to run one after another), and each index streams the non-streamed result."""
    prompts = ["The capital of France is", "Two plus two equals", "The color of the sky is"]
    with server.client() as c:
        sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        full = c.post("/generate", json={"text": prompts, "sampling_params": sp}).json()
        events = _sse_payloads(c, "/generate", {"text": prompts, "sampling_params": sp, "stream": True})
        name = c.get("/get_model_info").json()["served_model_name"]
        body = {"model": name, "prompt": prompts, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        comp = c.post("/v1/completions", json=body).json()
        chunks = _sse_payloads(c, "/v1/completions", {**body, "stream": True})
    firsts = [min(i for i, e in enumerate(events) if e["index"] == k) for k in range(3)]
    lasts = [max(i for i, e in enumerate(events) if e["index"] == k) for k in range(3)]
    assert max(firsts) < min(lasts), (firsts, lasts)
    assert [[e for e in events if e["index"] == k][-1]["output_ids"] for k in range(3)] == [
        f["output_ids"] for f in full]
    choices = [(i, ch) for i, p in enumerate(chunks) for ch in p["choices"]]
    firsts = [min(i for i, ch in choices if ch["index"] == k) for k in range(3)]
    lasts = [max(i for i, ch in choices if ch["index"] == k) for k in range(3)]
    assert max(firsts) < min(lasts), (firsts, lasts)
    texts = ["".join(ch["text"] for _, ch in choices if ch["index"] == k) for k in range(3)]
    assert texts == [ch["text"] for ch in sorted(comp["choices"], key=lambda ch: ch["index"])]
    idle_invariants(server)


def test_health_generate_and_batch_prompts_match_singles(server, idle_invariants):
    """/health_generate runs a token through the scheduler; a /generate batch of prompts
    (run concurrently) gives each prompt the tokens it gets alone."""
    with server.client() as c:
        assert c.get("/health_generate").status_code == 200
        prompts = ["The capital of France is", "Two plus two equals", "The color of the sky is"]
        sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        batch = c.post("/generate", json={"text": prompts, "sampling_params": sp}).json()
        singles = [c.post("/generate", json={"text": p, "sampling_params": sp}).json() for p in prompts]
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    assert all(len(b["output_ids"]) == 8 for b in batch)
    idle_invariants(server)
