"""What both controllers' shells share to drive standby sleepers (control/core/standby_aside.py),
pure and exact: the planner's view beside sleepers and standbys loading, and the GPU memory a
sleeping engine still holds (the sim engine's own accounting, asleep at either level)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from flexpipe.cluster import Cluster, load_cluster
from flexpipe.control.core.standby_aside import (
    AsideStep,
    asleep_gpu_bytes,
    evicts_asleep,
    first_asleep,
    first_plan,
    footprint_bytes,
    standby_view,
    standbys_to_start,
    swap_procedure,
    swap_steps,
    time_shared_gpus,
    woken_back,
)
from flexpipe.engine.sleep import TAGS, SleepState
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import perf_model_for
from flexpipe.policies.planner import ModelDemand, Plan, PlannedInstance, Slo, plan
from flexpipe.policies.shift.migration import perf_model_of
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_sleepers import (
    StandbyParams,
)
from flexpipe.policies.shift.time_share import (
    Swap,
)

GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]
# the seed's 4-GPU cluster, its other tenant gone from gpu1
FREED = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml").with_used("gpu1", 0.0)
A = ModelDemand("a", "llama-2-7b", 1.0, 2048, 256, Slo(2.0, 0.05), ("bf16",))
TEMPLATE = plan(FREED, (A,)).instances[0]


def test_the_view_counts_sleepers_and_holds_the_gpus_of_standbys_loading_whole() -> None:
    asleep = replace(TEMPLATE, stages=(("gpu1",),), layers_per_stage=(32,))
    view = standby_view(FREED, [(asleep, 3 * GIB)], False, ["gpu2", "gpu9"])
    assert view.gpu("gpu1").used_bytes == FREED.gpu("gpu1").used_bytes + 3 * GIB
    assert view.gpu("gpu1").owner == "flexpipe-asleep"
    assert view.gpu("gpu2").free_bytes == 0 and view.gpu("gpu2").owner == "flexpipe"
    assert view.gpu("gpu0").used_bytes == FREED.gpu("gpu0").used_bytes  # untouched
    assert standby_view(FREED, [], False, []) == FREED
    kept = standby_view(FREED, [(asleep, 3 * GIB)], True, [])
    assert kept.gpu("gpu1").free_bytes == 1.0  # kept for its wake


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeper_holds_its_reserve_as_the_sim_engine_accounts_it(level: int) -> None:
    pm = perf_model_for("llama-2-7b", "tp=2", "A100-80G-SXM")
    state = SleepState(pm)
    state.apply_sleep(level, TAGS, 0.0)
    assert asleep_gpu_bytes(pm) == state.gpu_memory_bytes
    assert asleep_gpu_bytes(pm) == sum(g.reserve_bytes for g in pm.memory.per_gpu) > 0
    assert asleep_gpu_bytes(pm) < sum(g.weights_bytes for g in pm.memory.per_gpu)


# -- time-sharing (docs/shift-policy.md, "Time-sharing, live") ---------------------------------

ONE = FREED.with_used("gpu0", FREED.gpu("gpu0").capacity_bytes)  # the L4 taken: not ours
for _g in ("gpu1", "gpu3"):
    ONE = ONE.with_used(_g, ONE.gpu(_g).capacity_bytes)
# only gpu2 (an A100) is free: A serves there, B's only room is beside it
B = replace(A, name="b", request_rate_per_s=0.0, min_instances=0, priority=2.0)
(HOLDER,) = plan(ONE, (A,)).instances
SHARE = StandbyParams(enabled=True, time_share=True)


def _footprint(inst: PlannedInstance, awake: bool) -> float:
    return footprint_bytes(perf_model_of(ONE, inst, spec=load_model_spec(inst.model_id)), awake)


def _planner(cluster: Cluster, demands: Sequence[ModelDemand], now_s: float) -> Plan:
    return plan(cluster, demands, now_s=now_s)


def test_a_sleeper_beside_a_running_engine_is_not_counted_again() -> None:
    beside = replace(TEMPLATE, model="b", stages=(("gpu2",),), layers_per_stage=(32,))
    running = replace(TEMPLATE, stages=(("gpu2",),), layers_per_stage=(32,))
    gpus = time_shared_gpus([running], True)
    assert gpus == {"gpu2"} and time_shared_gpus([running], False) == set()
    view = standby_view(FREED, [(beside, 3 * GIB)], False, ["gpu2", "gpu3"], gpus)
    assert view.gpu("gpu2") == FREED.gpu("gpu2")  # neither counted nor held whole
    assert view.gpu("gpu3").free_bytes == 0  # a standby loading on a GPU nothing runs on
    # without time-sharing the same sleeper is counted, the loading GPU held whole
    assert standby_view(FREED, [(beside, 3 * GIB)], False, ["gpu2"]).gpu("gpu2").free_bytes == 0


def test_a_standby_with_no_free_gpu_is_placed_beside_another_models_engine() -> None:
    got = standbys_to_start(
        ONE, ONE, (), (A, B), [HOLDER], [], {}, {}, _planner, 0.0, SHARE, _footprint
    )
    assert [(s.model, s.gpu_ids, s.gear.key()) for s in got] == [
        ("b", ("gpu2",), "tp1-pp1-bf16-kvauto-s24")
    ]
    # it fits asleep beside the holder: the A100's 80 GiB hold A awake (72) and B's reserve
    assert _footprint(HOLDER, True) / GIB == 72.0
    assert 0 < _footprint(got[0], False) < ONE.gpu("gpu2").capacity_bytes - 72 * GIB
    # without time_share, or with gpu2 loading a standby already: none
    off = replace(SHARE, time_share=False)
    assert standbys_to_start(ONE, ONE, (), (A, B), [HOLDER], [], {}, {}, _planner, 0.0, off,
                             _footprint) == []  # fmt: skip
    assert standbys_to_start(ONE, ONE, ["gpu2"], (A, B), [HOLDER], [], {}, {}, _planner, 0.0,
                             SHARE, _footprint) == []  # fmt: skip


@pytest.mark.parametrize("level", [1, 2])
def test_the_footprint_is_the_sim_engines_own_accounting(level: int) -> None:
    pm = perf_model_for("llama-2-7b", "tp=2", "A100-80G-SXM")
    state = SleepState(pm)
    assert footprint_bytes(pm, True) == state.gpu_memory_bytes
    state.apply_sleep(level, TAGS, 0.0)
    assert footprint_bytes(pm, False) == state.gpu_memory_bytes == asleep_gpu_bytes(pm)


def test_only_a_time_shared_standby_launch_keeps_the_sleepers_on_its_gpus() -> None:
    assert not evicts_asleep("standby", {}, [HOLDER], True)
    assert evicts_asleep("standby", {}, [HOLDER], False)
    assert evicts_asleep("standby", {"k": 1}, [], True)  # its sleep step: nothing launched
    assert evicts_asleep("standby", {"k": 1}, [HOLDER], True)  # the first plan's sleep step
    assert evicts_asleep("swap-wake", {}, [HOLDER], True)
    assert evicts_asleep("wake-aside", {}, [HOLDER], True)


def test_the_first_plan_puts_each_models_standby_set_in_place_of_the_planners() -> None:
    a_std = replace(HOLDER, name="a-std")
    b_planned = replace(HOLDER, name="b-0", model="b", stages=(("gpu3",),))
    assert first_plan([a_std], [HOLDER, b_planned]) == [a_std, b_planned]
    assert first_plan([], [HOLDER]) == [HOLDER]
    running = {instance_key(a_std): a_std, instance_key(b_planned): b_planned}
    keys = {instance_key(a_std)}
    idle: list[dict[str, object]] = [{"model": "a", "state": "active", "num_in_flight": 0}]
    busy: list[dict[str, object]] = [{"model": "a", "state": "active", "num_in_flight": 2}]
    assert first_asleep(keys, running, idle, {}) == keys
    assert first_asleep(keys, running, busy, {}) == set()  # it serves: awake
    assert first_asleep(keys, running, idle, {"a": 1}) == set()  # requests wait for it
    assert first_asleep(keys, {}, idle, {}) == set()  # it did not start


def test_a_swap_sleeps_the_holders_then_wakes_and_wakes_them_back_if_it_failed() -> None:
    other = replace(TEMPLATE, stages=(("gpu3",),), layers_per_stage=(32,))
    sleeper = replace(HOLDER, model="b", name="b-0")
    swap = Swap(sleeper, (HOLDER,))
    kept, wakes = swap_steps([HOLDER, other], [swap])
    assert kept == [other] and wakes == [sleeper]
    key = instance_key
    # woken: nothing back; not running (its wake and its cold start failed): the holder
    assert woken_back([swap], {key(other), key(sleeper)}, {key(HOLDER)}) == []
    assert woken_back([swap], {key(other)}, {key(HOLDER)}) == [HOLDER]
    assert woken_back([swap], {key(other)}, set()) == []  # the holder stopped: none to wake


def test_the_swap_procedure_both_shells_drive() -> None:
    """Its steps, each sent the state after the one before: the holder sleeps, the sleeper
    wakes beside what runs, and only if it does not run, the holder wakes back."""
    other = replace(TEMPLATE, stages=(("gpu3",),), layers_per_stage=(32,))
    sleeper = replace(HOLDER, model="b", name="b-0")
    swap = Swap(sleeper, (HOLDER,))
    key = instance_key

    def steps(woke: bool) -> list[AsideStep]:
        gen = swap_procedure([HOLDER, other], [swap])
        out = [next(gen)]
        states = [
            ([other], {key(other)}, {key(HOLDER), key(sleeper)}),
            ([other, sleeper], {key(other), key(sleeper)}, {key(HOLDER)})
            if woke
            else ([other], {key(other)}, {key(HOLDER)}),
        ]
        for state in states:
            try:
                out.append(gen.send(state))
            except StopIteration:
                break
        return out

    sleep = AsideStep("swap-sleep", (other,))
    wake = AsideStep("swap-wake", (other, sleeper))
    assert steps(woke=True) == [sleep, wake]
    assert steps(woke=False) == [sleep, wake, AsideStep("swap-back", (other, HOLDER))]
