"""Tool calling on the chat route without a model (radixlm.runtime.server.tool_calling):
the default rendering of tools, calls and tool results for a template without tools, the
hand-over to a template with them, and streamed deltas that add up to the unstreamed message."""

from __future__ import annotations

import json

import pytest

from radixlm.runtime.server.protocol import ChatCompletionRequest
from radixlm.runtime.server.tokenizer_manager import InvalidRequest
from radixlm.runtime.server.tool_calling import ToolCallStream, plan_tools, render_chat
from radixlm.runtime.text.tool_parsers import get_parser

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
WITH_TOOLS = "{% if tools %}{{ tools }}{% endif %}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def _request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **body})


HISTORY = [
    {"role": "user", "content": "What is 2 + 3 and 4 + 5?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 4, "b": 5}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9"},
]


def test_default_rendering_for_a_template_without_tools():
    messages, tools = render_chat(_request(messages=HISTORY, tools=[ADD]), get_parser("hermes"), CHATML)
    assert tools is None  # the template would ignore them: they are in the system message
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("# Tools\n") and json.dumps(ADD) in system and "<tool_call>" in system
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call>')
    assert messages[3]["content"] == "<tool_response>\n5\n</tool_response>\n<tool_response>\n9\n</tool_response>"


def test_the_block_ends_an_existing_system_message_in_the_parsers_format():
    body = _request(messages=[{"role": "developer", "content": "Be terse."}, *HISTORY[:2]], tools=[ADD])
    messages, _ = render_chat(body, get_parser("mistral"), CHATML)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be terse.\n\n# Tools\n")
    assert "[TOOL_CALLS]" in messages[0]["content"]
    assert messages[2]["content"] == ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}, '
                                      '{"name": "add", "arguments": {"a": 4, "b": 5}}]')


def test_a_template_with_tools_gets_them_and_the_calls_as_objects():
    messages, tools = render_chat(_request(messages=HISTORY, tools=[ADD]), get_parser("hermes"), WITH_TOOLS)
    assert tools == [ADD]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert messages[2]["tool_call_id"] == "call_1"


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_streamed_deltas_add_up_to_the_message(parser):
    fmt = get_parser(parser)
    plan = plan_tools(_request(messages=HISTORY[:1], tools=[ADD]).tools, "auto", True, fmt)
    text = "I will add them.\n" + fmt.calls_text([("add", '{"a": 2, "b": 3}'), ("add", '{"a": 4, "b": 5}')])
    content, calls = plan.message(text)
    assert content == "I will add them."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]
    stream, deltas = ToolCallStream(fmt), []
    for i, ch in enumerate(text):
        deltas += stream.push(ch, final=i == len(text) - 1)
    streamed_content = "".join(d.get("content", "") for d in deltas)
    entries = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    headers = [e for e in entries if "id" in e]
    assert streamed_content == content
    assert [(h["index"], h["type"], h["function"]) for h in headers] == [
        (0, "function", {"name": "add", "arguments": ""}), (1, "function", {"name": "add", "arguments": ""})]
    for k, call in enumerate(calls):
        pieces = [e["function"]["arguments"] for e in entries if e["index"] == k and "id" not in e]
        assert len(pieces) > 3 and "".join(pieces) == call["function"]["arguments"]
    first_piece = next(i for i, e in enumerate(entries) if "id" not in e)
    assert "id" in entries[first_piece - 1]  # the name comes before any argument


def test_plan_needs_tools_and_a_choice_other_than_none():
    tools = _request(messages=HISTORY[:1], tools=[ADD]).tools
    fmt = get_parser("hermes")
    assert plan_tools(None, None, None, fmt) is None
    assert plan_tools(tools, "none", None, fmt) is None
    assert plan_tools(tools, None, None, fmt) is not None


def test_a_grammar_that_does_not_compile_is_a_400_naming_tools(monkeypatch):
    tools = _request(messages=HISTORY[:1], tools=[ADD]).tools
    fmt = get_parser("hermes")
    monkeypatch.setattr(type(fmt), "structural_tag", lambda *a: '{"type": "structural_tag", "format": 3}')
    with pytest.raises(InvalidRequest) as err:
        plan_tools(tools, "required", None, fmt)
    assert err.value.param == "tools"
