"""The OpenAI request schema (flexpipe.protocol): exact errors and params, and what it exposes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from flexpipe import protocol
from flexpipe.protocol import (
    ChatCompletionRequest,
    RequestError,
    check_content_type,
    parse_chat_request,
    parse_completion_request,
)

JSON = "application/json"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def chat_error(body: dict[str, Any] | bytes, content_type: str | None = JSON) -> RequestError:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(RequestError) as info:
        parse_chat_request(raw, content_type)
    return info.value


def completion_error(body: dict[str, Any]) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_completion_request(orjson.dumps(body), JSON)
    return info.value


def parts(*content: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": list(content)}])


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        # the list
        (parts({"type": "text", "text": 5}), "messages.0.content.0.text", "got a number"),
        (parts({"type": "text", "text": None}), "messages.0.content.0.text", "got null"),
        (chat(max_tokens=True), "max_tokens", "must be an integer, got a boolean"),
        (chat(stream="yes"), "stream", "must be a boolean"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model", "is required"),
        # siblings
        (parts({"type": "text"}), "messages.0.content.0.text", "is required"),
        (parts(5), "messages.0.content.0", "content part must be an object"),
        (parts({"type": "video"}), "messages.0.content.0", "whose `type` is one of"),
        (parts({"type": "image_url", "image_url": {}}), "messages.0.content.0.image_url.url", ""),
        (chat(messages=[{"role": "user", "content": 5}]), "messages.0.content", "a string or"),
        (chat(messages=[{"content": "hi"}]), "messages.0.role", "is required"),
        (chat(messages=[{"role": "", "content": "hi"}]), "messages.0.role", "must not be empty"),
        (chat(messages=[]), "messages", "must not be empty"),
        (chat(messages="hi"), "messages", "must be a list"),
        (chat(model=""), "model", "must not be empty"),
        (chat(model=7), "model", "must be a string"),
        (chat(max_tokens=0), "max_tokens", ">= 1"),
        (chat(max_tokens="5"), "max_tokens", "got a string"),
        (chat(max_completion_tokens=2.5), "max_completion_tokens", "got a number"),
        (chat(stream=1), "stream", "got a number"),
        (
            chat(stream=True, stream_options={"include_usage": "yes"}),
            "stream_options.include_usage",
            "",
        ),
        (chat(stream_options={"include_usage": True}), "stream_options", "stream is true"),
        (chat(n=2), "n", "only 1 choice"),
        (chat(n=True), "n", "got a boolean"),
        (chat(temperature=2.5), "temperature", "<= 2"),
        (chat(temperature="hot"), "temperature", "must be a number"),
        (chat(top_p=0), "top_p", "> 0"),
        (chat(presence_penalty=-3), "presence_penalty", ">= -2"),
        (chat(stop=5), "stop", "a string or a list of strings"),
        (chat(stop=["a", 1]), "stop.1", "must be a string"),
        (chat(seed=1.5), "seed", "must be an integer"),
        (chat(seed=1 << 63), "seed", "<="),
        (chat(user=3), "user", "must be a string"),
        (chat(logprobs="yes"), "logprobs", "must be a boolean"),
        (chat(ignore_eos="true"), "ignore_eos", "must be a boolean"),
        (chat(stop_token_ids=[-1]), "stop_token_ids.0", ">= 0"),
        (chat(min_tokens=5, max_tokens=2), "min_tokens", "<= max_tokens (2)"),
        (chat(logit_bias={"5": "x"}), "logit_bias.5", "must be a number"),
    ],
)
def test_chat_violations_name_their_param(body: dict[str, Any], param: str, needle: str) -> None:
    err = chat_error(body)
    assert err.param == param
    assert err.message.startswith(param + ":")
    assert needle in err.message
    assert err.body() == {
        "error": {"message": err.message, "type": "BadRequestError", "param": param, "code": 400}
    }


@pytest.mark.parametrize(
    ("prompt", "param", "needle"),
    [
        (None, "prompt", "must be a string, a list of strings, a list of token ids"),
        (5, "prompt", "must be a string, a list"),
        ([], "prompt", "must not be empty"),
        ([True], "prompt.0", "got a boolean"),
        ([-1], "prompt.0", ">= 0"),
        ([1, "a"], "prompt.1", "must be an integer"),
        (["a", 1], "prompt.1", "must be a string"),
        ([[1, 2], []], "prompt.1", "must not be empty"),
        ([[1, "x"]], "prompt.0.1", "must be an integer"),
    ],
)
def test_completion_prompt_violations(prompt: Any, param: str, needle: str) -> None:
    err = completion_error({"model": "m", "prompt": prompt})
    assert (err.param, needle in err.message) == (param, True), err.message


def test_missing_prompt_and_several_problems_at_once() -> None:
    err = completion_error({"model": "m"})
    assert (err.param, err.message) == ("prompt", "prompt: is required")
    err = completion_error({"prompt": "x", "max_tokens": True, "stream": "yes"})
    assert err.param == "model" and err.message.endswith("(and 2 more problems)")


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "Invalid JSON body"),
        (b"[1, 2]", "must be a JSON object"),
        (b"", "Invalid JSON body"),
    ],
)
def test_bodies_that_are_not_json_objects(raw: bytes, needle: str) -> None:
    err = chat_error(raw)
    assert needle in err.message and err.param is None


def test_content_type_must_be_json() -> None:
    body = orjson.dumps(chat())
    for ok in ("application/json", "Application/JSON; charset=utf-8", None):
        parse_chat_request(body, ok)
    for bad in ("text/plain", "application/x-www-form-urlencoded", ""):
        err = chat_error(body, bad)
        assert "Unsupported Media Type" in err.message and "application/json" in err.message
    # vLLM's rule (the sim engine's): the header itself is required
    with pytest.raises(RequestError, match="content-type"):
        check_content_type(None, allow_missing=False)


def test_valid_chat_keeps_unknown_fields_and_exposes_what_the_gateway_needs() -> None:
    body = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look: "},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                    {"type": "text", "text": "what is it?"},
                ],
            },
            {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
        ],
        max_tokens=9,
        max_completion_tokens=7,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        user="alice",
        guided_json={"type": "object"},  # a vLLM extra the schema does not know
    )
    valid = parse_chat_request(orjson.dumps(body), JSON)
    assert isinstance(valid.request, ChatCompletionRequest) and valid.chat
    assert valid.body == body
    assert valid.prompt_bytes == b"<system>Be brief.<user>Look: what is it?<assistant>"
    assert (valid.model, valid.stream, valid.max_tokens, valid.user) == ("m", True, 7, "alice")
    assert valid.include_usage and valid.continuous_usage_stats
    assert valid.request.model_extra == {"guided_json": {"type": "object"}}
    assert valid.request.messages[2].model_extra == {"tool_calls": [{"id": "t"}]}


@pytest.mark.parametrize(
    ("prompt", "hashed"),
    [
        ("hello", b"hello"),
        (["first", "second"], b"first"),
        ([1, 2, 3], b"[1,2,3]"),
        ([[4, 5], [6]], b"[4,5]"),
    ],
)
def test_completion_prompt_bytes(prompt: Any, hashed: bytes) -> None:
    valid = parse_completion_request(orjson.dumps({"model": "m", "prompt": prompt}), JSON)
    assert valid.prompt_bytes == hashed and not valid.chat
    assert (valid.stream, valid.max_tokens, valid.include_usage) == (False, None, False)


def test_completion_max_tokens_and_defaults() -> None:
    valid = parse_completion_request(
        orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 3, "temperature": 0}), JSON
    )
    r = valid.request
    assert (valid.max_tokens, r.temperature, r.n, r.ignore_eos, r.echo) == (
        3,
        0.0,
        None,
        False,
        False,
    )


def test_messages_alone() -> None:
    assert protocol.validate_messages([{"role": "user", "content": "x"}])[0].role == "user"
    part = [{"role": "u", "content": [{"type": "text"}]}]
    cases = [("x", "messages"), ([], "messages"), (["x"], "messages.0")]
    for bad, param in [*cases, (part, "messages.0.content.0.text")]:
        with pytest.raises(RequestError) as info:
            protocol.validate_messages(bad)
        assert info.value.param == param


def test_public_api() -> None:
    assert set(protocol.__all__) == {
        "JSON_MEDIA_TYPE",
        "ChatCompletionRequest",
        "CompletionRequest",
        "ContentPart",
        "ImageUrlPart",
        "Message",
        "RequestError",
        "StreamOptions",
        "TextPart",
        "ValidRequest",
        "check_content_type",
        "load_json_object",
        "parse_chat_request",
        "parse_completion_request",
        "validate_messages",
    }
    assert all(hasattr(protocol, name) for name in protocol.__all__)
