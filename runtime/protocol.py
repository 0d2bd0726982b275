"""Request bodies of the HTTP APIs, validated by pydantic.

Native ``/generate`` follows SGLang's field names; ``/v1/completions`` and
``/v1/chat/completions`` follow the OpenAI API (plus the usual vLLM/SGLang extras:
``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``min_tokens``). Unknown fields
are ignored, as the OpenAI API does; a wrong type or range is an HTTP 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from radixlm.runtime.messages import SamplingParams

__all__ = [
    "NativeSamplingParams",
    "GenerateRequest",
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
    "StreamOptions",
]

NonNegInt = Annotated[int, Field(ge=0)]
# Integers that travel to the scheduler (msgpack, torch int64) must fit in 64 bits: a
# larger one was a 500 in the tokenizer process (top_k: a dead scheduler) instead of a 400.
INT64_MAX = 2**63 - 1
TokenIdInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopField = str | list[str] | None


def _stop_tuple(stop: StopField) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    return tuple(s for s in stops if s)


class _Sampling(BaseModel):
    """Fields shared by every API (native names)."""

    model_config = ConfigDict(extra="ignore")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # Logits are divided/multiplied by it: below 1e-2 float32 logits overflow to inf.
    repetition_penalty: float = Field(1.0, ge=1e-2, le=100.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: StopField = None
    stop_token_ids: list[TokenIdInt] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)  # seed + i (n <= 128) fits too
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def _common(self) -> dict[str, Any]:
        return dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, stop=_stop_tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            seed=self.seed, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class NativeSamplingParams(_Sampling):
    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0, le=INT64_MAX)
    n: int = Field(1, ge=1, le=128)

    def to_sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, min_new_tokens=self.min_new_tokens,
                              **self._common())


class GenerateRequest(BaseModel):
    """SGLang's native /generate body: exactly one of ``text`` / ``input_ids``."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[NonNegInt] | list[list[NonNegInt]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAIBase(_Sampling):
    model: str
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def to_sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_tokens, min_new_tokens=self.min_tokens, **self._common())


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (or be omitted)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(
                "response_format json_object/json_schema is not supported yet (constrained "
                "decoding is not implemented); refusing rather than ignoring it")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages for the chat template; ``developer`` is rendered as ``system``."""
        out = []
        for msg in self.messages:
            role = "system" if msg.role == "developer" else msg.role
            out.append({"role": role, "content": msg.text()})
        return out
