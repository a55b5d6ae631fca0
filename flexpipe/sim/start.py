"""How a run's deployment starts (the scenario's `start:` section; docs/simulator.md, "The
start").

By default every policy's first plan is decided at t = 0 and cold-starts then, while the
traffic already arrives (a deployment switched on under load). A platform team deploys before
it switches traffic over: with `warm: true` every instance launched at t = 0 — the first plan
of every policy compared, flexpipe's and the baselines' alike — is loaded by then and takes
requests from the first one. Its load before t = 0 is billed to no policy.

`expected_window_s: W` sizes the controller's first plan (flexpipe, round_robin) for at least
each model's rate over the first W seconds of traffic: the traffic an operator sees at the
cut-over (the old deployment's), which the whole run's mean (what the planner is given
otherwise) may lie far below on a diurnal curve. The baselines plan for the rate that defines
them (static: the mean, peak: the busiest interval) and never re-plan, so it is theirs to keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from flexpipe.policies.planner import ModelDemand
from flexpipe.sim import fields
from flexpipe.sim.request import SimRequest

__all__ = ["StartParams", "parse_start", "start_demands"]


@dataclass(frozen=True, slots=True)
class StartParams:
    warm: bool = False  # instances launched at t = 0 are ready at t = 0 (every policy)
    expected_window_s: float = 0.0  # the first plan's rate: at least this window's (0: off)


_KEYS = ("warm", "expected_window_s")


def parse_start(value: Any, where: str) -> StartParams:
    """The scenario's `start:` mapping (absent: the defaults, a cold start)."""
    doc = fields.mapping(value if value is not None else {}, where)
    fields.check_keys(doc, _KEYS, where)
    warm = doc.get("warm", False)
    if not isinstance(warm, bool):
        raise fields.FieldError(f"{where}.warm: expected true or false, got {fields.shown(warm)}")
    window_s = fields.number(
        doc.get("expected_window_s", 0.0), f"{where}.expected_window_s", min_value=0
    )
    return StartParams(warm, window_s)


def start_demands(
    demands: Sequence[ModelDemand], requests: Sequence[SimRequest], window_s: float
) -> tuple[ModelDemand, ...]:
    """`demands` with each rate raised to its model's arrivals over [0, `window_s`) per second
    where those are higher (`window_s` 0: `demands` as they are)."""
    if window_s <= 0:
        return tuple(demands)
    counts: dict[str, int] = {}
    for r in requests:
        if r.arrival_s >= window_s:
            break  # (in time order)
        counts[r.model] = counts.get(r.model, 0) + 1
    return tuple(
        replace(d, request_rate_per_s=max(d.request_rate_per_s, counts.get(d.name, 0) / window_s))
        for d in demands
    )
