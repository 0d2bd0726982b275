"""API compatibility with OpenAI/vLLM and SGLang on a real server: ``/v1/completions``
``echo``, ``stop_regex``, ``/get_model_info`` / ``/get_server_info``, and the request
fields SGLang's own frontend (``sglang.RuntimeEndpoint``, 0.5.x) sends."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

import radixlm
from radixlm.runtime.executor.model_loader import usable_cores

MODEL = "default"
PROMPT = "The capital of France is"
COUNT = "Count from 1 to 20: 1, 2, 3,"  # greedy: " 4, 5, 6, 7, 8, 9, 10, 11, ..."


def _post(c, path: str, body: dict) -> dict:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _events(c, path: str, body: dict) -> list[dict]:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.fixture(scope="module")
def tokenizer(server):
    with server.client() as c:
        return AutoTokenizer.from_pretrained(c.get("/get_model_info").json()["tokenizer_path"])


# ----------------------------------------------------------------------------- echo
def test_echo_with_max_tokens_0_scores_the_prompt(server, tokenizer, idle_invariants):
    ids = tokenizer.encode(PROMPT)
    with server.client() as c:
        out = _post(c, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True,
                                           "logprobs": 1})
        native = _post(c, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                        "return_logprob": True, "logprob_start_len": 0})
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    tokens = [tokenizer.decode([t]) for t in ids]
    assert lp["tokens"] == tokens and "".join(tokens) == PROMPT
    assert lp["text_offset"] == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [e[0] for e in native["meta_info"]["input_token_logprobs"]]
    assert want[0] is None and len(want) == len(ids)
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp["token_logprobs"][1:], want[1:], strict=True))
    assert all(x < 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) == 1 and max(t.values()) >= lp["token_logprobs"][k + 1] - 1e-4
               for k, t in enumerate(lp["top_logprobs"][1:]))  # the top-1 is at least as likely
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                            "prompt_tokens_details": {"cached_tokens": 0}}
    idle_invariants(server)


def test_echo_with_generation_puts_the_prompt_first(server, tokenizer, idle_invariants):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0}
    with server.client() as c:
        plain = _post(c, "/v1/completions", body)["choices"][0]
        echo = _post(c, "/v1/completions", {**body, "echo": True})["choices"][0]
        streamed = _events(c, "/v1/completions", {**body, "echo": True})
        no_lp = _post(c, "/v1/completions", {**body, "echo": True, "logprobs": None})["choices"][0]
        token_prompt = _post(c, "/v1/completions", {**body, "echo": True, "prompt": tokenizer.encode(PROMPT)})
    n_prompt = len(tokenizer.encode(PROMPT))
    assert echo["text"] == PROMPT + plain["text"] == no_lp["text"] and no_lp["logprobs"] is None
    assert token_prompt["choices"][0]["text"] == echo["text"]
    lp, plp = echo["logprobs"], plain["logprobs"]
    assert lp["tokens"][n_prompt:] == plp["tokens"] and len(lp["tokens"]) == n_prompt + 6
    assert lp["token_logprobs"][n_prompt:] == pytest.approx(plp["token_logprobs"], abs=1e-4)
    assert lp["top_logprobs"] is None  # logprobs=0: no alternatives
    # The stream: the first chunk carries the prompt (and its logprobs), then the deltas.
    pieces = [e["choices"][0] for e in streamed]
    assert pieces[0]["text"].startswith(PROMPT) and "".join(p["text"] for p in pieces) == echo["text"]
    merged = {k: sum((p["logprobs"][k] for p in pieces), []) for k in ("tokens", "token_logprobs", "text_offset")}
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    assert merged["token_logprobs"][0] is None
    assert merged["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    assert pieces[-1]["finish_reason"] == "length"
    idle_invariants(server)


def test_streamed_top_logprobs_are_a_list_in_every_chunk(server, idle_invariants):
    """logprobs: 2, streamed: every chunk's top_logprobs is a list as long as its tokens (the
    last chunk, which may carry no token, too: it was null), and the chunks add up to the
    non-streamed answer."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    with server.client() as c:
        whole = _post(c, "/v1/completions", body)["choices"][0]["logprobs"]
        pieces = [e["choices"][0] for e in _events(c, "/v1/completions", body)]
    assert len(pieces) >= 2 and pieces[-1]["finish_reason"] == "length"
    for p in pieces:
        lp = p["logprobs"]
        assert isinstance(lp["top_logprobs"], list) and len(lp["top_logprobs"]) == len(lp["tokens"])
    merged = {k: sum((p["logprobs"][k] for p in pieces), []) for k in ("tokens", "top_logprobs")}
    assert merged["tokens"] == whole["tokens"] and len(whole["tokens"]) == 6
    assert [sorted(t) for t in merged["top_logprobs"]] == [sorted(t) for t in whole["top_logprobs"]]
    assert all(1 <= len(t) <= 2 for t in whole["top_logprobs"])
    idle_invariants(server)


def test_echo_through_the_openai_client_and_its_limits(server, idle_invariants):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=0, echo=True, logprobs=0)
    assert [ch.text for ch in out.choices] == [PROMPT, "Hello"]
    assert out.choices[1].logprobs.tokens == ["Hello"] and out.choices[1].logprobs.token_logprobs == [None]
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]
    idle_invariants(server)


# ----------------------------------------------------------------------------- min_new_tokens
def test_min_new_tokens_bans_eos_until_reached(server, tokenizer, idle_invariants):
    """EOS (and stop token ids) cannot be sampled before min_new_tokens outputs (vLLM's
    min_tokens, SGLang's penalizer): it was sampled and skipped over, so the output ran on
    past EOS into an invented next turn. The OpenAI route's min_tokens the same."""
    prompt = "<|im_start|>user\nSay only the word OK.<|im_end|>\n<|im_start|>assistant\n"
    greedy = {"temperature": 0, "skip_special_tokens": False}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with server.client() as c:
        free = _post(c, "/generate", {"text": prompt, "sampling_params": {**greedy, "max_new_tokens": 20}})
        assert free["output_ids"][-1] == eos and len(free["output_ids"]) <= 12, free  # a short reply, then EOS
        n = len(free["output_ids"])
        held = _post(c, "/generate", {"text": prompt, "sampling_params": {**greedy, "max_new_tokens": 20,
                                                                          "min_new_tokens": n + 2}})
        full = _post(c, "/generate", {"text": prompt, "sampling_params": {**greedy, "max_new_tokens": 12,
                                                                          "min_new_tokens": 12}})
        stop_id = full["output_ids"][3]
        no_stop = _post(c, "/generate", {"text": prompt, "sampling_params": {
            **greedy, "max_new_tokens": 12, "min_new_tokens": 12, "stop_token_ids": [stop_id]}})
        oai = _post(c, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12, "min_tokens": 12,
                                           "temperature": 0})
    ids = held["output_ids"]
    assert eos not in ids[: n + 2] and len(ids) > n + 2, ids  # n + 2 tokens first, EOS only after
    assert ids[: n - 1] == free["output_ids"][: n - 1]  # the same greedy tokens before the ban mattered
    assert len(full["output_ids"]) == 12 and eos not in full["output_ids"], full
    assert full["meta_info"]["finish_reason"]["type"] == "length"
    assert len(no_stop["output_ids"]) == 12 and stop_id not in no_stop["output_ids"], no_stop
    assert oai["choices"][0]["finish_reason"] == "length" and oai["usage"]["completion_tokens"] == 12
    idle_invariants(server)


# ----------------------------------------------------------------------------- stop_regex
def test_stop_regex_stops_and_cuts_like_a_stop_string(server, tokenizer, idle_invariants):
    base = {"text": COUNT, "sampling_params": {"max_new_tokens": 40, "temperature": 0}}
    with server.client() as c:
        full = _post(c, "/generate", base)
        sp = {**base["sampling_params"], "stop_regex": [r"1\d", r"never+"]}
        stopped = _post(c, "/generate", {**base, "sampling_params": sp})
        kept = _post(c, "/generate", {**base, "sampling_params": {**sp, "include_stop_str_in_output": True}})
        events = _events(c, "/generate", {**base, "sampling_params": sp})
        openai_out = _post(c, "/v1/completions", {"model": MODEL, "prompt": COUNT, "max_tokens": 40,
                                                  "temperature": 0, "stop_regex": r"1\d"})
    ids = full["output_ids"]
    first = next(k for k in range(1, len(ids) + 1) if re.search(r"1\d", tokenizer.decode(ids[:k])))
    text = tokenizer.decode(ids[:first])
    m = re.search(r"1\d", text)
    assert stopped["output_ids"] == ids[:first]  # generation stopped at the first matching token
    assert stopped["text"] == text[: m.start()] == full["text"][: m.start()]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"1\d"}
    assert kept["text"] == text[: m.end()] and kept["text"].endswith("10")
    assert [e["text"] for e in events][-1] == stopped["text"]
    assert all(stopped["text"].startswith(e["text"]) for e in events)  # never streamed, then cut
    assert openai_out["choices"][0]["text"] == stopped["text"]
    assert openai_out["choices"][0]["finish_reason"] == "stop"
    idle_invariants(server)


def test_a_server_abort_with_a_reason_is_an_openai_error(server, idle_invariants):
    """A stop_regex with catastrophic backtracking over a forced run of 'a's times out in the
    scheduler, which aborts the sample with a reason: without streaming the OpenAI routes
    answer that error (400), streamed the last chunk (finish_reason "abort") is followed by
    an error event, then [DONE]."""
    body = {"model": MODEL, "prompt": "Say a:", "max_tokens": 60, "temperature": 0, "regex": "a{60}",
            "stop_regex": "(a|aa)+b"}
    chat = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": [{"role": "user", "content": "Say a"}]}
    with server.client() as c:
        for path, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            r = c.post(path, json=b)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "stop_regex search took over" in err["message"] and err["type"] == "invalid_request_error"
            events = _events(c, path, b)
            finishes = [ch["finish_reason"] for e in events[:-1] for ch in e.get("choices", [])]
            assert finishes[-1] == "abort" and finishes.count("abort") == 1, finishes
            assert "stop_regex search took over" in events[-1]["error"]["message"], events[-1]
            assert events[-1]["error"]["code"] == 400
        # A grammar no token can follow (U+40000: no token of SmolLM2 spells its bytes) is the
        # request's fault too, not an internal error (found by the schemathesis fuzz test).
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "0", "regex": "\U00040000", "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert "grammar allows no token of the model's vocabulary after 0 generated tokens" in r.json()["error"]["message"]
        # The native route answers the abort; the token the grammar rejected is not output.
        r = c.post("/generate", json={"text": "0", "sampling_params": {"regex": "\U00040000", "max_new_tokens": 4},
                                      "return_logprob": True})
        out = r.json()
        assert r.status_code == 200 and out["output_ids"] == [] and out["text"] == "", out
        assert out["meta_info"]["output_token_logprobs"] == [], out["meta_info"]
        assert "grammar allows no token" in out["meta_info"]["finish_reason"]["message"]
    idle_invariants(server)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/generate", {"text": "x", "sampling_params": {"stop_regex": ["ok", "(unclosed"]}},
     "sampling_params.stop_regex"),
    ("/generate", {"text": "x", "sampling_params": {"stop_regex": r"\s*"}}, "sampling_params.stop_regex"),
    ("/generate", {"text": "x", "sampling_params": {"stop_regex": 5}}, "sampling_params.stop_regex"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_regex": "[z-a]"}, "stop_regex"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "stop_regex": "("}, "stop_regex"),
])
def test_bad_stop_regex_is_a_400_naming_the_field(server, path, body, param):
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)  # a union type error names the member tried


# ----------------------------------------------------------------------------- model / server info
def test_e2e_latency_covers_the_generation(server, idle_invariants):
    """meta_info.e2e_latency is the request's time in the server (it read ~0 for a
    non-streaming request: the clock started after the results were gathered)."""
    body = {"text": COUNT, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    with server.client() as c:
        for stream in (False, True):
            start = time.perf_counter()
            meta = (_events(c, "/generate", body)[-1] if stream else _post(c, "/generate", body))["meta_info"]
            wall = time.perf_counter() - start
            assert meta["completion_tokens"] == 24
            assert 0.3 * wall < meta["e2e_latency"] <= wall, (stream, meta["e2e_latency"], wall)


def test_model_info_reports_the_model_as_given(server):
    with server.client() as c:
        info = c.get("/get_model_info").json()
    assert info["model_path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")  # the default model's file
    assert Path(info["model_path"]).is_file()
    assert (Path(info["model_dir"]) / "config.json").is_file()  # the converted copy
    assert info["tokenizer_path"] == info["model_dir"] and info["model_dir"] != info["model_path"]
    assert info["is_generation"] is True and info["context_length"] == 8192


@pytest.mark.slow
def test_server_info_mirrors_sglang_without_the_api_key(server_factory, idle_invariants):
    key = "apigaps-secret-key-42"
    with server_factory(api_key=key, max_total_tokens=4096, page_size=8) as srv, srv.client() as c:
        _post(c, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        deadline = time.monotonic() + 30
        while True:  # the scheduler reports its stats every 0.5 s
            r = c.get("/get_server_info")
            assert r.status_code == 200
            if r.json()["internal_states"][0].get("decode_tokens") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert c.get("/get_server_info", headers={"Authorization": "Bearer wrong"}).status_code == 401
        model = c.get("/get_model_info").json()
        idle_invariants(srv)
    info = r.json()
    assert key not in r.text and "api_key" not in info
    assert info["page_size"] == 8 and info["max_total_num_tokens"] == 4096 == info["max_total_tokens"]
    assert info["max_req_input_len"] == 8191 and info["context_length"] == 8192
    assert info["device"] == "cpu" and info["dtype"] == "float32"  # resolved, not "auto"
    assert info["model_path"] == model["model_path"] and info["version"] == "0.1.0"
    assert info["debug_invariants"] is True and info["radix_eviction_policy"] == "lru"
    # defaults resolved at start-up, not the flags' None: no decode graphs on the CPU, so no
    # admission batching; the idle spin by the usable cores (scheduler.idle_spin_s)
    assert info["cuda_graph_max_bs"] is None and info["admit_batch_size"] == 1
    assert info["idle_spin_ms"] == (20.0 if usable_cores() >= 4 else 0.0)
    state = info["internal_states"][0]
    assert state["kv_total_pages"] == 4096 // 8 and 0 <= state["token_usage"] <= 1
    assert state["prefill_tokens_computed"] == 5 and state["decode_tokens"] == 1  # 5 prompt tokens, 2nd token


def test_server_info_route_aliases_and_version(server, idle_invariants):
    """/server_info (SGLang's newer name) serves /get_server_info's body; /version gives the
    package version; the info names the server (how ``bench serving`` tells it from SGLang)."""
    with server.client() as c:
        old, new = c.get("/get_server_info"), c.get("/server_info")
        version = c.get("/version")
    assert old.status_code == new.status_code == version.status_code == 200
    old_body, new_body = old.json(), new.json()
    # the scheduler's last report may land between the two calls: compared by its keys only
    old_state, new_state = old_body.pop("internal_states"), new_body.pop("internal_states")
    assert new_body == old_body and len(old_body) > 20
    assert [sorted(s) for s in new_state] == [sorted(s) for s in old_state]
    assert version.json() == {"version": radixlm.__version__} and radixlm.__version__ == "0.1.0"
    assert old.json()["version"] == radixlm.__version__ and old.json()["name"] == "radixlm"
    idle_invariants(server)


# ----------------------------------------------------------------------------- SGLang's frontend
def _sglang_gen_body(text: str, **overrides) -> dict:
    """What sglang 0.5.x ``RuntimeEndpoint.generate`` sends for a plain ``gen`` (defaults of
    ``SglSamplingParams.to_srt_kwargs`` plus the two special-token flags)."""
    sp = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 8,
          "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
          "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
          "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None, **overrides}
    return {"text": text, "sampling_params": sp}


def test_sglang_frontend_requests_are_served(server, tokenizer, idle_invariants):
    with server.client() as c:
        plain = _post(c, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        sgl = _post(c, "/generate", _sglang_gen_body(PROMPT))
        regex_stop = _post(c, "/generate", _sglang_gen_body(COUNT, max_new_tokens=40, stop_regex=r"[5-6],"))
        # select: cache the prefix, then score "text + choice" rows from prompt_len - 2.
        prompt_len = _post(c, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})[
            "meta_info"]["prompt_tokens"]
        rows = _post(c, "/generate", {"text": [PROMPT + " Paris", PROMPT + " Rome"],
                                      "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                      "return_logprob": True, "return_text_in_logprobs": True,
                                      "logprob_start_len": max(prompt_len - 2, 0)})
        no_start = _post(c, "/generate", {"input_ids": tokenizer.encode(PROMPT), "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 0}})
        image = c.post("/generate", json={**_sglang_gen_body(PROMPT), "image_data": "cat.png"})
        flushed = c.post("/flush_cache", json={"empty_cache": True})
    assert sgl["text"] == plain["text"] and sgl["output_ids"] == plain["output_ids"]
    assert regex_stop["text"] == " 4, " and regex_stop["meta_info"]["finish_reason"]["matched"] == "[5-6],"
    assert len(rows) == 2
    for row, word in zip(rows, (" Paris", " Rome"), strict=True):
        entries = row["meta_info"]["input_token_logprobs"]
        assert len(entries) == 3 and entries[-1][2] == word and all(e[0] < 0 for e in entries)
        assert row["meta_info"]["output_token_logprobs"] == []
    assert rows[0]["meta_info"]["input_token_logprobs"][-1][0] > rows[1]["meta_info"]["input_token_logprobs"][-1][0]
    assert no_start["meta_info"]["input_token_logprobs"] == []  # present (SGLang's frontend reads it), empty
    assert image.status_code == 400 and image.json()["error"]["param"] == "image_data"
    assert flushed.status_code == 200
    idle_invariants(server)
