"""Tool-call formats (radixlm.runtime.text.tool_parsers): each parser on recorded outputs of
its model family, malformed ones included (they stay text); streamed scans that add up to
the final one; and each format's grammar, which accepts the format's own calls and refuses
arguments outside the schema."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from radixlm.runtime.text.tool_parsers import (
    TOOL_CALL_PARSERS,
    CallText,
    ToolCallFormat,
    detect_parser,
    get_parser,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}


def _split(name: str, text: str) -> tuple[str, list[tuple[str, dict]], list[str]]:
    """(text outside the calls, valid calls as (name, arguments), raw texts of invalid calls)."""
    segments = get_parser(name).scan(text, final=True)
    content = "".join(s for s in segments if isinstance(s, str))
    calls = [(s.name, json.loads(s.arguments)) for s in segments if isinstance(s, CallText) and s.valid]
    bad = [s.raw for s in segments if isinstance(s, CallText) and not s.valid]
    return content, calls, bad


# Outputs as the model families write them (Hermes-2-Pro / Qwen2.5, Llama-3.1-8B-Instruct,
# Mistral-7B-Instruct-v0.3), and broken variants.
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "days": 2})], 0),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>',
     "Let me check.\n\n", [("get_weather", {"city": "Paris", "days": 1}), ("get_weather", {"city": "Rome", "days": 1})],
     0),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',  # key order
     "", [("get_weather", {"city": "Oslo"})], 0),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', "",  # no closing tag at the end
     [("get_weather", {"city": "Oslo"})], 0),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"\n</tool_call>', "", [], 1),
    ("hermes", "<tool_call>\nnot json\n</tool_call> after", " after", [], 1),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>', "", [], 1),  # not an object
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", [], 0),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "",
     [("get_weather", {"city": "Paris", "days": 3})], 0),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "",
     [("a", {}), ("b", {"x": 1})], 0),
    ("llama3_json", 'Sure. {"name": "get_weather", "parameters": {"city": ', "Sure. ", [], 1),
    ("llama3_json", "The answer is {1, 2}.", "The answer is {1, 2}.", [], 0),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}, '
     '{"name": "get_weather", "arguments": {"city": "Lyon", "days": 2}}]', "",
     [("get_weather", {"city": "Paris", "days": 1}), ("get_weather", {"city": "Lyon", "days": 2})], 0),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "f", "arguments": {}}]', "Checking. ", [("f", {})], 0),
    ("mistral", "[TOOL_CALLS] sorry", "", [], 1),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": ', "", [], 1),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls", "bad"), RECORDED)
def test_recorded_outputs(parser, text, content, calls, bad):
    got_content, got_calls, got_bad = _split(parser, text)
    assert got_calls == calls
    assert len(got_bad) == bad
    assert got_content == content
    if bad:  # a malformed call is kept whole, to be shown as text
        assert all(raw in text for raw in got_bad)


def test_arguments_are_the_generated_text_when_the_name_comes_first():
    text = '<tool_call>\n{"name": "f", "arguments": {"b": 1,  "a": "é"}}\n</tool_call>'
    (call,) = [s for s in get_parser("hermes").scan(text, final=True) if isinstance(s, CallText)]
    assert call.arguments == '{"b": 1,  "a": "é"}'
    text = '<tool_call>\n{"arguments": {"b": 1}, "name": "f"}\n</tool_call>'
    (call,) = [s for s in get_parser("hermes").scan(text, final=True) if isinstance(s, CallText)]
    assert call.arguments == '{"b": 1}'


STREAMED = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "f", "arguments": {"x": {"y": [1, {"z": 2}]}}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Pa}ris", "days": 2}}; '
                   '{"name": "f", "parameters": {"x": {"y": [1, {"z": 2}]}}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa}ris", "days": 2}}, '
               '{"name": "f", "arguments": {"x": {"y": [1, {"z": 2}]}}}]',
}


@pytest.mark.parametrize("parser", sorted(STREAMED))
def test_streamed_scans_grow_into_the_final_one(parser):
    """Scanned after every character, each call's name appears once whole and its
    arguments only grow, as prefixes of the final arguments; text outside the calls grows
    the same way, and no marker character is ever shown as text."""
    fmt, text = get_parser(parser), STREAMED[parser]
    final = fmt.scan(text, final=True)
    final_calls = [s for s in final if isinstance(s, CallText)]
    final_content = "".join(s for s in final if isinstance(s, str))
    assert [c.valid for c in final_calls] == [True, True]
    for cut in range(len(text) + 1):
        partial = fmt.scan(text[:cut], final=False)
        calls = [s for s in partial if isinstance(s, CallText)]
        content = "".join(s for s in partial if isinstance(s, str))
        assert final_content.startswith(content), (cut, content)
        assert "<" not in content and "[" not in content and "{" not in content
        for call, done in zip(calls, final_calls, strict=False):
            assert call.name in (None, done.name), cut
            assert done.arguments.startswith(call.arguments), (cut, call.arguments)


def _matcher(grammar: str) -> xgr.GrammarMatcher:
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "</s>"]  # one token per character
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(grammar))


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
@pytest.mark.parametrize("mode", ["named", "required", "auto"])
def test_grammar_accepts_the_formats_own_calls_only_with_valid_arguments(parser, mode):
    fmt = get_parser(parser)
    grammar = fmt.structural_tag([("get_weather", WEATHER), ("noop", {"type": "object"})], mode, parallel=True)
    good = fmt.calls_text([("get_weather", '{"city": "Paris", "days": 2}')])
    if mode == "auto":
        good = "Let me look. " + good
    matcher = _matcher(grammar)
    assert matcher.accept_string(good), good
    for bad_args in ('{"city": "Paris"}', '{"city": 1, "days": 2}', '{"city": "Paris", "days": 2, "x": 0}'):
        bad = fmt.calls_text([("get_weather", bad_args)])
        assert not _matcher(grammar).accept_string(bad), bad
    assert not _matcher(grammar).accept_string(fmt.calls_text([("delete_all", "{}")]))


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_parallel_false_allows_one_call(parser):
    fmt = get_parser(parser)
    two = fmt.calls_text([("noop", "{}"), ("noop", "{}")])
    one = fmt.calls_text([("noop", "{}")])
    for parallel, accepted in ((True, True), (False, False)):
        assert _matcher(fmt.structural_tag([("noop", {"type": "object"})], "required", parallel)
                        ).accept_string(two) is accepted
    assert _matcher(fmt.structural_tag([("noop", {"type": "object"})], "required", False)).accept_string(one)


def test_required_allows_no_text_and_auto_allows_text_without_calls():
    fmt = get_parser("hermes")
    functions = [("noop", {"type": "object"})]
    assert not _matcher(fmt.structural_tag(functions, "required", True)).accept_string("Hello")
    auto = _matcher(fmt.structural_tag(functions, "auto", True))
    assert auto.accept_string("Hello, no call needed.")
    assert auto.accept_token(96)  # then the stop token ends it


@pytest.mark.parametrize(("template", "parser"), [
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", "hermes"),
    ("{%- if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    (None, "hermes"),
])
def test_detect_parser_from_the_chat_template(template, parser):
    assert detect_parser(template) == parser
    assert get_parser("auto", template).name == parser


def test_unknown_parser_is_a_value_error():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_parser("pythonic")


def test_argument_grammar_keeps_non_ascii_names_and_values():
    """Latin-1 characters in property names and enum values survive the grammar's text
    form: "städt" is not read back as "st" + U+0E4D + "t" (xgrammar prints \\xe4, which
    its parser reads greedily when a hex digit follows)."""
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"städt": {"type": "string", "enum": ["München", "東京"]},
                                               "gebäude": {"type": "integer"}}, "required": ["städt"]}
    grammar = xgr.Grammar.from_ebnf(ToolCallFormat._schema(schema).grammar)
    assert _is_grammar_accept_string(grammar, '{"städt": "München"}')
    assert _is_grammar_accept_string(grammar, '{"städt": "東京", "gebäude": 3}')
    assert not _is_grammar_accept_string(grammar, '{"st\u0e4dt": "München"}')
    assert not _is_grammar_accept_string(grammar, '{"städt": "Berlin"}')


def test_empty_parameters_schema_means_an_object():
    """``"parameters": {}`` (a function without parameters) constrains the arguments to an
    object, as a missing ``parameters`` does, not to any JSON value."""
    from radixlm.runtime.server.protocol import FunctionDefinition

    assert FunctionDefinition(name="f", parameters={}).arguments_schema() == {"type": "object"}
    props = {"properties": {"x": {"type": "integer"}}}
    assert FunctionDefinition(name="f", parameters=props).arguments_schema() == {**props, "type": "object"}
