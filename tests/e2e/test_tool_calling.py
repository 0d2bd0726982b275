"""Tool calling end to end with the official ``openai`` client and SmolLM2 on the CPU (the
shared ``server``; its chat template has no tools section, so the default tools block and
the hermes format are used): every ``tool_choice``, streamed and not, parallel calls, a
tool-result turn, the ``parse`` / ``stream`` helpers, and the 400s.

Sampled tests are seeded, so a run is reproducible on one machine."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel

MODEL = "default"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as c:
        yield c


def _valid(call) -> tuple[str, dict]:
    """(name, arguments) of a call, asserting they validate against the tool's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return call.function.name, args


def _deltas(client, **body) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, calls as (name, arguments text), finish_reason) of a raw stream,
    accumulated delta by delta: a call's id, type and name come first, then argument
    fragments, by index."""
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **body):
        (choice,) = chunk.choices
        delta, finish = choice.delta, choice.finish_reason or finish
        if delta.content:
            content = (content or "") + delta.content
        for entry in delta.tool_calls or []:
            if entry.id is not None:
                assert entry.index == len(calls) and entry.function.name and entry.function.arguments == ""
                calls[entry.index] = [entry.id, entry.function.name, ""]
            else:
                calls[entry.index][2] += entry.function.arguments
    return content, [(name, args) for _, name, args in calls.values()], finish


def _streamed(client, **body) -> tuple[str | None, list[tuple[str, dict]], str]:
    """(content, calls, finish_reason) accumulated by the client's stream helper."""
    with client.chat.completions.stream(model=MODEL, **body) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    return choice.message.content, [_valid(c) for c in choice.message.tool_calls or []], choice.finish_reason


class Add(BaseModel):
    a: int
    b: int


ADD_TOOL = [openai.pydantic_function_tool(Add, name="add", description="Add two integers")]
ADD_ASK = [{"role": "user", "content": "What is 5 plus 6?"}]
ONE = dict(messages=ASK, tools=TOOLS, max_tokens=64, temperature=0, parallel_tool_calls=False)
NAMED = {"type": "function", "function": {"name": "add"}}
PARALLEL = dict(messages=[{"role": "user", "content": "Add 2 and 3, then add 4 and 5."}], tools=TOOLS[1:],
                tool_choice="required", max_tokens=80, temperature=0)
FIRST_TURN = dict(messages=[{"role": "user", "content": "What is 2 plus 40?"}], tools=TOOLS, tool_choice=NAMED,
                  max_tokens=48, temperature=0)


@pytest.fixture(scope="module")
def replies(client) -> dict:
    """The replies the tests below check, requested concurrently (the server batches them:
    one CPU pass for all instead of one each)."""
    create = client.chat.completions.create
    requests = {
        "required": lambda: create(model=MODEL, tool_choice="required", **ONE),
        "required_helper": lambda: _streamed(client, tool_choice="required", **ONE),
        "required_deltas": lambda: _deltas(client, tool_choice="required", **ONE),
        "named": lambda: create(model=MODEL, tool_choice=NAMED, **ONE),
        "named_helper": lambda: _streamed(client, tool_choice=NAMED, **ONE),
        "parallel": lambda: create(model=MODEL, **PARALLEL),
        "parallel_deltas": lambda: _deltas(client, **PARALLEL),
        "parallel_false": lambda: create(model=MODEL, parallel_tool_calls=False, **PARALLEL),
        "auto": lambda: create(model=MODEL, messages=[{"role": "user", "content": "Use the add tool to add 3 and 4."}],
                               tools=TOOLS, max_tokens=40, temperature=0.7, n=8, seed=1),
        "none": lambda: create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16,
                               temperature=0),
        "first_turn": lambda: create(model=MODEL, **FIRST_TURN),
        "parse": lambda: client.chat.completions.parse(model=MODEL, messages=ADD_ASK, tools=ADD_TOOL,
                                                       tool_choice="required", parallel_tool_calls=False,
                                                       max_tokens=48, temperature=0),
        "parse_stream": lambda: _helper_events(client),
    }
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {name: pool.submit(request) for name, request in requests.items()}
        return {name: future.result() for name, future in futures.items()}


def _helper_events(client) -> list:
    with client.chat.completions.stream(model=MODEL, messages=ADD_ASK, tools=ADD_TOOL, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=48, temperature=0) as stream:
        return [e for e in stream if e.type == "tool_calls.function.arguments.done"]


def _message(reply) -> tuple[str | None, list[tuple[str, dict]], str]:
    choice = reply.choices[0]
    return choice.message.content, [_valid(c) for c in choice.message.tool_calls or []], choice.finish_reason


def test_required_and_named_calls_validate_streamed_or_not(replies, server, idle_invariants):
    for name in ("required", "named"):
        for content, calls, finish in (_message(replies[name]), replies[f"{name}_helper"]):
            assert finish == "tool_calls" and content is None and len(calls) == 1, (name, content, calls)
    assert _message(replies["named"])[1][0][0] == "add"
    idle_invariants(server)


def test_streamed_deltas_add_up_to_the_unstreamed_calls(replies):
    r = replies["required"].choices[0]
    content, calls, finish = replies["required_deltas"]
    assert [(c.function.name, c.function.arguments) for c in r.message.tool_calls] == calls
    assert (content, finish) == (r.message.content, r.finish_reason) == (None, "tool_calls")


def test_parallel_calls_and_parallel_false(replies):
    """SmolLM2 under "required" calls the tool again and again when it may (until
    max_tokens: a call cut short stays text, and is streamed as far as it got);
    ``parallel_tool_calls: false`` stops it after one call."""
    many = replies["parallel"].choices[0]
    _, calls, finish = _message(replies["parallel"])
    assert calls[:2] == [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})], many.message
    assert len({c.id for c in many.message.tool_calls}) == len(calls)
    _, streamed, streamed_finish = replies["parallel_deltas"]
    assert streamed[:len(calls)] == [(c.function.name, c.function.arguments) for c in many.message.tool_calls]
    assert streamed_finish == finish
    _, one, finish = _message(replies["parallel_false"])
    assert finish == "tool_calls" and one == [("add", {"a": 2, "b": 3})]


def test_auto_calls_validate_and_none_never_calls(replies):
    """Under "auto" the model may answer in text; a call it opens is generated under the
    tool's schema. Under "none" nothing is read as a call."""
    auto = replies["auto"]
    assert any(c.message.tool_calls for c in auto.choices), [c.message.content for c in auto.choices]
    for choice in auto.choices:
        for call in choice.message.tool_calls or []:
            _valid(call)
        assert "<tool_call>" not in (choice.message.content or "")  # every opened call parsed
    none = replies["none"].choices[0]
    assert none.message.tool_calls is None and none.message.content and none.finish_reason in ("stop", "length")


def test_a_tool_result_turn_reuses_the_history(client, replies):
    first = replies["first_turn"]
    message = first.choices[0].message
    (call,) = message.tool_calls
    args = json.loads(call.function.arguments)
    history = [*FIRST_TURN["messages"], message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert second.choices[0].message.content
    # the first turn's prompt is a prefix of the second's: its whole pages come from the cache
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16


def test_parse_and_stream_helpers_with_pydantic_tools(replies):
    (call,) = replies["parse"].choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Add)
    assert [(e.name, e.parsed_arguments) for e in replies["parse_stream"]] == [
        ("add", call.function.parsed_arguments)]


BAD = [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tool_choice={"type": "function", "function": {"name": "add"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "delete"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "no-such-type"}}}}}]), "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "two words"}}]), "tools.0.function.name"),
    (dict(tools=[]), "tools"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}), None),
    (dict(messages=[*ASK, {"role": "tool", "tool_call_id": "call_nope", "content": "1"}]), "messages"),
    (dict(messages=[*ASK, {"role": "tool", "content": "1"}]), "messages.1"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_tool_requests_are_400s_naming_the_field(client, server, extra, param):
    for stream in (False, True):
        body = {"messages": ASK, "max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, stream=stream, **body)
        assert err.value.status_code == 400
        assert err.value.body["param"] == param, err.value.body
        assert err.value.body["message"]
    with server.client() as c:
        assert c.get("/health").status_code == 200


@pytest.mark.slow
def test_required_50_of_50_calls_validate_at_temperature_0_7(client, server, idle_invariants):
    """SmolLM2 (weak at tools) under "required": every one of 50 sampled calls parses and
    validates against its tool's schema."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris, and what is 3 plus 4?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0.7, n=50, seed=3)
    calls = []
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        calls.append(_valid(call))
    assert len({json.dumps(c) for c in calls}) > 3  # really sampled
    assert {name for name, _ in calls} == {"get_weather", "add"}
    idle_invariants(server)
