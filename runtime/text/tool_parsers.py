"""Tool-call formats: how a model family writes function calls, read back out of its output
(``scan``) and imposed on it while it writes them (``structural_tag``, an xgrammar grammar).

One ``ToolCallFormat`` per family, registered by name in ``TOOL_CALL_PARSERS`` (the choices
of ``--tool-call-parser``; ``detect_parser`` picks one from a chat template's source):

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
                 (Hermes 2 Pro, Qwen2.5, Qwen3; the default)
    llama3_json  {"name": "f", "parameters": {...}}, several separated by "; "
                 (Llama 3.1 - 3.3 JSON tool calls; a leading <|python_tag|> is dropped)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
                 (Mistral 7B Instruct v0.3, Mistral Nemo)

``scan(text, final)`` splits output text into segments: plain text (``str``) and calls
(``CallText``). It is called on the whole text so far, again after every chunk while
streaming: a call's ``name`` appears once read whole, its ``arguments`` grow as a prefix of
their final text, and text that may be the start of a marker is held back until
``final``. A call whose text does not parse once complete has ``valid`` False; callers keep
its ``raw`` text as content (a malformed call is never an error).

``structural_tag(functions, mode, parallel)`` is the grammar of the calls (xgrammar's
structural tags: Dong et al. 2024, XGrammar): ``"named"`` exactly one call of the one
function given; ``"required"`` one or more calls and nothing else; ``"auto"`` free text
until the format's trigger (``<tool_call>``, ...), then a whole call under its function's
parameter schema. ``parallel=False``: at most one call. The arguments follow the grammar
of ``json_schema`` requests (runtime/text/grammar.py: the schema's xgrammar grammar with
``any_whitespace=False``, one space after ':' and ',', the layout of ``json.dumps``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import xgrammar as xgr
from xgrammar.structural_tag import (
    GrammarFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

__all__ = ["CallText", "Segment", "ToolCallFormat", "TOOL_CALL_PARSERS", "DEFAULT_TOOL_CALL_PARSER",
           "detect_parser", "get_parser"]

Mode = Literal["auto", "required", "named"]


@dataclass
class CallText:
    """One call in the output. ``name``: None until read whole; ``arguments``: the
    arguments' JSON text so far (a prefix of the final text; the whole of it once
    ``done``); ``valid``: done, and the name is a string and the arguments a JSON object;
    ``raw``: the call's text as generated, markers included."""

    name: str | None
    arguments: str
    done: bool
    valid: bool
    raw: str


Segment = str | CallText

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


_LATIN1_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _arguments_of(obj: Any) -> str | None:
    """The arguments of a decoded call object as JSON text, or None if it is no call
    (``arguments`` / ``parameters`` must be an object, or a string holding one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            return args if isinstance(json.loads(args), dict) else None
        except json.JSONDecodeError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _object_call(body: str, done: bool, raw: str) -> CallText:
    """The call in ``body``, one JSON object ``{"name": ..., "arguments": {...}}`` (whole
    when ``done``). The arguments are the generated text itself where the name comes first
    (so streamed fragments add up to them), else re-serialised."""
    header = _HEADER.match(body)
    name = json.loads(f'"{header.group(1)}"') if header else None
    if not done:
        tail = body[header.end():].rstrip() if header else ""
        if tail.endswith("}"):  # may close the call object rather than the arguments
            tail = tail[:-1].rstrip()
        return CallText(name, tail, False, False, raw)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return CallText(name, "", True, False, raw)
    args = _arguments_of(obj)
    if args is None:
        return CallText(name, "", True, False, raw)
    if header:
        text = body[header.end():].rstrip()[:-1].rstrip()
        with_text = _loads_or_none(text)
        if with_text is not None and with_text == json.loads(args):
            args = text
    return CallText(obj["name"], args, True, True, raw)


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _decode_object(text: str, pos: int) -> int | None:
    """End of the JSON value starting at ``pos``, or None if it is not complete yet."""
    try:
        return _DECODER.raw_decode(text, pos)[1]
    except json.JSONDecodeError:
        return None


class ToolCallFormat:
    """A model family's way of writing function calls. Subclasses set ``name``,
    ``markers`` (strings that identify the format in a chat template and mark calls in
    output) and ``instructions`` (how to call, for prompts of templates without tools)."""

    name = ""
    markers: tuple[str, ...] = ()
    instructions = ""
    args_key = "arguments"

    def scan(self, text: str, final: bool) -> list[Segment]:
        raise NotImplementedError

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (``arguments``: JSON text), to render history."""
        raise NotImplementedError

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments) calls of one assistant message as the model writes them."""
        return "\n".join(self.call_text(n, a) for n, a in calls)

    def structural_tag(self, functions: list[tuple[str, Any]], mode: Mode, parallel: bool) -> str:
        """The grammar (xgrammar structural tag, as JSON text) of calls to ``functions``
        ((name, JSON schema of the arguments) pairs; a ``True`` schema: any object)."""
        raise NotImplementedError

    @staticmethod
    def _schema(schema: Any) -> GrammarFormat:
        """The grammar of arguments following ``schema``. Raises RuntimeError (xgrammar's)
        if the schema does not compile."""
        text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
        # The printed grammar writes a Latin-1 character as \xHH, which the EBNF parser reads
        # greedily ("\xe4d" as U+0E4D): rewrite each unescaped \xHH as the fixed-width \u00HH.
        return GrammarFormat(grammar=_LATIN1_ESCAPE.sub(r"\1\\u00\2", text))


class HermesFormat(ToolCallFormat):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    markers = (start,)
    instructions = ("For each function call, return a json object with function name and arguments within "
                    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def scan(self, text: str, final: bool) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                out.append(tail if final else tail[: len(tail) - _partial_suffix(tail, self.start)])
                return out
            out.append(text[pos:i])
            j = i + len(self.start)
            k = text.find(self.end, j)
            if k < 0:  # unterminated: at the end of the output, a whole object still counts
                body = text[j:]
                if not final:
                    body = body[: len(body) - _partial_suffix(body, self.end)]
                out.append(_object_call(body, final, text[i:]))
                return out
            out.append(_object_call(text[j:k], True, text[i:k + len(self.end)]))
            pos = k + len(self.end)

    def call_text(self, name: str, arguments: str) -> str:
        return f'{self.start}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{self.end}'

    def _tag(self, name: str, schema: Any) -> TagFormat:
        return TagFormat(begin=f'{self.start}\n{{"name": {json.dumps(name)}, "arguments": ',
                         content=self._schema(schema), end="}\n" + self.end)

    def structural_tag(self, functions: list[tuple[str, Any]], mode: Mode, parallel: bool) -> str:
        tags = [self._tag(n, s) for n, s in functions]
        if mode == "named":
            fmt: Any = tags[0]
        elif mode == "required":
            fmt = TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True,
                                          stop_after_first=not parallel)
        else:
            fmt = TriggeredTagsFormat(triggers=[self.start], tags=tags, stop_after_first=not parallel)
        return StructuralTag(format=fmt).model_dump_json()


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    trigger = '{"name": '
    markers = (python_tag,)
    args_key = "parameters"
    instructions = ("For each function call, reply with a JSON object of the form "
                    '{"name": <function-name>, "parameters": <args-json-object>}; '
                    'separate several calls with "; ".')
    _start = re.compile(r'\{\s*"name"\s*:')
    _partial_start = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?$')  # may become _start

    def scan(self, text: str, final: bool) -> list[Segment]:
        text = text.replace(self.python_tag, "")
        out: list[Segment] = []
        pos = 0
        while True:
            m = self._start.search(text, pos)
            if m is None:
                tail = text[pos:]
                if not final:
                    held = self._partial_start.search(tail)
                    tail = tail[: held.start()] if held else tail
                    if out and isinstance(out[-1], CallText) and not tail.strip(" \n;"):
                        tail = ""  # a separator, or text: not known yet
                out.append(tail)
                return out
            between = text[pos:m.start()]
            previous_call = bool(out) and isinstance(out[-1], CallText)
            out.append("" if previous_call and not between.strip(" \n;") else between)
            end = _decode_object(text, m.start())
            if end is None:
                out.append(_object_call(text[m.start():], final, text[m.start():]))
                return out
            out.append(_object_call(text[m.start():end], True, text[m.start():end]))
            pos = end

    def call_text(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}'

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(self.call_text(n, a) for n, a in calls)

    def structural_tag(self, functions: list[tuple[str, Any]], mode: Mode, parallel: bool) -> str:
        tags = [TagFormat(begin=f'{{"name": {json.dumps(n)}, "parameters": ', content=self._schema(s), end="}")
                for n, s in functions]
        if mode == "named":
            fmt: Any = tags[0]
        elif mode == "required":
            fmt = TagsWithSeparatorFormat(tags=tags, separator="; ", at_least_one=True,
                                          stop_after_first=not parallel)
        else:
            fmt = TriggeredTagsFormat(triggers=[self.trigger], tags=tags, stop_after_first=not parallel)
        return StructuralTag(format=fmt).model_dump_json()


class MistralFormat(ToolCallFormat):
    name = "mistral"
    start = "[TOOL_CALLS]"
    markers = (start,)
    instructions = ("To call functions, reply with [TOOL_CALLS] followed by a JSON array of "
                    '{"name": <function-name>, "arguments": <args-json-object>} objects.')

    def scan(self, text: str, final: bool) -> list[Segment]:
        i = text.find(self.start)
        if i < 0:
            return [text if final else text[: len(text) - _partial_suffix(text, self.start)]]
        out: list[Segment] = [text[:i]]
        pos = self._skip(text, i + len(self.start))
        if pos == len(text) or text[pos] != "[":
            if pos < len(text) or final:
                out.append(CallText(None, "", True, False, text[i:]))
            return out
        pos = self._skip(text, pos + 1)
        while pos < len(text) and text[pos] != "]":
            end = _decode_object(text, pos)
            if end is None:
                out.append(_object_call(text[pos:], final, text[pos:]))
                return out
            out.append(_object_call(text[pos:end], True, text[pos:end]))
            pos = self._skip(text, end)
            if pos < len(text) and text[pos] == ",":
                pos = self._skip(text, pos + 1)
            elif pos < len(text) and text[pos] != "]":
                out.append(text[pos:])  # not a list of calls past here: plain text
                return out
        out.append(text[pos + 1:])
        return out

    @staticmethod
    def _skip(text: str, pos: int) -> int:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        return pos

    def call_text(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "arguments": {arguments}}}'

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        return self.start + "[" + ", ".join(self.call_text(n, a) for n, a in calls) + "]"

    def structural_tag(self, functions: list[tuple[str, Any]], mode: Mode, parallel: bool) -> str:
        tags = [TagFormat(begin=f'{{"name": {json.dumps(n)}, "arguments": ', content=self._schema(s), end="}")
                for n, s in functions]
        calls: Any = tags[0] if mode == "named" else TagsWithSeparatorFormat(
            tags=tags, separator=", ", at_least_one=True, stop_after_first=not parallel)
        wrapper = TagFormat(begin=self.start + "[", content=calls, end="]")
        fmt: Any = wrapper if mode != "auto" else TriggeredTagsFormat(
            triggers=[self.start], tags=[wrapper], stop_after_first=True)
        return StructuralTag(format=fmt).model_dump_json()


TOOL_CALL_PARSERS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(),
                                                                      MistralFormat())}
DEFAULT_TOOL_CALL_PARSER = "hermes"


def detect_parser(chat_template: str | None) -> str:
    """The parser whose markers the chat template's source mentions (``<tool_call>`` ->
    hermes, ``[TOOL_CALLS]`` -> mistral, ``<|python_tag|>`` -> llama3_json), else
    ``DEFAULT_TOOL_CALL_PARSER``."""
    for name, fmt in TOOL_CALL_PARSERS.items():
        if chat_template and any(marker in chat_template for marker in fmt.markers):
            return name
    return DEFAULT_TOOL_CALL_PARSER


def get_parser(name: str, chat_template: str | None = None) -> ToolCallFormat:
    """The format registered as ``name``; ``"auto"``: ``detect_parser(chat_template)``.
    Raises ValueError for an unknown name."""
    if name == "auto":
        name = detect_parser(chat_template)
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_CALL_PARSERS)} or auto")
    return TOOL_CALL_PARSERS[name]
