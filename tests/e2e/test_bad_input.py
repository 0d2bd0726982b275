"""Bad and edge-case input on a real server: regression cases C08, C09 and C10.

- C08 empty prompt: zero-token prompts are HTTP 400 "prompt is empty" for that request
  only (SmolLM2's tokenizer adds no BOS, so "" is zero tokens). A chat message with
  content "" is still a valid request: the chat template adds a system prompt. Policy for
  a batch with one empty prompt: the whole request is rejected with 400.
- C09 ``max_tokens=0``: OpenAI endpoints refuse it (400, documented policy; ``/v1/completions``
  accepts it only with ``echo``, to score the prompt: tests/e2e/test_api_compat.py);
  ``/generate`` with ``max_new_tokens=0`` returns 200 with empty text, 0 completion
  tokens, ``finish_reason`` length (and prompt logprobs + ``cached_tokens`` when asked).
  ``max_tokens=1`` streaming: exactly one content delta, then the finish chunk.
- C10 malformed bodies: HTTP 400 with a JSON ``error`` object of type
  ``invalid_request_error`` naming the problem; never 500 or plain text; the scheduler
  never sees the request; the server stays healthy.

Every test runs on the shared ``server`` fixture and ends with the idle invariant.
The model runs on a shared 2-core CPU machine, so no test asserts tight latencies.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

JSON = {"Content-Type": "application/json"}
MODEL = "default"  # accepted alias of the served model name
# 8 normal requests sent together with every C09 edge case; their greedy outputs must
# equal the outputs they give alone (references computed first).
NORMAL_PROMPTS = [f"Shopping list {i}: apples, bread, milk, eggs, and" for i in range(8)]
NORMAL_MAX_TOKENS = 6


# --------------------------------------------------------------------------- helpers
def _metric_sum(srv: Any, name: str) -> float:
    """Sum of all samples of a Prometheus metric (any labels)."""
    text = httpx.get(f"{srv.url}/metrics", timeout=60).text
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"^{re.escape(name)}(\{{|\s)", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _scheduler_pid(srv: Any) -> int:
    """The scheduler child of the launcher (multiprocessing 'spawn' child; the launcher
    may also have a resource-tracker child, which is skipped)."""
    pids = []
    for children in Path(f"/proc/{srv.proc.pid}/task").glob("*/children"):
        pids += [int(p) for p in children.read_text().split()]
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    raise AssertionError(f"no scheduler child among {pids}")


def _assert_400(r: httpx.Response, *mentions: str, param: str | None = None) -> dict:
    """HTTP 400 with a JSON OpenAI-style error; ``mentions`` appear in the message
    (case-insensitive) and ``param`` (if given) names the field."""
    assert r.status_code == 400, f"{r.status_code}: {r.text[:500]}"
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert err["type"] == "invalid_request_error", err
    for word in mentions:
        assert word.lower() in err["message"].lower(), (word, err)
    if param is not None:
        assert err["param"] == param, err
    return err


def _post(c: httpx.Client, path: str, body: dict) -> httpx.Response:
    return c.post(path, json=body)


def _normal(c: httpx.Client, prompt: str) -> str:
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": NORMAL_MAX_TOKENS,
                                        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == NORMAL_MAX_TOKENS, body
    assert body["choices"][0]["finish_reason"] == "length", body
    return body["choices"][0]["text"]


def _assert_healthy(srv: Any, scheduler_pid: int) -> None:
    assert srv.proc.poll() is None, "server process exited"
    assert Path(f"/proc/{scheduler_pid}").exists(), "scheduler process is gone"
    assert _scheduler_pid(srv) == scheduler_pid, "scheduler was replaced"
    assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
    with srv.client() as c:
        r = c.post("/generate", json={"text": "The sky is", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2


def _sse_events(r: httpx.Response) -> list:
    """Payloads of an SSE response; the last element is the string '[DONE]' if sent."""
    events = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --------------------------------------------------------------------------- C08
def test_c08_empty_prompts_are_rejected_and_server_keeps_serving(server, idle_invariants):
    pid = _scheduler_pid(server)
    before = _metric_sum(server, "radixlm:requests_total")
    with server.client() as c:
        cases = [
            ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4, "stream": True}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": [""], "max_tokens": 4}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 4}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": [[]], "max_tokens": 4}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4, "n": 2}, "prompt"),
            ("/generate", {"text": "", "sampling_params": {"max_new_tokens": 4}}, "text"),
            ("/generate", {"text": "", "stream": True}, "text"),
            ("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 4}}, "input_ids"),
            ("/generate", {"input_ids": [[]], "sampling_params": {"max_new_tokens": 4}}, "input_ids"),
            ("/generate", {"text": "", "return_logprob": True, "logprob_start_len": 0,
                           "sampling_params": {"max_new_tokens": 0}}, "text"),
        ]
        for path, body, param in cases:
            _assert_400(_post(c, path, body), "prompt is empty", param=param)

        # Documented policy: a batch with one empty prompt is rejected as a whole (400),
        # and its non-empty prompt never reaches the scheduler.
        batches = [
            ("/v1/completions", {"model": MODEL, "prompt": ["hello", ""], "max_tokens": 4}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": [[28, 29], []], "max_tokens": 4}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": ["hello", ""], "max_tokens": 4, "stream": True}, "prompt"),
            ("/generate", {"text": ["hello", ""], "sampling_params": {"max_new_tokens": 4}}, "text"),
            ("/generate", {"input_ids": [[28, 29], []], "sampling_params": {"max_new_tokens": 4}}, "input_ids"),
        ]
        for path, body, param in batches:
            _assert_400(_post(c, path, body), "prompt is empty", param=param)
        _assert_400(_post(c, "/generate", {"text": []}), "empty", param="text")
        # Nothing above reached the scheduler: no request finished in the meantime.
        assert _metric_sum(server, "radixlm:requests_total") == before

        # The chat template adds a system prompt, so an empty user message is valid.
        for stream in (False, True):
            body = {"model": MODEL, "messages": [{"role": "user", "content": ""}], "max_tokens": 4,
                    "temperature": 0, "stream": stream,
                    "stream_options": {"include_usage": True} if stream else None}
            if stream:
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    events = _sse_events(r)
                assert events[-1] == "[DONE]"
                usage = events[-2]["usage"]
                finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
                assert finishes[-1] in ("stop", "length")
            else:
                r = _post(c, "/v1/chat/completions", body)
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            assert usage["prompt_tokens"] > 0, usage
            assert 0 < usage["completion_tokens"] <= 4, usage

    _assert_healthy(server, pid)
    idle_invariants(server)


def _bos_tokenizer(model_dir: Path, out: Path) -> Path:
    """A copy of SmolLM2's tokenizer whose post-processor prepends <|im_start|> (its
    configured bos_token, id 1) to every encoded text: the "tokenizer that adds BOS"."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            (out / name).write_bytes((model_dir / name).read_bytes())
    spec = json.loads((out / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    seq = [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]
    spec["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, seq[0]], "pair": [bos, *seq],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@pytest.mark.slow
def test_c08_empty_prompt_with_a_bos_tokenizer(server, server_factory, tmp_path, idle_invariants):
    """With a tokenizer that adds BOS, "" is one token: a valid request (prompt_tokens=1)."""
    model_dir = Path(httpx.get(f"{server.url}/get_model_info", timeout=60).json()["tokenizer_path"])
    tok_dir = _bos_tokenizer(model_dir, tmp_path / "bos-tokenizer")
    with server_factory(tokenizer_path=str(tok_dir), max_total_tokens=4096) as srv, srv.client() as c:
        def ok(path: str, body: dict) -> dict:
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            return r.json()

        for prompt in ("", [""]):
            out = ok("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert out["usage"]["prompt_tokens"] == 1, out
            assert out["choices"][0]["finish_reason"] in ("stop", "length")
        out = ok("/generate", {"text": "", "sampling_params": {"max_new_tokens": 2}})
        assert out["meta_info"]["prompt_tokens"] == 1, out
        out = ok("/v1/completions", {"model": MODEL, "prompt": ["hello", ""], "max_tokens": 2})
        assert len(out["choices"]) == 2
        assert out["usage"]["prompt_tokens"] == 2 + 1, out  # [BOS, hello] + [BOS]
        out = ok("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                          "messages": [{"role": "user", "content": ""}]})
        assert out["usage"]["prompt_tokens"] > 1
        # Explicit token ids get no BOS: [] is still an empty prompt.
        _assert_400(c.post("/generate", json={"input_ids": []}), "prompt is empty", param="input_ids")
        _assert_400(c.post("/v1/completions", json={"model": MODEL, "prompt": [[]]}), "prompt is empty")
        assert c.get("/health").status_code == 200
        idle_invariants(srv)


# --------------------------------------------------------------------------- C09
def _burst(srv: Any, special, references: list[str]):
    """Run ``special(client)`` together with the 8 normal requests; the normal ones must
    succeed with their reference outputs. Returns special's result."""
    with srv.client() as c, cf.ThreadPoolExecutor(9) as ex:
        normals = [ex.submit(_normal, c, p) for p in NORMAL_PROMPTS]
        out = ex.submit(special, c)
        texts = [f.result() for f in normals]
        result = out.result()
    assert texts == references, "a concurrent normal request changed its output"
    return result


@pytest.mark.slow
def test_c09_max_tokens_zero(server, idle_invariants):
    pid = _scheduler_pid(server)
    with server.client() as c:
        references = [_normal(c, p) for p in NORMAL_PROMPTS]

    # OpenAI endpoints: documented policy is 400 for max_tokens / max_completion_tokens 0 (without echo).
    openai_cases = [
        ("/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 0, "stream": True},
         "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                  "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                  "max_completion_tokens": 0, "stream": True}, "max_completion_tokens"),
    ]
    for path, body, param in openai_cases:
        r = _burst(server, lambda c, path=path, body=body: c.post(path, json=body), references)
        _assert_400(r, param, param=param)

    # Native /generate: 200, empty text, 0 completion tokens, finish_reason length.
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    plain = _burst(server, lambda c: c.post("/generate", json={
        "text": prompt, "sampling_params": {"max_new_tokens": 0}}), references)
    assert plain.status_code == 200, plain.text
    meta = plain.json()["meta_info"]
    n_prompt = meta["prompt_tokens"]
    assert n_prompt > 16
    assert plain.json()["text"] == "" and plain.json()["output_ids"] == []
    assert meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert isinstance(meta["cached_tokens"], int) and 0 <= meta["cached_tokens"] < n_prompt

    # return_logprob without logprob_start_len: no prompt scoring asked, still no crash.
    lp = _burst(server, lambda c: c.post("/generate", json={
        "text": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 0}}), references)
    assert lp.status_code == 200, lp.text
    meta = lp.json()["meta_info"]
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert "cached_tokens" in meta

    # Prompt scoring: logprob_start_len=0 returns a logprob for every prompt token.
    scoring_body = {"text": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                    "sampling_params": {"max_new_tokens": 0}}
    scored = [_burst(server, lambda c: c.post("/generate", json=scoring_body), references) for _ in range(2)]
    for r in scored:
        assert r.status_code == 200, r.text
        body = r.json()
        meta = body["meta_info"]
        assert body["text"] == "" and body["output_ids"] == []
        assert meta["completion_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["prompt_tokens"] == n_prompt
        assert isinstance(meta["cached_tokens"], int) and 0 <= meta["cached_tokens"] < n_prompt
        assert meta["output_token_logprobs"] == []
        lps = meta["input_token_logprobs"]
        assert len(lps) == n_prompt, (len(lps), n_prompt)
        assert lps[0][0] is None  # the first prompt token has no logprob (documented)
        assert all(isinstance(x[0], float) and x[0] <= 0.0 for x in lps[1:]), lps[:4]
        assert len(meta["input_top_logprobs"]) == n_prompt
    first, second = (r.json()["meta_info"]["input_token_logprobs"] for r in scored)
    assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(first[1:], second[1:], strict=True))

    # Streaming /generate with max_new_tokens=0: one final event, then [DONE].
    def stream_zero(c: httpx.Client) -> list:
        with c.stream("POST", "/generate", json={"text": prompt, "stream": True,
                                                 "sampling_params": {"max_new_tokens": 0}}) as r:
            assert r.status_code == 200
            return _sse_events(r)

    events = _burst(server, stream_zero, references)
    assert events[-1] == "[DONE]"
    assert events[-2]["text"] == "" and events[-2]["meta_info"]["completion_tokens"] == 0
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}

    _assert_healthy(server, pid)
    idle_invariants(server)


def _chat_body(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


def test_c09_max_tokens_one_stream_and_stop(server, idle_invariants):
    """max_tokens=1 streaming: exactly one content delta, then the finish chunk with
    "length"; with a stop string that the first token completes: "stop", nothing emitted."""
    pid = _scheduler_pid(server)
    comp = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 1}
    chat = _chat_body("What is the capital of France?", max_tokens=1)
    with server.client() as c:
        # The greedy first token of each, non-streaming.
        r = _post(c, "/v1/completions", comp)
        assert r.status_code == 200, r.text
        comp_text = r.json()["choices"][0]["text"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 1
        r = _post(c, "/v1/chat/completions", chat)
        assert r.status_code == 200, r.text
        chat_text = r.json()["choices"][0]["message"]["content"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert comp_text.strip() and chat_text.strip(), (comp_text, chat_text)

        def stream(path: str, body: dict) -> tuple[list[str], list[str | None]]:
            with c.stream("POST", path, json={**body, "stream": True}) as resp:
                assert resp.status_code == 200
                events = _sse_events(resp)
            assert events[-1] == "[DONE]"
            deltas, finishes = [], []
            for e in events[:-1]:
                (choice,) = e["choices"]
                if "delta" in choice:
                    text = choice["delta"].get("content") or ""
                    if choice["delta"].get("role"):
                        assert text == "", choice  # the role chunk carries no content
                        continue
                else:
                    text = choice["text"]
                if text:
                    deltas.append(text)
                finishes.append(choice["finish_reason"])
            return deltas, finishes

        for path, body, text in (("/v1/completions", comp, comp_text), ("/v1/chat/completions", chat, chat_text)):
            deltas, finishes = stream(path, body)
            assert deltas == [text], (path, deltas)
            assert finishes[-1] == "length", (path, finishes)
            assert [f for f in finishes if f is not None] == ["length"], (path, finishes)

            # A stop string equal to the first token's text: finish "stop", nothing emitted.
            stop = text.strip()
            r = _post(c, path, {**body, "stop": [stop]})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out = choice["text"] if "text" in choice else choice["message"]["content"]
            assert choice["finish_reason"] == "stop", choice
            assert stop not in out, choice
            assert out == text[: text.index(stop)], choice
            deltas, finishes = stream(path, {**body, "stop": [stop]})
            assert "".join(deltas) == out and not any(stop in d for d in deltas), deltas
            assert [f for f in finishes if f is not None] == ["stop"], finishes

            # A stop string the token completes part-way: the text before it is emitted.
            if len(stop) >= 2:
                tail = stop[-2:]
                r = _post(c, path, {**body, "stop": [tail]})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                out = choice["text"] if "text" in choice else choice["message"]["content"]
                assert choice["finish_reason"] == "stop", choice
                assert out == text[: text.index(tail)], (text, tail, out)
                deltas, finishes = stream(path, {**body, "stop": [tail]})
                assert "".join(deltas) == out, (deltas, out)
                assert [f for f in finishes if f is not None] == ["stop"], finishes

        # Native: matched stop reported.
        r = _post(c, "/generate", {"text": comp["prompt"], "sampling_params": {
            "max_new_tokens": 1, "temperature": 0, "stop": [comp_text.strip()]}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": comp_text.strip()}
        assert comp_text.strip() not in r.json()["text"]

    _assert_healthy(server, pid)
    idle_invariants(server)


# --------------------------------------------------------------------------- C10
_CHAT_OK = '"model":"m","messages":[{"role":"user","content":"hi"}]'
_COMP_OK = '"model":"m","prompt":"hi"'
_GEN_OK = '"text":"hi"'
_BASE = {"/v1/chat/completions": _CHAT_OK, "/v1/completions": _COMP_OK, "/generate": _GEN_OK}


def _raw_cases() -> list[tuple[str, str, bytes, tuple[str, ...], str | None]]:
    """(path, label, body, words the message must contain, expected param)."""
    cases = []
    for path, ok in _BASE.items():
        for stream in (False, True):
            s = '"stream":true,' if stream else ""
            tag = "stream" if stream else "plain"
            cases.append((path, f"trailing-garbage-{tag}", f"{{{s}{ok}, x}}".encode(), ("json",), None))
            cases.append((path, f"truncated-{tag}", f"{{{s}{ok}".encode(), ("json",), None))
            cases.append((path, f"single-quotes-{tag}", f"{{{s}'model':'m'}}".encode(), ("json",), None))
        for body in (b"not json", b"\xff\xfe{", b"[" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000):
            cases.append((path, f"garbage-{body[:8]!r}", body, (), None))
        cases.append((path, "empty", b"", ("body",), None))
        for body in (b"null", b"[]", b"123", b'"hi"', b"true"):
            cases.append((path, f"not-an-object-{body.decode()}", body, ("body",), None))
    return cases


def _typed_cases() -> list[tuple[str, str, dict, str]]:
    """Valid JSON with wrong types or out-of-range values: (path, label, body, param)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    comp = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
    big = 2**64  # does not fit in 64 bits: must be a 400, not a 500 or a dead scheduler
    cases = []
    for stream in (False, True):
        for label, body, param in [
            ("messages-str", {**chat, "messages": "hi"}, "messages"),
            ("messages-empty", {**chat, "messages": []}, "messages"),
            ("content-int", {**chat, "messages": [{"role": "user", "content": 5}]}, None),
            ("no-role", {**chat, "messages": [{"content": "hi"}]}, "messages.0.role"),
            ("unknown-role", {**chat, "messages": [{"role": "narrator", "content": "hi"}]}, "messages.0.role"),
            ("max_tokens-str", {**chat, "max_tokens": "ten"}, "max_tokens"),
            ("max_tokens-neg", {**chat, "max_tokens": -1}, "max_tokens"),
            ("temperature-neg", {**chat, "temperature": -1}, "temperature"),
            ("top_p-0", {**chat, "top_p": 0}, "top_p"),
            ("n-0", {**chat, "n": 0}, "n"),
            ("model-missing", {k: v for k, v in chat.items() if k != "model"}, "model"),
            ("seed-huge", {**chat, "seed": big}, "seed"),
            ("top_k-huge", {**chat, "top_k": 2**63}, "top_k"),
            ("max_tokens-huge", {**chat, "max_tokens": big}, "max_tokens"),
            ("max_completion_tokens-huge", {**chat, "max_completion_tokens": big}, "max_completion_tokens"),
        ]:
            cases.append(("/v1/chat/completions", f"{label}-{stream}", {**body, "stream": stream}, param))
        for label, body, param in [
            ("prompt-int", {**comp, "prompt": 5}, None),
            ("prompt-dict", {**comp, "prompt": {"a": 1}}, None),
            ("prompt-missing", {k: v for k, v in comp.items() if k != "prompt"}, "prompt"),
            ("max_tokens-str", {**comp, "max_tokens": "ten"}, "max_tokens"),
            ("max_tokens-neg", {**comp, "max_tokens": -5}, "max_tokens"),
            ("max_tokens-float", {**comp, "max_tokens": 1.5}, "max_tokens"),
            ("temperature-neg", {**comp, "temperature": -1}, "temperature"),
            ("top_p-0", {**comp, "top_p": 0}, "top_p"),
            ("logprobs-neg", {**comp, "logprobs": -1}, "logprobs"),
            ("stop-int", {**comp, "stop": 5}, None),
            ("seed-huge", {**comp, "seed": big}, "seed"),
            ("min_tokens-huge", {**comp, "min_tokens": big}, "min_tokens"),
            ("top_k-huge", {**comp, "top_k": 2**63}, "top_k"),
            ("stop_token_ids-huge", {**comp, "stop_token_ids": [big]}, "stop_token_ids.0"),
            ("n2-seed-huge", {**comp, "n": 2, "seed": big - 1}, "seed"),
            ("max_tokens-huge", {**comp, "max_tokens": big}, "max_tokens"),
        ]:
            cases.append(("/v1/completions", f"{label}-{stream}", {**body, "stream": stream}, param))
        sp = gen["sampling_params"]
        for label, body, param in [
            ("text-int", {**gen, "text": 5}, None),
            ("input_ids-str", {"input_ids": "hi"}, None),
            ("text-and-ids", {**gen, "input_ids": [1, 2]}, None),
            ("neither", {"sampling_params": sp}, None),
            ("sampling_params-str", {**gen, "sampling_params": "x"}, "sampling_params"),
            ("max_new_tokens-str", {**gen, "sampling_params": {"max_new_tokens": "ten"}},
             "sampling_params.max_new_tokens"),
            ("max_new_tokens-neg", {**gen, "sampling_params": {"max_new_tokens": -1}},
             "sampling_params.max_new_tokens"),
            ("temperature-neg", {**gen, "sampling_params": {**sp, "temperature": -1}},
             "sampling_params.temperature"),
            ("top_p-0", {**gen, "sampling_params": {**sp, "top_p": 0}}, "sampling_params.top_p"),
            ("seed-huge", {**gen, "sampling_params": {**sp, "seed": big}}, "sampling_params.seed"),
            ("top_k-huge", {**gen, "sampling_params": {**sp, "top_k": big}}, "sampling_params.top_k"),
            ("min_new_tokens-huge", {**gen, "sampling_params": {**sp, "min_new_tokens": big}},
             "sampling_params.min_new_tokens"),
            ("stop_token_ids-huge", {**gen, "sampling_params": {**sp, "stop_token_ids": [big]}},
             "sampling_params.stop_token_ids.0"),
            ("logprob_start_len-neg", {**gen, "logprob_start_len": -2}, "logprob_start_len"),
            ("logprob_start_len-huge", {**gen, "logprob_start_len": big}, "logprob_start_len"),
            ("max_new_tokens-huge", {**gen, "sampling_params": {**sp, "max_new_tokens": big}},
             "sampling_params.max_new_tokens"),
        ]:
            cases.append(("/generate", f"{label}-{stream}", {**body, "stream": stream}, param))
    return cases


def test_c10_malformed_bodies_are_400_json(server, idle_invariants):
    pid = _scheduler_pid(server)
    before = _metric_sum(server, "radixlm:requests_total")
    failures = []
    with server.client(timeout=60) as c:
        for path, label, body, words, param in _raw_cases():
            try:
                _assert_400(c.post(path, content=body, headers=JSON), *words, param=param)
            except (AssertionError, KeyError, ValueError) as exc:
                failures.append(f"{path} {label}: {exc!r}"[:400])
        for path, label, body, param in _typed_cases():
            try:
                words = (param.split(".")[-1],) if param and not param[-1].isdigit() else ()
                _assert_400(c.post(path, json=body), *words, **({"param": param} if param else {}))
            except (AssertionError, KeyError, ValueError) as exc:
                failures.append(f"{path} {label}: {exc!r}"[:400])
    assert not failures, "\n".join(failures)
    # None of them reached the scheduler.
    assert _metric_sum(server, "radixlm:requests_total") == before
    _assert_healthy(server, pid)
    idle_invariants(server)


def test_c10_semantic_errors_are_400(server, idle_invariants):
    """Requests that parse but cannot be served: unknown model, unknown role, token ids
    outside the vocabulary, prompts longer than the context."""
    pid = _scheduler_pid(server)
    before = _metric_sum(server, "radixlm:requests_total")
    with server.client() as c:
        ctx = c.get("/get_model_info").json()["context_length"]
        vocab_hint = "token ids"
        for stream in (False, True):
            chat = _chat_body("hi", max_tokens=4, stream=stream)
            comp = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream}
            for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
                err = _assert_400(_post(c, path, {**body, "model": "no-such-model"}), "model", param="model")
                assert "no-such-model" in err["message"]
            _assert_400(_post(c, "/v1/chat/completions", {**chat, "messages": [
                {"role": "system", "content": "x"}, {"role": "wizard", "content": "hi"}]}),
                "role", param="messages.1.role")
            # Token ids out of the vocabulary (and negative ones).
            for ids in ([1, 2, 10**9], [1, -1], [2**70], [[1, 2], [3, -4]]):
                _assert_400(_post(c, "/generate", {"input_ids": ids, "stream": stream}), vocab_hint, param="input_ids")
            _assert_400(_post(c, "/generate", {"input_ids": [1, 2, 10**9], "stream": stream}),
                        vocab_hint, param="input_ids")
            _assert_400(_post(c, "/v1/completions", {**comp, "prompt": [1, 2, 10**9]}), vocab_hint, param="prompt")
            _assert_400(_post(c, "/v1/completions", {**comp, "prompt": [[1, 2], [3, 10**9]]}),
                        vocab_hint, param="prompt")
            # Prompts longer than the context (validation only: no prefill is run).
            _assert_400(_post(c, "/generate", {"input_ids": [28] * (ctx + 5), "stream": stream}),
                        "context", param="input_ids")
            _assert_400(_post(c, "/generate", {"input_ids": [28] * ctx, "stream": stream}),
                        "context", param="input_ids")
            _assert_400(_post(c, "/v1/completions", {**comp, "prompt": [28] * ctx}), "context", param="prompt")
            _assert_400(_post(c, "/v1/completions", {**comp, "prompt": " hello" * (ctx + 10)}),
                        "context", param="prompt")
            _assert_400(_post(c, "/v1/chat/completions", _chat_body(" hello" * (ctx + 10), stream=stream)),
                        "context", param="messages")
    assert _metric_sum(server, "radixlm:requests_total") == before
    _assert_healthy(server, pid)
    idle_invariants(server)


def test_c10_wrong_method_and_unknown_route_are_json_errors(server, idle_invariants):
    """Errors outside body validation (wrong method, unknown route) are JSON too."""
    with server.client(timeout=60) as c:
        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            r = c.get(path)
            assert r.status_code == 405, r.text
            assert r.json()["error"]["message"], r.text
        r = c.post("/v1/no-such-route", json={})
        assert r.status_code == 404 and r.json()["error"]["message"], r.text
    idle_invariants(server)


def test_lone_surrogates_are_400_not_500(server, idle_invariants):
    """JSON escapes like "\\ud800" decode to lone UTF-16 surrogates, which are not valid
    Unicode text: every field that carries text gets a 400 naming it, streams included
    (chat messages and tools too: they got the tokenizer's own TypeError text before)."""
    pid = _scheduler_pid(server)
    cases = [
        ("/generate", b'{"text":"\\ud800abc","sampling_params":{"max_new_tokens":2}}', "text"),
        ("/generate", b'{"text":"abc","sampling_params":{"max_new_tokens":2,"stop":["\\udc00"]}}', "stop"),
        ("/generate", b'{"text":"abc","rid":"\\ud800","sampling_params":{"max_new_tokens":2}}', "rid"),
        ("/generate", b'{"text":"abc","sampling_params":{"max_new_tokens":2,"stop_regex":"\\ud800"}}', "stop_regex"),
        ("/v1/completions", b'{"model":"' + MODEL.encode() + b'","prompt":"\\ud800","max_tokens":2}', "prompt"),
        ("/v1/completions", b'{"model":"' + MODEL.encode() + b'","prompt":["ok","\\ud800"],"max_tokens":2}',
         "prompt"),
        ("/v1/completions", b'{"model":"' + MODEL.encode() + b'","prompt":"hi","max_tokens":2,"stop":"\\ud800",'
         b'"stream":true}', "stop"),
        ("/v1/chat/completions", b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":'
         b'"\\ud800"}],"max_tokens":2}', "messages"),
        ("/v1/chat/completions", b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"hi"}],'
         b'"tools":[{"type":"function","function":{"name":"f","description":"\\udc00"}}],"max_tokens":2}', "tools"),
    ]
    with server.client() as c:
        for path, body, param in cases:
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
            _assert_400(r, "unicode", param=param)
    _assert_healthy(server, pid)
    idle_invariants(server)


def test_deep_nesting_and_huge_integers_are_400_with_the_fields_message(server, idle_invariants):
    """JSON schemas nested near Python's recursion limit (json.dumps raised RecursionError:
    a 500), a stop regex of thousands of nested groups, infinite or NaN sampling floats
    (an infinite temperature was served), and integers beyond 64 bits, which the body
    parser must read as integers (orjson makes them floats; max_new_tokens too), and chat tools nested as deep
    (their 400 named ``messages``): each a 400 naming its field, with pydantic's range message."""
    pid = _scheduler_pid(server)
    deep = b'{"a":' * 1000 + b"1" + b"}" * 1000
    nested_text = json.dumps("[" * 980 + "]" * 980).encode()
    model = json.dumps(MODEL).encode()
    cases = [
        ("/generate", b'{"text":"hi","sampling_params":{"max_new_tokens":2,"json_schema":' + deep + b"}}",
         "sampling_params.json_schema", "nested deeper"),
        ("/generate", b'{"text":"hi","sampling_params":{"max_new_tokens":2,"json_schema":' + nested_text + b"}}",
         "sampling_params.json_schema", "nested deeper"),
        ("/v1/completions", b'{"model":' + model + b',"prompt":"hi","max_tokens":2,"json_schema":' + deep + b"}",
         "json_schema", "nested deeper"),
        ("/v1/chat/completions", b'{"model":' + model + b',"messages":[{"role":"user","content":"hi"}],'
         b'"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":' + deep + b"}}}",
         "response_format.json_schema.schema", "nested deeper"),
        ("/generate", json.dumps({"text": "hi", "sampling_params": {"stop_regex": "(" * 5000 + "a" + ")" * 5000}})
         .encode(), "sampling_params.stop_regex", "regular expression"),
        *[("/generate", b'{"text":"hi","sampling_params":{"temperature":' + v + b"}}", "sampling_params.temperature",
           "finite number") for v in (b"Infinity", b"NaN", b"1e400")],
        ("/v1/chat/completions", b'{"model":' + model + b',"messages":[{"role":"user","content":"hi"}],'
         b'"top_p":NaN}', "top_p", "finite number"),
        ("/v1/chat/completions", b'{"model":' + model + b',"messages":[{"role":"user","content":"hi"}],'
         b'"tools":[' + deep + b"]}", "tools", "nested deeper"),
        ("/generate", b'{"text":"hi","sampling_params":{"seed":18446744073709551616}}', "sampling_params.seed",
         "less than or equal to 9223372036854775807"),
        ("/v1/completions", b'{"model":' + model + b',"prompt":"hi","seed":-9223372036854775809}', "seed",
         "greater than or equal to -9223372036854775808"),
        ("/v1/completions", b'{"model":' + model + b',"prompt":[18446744073709551616],"max_tokens":2}', "prompt",
         "token ids"),
        ("/generate", b'{"text":"hi","sampling_params":{"max_new_tokens":18446744073709551616}}',
         "sampling_params.max_new_tokens", "less than or equal to 9223372036854775807"),
    ]
    with server.client(timeout=60) as c:
        for path, body, param, says in cases:
            for stream in (False, True):
                data = body[:-1] + (b',"stream":true}' if stream else b"}")
                _assert_400(c.post(path, content=data, headers=JSON), says, param=param)
        # within int64, a max_new_tokens larger than the context is clamped to it: the stream
        # starts; closing it after the first event aborts the request.
        with c.stream("POST", "/generate", headers=JSON, content=b'{"text":"hi","stream":true,'
                      b'"sampling_params":{"max_new_tokens":9223372036854775807}}') as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
    _assert_healthy(server, pid)
    idle_invariants(server)


def test_concurrent_duplicate_rid_is_refused_and_the_first_request_completes(server, idle_invariants):
    long = {"text": "Tell me a story about a dragon", "rid": "dup-rid",
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    with server.client() as c, cf.ThreadPoolExecutor(1) as pool:
        first = pool.submit(c.post, "/generate", json=long)
        deadline = 0
        while deadline < 100:  # wait until the first request is registered (live in the scheduler)
            if server.invariants()["num_live"]:
                break
            deadline += 1
            time.sleep(0.05)
        second = c.post("/generate", json={**long, "text": "List some fruits"})
        _assert_400(second, "already in use", param="rid")
        r = first.result(timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["completion_tokens"] == 24 and body["meta_info"]["id"] == "dup-rid"
    idle_invariants(server)


def test_repetition_penalty_out_of_range_is_400(server, idle_invariants):
    """Dividing float32 logits by a penalty near 0 overflows to inf (NaN samples)."""
    with server.client() as c:
        for value in (1e-40, 0.0, 1e3):
            r = c.post("/generate", json={"text": "Hi Hi Hi", "sampling_params": {
                "max_new_tokens": 3, "temperature": 1, "repetition_penalty": value}})
            _assert_400(r, param="sampling_params.repetition_penalty")
        ok = c.post("/generate", json={"text": "Hi Hi Hi", "sampling_params": {
            "max_new_tokens": 3, "temperature": 1, "repetition_penalty": 0.01, "seed": 1}})
    assert ok.status_code == 200 and ok.json()["output_ids"] != [0, 0, 0], ok.text
    idle_invariants(server)


def test_an_unsupported_architecture_stops_start_up_with_one_line(tiny_model_dir, smollm2_dir, tmp_path):
    """A config.json naming an architecture outside the registry: launch_server exits
    non-zero with the error naming it and the supported ones, and no traceback (a user's
    configuration, not a bug)."""
    import shutil
    import subprocess
    import sys

    from radixlm.runtime.bench.server_process import free_port

    model = tmp_path / "foo"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    run = subprocess.run([sys.executable, "-m", "radixlm.runtime.launch_server", "--model-path", str(model),
                          "--tokenizer-path", smollm2_dir, "--device", "cpu", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    log = run.stdout + run.stderr
    assert "unsupported architecture ['FooForCausalLM']; radixlm supports: Gemma2ForCausalLM" in log, log[-2000:]
    assert "Traceback" not in log, log[-2000:]
