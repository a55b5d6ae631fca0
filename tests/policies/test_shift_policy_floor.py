"""The min_instances floor (policies/shift/policy.py, check 3): a model whose last engine died
is re-planned at once — not held at zero through the cooldown of the shift before — while a
model that may scale to zero (min 0) still waits; and a floor the GPUs cannot restore does not
block the other checks."""

from __future__ import annotations

from test_shift_policy import CLUSTER, decide, demand, idle, policy, running_for, snap

from flexpipe.policies.shift.snapshot import ShiftRecord

JUST_SHIFTED = (ShiftRecord(started_s=60.0, finished_s=100.0, succeeded=True),)  # cooldown 180 s


def test_a_model_that_lost_its_last_engine_is_replanned_in_the_cooldown() -> None:
    p = policy()
    # min 0 (scale to zero allowed): it waits, as before
    waits = decide(p, snap((), [idle(125)], rate=1.5, history=JUST_SHIFTED), 132)
    assert (waits.action, waits.reason) == ("hold", "cooldown after the last shift: 148 s left")
    # min 1 (every model without --scale-to-zero): back at once
    d = decide(p, snap((), [idle(125)], rate=1.5, history=JUST_SHIFTED, min_instances=1), 132)
    assert (d.action, d.trigger) == ("shift", "floor")
    assert d.reason.startswith("llama-7b has 0 instance(s), below its minimum of 1; replan: ")
    assert d.target is not None and [i.model for i in d.target] == ["llama-7b"]
    assert d.target == running_for(CLUSTER, demand(1.5))  # the planner's plan for the GPUs


def test_a_floor_no_gpu_can_restore_leaves_the_other_checks_to_decide() -> None:
    gone = CLUSTER
    for g in CLUSTER.gpu_ids:
        gone = gone.with_used(g, gone.gpu(g).capacity_bytes, owner="batch job")
    d = decide(policy(), snap((), [idle(125)], cluster=gone, rate=1.5, history=JUST_SHIFTED,
                              min_instances=1), 132)  # fmt: skip
    assert (d.action, d.reason) == ("hold", "cooldown after the last shift: 148 s left")
