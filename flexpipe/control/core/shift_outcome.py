"""What carrying out one shift did (plain data): what the shift log records, from the live
executor (`control/executor.py`) and the simulator (`sim/shift_run.py`) alike."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flexpipe.policies.shift.snapshot import ShiftRecord

__all__ = ["ShiftOutcome", "finished_record", "in_place_gap_s"]


@dataclass
class ShiftOutcome:
    succeeded: bool = True
    reason: str = ""
    phases_s: dict[str, float] = field(default_factory=dict)
    migrated: dict[str, int] = field(default_factory=dict)  # method -> requests
    rehearsal: list[dict[str, Any]] = field(default_factory=list)
    started: list[str] = field(default_factory=list)  # instance keys
    stopped: list[str] = field(default_factory=list)
    slept: list[str] = field(default_factory=list)  # put to sleep instead of stopped
    woken: list[str] = field(default_factory=list)  # woken instead of cold-started
    # how each in-place step re-geared and how long the model lacked the capacity it
    # replaces ("wake, capacity away 1.234 s: why"; policies/shift/in_place.py); the shift
    # log's notes say it ("in place: ...")
    in_place: list[str] = field(default_factory=list)
    # refused before anything changed (the target was not tried: no failure of it)
    refused: bool = False

    def count(self, method: str, n: int = 1) -> None:
        """`n` more requests that left their instance by `method` (none recorded for 0)."""
        if n:
            self.migrated[method] = self.migrated.get(method, 0) + n

    def to_dict(self) -> dict[str, Any]:
        return {
            "succeeded": self.succeeded,
            "refused": self.refused,
            "reason": self.reason,
            "phases_s": {k: round(v, 3) for k, v in self.phases_s.items()},
            "migrated": dict(self.migrated),
            "rehearsal": self.rehearsal,
            "started": self.started,
            "stopped": self.stopped,
            **({"slept": self.slept} if self.slept else {}),
            **({"woken": self.woken} if self.woken else {}),
            **({"in_place": self.in_place} if self.in_place else {}),
        }


def finished_record(record: ShiftRecord, outcome: ShiftOutcome, now_s: float) -> ShiftRecord:
    """The policy's record of a shift once the executor is done with it. A failed shift
    blacklists the instances that failed (their rehearsal), not every one it added; a shift
    the executor refused before changing anything is recorded as refused, never as a failure
    of its target."""
    failed = tuple(c["instance"] for c in outcome.rehearsal if not c.get("passed"))
    keys = failed if not outcome.succeeded and failed else record.target_keys
    return dataclasses.replace(
        record,
        finished_s=now_s,
        succeeded=outcome.succeeded,
        target_keys=keys,
        refused=outcome.refused,
    )


def in_place_gap_s(notes: Sequence[str]) -> float | None:
    """The capacity in-place steps took away (s, the driver's), from the shift log's notes
    (`ShiftOutcome.in_place`: "wake, capacity away 1.234 s: ..."); None: no in-place step."""
    found = [float(m.group(1)) for n in notes if (m := _CAPACITY_AWAY.search(n))]
    return sum(found) if found else None


_CAPACITY_AWAY = re.compile(r"^in place: \w+, capacity away ([0-9.]+) s")


def said(outcome: ShiftOutcome) -> str:
    """How the controller's lines say a shift ended (a policy's or one beside it)."""
    return "done" if outcome.succeeded else "refused" if outcome.refused else "rolled back"
