"""The controller's admin API (docs/controller.md), behind its bearer token:

    POST /admin/cluster/occupy    GPUs another tenant holds now (until a time, or released)
    POST /admin/cluster/release   GPUs given back
    GET  /admin/status            instances, resources, the last decision and shift, ...
    GET  /sd/engines              the engines as Prometheus HTTP service-discovery targets
    GET  /health, GET /metrics    (no token)

The request and answer shapes live in `control/api/client.py`, shared with `flexpipe cluster`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from flexpipe.control.api.client import (
    OCCUPY_PATH,
    RELEASE_PATH,
    STATUS_PATH,
    OccupyRequest,
    ReleaseRequest,
    admin_answer,
    bearer_ok,
)
from flexpipe.control.core.resources import ResourceError, ResourceEvent, Resources, UnknownGpuError
from flexpipe.control.core.targets import SD_PATH, http_sd_targets
from flexpipe.http.server import App, HttpError, Request, Response, json_response

if TYPE_CHECKING:
    from flexpipe.control.controller import Controller

__all__ = ["ControllerApi", "authorize"]


def authorize(req: Request, token: str | None) -> None:
    """The admin API's bearer token (constant-time), or a 401."""
    if not bearer_ok(req.headers.get("authorization"), token):
        raise HttpError(401, "admin API: missing or wrong bearer token")


class ControllerApi:
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl

    def add_routes(self, app: App) -> None:
        app.add_route("POST", OCCUPY_PATH, self._occupy)
        app.add_route("POST", RELEASE_PATH, self._release)
        app.add_route("GET", STATUS_PATH, self._status)
        app.add_route("GET", "/health", self._health)
        app.add_route("GET", "/metrics", self._metrics)
        app.add_route("GET", SD_PATH, self._targets)

    def _auth(self, req: Request) -> None:
        authorize(req, self.ctl.cfg.token)

    def _change(
        self, call: Callable[[], tuple[Resources, list[ResourceEvent]]], gpus: Sequence[str]
    ) -> Response:
        try:
            events = self.ctl.change_resources(call)
        except UnknownGpuError as exc:
            raise HttpError(404, str(exc)) from None
        except ResourceError as exc:
            raise HttpError(400, str(exc)) from None
        return json_response(admin_answer(gpus, events))

    async def _occupy(self, req: Request) -> Response:
        self._auth(req)
        try:
            body = OccupyRequest.from_json(req.json())
        except ResourceError as exc:
            raise HttpError(400, str(exc)) from None
        now = self.ctl.wall()
        return self._change(
            lambda: self.ctl.resources.occupy(body.gpus, body.owner, body.until_s, now),
            body.gpus,
        )

    async def _release(self, req: Request) -> Response:
        self._auth(req)
        try:
            body = ReleaseRequest.from_json(req.json())
        except ResourceError as exc:
            raise HttpError(400, str(exc)) from None
        now = self.ctl.wall()
        return self._change(lambda: self.ctl.resources.release(body.gpus, now), body.gpus)

    async def _status(self, req: Request) -> Response:
        self._auth(req)
        return json_response(self.ctl.status())

    async def _targets(self, req: Request) -> Response:
        self._auth(req)
        return json_response(http_sd_targets(self.ctl.status()["instances"]))

    async def _health(self, req: Request) -> Response:
        del req
        return Response(b"")

    async def _metrics(self, req: Request) -> Response:
        del req
        return Response(self.ctl.metrics.render(), content_type="text/plain; version=0.0.4")
