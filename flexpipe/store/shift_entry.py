"""One entry of the shift log: a decision (taken or not) and, later, what became of it.

Plain frozen data with an exact JSON round trip (`to_dict` / `from_dict`). The decision's
parts are filled from the shift policy's own `to_dict` (`ShiftEntry.from_decision`), so the
log never re-derives a signal, a score or a reason; what happens after (rehearsal, phases,
requests migrated, measured performance) comes from the controller through
`ShiftLog.update_outcome`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

if TYPE_CHECKING:
    from flexpipe.policies.planner import PlannedInstance
    from flexpipe.policies.shift import ShiftDecision

__all__ = [
    "FINAL_OUTCOMES",
    "FIXED_OUTCOMES",
    "KINDS",
    "METHODS",
    "OUTCOMES",
    "PHASES",
    "After",
    "Alternative",
    "Kind",
    "Migrated",
    "Outcome",
    "Phases",
    "PlanInstance",
    "PriceTerms",
    "RehearsalCheck",
    "ShiftEntry",
    "SignalValues",
]

# plan: a plan put in place from nothing (`flexpipe up`); shift: a planned change of gears;
# hold: a decision not to change; reclaim: GPUs vacated before a tenant's lease ends;
# emergency: GPUs or an engine lost without notice; rollback: a target undone after its
# rehearsal missed; resources: not a decision, the GPUs free to us changed (a tenant came or
# left, a GPU was lost): the context of the decisions that follow.
Kind = Literal["plan", "shift", "hold", "reclaim", "emergency", "rollback", "resources"]
KINDS: tuple[Kind, ...] = get_args(Kind)
# pending: being carried out; aborted: cut short (e.g. the controller restarted mid-shift);
# refused: the executor refused the target before changing anything (not a failure of the
# target: it never counts towards its blacklist); held: the outcome of a hold, noted: of a
# resources entry (both fixed by the kind).
Outcome = Literal[
    "pending", "succeeded", "failed", "rolled_back", "refused", "aborted", "held", "noted"
]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
FIXED_OUTCOMES: Mapping[str, Outcome] = {"hold": "held", "resources": "noted"}  # kind -> outcome
FINAL_OUTCOMES: frozenset[Outcome] = frozenset(OUTCOMES) - {"pending"}
# gateway move results (POST /admin/requests/move) -> migration methods
_METHOD_ALIASES = {"kv": "kv_moved", "recompute": "recomputed"}
# sleep: leaving engines put to sleep instead of stopped; wake: sleeping ones woken instead
# of a cold start (docs/controller.md, "Sleep instead of stop")
PHASES = ("warm", "rehearse", "switch", "drain", "migrate", "release", "sleep", "wake")
METHODS = ("kv_moved", "recomputed", "finished_in_place", "rerun")


def _utc(at: datetime) -> datetime:
    if at.tzinfo is None:
        raise ValueError(f"time {at.isoformat()} has no zone; the shift log keeps UTC")
    return at.astimezone(UTC)


def _time(value: str | None) -> datetime | None:
    return None if value is None else _utc(datetime.fromisoformat(value))


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class PlanInstance:
    """An instance of a plan: model, gear key and GPU ids per pipeline stage."""

    model: str
    gear: str  # Gear.key(): tp2-pp1-bf16-kvauto-s48
    stages: tuple[tuple[str, ...], ...]

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(g for s in self.stages for g in s)

    @property
    def key(self) -> str:
        """The shift policy's instance_key: `llama-7b|tp2-pp1-bf16-kvauto-s48|gpu1,gpu2`."""
        return f"{self.model}|{self.gear}|{'/'.join(','.join(s) for s in self.stages)}"

    @classmethod
    def from_key(cls, key: str) -> PlanInstance:
        parts = key.split("|")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"bad instance key {key!r}: expected MODEL|GEAR|GPU,GPU/GPU")
        stages = tuple(tuple(s.split(",")) for s in parts[2].split("/"))
        return cls(parts[0], parts[1], stages)

    @classmethod
    def from_planned(cls, instance: PlannedInstance) -> PlanInstance:
        return cls(instance.model, instance.gear.key(), instance.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "gear": self.gear, "stages": [list(s) for s in self.stages]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanInstance:
        return cls(d["model"], d["gear"], tuple(tuple(s) for s in d["stages"]))


@dataclass(frozen=True, slots=True)
class SignalValues:
    """A model's signals when the decision was taken (the policy's ModelSignal.to_dict)."""

    model: str
    queue: float | None  # queue depth / capacity; None: no sample in the window
    latency: float | None  # max(TTFT p99 / SLO, TPOT p99 / SLO)
    utilization: float | None
    zone: str  # up | down | hold
    run: int  # consecutive samples in `zone`
    fired: str  # the zone that fired, or hold
    num_samples: int

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SignalValues:
        return cls(
            model=d["model"],
            queue=_opt_float(d["queue"]),
            latency=_opt_float(d["latency"]),
            utilization=_opt_float(d["utilization"]),
            zone=d["zone"],
            run=int(d["run"]),
            fired=d["fired"],
            num_samples=int(d["num_samples"]),
        )


@dataclass(frozen=True, slots=True)
class PriceTerms:
    """The terms of a shift's score (policies/shift/pricing.py), in priority-weighted
    SLO-meeting requests over the horizon."""

    gain: float
    gap_cost: float
    migration_cost: float
    risk: float
    horizon_s: float
    goodput_running_per_s: float
    goodput_target_per_s: float
    num_gpus_running: int
    num_gpus_target: int
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PriceTerms:
        return cls(
            gain=float(d["gain"]),
            gap_cost=float(d["gap_cost"]),
            migration_cost=float(d["migration_cost"]),
            risk=float(d["risk"]),
            horizon_s=float(d["horizon_s"]),
            goodput_running_per_s=float(d["goodput_running_per_s"]),
            goodput_target_per_s=float(d["goodput_target_per_s"]),
            num_gpus_running=int(d["num_gpus_running"]),
            num_gpus_target=int(d["num_gpus_target"]),
            notes=tuple(d.get("notes", ())),
        )


@dataclass(frozen=True, slots=True)
class Alternative:
    """A candidate plan the decision weighed: taken, beaten (with its score) or refused."""

    name: str
    accepted: bool
    reason: str
    score: float | None  # None: refused before pricing
    instances: tuple[str, ...]  # instance keys

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "accepted": self.accepted,
            "reason": self.reason,
            "score": self.score,
            "instances": list(self.instances),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Alternative:
        return cls(
            d["name"],
            bool(d["accepted"]),
            d["reason"],
            _opt_float(d["score"]),
            tuple(d["instances"]),
        )


@dataclass(frozen=True, slots=True)
class RehearsalCheck:
    """One comparison of a warmed target against the gear table's prediction."""

    instance: str  # instance key
    metric: str  # e.g. probe_s, tpot_p50_s
    predicted: float | None  # None: the probe failed before a measurement
    measured: float | None
    tolerance: float  # what the controller allowed, in its terms (e.g. x2.0 on the ratio)
    passed: bool  # the controller's verdict
    why: str = ""  # why it missed, in words

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when either is missing or nothing was predicted)."""
        if self.predicted is None or self.measured is None or self.predicted == 0:
            return None
        return self.measured / self.predicted

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RehearsalCheck:
        return cls(
            d["instance"],
            d["metric"],
            _opt_float(d["predicted"]),
            _opt_float(d["measured"]),
            float(d["tolerance"]),
            bool(d["passed"]),
            d.get("why", ""),
        )

    @classmethod
    def from_probe(
        cls, probe: Mapping[str, Any], tolerance: float, metric: str = "probe_s"
    ) -> RehearsalCheck:
        """From the controller's probe result: `{"instance", "passed", "why", "predicted_s",
        "measured_s"}` (the times absent when the probe failed)."""
        return cls(
            instance=probe["instance"],
            metric=metric,
            predicted=_opt_float(probe.get("predicted_s")),
            measured=_opt_float(probe.get("measured_s")),
            tolerance=tolerance,
            passed=bool(probe["passed"]),
            why=str(probe.get("why", "")),
        )


@dataclass(frozen=True, slots=True)
class Migrated:
    """Requests of removed instances still running at the drain deadline, by what happened."""

    kv_moved: int = 0  # KV cache exported and imported on the successor
    recomputed: int = 0  # continued on the successor by re-prefilling prompt + output so far
    finished_in_place: int = 0  # finished on the old instance before its release
    rerun: int = 0  # started over (nothing streamed yet, or no continuation possible)

    def __post_init__(self) -> None:
        if min(self.kv_moved, self.recomputed, self.finished_in_place, self.rerun) < 0:
            raise ValueError("migrated request counts must be >= 0")

    @property
    def total(self) -> int:
        return self.kv_moved + self.recomputed + self.finished_in_place + self.rerun

    def to_dict(self) -> dict[str, Any]:
        return {m: getattr(self, m) for m in METHODS}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Migrated:
        return cls(**{m: int(d.get(m, 0)) for m in METHODS})

    @classmethod
    def from_counts(cls, counts: Mapping[str, int]) -> Migrated:
        """From method -> requests, with the gateway's move results as names too (`kv`,
        `recompute`, `rerun`); an unknown name is a ValueError."""
        out = dict.fromkeys(METHODS, 0)
        for name, num in counts.items():
            method = _METHOD_ALIASES.get(name, name)
            if method not in out:
                raise ValueError(
                    f"unknown migration method {name!r}: expected {', '.join(METHODS)}"
                )
            out[method] += int(num)
        return cls(**out)


@dataclass(frozen=True, slots=True)
class Phases:
    """Each phase's duration in seconds (None: not run, or not yet)."""

    warm_s: float | None = None  # start the target instances, wait until ready
    rehearse_s: float | None = None
    switch_s: float | None = None  # routing table changed in the gateway
    drain_s: float | None = None
    migrate_s: float | None = None
    release_s: float | None = None  # old engines stopped, GPUs free
    sleep_s: float | None = None  # old engines put to sleep (they keep their GPUs)
    wake_s: float | None = None  # sleeping engines woken (instead of warm's cold start)

    def __post_init__(self) -> None:
        for name, seconds in self.items():
            if seconds < 0:
                raise ValueError(f"phase {name} took {seconds} s: durations must be >= 0")

    def items(self) -> list[tuple[str, float]]:
        """(phase, seconds) of the phases that ran, in order."""
        out = []
        for phase in PHASES:
            seconds = getattr(self, f"{phase}_s")
            if seconds is not None:
                out.append((phase, float(seconds)))
        return out

    @property
    def total_s(self) -> float:
        return sum(s for _, s in self.items())

    def to_dict(self) -> dict[str, Any]:
        return {f"{p}_s": getattr(self, f"{p}_s") for p in PHASES}

    @classmethod
    def from_seconds(cls, seconds: Mapping[str, float]) -> Phases:
        """From phase -> seconds as the controller times them; a phase run twice under a
        suffix (`warm_in_place` of an in-place shift) adds to its phase. An unknown phase is a
        ValueError."""
        out: dict[str, float] = {}
        for name, value in seconds.items():
            phase = name.split("_", 1)[0]
            if phase not in PHASES:
                raise ValueError(f"unknown shift phase {name!r}: expected {', '.join(PHASES)}")
            out[f"{phase}_s"] = out.get(f"{phase}_s", 0.0) + float(value)
        return cls(**out)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Phases:
        return cls(**{f"{p}_s": _opt_float(d.get(f"{p}_s")) for p in PHASES})


@dataclass(frozen=True, slots=True)
class After:
    """Performance measured over a window after the shift settled."""

    window_s: float
    requests_per_s: float
    goodput_per_s: float | None  # requests/s that met their SLO
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    num_failed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> After:
        return cls(
            window_s=float(d["window_s"]),
            requests_per_s=float(d["requests_per_s"]),
            goodput_per_s=_opt_float(d["goodput_per_s"]),
            ttft_p99_s=_opt_float(d["ttft_p99_s"]),
            tpot_p99_s=_opt_float(d["tpot_p99_s"]),
            num_failed=int(d["num_failed"]),
        )


@dataclass(frozen=True)
class ShiftEntry:
    at: datetime  # when decided (UTC)
    kind: Kind
    trigger: str = "none"  # the policy's trigger (up, down, resource, reclaim, wake, ...)
    reason: str = ""  # the decision's reason, in words
    signals: tuple[SignalValues, ...] = ()
    current: tuple[PlanInstance, ...] = ()  # the plan running when decided
    target: tuple[PlanInstance, ...] | None = None  # None: no change (a hold)
    score: float | None = None
    price: PriceTerms | None = None
    alternatives: tuple[Alternative, ...] = ()  # what it beat, or why nothing was taken
    notes: tuple[str, ...] = ()  # free lines: resource events, instances started / stopped
    outcome: Outcome = "pending"
    error: str | None = None  # why it failed, rolled back or was aborted
    finished_at: datetime | None = None  # when the outcome became final
    rehearsal: tuple[RehearsalCheck, ...] = ()
    migrated: Migrated | None = None  # None: not known (yet)
    phases: Phases = field(default_factory=Phases)
    after: After | None = None
    id: int | None = None  # given by the log
    # the deployment whose controller wrote it (given by the log; None: written without one)
    deployment: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown shift log kind {self.kind!r}: expected {', '.join(KINDS)}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {self.outcome!r}: expected {', '.join(OUTCOMES)}")
        fixed = FIXED_OUTCOMES.get(self.kind)
        if fixed is not None and self.outcome != fixed:
            raise ValueError(f"a {self.kind} entry's outcome is {fixed!r}, not {self.outcome!r}")
        if fixed is None and self.outcome in FIXED_OUTCOMES.values():
            raise ValueError(f"outcome {self.outcome!r} is only for {', '.join(FIXED_OUTCOMES)}")
        object.__setattr__(self, "at", _utc(self.at))
        if self.finished_at is not None:
            object.__setattr__(self, "finished_at", _utc(self.finished_at))

    @property
    def rehearsal_passed(self) -> bool | None:
        """None: no rehearsal."""
        return None if not self.rehearsal else all(c.passed for c in self.rehearsal)

    @classmethod
    def from_decision(
        cls,
        decision: ShiftDecision,
        at: datetime,
        current: Sequence[PlannedInstance],
        kind: Kind | None = None,
    ) -> ShiftEntry:
        """The entry of a shift policy decision. `kind` defaults to hold for a hold, reclaim
        for a reclaim shift, else shift (the controller says emergency / rollback / plan)."""
        if kind is None:
            if decision.action == "hold":
                kind = "hold"
            else:
                kind = "reclaim" if decision.trigger == "reclaim" else "shift"
        d = decision.to_dict()
        price = d["price"]
        return cls(
            at=at,
            kind=kind,
            trigger=decision.trigger,
            reason=decision.reason,
            signals=tuple(
                SignalValues.from_dict(s) for s in cast(list[dict[str, Any]], d["signals"])
            ),
            current=tuple(PlanInstance.from_planned(i) for i in current),
            target=None
            if decision.target is None
            else tuple(PlanInstance.from_planned(i) for i in decision.target),
            score=decision.score,
            price=None if price is None else PriceTerms.from_dict(cast(dict[str, Any], price)),
            alternatives=tuple(
                Alternative.from_dict(a) for a in cast(list[dict[str, Any]], d["alternatives"])
            ),
            outcome="held" if kind == "hold" else "pending",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; `ShiftEntry.from_dict(json.loads(json.dumps(e.to_dict()))) == e`."""
        return {
            "id": self.id,
            "at": self.at.isoformat(),
            "kind": self.kind,
            "trigger": self.trigger,
            "reason": self.reason,
            "signals": [s.to_dict() for s in self.signals],
            "current": [i.to_dict() for i in self.current],
            "target": None if self.target is None else [i.to_dict() for i in self.target],
            "score": self.score,
            "price": None if self.price is None else self.price.to_dict(),
            "alternatives": [a.to_dict() for a in self.alternatives],
            "notes": list(self.notes),
            "outcome": self.outcome,
            "error": self.error,
            "finished_at": None if self.finished_at is None else self.finished_at.isoformat(),
            "rehearsal": [c.to_dict() for c in self.rehearsal],
            "rehearsal_passed": self.rehearsal_passed,
            "migrated": None if self.migrated is None else self.migrated.to_dict(),
            "phases": self.phases.to_dict(),
            "after": None if self.after is None else self.after.to_dict(),
            "deployment": self.deployment,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShiftEntry:
        target = d.get("target")
        return cls(
            id=d.get("id"),
            at=_utc(datetime.fromisoformat(d["at"])),
            kind=d["kind"],
            trigger=d.get("trigger", "none"),
            reason=d.get("reason", ""),
            signals=tuple(SignalValues.from_dict(s) for s in d.get("signals", ())),
            current=tuple(PlanInstance.from_dict(i) for i in d.get("current", ())),
            target=None if target is None else tuple(PlanInstance.from_dict(i) for i in target),
            score=_opt_float(d.get("score")),
            price=None if d.get("price") is None else PriceTerms.from_dict(d["price"]),
            alternatives=tuple(Alternative.from_dict(a) for a in d.get("alternatives", ())),
            notes=tuple(d.get("notes", ())),
            outcome=d.get("outcome", "pending"),
            error=d.get("error"),
            finished_at=_time(d.get("finished_at")),
            rehearsal=tuple(RehearsalCheck.from_dict(c) for c in d.get("rehearsal", ())),
            migrated=None if d.get("migrated") is None else Migrated.from_dict(d["migrated"]),
            phases=Phases.from_dict(d.get("phases", {})),
            after=None if d.get("after") is None else After.from_dict(d["after"]),
            deployment=d.get("deployment"),
        )
