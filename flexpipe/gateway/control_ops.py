"""The admin API's changes as data (`ControlOp`), so that a change made through one gateway
worker or replica reaches every other (shared_state.py): the member the controller called
applies it through the admin API and publishes it; every other member, and one that starts
later replaying the log, applies it here, through the same pool and hold calls.

An op that no longer fits (an instance another change removed, a transition already made)
is skipped: the log's order is the order the members agreed on, and the member that took the
call answered the controller."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from flexpipe.gateway.core.pool import Instance, PoolError
from flexpipe.gateway.shared_state import ControlOp, seconds_left
from flexpipe.lifecycle import LifecycleError, State, parse_state

if TYPE_CHECKING:
    from flexpipe.gateway.app import Gateway

__all__ = ["apply_op", "hold_op", "refuse_op"]

log = logging.getLogger("flexpipe.gateway")


def hold_op(model: str, seconds: float) -> ControlOp:
    return {"op": "hold", "model": model, "seconds": seconds, "at_wall_s": time.time()}


def refuse_op(model: str, reason: str, seconds: float) -> ControlOp:
    return {
        "op": "refuse",
        "model": model,
        "reason": reason,
        "seconds": seconds,
        "at_wall_s": time.time(),
    }


async def _discover(gw: Gateway, inst: Instance) -> None:
    await gw.prober.discover(inst)


def apply_op(gw: Gateway, op: ControlOp) -> None:
    """Apply another member's change here (never published again)."""
    try:
        _apply(gw, op)
    except (PoolError, LifecycleError, KeyError, TypeError, ValueError) as exc:
        log.debug("control op %s skipped: %s", op.get("op"), exc)


def _apply(gw: Gateway, op: ControlOp) -> None:
    kind = op["op"]
    if kind == "hold":
        gw.set_hold(op["model"], seconds_left(op))
    elif kind == "refuse":
        gw.set_refuse(op["model"], op["reason"], seconds_left(op))
    elif kind == "add":
        inst = gw.pool.add(
            op["url"],
            op.get("model"),
            float(op.get("weight", 1.0)),
            int(op.get("max_concurrency", 0)),
            op.get("api_key"),
            int(op.get("max_num_seqs", 0)),
            parse_state(op.get("state", "active")),
        )
        if op.get("admin_token"):
            gw.engine_admin_tokens[inst.url] = op["admin_token"]
        if inst.model is None:
            gw.keep_task(gw.loop().create_task(_discover(gw, inst)))
    elif kind == "remove":
        gw.forget_instance(gw.pool.remove(op["url"]).url)
    elif kind == "state":
        state = parse_state(op["state"])
        inst = gw.pool.set_state(op["url"], state)
        if state is State.GONE:
            gw.forget_instance(inst.url)
    elif kind == "weight":
        gw.pool.set_weight(op["url"], float(op["weight"]))
    else:
        raise ValueError(f"unknown control op {kind!r}")
