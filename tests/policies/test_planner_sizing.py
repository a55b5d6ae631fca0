"""The planner's `sizing`: an instance's capacity at throughput (the default) or at the SLO
(flexpipe.perf.slo_capacity, with the demand's burstiness). docs/planner.md "Sized at the SLO"."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexpipe.cluster import Cluster, placement_on
from flexpipe.cluster.generate import generate_cluster
from flexpipe.cluster.parse import parse_cluster
from flexpipe.model_spec import load_model_spec
from flexpipe.perf.gear_lookup import GearLookup, GearQuery
from flexpipe.perf.slo_capacity import SloShape, slo_rate_per_s
from flexpipe.policies.planner import ModelDemand, PlannerConfig, parse_models, plan
from flexpipe.policies.planner.demand import ModelsFileError
from flexpipe.policies.planner.memo import EvaluationMemo


def _demand(rate_per_s: float = 3.0, cv2: float | None = None) -> ModelDemand:
    demand: dict[str, float] = {
        "request_rate_per_s": rate_per_s,
        "input_tokens": 1024,
        "output_tokens": 256,
    }
    if cv2 is not None:
        demand["arrival_cv2"] = cv2
    entry = {
        "name": "chat",
        "model": "llama-2-7b",
        "demand": demand,
        "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60},
    }
    return parse_models({"models": [entry]}, "test")[0]


def _one_a100() -> Cluster:
    return parse_cluster(
        {"name": "one", "nodes": [{"name": "n0", "gpus": [{"id": "g0", "type": "A100-80G-SXM"}]}]}
    )


def test_the_default_is_throughput_and_sizing_is_checked() -> None:
    assert PlannerConfig().sizing == "throughput"
    with pytest.raises(ValueError, match="sizing must be throughput or slo"):
        PlannerConfig(sizing="fast")  # type: ignore[arg-type]


def test_a_models_file_may_declare_the_burstiness() -> None:
    assert _demand().arrival_cv2 == 1.0  # unknown: Poisson
    assert _demand(cv2=4).arrival_cv2 == 4.0
    with pytest.raises(ModelsFileError, match=r"demand.arrival_cv2: must be positive"):
        _demand(cv2=0)


def test_an_instance_is_sized_by_the_queue_at_the_slo() -> None:
    cluster = _one_a100()
    thr = plan(cluster, [_demand()], config=PlannerConfig()).instances[0]
    assert thr.capacity_requests_per_s == pytest.approx(thr.estimate.requests_per_s * 0.85)
    slo = plan(cluster, [_demand()], config=PlannerConfig(sizing="slo")).instances[0]
    # the capacity is the module's SLO rate of the instance's own figures
    spec = load_model_spec("llama-2-7b")
    placement = placement_on(cluster, slo.stages, spec.num_layers, slo.layers_per_stage)
    one = GearLookup().estimate(
        GearQuery.of(spec, replace(slo.gear, max_num_seqs=1), placement), _demand().workload
    )
    est = slo.estimate
    shape = SloShape(est.batch, est.requests_per_s, est.ttft_s, est.tpot_s, one.tpot_s, 256)
    assert slo.capacity_requests_per_s == slo_rate_per_s(shape, 2.0, 0.06, 1.0)
    assert (slo.gear.max_num_seqs, round(slo.capacity_requests_per_s, 3)) == (64, 3.991)
    assert slo.capacity_tokens_per_s == pytest.approx(slo.capacity_requests_per_s * 256)
    # burstier arrivals: less of the same instance
    bursty = plan(cluster, [_demand(cv2=4)], config=PlannerConfig(sizing="slo")).instances[0]
    assert round(bursty.capacity_requests_per_s, 3) == 3.219


def test_the_memo_keeps_evaluations_apart_by_burstiness_only_when_sized_at_the_slo() -> None:
    cluster = generate_cluster(1, 8, 0)
    for sizing, differ in (("slo", True), ("throughput", False)):
        memo, lookup = EvaluationMemo(), GearLookup()
        config = PlannerConfig(sizing=sizing)  # type: ignore[arg-type]
        calm = plan(cluster, [_demand(20.0)], lookup, config=config, memo=memo)
        bursty = plan(cluster, [_demand(20.0, cv2=9)], lookup, config=config, memo=memo)
        fresh = plan(cluster, [_demand(20.0, cv2=9)], config=config)
        assert bursty.instances == fresh.instances  # the memo changes nothing
        capacity = [sum(i.capacity_requests_per_s for i in p.instances) for p in (calm, bursty)]
        assert (capacity[0] != capacity[1]) is differ
