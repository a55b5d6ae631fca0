"""The order of a shift's steps, planned before anything changes (pure; docs/controller.md, "A
shift, make-before-break").

Both the live executor (`control/executor.py`) and the simulator (`sim/shift_run.py`) carry a
shift out in this order, make-before-break, and the shift policy keeps only targets it can
order (one rule for all three):

1. `now_adds`: new instances on GPUs no leaving instance holds start first (warm, rehearse,
   switch);
2. `steps`: in-place replacements roll, one group at a time: each step retires the leaving
   instances whose GPUs a group of new instances needs, then starts that group, and is taken
   only while every model of the group (of what it retires or starts) that serves before it
   still has another instance serving: a model woken by the shift (none of its instances
   serves yet) has no service to keep, and may start on GPUs another model leaves;
3. `rest`: the leaving instances nobody needs the GPUs of retire last.

`refusal` is non-empty when no order keeps every model serving (the shift is refused). With
`scale_to_zero`, a model the target has no instance of leaves on purpose (the live gateway holds
its requests for a cold start), not a gap. Instances are matched by `instance_key` (model, gear,
GPUs per stage).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.snapshot import instance_key

__all__ = ["ShiftSteps", "Step", "capacity_gap", "plan_shift", "rolling_steps"]

# (leaving instances retired first, new instances started on their GPUs after)
Step = tuple[tuple[PlannedInstance, ...], tuple[PlannedInstance, ...]]


@dataclass(frozen=True, slots=True)
class ShiftSteps:
    now_adds: tuple[PlannedInstance, ...]
    steps: tuple[Step, ...]
    rest: tuple[PlannedInstance, ...]
    refusal: str = ""  # why the shift cannot keep every model serving ("" when it can)

    @property
    def leaving(self) -> tuple[PlannedInstance, ...]:
        return tuple(b for blockers, _ in self.steps for b in blockers) + self.rest


def _overlaps(a: Sequence[str], b: Sequence[str]) -> bool:
    return bool(set(a) & set(b))


def capacity_gap(
    running: Sequence[PlannedInstance],
    leaving: Sequence[PlannedInstance],
    now_adds: Sequence[PlannedInstance],
    to_zero: Collection[str] = (),
) -> str:
    """Why retiring `leaving` would leave a model with no instance serving ("" if none);
    models in `to_zero` scale to zero on purpose."""
    gone = {instance_key(i) for i in leaving}
    for model in sorted({i.model for i in leaving} - set(to_zero)):
        staying = [i for i in running if i.model == model and instance_key(i) not in gone]
        if not staying and not any(p.model == model for p in now_adds):
            return (
                f"{model}: every instance leaves and its replacement needs their GPUs; "
                "serving would stop in between"
            )
    return ""


def rolling_steps(
    serving: Sequence[PlannedInstance],
    in_way: Sequence[PlannedInstance],
    later_adds: Sequence[PlannedInstance],
    to_zero: Collection[str] = (),
) -> list[Step] | None:
    """The order of in-place replacements (see the module docstring); `serving` is what
    serves before the first step (running plus the instances started first); models in
    `to_zero` leave on purpose. None when no order keeps every model serving."""
    serving_now = list(serving)
    blockers_left = list(in_way)
    remaining = list(later_adds)
    steps: list[Step] = []
    while remaining:
        for first in remaining:
            adds = [first]
            blockers: list[PlannedInstance] = []
            grown = True
            while grown:  # close the group over shared GPUs
                grown = False
                for b in blockers_left:
                    if b not in blockers and any(_overlaps(b.gpu_ids, a.gpu_ids) for a in adds):
                        blockers.append(b)
                        grown = True
                for a in remaining:
                    if a not in adds and any(_overlaps(a.gpu_ids, b.gpu_ids) for b in blockers):
                        adds.append(a)
                        grown = True
            gone = {instance_key(b) for b in blockers}
            staying = [p for p in serving_now if instance_key(p) not in gone]
            group = {i.model for i in (*blockers, *adds)} - set(to_zero)
            served_before = group & {p.model for p in serving_now}
            if served_before <= {p.model for p in staying}:
                break
        else:
            return None
        steps.append((tuple(blockers), tuple(adds)))
        serving_now = [p for p in serving_now if instance_key(p) not in gone] + adds
        blockers_left = [b for b in blockers_left if b not in blockers]
        remaining = [a for a in remaining if a not in adds]
    return steps


def plan_shift(
    running: Sequence[PlannedInstance],
    target: Sequence[PlannedInstance],
    *,
    scale_to_zero: bool = False,
) -> ShiftSteps:
    """The steps from `running` to `target` (module docstring)."""
    target_keys = {instance_key(p): p for p in target}
    running_keys = {instance_key(i) for i in running}
    leaving = [i for i in running if instance_key(i) not in target_keys]
    adding = [p for k, p in target_keys.items() if k not in running_keys]
    leaving_gpus = {g for i in leaving for g in i.gpu_ids}
    now_adds = [p for p in adding if not set(p.gpu_ids) & leaving_gpus]
    later_adds = [p for p in adding if set(p.gpu_ids) & leaving_gpus]
    later_gpus = {g for p in later_adds for g in p.gpu_ids}
    in_way = [i for i in leaving if set(i.gpu_ids) & later_gpus]
    rest = [i for i in leaving if not set(i.gpu_ids) & later_gpus]
    replaced_models = {p.model for p in later_adds}
    to_zero = {i.model for i in leaving} - {p.model for p in target} if scale_to_zero else set()
    without = [i for i in leaving if i.model not in replaced_models]
    why_not = capacity_gap(running, without, now_adds, to_zero)
    steps = rolling_steps([*running, *now_adds], in_way, later_adds, to_zero)
    if steps is None:
        why_not = capacity_gap(running, leaving, now_adds, to_zero) or (
            "no order of in-place replacements keeps every model serving"
        )
    return ShiftSteps(tuple(now_adds), tuple(steps or ()), tuple(rest), why_not)
