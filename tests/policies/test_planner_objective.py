"""The planner's objective (priority-weighted goodput, minimums) and the running plan as its
input (stickiness, the kept / new / stopped diff), on the seed's fragmented 4-GPU cluster."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexpipe.cluster import Cluster, load_cluster
from flexpipe.perf import Efficiency
from flexpipe.perf.calibration import NO_CALIBRATION
from flexpipe.policies.planner import (
    ModelDemand,
    ModelsFileError,
    Plan,
    PlannerConfig,
    Slo,
    parse_models,
    plan,
)
from flexpipe.policies.planner.exact import all_candidates, solve_exact

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"
MODELS = ROOT / "examples" / "models" / "llama-7b.yaml"


GENERIC = Efficiency(calibration=NO_CALIBRATION)


def plan_generic(*args: Any, **kwargs: Any) -> Plan:
    """The planner on the generic factors: the figures below are theirs (with the A100
    calibration the seed's TP2 gear is TPOT-bound at batch 48 at a 50 ms SLO)."""
    return plan(*args, efficiency=GENERIC, **kwargs)


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return load_cluster(CLUSTER)


@pytest.fixture(scope="module")
def seed_demand() -> ModelDemand:
    (d,) = parse_models(yaml.safe_load(MODELS.read_text()), str(MODELS))
    return d


def model(name: str, spec: str, rate: float, priority: float = 1, minimum: int = 0) -> ModelDemand:
    return ModelDemand(
        name,
        spec,
        rate,
        2048,
        256,
        Slo(2.0, 0.05),
        ("bf16", "fp8"),
        priority=priority,
        min_instances=minimum,
    )


def placed(p: Plan) -> dict[str, tuple[str, ...]]:
    """instance name -> its GPUs, sorted."""
    return {i.name: tuple(sorted(i.gpu_ids)) for i in p.instances}


def statuses(p: Plan) -> dict[str, str]:
    return {c.name: c.status for c in p.changes}


def optimum(cl: Cluster, demands: list[ModelDemand]) -> float:
    return solve_exact(all_candidates(cl, demands), demands).objective


# -- the objective -----------------------------------------------------------------------------


def test_objective_is_priority_weighted_slo_meeting_requests(cluster: Cluster) -> None:
    """Both models want more than the 4 GPUs give. Priority 2 counts each chat request twice:
    chat takes the A100 pair; flip the priorities and the 13B takes it. Either way the plan is
    the exact ILP's optimum of the same objective."""
    chat_first = [model("chat", "llama-2-7b", 20, priority=2), model("batch", "llama-2-13b", 20)]
    p = plan(cluster, chat_first)
    by_gpus = {tuple(sorted(i.gpu_ids)): i.model for i in p.instances}
    assert by_gpus == {("gpu1", "gpu2"): "chat", ("gpu3",): "chat", ("gpu0",): "chat"}
    chat = p.models[0]
    assert chat.weighted_goodput_per_s == pytest.approx(2 * chat.served_requests_per_s)
    assert p.weighted_goodput_per_s == pytest.approx(optimum(cluster, chat_first), rel=1e-6)

    batch_first = [replace(chat_first[0], priority=1), replace(chat_first[1], priority=2)]
    q = plan(cluster, batch_first)
    by_gpus = {tuple(sorted(i.gpu_ids)): i.model for i in q.instances}
    assert by_gpus[("gpu1", "gpu2")] == "batch"
    assert q.weighted_goodput_per_s == pytest.approx(optimum(cluster, batch_first), rel=1e-6)
    # The objective in numbers: sum over models of priority x min(rate, capacity) in req/s.
    assert q.weighted_goodput_per_s == pytest.approx(
        sum(m.priority * min(m.demand_requests_per_s, m.capacity_requests_per_s) for m in q.models)
    )


def test_priority_2_keeps_its_minimum_and_gets_the_gpus_first(cluster: Cluster) -> None:
    """Short cluster, both models with a minimum of one: the priority-2 model's minimum is
    placed first and takes the best GPUs (the A100 pair); the priority-1 model keeps its
    minimum on what is left."""
    demands = [model("chat", "llama-2-7b", 20, 2, 1), model("batch", "llama-2-13b", 20, 1, 1)]
    p = plan(cluster, demands)
    by_gpus = {tuple(sorted(i.gpu_ids)): i.model for i in p.instances}
    assert by_gpus == {("gpu1", "gpu2"): "chat", ("gpu3",): "batch", ("gpu0",): "chat"}
    assert [m.num_instances for m in p.models] == [2, 1]
    assert p.weighted_goodput_per_s == pytest.approx(optimum(cluster, demands), rel=1e-6)


def test_when_minimums_collide_the_higher_priority_keeps_its_own(cluster: Cluster) -> None:
    """Four usable GPUs, minimums of 3 and 3: the priority-2 model gets its three, the other
    gets what is left and the plan says its minimum was not met."""
    demands = [model("batch", "llama-2-7b", 20, 1, 3), model("chat", "llama-2-7b", 20, 2, 3)]
    p = plan(cluster, demands)
    counts = {m.name: m.num_instances for m in p.models}
    assert counts == {"batch": 1, "chat": 3}
    assert any(n.startswith("batch: minimum of 3 instance(s) not met, 1 fit") for n in p.notes)
    assert [m.below_minimum for m in p.models] == [True, False]


def test_min_instances_is_honoured_against_cheaper_requests(cluster: Cluster) -> None:
    """Without a minimum the 13B gets nothing (the 7B's requests are cheaper); with a minimum
    of two it gets two instances, and the plan is the ILP's optimum under that minimum."""
    free = [model("chat", "llama-2-7b", 20), model("batch", "llama-2-13b", 20)]
    assert plan(cluster, free).models[1].num_instances == 0
    held = [free[0], replace(free[1], min_instances=2)]
    p = plan(cluster, held)
    assert p.models[1].num_instances == 2
    assert p.weighted_goodput_per_s == pytest.approx(optimum(cluster, held), rel=1e-6)


def test_a_minimum_holds_with_no_demand(cluster: Cluster) -> None:
    """An idle model with a minimum keeps one warm instance, on the fewest GPUs."""
    p = plan(cluster, [model("idle", "llama-2-7b", 0, minimum=1)])
    (inst,) = p.instances
    assert inst.num_gpus == 1 and inst.assigned_requests_per_s == 0
    assert plan(cluster, [model("idle", "llama-2-7b", 0)]).instances == ()


def test_models_file_priority_and_minimum() -> None:
    base = {
        "name": "chat",
        "model": "llama-2-7b",
        "demand": {"request_rate_per_s": 1, "input_tokens": 8, "output_tokens": 8},
        "slo": {"ttft_p99_ms": 100, "tpot_p99_ms": 20},
    }
    (d,) = parse_models({"models": [{**base, "priority": 3, "min_instances": 2}]})
    assert (d.priority, d.min_instances) == (3.0, 2)
    (d,) = parse_models({"models": [base]})
    assert (d.priority, d.min_instances) == (1.0, 0)
    bad = {"models": [{**base, "priority": 0, "min_instances": 1.5}]}
    with pytest.raises(ModelsFileError) as info:
        parse_models(bad, "m.yaml")
    assert info.value.errors == [
        "m.yaml: models[0].priority: expected a positive number, got 0",
        "m.yaml: models[0].min_instances: expected an integer >= 0, got 1.5",
    ]


# -- the running plan as an input -----------------------------------------------------------


def test_unchanged_cluster_returns_the_running_plan_exactly(
    cluster: Cluster, seed_demand: ModelDemand
) -> None:
    running = plan(cluster, [seed_demand])
    assert set(statuses(running).values()) == {"new"}
    again = plan(cluster, [seed_demand], running=running)
    assert again.instances == running.instances
    assert statuses(again) == {i.name: "kept" for i in running.instances}
    assert again.stopped == () and again.new == ()
    assert again.weighted_goodput_per_s == running.weighted_goodput_per_s
    # The shift policy holds the running instances, not a Plan: the same answer.
    assert plan(cluster, [seed_demand], running=running.instances).instances == running.instances


def test_tenant_leaving_gpu1_replaces_only_the_tp2_instance(
    cluster: Cluster, seed_demand: ModelDemand
) -> None:
    """The seed example: the other tenant leaves gpu1. The TP2 instance on gpu1+gpu2 is
    replaced by one with the larger KV cache and batch; the lone instances are kept as they
    run, under their names; the new instance's name is not the stopped one's."""
    running = plan_generic(cluster, [seed_demand])
    assert placed(running) == {
        "llama-7b-0": ("gpu1", "gpu2"),
        "llama-7b-1": ("gpu3",),
        "llama-7b-2": ("gpu0",),
    }
    after = plan_generic(cluster.with_used("gpu1", 0), [seed_demand], running=running)
    assert statuses(after) == {
        "llama-7b-1": "kept",
        "llama-7b-2": "kept",
        "llama-7b-3": "new",
        "llama-7b-0": "stopped",
    }
    (old,) = after.stopped
    (new,) = after.new
    assert sorted(new.gpu_ids) == ["gpu1", "gpu2"] and new.gear.tp == 2
    assert new.kv_capacity_tokens > 1.9 * old.kv_capacity_tokens
    assert (old.gear.max_num_seqs, new.gear.max_num_seqs) == (48, 64)
    assert set(after.kept) == {i for i in running.instances if i.name != "llama-7b-0"}
    reason = next(c.reason for c in after.changes if c.name == "llama-7b-0")
    assert reason.startswith("replaced: +0.155 weighted req/s > margin 0.02 x 4.19 served")
    assert after.weighted_goodput_per_s > running.weighted_goodput_per_s


def test_the_margin_keeps_a_small_gain_from_moving_anything(
    cluster: Cluster, seed_demand: ModelDemand
) -> None:
    """The same gain (3.7% of what the TP2 instance serves) under a 5% margin: all kept."""
    running = plan(cluster, [seed_demand])
    config = PlannerConfig(replace_margin=0.05)
    after = plan(cluster.with_used("gpu1", 0), [seed_demand], running=running, config=config)
    assert statuses(after) == {i.name: "kept" for i in running.instances}
    assert [i.name for i in after.instances] == [i.name for i in running.instances]
    assert after.instances[0].gear == running.instances[0].gear


def test_a_running_instance_that_no_longer_fits_is_stopped(
    cluster: Cluster, seed_demand: ModelDemand
) -> None:
    """The tenant comes back for 70 GiB of gpu1: the TP2 instance's memory plan fails there,
    so it is stopped with why; the rest is kept and gpu2 is re-planned."""
    running = plan(cluster, [seed_demand])
    squeezed = cluster.with_used("gpu1", 70 * 2**30)
    after = plan(squeezed, [seed_demand], running=running)
    st = statuses(after)
    assert st["llama-7b-0"] == "stopped" and st["llama-7b-1"] == st["llama-7b-2"] == "kept"
    reason = next(c.reason for c in after.changes if c.name == "llama-7b-0")
    assert reason.startswith("no longer fits: ")
    assert all(i.name != "llama-7b-0" for i in after.instances)
    assert "gpu2" in {g for i in after.new for g in i.gpu_ids}


def test_a_model_no_longer_listed_is_stopped_and_its_gpus_reused(
    cluster: Cluster, seed_demand: ModelDemand
) -> None:
    running = plan(cluster, [seed_demand])
    other = replace(seed_demand, name="other")
    after = plan(cluster, [other], running=running)
    assert {c.status for c in after.changes if c.name.startswith("llama-7b")} == {"stopped"}
    assert {c.reason for c in after.changes if c.status == "stopped"} == {
        "llama-7b is no longer among the models"
    }
    assert placed(after) == {k.replace("llama-7b", "other"): v for k, v in placed(running).items()}


def test_a_gpu_reclaimed_soon_stops_its_instance_and_the_diff_is_json(
    cluster: Cluster, seed_demand: ModelDemand
) -> None:
    """gpu3 is free only 500 s more (< min_lease_s): its instance is stopped, the others
    kept; `to_dict` carries the diff for `flexpipe plan --json` and the controller."""
    running = plan(cluster, [seed_demand])
    leased = cluster.with_gpu("gpu3", free_until_s=600.0)
    after = plan(leased, [seed_demand], running=running, now_s=100.0)
    doc = after.to_dict()
    assert doc["changes"] == [
        {"name": "llama-7b-0", "status": "kept", "reason": doc["changes"][0]["reason"]},
        {"name": "llama-7b-2", "status": "kept", "reason": doc["changes"][1]["reason"]},
        {"name": "llama-7b-1", "status": "stopped", "reason": "gpu3 no longer usable"},
    ]
    assert doc["stopped"] == ["llama-7b-1"]
    assert after.status_of("llama-7b-1") == "stopped"


def test_more_demand_fills_free_gpus_and_regroups_where_it_pays_less_drops_nothing(
    cluster: Cluster, seed_demand: ModelDemand
) -> None:
    """At 0.5 req/s one instance on gpu2 serves it all. At 8 req/s the re-plan starts
    instances on the GPUs it left free (no margin: nothing runs there), and replaces the gpu2
    instance by the tp=2 pair, since the pair serves 0.436 req/s more than gpu2 and gpu1 apart
    (above 2% of the 1.98 req/s the gpu2 instance serves). Back at 0.5 req/s nothing is
    stopped: the planner never drops a running instance only to save GPUs (the shift policy's
    `shrink` does that)."""
    low = replace(seed_demand, request_rate_per_s=0.5)
    small = plan_generic(cluster, [low])
    assert placed(small) == {"llama-7b-0": ("gpu2",)}
    grown = plan_generic(cluster, [seed_demand], running=small)
    assert placed(grown) == {
        "llama-7b-1": ("gpu3",),
        "llama-7b-2": ("gpu0",),
        "llama-7b-3": ("gpu1", "gpu2"),
    }
    assert [(c.name, c.status, c.reason) for c in grown.changes] == [
        ("llama-7b-1", "new", "on GPUs the running plan left"),
        ("llama-7b-2", "new", "on GPUs the running plan left"),
        (
            "llama-7b-3",
            "new",
            "replaces running instances: +0.436 weighted req/s > margin 0.02 x 1.98 served",
        ),
        ("llama-7b-0", "stopped", "replaced: +0.436 weighted req/s > margin 0.02 x 1.98 served"),
    ]
    shrunk = plan_generic(cluster, [low], running=grown)
    assert statuses(shrunk) == {i.name: "kept" for i in grown.instances}
