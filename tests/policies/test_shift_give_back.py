"""A resource-driven shift that gives GPUs back keeps the capacity a down-shift keeps
(docs/simulator.md, "Giving GPUs back"): priced goodput counts a plan loaded to its
planned capacity as losing nothing, the SLO's tail does not."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_shift_policy import (
    CLUSTER,
    FREED,
    decide,
    demand,
    policy,
    running_for,
    snap,
    steady,
)

from flexpipe.policies.shift import PricingParams


def _freed_at(rate: float):  # type: ignore[no-untyped-def]
    """gpu1 freed under the plan for 8 req/s, the load now `rate`."""
    running = running_for(CLUSTER, demand(8.0))
    s = snap(running, [steady(50)], cluster=FREED, resources_changed_s=0.0)
    return replace(s, models=(replace(s.models[0], demand=demand(rate)),))


def test_a_give_back_below_the_down_headroom_is_refused() -> None:
    """At 4 req/s the plan for the GPUs free now is the TP2 pair alone (4.35 req/s): the same
    priced goodput on two GPUs fewer, but under the 1.25 x 4 = 5 req/s a down-shift keeps."""
    d = decide(policy(), _freed_at(4.0), 60)
    assert d.action == "hold" and d.trigger == "resource"
    replan = next(a for a in d.alternatives if a.name == "replan")
    assert replan.reason == (
        "score 74.0 = gain 176.3 - gap 93.6 - migration 0.0 - risk 8.8: goodput +0.000/s is "
        "below the margin 0.080/s and capacity +-22.8% below 2%; llama-7b below the "
        "down-shift's headroom (the planner's plan for the GPUs free now)"
    )
    assert [i.gpu_ids for i in replan.instances] == [("gpu1", "gpu2")]
    # Without the headroom the same plan gives the two GPUs back.
    lax = policy(pricing=PricingParams(down_headroom=0.0))
    d = decide(lax, _freed_at(4.0), 60)
    assert d.action == "shift" and d.target is not None
    assert [i.gpu_ids for i in d.target] == [("gpu1", "gpu2")]


def test_a_give_back_with_the_headroom_goes_through() -> None:
    """At 3 req/s two single A100s (1.98 req/s each, 3.96 >= 1.25 x 3) replace the three
    instances: two GPUs go back."""
    d = decide(policy(), _freed_at(3.0), 60)
    assert d.action == "shift" and d.trigger == "resource", d.reason
    assert d.target is not None
    assert sorted(i.gpu_ids for i in d.target) == [("gpu1",), ("gpu2",)]
