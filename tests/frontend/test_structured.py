"""Constrained ``gen`` through the DSL: regex and JSON-schema outputs parse, sampled at
temperature 0.7, on both backends."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixlm.frontend import assistant, function, gen, system, user

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                               "maxItems": 3}},
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
RUNS = 10


@function
def phone(s, who):
    s += user(f"Make up a US phone number for {who}.")
    s += assistant(gen("number", max_tokens=20, regex=PHONE))


@function
def person(s, hint):
    s += user(f"Describe {hint} as JSON with name, age and hobbies.")
    # Room for the longest object the schema allows even at one token per character
    # (24 + 3 x 16 characters of strings and ~30 of structure): 80 tokens ran out once at
    # temperature 0.7 (a cut, unterminated string), which is max_tokens, not the grammar.
    s += assistant(gen("json", max_tokens=160, json_schema=json.dumps(PERSON)))


def test_regex_gen_fullmatches(endpoint):
    states = phone.run_batch([{"who": f"shop number {i}"} for i in range(RUNS)], backend=endpoint,
                             temperature=0.7)
    numbers = [s["number"] for s in states]
    assert all(re.fullmatch(PHONE, n) for n in numbers), numbers
    assert len(set(numbers)) > 1  # sampled, not one forced string


def test_json_schema_gen_validates(endpoint):
    states = person.run_batch([{"hint": f"person number {i}"} for i in range(RUNS)], backend=endpoint,
                              temperature=0.7)
    records = [json.loads(s["json"]) for s in states]
    for record in records:
        jsonschema.validate(record, PERSON)
    assert len({r["name"] for r in records}) > 1


def test_a_dict_schema_is_sent_as_json(endpoint):
    @function
    def age(s):
        s += user("How old is a ten year old child? Answer as JSON.")
        s += assistant(gen("json", max_tokens=20, json_schema={"type": "object", "properties": {
            "age": {"type": "integer", "maximum": 200}}, "required": ["age"], "additionalProperties": False}))

    assert json.loads(age.run(temperature=0, backend=endpoint)["json"]) == {"age": 10}


@pytest.mark.parametrize("program,check", [
    (phone, lambda s: re.fullmatch(PHONE, s["number"])),
    (person, lambda s: jsonschema.validate(json.loads(s["json"]), PERSON) is None),
], ids=["regex", "json_schema"])
def test_openai_backend_constrains_too(openai_backend, program, check):
    kwargs = {"who": "a bakery"} if program is phone else {"hint": "a chef"}
    state = program.run(**kwargs, temperature=0.7, backend=openai_backend)
    assert check(state)


def test_two_constraints_are_refused():
    with pytest.raises(ValueError, match="at most one"):
        gen("x", regex="a+", json_schema="{}")


def test_a_regex_in_the_grammar_compilers_dialect_is_not_refused_by_the_client(endpoint):
    """``(?<year>...)`` is a named group for xgrammar (the server compiles it) but an error
    for Python's ``re``: the DSL sends it instead of raising re.error."""
    @function
    def year(s):
        s += user("In which year did the Apollo 11 mission land on the Moon?")
        s += assistant(gen("year", max_tokens=8, regex=r"(?<year>[12][0-9]{3})"))

    assert re.fullmatch(r"[12][0-9]{3}", year.run(temperature=0, backend=endpoint)["year"])


ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}


@function
def calculator(s, question):
    s += system("You can call add(a, b) to add two integers: " + json.dumps(ADD_TOOL))
    s += user(question)
    s += assistant(gen("calls", max_tokens=64, tools=[ADD_TOOL], tool_choice="required", parallel_tool_calls=False))


def test_gen_with_tools_returns_parsed_calls(endpoint):
    """``gen(tools=...)``: the variable holds the calls the server parsed (arguments
    decoded, under the tool's schema), the state's text the call as the model wrote it."""
    states = calculator.run_batch([{"question": f"What is {i} plus {i + 7}?"} for i in range(4)], backend=endpoint,
                                  temperature=0.7)
    for state in states:
        (call,) = state["calls"]
        assert call["name"] == "add" and call["id"].startswith("call_")
        jsonschema.validate(call["arguments"], ADD_TOOL["function"]["parameters"])
        assert f'"arguments": {json.dumps(call["arguments"])}' in state.messages()[-1]["content"]
        assert state.get_meta_info("calls")["tool_calls"][0]["function"]["name"] == "add"


def test_gen_with_tools_refuses_other_constraints_and_the_openai_backend(openai_backend):
    with pytest.raises(ValueError, match="tools"):
        gen("x", tools=[ADD_TOOL], regex="a+")
    with pytest.raises(NotImplementedError, match="native API"):
        calculator.run(question="What is 1 plus 2?", backend=openai_backend)
