"""The shift policy (pure): when to shift gears and to which plan (seed 000 §3).

`ShiftPolicy(params, planner, capacity).decide(snapshot, now_s, rng) -> ShiftDecision`; the
controller and the simulator both call it. See docs/shift-policy.md.
"""

from flexpipe.policies.shift.candidates import Candidate, Planner, default_planner
from flexpipe.policies.shift.decision import Action, ScoredCandidate, ShiftDecision, Trigger
from flexpipe.policies.shift.migration import (
    MigrationChoice,
    choose_migration,
    link_between,
    perf_model_of,
)
from flexpipe.policies.shift.params import ShiftParams
from flexpipe.policies.shift.policy import ShiftPolicy
from flexpipe.policies.shift.pricing import (
    Capacity,
    Price,
    PricingParams,
    goodput_per_s,
    planned_capacity,
    price,
)
from flexpipe.policies.shift.signals import Pressure, Sample, Thresholds, Zone
from flexpipe.policies.shift.snapshot import ModelState, ShiftRecord, ShiftSnapshot, instance_key
from flexpipe.policies.shift.triggers import ModelSignal, TriggerParams

__all__ = [
    "Action",
    "Candidate",
    "Capacity",
    "MigrationChoice",
    "ModelSignal",
    "ModelState",
    "Planner",
    "Pressure",
    "Price",
    "PricingParams",
    "Sample",
    "ScoredCandidate",
    "ShiftDecision",
    "ShiftParams",
    "ShiftPolicy",
    "ShiftRecord",
    "ShiftSnapshot",
    "Thresholds",
    "Trigger",
    "TriggerParams",
    "Zone",
    "choose_migration",
    "default_planner",
    "goodput_per_s",
    "instance_key",
    "link_between",
    "perf_model_of",
    "planned_capacity",
    "price",
]
