"""What both controllers' shells share to drive standby sleepers (control/core/standby_aside.py),
pure and exact: the planner's view beside sleepers and standbys loading, and the GPU memory a
sleeping engine still holds (the sim engine's own accounting, asleep at either level)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from flexpipe.cluster import load_cluster
from flexpipe.control.core.standby_aside import asleep_gpu_bytes, standby_view
from flexpipe.engine.sleep import TAGS, SleepState
from flexpipe.perf import perf_model_for
from flexpipe.policies.planner import ModelDemand, Slo, plan

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
