"""A tool-calling agent over radixlm's OpenAI API: the official ``openai`` client runs a
multi-step tool loop (a calculator and a fact lookup) for several conversations at once.

    .venv/bin/python examples/agent_tools.py                     # starts its own server
    .venv/bin/python examples/agent_tools.py --url http://127.0.0.1:30000

Each conversation asks two questions. For each one the agent loops: it sends the history
with the tools; the model's calls (``message.tool_calls``) are run here and their results
appended as ``role: "tool"`` messages, until the model answers in text or --max-steps
is reached. A 135M model rarely decides to call a tool by itself, so the first step of
each question uses ``tool_choice: "required"`` (the model still picks the tool and its
arguments, under the tools' grammar), later steps ``"auto"``, and the last one ``"none"``.

Every turn prints ``usage.prompt_tokens_details.cached_tokens``: the conversation so far is
a prefix of the next request, so its KV pages come from the radix cache and the cached
count grows turn after turn (whole 16-token pages; the tools' system block is shared by
every conversation).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import operator
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai

from radixlm.runtime.bench.server_process import ServerProcess

FACTS = {
    "eiffel tower height in meters": "330",
    "moons of mars": "2 (Phobos and Deimos)",
    "population of canada in millions": "40",
    "boiling point of water in celsius": "100",
}
TOOLS = [
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression (numbers, + - * / and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "pattern": r"[0-9][0-9+\-*/(). ]{0,20}"}},
            "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Look up a fact.",
        "parameters": {"type": "object", "properties": {"topic": {"enum": sorted(FACTS)}},
                       "required": ["topic"], "additionalProperties": False}}},
]
CONVERSATIONS = [
    ["How tall is the Eiffel Tower in meters?", "What is 330 times 3?"],
    ["How many moons does Mars have?", "What is 17 times 23?"],
    ["What is the population of Canada in millions?", "What is 40 plus 2?"],
    ["At what temperature does water boil in Celsius?", "What is 100 divided by 4?"],
]
SYSTEM = "You are a careful assistant. Use the tools to look up facts and to calculate."

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float:
    """The value of an arithmetic expression. Raises ValueError for anything else,
    SyntaxError if it does not parse, ZeroDivisionError."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    return value(ast.parse(expression, mode="eval").body)


def run_tool(name: str, arguments: str) -> str:
    """The result of one call, as the text of its tool message (errors included)."""
    try:
        args = json.loads(arguments)
        if name == "calculate":
            return f"{calculate(args['expression']):g}"
        if name == "lookup":
            return FACTS[args["topic"]]
        return f"error: no tool named {name!r}"
    except (ValueError, SyntaxError, ZeroDivisionError, KeyError, TypeError) as exc:
        return f"error: {exc!r}"


def converse(client: openai.OpenAI, conv: int, questions: list[str], args: argparse.Namespace) -> list[str]:
    """One conversation's tool loops; the printed lines, one per model turn."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    lines, turn = [], 0
    for question in questions:
        messages.append({"role": "user", "content": question})
        for step in range(args.max_steps):
            choice = "required" if step == 0 else "none" if step == args.max_steps - 1 else "auto"
            reply = client.chat.completions.create(
                model="default", messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                max_tokens=args.max_answer_tokens if choice == "none" else args.max_tokens, temperature=0.7,
                seed=args.seed + turn)
            turn += 1
            message = reply.choices[0].message
            usage = reply.usage
            head = (f"conv {conv} turn {turn} tool_choice={choice} prompt_tokens={usage.prompt_tokens} "
                    f"cached_tokens={usage.prompt_tokens_details.cached_tokens}")
            messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            if not message.tool_calls:
                lines.append(f"{head} answer={message.content!r}")
                break
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                lines.append(f"{head} call={call.function.name}({call.function.arguments}) result={result!r}")
    return lines


@contextlib.contextmanager
def server_url(args: argparse.Namespace) -> Iterator[str]:
    if args.url:
        yield args.url
        return
    with ServerProcess.launch(["--log-level", "warning"]) as srv:
        yield srv.url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running radixlm server (default: start one)")
    p.add_argument("--api-key", default="none", help="the server's --api-key")
    p.add_argument("--num-conversations", type=int, default=len(CONVERSATIONS))
    p.add_argument("--questions", type=int, default=2, help="questions per conversation (at most 2)")
    p.add_argument("--max-steps", type=int, default=3, help="model turns per question at most (2 or more)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens of a turn that may call (a call takes ~45)")
    p.add_argument("--max-answer-tokens", type=int, default=64, help="output tokens of a last, answering turn")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    convs = [CONVERSATIONS[i % len(CONVERSATIONS)][: args.questions] for i in range(args.num_conversations)]
    with server_url(args) as url, openai.OpenAI(base_url=f"{url}/v1", api_key=args.api_key) as client:
        with ThreadPoolExecutor(len(convs)) as pool:  # the server batches the conversations' turns
            results = list(pool.map(lambda ic: converse(client, *ic, args), enumerate(convs)))
    for lines in results:
        print("\n".join(lines))
    calls = sum(" call=" in line for lines in results for line in lines)
    print(f"summary: {len(convs)} conversations, {sum(map(len, results))} turns, {calls} tool calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
