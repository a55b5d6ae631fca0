"""The OpenAI request schema, validated once at the edge (gateway and sim engine alike).

pydantic v2 models (what vLLM and the official `openai` client use) for the bodies of
POST /v1/completions and POST /v1/chat/completions. Types are strict: `true` is not an
integer, `"yes"` is not a boolean, `5` and `null` are not text; unknown fields are kept
(vLLM's extras, fields of newer API versions), as vLLM does.

    from flexpipe.protocol import RequestError, parse_chat_request

    try:
        valid = parse_chat_request(req.body, req.headers.get("content-type"))
    except RequestError as exc:
        return error_response(400, exc.message, "BadRequestError", exc.param)
    valid.request            # the ChatCompletionRequest (typed fields)
    valid.body               # the same body as a plain dict (forward it, rewrite it)
    valid.prompt_bytes       # what prefix hashing reads (roles + text parts; the prompt)
    valid.stream, valid.max_tokens, valid.include_usage, valid.user

Every violation raises one `RequestError` with a readable message and the offending
`param` as a dotted path (`messages.0.content.0.text`); `exc.body()` is OpenAI's error shape
{"error": {"message", "type": "BadRequestError", "param", "code": 400}}.

The body is parsed once with orjson (the gateway needs the dict anyway) and validated with
`model_validate(strict=True)`; see docs/sim-engine.md for the cost per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    TypeAdapter,
    ValidationError,
)

JSON_MEDIA_TYPE = "application/json"
MAX_SEED = (1 << 63) - 1


class RequestError(ValueError):
    """A request body the API refuses: a 400 with `message` and the offending `param`."""

    status = 400
    type = "BadRequestError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[Any, tuple[str, str | None]]:
        # raised in the gateway's parser process: `param` must cross back with the message
        return self.__class__, (self.message, self.param)

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape (vLLM's too: `code` is the HTTP status)."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


class _Model(BaseModel):
    # strict: no coercion ("5" is not 5, true is not 1); extra fields kept, as vLLM does
    model_config = ConfigDict(strict=True, extra="allow")


# --- chat messages ---------------------------------------------------------------------------
class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(_Model):
    url: StrictStr


class ImageUrlPart(_Model):
    """Accepted and ignored (the sim engine is text-only; vLLM serves it on vision models)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class MediaPart(_Model):
    """Other media parts vLLM or OpenAI accept (audio, video, files): accepted and ignored."""

    type: Literal["input_audio", "audio_url", "video_url", "file", "image_embeds"]


class RefusalPart(_Model):
    type: Literal["refusal"]
    refusal: StrictStr


def _part_kind(part: Any) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return kind if isinstance(kind, str) else None


ContentPart = Annotated[
    Annotated[TextPart, Tag("text")]
    | Annotated[ImageUrlPart, Tag("image_url")]
    | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[MediaPart, Tag("input_audio")]
    | Annotated[MediaPart, Tag("audio_url")]
    | Annotated[MediaPart, Tag("video_url")]
    | Annotated[MediaPart, Tag("file")]
    | Annotated[MediaPart, Tag("image_embeds")],
    Discriminator(
        _part_kind,
        custom_error_type="invalid_content_part",
        custom_error_message=(
            "a content part must be an object whose `type` is one of text, image_url, "
            "refusal, input_audio, audio_url, video_url, file, image_embeds"
        ),
    ),
]


def _text_or_list(value: Any) -> str | None:
    """Which branch of a "string or list" union to validate: one clear error, not one per
    branch."""
    if isinstance(value, str):
        return "text"
    return "list" if isinstance(value, list) else None


Content = Annotated[
    Annotated[StrictStr, Tag("text")] | Annotated[list[ContentPart], Tag("list")],
    Discriminator(
        _text_or_list,
        custom_error_type="content_type",
        custom_error_message="must be a string or a list of content parts",
    ),
]
Stop = Annotated[
    Annotated[StrictStr, Tag("text")] | Annotated[list[StrictStr], Tag("list")],
    Discriminator(
        _text_or_list,
        custom_error_type="stop_type",
        custom_error_message="must be a string or a list of strings",
    ),
]


class Message(_Model):
    role: Annotated[StrictStr, Field(min_length=1)]
    content: Content | None = None  # None: an assistant turn with tool calls
    name: StrictStr | None = None


class StreamOptions(_Model):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


# --- sampling (both endpoints) ---------------------------------------------------------------
PositiveInt = Annotated[StrictInt, Field(ge=1)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class _Sampling(_Model):
    model: Annotated[StrictStr, Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    stop: Stop | None = None
    seed: Annotated[StrictInt, Field(ge=-MAX_SEED - 1, le=MAX_SEED)] | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras the sim engine honours (or accepts)
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    top_k: StrictInt | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    skip_special_tokens: StrictBool = True

    @property
    def output_limit(self) -> int | None:
        """The client's cap on generated tokens (None: the model stops by itself)."""
        return self.max_tokens


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
        m = self.max_completion_tokens
        return m if m is not None else self.max_tokens


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    if not value:
        return "ids"  # too short
    first = value[0]
    if isinstance(first, str):
        return "texts"
    if isinstance(first, list):
        return "batch"
    return "ids"


Prompt = Annotated[
    Annotated[StrictStr, Tag("text")]
    | Annotated[list[StrictStr], Field(min_length=1), Tag("texts")]
    | Annotated[list[TokenId], Field(min_length=1), Tag("ids")]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Tag("batch")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message=(
            "must be a string, a list of strings, a list of token ids or a list of token id lists"
        ),
    ),
]


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Prompt
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True


R = TypeVar("R", ChatCompletionRequest, CompletionRequest)


@dataclass(frozen=True, slots=True)
class ValidRequest(Generic[R]):
    """A validated request: the typed model and the same body as a plain dict."""

    request: R
    body: dict[str, Any]

    @property
    def chat(self) -> bool:
        return isinstance(self.request, ChatCompletionRequest)

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def max_tokens(self) -> int | None:
        """The client's cap on generated tokens (chat: max_completion_tokens first)."""
        return self.request.output_limit

    @property
    def include_usage(self) -> bool:
        opts = self.request.stream_options
        return bool(opts is not None and opts.include_usage)

    @property
    def continuous_usage_stats(self) -> bool:
        opts = self.request.stream_options
        return bool(opts is not None and opts.continuous_usage_stats)

    @property
    def user(self) -> str:
        return self.request.user or ""

    @property
    def prompt_bytes(self) -> bytes:
        """What the gateway hashes for prefix affinity. Chat: "<role>" then the message's
        text (a string, or its text parts joined), message after message; completions: the
        prompt (the first one of a batch; token ids as their JSON list)."""
        req = self.request
        if isinstance(req, ChatCompletionRequest):
            parts: list[str] = []
            for m in req.messages:
                parts.append(f"<{m.role}>")
                content = m.content
                if isinstance(content, str):
                    parts.append(content)
                elif content is not None:
                    parts.extend(p.text for p in content if isinstance(p, TextPart))
            return "".join(parts).encode()
        prompt = req.prompt
        if isinstance(prompt, str):
            return prompt.encode()
        first = prompt[0]
        if isinstance(first, str):
            return first.encode()
        return orjson.dumps(first if isinstance(first, list) else prompt)


# --- parsing ---------------------------------------------------------------------------------
def check_content_type(content_type: str | None, allow_missing: bool = True) -> None:
    """The body must be declared JSON. vLLM answers 400 to any other media type, a missing
    header included (`allow_missing=False`); the gateway accepts a missing header."""
    if content_type is None:
        if allow_missing:
            return
        raise RequestError(
            "Unsupported Media Type: send the body as application/json (content-type header)"
        )
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise RequestError(
            f"Unsupported Media Type {media_type or '(empty)'!r}: "
            "only 'application/json' is allowed"
        )


def parse_chat_request(
    raw: bytes, content_type: str | None = None, allow_missing_content_type: bool = True
) -> ValidRequest[ChatCompletionRequest]:
    """Validate a /v1/chat/completions body; RequestError (400) on any violation."""
    return _parse(ChatCompletionRequest, raw, content_type, allow_missing_content_type)


def parse_completion_request(
    raw: bytes, content_type: str | None = None, allow_missing_content_type: bool = True
) -> ValidRequest[CompletionRequest]:
    """Validate a /v1/completions body; RequestError (400) on any violation."""
    return _parse(CompletionRequest, raw, content_type, allow_missing_content_type)


def load_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; RequestError otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _parse(
    cls: type[R], raw: bytes, content_type: str | None, allow_missing_content_type: bool
) -> ValidRequest[R]:
    check_content_type(content_type, allow_missing_content_type)
    body = load_json_object(raw)
    try:
        request = cls.model_validate(body)
    except ValidationError as exc:
        raise _request_error(exc, body) from None
    _check_rules(request)
    return ValidRequest(request, body)


_MESSAGE_LIST: TypeAdapter[list[Message]] = TypeAdapter(
    Annotated[list[Message], Field(min_length=1)]
)


def validate_messages(messages: Any) -> list[Message]:
    """Chat messages alone (vLLM's /tokenize takes them): RequestError on a violation, its
    param under `messages`."""
    try:
        return _MESSAGE_LIST.validate_python(messages)
    except ValidationError as exc:
        err = _request_error(exc, {"messages": messages}, prefix=("messages",))
        raise err from None


def _check_rules(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Rules between fields (cheaper here than as pydantic validators, and with a param)."""
    if req.n is not None and req.n != 1:
        raise RequestError(f"n: only 1 choice is supported, got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options: only allowed when stream is true", "stream_options")
    limit = req.output_limit
    if limit is not None and req.min_tokens > limit:
        raise RequestError(
            f"min_tokens: must be <= max_tokens ({limit}), got {req.min_tokens}", "min_tokens"
        )


_MESSAGES: dict[str, Callable[[dict[str, Any]], str]] = {
    "missing": lambda e: "is required",
    "string_type": lambda e: f"must be a string, got {_json_kind(e['input'])}",
    "int_type": lambda e: f"must be an integer, got {_json_kind(e['input'])}",
    "bool_type": lambda e: f"must be a boolean (true or false), got {_json_kind(e['input'])}",
    "float_type": lambda e: f"must be a number, got {_json_kind(e['input'])}",
    "list_type": lambda e: f"must be a list, got {_json_kind(e['input'])}",
    "dict_type": lambda e: f"must be an object, got {_json_kind(e['input'])}",
    "model_type": lambda e: f"must be an object, got {_json_kind(e['input'])}",
    "model_attributes_type": lambda e: f"must be an object, got {_json_kind(e['input'])}",
    "too_short": lambda e: "must not be empty",
    "string_too_short": lambda e: "must not be empty",
    "greater_than_equal": lambda e: f"must be >= {e['ctx']['ge']}, got {e['input']!r}",
    "greater_than": lambda e: f"must be > {e['ctx']['gt']}, got {e['input']!r}",
    "less_than_equal": lambda e: f"must be <= {e['ctx']['le']}, got {e['input']!r}",
    "less_than": lambda e: f"must be < {e['ctx']['lt']}, got {e['input']!r}",
    "literal_error": lambda e: f"must be {e['ctx']['expected']}",
}


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _request_error(
    exc: ValidationError, body: dict[str, Any], prefix: tuple[str, ...] = ()
) -> RequestError:
    """The first violation as one RequestError (the count of the others in the message)."""
    errors = exc.errors(include_url=False, include_context=True)
    err = errors[0]
    param = _param((*prefix, *err["loc"]), body)
    describe = _MESSAGES.get(err["type"])
    if describe is not None:
        what = describe(dict(err))
    else:
        what = str(err["msg"]).removeprefix("Value error, ")
        what = what[:1].lower() + what[1:]
    message = f"{param or 'body'}: {what}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return RequestError(message, param)


def _param(loc: tuple[int | str, ...], body: Any) -> str | None:
    """pydantic's error location as the client's dotted path (`messages.0.content.0.text`).

    A location also names union branches (tags such as "parts"); walking the body tells them
    apart from fields: a segment is kept when the body has it at that point, or when it is
    the last segment under an object (a missing field)."""
    path: list[str] = []
    node = body
    last = len(loc) - 1
    for i, seg in enumerate(loc):
        if isinstance(seg, int):
            if isinstance(node, list) and 0 <= seg < len(node):
                path.append(str(seg))
                node = node[seg]
            continue
        if isinstance(node, dict) and (seg in node or i == last):
            path.append(seg)
            node = node.get(seg)
    return ".".join(path) or None


__all__ = [
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
]
