"""Standby sets sized by what meets the SLO in a burst (policies/shift/standby_sleepers.py,
`slo_gears`, `arrival_peaks`, `single_stage`): the rate a burst arrived at, not the rate its
engines managed to finish; no pipeline among the standbys. Exact, on the seed's 4-GPU
cluster with gpu1 freed and fake planners, as test_standby_sleepers.py."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[0]))
from test_shift_policy import FREED
from test_standby_sleepers import ON, A, B, fake_planner, inst
from test_standby_time_share import AWAKE, SHARE, shared

from flexpipe.cluster import Cluster
from flexpipe.policies.planner import ModelDemand, Plan, PlannedInstance
from flexpipe.policies.shift import ShiftParams
from flexpipe.policies.shift.standby_sleepers import (
    StandbyParams,
    arrived,
    peak_rates,
    recent_rates,
    standby_wanted,
)
from flexpipe.policies.shift.time_share import (
    standby_time_shared,
)


def test_arrived_counts_what_is_in_flight_and_waiting_as_well() -> None:
    pool = [
        {"model": "a", "state": "active", "num_in_flight": 40},
        {"model": "a", "state": "draining", "num_in_flight": 2},
        {"model": "b", "state": "active", "num_in_flight": 0},
    ]
    got = arrived({"a": 100.0, "c": 3.0}, pool, {"a": 8, "d": 1})
    assert got == {"a": 150.0, "b": 0.0, "c": 3.0, "d": 1.0}


def test_a_burst_the_engines_fall_behind_on_reads_at_its_arrival_rate() -> None:
    """Two ticks 10 s apart: 50 requests finished (5 req/s, what one engine managed), but
    120 arrived (12 req/s, the burst): the finished count would size the set at 5."""
    before = arrived({"a": 0.0}, [], {})
    after = arrived({"a": 50.0}, [{"model": "a", "state": "active", "num_in_flight": 64}], {"a": 6})
    finished = recent_rates([(0.0, {"a": 0.0}), (10.0, {"a": 50.0})])
    assert finished == {"a": 5.0}
    assert recent_rates([(0.0, before), (10.0, after)]) == {"a": 12.0}
    assert peak_rates({"a": 5.0}, recent_rates([(0.0, before), (10.0, after)])) == {"a": 12.0}


def pipeline_first(cluster: Cluster, demands: tuple[ModelDemand, ...], now_s: float) -> Plan:
    """A two-stage pipeline over the first two free GPUs first, then one per GPU after."""
    (d,) = demands
    free = [g for g in cluster.gpu_ids if cluster.gpu(g).free_bytes > 0]
    if len(free) < 2:
        return fake_planner(cluster, demands, now_s)
    pipe = replace(
        inst(d.name, free[0]), stages=((free[0],), (free[1],)), layers_per_stage=(16, 16)
    )
    return Plan((pipe, *fake_planner(cluster, demands, now_s).instances[2:]), ())


def test_single_stage_takes_no_pipeline_as_a_standby() -> None:
    """a wants 8 req/s (two engines of 5), b 4 (one); the planner offers a pipeline over
    the first two free GPUs first. Without `single_stage`: a's pipeline on gpu0+gpu1, b's
    on gpu2+gpu3, nothing left for a's second. With it: the single-GPU instances only, a on
    gpu2, b on gpu3, and a's second finds no single GPU (gpu0+gpu1 offer a pipeline)."""
    pipes = [(i.model, i.gpu_ids) for i in _wanted_instances(ON)]
    assert pipes == [("a", ("gpu0", "gpu1")), ("b", ("gpu2", "gpu3"))]
    got = _wanted_instances(replace(ON, single_stage=True))
    assert [(i.model, i.gpu_ids) for i in got] == [("a", ("gpu2",)), ("b", ("gpu3",))]


def _wanted_instances(params: StandbyParams) -> list[PlannedInstance]:
    return standby_wanted(FREED, (A, B), (), (), {}, {}, pipeline_first, 0.0, params)


def test_the_shift_config_reads_the_new_keys_off_by_default() -> None:
    p = ShiftParams.from_mapping(
        {
            "standby": {
                "enabled": True,
                "slo_gears": True,
                "arrival_peaks": True,
                "single_stage": True,
            }
        }
    )
    assert p.standby == StandbyParams(
        enabled=True, slo_gears=True, arrival_peaks=True, single_stage=True
    )
    d = StandbyParams()
    assert (d.slo_gears, d.arrival_peaks, d.single_stage) == (False, False, False)


def test_max_models_per_gpu_spreads_the_guests() -> None:
    """a wants two more engines beside the others' (test_standby_time_share.py's AWAKE: x on
    gpu1 and gpu2, y on gpu3). With at most 1 other model a GPU every GPU is full (each
    holds one); with 2, gpu1 and gpu2 as without the limit."""

    assert shared(12.0, AWAKE) == [("a", "gpu1"), ("a", "gpu2")]
    assert shared(12.0, AWAKE, params=replace(SHARE, max_models_per_gpu=1)) == []
    two = replace(SHARE, max_models_per_gpu=2)
    assert shared(12.0, AWAKE, params=two) == [("a", "gpu1"), ("a", "gpu2")]


def test_quiet_hosts_first_puts_a_guest_beside_the_model_that_bursts_least() -> None:
    """a wants one more engine (8 req/s, one of 5 on gpu0); x runs on gpu1, y on gpu2, both
    with room beside them. The planner takes gpu1 first; with `quiet_hosts_first`, gpu2:
    y's peak is 10 x its mean (busy a tenth of the time), x's 2 x. With no peak known the
    two are alike (duty 1), by name: x first."""
    from test_shift_policy import demand
    from test_standby_time_share import footprint

    awake = (inst("a", "gpu0"), inst("x", "gpu1"), inst("y", "gpu2"))
    demands = (demand(8.0, "a"), demand(10.0, "x"), demand(1.0, "y"))  # (means)

    def guests(params: StandbyParams, peaks: dict[str, float]) -> list[tuple[str, tuple[str, ...]]]:
        got = standby_time_shared(
            FREED, demands, awake, (), {}, peaks, fake_planner, 0.0, params, footprint, {"x", "y"}
        )
        return [(i.model, i.gpu_ids) for i in got]

    peaks = {"x": 20.0, "y": 10.0}
    quiet = replace(SHARE, quiet_hosts_first=True)
    assert guests(SHARE, peaks) == [("a", ("gpu1",))]
    assert guests(quiet, peaks) == [("a", ("gpu2",))]
    assert guests(quiet, {}) == [("a", ("gpu1",))]
