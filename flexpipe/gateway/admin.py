"""The gateway's admin API (bearer token): the pool as the controller drives it.

GET  /admin/instances                 list with state and load
POST /admin/instances                 {"url", "model"?, "weight"?, "max_concurrency"?, "api_key"?}
POST /admin/instances/remove|drain|activate   {"url"}
POST /admin/instances/weight          {"url", "weight"}
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from flexpipe.gateway.pool import PoolError
from flexpipe.http.server import App, HttpError, Request, Response, json_response

if TYPE_CHECKING:
    from flexpipe.gateway.app import Gateway


class AdminApi:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def add_routes(self, app: App) -> None:
        app.add_route("GET", "/admin/instances", self.list)
        app.add_route("POST", "/admin/instances", self.add)
        app.add_route("POST", "/admin/instances/remove", self.remove)
        app.add_route("POST", "/admin/instances/drain", self.drain)
        app.add_route("POST", "/admin/instances/activate", self.activate)
        app.add_route("POST", "/admin/instances/weight", self.weight)

    def _check(self, req: Request) -> None:
        token = self.gw.cfg.admin_token
        if not token:
            raise HttpError(403, "the admin API is disabled: set admin_token in the config")
        given = req.headers.get("authorization", "")
        if not given.lower().startswith("bearer ") or not hmac.compare_digest(
            given[7:].strip().encode(), token.encode()
        ):
            raise HttpError(401, "admin API: missing or wrong bearer token")

    def _body(self, req: Request) -> dict[str, Any]:
        self._check(req)
        body = req.json()
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise HttpError(400, "expected a JSON object with a string `url`", param="url")
        return body

    async def list(self, req: Request) -> Response:
        self._check(req)
        return json_response({"instances": [i.as_dict() for i in self.gw.pool.instances.values()]})

    async def add(self, req: Request) -> Response:
        body = self._body(req)
        try:
            api_key = body.get("api_key")
            if api_key is not None and not isinstance(api_key, str):
                raise TypeError("`api_key` must be a string")
            inst = self.gw.pool.add(
                body["url"],
                body.get("model"),
                float(body.get("weight", 1.0)),
                int(body.get("max_concurrency", 0)),
                api_key,
            )
        except (PoolError, TypeError, ValueError) as exc:
            raise HttpError(400, str(exc)) from None
        if inst.model is None:
            await self.gw.prober.discover(inst)
        return json_response(inst.as_dict())

    async def remove(self, req: Request) -> Response:
        body = self._body(req)
        try:
            inst = self.gw.pool.remove(body["url"])
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None
        self.gw.router.remove_instance(inst.url)
        return json_response(inst.as_dict())

    async def drain(self, req: Request) -> Response:
        body = self._body(req)
        try:
            return json_response(self.gw.pool.drain(body["url"]).as_dict())
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None

    async def activate(self, req: Request) -> Response:
        body = self._body(req)
        try:
            return json_response(self.gw.pool.activate(body["url"]).as_dict())
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None

    async def weight(self, req: Request) -> Response:
        body = self._body(req)
        weight = body.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise HttpError(400, "`weight` must be a number", param="weight")
        try:
            return json_response(self.gw.pool.set_weight(body["url"], float(weight)).as_dict())
        except PoolError as exc:
            raise HttpError(400 if "weight" in str(exc) else 404, str(exc)) from None
