"""What a decision says: the action, the trigger, the signals, the chosen plan and price,
and every alternative with its score or why it was refused (the shift log's record)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.pricing import Price
from flexpipe.policies.shift.snapshot import ShiftRecord, instance_key
from flexpipe.policies.shift.triggers import ModelSignal

__all__ = ["Action", "ScoredCandidate", "ShiftDecision", "Trigger"]

Action = Literal["hold", "shift"]
# floor: a model below its min_instances (its last engine died): restored at once
Trigger = Literal["none", "reclaim", "floor", "wake", "up", "down", "resource"]


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    name: str
    accepted: bool
    reason: str  # why accepted or refused, in words
    price: Price | None  # None: refused before pricing
    instances: tuple[PlannedInstance, ...]

    @property
    def score(self) -> float | None:
        return None if self.price is None else self.price.score

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "accepted": self.accepted,
            "reason": self.reason,
            "score": None if self.score is None else round(self.score, 3),
            "instances": [instance_key(i) for i in self.instances],
        }


@dataclass(frozen=True)
class ShiftDecision:
    at_s: float
    action: Action
    trigger: Trigger
    reason: str
    signals: tuple[ModelSignal, ...]
    target: tuple[PlannedInstance, ...] | None = None  # the plan to shift to
    price: Price | None = None
    alternatives: tuple[ScoredCandidate, ...] = ()  # what it beat, or why nothing was taken

    @property
    def score(self) -> float | None:
        return None if self.price is None else self.price.score

    def started(self, started_s: float) -> ShiftRecord:
        """The history record of carrying out this decision (the controller completes it with
        `finished_s` and `succeeded` via dataclasses.replace)."""
        if self.action != "shift" or self.price is None:
            raise ValueError("only a shift decision starts a shift")
        return ShiftRecord(started_s, target_keys=self.price.added)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready, for the shift log."""
        return {
            "at_s": self.at_s,
            "action": self.action,
            "trigger": self.trigger,
            "reason": self.reason,
            "signals": [s.to_dict() for s in self.signals],
            "target": None if self.target is None else [instance_key(i) for i in self.target],
            "price": None if self.price is None else self.price.to_dict(),
            "alternatives": [a.to_dict() for a in self.alternatives],
        }
