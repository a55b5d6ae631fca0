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

With several workers or replicas (docs/gateway.md, "Workers and replicas") the call lands on
one of them: a change is applied there and published to the others (control_ops.py), and a
question is put to all of them (peers.py): drained means drained everywhere, the requests of
an instance are those of every member, a move is carried out where its request is. The two
lists take `?scope=member` for the answering member's own (a controller that calls every
replica itself).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any

from flexpipe.gateway.call import Move
from flexpipe.gateway.control_ops import hold_op, refuse_op
from flexpipe.gateway.core.holds import STANDBY_HOLD_S
from flexpipe.gateway.core.pool import PoolError, TransitionError
from flexpipe.gateway.peers import merge_instances
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
        """With workers or replicas: each instance's requests in flight and slots summed
        over all of them (peers.py `merge_instances`)."""
        self._check(req)
        listed = [i.as_dict() for i in self.gw.pool.instances.values()]
        if self.gw.shared is not None and not _member_only(req):
            theirs = await self.gw.shared.ask_peers("instances", {}, 2.0)
            listed = merge_instances(listed, theirs)
        return json_response({"instances": listed})

    async def add(self, req: Request) -> Response:
        """A registration the pool already has (the same URL and model: a controller that
        registers with every replica, after another replica published it) answers the
        instance as it is."""
        body = self._body(req)
        same = self.gw.instance(body["url"])
        if same is not None and body.get("model") in (None, same.model):
            return json_response(same.as_dict())
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
        self.gw.publish(
            {
                "op": "add",
                "url": inst.url,
                "model": inst.model,
                "weight": inst.weight,
                "max_concurrency": inst.max_concurrency_configured,
                "api_key": api_key,
                "max_num_seqs": max_num_seqs,
                "state": state.value,
                "admin_token": admin_token,
            }
        )
        if inst.model is None:
            await self.gw.prober.discover(inst)
        return json_response(inst.as_dict())

    async def remove(self, req: Request) -> Response:
        body = self._body(req)
        try:
            inst = self.gw.pool.remove(body["url"])
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None
        self.gw.forget_instance(inst.url)
        self.gw.publish({"op": "remove", "url": inst.url})
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
        self.gw.publish({"op": "state", "url": inst.url, "state": State.DRAINING.value})
        drained = await self._drained_everywhere(inst.url, float(wait_s))
        return json_response({**inst.as_dict(), "drained": drained})

    async def _drained_everywhere(self, url: str, wait_s: float) -> bool:
        shared = self.gw.shared
        if shared is None:
            return await self.gw.drained(url, wait_s)
        here, there = await asyncio.gather(
            self.gw.drained(url, wait_s),
            shared.ask_peers("drained", {"url": url, "wait_s": wait_s}, wait_s + 2.0),
        )
        return here and all(there)

    async def hold(self, req: Request) -> Response:
        self._check(req)
        body = req.json()
        model, seconds = _model_and_seconds(body, None)
        self.gw.set_hold(model, seconds)
        self.gw.publish(hold_op(model, seconds))
        return json_response({"model": model, "seconds": seconds})

    async def refuse(self, req: Request) -> Response:
        self._check(req)
        body = req.json()
        model, seconds = _model_and_seconds(body, STANDBY_HOLD_S)
        reason = body.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise HttpError(400, "`reason` must be a non-empty string", param="reason")
        self.gw.set_refuse(model, reason.strip(), seconds)
        self.gw.publish(refuse_op(model, reason.strip(), seconds))
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
        wait = min(float(wait_s), 600.0)
        shared = self.gw.shared
        if shared is None:
            return json_response({"queued": await self.gw.demand(models, wait)})
        # any member's queue: the first that has a waiter answers (or all, after wait_s)
        here = asyncio.ensure_future(self.gw.demand(models, wait))
        there = asyncio.ensure_future(
            shared.ask_peers("demand", {"models": models, "wait_s": wait}, wait + 2.0, True)
        )
        try:
            await asyncio.wait({here, there}, return_when=asyncio.FIRST_COMPLETED)
            if not here.done() and not any(there.result()):
                await here  # the others had none within wait_s: this one's own answer
        finally:
            for task in (here, there):
                task.cancel()
        queued: dict[str, int] = {}
        answers = [here.result()] if here.done() and not here.cancelled() else []
        if there.done() and not there.cancelled():
            answers += there.result()
        for answer in answers:
            for model, num in (answer or {}).items():
                queued[model] = queued.get(model, 0) + int(num)
        return json_response({"queued": queued})

    async def requests(self, req: Request) -> Response:
        self._check(req)
        urls = req.query_params().get("url") or []
        if len(urls) != 1:
            raise HttpError(400, "give one instance as ?url=", param="url")
        url = urls[0].rstrip("/")
        described = [c.describe() for c in self.gw.calls_on(url)]
        if self.gw.shared is not None and not _member_only(req):
            for theirs in await self.gw.shared.ask_peers("requests", {"url": url}, 2.0):
                described += theirs or []
        return json_response({"requests": described})

    async def move(self, req: Request) -> Response:
        self._check(req)
        body = req.json()
        moves = body.get("moves") if isinstance(body, dict) else None
        if not isinstance(moves, list):
            raise HttpError(400, 'expected {"moves": [...]}', param="moves")
        parsed = [parse_move(m, i) for i, m in enumerate(moves)]
        elsewhere: dict[int, tuple[str, Any]] = {}  # call id -> (outcome, warm) of a peer's
        shared = self.gw.shared
        if shared is not None and any(self.gw.call(i) is None for i, _ in parsed):
            theirs = [m for (i, _), m in zip(parsed, moves, strict=True) if self.gw.call(i) is None]
            for answer in await shared.ask_peers("move", {"moves": theirs}, 600.0):
                for call_id, outcome, warm in answer or []:
                    elsewhere[call_id] = (outcome, warm)
        # together: each KV move first asks its engine for an export; one at a time, the
        # last request of a batch paused for every export before its own
        mine = [(i, m) for i, m in parsed if i not in elsewhere]
        outcomes = dict(
            zip(
                [i for i, _ in mine],
                await asyncio.gather(*(self.gw.move_request(i, m) for i, m in mine)),
                strict=True,
            )
        )
        outcomes.update(elsewhere)
        results = []
        for i, _ in parsed:
            o, w = outcomes[i]
            results.append(
                {"id": i, "outcome": o, "warmed": o == "recompute" and w == "warmed", "warm": w}
            )
        return json_response({"results": results})

    async def activate(self, req: Request) -> Response:
        body = self._body(req)
        try:
            inst = self.gw.pool.activate(body["url"])
            self.gw.publish({"op": "state", "url": inst.url, "state": State.ACTIVE.value})
            return json_response(inst.as_dict())
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
            self.gw.forget_instance(inst.url)
        self.gw.publish({"op": "state", "url": inst.url, "state": state.value})
        return json_response(inst.as_dict())

    async def weight(self, req: Request) -> Response:
        body = self._body(req)
        weight = body.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise HttpError(400, "`weight` must be a number", param="weight")
        try:
            inst = self.gw.pool.set_weight(body["url"], float(weight))
            self.gw.publish({"op": "weight", "url": inst.url, "weight": inst.weight})
            return json_response(inst.as_dict())
        except PoolError as exc:
            raise HttpError(400 if "weight" in str(exc) else 404, str(exc)) from None


def _member_only(req: Request) -> bool:
    """`?scope=member`: this worker's or replica's own answer (a controller that calls
    every replica itself), not the whole gateway's."""
    return "member" in (req.query_params().get("scope") or [])


def _state(value: Any) -> State:
    if not isinstance(value, str):
        raise ValueError("`state` must be a string")
    try:
        return parse_state(value)
    except LifecycleError as exc:
        raise ValueError(str(exc)) from None


def parse_move(m: Any, i: int) -> tuple[int, Move]:
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
