"""Engines that share a GPU in memory (`planner.share_gpus`) launch in waves where the engine
kind cannot load beside another engine (vLLM's start-up memory profiling charges a
neighbour's loading to itself): `launch_waves` (control/core/standby_aside.py), and the shift
procedure stepped by hand with test_shift_procedure.py's fake world. The sim engine loads
beside: one launch, as before."""

from __future__ import annotations

from dataclasses import replace

from flexpipe.control.core.shift_procedure import ShiftParams, ShiftProcedure
from flexpipe.control.core.standby_aside import launch_waves
from flexpipe.policies.planner import PlannedInstance
from tests.control.test_shift_procedure import L4, L40S, PAIR, FakeWorld, drive

# another model's engine on the L40S (gpu3) beside llama-7b-1, and one on gpu2 beside the pair
BESIDE = replace(L40S, name="other-0", model="other")
ON_GPU2 = replace(L4, name="other-1", model="other", stages=(("gpu2",),))


def names(waves: list[list[PlannedInstance]]) -> list[list[str]]:
    return [[i.name for i in w] for w in waves]


def test_launch_waves_one_engine_per_gpu_per_wave() -> None:
    assert names(launch_waves([L40S, BESIDE, L4], False)) == [
        ["llama-7b-1", "llama-7b-2"],
        ["other-0"],
    ]
    # the pair (gpu1+gpu2) and other-1 (gpu2) apart; other-0 waits for llama-7b-1 (gpu3)
    assert names(launch_waves([PAIR, ON_GPU2, L40S, BESIDE], False)) == [
        ["llama-7b-0", "llama-7b-1"],
        ["other-1", "other-0"],
    ]
    assert names(launch_waves([L40S, BESIDE, L4], True)) == [
        ["llama-7b-1", "other-0", "llama-7b-2"]
    ]
    assert launch_waves([], False) == [[]]


def shift_log(loads_beside_awake: bool) -> list[str]:
    world = FakeWorld()
    params = ShiftParams(loads_beside_awake=loads_beside_awake)
    out = drive(ShiftProcedure({}, [L40S, BESIDE, L4], params).run(world.now_s), world)
    assert out.succeeded
    return [line for line in world.log if line.startswith(("launch", "ready"))]


def test_a_shift_launches_engines_sharing_a_gpu_one_after_the_other() -> None:
    assert shift_log(False) == [
        "launch llama-7b-1,llama-7b-2",
        "ready llama-7b-1,llama-7b-2",
        "launch other-0",
        "ready llama-7b-1,other-0,llama-7b-2",
    ]
    assert shift_log(True) == [
        "launch llama-7b-1,other-0,llama-7b-2",
        "ready llama-7b-1,other-0,llama-7b-2",
    ]
