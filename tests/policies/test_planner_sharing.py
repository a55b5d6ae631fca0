"""Memory sharing in the planner (`share_gpus`, policies/planner/sharing.py) and the shift
policy's `pack` candidate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexpipe.cluster import parse_cluster_yaml, placement_on
from flexpipe.control.core.planner import ControllerPlanner
from flexpipe.hardware import gpu_spec
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import memory_plan
from flexpipe.perf.colocation import busy_share, fits_together, shared_capacity_per_s, stretch
from flexpipe.perf.efficiency import DEFAULT_EFFICIENCY
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import ModelDemand, PlannerConfig, Slo, num_gpus_held, plan
from flexpipe.policies.shift.candidates import Candidate, packed

CLUSTER = parse_cluster_yaml(
    """
name: two-a100
nodes:
  - name: n0
    gpus: [{id: g0, type: A100-80G-SXM}, {id: g1, type: A100-80G-SXM}]
    links: [{gpus: [g0, g1], link: nvswitch-a100}]
"""
)
SLO = Slo(2.5, 0.08)


def demands(rate_per_s: float) -> list[ModelDemand]:
    return [
        ModelDemand("chat-8b", "llama-3.1-8b", rate_per_s, 1024, 200, SLO),
        ModelDemand("summarise-7b", "qwen2.5-7b", rate_per_s, 1024, 200, SLO),
    ]


def test_off_by_default_one_gpu_each() -> None:
    p = plan(CLUSTER, demands(0.3))
    assert [i.gpu_ids for i in p.instances] == [("g0",), ("g1",)]
    assert [i.gpu_memory_fraction for i in p.instances] == [None, None]
    assert p.num_gpus == 2


def test_two_small_models_share_one_gpu() -> None:
    p = plan(CLUSTER, demands(0.3), config=PlannerConfig(share_gpus=True))
    a, b = p.instances
    assert a.gpu_ids == b.gpu_ids == ("g0",)
    assert p.num_gpus == 1 == num_gpus_held(p.instances)
    assert [u.gpu_id for u in p.unused] == ["g1"]
    assert p.unused[0].reason == "freed: summarise-7b-0 shares g0"
    assert (a.gpu_memory_fraction, b.gpu_memory_fraction) == FRACTIONS
    assert (a.gear.max_num_seqs, b.gear.max_num_seqs) == BATCHES
    assert a.gpu_memory_fraction + b.gpu_memory_fraction <= 0.9
    # every request still served within the SLOs with both busy at once
    assert p.goodput_requests_per_s == pytest.approx(0.6)
    for inst, d in zip(p.instances, demands(0.3), strict=True):
        assert inst.estimate.tpot_s * stretch(2) <= d.slo.tpot_p99_s
        assert inst.estimate.ttft_s * stretch(2) <= d.slo.ttft_p99_s
    # each one's capacity is what the other's expected load leaves it
    busy = [busy_share(0.3, i.estimate.requests_per_s) for i in p.instances]
    for k, inst in enumerate(p.instances):
        alone = inst.estimate.requests_per_s * PlannerConfig().target_utilization
        expect = shared_capacity_per_s(alone, inst.estimate.requests_per_s, busy[1 - k], 2)
        assert inst.capacity_requests_per_s == pytest.approx(expect)
        assert inst.capacity_requests_per_s >= 0.3
    # the fraction holds the weights, the reserve and KV for the batch's full contexts
    for inst in p.instances:
        spec = load_model_spec(inst.model_id)
        placement = placement_on(CLUSTER, inst.stages, spec.num_layers)
        mine = memory_plan(spec, inst.gear, placement, DEFAULT_EFFICIENCY, inst.gpu_memory_fraction)
        assert mine.feasible
        assert mine.max_batch(1224) >= inst.gear.max_num_seqs
        assert mine.per_gpu[0].budget_bytes == pytest.approx(
            gpu_spec("A100-80G-SXM").memory_bytes * inst.gpu_memory_fraction
        )


def test_no_sharing_when_the_loads_do_not_fit_one_gpu() -> None:
    p = plan(CLUSTER, demands(4.0), config=PlannerConfig(share_gpus=True))
    assert [i.gpu_ids for i in p.instances] == [("g0",), ("g1",)]
    assert [i.gpu_memory_fraction for i in p.instances] == [None, None]
    busy = [busy_share(i.assigned_requests_per_s, i.estimate.requests_per_s) for i in p.instances]
    assert not fits_together(busy, PlannerConfig().target_utilization)


FRACTIONS = (0.3, 0.26)
BATCHES = (48, 64)


def test_a_model_left_without_a_gpu_joins_one_that_has_room() -> None:
    one = parse_cluster_yaml(
        "name: one\nnodes:\n  - name: n0\n    gpus: [{id: g0, type: A100-80G-SXM}]\n"
    )
    alone = plan(one, demands(0.3))
    assert [i.model for i in alone.instances] == ["chat-8b"]  # one GPU: one model
    p = plan(one, demands(0.3), config=PlannerConfig(share_gpus=True))
    assert [(i.name, i.gpu_ids, i.gpu_memory_fraction) for i in p.instances] == [
        ("chat-8b-0", ("g0",), 0.3),
        ("summarise-7b-0", ("g0",), 0.26),
    ]
    assert p.status_of("summarise-7b-0") == "new"
    assert p.goodput_requests_per_s == pytest.approx(0.6)
    assert [(m.name, m.num_instances, m.covered) for m in p.models] == [
        ("chat-8b", 1, True),
        ("summarise-7b", 1, True),
    ]
    assert p.num_gpus == 1
    assert p.notes[-1] == "share_gpus: 0 instance(s) moved and 1 added onto 1 shared GPU(s)"


def test_a_shared_gpu_running_is_kept_whole_while_its_group_fits() -> None:
    """Re-planned with the shared plan running (a restarted controller adopting its engines):
    both instances kept on g0 at their fractions and batches, each at the capacity the
    other's load leaves it, the GPU counted once; when their load no longer fits one GPU, the
    second is stopped and planned on a GPU of its own (sticky.keep_running)."""
    config = PlannerConfig(share_gpus=True)
    running = plan(CLUSTER, demands(0.3), config=config)
    again = plan(CLUSTER, demands(0.3), running=running.instances, config=config)
    assert [(c.name, c.status) for c in again.changes] == [
        ("chat-8b-0", "kept"),
        ("summarise-7b-0", "kept"),
    ]
    assert [(i.gpu_ids, i.gpu_memory_fraction, i.gear.max_num_seqs) for i in again.instances] == [
        (("g0",), 0.3, 48),
        (("g0",), 0.26, 64),
    ]
    assert again.num_gpus == 1 == num_gpus_held(again.instances)
    for kept, planned in zip(again.instances, running.instances, strict=True):
        assert kept.capacity_requests_per_s == pytest.approx(planned.capacity_requests_per_s)
    busier = plan(CLUSTER, demands(4.0), running=running.instances, config=config)
    assert [(c.name, c.status, c.reason) for c in busier.changes][1:] == [
        ("summarise-7b-1", "new", "on GPUs the running plan left"),
        (
            "summarise-7b-0",
            "stopped",
            "no longer fits: the load of the 2 engines on g0 is more than its time",
        ),
    ]
    assert [(i.gpu_ids, i.gpu_memory_fraction) for i in busier.instances] == [
        (("g0",), 0.3),
        (("g1",), None),
    ]


def test_a_model_joins_a_gpu_that_a_running_shared_instance_holds_with_room() -> None:
    """chat-8b-0 runs on g0 at 0.3 of its memory (its partner gone), the only GPU: the model
    left without one joins it, beside it as it runs (its batch and fraction unchanged), both
    in the planner's pass over a running plan and in the shift policy's pack candidate."""
    one = parse_cluster_yaml(
        "name: one\nnodes:\n  - name: n0\n    gpus: [{id: g0, type: A100-80G-SXM}]\n"
    )
    config = PlannerConfig(share_gpus=True)
    resident = plan(one, demands(0.3), config=config).instances[:1]
    assert [(i.name, i.gpu_memory_fraction, i.gear.max_num_seqs) for i in resident] == [
        ("chat-8b-0", 0.3, 48)
    ]
    expected = [("chat-8b-0", ("g0",), 0.3, 48), ("summarise-7b-0", ("g0",), 0.26, 64)]
    again = plan(one, demands(0.3), running=resident, config=config)
    assert [
        (i.name, i.gpu_ids, i.gpu_memory_fraction, i.gear.max_num_seqs) for i in again.instances
    ] == expected
    assert [(c.name, c.status) for c in again.changes] == [
        ("chat-8b-0", "kept"),
        ("summarise-7b-0", "new"),
    ]
    assert again.num_gpus == 1
    assert again.notes[-1] == "share_gpus: 0 instance(s) moved and 1 added onto 1 shared GPU(s)"
    packer = ControllerPlanner(GearLookup(), config=config)
    out = packer.pack(one, demands(0.3), resident, spare=())
    assert out is not None
    assert [
        (i.name, i.gpu_ids, i.gpu_memory_fraction, i.gear.max_num_seqs) for i in out
    ] == expected
    # the resident's capacity is what the newcomer's load leaves it
    busy = busy_share(0.3, out[1].estimate.requests_per_s)
    alone = resident[0].estimate.requests_per_s * config.target_utilization
    assert out[0].capacity_requests_per_s == pytest.approx(
        shared_capacity_per_s(alone, resident[0].estimate.requests_per_s, busy, 2)
    )
    assert ControllerPlanner(GearLookup()).pack(one, demands(0.3), resident, spare=()) is None


def test_a_third_model_joins_two_running_shared_instances_listed_apart() -> None:
    """Two instances share g0 and run; qa-7b's instance, on g1 and listed between them, joins
    them (at looser SLOs, three fit): the group is both residents, whatever the order, and
    they stay as they run."""
    config = PlannerConfig(share_gpus=True)
    chat, summarise = plan(CLUSTER, demands(0.3), config=config).instances
    loose = [replace(d, slo=Slo(2.5, 0.2)) for d in demands(0.3)]
    loose.append(ModelDemand("qa-7b", "qwen2.5-7b", 0.2, 1024, 200, Slo(2.5, 0.2)))
    (qa,) = plan(CLUSTER, loose[2:]).instances
    qa = replace(qa, stages=(("g1",),))
    out = ControllerPlanner(GearLookup(), config=config).pack(
        CLUSTER, loose, [chat, qa, summarise], spare=()
    )
    assert out is not None
    assert [(i.name, i.gpu_ids, i.gpu_memory_fraction, i.gear.max_num_seqs) for i in out] == [
        ("chat-8b-0", ("g0",), 0.3, 48),
        ("qa-7b-0", ("g0",), 0.28, 96),
        ("summarise-7b-0", ("g0",), 0.26, 64),
    ]
    assert num_gpus_held(out) == 1


def test_the_shift_policy_packs_a_running_plan_onto_a_free_gpu() -> None:
    """A down trigger's `pack` candidate: the running plan's small models moved onto a GPU
    nothing runs on (make-before-break), at the load asked now; None with the option off."""
    three = parse_cluster_yaml(
        """
name: three
nodes:
  - name: n0
    gpus: [{id: g0, type: A100-80G-SXM}, {id: g1, type: A100-80G-SXM},
           {id: g2, type: A100-80G-SXM}]
"""
    )
    running = plan(three, demands(2.0)).instances  # one GPU each: g0, g1
    assert [i.gpu_ids for i in running] == [("g0",), ("g1",)]
    base = Candidate("keep", running)
    off = ControllerPlanner(GearLookup())
    assert packed(three, base, demands(0.3), off, held=()) is None
    on = ControllerPlanner(GearLookup(), config=PlannerConfig(share_gpus=True))
    c = packed(three, base, demands(0.3), on, held=())
    assert c is not None and c.name == "pack keep"
    assert [(i.name, i.gpu_ids, i.gpu_memory_fraction) for i in c.instances] == [
        ("chat-8b-0", ("g2",), 0.3),
        ("summarise-7b-0", ("g2",), 0.26),
    ]
    assert num_gpus_held(c.instances) == 1
    # g2 held (a sleeper there): packed in place, on the first member's GPU
    c = packed(three, base, demands(0.3), on, held=("g2",))
    assert c is not None and {i.gpu_ids for i in c.instances} == {("g0",)}
    # at the load of two GPUs, nothing packs
    assert packed(three, base, demands(4.0), on, held=()) is None
