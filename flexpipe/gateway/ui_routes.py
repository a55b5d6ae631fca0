"""The dashboard on the gateway's port (docs/dashboard.md): the page and its static files, its
JSON view and a server-sent event stream of it; and the loop that feeds them — every
`ui_interval_s` one reading of the gateway (its metrics registry, its pool, the engines'
token and prefix-cache counters) into a 15-minute ring, and, when the gateway knows its
controller (`controller_url`), the GPU map and the shift log from the controller's admin API;
and, when the operator names NVIDIA's DCGM exporters (`dcgm_urls`), how busy each instance's
GPUs are (joined through the GPU map: flexpipe/observe/dcgm.py; docs/observability.md).

GET /ui, /ui/              the page (reads are open, as /metrics is; an action on the page,
                           such as drain, goes to the admin API with the admin token)
GET /ui/static/<file>      its CSS and JS (no CDN: works offline)
GET /ui/api/view[?since=T][&shifts=all]
                           the view (`flexpipe.ui.view.assemble_view`); `since`: only the
                           series points after unix time T; `shifts=all`: the shift log of
                           every deployment on the store, earlier runs too (default: this
                           run's, since this gateway started)
GET /ui/events[?shifts=all]
                           text/event-stream: `event: view` with the whole view at once, then
                           every interval with the points new to this client
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from flexpipe.gateway.core.pool import Instance
from flexpipe.http.client import Timeouts, UpstreamError
from flexpipe.http.server import (
    App,
    ChunkWriter,
    HttpError,
    PushResponse,
    Request,
    Response,
    json_response,
)
from flexpipe.observe.dcgm import (
    GpuReading,
    gpu_busy_by_instance,
    join_instances,
    parse_dcgm,
    topology_places,
)
from flexpipe.ui.reading import EngineCounters, Reading, parse_engine_counters, read_registry
from flexpipe.ui.series import History
from flexpipe.ui.view import ControllerSnapshot, ExporterState, assemble_view

if TYPE_CHECKING:
    from flexpipe.gateway.app import Gateway

__all__ = ["UiRoutes"]

log = logging.getLogger("flexpipe.gateway.ui")

_STATIC = {  # file -> content type; the page's whole set (exact routes, nothing else served)
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
_TIMEOUTS = Timeouts(connect_s=1.0, ttfb_s=3.0, idle_s=3.0)
_MAX_SHIFTS = 100


def _base_and_path(url: str) -> tuple[str, str]:
    """An exporter's URL as the HTTP client takes it: http://HOST:PORT, and the path
    (`/metrics` where the URL names none, as dcgm-exporter serves it)."""
    parts = urlsplit(url.rstrip("/"))
    path = (parts.path or "/metrics") + (f"?{parts.query}" if parts.query else "")
    return f"{parts.scheme}://{parts.netloc}", path


def _asset(name: str) -> bytes:
    return resources.files("flexpipe.ui").joinpath("static", name).read_bytes()


class _Stream:
    """One client of /ui/events: its writer, the newest point it has, which shifts it sees."""

    __slots__ = ("every_shift", "last_t", "writer")

    def __init__(self, writer: ChunkWriter, every_shift: bool = False) -> None:
        self.writer = writer
        self.last_t: float | None = None
        self.every_shift = every_shift


def _every_shift(req: Request) -> bool:
    """`shifts=all`: every deployment's shift log entries; `shifts=run` (the default): this
    run's."""
    given = (req.query_params().get("shifts") or ["run"])[0]
    if given not in ("run", "all"):
        raise HttpError(400, f"shifts must be run or all, got {given!r}", param="shifts")
    return given == "all"


class UiRoutes:
    def __init__(self, gw: Gateway, wall: Callable[[], float] = time.time) -> None:
        self.gw = gw
        self.wall = wall
        self.started_at_s = wall()  # the timeline shows this run's shifts by default
        self.interval_s = gw.cfg.ui_interval_s
        self.history = History()
        self.controller: ControllerSnapshot | None = (
            ControllerSnapshot(gw.cfg.controller_url.rstrip("/")) if gw.cfg.controller_url else None
        )
        self.streams: set[_Stream] = set()
        self._engines: dict[str, EngineCounters] = {}  # url -> last counters scraped
        # the DCGM exporters: each one's state for the view, and the GPUs it last reported
        self.exporters = {u: ExporterState(u) for u in gw.cfg.dcgm_urls}
        self._gpus: dict[str, dict[tuple[str, int], GpuReading]] = {}
        self._task: asyncio.Task[None] | None = None
        self._page = _asset("index.html")
        self._static = {name: _asset(name) for name in _STATIC}

    @property
    def num_streams(self) -> int:
        """Clients of /ui/events connected now."""
        return len(self.streams)

    def add_routes(self, app: App) -> None:
        app.add_route("GET", "/ui", self._index)
        app.add_route("GET", "/ui/", self._index)
        for name in _STATIC:
            app.add_route("GET", f"/ui/static/{name}", self._file)
        app.add_route("GET", "/ui/api/view", self._view)
        app.add_route("GET", "/ui/events", self._events)

    # ---------------------------------------------------------------- the loop
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for stream in list(self.streams):
            stream.writer.end()
        self.streams.clear()

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
                self.push()
            except Exception:  # a bug here must not stop the dashboard
                log.exception("dashboard sampling failed")
            await asyncio.sleep(self.interval_s)

    async def sample(self) -> None:
        """One reading of the gateway (and of the controller, when it has one)."""
        instances = list(self.gw.pool.instances.values())
        polls: list[Any] = [self._scrape(i) for i in instances]
        if self.controller is not None:
            polls.append(self._poll_controller(self.controller.url))
        polls += [self._scrape_dcgm(url) for url in self.exporters]
        await asyncio.gather(*polls)
        live = {i.url for i in instances}
        self._engines = {u: c for u, c in self._engines.items() if u in live}
        reading = Reading(
            at_s=self.wall(),
            models=read_registry(self.gw.metrics.registry.collect()),
            engines=dict(self._engines),
            instances=tuple(i.as_dict() for i in self.gw.pool.instances.values()),
            num_queued=self.gw.num_waiting,
            gpu_busy=self._gpu_busy(),
        )
        self.history.add(reading)

    def _gpu_busy(self) -> dict[str, tuple[float, ...]]:
        """Each instance's GPUs (from the controller's GPU map) with what the exporters
        reported for them: instance url -> busy fractions."""
        if not self._gpus or self.controller is None:
            return {}
        readings: dict[tuple[str, int], GpuReading] = {}
        for url in sorted(self._gpus):
            readings.update(self._gpus[url])
        places = topology_places(self.controller.topology)
        rows = join_instances(readings, places, self.gw.cfg.dcgm_hostnames)
        return gpu_busy_by_instance(rows)

    async def _get(self, base: str, path: str, token: str | None) -> tuple[int, bytes]:
        headers = {"authorization": f"Bearer {token}"} if token else None
        resp = await self.gw.client.request(base, "GET", path, headers=headers, timeouts=_TIMEOUTS)
        try:
            return resp.status, await resp.read()
        finally:
            resp.release()

    async def _scrape(self, inst: Instance) -> None:
        """The engine's token and prefix-cache counters (kept from the last scrape on failure:
        the prober decides about health)."""
        with contextlib.suppress(UpstreamError):
            status, body = await self._get(inst.url, "/metrics", inst.api_key)
            if status == 200:
                self._engines[inst.url] = parse_engine_counters(body)

    async def _scrape_dcgm(self, url: str) -> None:
        """One DCGM exporter's GPUs, with the engines' timeouts. A dead one's GPUs are
        dropped (an old reading would pass for a measurement) and it is said once, in the log
        and in the view, until it answers again; the others are used meanwhile."""
        base, path = _base_and_path(url)
        try:
            status, body = await self._get(base, path, None)
            if status != 200:
                raise ValueError(f"it answered {status}")
            readings = parse_dcgm(body.decode("utf-8", "replace"))
        except (UpstreamError, OSError, ValueError) as exc:
            self._gpus.pop(url, None)
            why = f"cannot read the DCGM exporter at {url}: {exc}"
            if self.exporters[url].error is None:
                log.warning("%s; its GPUs' utilisation is left out until it answers", why)
            self.exporters[url] = ExporterState(url, 0, why)
            return
        if self.exporters[url].error is not None:
            log.warning("the DCGM exporter at %s answers again", url)
        self._gpus[url] = readings
        self.exporters[url] = ExporterState(url, len(readings))

    async def _poll_controller(self, url: str) -> None:
        token = self.gw.cfg.controller_token
        old = self.controller or ControllerSnapshot(url)
        try:
            s1, topo = await self._get(url, "/admin/topology", token)
            s2, own = await self._get(url, f"/admin/shifts?limit={_MAX_SHIFTS}", token)
            s3, every = await self._get(url, f"/admin/shifts?limit={_MAX_SHIFTS}&all=1", token)
            bad = [s for s in (s1, s2, s3) if s != 200]
            if bad:
                raise ValueError(f"the controller answered {bad[0]}")
            mine = orjson.loads(own)
            self.controller = ControllerSnapshot(
                url,
                orjson.loads(topo),
                mine["entries"],
                None,
                self.wall(),
                orjson.loads(every)["entries"],
                mine.get("deployment"),
            )
        except (UpstreamError, ValueError, KeyError, TypeError) as exc:
            why = f"cannot read the controller at {url}: {exc}"
            self.controller = replace(old, url=url, error=why)

    # ---------------------------------------------------------------- the view
    def view(self, since_s: float | None = None, every_shift: bool = False) -> dict[str, Any]:
        return assemble_view(
            self.wall(),
            self.history,
            self.controller,
            self.interval_s,
            since_s,
            admin_enabled=bool(self.gw.cfg.admin_token),
            started_at_s=self.started_at_s,
            every_shift=every_shift,
            exporters=list(self.exporters.values()) if self.exporters else None,
        )

    def push(self) -> None:
        """Each client gets the view with the points it lacks; one whose socket is full is
        skipped this time (it gets them with the next)."""
        for stream in list(self.streams):
            if stream.writer.writable:
                self._send(stream)

    def _send(self, stream: _Stream) -> None:
        doc = self.view(stream.last_t, stream.every_shift)
        stream.writer.write(b"event: view\ndata: " + orjson.dumps(doc) + b"\n\n")
        if doc["series"]:
            stream.last_t = doc["series"][-1]["t"]

    # ---------------------------------------------------------------- handlers
    async def _index(self, req: Request) -> Response:
        del req
        return Response(
            self._page,
            content_type="text/html; charset=utf-8",
            headers={"cache-control": "no-cache"},
        )

    async def _file(self, req: Request) -> Response:
        name = req.path.rsplit("/", 1)[1]
        return Response(
            self._static[name], content_type=_STATIC[name], headers={"cache-control": "no-cache"}
        )

    async def _view(self, req: Request) -> Response:
        given = req.query_params().get("since")
        raw = given[0] if given else None
        try:
            since = None if raw is None else float(raw)
        except ValueError:
            why = f"since must be unix seconds, got {raw!r}"
            raise HttpError(400, why, param="since") from None
        return json_response(self.view(since, _every_shift(req)))

    async def _events(self, req: Request) -> PushResponse:
        every_shift = _every_shift(req)

        def start(writer: ChunkWriter) -> None:
            if writer.closed:  # the client left before the stream started
                return
            stream = _Stream(writer, every_shift)
            self.streams.add(stream)
            writer.on_close = lambda: self.streams.discard(stream)
            writer.write(b"retry: 2000\n\n")
            self._send(stream)

        return PushResponse(start, headers={"cache-control": "no-cache"})
