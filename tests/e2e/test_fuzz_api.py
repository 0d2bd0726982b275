"""API fuzzing of every endpoint of a real server, from its own OpenAPI schema.

Two generators, one server (a tiny random-weight Llama with SmolLM2's tokenizer, so a
request costs milliseconds; context 128 tokens, so no generation runs long):

1. schemathesis strategies over ``/openapi.json``, for every operation: schema-valid
   cases (positive) and, for the operations with a body, schema-invalid ones (negative:
   changed types, negated constraints, off-by-one values, removed required fields,
   bodies that are not JSON at all).
2. hypothesis over transport-level bad input the schema cannot describe: malformed and
   non-UTF-8 JSON, wrong content types, non-object JSON, deep nesting, huge and
   non-finite numbers, odd Unicode, duplicate keys, huge strings, unknown paths and
   methods, each breaking one field of a valid request (streamed or not); and a
   deterministic sweep of every odd string / number through every string / numeric field.

Properties, for every response: no 5xx; a 4xx is JSON ``{"error": {"message", ...}}``
with ``code`` equal to the status; a 200 stream is well-formed SSE ending in
``data: [DONE]`` with no error event of code >= 500. After the run the server is
healthy and still generates, its log holds no traceback, and the idle invariant holds.

Steering (``_steer``): schema-valid cases use the served model name and, on /generate,
send ``text`` alone when both or neither of ``text`` / ``input_ids`` are drawn (rules
the schema cannot state), so they reach the scheduler. Cost bound: the fuzzers may pick ``n`` up to 128
and batches of any length; the cases lower ``n`` / ``best_of`` above 4 to 4 and keep
the first 4 prompts of a batch (values the server accepts either way; out-of-range
values are left alone), and the server's context of 128 tokens bounds every sample. The tests run in module order: the last one
checks the server after both fuzzers and prints the figures (``pytest -s`` shows them).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

CONTEXT = 128
MAX_N = 4  # cost bound on n / best_of and on the prompts of a batch
# Examples per operation and mode (a GET without parameters has 1) of the schemathesis run:
# the fast tier's, the full suite's and the soak's. A run must reach 5 x that many cases
# (3 bodies x 2 modes, less hypothesis's duplicates, plus the GETs).
SCHEMATHESIS_EXAMPLES = [pytest.param(10, id="10"), pytest.param(60, id="60", marks=pytest.mark.slow),
                         pytest.param(600, id="600", marks=pytest.mark.soak)]
TRANSPORT_EXAMPLES = [pytest.param(600, id="600"), pytest.param(6000, id="6000", marks=pytest.mark.soak)]
EXPECTED_CASES: collections.Counter[str] = collections.Counter()  # generator -> cases the tests that ran must reach
HTTP_TIMEOUT = 120.0


class FuzzLog:
    """Figures of the run: cases, the kinds of input tried, status codes per endpoint."""

    def __init__(self) -> None:
        self.cases: collections.Counter[str] = collections.Counter()  # generator -> cases
        self.kinds: collections.Counter[str] = collections.Counter()  # kind of input -> cases
        self.by_endpoint: dict[str, collections.Counter[int]] = collections.defaultdict(
            collections.Counter)  # "METHOD /path" -> status -> cases

    def record(self, generator: str, kind: str, endpoint: str, status: int) -> None:
        self.cases[generator] += 1
        self.kinds[f"{generator}: {kind}"] += 1
        self.by_endpoint[endpoint][status] += 1

    @property
    def statuses(self) -> collections.Counter[int]:
        return sum(self.by_endpoint.values(), collections.Counter())

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)

    def summary(self) -> str:
        return "\n".join([
            f"fuzz cases: {sum(self.cases.values())} ({dict(self.cases)})",
            f"kinds of input: {len(self.kinds)}",
            *(f"  {count:5d}  {kind}" for kind, count in sorted(self.kinds.items())),
            "status codes per endpoint:",
            *(f"  {endpoint}: {dict(sorted(c.items()))}" for endpoint, c in sorted(self.by_endpoint.items())),
            f"5xx responses: {self.server_errors}"])


LOG = FuzzLog()


# --------------------------------------------------------------------------- server
def _tiny_model(out: Path) -> str:
    """A 2-layer, hidden-64 Llama with random weights and SmolLM2's vocabulary (its
    tokenizer and chat template are passed with --tokenizer-path)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                         max_position_embeddings=CONTEXT, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).float().eval().save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def fuzz_server(server_factory, smollm2_dir, tmp_path_factory):
    model = _tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    with server_factory(model_path=model, tokenizer_path=smollm2_dir, page_size=8,
                        max_total_tokens=1024, max_running_requests=16) as srv:
        yield srv


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


# --------------------------------------------------------------------------- checks
def check_response(status: int, content_type: str, body: bytes, cut_short: bool = False,
                   request: str = "") -> None:
    """The per-response properties (see the module docstring)."""
    assert status < 500, f"server error {status}: {body[:500]!r} for {request}"
    if 400 <= status < 500:
        assert content_type.startswith("application/json"), f"{status} as {content_type}: {body[:300]!r}"
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"].strip(), error
        assert error["code"] == status, error
    elif content_type.startswith("text/event-stream"):
        _check_sse(body, cut_short)
    elif content_type.startswith("application/json"):
        json.loads(body)


def _check_sse(body: bytes, cut_short: bool) -> None:
    events = [e for e in body.decode().split("\n\n") if e.strip()]
    for event in events:
        assert event.startswith("data: "), event[:200]
        data = event.removeprefix("data: ")
        if data != "[DONE]":
            payload = json.loads(data)
            if "error" in payload:
                assert payload["error"]["code"] < 500, payload
    if not cut_short:
        assert events and events[-1] == "data: [DONE]", events[-1:]


def _steer(case: schemathesis.Case) -> None:
    """Bound the cost of every case; point schema-valid cases past the two rules the
    schema cannot state, so they reach the scheduler instead of all stopping at a 400:
    the served model name, and /generate's "exactly one of text / input_ids" (text is
    sent). Schema-invalid cases are left as generated (cost bound aside)."""
    body = case.body
    if not isinstance(body, dict):
        return
    _cap_cost(body)
    if case.meta.generation.mode is schemathesis.GenerationMode.POSITIVE:
        if "model" in body:
            body["model"] = "default"
        if case.operation.path == "/generate" and (body.get("text") is None) == (
                body.get("input_ids") is None):
            body.pop("input_ids", None)
            body["text"] = body.get("text") or "Hello"


def _cap_cost(body: dict) -> None:
    """Lower costly-but-valid ``n`` / ``best_of`` and batch sizes (module docstring)."""
    targets = [body]
    if isinstance(body.get("sampling_params"), dict):
        targets.append(body["sampling_params"])
    for target in targets:
        for key in ("n", "best_of"):
            value = target.get(key)
            if type(value) in (int, float) and MAX_N < value <= 128:
                target[key] = MAX_N
    for key in ("text", "prompt", "input_ids", "rid"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            del value[MAX_N:]


def _kind(case: schemathesis.Case) -> str:
    """What sort of input a schemathesis case is: its mode, and for a negative case the
    mutations applied (change_type, negate_constraints, value_violator,
    remove_required_property, syntax_fuzzing)."""
    mutations = sorted({m.operator.value for m in getattr(case.meta.phase.data, "mutations", ())})
    return f"{case.meta.generation.mode.value} {'+'.join(mutations)}".rstrip()


# --------------------------------------------------------------------------- 1. schemathesis
@pytest.mark.parametrize("examples", SCHEMATHESIS_EXAMPLES)
def test_schemathesis_fuzz_every_endpoint(fuzz_schema, examples: int) -> None:
    """Every operation of the schema, schema-valid and (where it has a body to break)
    schema-invalid cases. (schemathesis's own pytest plugin does not run under pytest 9,
    so its strategies are driven with hypothesis here.)"""
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    assert {op.label for op in operations} >= EXPECTED_OPERATIONS
    EXPECTED_CASES["schemathesis"] += 5 * examples
    for op in operations:
        modes = list(schemathesis.GenerationMode) if op.body else [schemathesis.GenerationMode.POSITIVE]
        for mode in modes:
            _fuzz_operation(op, mode, examples)


EXPECTED_OPERATIONS = {"GET /health", "GET /get_model_info", "GET /flush_cache", "POST /flush_cache",
                       "GET /debug/check_invariants", "GET /metrics", "POST /generate",
                       "GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions"}


def _fuzz_operation(op: schemathesis.APIOperation, mode: schemathesis.GenerationMode, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        _steer(case)
        note(case.as_curl_command())
        response = case.call(timeout=HTTP_TIMEOUT)
        LOG.record("schemathesis", _kind(case), op.label, response.status_code)
        content_type = (response.headers.get("content-type") or [""])[0]
        check_response(response.status_code, content_type, response.content, response.stream_cut_short)

    run()


# --------------------------------------------------------------------------- 2. transport-level
BASE_BODIES = {  # valid requests; the strategy breaks one field of one of them
    "/generate": {"text": "Hello", "rid": "fuzz", "return_logprob": True, "top_logprobs_num": 2,
                  "sampling_params": {"max_new_tokens": 4, "temperature": 0.5, "top_p": 0.9,
                                      "top_k": 5, "stop": ["x"], "stop_token_ids": [2],
                                      "seed": 1, "n": 2}},
    "/v1/completions": {"model": "default", "prompt": ["Hello", "Hi"], "max_tokens": 4,
                        "temperature": 0.5, "stop": "x", "seed": 1, "logprobs": 2, "n": 2,
                        "stream_options": {"include_usage": True}},
    "/v1/chat/completions": {"model": "default", "max_tokens": 4, "logprobs": True,
                             "top_logprobs": 2, "stop": ["x"],
                             "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text",
                                                                        "text": "Hello"}]}]},
}
PATHS = ["/health", "/get_model_info", "/flush_cache", "/debug/check_invariants", "/metrics",
         "/v1/models", *BASE_BODIES]
JSON_CT = "application/json"
ODD_STRINGS = [
    "\\ud800", "\\udfff", "a\\ud83dz",  # lone surrogates (JSON escapes)
    "\\u0000", "nul\\u0000inside", "\\ufeffbom", "\\uffff\\ufffe", "\\u202eright-to-left",
    "e\\u0301\\u0301\\u0301", "\\ud83d\\ude00\\ud83d\\udc68\\u200d\\ud83d\\udc69", "\\u00ff" * 2000,
    "", " ", "\\n\\r\\t", "<|im_start|>", "<|endoftext|>",
]
ODD_NUMBERS = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1e308", "-0", "0.5",
               str(2**63), str(-(2**63) - 1), "1" + "0" * 400, "-" + "9" * 400, "1e-400"]
WRONG_CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                       "multipart/form-data; boundary=x", "application/xml", "",
                       "application/json; charset=utf-16", "application/json; charset=latin-1",
                       "application/*", "*/*", "garbage/x y"]


def _fields(body: Any, of_type: type | tuple[type, ...] = object, path: tuple = ()) -> list[tuple]:
    """JSON paths (dict keys and list indices) of the values in ``body`` of ``of_type``."""
    out = [path] if path and isinstance(body, of_type) and not isinstance(body, bool) else []
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    for key, value in items:
        out += _fields(value, of_type, (*path, key))
    return out


def _replace(body: Any, path: tuple, raw: str) -> str:
    """``body`` as JSON text with the value at ``path`` replaced by raw JSON text ``raw``."""
    marker = "\u0001MARK\u0001"
    body = json.loads(json.dumps(body))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = marker
    return json.dumps(body).replace(json.dumps(marker), raw)


@st.composite
def bad_requests(draw: st.DrawFn) -> tuple[str, str, str, dict[str, str], bytes]:
    """(kind, method, path, headers, body) of one transport-level bad request."""
    path = draw(st.sampled_from(list(BASE_BODIES)))
    base = {**BASE_BODIES[path], "stream": draw(st.booleans())}
    valid = json.dumps(base)
    field = draw(st.sampled_from(_fields(base)))
    kind = draw(st.sampled_from(["malformed JSON", "invalid UTF-8", "non-object JSON",
                                 "wrong content-type", "deep nesting", "huge/non-finite number",
                                 "odd unicode string", "duplicate keys", "unknown path or method",
                                 "huge string"]))
    headers, method = {"content-type": JSON_CT}, "POST"
    if kind == "malformed JSON":
        cut = draw(st.integers(0, len(valid) - 1))
        body = (valid[:cut] + draw(st.sampled_from(["", "}", ",", "]]", "'", "\\", "{{"]))).encode()
    elif kind == "invalid UTF-8":
        junk = draw(st.binary(min_size=1, max_size=8).filter(lambda b: not _is_utf8(b)))
        body = _replace(base, field, '"\u0002"').encode().replace(b"\x02", junk)
    elif kind == "non-object JSON":
        body = draw(st.sampled_from(["[]", "[1, 2]", '"text"', "42", "null", "true", "[{}]",
                                     json.dumps([base])])).encode()
    elif kind == "wrong content-type":
        headers = {"content-type": draw(st.sampled_from(WRONG_CONTENT_TYPES))}
        body = draw(st.sampled_from([valid, "text=Hello", "--x\r\n\r\n--x--"])).encode()
    elif kind == "deep nesting":
        depth = draw(st.integers(100, 20000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        body = _replace(base, field, opener * depth + "1" + closer * depth).encode()
    elif kind == "huge/non-finite number":
        field = draw(st.sampled_from(_fields(base, (int, float))))
        body = _replace(base, field, draw(st.sampled_from(ODD_NUMBERS))).encode()
    elif kind == "odd unicode string":
        field = draw(st.sampled_from(_fields(base, str)))
        body = _replace(base, field, '"' + draw(st.sampled_from(ODD_STRINGS)) + '"').encode()
    elif kind == "duplicate keys":
        body = (valid[:-1] + ', "model": 7, "max_tokens": "x", "text": null}').encode()
    elif kind == "unknown path or method":
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "POST"]))
        path = draw(st.sampled_from([*PATHS, "/nope", "/v1", "/v1/models/x", "/generate/", "//generate",
                                     "/%ff", "/v1/completions?x=%zz"]))
        body = valid.encode()
    else:  # huge string: far beyond the context, or in a field that is no prompt
        body = _replace(base, field, json.dumps("word " * draw(st.integers(200, 40000)))).encode()
    return kind, method, path, headers, body


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("examples", TRANSPORT_EXAMPLES)
def test_transport_level_bad_input(fuzz_server, examples: int) -> None:
    EXPECTED_CASES["transport"] += examples
    with httpx.Client(base_url=fuzz_server.url, timeout=HTTP_TIMEOUT) as client:

        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(bad_requests())
        def run(request: tuple[str, str, str, dict[str, str], bytes]) -> None:
            kind, method, path, headers, body = request
            note(f"{kind}: {method} {path} {headers} {body[:300]!r}")
            r = client.request(method, path, headers=headers, content=body)
            endpoint = f"{method} {path}" if kind != "unknown path or method" else "other method or path"
            LOG.record("transport", kind, endpoint, r.status_code)
            check_response(r.status_code, r.headers.get("content-type", ""), r.content)

        run()


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("PUT", "/generate", {"POST"}), ("DELETE", "/health", {"GET"}),
    ("TRACE", "/v1/chat/completions", {"POST"}), ("PATCH", "/flush_cache", {"GET", "POST"})])
def test_wrong_method_is_405_naming_the_allowed_ones(fuzz_server, method: str, path: str,
                                                     allowed: set[str]) -> None:
    """Regression (found by schemathesis): the JSON error handler dropped the ``Allow``
    header that a 405 must carry (RFC 9110)."""
    r = httpx.request(method, f"{fuzz_server.url}{path}", timeout=30)
    check_response(r.status_code, r.headers["content-type"], r.content)
    assert r.status_code == 405
    assert {m.strip() for m in r.headers["allow"].split(",")} == allowed


def test_every_field_with_every_odd_value(fuzz_server) -> None:
    """The deterministic part of 2.: each odd string in each string field and each odd
    number in each numeric field of each base body, one at a time."""
    EXPECTED_CASES["sweep"] += 300
    with httpx.Client(base_url=fuzz_server.url, timeout=HTTP_TIMEOUT) as client:
        for path, base in BASE_BODIES.items():
            for kind, of_type, values in [("odd unicode string", str, [f'"{v}"' for v in ODD_STRINGS]),
                                          ("huge/non-finite number", (int, float), ODD_NUMBERS)]:
                for field in _fields(base, of_type):
                    for value in values:
                        body = _replace(base, field, value).encode()
                        r = client.post(path, headers={"content-type": JSON_CT}, content=body)
                        LOG.record("sweep", kind, f"POST {path}", r.status_code)
                        check_response(r.status_code, r.headers.get("content-type", ""), r.content,
                                       request=f"POST {path} {body[:300]!r}")


# --------------------------------------------------------------------------- after both
@pytest.mark.parametrize("tier", ["suite", pytest.param("soak", marks=pytest.mark.soak)])
def test_server_sound_after_fuzzing(fuzz_server, idle_invariants, tier: str) -> None:
    """Runs last in either tier (``make soak`` selects only soak-marked tests)."""
    print("\n" + LOG.summary())
    for generator in ("schemathesis", "transport", "sweep"):  # each ran first, and in full
        assert EXPECTED_CASES[generator] > 0, f"the {generator} test did not run first"
        assert LOG.cases[generator] >= EXPECTED_CASES[generator], (generator, LOG.cases, EXPECTED_CASES)
    assert LOG.server_errors == 0
    assert httpx.get(f"{fuzz_server.url}/health", timeout=30).status_code == 200
    idle_invariants(fuzz_server)
    r = httpx.post(f"{fuzz_server.url}/generate", timeout=60,
                   json={"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3, r.text
    assert "Traceback" not in fuzz_server.log(), fuzz_server.log()[-3000:]
