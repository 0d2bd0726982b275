"""Request bodies of the HTTP APIs, validated by pydantic.

Native ``/generate`` follows SGLang's field names; ``/v1/completions`` and
``/v1/chat/completions`` follow the OpenAI API (plus the usual vLLM/SGLang extras:
``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``min_tokens``). Unknown fields
are ignored, as the OpenAI API does; a wrong type or range is an HTTP 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from radixlm.runtime.messages import SamplingParams
from radixlm.runtime.text.grammar import GRAMMAR_KINDS, check_grammar, check_json_depth
from radixlm.runtime.text.stop_regex import check_stop_regex

__all__ = [
    "NativeSamplingParams",
    "GenerateRequest",
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
    "FunctionDefinition",
    "NamedToolChoice",
    "StreamOptions",
    "Tool",
    "ToolCall",
    "ToolChoice",
]

# Integers that travel to the scheduler (msgpack, torch int64) must fit in 64 bits: a
# larger one was a 500 in the tokenizer process (top_k: a dead scheduler) instead of a 400.
INT64_MAX = 2**63 - 1
TokenIdInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopField = str | list[str] | None


def _json_type(v: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _stop_tuple(stop: StopField) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    return tuple(s for s in stops if s)


class _Sampling(BaseModel):
    """Fields shared by every API (native names)."""

    model_config = ConfigDict(extra="ignore")

    # Finite floats only: an infinite temperature passed (native /generate has no upper
    # bound) and sampled noise; NaN got "greater than or equal to 0".
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    # Logits are divided/multiplied by it: below 1e-2 float32 logits overflow to inf.
    repetition_penalty: float = Field(1.0, ge=1e-2, le=100.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    stop: StopField = None
    stop_regex: StopField = None  # SGLang's name: stop once the output text matches a pattern
    stop_token_ids: list[TokenIdInt] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)  # seed + i (n <= 128) fits too
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured generation (SGLang's names); json_schema as JSON text or an object.
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None  # an xgrammar structural tag (SGLang's name)

    @field_validator("stop_regex", mode="after")
    @classmethod
    def _stop_patterns(cls, v: StopField) -> tuple[str, ...]:
        patterns = () if v is None else (v,) if isinstance(v, str) else tuple(v)
        check_stop_regex(patterns)
        return patterns

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_type(cls, v: Any) -> Any:
        """A 400 that says what a json_schema must be, not pydantic's "valid string"."""
        if v is not None and not isinstance(v, str | dict):
            raise ValueError(f"json_schema must be a JSON schema as a string or an object (got {_json_type(v)})")
        if isinstance(v, dict):
            check_json_depth(v, "json_schema")  # before json.dumps in _schema_text
        return v

    @field_validator("json_schema", mode="after")
    @classmethod
    def _schema_text(cls, v: str | dict | None) -> str | None:
        if v is None:
            return None
        text = v if isinstance(v, str) else json.dumps(v)
        check_grammar("json_schema", text)
        return text

    @field_validator("structural_tag", mode="before")
    @classmethod
    def _tag_text(cls, v: Any) -> Any:
        if isinstance(v, dict):
            check_json_depth(v, "structural_tag")
            return json.dumps(v)
        return v

    @field_validator("regex", "ebnf", "structural_tag", mode="after")
    @classmethod
    def _grammar(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None:
            check_grammar(info.field_name, v)
        return v

    @model_validator(mode="after")
    def _one_grammar(self) -> _Sampling:
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(GRAMMAR_KINDS)} (got {', '.join(given)})")
        return self

    def _common(self) -> dict[str, Any]:
        return dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, stop=_stop_tuple(self.stop), stop_regex=tuple(self.stop_regex or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            seed=self.seed, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            regex=self.regex, json_schema=self.json_schema, ebnf=self.ebnf, structural_tag=self.structural_tag,
        )


class NativeSamplingParams(_Sampling):
    max_new_tokens: int = Field(128, ge=0, le=INT64_MAX)
    min_new_tokens: int = Field(0, ge=0, le=INT64_MAX)
    n: int = Field(1, ge=1, le=128)
    # Sent by SGLang's frontend on every gen. Accepted for compatibility; it has no effect:
    # fast (Rust) tokenizers, the only kind served, never put spaces between special tokens.
    spaces_between_special_tokens: bool = True

    def to_sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, min_new_tokens=self.min_new_tokens,
                              **self._common())


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAIBase(_Sampling):
    model: str
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _response_format(self) -> _OpenAIBase:
        schema = self.response_format.schema_text() if self.response_format is not None else None
        if schema is not None:
            if any(getattr(self, kind) is not None for kind in GRAMMAR_KINDS):
                raise ValueError(f"give response_format or one of {', '.join(GRAMMAR_KINDS)}, not both")
            self.json_schema = schema
        return self

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def to_sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_tokens, min_new_tokens=self.min_tokens, **self._common())


class CompletionRequest(_OpenAIBase):
    """``echo``: the prompt is prepended to each choice's text, and with ``logprobs`` its
    tokens' logprobs come first (the first one null); ``max_tokens=0`` needs ``echo`` and
    scores the prompt without generating."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # before max_tokens: its validator reads it
    max_tokens: int = Field(16, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _zero_needs_echo(cls, v: int, info: ValidationInfo) -> int:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be >= 1 (0 only with echo=true, to score the prompt)")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (or be omitted)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call an assistant message made (``messages[].tool_calls[]``)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A chat message; an assistant message may carry ``tool_calls`` (its ``content`` then
    may be null), a ``tool`` message answers one of them by ``tool_call_id``."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs tool_call_id (the id of the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    """OpenAI ``response_format.json_schema``: the schema is under ``schema``."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema_type(cls, v: Any) -> Any:
        """A 400 naming ``schema`` itself, not the union member tried (``schema.dict[str,any]``); and
        no lax coercion of 1 or "yes" to the schema ``true``."""
        if not isinstance(v, dict | bool):
            raise ValueError(f"schema must be a JSON schema as an object or a boolean (got {_json_type(v)})")
        check_json_depth(v, "schema")  # before json.dumps in ResponseFormat.schema_text
        return v


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``. ``json_object``: any JSON object; ``json_schema``: the
    given schema, enforced by constrained decoding (runtime/text/grammar.py)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        """Raises ValueError (-> 400, param ``response_format``) if the schema is missing,
        does not compile or uses a keyword that cannot be enforced."""
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format type json_schema needs response_format.json_schema.schema")
        text = self.schema_text()
        if text is not None:
            try:
                check_grammar("json_schema", text)
            except ValueError as exc:
                raise ValueError(f"response_format.json_schema.schema: {exc}") from None
        return self

    def schema_text(self) -> str | None:
        """The JSON schema to enforce (None for "text"); checked when the request is validated."""
        if self.type == "text":
            return None
        return json.dumps(self.json_schema.schema_ if self.json_schema else {"type": "object"})


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    """OpenAI ``tools[].function``. ``parameters``: a JSON schema of an object (None: no
    arguments schema, any object). ``strict``: true or null (default): the arguments are
    generated under the schema, and a schema keyword the grammar backend cannot enforce is
    refused (400); false: any JSON object is generated, the schema only informs the model."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    strict: bool | None = None  # before parameters: its validator reads it
    parameters: dict[str, Any] | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _schema_type(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"parameters must be a JSON schema object (got {_json_type(v)})")
        if isinstance(v, dict):
            check_json_depth(v, "parameters")
        return v

    @field_validator("parameters", mode="after")
    @classmethod
    def _schema(cls, v: dict | None, info: ValidationInfo) -> dict | None:
        if v is None:
            return v
        if v.get("type", "object") != "object":
            raise ValueError(f"parameters must be a JSON schema of type 'object' (got type {v['type']!r})")
        try:
            check_grammar("json_schema", json.dumps(v), refuse_unenforced=info.data.get("strict") is not False)
        except ValueError as exc:
            raise ValueError(f"parameters is not a usable JSON schema: {exc}") from None
        # A schema without "type" ({} declares a function without parameters) still describes
        # an object: untyped, the grammar would let the arguments be any JSON value.
        return v if "type" in v else {**v, "type": "object"}

    def arguments_schema(self) -> dict[str, Any]:
        """The schema generated arguments follow (see ``strict``)."""
        if self.parameters is None or self.strict is False:
            return {"type": "object"}
        return self.parameters


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _ToolFields(BaseModel):
    """OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, checked as OpenAI does: a
    400 naming ``tools`` for two functions of one name, one naming ``tool_choice`` for
    "required" or a named function without (or not among) the tools."""

    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = None  # after tools: its validator reads them
    parallel_tool_calls: bool | None = None

    @field_validator("tools", mode="after")
    @classmethod
    def _distinct_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        check_tools(v)
        return v

    @field_validator("tool_choice", mode="after")
    @classmethod
    def _choice_needs_tools(cls, v: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        check_tool_choice(v, info.data.get("tools"))
        return v


class GenerateRequest(_ToolFields):
    """SGLang's native /generate body: exactly one of ``text`` / ``input_ids``. ``tools``, radixlm's
    extension for the frontend DSL: calls constrained and parsed as on the chat route
    (``meta_info.tool_calls``); the prompt is the caller's text, tools are not rendered into it."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    # Plain ints: TokenizerManager.validate checks every id against the vocabulary (one
    # min / max, 0.10 ms for 4096 ids); a per-element ``ge=0`` here cost pydantic 0.11 ms more.
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1, le=INT64_MAX)
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    # SGLang's field: run on this data parallel replica (0 .. --dp-size - 1) instead of the router's pick
    data_parallel_rank: int | None = Field(None, ge=0)
    image_data: Any = None  # SGLang's multimodal input: refused, the served models read text only

    @field_validator("image_data")
    @classmethod
    def _no_images(cls, v: Any) -> None:
        if v is not None:
            raise ValueError("image input is not supported: the served model reads text only")
        return None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        return self


class ChatCompletionRequest(_OpenAIBase, _ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_depth(cls, v: Any) -> Any:
        """A 400 naming ``tools`` for tools nested too deep to render (the chat template's
        recursion failed, and the 400 named ``messages``)."""
        if isinstance(v, list):
            check_json_depth(v, "tools")
        return v

    @field_validator("messages", mode="after")
    @classmethod
    def _answers_known_calls(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        """As OpenAI: a tool message answers a call of an earlier assistant message."""
        ids: set[str] = set()
        for i, msg in enumerate(v):
            ids.update(c.id for c in msg.tool_calls or ())
            if msg.role == "tool" and msg.tool_call_id not in ids:
                raise ValueError(f"message {i} (role 'tool') answers tool_call_id {msg.tool_call_id!r}, "
                                 "which no earlier assistant message's tool_calls has")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def calls_tools(self) -> bool:
        """Whether the output is read for tool calls (tools given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @model_validator(mode="after")
    def _one_output_grammar(self) -> ChatCompletionRequest:
        if self.calls_tools and any(getattr(self, kind) is not None for kind in GRAMMAR_KINDS):
            raise ValueError("tools (unless tool_choice is 'none') constrain the output with their own grammar: "
                             "give response_format / regex / json_schema / ebnf / structural_tag without them")
        return self


def check_tool_choice(choice: ToolChoice | None, tools: list[Tool] | None) -> None:
    """Raises ValueError (-> 400 naming ``tool_choice``, as OpenAI) for "required" or a
    named function without ``tools``, or a named function that is not among them."""
    if choice in (None, "none", "auto"):
        return
    if not tools:
        raise ValueError("tool_choice 'required' or a named function is only allowed when tools are given")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")


def check_tools(tools: list[Tool] | None) -> None:
    """Raises ValueError (-> 400 naming ``tools``) for two functions of one name."""
    names = [t.function.name for t in tools or ()]
    if len(set(names)) != len(names):
        raise ValueError("tools name a function more than once: " + ", ".join(sorted({n for n in names
                                                                                        if names.count(n) > 1})))
