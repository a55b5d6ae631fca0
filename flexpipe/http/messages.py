"""The values a handler takes and returns: `Request`, `Response`, `StreamResponse`,
`PushResponse`, `HttpError`, and OpenAI's error body (see `flexpipe.http.server`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import orjson

if TYPE_CHECKING:
    from flexpipe.http.push import ChunkWriter

__all__ = [
    "Handler",
    "HttpError",
    "PushResponse",
    "Request",
    "Response",
    "StreamResponse",
    "error_body",
    "error_response",
    "json_response",
]

# vLLM's error "type" per status (vllm/entrypoints/openai: create_error_response).
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    414: "URITooLongError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


_STATUS_LINES = {s: b"HTTP/1.1 %d %s\r\n" % (s, _reason(s)) for s in range(100, 600)}


class HttpError(Exception):
    """Raise in a handler to answer `status` with an OpenAI/vLLM error body."""

    def __init__(
        self, status: int, message: str, type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param


class Request:
    __slots__ = ("_json", "body", "client", "headers", "method", "path", "query")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        headers: dict[str, str],
        body: bytes,
        client: tuple[str, int] | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.client = client
        self._json: Any = None

    def json(self) -> Any:
        """The body parsed as JSON; HttpError(400) when it is not JSON."""
        if self._json is None:
            try:
                self._json = orjson.loads(self.body)
            except orjson.JSONDecodeError as exc:
                raise HttpError(400, f"Invalid JSON body: {exc}") from None
        return self._json

    def query_params(self) -> dict[str, list[str]]:
        return parse_qs(self.query)


class Response:
    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body = body
        self.status = status
        self.content_type = content_type
        self.headers = headers


class StreamResponse:
    __slots__ = ("content_type", "headers", "iterator", "status")

    def __init__(
        self,
        iterator: AsyncIterator[bytes],
        status: int = 200,
        content_type: str = "text/event-stream",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.iterator = iterator
        self.status = status
        self.content_type = content_type
        self.headers = headers


class PushResponse:
    """A streamed response written by its producer through a `ChunkWriter` (see the module
    docstring); `start(writer)` is called once the connection is ready for it."""

    __slots__ = ("content_type", "headers", "start", "status")

    def __init__(
        self,
        start: Callable[[ChunkWriter], None],
        status: int = 200,
        content_type: str = "text/event-stream",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.start = start
        self.status = status
        self.content_type = content_type
        self.headers = headers


Handler = Callable[[Request], Awaitable[Response | StreamResponse | PushResponse]]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, "application/json", headers)


def error_body(
    status: int, message: str, type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """vLLM's error shape: {"error": {"message", "type", "param", "code": <status>}}."""
    err_type = type or _ERROR_TYPES.get(status, "Error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(
    status: int, message: str, type: str | None = None, param: str | None = None
) -> Response:
    return json_response(error_body(status, message, type, param), status)


def encode_head(
    status: int,
    content_type: str,
    headers: dict[str, str] | None,
    length: int | None,
    keep_alive: bool,
    chunked: bool = True,
) -> bytes:
    """The response head; `length` None: a stream, chunked or (HTTP/1.0) delimited by close."""
    parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status]
    parts.append(b"content-type: " + content_type.encode("latin-1") + b"\r\n")
    if length is None:
        if chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
    else:
        parts.append(b"content-length: %d\r\n" % length)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    if headers:
        for name, value in headers.items():
            parts.append(f"{name}: {value}\r\n".encode("latin-1"))
    parts.append(b"\r\n")
    return b"".join(parts)
