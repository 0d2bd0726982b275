"""A multi-turn chat agent with a calculator tool, written in radixlm's frontend DSL.

    .venv/bin/python examples/dsl_tool_agent.py                  # starts its own server
    .venv/bin/python examples/dsl_tool_agent.py --url http://127.0.0.1:30000

Each user question runs a tool loop inside one growing conversation:
  1. the assistant's first action is "calculate" (a 135M model rarely picks the tool by
     itself); after a tool result it picks the next action with ``select``
     ("calculate" again or "answer");
  2. "calculate": it writes an arithmetic expression with a regex-constrained ``gen``
     (digits, operators, parentheses; a server without constrained decoding ignores
     the regex, so the expression is also parsed with it, from the start of the output),
     the program evaluates it with a safe calculator (``ast``; no ``eval``) and appends
     the result as a user message "Tool result: ...";
  3. "answer": it writes the final answer, which ends the loop (at most --max-steps).
Every turn reuses the KV pages of the conversation so far: the printed
``cached_tokens`` of each model call grows with the history.
"""

from __future__ import annotations

import argparse
import ast
import operator
import re

from dsl_backend import add_backend_args, backend_from_args

from radixlm.frontend import assistant_begin, assistant_end, function, gen, select, system, user

EXPRESSION = r"[0-9][0-9+\-*/(). ]{0,38}[0-9)]"  # what the calculator accepts
SYSTEM = ("You are a math assistant with a calculator tool. To use it, reply 'Action: calculate' "
          "and an 'Expression:'; the tool replies with the result. When you know the result, "
          "reply 'Action: answer' and a one-sentence 'Answer:'.")
QUESTIONS = ["What is 37 times 41?", "What is 1517 plus 123?", "What is 1640 divided by 4?"]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float:
    """The value of an arithmetic expression (numbers, + - * /, parentheses). Raises
    ValueError for anything else, ZeroDivisionError for a division by zero."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)}")

    return value(ast.parse(expression, mode="eval").body)


@function
def agent(s, questions, max_steps):
    s += system(SYSTEM)
    log = []
    for question in questions:
        s += user(question)
        for step in range(max_steps):
            s += assistant_begin()
            s += "Action: " + (select("action", ["calculate", "answer"]) if step else "calculate")
            if step and s["action"] == "answer":
                s += "\nAnswer: " + gen("answer", max_tokens=40, stop="\n")
                s += assistant_end()
                log.append(("answer", repr(s["answer"]), s.get_meta_info("answer")))
                break
            s += "\nExpression: " + gen("expression", max_tokens=24, regex=EXPRESSION, stop="\n")
            s += assistant_end()
            found = re.match(EXPRESSION, s["expression"].strip())  # all of it, when constrained
            try:
                result = f"{calculate(found.group()):g}" if found else "error: no expression"
            except (ValueError, SyntaxError, ZeroDivisionError) as exc:
                result = f"error: {exc}"
            s += user(f"Tool result: {result}")
            log.append(("calculate", f"{s['expression']!r} -> {result}", s.get_meta_info("expression")))
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_args(parser)
    parser.add_argument("--max-steps", type=int, default=3, help="tool calls + answer per question")
    args = parser.parse_args()
    backend = backend_from_args(args)
    state = agent.run(questions=QUESTIONS, max_steps=args.max_steps, temperature=0, backend=backend)
    for kind, text, meta in state.ret_value:
        print(f"{kind}: {text} prompt_tokens={meta['prompt_tokens']} cached_tokens={meta['cached_tokens']}")
    print(f"messages: {len(state.messages())}")


if __name__ == "__main__":
    main()
