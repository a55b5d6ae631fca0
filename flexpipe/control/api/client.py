"""The controller's admin API for GPUs: its contract (paths, bodies, answers) and a small client,
synchronous (urllib, for the CLI) and asynchronous (flexpipe.http.client, for other processes).

The contract (docs/cluster-file.md, "Occupying GPUs by hand"); every call carries
`Authorization: Bearer <token>` when the controller has a token:

    POST /admin/gpus/occupy  {"gpus": ["gpu1"], "until_s": 1764600000.0 | null, "owner": "alice"}
    POST /admin/gpus/release {"gpus": ["gpu1"]}
      -> 200 {"gpus": ["gpu1"], "events": [ResourceEvent.to_json(), ...]}
      -> 400 bad body or until_s not in the future, GPU not occupied (release)
      -> 401 missing or wrong token; 404 unknown GPU
    GET  /admin/status       -> 200 JSON (the controller's; `Resources.to_json()` under "resources")

Errors are vLLM's error body, `{"error": {"message": ..., "code": <status>}}`. The server
parses bodies with `OccupyRequest.from_json` / `ReleaseRequest.from_json` (so both ends share
one reading of the contract), applies them with `Resources.occupy` / `.release`, and answers
`admin_answer(gpus, events)`.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexpipe.control.core.resources import DEFAULT_OWNER, ResourceError, ResourceEvent
from flexpipe.http.client import ClientPool, Timeouts, UpstreamError

__all__ = [
    "DEFAULT_CONTROLLER_URL",
    "OCCUPY_PATH",
    "RELEASE_PATH",
    "STATUS_PATH",
    "TOKEN_ENV",
    "AdminResult",
    "AsyncControllerClient",
    "ControllerClient",
    "ControllerError",
    "OccupyRequest",
    "ReleaseRequest",
    "admin_answer",
    "bearer_ok",
    "resolve_token",
]

DEFAULT_CONTROLLER_URL = "http://127.0.0.1:8100"
TOKEN_ENV = "FLEXPIPE_CONTROLLER_TOKEN"
OCCUPY_PATH = "/admin/gpus/occupy"
RELEASE_PATH = "/admin/gpus/release"
STATUS_PATH = "/admin/status"


class ControllerError(Exception):
    """The controller could not be reached or refused the call; the message is one line.
    `status`: the HTTP status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------------------------
# The contract


def _gpu_list(doc: Mapping[str, Any]) -> tuple[str, ...]:
    gpus = doc.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        raise ResourceError('"gpus" must be a non-empty list of GPU ids')
    bad = [g for g in gpus if not isinstance(g, str) or not g.strip()]
    if bad:
        raise ResourceError(f'"gpus" must hold GPU ids (strings); got {bad[0]!r}')
    return tuple(dict.fromkeys(g.strip() for g in gpus))


def _object(doc: object, keys: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(doc, dict):
        raise ResourceError("the body must be a JSON object")
    unknown = sorted(set(doc) - set(keys))
    if unknown:
        raise ResourceError(f"unknown field {unknown[0]!r}; allowed: {', '.join(keys)}")
    return doc


@dataclass(frozen=True, slots=True)
class OccupyRequest:
    gpus: tuple[str, ...]
    until_s: float | None = None  # unix seconds; None: until released
    owner: str = DEFAULT_OWNER

    def to_json(self) -> dict[str, Any]:
        return {"gpus": list(self.gpus), "until_s": self.until_s, "owner": self.owner}

    @staticmethod
    def from_json(doc: object) -> OccupyRequest:
        """Read a body; a mistake is one ResourceError (HTTP 400)."""
        body = _object(doc, ("gpus", "until_s", "owner"))
        gpus = _gpu_list(body)
        until = body.get("until_s")
        if until is not None and (isinstance(until, bool) or not isinstance(until, int | float)):
            raise ResourceError(f'"until_s" must be unix seconds or null; got {until!r}')
        owner = body.get("owner", DEFAULT_OWNER)
        if owner is None:
            owner = DEFAULT_OWNER
        if not isinstance(owner, str) or not owner.strip():
            raise ResourceError(f'"owner" must be a non-empty string; got {owner!r}')
        return OccupyRequest(gpus, None if until is None else float(until), owner.strip())


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    gpus: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"gpus": list(self.gpus)}

    @staticmethod
    def from_json(doc: object) -> ReleaseRequest:
        return ReleaseRequest(_gpu_list(_object(doc, ("gpus",))))


def admin_answer(gpus: Sequence[str], events: Sequence[ResourceEvent]) -> dict[str, Any]:
    """The 200 body of occupy and release."""
    return {"gpus": list(gpus), "events": [e.to_json() for e in events]}


@dataclass(frozen=True, slots=True)
class AdminResult:
    """What the controller answered to occupy / release."""

    gpus: tuple[str, ...]
    events: tuple[ResourceEvent, ...]

    @staticmethod
    def from_json(doc: Any) -> AdminResult:
        try:
            return AdminResult(
                tuple(str(g) for g in doc["gpus"]),
                tuple(ResourceEvent.from_json(e) for e in doc["events"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ControllerError(
                f"the controller's answer does not fit the contract: {exc!r}"
            ) from None

    def summary(self) -> str:
        """One line: what changed for flexpipe, in the controller's words."""
        if not self.events:
            return "no change to the GPUs free to flexpipe"
        return "; ".join(e.why for e in self.events)


def bearer_ok(authorization: str | None, token: str | None) -> bool:
    """Whether an `Authorization` header carries `token` (always true without a token)."""
    if not token:
        return True
    given = authorization or ""
    if not given.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(given[7:].strip().encode(), token.encode())


# --------------------------------------------------------------------------------------------
# CLI inputs


def resolve_token(
    token: str | None, token_file: Path | None, environ: Mapping[str, str] = os.environ
) -> str | None:
    """`--token`, else `--token-file`, else $FLEXPIPE_CONTROLLER_TOKEN, else None."""
    if token is not None and token_file is not None:
        raise ValueError("give --token or --token-file, not both")
    if token is not None:
        if not token.strip():
            raise ValueError("--token is empty")
        return token.strip()
    if token_file is not None:
        try:
            text = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"--token-file {token_file}: cannot read: {reason}") from None
        if not text:
            raise ValueError(f"--token-file {token_file} is empty")
        return text
    return environ.get(TOKEN_ENV) or None


# --------------------------------------------------------------------------------------------
# Clients


def _base(url: str) -> str:
    base = url.strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+$", base):
        raise ValueError(f"controller URL {url!r}: expected http://HOST:PORT")
    return base


def _answer(base: str, status: int, body: bytes) -> Any:
    """The JSON of a 2xx answer; anything else is one ControllerError line."""
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        doc = None
    if 200 <= status < 300:
        if doc is None:
            raise ControllerError(
                f"the controller at {base} answered {status} without JSON", status
            )
        return doc
    message = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        message = doc["error"].get("message")
    if message is None:
        message = body.decode("utf-8", "replace").strip()[:200] or "no details"
    hint = " (give --token, --token-file or $FLEXPIPE_CONTROLLER_TOKEN)" if status == 401 else ""
    raise ControllerError(f"the controller refused ({status}): {message}{hint}", status)


def _unreachable(base: str, reason: str) -> ControllerError:
    return ControllerError(
        f"cannot reach the controller at {base}: {reason} (is `flexpipe controller` running? "
        "--controller gives its URL)"
    )


class ControllerClient:
    """Blocking client (the CLI). Every error is a ControllerError with a one-line message."""

    def __init__(
        self, url: str = DEFAULT_CONTROLLER_URL, token: str | None = None, timeout_s: float = 10.0
    ) -> None:
        self.base = _base(url)
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("accept", "application/json")
        if data is not None:
            request.add_header("content-type", "application/json")
        if self.token:
            request.add_header("authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                return _answer(self.base, resp.status, resp.read())
        except urllib.error.HTTPError as exc:
            return _answer(self.base, exc.code, exc.read())
        except urllib.error.URLError as exc:
            reason = exc.reason
            text = getattr(reason, "strerror", None) or str(reason)
            raise _unreachable(self.base, text.lower()) from None
        except TimeoutError:
            raise _unreachable(self.base, f"no answer within {self.timeout_s:g} s") from None
        except OSError as exc:
            raise _unreachable(self.base, (exc.strerror or str(exc)).lower()) from None

    def occupy(
        self, gpus: Sequence[str], until_s: float | None = None, owner: str = DEFAULT_OWNER
    ) -> AdminResult:
        body = OccupyRequest(tuple(gpus), until_s, owner).to_json()
        return AdminResult.from_json(self._call("POST", OCCUPY_PATH, body))

    def release(self, gpus: Sequence[str]) -> AdminResult:
        body = ReleaseRequest(tuple(gpus)).to_json()
        return AdminResult.from_json(self._call("POST", RELEASE_PATH, body))

    def status(self) -> Any:
        return self._call("GET", STATUS_PATH)


class AsyncControllerClient:
    """The same calls on an event loop, over a keep-alive ClientPool (close() when done)."""

    def __init__(
        self,
        url: str = DEFAULT_CONTROLLER_URL,
        token: str | None = None,
        timeout_s: float = 10.0,
        pool: ClientPool | None = None,
    ) -> None:
        self.base = _base(url)
        if not self.base.startswith("http://"):
            raise ValueError(f"controller URL {url!r}: the async client speaks http:// only")
        self.token = token
        self.timeouts = Timeouts(connect_s=timeout_s, ttfb_s=timeout_s, idle_s=timeout_s)
        self._own_pool = pool is None
        self.pool = pool or ClientPool()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"accept": "application/json"}
        if body is not None:
            headers["content-type"] = "application/json"
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        data = b"" if body is None else json.dumps(body).encode()
        try:
            resp = await self.pool.request(self.base, method, path, data, headers, self.timeouts)
            try:
                raw = await resp.read()
            finally:
                resp.release()
        except UpstreamError as exc:
            reason = "could not connect" if exc.kind == "connect" else str(exc)
            raise _unreachable(self.base, reason) from None
        return _answer(self.base, resp.status, raw)

    async def occupy(
        self, gpus: Sequence[str], until_s: float | None = None, owner: str = DEFAULT_OWNER
    ) -> AdminResult:
        body = OccupyRequest(tuple(gpus), until_s, owner).to_json()
        return AdminResult.from_json(await self._call("POST", OCCUPY_PATH, body))

    async def release(self, gpus: Sequence[str]) -> AdminResult:
        body = ReleaseRequest(tuple(gpus)).to_json()
        return AdminResult.from_json(await self._call("POST", RELEASE_PATH, body))

    async def status(self) -> Any:
        return await self._call("GET", STATUS_PATH)

    async def close(self) -> None:
        if self._own_pool:
            await self.pool.close()
