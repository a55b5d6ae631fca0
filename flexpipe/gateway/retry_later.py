"""Answers that tell the client when to try again (`Retry-After`, whole seconds, at least 1):
429 while every instance is busy or a tenant is over its quota, and 503 for a model no GPU
free to us can place (holds.py's refusals)."""

from __future__ import annotations

import math

from flexpipe.http.server import HttpError, Response, error_response

__all__ = ["RetryLater", "retry_later"]


class RetryLater(HttpError):
    def __init__(
        self, status: int, message: str, retry_after_s: float, param: str | None = None
    ) -> None:
        kind = "ServiceUnavailableError" if status == 503 else None
        super().__init__(status, message, type=kind, param=param)
        self.retry_after_s = retry_after_s


def retry_later(exc: RetryLater) -> Response:
    resp = error_response(exc.status, exc.message, exc.type, exc.param)
    resp.headers = {"retry-after": str(max(1, math.ceil(exc.retry_after_s)))}
    return resp
