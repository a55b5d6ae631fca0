"""A wake (requests wait for a model with no instance) never stalls on a target the executor
would refuse: the policy also proposes the running plan kept plus the woken model on the GPUs
free now, and refuses, before choosing, every candidate no order of steps can carry out
(`plan_shift`, the executor's own rule).

Exact, on the seed's fragmented cluster with the real planner (memoised), and once end to end
on the simulator's virtual clock: two models scaled to zero woken beside `a`, a model that
serves 50k-token answers on its only instance(s) (before: the wake chose the planner's
re-plan, which moved `a` or put the woken model on `a`'s GPU, was refused at every tick, and
the held requests ended in 429).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_controller_renew import _short, _zero
from test_executor_steps import relaunched
from test_shift_policy import CLUSTER, FREED, decide, demand, policy, running_for, steady

from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift import ModelState, Sample, ShiftSnapshot, instance_key
from flexpipe.policies.shift.step_order import plan_shift, rolling_steps
from flexpipe.policies.shift.step_order import plan_shift as executor_plan_shift
from flexpipe.sim import simulate
from flexpipe.sim.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[2]
SEED_CLUSTER = ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"


def waiting(t: float) -> Sample:
    """Requests queued in the gateway for a model with no instance."""
    return Sample(t, 3, 100, None, None, 0.0)


def keys(instances: tuple[PlannedInstance, ...] | None) -> list[str]:
    assert instances is not None
    return sorted(instance_key(i) for i in instances)


def wake_snapshot(a_rate: float, running: tuple[PlannedInstance, ...]) -> ShiftSnapshot:
    """`a` (min 1) running `running`, at `a_rate` now; `c` (min 0) has none, 3 waiting."""
    models = [
        ModelState(demand(a_rate, "a"), (steady(50),), min_instances=1),
        ModelState(demand(0.0, "c", "mistral-7b"), (waiting(50),)),
    ]
    return ShiftSnapshot.of(CLUSTER, running, models)


def test_the_policy_and_the_executor_share_one_step_order() -> None:
    assert executor_plan_shift is plan_shift


def test_a_wake_whose_replan_moves_a_in_place_adds_the_woken_model_and_leaves_a_alone() -> None:
    """`a` runs its only instance on gpu2 in another gear than the planner would give it now
    (planned at another load): the re-plan relaunches it in place, which stops `a` in between.
    Refused before pricing, with the executor's reason; the wake keeps `a` as it is and starts
    `c` on a GPU free now."""
    (planned,) = running_for(CLUSTER, demand(1.5, "a"))
    assert planned.gpu_ids == ("gpu2",)
    running = (relaunched(planned),)  # same GPU, another gear
    d = decide(policy(), wake_snapshot(1.5, running), 50)
    assert d.action == "shift" and d.trigger == "wake"
    assert d.reason.split("; ")[1].startswith("add c: ")
    assert d.target is not None and d.target[:1] == running  # `a` untouched
    (added,) = d.target[1:]
    assert added.model == "c" and added.gpu_ids == ("gpu3",)  # free now: gpu0, gpu3
    assert plan_shift(running, d.target, scale_to_zero=True) == plan_shift(
        running, d.target
    )  # nothing leaves: no step in place, nothing to refuse
    assert plan_shift(running, d.target).now_adds == (added,)
    by_name = {a.name: a for a in d.alternatives}
    replan = by_name["replan"]
    assert instance_key(planned) in keys(replan.instances)  # `a` relaunched in place
    assert not replan.accepted and replan.price is None
    assert replan.reason == (
        "cannot be carried out: a: every instance leaves and its replacement needs their "
        "GPUs; serving would stop in between"
    )
    assert replan.reason.endswith(plan_shift(running, replan.instances).refusal)


def test_a_wake_still_takes_a_feasible_replan_that_pays_more() -> None:
    """`a` now gets 5 req/s on an instance planned for 1.5: the re-plan (`a` on TP2 over gpu2
    and gpu1, and on gpu3; `c` on gpu0) is carried out make-before-break — its new instances
    on free GPUs first, then `a`'s gpu2 relaunched as TP2 while `a` serves on gpu3 — and pays
    far more than only adding `c`: taken."""
    running = running_for(CLUSTER, demand(1.5, "a"))
    assert keys(running) == ["a|tp1-pp1-bf16-kvauto-s24|gpu2"]
    d = decide(policy(), wake_snapshot(5.0, running), 50)
    assert d.action == "shift" and d.trigger == "wake"
    assert d.reason.split("; ")[1].startswith("replan: ")
    assert keys(d.target) == [
        "a|tp1-pp1-fp8-kvauto-s16|gpu3",
        "a|tp2-pp1-bf16-kvauto-s48|gpu2,gpu1",
        "c|tp1-pp1-fp8-kvauto-s8|gpu0",
    ]
    steps = plan_shift(running, d.target or (), scale_to_zero=True)
    assert steps.refusal == ""
    assert keys(steps.now_adds) == keys(d.target)[::2]  # gpu3 and gpu0 first
    ((blockers, adds),) = steps.steps
    assert (keys(blockers), keys(adds)) == (keys(running), keys(d.target)[1:2])
    add = next(a for a in d.alternatives if a.name == "add c")
    assert add.accepted and add.score is not None and d.score is not None
    assert add.score < d.score
    assert keys(add.instances) == [*keys(running), "c|tp1-pp1-fp8-kvauto-s48|gpu3"]


def test_a_wake_with_no_gpu_free_proposes_no_additive_candidate() -> None:
    """Every GPU but `a`'s is held by another tenant: nothing to add `c` on, and the re-plan
    keeps `a` (its minimum) with no room for `c`: the wake holds."""
    (planned,) = running_for(CLUSTER, demand(1.5, "a"))
    full = CLUSTER
    for g in ("gpu0", "gpu1", "gpu3"):
        full = full.with_used(g, full.gpu(g).capacity_bytes, owner="batch")
    snapshot = replace(wake_snapshot(1.5, (planned,)), cluster=full)
    d = decide(policy(), snapshot, 50)
    assert d.action == "hold" and d.trigger == "wake"
    assert d.reason.endswith("no candidate clears the bar")
    assert [(a.name, a.reason) for a in d.alternatives][:1] == [
        ("replan", "the same plan as the running one")  # no room for `c` beside `a`
    ]
    assert [a.name for a in d.alternatives] == ["replan", "keep"]  # no "add c"


# -- the step order: a woken model may start on GPUs another model leaves -----------------------


def test_a_woken_model_starts_on_gpus_a_moved_model_leaves() -> None:
    """`a` moves from gpu2 to gpu1 (its new instance starts first), then `c`, which serves
    nothing yet, starts on gpu2: no model stops serving. Before, the step waited for another
    instance of `c` to serve, which a woken model never has: every such shift was refused."""
    (a2,) = running_for(FREED, demand(1.5, "a"))
    assert a2.gpu_ids == ("gpu1",)
    a1 = replace(a2, stages=(("gpu2",),))
    (c,) = running_for(FREED, demand(1.5, "c", "mistral-7b"))
    c2 = replace(c, stages=(("gpu2",),))
    steps = plan_shift([a1], [a2, c2])
    assert steps.refusal == "" and steps.now_adds == (a2,)
    assert steps.steps == (((a1,), (c2,)),) and steps.rest == ()
    # the same, if `a` had nowhere else to go: `a` would stop serving, refused
    alone = plan_shift([a1], [c2])
    assert "a: every instance leaves" in alone.refusal
    assert plan_shift([a1], [c2], scale_to_zero=True).refusal == ""  # `a` leaves on purpose


def test_a_step_never_retires_another_models_last_instance() -> None:
    """`c` (serving on gpu0) takes gpu2 from `a`'s only instance, and `a` moves to gpu3, which
    `x` (serving on gpu1 too) leaves. Taking `c`'s group first would stop `a` until its own
    group: `a` moves first. Before, `c`'s group went first (only `c`'s service was checked),
    then `a`'s found nothing of `a` serving, and the shift was refused."""
    (a,) = running_for(FREED, demand(1.5, "a"))

    def on(model: str, gpu: str) -> PlannedInstance:
        return replace(a, model=model, name=f"{model}-{gpu}", stages=((gpu,),))

    running = [on("a", "gpu2"), on("c", "gpu0"), on("x", "gpu3"), on("x", "gpu1")]
    target = [on("c", "gpu0"), on("c", "gpu2"), on("a", "gpu3"), on("x", "gpu1")]
    steps = plan_shift(running, target)
    assert steps.refusal == "" and steps.now_adds == () and steps.rest == ()
    assert steps.steps == (
        ((on("x", "gpu3"),), (on("a", "gpu3"),)),
        ((on("a", "gpu2"),), (on("c", "gpu2"),)),
    )
    # `a` and `c` swap GPUs: either group first stops one of them
    swap = [on("a", "gpu0"), on("c", "gpu2")]
    assert rolling_steps(running[:2], running[:2], swap) is None
    assert plan_shift(running[:2], swap).refusal.startswith("a: every instance leaves")


# -- end to end: the simulator's controller on its virtual clock --------------------------------


def _scenario(a_min_instances: int) -> Any:
    """The seed's cluster (gpu1 freed at 100 s). `a` serves 50k-token answers (min 1: one
    instance on gpu2; min 2: gpu2 and gpu1); `c` and `d` have no instance until their requests
    come, at 600 s and 700 s."""
    a = {"name": "a", "model": "llama-3.1-8b", "max_model_len": 65536,
         "min_instances": a_min_instances,
         "demand": {"request_rate_per_s": 1, "input_tokens": 256, "output_tokens": 1024},
         "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 200}, "dtypes": ["bf16"]}  # fmt: skip
    doc = {
        "name": "wake", "duration_s": 1300, "seed": 0, "cluster": {"file": str(SEED_CLUSTER)},
        "controller": {"drain_deadline_s": 3000, "min_instances_floor": 0,
                       "shift": {"triggers": {"thresholds": {"down_utilization": 0.0}}}},
        "models": [a, _zero("c", "llama-2-7b"), _zero("d", "llama-2-7b")],
        "resources": [{"at_s": 100, "release": ["gpu1"]}],
        "workloads": [{"model": "a", "arrivals": {"rate_per_s": 0.02, "start_s": 30},
                       "prompt_tokens": {"dist": "fixed", "mean": 256},
                       "output_tokens": {"dist": "fixed", "mean": 50000}},
                      _short("c", 600), _short("d", 700)],
    }  # fmt: skip
    return parse_scenario(doc, ROOT)


@pytest.mark.parametrize("a_min_instances", [1, 2])
def test_the_simulator_wakes_both_models_beside_a_and_serves_every_request(
    a_min_instances: int,
) -> None:
    """Before: min 1, the re-plan put `c` on `a`'s GPU (refused at every tick, `c`'s 39 and
    `d`'s 23 requests all 429); min 2, `c`'s wake relaunched one of `a`'s instances in place
    (an 830 s shift) and `d`'s re-plan was then refused at every tick (23 requests 429)."""
    r = simulate(_scenario(a_min_instances), "flexpipe")
    first = r.shifts[0]["started"]
    wakes = [s for s in r.shifts if s["trigger"] == "wake"]
    assert [(s["at_s"] // 10 * 10, s["succeeded"], s["refused"]) for s in wakes] == [
        (610.0, True, False),
        (710.0, True, False),
    ]
    for wake, model in zip(wakes, "cd", strict=True):
        assert wake["reason"].split("; ")[1].startswith(f"add {model}: ")
        (started,) = wake["started"]
        assert started.startswith(f"{model}|") and wake["stopped"] == []
        assert wake["finished_s"] - wake["at_s"] < 60  # a cold start, no drain of `a`
    assert all(s["stopped"] == [] for s in r.shifts)
    assert len(first) == a_min_instances and all(k.startswith("a|") for k in first)
    served = {m: [q for q in r.requests if q.model == m] for m in "acd"}
    assert all(served.values())
    assert all(q.completed and not q.failed for q in r.requests), {q.failed for q in r.requests}
