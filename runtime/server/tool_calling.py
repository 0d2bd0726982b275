"""Tool calling on the chat route: tools into the prompt, a grammar for the calls, calls
out of the output (docs/SERVING.md "Tool calling"). The formats themselves (parsing,
grammars) are in runtime/text/tool_parsers.py.

Prompt. A chat template that mentions ``tools`` renders the tool definitions itself, and
one that mentions ``tool_calls`` renders assistant calls and ``tool`` messages (arguments
handed to it as objects, as Hugging Face templates expect). Otherwise (SmolLM2's template,
plain ChatML) radixlm renders them in the default format:

- ``DEFAULT_TOOLS_BLOCK`` (the tools as JSON lines and the format's instructions) ends the
  first system message, or is the system message when the conversation has none;
- an assistant message's calls follow its content, written as the model writes them
  (``<tool_call>...</tool_call>`` for hermes), so the history reads like its own output;
- ``tool`` messages become ``user`` messages of ``<tool_response>`` blocks (consecutive
  ones merged into one), as Qwen2.5's template does.

Output. ``ToolPlan.message`` splits a finished output into content and calls;
``ToolCallStream`` turns a growing output into ``delta.content`` / ``delta.tool_calls``
pieces: a call's ``id``, ``type`` and ``function.name`` first (arguments ""), then its
argument fragments, which add up to the arguments of the finished call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    Tool,
    ToolChoice,
)
from radixlm.runtime.server.tokenizer_manager import InvalidRequest
from radixlm.runtime.text.grammar import check_grammar
from radixlm.runtime.text.tool_parsers import CallText, Segment, ToolCallFormat

__all__ = ["DEFAULT_TOOLS_BLOCK", "ToolPlan", "ToolCallStream", "plan_tools", "render_chat", "new_call_id"]

DEFAULT_TOOLS_BLOCK = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

{instructions}"""


def new_call_id() -> str:
    """A call id in OpenAI's style: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


# ----------------------------------------------------------------------------- prompt
def _tool_dicts(tools: list[Tool]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def tools_block(tools: list[Tool], fmt: ToolCallFormat) -> str:
    """The default system text describing ``tools`` and how ``fmt`` calls them."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in _tool_dicts(tools))
    return DEFAULT_TOOLS_BLOCK.format(tools=lines, instructions=fmt.instructions)


def _template_calls(msg: ChatMessage) -> list[dict[str, Any]]:
    out = []
    for c in msg.tool_calls or ():
        try:
            args: Any = json.loads(c.function.arguments)
        except json.JSONDecodeError:
            args = c.function.arguments
        out.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
    return out


def render_chat(body: ChatCompletionRequest, fmt: ToolCallFormat, template: str | None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: ``developer`` as ``system``; tools, calls and
    tool results as the template takes them or in the default format (module docstring)."""
    template = template or ""
    native_tools, native_calls = "tools" in template, "tool_calls" in template
    out: list[dict[str, Any]] = []
    for msg in body.messages:
        role = "system" if msg.role == "developer" else msg.role
        entry: dict[str, Any] = {"role": role, "content": msg.text()}
        if msg.tool_calls and native_calls:
            entry["tool_calls"] = _template_calls(msg)
        elif msg.tool_calls:
            calls = fmt.calls_text([(c.function.name, c.function.arguments) for c in msg.tool_calls])
            entry["content"] = f"{entry['content']}\n{calls}" if entry["content"] else calls
        if role == "tool" and native_calls:
            entry["tool_call_id"] = msg.tool_call_id
        elif role == "tool":
            response = f"<tool_response>\n{entry['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + response
                continue
            entry = {"role": "user", "content": response, "tool_responses": True}
        out.append(entry)
    for entry in out:
        entry.pop("tool_responses", None)
    if body.tools and not native_tools:
        block = tools_block(body.tools, fmt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, (_tool_dicts(body.tools) if body.tools and native_tools else None)


# ----------------------------------------------------------------------------- grammar
@dataclass
class ToolPlan:
    """How one request's output is read for calls: the format, and the grammar the calls
    are generated under (an xgrammar structural tag as JSON text)."""

    fmt: ToolCallFormat
    grammar: str

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished output: content None when there are calls
        and no other text; a malformed call stays in the content, as written."""
        segments = self.fmt.scan(text, final=True)
        calls = [s for s in segments if isinstance(s, CallText) and s.valid]
        if not calls:
            return text, []
        content = "".join(s if isinstance(s, str) else s.raw for s in segments
                          if not (isinstance(s, CallText) and s.valid)).strip()
        return content or None, [_call(new_call_id(), c.name, c.arguments) for c in calls]


def _call(call_id: str, name: str | None, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None,
               fmt: ToolCallFormat) -> ToolPlan | None:
    """The plan of a request with ``tools`` (None without tools or with tool_choice "none"):
    "required" and a named function constrain the whole output to calls, "auto" (the
    default) the calls the model opens. Raises InvalidRequest (400 naming ``tools``) if the
    grammar does not compile."""
    if not tools or choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        mode, chosen = "named", [t for t in tools if t.function.name == choice.function.name]
    else:
        mode, chosen = choice or "auto", tools
    functions = [(t.function.name, t.function.arguments_schema()) for t in chosen]
    try:
        grammar = fmt.structural_tag(functions, mode, parallel is not False)
        check_grammar("structural_tag", grammar)
    except (ValueError, RuntimeError) as exc:
        raise InvalidRequest(f"the grammar of the tools' calls does not compile: {exc}", "tools") from None
    return ToolPlan(fmt, grammar)


# ----------------------------------------------------------------------------- streaming
@dataclass
class _Sent:
    call_id: str
    arguments: str = ""


@dataclass
class ToolCallStream:
    """One streamed choice's output read for calls. ``push(text, final)`` takes the new
    text and returns the deltas to send now, in order (``{"content": ...}`` or
    ``{"tool_calls": [one entry]}``); content trailing whitespace is held back until more
    text follows (and dropped at the end when there were calls)."""

    fmt: ToolCallFormat
    text: str = ""
    content_sent: str = ""
    calls: list[_Sent] = field(default_factory=list)

    def push(self, new_text: str, final: bool) -> list[dict[str, Any]]:
        self.text += new_text
        segments: list[Segment] = self.fmt.scan(self.text, final)
        started = [s for s in segments if isinstance(s, CallText) and s.name is not None]
        content = "".join(s for s in segments if isinstance(s, str))
        if final:  # calls that never got a name are text after all
            content += "".join(s.raw for s in segments if isinstance(s, CallText) and s.name is None)
        if not final or started or self.calls:
            content = content.rstrip()
        deltas = []
        if content.startswith(self.content_sent) and len(content) > len(self.content_sent):
            deltas.append({"content": content[len(self.content_sent):]})
            self.content_sent = content
        for i, call in enumerate(started):
            if i == len(self.calls):
                self.calls.append(_Sent(new_call_id()))
                deltas.append({"tool_calls": [{"index": i, **_call(self.calls[i].call_id, call.name, "")}]})
            sent = self.calls[i]
            if call.arguments.startswith(sent.arguments) and len(call.arguments) > len(sent.arguments):
                piece = call.arguments[len(sent.arguments):]
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                sent.arguments = call.arguments
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.calls)
