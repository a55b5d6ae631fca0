"""The shift policy's input: plain, immutable data the controller or the simulator fills in.

The policy keeps no state between calls. What it must remember (recent samples, past shifts
and their outcomes) is in the snapshot, produced by the caller; the policy only reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.cluster import Cluster
from flexpipe.policies.planner import ModelDemand, PlannedInstance
from flexpipe.policies.shift.signals import Sample

__all__ = ["ModelState", "ShiftRecord", "ShiftSnapshot", "instance_key"]


def instance_key(instance: PlannedInstance) -> str:
    """What makes two planned instances the same one: model, gear and GPUs per stage
    (`llama-7b|tp2-pp1-bf16-kvauto-s48|gpu1,gpu2`). Names are not identity: two plans may
    both call an instance `llama-7b-0`."""
    stages = "/".join(",".join(stage) for stage in instance.stages)
    return f"{instance.model}|{instance.gear.key()}|{stages}"


@dataclass(frozen=True, slots=True)
class ModelState:
    """One served model: its demand as measured now, its recent samples and its standing."""

    demand: ModelDemand  # request_rate_per_s: the arrival rate measured now; SLOs
    samples: tuple[Sample, ...] = ()  # any order; the policy keeps those in its window
    priority: float = 1.0  # weight of its goodput (seed 004: customer-facing > internal)
    min_instances: int = 0  # never fewer (0: may scale to zero when idle)
    # The load expected over the pricing horizon (a forecast); None: the same as now.
    expected_request_rate_per_s: float | None = None
    # The configured demand's rate: a wake plans a model scaled to zero for at least this
    # (its rate measured now is that of the requests it served: none while it had no instance)
    declared_request_rate_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.priority <= 0:
            raise ValueError(f"{self.name}: priority must be > 0")
        if self.min_instances < 0:
            raise ValueError(f"{self.name}: min_instances must be >= 0")
        if self.expected_request_rate_per_s is not None and self.expected_request_rate_per_s < 0:
            raise ValueError(f"{self.name}: expected_request_rate_per_s must be >= 0")

    @property
    def name(self) -> str:
        return self.demand.name

    @property
    def request_rate_per_s(self) -> float:
        return self.demand.request_rate_per_s

    @property
    def expected_rate_per_s(self) -> float:
        if self.expected_request_rate_per_s is None:
            return self.demand.request_rate_per_s
        return self.expected_request_rate_per_s


@dataclass(frozen=True, slots=True)
class ShiftRecord:
    """A shift the controller started: when, what it started, and how it ended.

    A shift that did not succeed either *failed* (an instance did not start or missed its
    rehearsal, and was rolled back: counts towards the blacklist of `target_keys`) or was
    *refused* by the executor before anything changed (say, an in-place order that would
    leave a model with no instance serving): nothing of the target was tried, so a refusal
    is no evidence against it and never blacklists it. Both start the cooldown, so the
    same refused target is not proposed again on the very next tick.
    """

    started_s: float
    finished_s: float | None = None  # None: still in progress
    succeeded: bool | None = None  # False: failed or refused (see `refused`)
    target_keys: tuple[str, ...] = ()  # instance_key of each instance the shift started
    refused: bool = False  # not succeeded, but refused before any change (not a failure)

    def __post_init__(self) -> None:
        if self.refused and self.succeeded is not False:
            raise ValueError("a refused shift has succeeded=False")

    @property
    def in_progress(self) -> bool:
        return self.finished_s is None

    @property
    def failed(self) -> bool:
        """Tried and failed: what the blacklist counts."""
        return self.succeeded is False and not self.refused


@dataclass(frozen=True)
class ShiftSnapshot:
    """Everything one decision reads.

    `cluster` holds the GPUs as free for us now: memory other tenants hold is `used`, ours is
    not (the running instances are re-planned onto it). `resources_changed_s` is when the GPUs
    free to us last changed after the running plan was made (a tenant left, a GPU came back);
    None when they have not, so the resource-driven trigger need not ask the planner.
    `asleep`: instance key -> sleep level of the engines asleep on GPUs free to us (sleep
    mode): a target with one of them wakes it, priced at its wake time, not a cold start.
    `time_scale`: seconds of the controller's clock (`now_s`, the samples' `at_s`) per
    modelled second (sim engines at a time scale; 1 in production and in the simulator): a
    rate the policy derives from the samples' times is per modelled second, as the arrival
    rates measured are.
    """

    cluster: Cluster
    running: tuple[PlannedInstance, ...]
    models: tuple[ModelState, ...]
    history: tuple[ShiftRecord, ...] = ()
    resources_changed_s: float | None = None
    asleep: tuple[tuple[PlannedInstance, int], ...] = ()  # (instance, its sleep level)
    time_scale: float = 1.0

    @property
    def asleep_levels(self) -> dict[str, int]:
        return {instance_key(i): level for i, level in self.asleep}

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique; got {names}")
        unknown = sorted({i.model for i in self.running} - set(names))
        if unknown:
            raise ValueError(f"running instances of models not in the snapshot: {unknown}")

    def model(self, name: str) -> ModelState:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    @staticmethod
    def of(
        cluster: Cluster,
        running: Sequence[PlannedInstance],
        models: Sequence[ModelState],
        history: Sequence[ShiftRecord] = (),
        resources_changed_s: float | None = None,
        asleep: Sequence[tuple[PlannedInstance, int]] = (),
        time_scale: float = 1.0,
    ) -> ShiftSnapshot:
        return ShiftSnapshot(
            cluster,
            tuple(running),
            tuple(models),
            tuple(history),
            resources_changed_s,
            tuple(asleep),
            time_scale if time_scale > 0 else 1.0,
        )
