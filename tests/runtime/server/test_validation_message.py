"""The 400 message and ``param`` of an invalid request body: the field's dotted path, with
the union member pydantic tried left out (``sampling_params.stop``, not ``...stop.str``)."""

from __future__ import annotations

import pydantic
import pytest

from radixlm.runtime.server.http_common import _validation_message
from radixlm.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)


@pytest.mark.parametrize(
    ("model", "body", "param", "says"),
    [
        (GenerateRequest, {"text": 5}, "text", "valid string"),
        (GenerateRequest, {"text": "hi", "sampling_params": {"stop": 5}}, "sampling_params.stop", "valid string"),
        (GenerateRequest, {"input_ids": ["a"]}, "input_ids.0", "valid integer"),
        (GenerateRequest, {"text": "hi", "rid": 5}, "rid", "valid string"),
        (GenerateRequest, {"text": "hi", "sampling_params": {"max_new_tokens": "x"}},
         "sampling_params.max_new_tokens", "valid integer"),
        (CompletionRequest, {"model": "m", "prompt": 5}, "prompt", "valid string"),
        (CompletionRequest, {"model": "m", "prompt": "x", "stop": 3}, "stop", "valid string"),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 5}]},
         "messages.0.content", "valid string"),
        (ChatCompletionRequest, {"model": "m", "messages": "x"}, "messages", "valid list"),
    ],
)  # fmt: skip
def test_param_names_the_field_not_the_union_member(model, body, param, says) -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        model.model_validate(body)
    message, got = _validation_message(exc.value)
    assert got == param
    assert message.startswith(f"{param}: ") and says in message, message


def test_a_body_that_is_not_an_object_names_the_content_type() -> None:
    """A JSON body sent without ``Content-Type: application/json`` (plain ``curl -d``)
    reaches validation as a string: the message says what to send."""
    with pytest.raises(pydantic.ValidationError) as exc:
        GenerateRequest.model_validate('{"text": "hi"}')
    message, param = _validation_message(exc.value)
    assert param is None and message.startswith("request body: ")
    assert message.endswith("send a JSON object with 'Content-Type: application/json'"), message
