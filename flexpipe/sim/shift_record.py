"""A finished shift as the simulator's report keeps it: one record for the policy's shifts
(sim/controller.py) and the changes beside them (sim/standby_run.py) alike."""

from __future__ import annotations

from typing import Any

from flexpipe.control.core.standby_aside import ASIDE_REASONS
from flexpipe.sim.shift_run import ShiftOutcome

__all__ = ["REASONS", "record"]

REASONS = {"plan": "the first plan", **ASIDE_REASONS}


def record(
    at_s: float,
    end_s: float,
    trigger: str,
    reason: str,
    score: float | None,
    outcome: ShiftOutcome,
) -> dict[str, Any]:
    """A finished shift as the report keeps it."""
    return {
        "at_s": at_s,
        "finished_s": end_s,
        "trigger": trigger,
        "reason": reason,
        "score": None if score is None else round(score, 3),
        "succeeded": outcome.succeeded,
        "refused": outcome.refused,
        "outcome": _outcome(outcome),
        "why_failed": outcome.reason,
        "phases_s": {k: round(v, 6) for k, v in outcome.phases_s.items()},
        "migrated": dict(sorted(outcome.migrated.items())),
        "rehearsal": outcome.rehearsal,
        "started": outcome.started,
        "stopped": outcome.stopped,
    }


def _outcome(out: ShiftOutcome) -> str:
    """The shift log's outcome of a finished shift (`Journal.finish`'s words)."""
    return "succeeded" if out.succeeded else "refused" if out.refused else "rolled_back"
