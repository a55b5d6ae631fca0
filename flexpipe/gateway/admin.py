"""The gateway's admin API (bearer token): the pool as the controller drives it.

GET  /admin/instances                 list with lifecycle state, health and load
POST /admin/instances                 {"url", "model"?, "weight"?, "max_concurrency"?,
                                       "max_num_seqs"?, "api_key"?,
                                       "admin_token"? (the engine's, for KV moves),
                                       "state"?: starting|rehearsing|active (default)}
POST /admin/instances/state           {"url", "state"}: along the lifecycle (flexpipe/
                                      lifecycle.py); an illegal move is a 409; gone removes
POST /admin/instances/remove|activate {"url"}
POST /admin/instances/drain           {"url", "wait_s"?}: with wait_s, answers once the
                                      instance serves nothing or wait_s passed ("drained")
POST /admin/instances/weight          {"url", "weight"}
GET  /admin/instances/requests?url=U  the requests U serves now (what a move is priced on)
POST /admin/requests/move             {"moves": [{"id", "method": "kv"|"recompute",
                                       "target"?, "bandwidth_bytes_per_s"?, "latency_s"?,
                                       "warm_timeout_s"? (recompute: the warm-up's bound)}]}
                                      answers {"results": [{"id", "outcome", "warmed",
                                       "warm": the warm-up's outcome (warmed | skipped |
                                       timed_out | failed; null: none tried)}]}
POST /admin/models/hold               {"model", "seconds"}: for that long, requests of the
                                      model wait in the queue for capacity (a shift that
                                      re-launches it, or one scaled to zero: the model
                                      stays known with no instance) instead of being
                                      refused; 0 ends it (and any hold lifts a refusal)
POST /admin/models/refuse             {"model", "reason", "seconds"?}: no GPU free to us
                                      can place the model: for that long (default 600;
                                      renewed by the controller every tick), while it has
                                      no instance, its requests (and those queued for it)
                                      get a 503 with the reason and a Retry-After; it
                                      stays listed; ends its hold
POST /admin/models/demand             {"models", "wait_s"}: answers {"queued": {model: n}}
                                      once a request of one of them waits in the queue, or
                                      wait_s passed (the controller's demand trigger)
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any

from flexpipe.gateway.call import Move
from flexpipe.gateway.core.holds import STANDBY_HOLD_S
from flexpipe.gateway.core.pool import PoolError, TransitionError
from flexpipe.http.server import App, HttpError, Request, Response, json_response
from flexpipe.lifecycle import LifecycleError, State, parse_state

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
        app.add_route("POST", "/admin/instances/state", self.state)
        app.add_route("POST", "/admin/instances/activate", self.activate)
        app.add_route("POST", "/admin/instances/weight", self.weight)
        app.add_route("GET", "/admin/instances/requests", self.requests)
        app.add_route("POST", "/admin/requests/move", self.move)
        app.add_route("POST", "/admin/models/hold", self.hold)
        app.add_route("POST", "/admin/models/refuse", self.refuse)
        app.add_route("POST", "/admin/models/demand", self.demand)

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
            admin_token = body.get("admin_token")
            if admin_token is not None and not isinstance(admin_token, str):
                raise TypeError("`admin_token` must be a string")
            max_num_seqs = body.get("max_num_seqs", 0)
            if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int):
                raise TypeError("`max_num_seqs` must be an integer")
            if max_num_seqs < 0:
                raise ValueError("`max_num_seqs` must be >= 0")
            state = _state(body.get("state", "active"))
            inst = self.gw.pool.add(
                body["url"],
                body.get("model"),
                float(body.get("weight", 1.0)),
                int(body.get("max_concurrency", 0)),
                api_key,
                max_num_seqs,
                state,
            )
        except (PoolError, TypeError, ValueError) as exc:
            raise HttpError(400, str(exc)) from None
        if admin_token:
            self.gw.engine_admin_tokens[inst.url] = admin_token
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
        self.gw.engine_admin_tokens.pop(inst.url, None)
        return json_response(inst.as_dict())

    async def drain(self, req: Request) -> Response:
        body = self._body(req)
        wait_s = body.get("wait_s", 0)
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or wait_s < 0:
            raise HttpError(400, "`wait_s` must be a number of seconds >= 0", param="wait_s")
        try:
            inst = self.gw.pool.drain(body["url"])
        except TransitionError as exc:
            raise HttpError(409, str(exc)) from None
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None
        drained = await self.gw.drained(inst.url, float(wait_s))
        return json_response({**inst.as_dict(), "drained": drained})

    async def hold(self, req: Request) -> Response:
        self._check(req)
        body = req.json()
        model, seconds = _model_and_seconds(body, None)
        self.gw.set_hold(model, seconds)
        return json_response({"model": model, "seconds": seconds})

    async def refuse(self, req: Request) -> Response:
        self._check(req)
        body = req.json()
        model, seconds = _model_and_seconds(body, STANDBY_HOLD_S)
        reason = body.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise HttpError(400, "`reason` must be a non-empty string", param="reason")
        self.gw.set_refuse(model, reason.strip(), seconds)
        return json_response({"model": model, "reason": reason.strip(), "seconds": seconds})

    async def demand(self, req: Request) -> Response:
        self._check(req)
        body = req.json()
        models = body.get("models") if isinstance(body, dict) else None
        wait_s = body.get("wait_s", 0) if isinstance(body, dict) else None
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise HttpError(400, "`models` must be a list of model names", param="models")
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or wait_s < 0:
            raise HttpError(400, "`wait_s` must be a number of seconds >= 0", param="wait_s")
        queued = await self.gw.demand(models, min(float(wait_s), 600.0))
        return json_response({"queued": queued})

    async def requests(self, req: Request) -> Response:
        self._check(req)
        urls = req.query_params().get("url") or []
        if len(urls) != 1:
            raise HttpError(400, "give one instance as ?url=", param="url")
        calls = self.gw.calls_on(urls[0].rstrip("/"))
        return json_response({"requests": [c.describe() for c in calls]})

    async def move(self, req: Request) -> Response:
        self._check(req)
        body = req.json()
        moves = body.get("moves") if isinstance(body, dict) else None
        if not isinstance(moves, list):
            raise HttpError(400, 'expected {"moves": [...]}', param="moves")
        parsed = [_parse_move(m, i) for i, m in enumerate(moves)]
        # together: each KV move first asks its engine for an export; one at a time, the
        # last request of a batch paused for every export before its own
        outcomes = await asyncio.gather(*(self.gw.move_request(i, m) for i, m in parsed))
        results = [
            {"id": i, "outcome": o, "warmed": o == "recompute" and w == "warmed", "warm": w}
            for (i, _), (o, w) in zip(parsed, outcomes, strict=True)
        ]
        return json_response({"results": results})

    async def activate(self, req: Request) -> Response:
        body = self._body(req)
        try:
            return json_response(self.gw.pool.activate(body["url"]).as_dict())
        except TransitionError as exc:
            raise HttpError(409, str(exc)) from None
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None

    async def state(self, req: Request) -> Response:
        """The controller moves an instance along its lifecycle as it brings it up or
        retires it; `gone` takes it out of the pool (as remove does)."""
        body = self._body(req)
        try:
            state = _state(body.get("state"))
        except ValueError as exc:
            raise HttpError(400, str(exc), param="state") from None
        try:
            inst = self.gw.pool.set_state(body["url"], state)
        except TransitionError as exc:
            raise HttpError(409, str(exc)) from None
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None
        if state is State.GONE:
            self.gw.router.remove_instance(inst.url)
            self.gw.engine_admin_tokens.pop(inst.url, None)
        return json_response(inst.as_dict())

    async def weight(self, req: Request) -> Response:
        body = self._body(req)
        weight = body.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise HttpError(400, "`weight` must be a number", param="weight")
        try:
            return json_response(self.gw.pool.set_weight(body["url"], float(weight)).as_dict())
        except PoolError as exc:
            raise HttpError(400 if "weight" in str(exc) else 404, str(exc)) from None


def _state(value: Any) -> State:
    if not isinstance(value, str):
        raise ValueError("`state` must be a string")
    try:
        return parse_state(value)
    except LifecycleError as exc:
        raise ValueError(str(exc)) from None


def _parse_move(m: Any, i: int) -> tuple[int, Move]:
    where = f"moves.{i}"
    if not isinstance(m, dict):
        raise HttpError(400, f"{where}: must be an object", param=where)
    call_id, method, target = m.get("id"), m.get("method", "recompute"), m.get("target")
    if isinstance(call_id, bool) or not isinstance(call_id, int):
        raise HttpError(400, f"{where}.id: must be an integer", param=f"{where}.id")
    if method not in ("kv", "recompute"):
        raise HttpError(400, f"{where}.method: kv or recompute", param=f"{where}.method")
    if target is not None and not isinstance(target, str):
        raise HttpError(400, f"{where}.target: must be a URL", param=f"{where}.target")
    numbers = {}
    for name in ("bandwidth_bytes_per_s", "latency_s", "warm_timeout_s", "max_token_wait_s"):
        v = m.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0):
            raise HttpError(400, f"{where}.{name}: must be a number >= 0", param=f"{where}.{name}")
        numbers[name] = None if v is None else float(v)
    return call_id, Move(
        method,
        target.rstrip("/") if target else None,
        numbers["bandwidth_bytes_per_s"],
        numbers["latency_s"] or 0.0,
        numbers["warm_timeout_s"],
        numbers["max_token_wait_s"],
    )


def _model_and_seconds(body: Any, default_s: float | None) -> tuple[str, float]:
    """A hold's or a refusal's `model` and `seconds` (`default_s` when absent; None: it must
    be given), or a 400 naming the field."""
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise HttpError(400, "`model` must be a non-empty string", param="model")
    seconds = body.get("seconds", default_s)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise HttpError(400, "`seconds` must be a number >= 0", param="seconds")
    return model, float(seconds)
