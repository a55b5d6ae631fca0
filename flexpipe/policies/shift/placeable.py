"""Placeable (pure): can a model with no instance be placed at all on the GPUs free to us?

A model scaled to zero (or whose instances were lost) is held in the gateway so that its
requests queue for the cold start its demand triggers. When no GPU free to flexpipe can place
even one instance of it, that cold start never comes, and its requests are better refused at
once with the reason (`Holds.refuse`) than held for the queue's whole wait.

The planner is the one source of truth: the model's demand is planned *alone* (at least one
instance, at the rate a wake plans it for: `ShiftParams.wake_request_rate_per_s`; at no load
the planner never tries its LP round, the only one that chains pipeline stages across
nodes) on `cluster`, the GPUs free to us — free now plus every GPU our own instances hold;
other tenants' memory is used, lost GPUs are absent, and the planner itself leaves out GPUs
reclaimed within its `min_lease_s`. Deliberately not considered: blacklists, priorities,
other models' demand and the room our own instances take. Those may delay a wake (it holds
and waits), never make the model impossible to place.

Pure: no clock (`now_s` is an argument), no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from flexpipe.cluster import Cluster
from flexpipe.policies.planner import ModelDemand
from flexpipe.policies.shift.candidates import Planner

__all__ = ["Placement", "placement", "unplaceable"]


@dataclass(frozen=True, slots=True)
class Placement:
    model: str
    placeable: bool
    reason: str  # where one instance fits, or the planner's words on why none does


def placement(
    cluster: Cluster, demand: ModelDemand, now_s: float, planner: Planner, wake_rate_per_s: float
) -> Placement:
    """Whether the planner places one instance of `demand` alone on `cluster` (the GPUs free
    to us, ours counted as free) at `now_s`, planned as a wake plans it: at least
    `wake_rate_per_s` (`ShiftParams.wake_request_rate_per_s`)."""
    rate_per_s = max(demand.request_rate_per_s, wake_rate_per_s)
    alone = replace(demand, request_rate_per_s=rate_per_s, min_instances=1, priority=1.0)
    planned = planner(cluster, (alone,), now_s)
    mine = [i for i in planned.instances if i.model == demand.name]
    if mine:
        first = mine[0]
        where = "+".join(first.gpu_ids)
        return Placement(demand.name, True, f"one instance fits on {where} ({first.gear.key()})")
    if not cluster.gpus:
        return Placement(demand.name, False, "no GPU is free to us")
    said = [n for n in planned.notes if demand.name in n]
    left_out = [
        f"{u.gpu_id} {u.reason}" for u in planned.unused if not u.reason.startswith("not needed")
    ]
    words = "; ".join(said) or f"the planner placed no instance of {demand.name}"
    if left_out:
        words += f" (left out: {'; '.join(left_out)})"
    return Placement(
        demand.name, False, f"no GPU free to us can place {demand.name} ({demand.model}): {words}"
    )


def unplaceable(
    cluster: Cluster,
    demands: Sequence[ModelDemand],
    standby: Collection[str],
    now_s: float,
    planner: Planner,
    wake_rate_per_s: float,
    next_change_in_s: float | None,
    hold_s: float,
) -> dict[str, str]:
    """Of the models with no instance (`standby`), those `placement` finds no room for,
    with the planner's reason: the live and the simulated controller refuse them rather
    than hold them. None while a change of the GPUs (an occupation's end) is due within
    `hold_s` (`next_change_in_s` from now): their requests wait for it instead."""
    if not standby or (next_change_in_s is not None and next_change_in_s <= hold_s):
        return {}
    out: dict[str, str] = {}
    for d in demands:
        if d.name in standby:
            p = placement(cluster, d, now_s, planner, wake_rate_per_s)
            if not p.placeable:
                out[d.name] = p.reason
    return out
