"""Structured generation end to end (cases C16, C18, C19, C20): regex, JSON schema
and EBNF through /generate and OpenAI response_format, with the real SmolLM2 on the CPU.

Sampled tests are seeded (``seed`` + sample index for n > 1), so a run is reproducible
on one machine; every sample must satisfy its grammar, not a fraction.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "field": {"enum": ["physics", "chemistry", "biology", "mathematics"]},
    },
    "required": ["name", "age", "field"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ANSWER_EBNF = 'root ::= "The answer is " ("yes" | "no") "." '


def _generate(server, prompt: str, n: int, **sp) -> list[dict]:
    with server.client() as c:
        r = c.post("/generate", json={"text": prompt, "sampling_params": {"n": n, "seed": 7, **sp}})
    assert r.status_code == 200, r.text
    out = r.json()
    return out if isinstance(out, list) else [out]


def _chat(server, content: str, **body) -> tuple[int, dict]:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": content}], "seed": 7, **body})
    return r.status_code, r.json()


@pytest.mark.slow
def test_json_schema_50_of_50_parse_and_validate(server, idle_invariants):
    outs = _generate(server, "Describe a famous scientist as JSON: ", 50, temperature=0.7,
                     max_new_tokens=96, json_schema=json.dumps(PERSON))
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), PERSON)
    assert len({o["text"] for o in outs}) > 10  # really sampled
    idle_invariants(server)


def test_regex_50_of_50_fullmatch(server):
    outs = _generate(server, "Call me at ", 50, temperature=0.7, max_new_tokens=30, regex=PHONE)
    for out in outs:
        assert re.fullmatch(PHONE, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert len({o["text"] for o in outs}) > 10


def test_ebnf_50_of_50(server):
    outs = _generate(server, "Is water wet? ", 50, temperature=0.7, max_new_tokens=20, ebnf=ANSWER_EBNF)
    texts = {o["text"] for o in outs}
    assert texts <= {"The answer is yes.", "The answer is no."}, texts


def test_a_completed_grammar_reports_the_eos_it_took_as_matched(server):
    """The grammar ends a request through the EOS it allows, also under ignore_eos and
    min_new_tokens: native ``matched`` is that token's id, as for a plain EOS (SGLang)."""
    finishes = []
    for extra in ({}, {"ignore_eos": True}, {"min_new_tokens": 16}):
        (out,) = _generate(server, "Is water wet? ", 1, temperature=0, max_new_tokens=20, ebnf=ANSWER_EBNF, **extra)
        finishes.append(out["meta_info"]["finish_reason"])
        assert finishes[-1] == {"type": "stop", "matched": out["output_ids"][-1]}, out
    assert finishes[0] == finishes[1] == finishes[2], finishes
    status, body = _chat(server, "Is water wet?", ebnf=ANSWER_EBNF, ignore_eos=True, temperature=0, max_tokens=20)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body


def test_grammar_rows_leave_the_rest_of_the_batch_untouched(server):
    """An unconstrained greedy request gives the same tokens alone and batched with
    constrained ones; a repeated constrained prompt reuses the radix cache."""
    import concurrent.futures as cf

    prompt = ("The moon is Earth's only natural satellite. It orbits at an average distance of "
              "384,400 km and always shows the same face to us. Write one sentence about the moon: ")
    (alone,) = _generate(server, prompt, 1, temperature=0, max_new_tokens=24)
    with cf.ThreadPoolExecutor(3) as ex:
        free = ex.submit(_generate, server, prompt, 1, temperature=0, max_new_tokens=24)
        constrained = [ex.submit(_generate, server, prompt, 4, temperature=0.7, max_new_tokens=30, regex=PHONE)
                       for _ in range(2)]
        (batched,) = free.result()
        for f in constrained:
            assert all(re.fullmatch(PHONE, o["text"]) for o in f.result())
    assert batched["output_ids"] == alone["output_ids"]
    (again,) = _generate(server, prompt, 1, temperature=0.7, max_new_tokens=30, regex=PHONE)
    assert again["meta_info"]["cached_tokens"] > 0


def test_streamed_json_schema_output_parses(server):
    import httpx

    body = {"text": "Describe a famous scientist as JSON: ", "stream": True,
            "sampling_params": {"temperature": 0.7, "seed": 3, "max_new_tokens": 96,
                                "json_schema": json.dumps(PERSON)}}
    with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    jsonschema.validate(json.loads(events[-1]["text"]), PERSON)


# --------------------------------------------------------------------------- C16
C16_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def schema_prefix(server):
    """``check(schema, text)``: True if ``text`` is a prefix of some output the JSON
    schema allows (xgrammar's matcher over the server's own tokenizer)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    with server.client() as c:
        info = c.get("/get_model_info").json()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(info["tokenizer_path"])))

    def check(schema: dict, text: str) -> bool:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return xgr.GrammarMatcher(compiled).accept_string(text)

    return check


def _stopped_valid_or_cut_prefix(schema: dict, texts_and_reasons: list[tuple[str, str]], prefix) -> int:
    """Every text that finished with "stop" parses (strict JSON) and validates; one cut
    by max_tokens ("length") is a valid prefix of the schema's language. Returns how many
    stopped. (SmolLM2-135M at temperature 1.0 sometimes never closes an unbounded string:
    the grammar cannot end it for the model.)"""
    stopped = 0
    for text, reason in texts_and_reasons:
        assert not re.search(r"[\x00-\x1f]", text), text
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            stopped += 1
        else:
            assert reason == "length" and prefix(schema, text), (reason, text)
    return stopped


@pytest.mark.slow
def test_c16_response_format_json_schema_is_enforced(server, schema_prefix):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": C16_SCHEMA}}
    status, body = _chat(server, "Tell me about a famous scientist.", response_format=fmt, temperature=1.0,
                         n=20, max_tokens=160)
    assert status == 200, body
    results = [(ch["message"]["content"], ch["finish_reason"]) for ch in body["choices"]]
    stopped = _stopped_valid_or_cut_prefix(C16_SCHEMA, results, schema_prefix)
    print(f"\nC16: {stopped} of 20 closed the object within 160 tokens")
    assert stopped >= 15
    bounded = {**C16_SCHEMA, "properties": {"name": {"type": "string", "maxLength": 40},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 130}}}
    fmt["json_schema"]["schema"] = bounded
    status, body = _chat(server, "Tell me about a famous scientist.", response_format=fmt, temperature=1.0,
                         n=20, max_tokens=160)
    for choice in body["choices"]:  # with bounded fields every sample closes
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), bounded)


def test_c16_json_object_and_malformed_formats(server):
    status, body = _chat(server, "Give me a JSON object with the name and age of a cat.",
                         response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    for fmt, param in [
        ({"type": "json_schema"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "schema": C16_SCHEMA}, "response_format.schema"),  # wrong placement
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "yes"}},  # not coerced to true
         "response_format.json_schema.schema"),
    ]:
        status, body = _chat(server, "hi", response_format=fmt, max_tokens=4)
        assert status == 400, (fmt, body)
        assert body["error"]["param"] == param, body


# --------------------------------------------------------------------------- C18
@pytest.mark.parametrize("string_schema", [
    {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
    {"type": "string", "pattern": "^[a-z]+$", "minLength": 5},
    {"type": "string", "format": "email", "maxLength": 10},
])
def test_c18_unenforceable_combinations_are_refused_not_dropped(server, string_schema):
    schema = {"type": "object", "properties": {"k": string_schema}, "required": ["k"],
              "additionalProperties": False}
    with server.client() as c:
        r = c.post("/generate", json={"text": "x", "sampling_params": {"json_schema": json.dumps(schema)}})
    assert r.status_code == 400 and "together with" in r.json()["error"]["message"], r.text
    fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}
    status, body = _chat(server, "Give one very long lowercase English word as k.", response_format=fmt)
    assert status == 400 and "together with" in body["error"]["message"], body


def test_c18_each_constraint_alone_is_enforced(server):
    for k_schema, check in [({"type": "string", "maxLength": 3}, lambda k: len(k) <= 3),
                            ({"type": "string", "pattern": "^[a-z]+$"}, lambda k: re.fullmatch("[a-z]+", k))]:
        schema = {"type": "object", "properties": {"k": k_schema}, "required": ["k"], "additionalProperties": False}
        outs = _generate(server, "Give one very long lowercase English word as k: ", 20, temperature=1.0,
                         max_new_tokens=64, json_schema=json.dumps(schema))
        for out in outs:
            value = json.loads(out["text"])["k"]
            assert check(value), (k_schema, value)


# --------------------------------------------------------------------------- C19
NESTED = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "genre": {"enum": ["drama", "comedy", "action", "documentary"]},
        "available": {"type": "boolean"},
        "director": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                      "born": {"type": "integer", "minimum": 1850, "maximum": 2020}},
                     "required": ["name", "born"], "additionalProperties": False},
        "cast": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"actor": {"type": "string", "maxLength": 30},
                                             "role": {"type": "string", "maxLength": 30}},
            "required": ["actor", "role"], "additionalProperties": False}},
        "languages": {"type": "array", "maxItems": 3, "items": {"enum": ["en", "fr", "de", "es"]}},
        "runtime_minutes": {"type": "integer", "minimum": 1, "maximum": 400},
        "budget_musd": {"type": "number", "minimum": 0, "maximum": 500},
        "sequel": {"type": "boolean"},
        "tagline": {"type": "string", "maxLength": 40},
    },
    "required": ["title", "year", "rating", "genre", "available", "director", "cast", "languages",
                 "runtime_minutes", "budget_musd", "sequel", "tagline"],
    "additionalProperties": False,
}


def _whitespace_outside_strings(text: str) -> int:
    """Longest run of whitespace characters outside JSON string values."""
    longest = run = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string, run = True, 0
            continue
        run = run + 1 if ch.isspace() else 0
        longest = max(longest, run)
    return longest


@pytest.mark.parametrize("topic", ["a science-fiction film", pytest.param("a film about the sea", marks=pytest.mark.slow),
                                   pytest.param("a comedy about cooks", marks=pytest.mark.slow)])
def test_c19_nested_schema_terminates_without_whitespace_runaway(server, topic):
    max_tokens = 1024
    outs = _generate(server, f"Describe {topic} as a JSON object: ", 1, temperature=0,
                     max_new_tokens=max_tokens, json_schema=json.dumps(NESTED))
    out = outs[0]
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    jsonschema.validate(json.loads(out["text"]), NESTED)
    assert _whitespace_outside_strings(out["text"]) <= 1
    assert out["meta_info"]["completion_tokens"] < max_tokens // 3


# --------------------------------------------------------------------------- C20
@pytest.mark.slow
def test_c20_strings_only_hold_legal_escapes(server, schema_prefix):
    schema = {"type": "object", "properties": {"poem": {"type": "string"}}, "required": ["poem"]}
    prompt = ("Write a short poem that quotes a Windows path, a regex with \\d and \\w, and a line "
              "with a tab, as JSON: ")
    outs = _generate(server, prompt, 50, temperature=1.0, max_new_tokens=192, json_schema=json.dumps(schema))
    results = [(o["text"], o["meta_info"]["finish_reason"]["type"]) for o in outs]
    stopped = _stopped_valid_or_cut_prefix(schema, results, schema_prefix)  # strict JSON, legal escapes
    print(f"\nC20: {stopped} of 50 closed the object within 192 tokens")
    assert stopped >= 35
    escapes = {m for text, _ in results for m in re.findall(r"\\(u[0-9a-fA-F]{4}|.)", text)}
    assert escapes <= {'"', "\\", "/", "b", "f", "n", "r", "t"} | {e for e in escapes if e.startswith("u")}


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("sampling", "param", "fragment"), [
    ({"regex": "[a-"}, "sampling_params.regex", "Unclosed"),
    ({"ebnf": 'root ::= "a" | '}, "sampling_params.ebnf", "does not compile"),
    ({"json_schema": "{not json"}, "sampling_params.json_schema", "not valid JSON"),
    ({"json_schema": '{"type": "objectx"}'}, "sampling_params.json_schema", "objectx"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "sampling_params", "at most one"),
    ({"json_schema": '{"type": "array", "uniqueItems": true}'}, "sampling_params.json_schema", "uniqueItems"),
    ({"json_schema": True}, "sampling_params.json_schema", "string or an object (got boolean)"),
    ({"json_schema": False}, "sampling_params.json_schema", "string or an object (got boolean)"),
])
def test_bad_grammar_is_400_with_the_compiler_message(server, sampling, param, fragment):
    with server.client() as c:
        r = c.post("/generate", json={"text": "x", "sampling_params": sampling})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and fragment in err["message"], err
        assert c.get("/health").status_code == 200
