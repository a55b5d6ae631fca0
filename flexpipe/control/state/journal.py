"""The shift log as the controller writes it (docs/shift-log.md): every decision of the policy,
taken or not; a shift's outcome once the executor is done (phases, moves, rehearsal); the
entries that are no decision (GPUs changed, an engine died, the first plan). Decisions and
finished shifts also count in the controller's /metrics. With no store, only the metrics."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from flexpipe.control.api.controller_metrics import ControllerMetrics
from flexpipe.control.core.shift_outcome import ShiftOutcome
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.decision import ShiftDecision
from flexpipe.store.instance_registry import InstanceRecord
from flexpipe.store.shift_entry import (
    Migrated,
    Outcome,
    Phases,
    PlanInstance,
    RehearsalCheck,
    ShiftEntry,
)
from flexpipe.store.shift_log import ShiftLog

__all__ = ["Journal", "changed_notes"]


class Journal:
    def __init__(
        self, shift_log: ShiftLog | None, metrics: ControllerMetrics, rehearsal_tolerance: float
    ) -> None:
        self.shift_log = shift_log
        self.metrics = metrics
        self.rehearsal_tolerance = rehearsal_tolerance

    def decision(
        self, decision: ShiftDecision, running: Sequence[PlannedInstance]
    ) -> ShiftEntry | None:
        """A decision against the running plan; a shift's entry stays pending until `finish`.
        None with no store."""
        entry = ShiftEntry.from_decision(decision, _utc_now(), running)
        if entry.kind == "hold" or entry.outcome == "pending":
            self.metrics.observe_decision(entry)
        if self.shift_log is None:
            return None
        return self.shift_log.append(entry)

    def aside(
        self,
        trigger: str,
        reason: str,
        running: Sequence[PlannedInstance],
        target: Sequence[PlannedInstance],
    ) -> ShiftEntry | None:
        """A change carried out beside the policy's shifts (a standby's start or sleep, a
        wake or sleep aside): a shift entry no decision took, pending until `finish`."""
        if self.shift_log is None:
            return None
        entry = ShiftEntry(
            at=_utc_now(),
            kind="shift",
            trigger=trigger,
            reason=reason,
            current=tuple(PlanInstance.from_planned(p) for p in running),
            target=tuple(PlanInstance.from_planned(p) for p in target),
        )
        return self.shift_log.append(entry)

    def finish(self, entry: ShiftEntry | None, outcome: ShiftOutcome) -> None:
        """A shift's entry completed with what carrying it out did."""
        if entry is None or entry.id is None or self.shift_log is None:
            return
        tol = self.rehearsal_tolerance
        result: Outcome = "succeeded" if outcome.succeeded else "rolled_back"
        done = self.shift_log.update_outcome(
            entry.id,
            outcome="refused" if outcome.refused else result,
            error=outcome.reason or None,
            phases=Phases.from_seconds(outcome.phases_s),
            migrated=Migrated.from_counts(outcome.migrated),
            rehearsal=tuple(RehearsalCheck.from_probe(c, tol) for c in outcome.rehearsal),
            notes=changed_notes(outcome.started, outcome.stopped)
            + tuple(f"in place: {line}" for line in outcome.in_place),
        )
        self.metrics.observe_finished(done)

    def note(
        self,
        kind: Any,
        reason: str,
        running: Sequence[PlannedInstance],
        notes: Sequence[str] = (),
        outcome: Any = "noted",
        trigger: str = "none",
    ) -> None:
        """An entry that is not a policy decision (resources, emergency, plan); `trigger`:
        what caused it (`lost`: an engine exited; `start`: the controller started)."""
        entry = ShiftEntry(
            at=_utc_now(),
            kind=kind,
            trigger=trigger,
            reason=reason,
            current=tuple(PlanInstance.from_planned(p) for p in running),
            notes=tuple(notes),
            outcome=outcome,
            finished_at=_utc_now() if outcome != "noted" else None,
        )
        if self.shift_log is not None:
            self.shift_log.append(entry)


def changed_notes(started: Sequence[str], stopped: Sequence[str]) -> tuple[str, ...]:
    """The notes of a change: each instance it started and stopped (by instance key)."""
    return tuple(f"started {k}" for k in started) + tuple(f"stopped {k}" for k in stopped)


def _utc_now() -> datetime:
    return datetime.now(UTC)


def first_plan_note(
    adopted: Sequence[str], retired: Sequence[InstanceRecord], outcome: ShiftOutcome
) -> tuple[str, list[str]]:
    """The shift log's reason and notes for the first plan: what a previous controller left
    running that was adopted (instance keys) or retired, what was started and stopped."""
    why = "the first plan"
    if adopted or retired:
        why += f" after a restart: adopted {len(adopted)} running instance(s)"
        if retired:
            why += f", retired {len(retired)} the plan lacks"
    notes = [f"adopted {k}" for k in adopted]
    notes += [f"retired {r.model}|{r.gear}|{','.join(r.gpu_ids)}" for r in retired]
    notes += changed_notes(outcome.started, outcome.stopped)
    return why, notes + ([outcome.reason] if outcome.reason else [])
