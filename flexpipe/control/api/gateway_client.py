"""The controller's side of the gateway's admin API (docs/gateway.md): register, drain,
move and remove instances, and read what the gateway sees. Every call is one HTTP request on
a pooled keep-alive connection; a failure is a `GatewayError` with one readable line.

`GatewayAdmin` is what the controller calls: this client for one gateway, or
`control/gateway_fleet.GatewayFleet` for several replicas of one, which says the same."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from flexpipe.http.client import ClientPool, Timeouts, UpstreamError

__all__ = ["GatewayAdmin", "GatewayClient", "GatewayError"]


class GatewayError(RuntimeError):
    """The gateway refused (`status`: its HTTP status) or could not be reached (None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class GatewayAdmin(Protocol):
    """The gateway's admin API as the controller uses it (docs/gateway.md)."""

    @property
    def url(self) -> str: ...

    async def close(self) -> None: ...

    async def instances(self) -> list[dict[str, Any]]: ...

    async def add(
        self,
        url: str,
        model: str,
        max_num_seqs: int = 0,
        admin_token: str | None = None,
        api_key: str | None = None,
        state: str = "active",
    ) -> dict[str, Any]: ...

    async def set_state(self, url: str, state: str) -> None: ...

    async def set_weight(self, url: str, weight: float) -> None: ...

    async def remove(self, url: str) -> None: ...

    async def drain(self, url: str, wait_s: float = 0.0) -> bool: ...

    async def requests_on(self, url: str) -> list[dict[str, Any]]: ...

    async def move(self, moves: Sequence[dict[str, Any]]) -> list[dict[str, Any]]: ...

    async def hold(self, model: str, seconds: float) -> None: ...

    async def refuse(self, model: str, reason: str, seconds: float) -> None: ...

    async def demand(self, models: Sequence[str], wait_s: float) -> dict[str, int]: ...

    async def metrics(self) -> str: ...


class GatewayClient:
    def __init__(
        self, url: str, token: str | None, timeout_s: float = 10.0, connect_s: float = 3.0
    ) -> None:
        self._url = url.rstrip("/")
        self._headers = {"content-type": "application/json"}
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        self._timeouts = Timeouts(connect_s=connect_s, ttfb_s=timeout_s, idle_s=timeout_s)
        self._pool = ClientPool(max_idle_per_backend=4)

    @property
    def url(self) -> str:
        return self._url

    async def close(self) -> None:
        await self._pool.close()

    async def _call(
        self, method: str, path: str, body: Any = None, ttfb_s: float | None = None
    ) -> Any:
        raw = b"" if body is None else orjson.dumps(body)
        timeouts = self._timeouts
        if ttfb_s is not None:
            timeouts = Timeouts(timeouts.connect_s, ttfb_s, timeouts.idle_s)
        try:
            resp = await self._pool.request(self.url, method, path, raw, self._headers, timeouts)
            data = await resp.read()
            resp.release()
        except UpstreamError as exc:
            raise GatewayError(f"gateway {self.url}{path}: {exc}") from None
        if resp.status >= 400:
            detail = data[:300].decode("utf-8", "replace")
            raise GatewayError(f"gateway {self.url}{path}: {resp.status} {detail}", resp.status)
        return orjson.loads(data) if data else None

    async def _text(self, path: str) -> str:
        try:
            resp = await self._pool.request(self.url, "GET", path, b"", None, self._timeouts)
            data = await resp.read()
            resp.release()
        except UpstreamError as exc:
            raise GatewayError(f"gateway {self.url}{path}: {exc}") from None
        return data.decode("utf-8", "replace")

    async def instances(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/admin/instances"))["instances"])

    async def add(
        self,
        url: str,
        model: str,
        max_num_seqs: int = 0,
        admin_token: str | None = None,
        api_key: str | None = None,
        state: str = "active",
    ) -> dict[str, Any]:
        """Register an engine launched with `max_num_seqs` (its cap is derived from it), in
        lifecycle `state` (starting or rehearsing: visible in the pool, not routed)."""
        body: dict[str, Any] = {
            "url": url,
            "model": model,
            "max_num_seqs": max_num_seqs,
            "state": state,
        }
        if admin_token:
            body["admin_token"] = admin_token
        if api_key:
            body["api_key"] = api_key
        return dict(await self._call("POST", "/admin/instances", body))

    async def set_state(self, url: str, state: str) -> None:
        """Move an instance along its lifecycle in the gateway's pool (gone removes it)."""
        await self._call("POST", "/admin/instances/state", {"url": url, "state": state})

    async def set_weight(self, url: str, weight: float) -> None:
        """The instance's share of its model's traffic (relative to the others')."""
        await self._call("POST", "/admin/instances/weight", {"url": url, "weight": weight})

    async def remove(self, url: str) -> None:
        await self._call("POST", "/admin/instances/remove", {"url": url})

    async def drain(self, url: str, wait_s: float = 0.0) -> bool:
        """Stop routing to `url`; with `wait_s`, wait until it serves nothing. Returns
        whether it is empty."""
        body = {"url": url, "wait_s": wait_s}
        answer = await self._call("POST", "/admin/instances/drain", body, ttfb_s=wait_s + 10)
        return bool(answer.get("drained"))

    async def requests_on(self, url: str) -> list[dict[str, Any]]:
        answer = await self._call("GET", f"/admin/instances/requests?url={url}")
        return list(answer["requests"])

    async def move(self, moves: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        answer = await self._call("POST", "/admin/requests/move", {"moves": list(moves)})
        return list(answer["results"])

    async def hold(self, model: str, seconds: float) -> None:
        """Requests of `model` wait up to `seconds` for capacity instead of being refused
        (0: back to the gateway's own queue wait)."""
        await self._call("POST", "/admin/models/hold", {"model": model, "seconds": seconds})

    async def refuse(self, model: str, reason: str, seconds: float) -> None:
        """No GPU free to us can place `model`: for `seconds` (renewed by the caller), while
        it has no instance, its requests get a 503 with `reason` (a `hold` lifts it)."""
        body = {"model": model, "reason": reason, "seconds": seconds}
        await self._call("POST", "/admin/models/refuse", body)

    async def demand(self, models: Sequence[str], wait_s: float) -> dict[str, int]:
        """Requests queued at the gateway for `models`, answered as soon as one queues (or
        after `wait_s` with none): the demand trigger of a model scaled to zero."""
        body = {"models": list(models), "wait_s": wait_s}
        answer = await self._call("POST", "/admin/models/demand", body, ttfb_s=wait_s + 10)
        return {str(k): int(v) for k, v in dict(answer["queued"]).items()}

    async def metrics(self) -> str:
        return await self._text("/metrics")
