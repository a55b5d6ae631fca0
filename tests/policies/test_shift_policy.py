"""The shift policy alone, on a fake clock, with exact expectations (seed 000 §3;
docs/shift-policy.md).

Pure: every decision is a function of (snapshot, now, rng). The planner is the real one on
the seed's fragmented 4-GPU cluster, memoised so that the suite stays fast.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import flexpipe.policies.shift as shift_pkg
from flexpipe.cluster import Cluster, load_cluster
from flexpipe.perf import Efficiency
from flexpipe.perf.calibration import NO_CALIBRATION
from flexpipe.policies.planner import ModelDemand, Plan, PlannedInstance, Slo, plan
from flexpipe.policies.shift import (
    ModelState,
    PricingParams,
    Sample,
    ShiftDecision,
    ShiftParams,
    ShiftPolicy,
    ShiftRecord,
    ShiftSnapshot,
    Thresholds,
    TriggerParams,
    Zone,
    choose_migration,
    instance_key,
    link_between,
    perf_model_of,
    price,
)
from flexpipe.policies.shift.signals import pressure_of, zone_of
from flexpipe.policies.shift.standby_sleepers import StandbyParams

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml")
FREED = CLUSTER.with_used("gpu1", 0.0)  # the other tenant left gpu1 (seed 000 §4.1)


# The seed scenario's numbers are the generic model's: with the A100 calibration the TP2 gear
# is TPOT-bound at batch 48 at a 50 ms SLO, and a freed gpu1 gains nothing.
GENERIC = Efficiency(calibration=NO_CALIBRATION)


@functools.cache
def cached_planner(cluster: Cluster, demands: tuple[ModelDemand, ...], now_s: float) -> Plan:
    return plan(cluster, demands, now_s=now_s, efficiency=GENERIC)


def policy(**changes: object) -> ShiftPolicy:
    params = replace(ShiftParams(), **changes)  # type: ignore[arg-type]
    return ShiftPolicy(params, planner=cached_planner, efficiency=GENERIC)


def demand(rate: float = 8.0, name: str = "llama-7b", model: str = "llama-2-7b") -> ModelDemand:
    return ModelDemand(name, model, rate, 2048, 256, Slo(2.0, 0.05), ("bf16", "fp8"))


def running_for(cluster: Cluster, *demands: ModelDemand) -> tuple[PlannedInstance, ...]:
    return cached_planner(cluster, demands, 0.0).instances


# Queue 0.8 and latency 0.95 of the SLO: the up zone. Queue 0.1, latency 0.5: hold.
def up(t: float) -> Sample:
    return Sample(t, 80, 100, 1.9, 0.045, 0.95)


def steady(t: float) -> Sample:
    return Sample(t, 10, 100, 1.0, 0.025, 0.6)


def idle(t: float) -> Sample:
    return Sample(t, 0, 100, None, None, 0.0)


def snap(
    running: tuple[PlannedInstance, ...],
    samples: list[Sample],
    *,
    cluster: Cluster = CLUSTER,
    rate: float = 8.0,
    history: tuple[ShiftRecord, ...] = (),
    min_instances: int = 0,
    resources_changed_s: float | None = None,
) -> ShiftSnapshot:
    model = ModelState(demand(rate), tuple(samples), min_instances=min_instances)
    return ShiftSnapshot.of(cluster, running, [model], history, resources_changed_s)


def decide(p: ShiftPolicy, s: ShiftSnapshot, now_s: float) -> ShiftDecision:
    return p.decide(s, now_s, random.Random(7))


# -- zones --------------------------------------------------------------------------------------


def test_zone_boundaries_follow_the_seed_strictly() -> None:
    t = Thresholds()
    assert zone_of(pressure_of(up(0), 2.0, 0.05), t) is Zone.UP
    assert zone_of(pressure_of(steady(0), 2.0, 0.05), t) is Zone.HOLD
    assert zone_of(pressure_of(idle(0), 2.0, 0.05), t) is Zone.DOWN
    # Exactly at the boundaries: not in the zone (the seed's `>` and `<`).
    at_up = Sample(0, 70, 100, 1.6, None, 0.9)  # queue 0.7, latency 0.8
    assert pressure_of(at_up, 2.0, 0.05).latency == pytest.approx(0.8)
    assert zone_of(pressure_of(at_up, 2.0, 0.05), t) is Zone.HOLD
    at_down = Sample(0, 0, 100, 1.0, None, 0.3)  # latency 0.5
    assert zone_of(pressure_of(at_down, 2.0, 0.05), t) is Zone.HOLD
    # The worse of TTFT and TPOT counts.
    tpot_bound = Sample(0, 90, 100, 0.2, 0.049, 0.9)
    assert pressure_of(tpot_bound, 2.0, 0.05).latency == pytest.approx(0.98)


# -- 5 samples, flapping, window, cooldown -------------------------------------------------------


def test_up_shift_needs_five_samples_in_a_row() -> None:
    running = running_for(CLUSTER, demand(1.5))  # planned for 1.5 req/s: one GPU
    assert [i.gpu_ids for i in running] == [("gpu2",)]
    p = policy()
    four = [up(t) for t in (10, 20, 30, 40)]
    held = decide(p, snap(running, four), 40)
    assert held.action == "hold" and held.trigger == "none"
    assert held.reason == "no trigger (llama-7b up x4; 5 in a row needed)"
    assert held.signals[0].run == 4 and held.signals[0].fired is Zone.HOLD

    shifted = decide(p, snap(running, [*four, up(50)]), 50)
    assert shifted.action == "shift" and shifted.trigger == "up"
    assert shifted.reason.startswith("llama-7b in the up zone 5 samples in a row; replan:")
    assert shifted.target is not None and shifted.price is not None
    # A spike to 8 req/s priced at 1.5x: every usable GPU, the NVLink pair as one TP2.
    gpus = sorted(tuple(sorted(i.gpu_ids)) for i in shifted.target)
    assert gpus == [("gpu0",), ("gpu1", "gpu2"), ("gpu3",)]
    assert shifted.price.num_gpus_running == 1 and shifted.price.num_gpus_target == 4
    assert shifted.price.goodput_target_per_s > shifted.price.goodput_running_per_s
    assert shifted.price.score > 0
    # gpu2's instance is replaced in place: it drains, then the TP2 cold-starts.
    assert shifted.price.gap_cost > 0
    assert [a.name for a in shifted.alternatives] == ["keep"]


def test_flapping_signal_never_shifts() -> None:
    running = running_for(CLUSTER, demand(1.5))
    p = policy()
    samples: list[Sample] = []
    actions = []
    for k in range(60):  # ten minutes of 10 s samples: up, hold, up, hold, ...
        t = 10.0 * (k + 1)
        samples.append(up(t) if k % 2 == 0 else steady(t))
        actions.append(decide(p, snap(running, samples), t).action)
    assert set(actions) == {"hold"}
    # Four in the up zone, one blip, four again: still no shift.
    blip = [up(10), up(20), up(30), up(40), steady(50), up(60), up(70), up(80), up(90)]
    assert decide(p, snap(running, blip), 90).action == "hold"
    # Swinging between the up and the down zone: neither fires.
    swing = [up(t) if k % 2 else idle(t) for k, t in enumerate(range(10, 610, 10))]
    assert {
        decide(p, snap(running, swing[: k + 1]), s.at_s).action for k, s in enumerate(swing)
    } == {"hold"}


def test_stale_samples_do_not_count() -> None:
    running = running_for(CLUSTER, demand(1.5))
    p = policy()
    five = [up(t) for t in (0, 15, 30, 45, 60)]
    assert decide(p, snap(running, five), 60).action == "shift"
    # 61 s later the first sample has left the 60 s window.
    late = decide(p, snap(running, five), 61)
    assert late.action == "hold" and late.signals[0].num_samples == 4


def test_cooldown_after_a_shift_and_samples_from_before_it_ignored() -> None:
    running = running_for(CLUSTER, demand(1.5))
    p = policy()
    done = (ShiftRecord(started_s=50.0, finished_s=100.0, succeeded=True),)
    # Five up samples, all taken before the last shift ended: they describe the old plan.
    before = [up(t) for t in (60, 70, 80, 90, 100)]
    assert decide(p, snap(running, before, history=done), 110).signals[0].run == 1
    after = [up(t) for t in (230, 240, 250, 260, 270)]
    cooling = decide(p, snap(running, after, history=done), 270)
    assert cooling.action == "hold"
    assert cooling.reason == "cooldown after the last shift: 10 s left"
    assert decide(p, snap(running, [*after, up(280)], history=done), 280).action == "shift"
    # A shift still in progress holds everything.
    busy = (ShiftRecord(started_s=250.0),)
    assert decide(p, snap(running, after, history=busy), 270).reason == "a shift is in progress"


def test_no_oscillation_between_up_and_down() -> None:
    """After an up-shift, load falls: the down-shift waits for the cooldown and 5 samples."""
    running = running_for(CLUSTER, demand(1.5))
    p = policy()
    first = decide(p, snap(running, [up(t) for t in (10, 20, 30, 40, 50)]), 50)
    assert first.action == "shift" and first.target is not None
    record = first.started(50.0)
    assert record.target_keys == first.price.added  # type: ignore[union-attr]
    history = (replace(record, finished_s=120.0, succeeded=True),)
    decisions = []
    samples: list[Sample] = []
    for t in range(130, 310, 10):
        samples.append(idle(float(t)))
        d = decide(p, snap(first.target, samples, rate=0.0, history=history), float(t))
        decisions.append((t, d.action))
    shifts = [t for t, a in decisions if a == "shift"]
    assert shifts == [300]  # cooldown ends at 300 (120 + 180); 5 idle samples since long before


# -- blacklist ------------------------------------------------------------------------------------


def test_target_failing_twice_in_ten_minutes_is_blacklisted_then_expires() -> None:
    running = running_for(CLUSTER, demand(1.5))
    p = policy()
    five = [up(t) for t in (2010, 2020, 2030, 2040, 2050)]
    target = decide(p, snap(running, five), 2050).target
    assert target is not None
    tp2 = next(instance_key(i) for i in target if i.num_gpus == 2)

    def failed(at_s: float) -> ShiftRecord:
        return ShiftRecord(at_s - 60, at_s, False, (tp2,))

    twice = (failed(1000.0), failed(1500.0))  # 500 s apart: blacklisted until 1500 + 900
    held = decide(p, snap(running, five, history=twice), 2050)
    assert held.action == "hold"
    replan = next(a for a in held.alternatives if a.name == "replan")
    assert replan.reason == f"blacklisted until 2400 s: {tp2}"
    later = [up(t) for t in (2360, 2370, 2380, 2390, 2400)]
    assert decide(p, snap(running, later, history=twice), 2400).action == "shift"
    # Two failures 700 s apart are not "twice in 10 minutes".
    apart = (failed(800.0), failed(1500.0))
    assert decide(p, snap(running, five, history=apart), 2050).action == "shift"
    # One failure alone does not blacklist either.
    assert decide(p, snap(running, five, history=(failed(1500.0),)), 2050).action == "shift"


def test_a_refused_shift_never_blacklists_its_target_a_failed_one_does() -> None:
    """The executor refusing a target before changing anything (an in-place order that would
    leave a model unserved) tried nothing: however often, it is no failure of the target's
    rehearsal. The same target failing (tried, missed, rolled back) twice is blacklisted."""
    running = running_for(CLUSTER, demand(1.5))
    p = policy()
    five = [up(t) for t in (2010, 2020, 2030, 2040, 2050)]
    target = decide(p, snap(running, five), 2050).target
    assert target is not None
    tp2 = next(instance_key(i) for i in target if i.num_gpus == 2)

    def refused(at_s: float) -> ShiftRecord:
        return ShiftRecord(at_s - 1, at_s, False, (tp2,), refused=True)

    def failed(at_s: float) -> ShiftRecord:
        return ShiftRecord(at_s - 60, at_s, False, (tp2,))

    assert refused(0).failed is False and failed(0).failed is True
    three = (refused(1000.0), refused(1200.0), refused(1500.0))
    again = decide(p, snap(running, five, history=three), 2050)
    assert again.action == "shift" and again.target == target
    # refusals do not add up with one real failure either
    mixed = (*three, failed(1500.0))
    assert decide(p, snap(running, five, history=mixed), 2050).target == target
    twice = (failed(1000.0), failed(1500.0))
    held = decide(p, snap(running, five, history=twice), 2050)
    assert held.action == "hold"
    replan = next(a for a in held.alternatives if a.name == "replan")
    assert replan.reason == f"blacklisted until 2400 s: {tp2}"
    # a refusal still starts the cooldown (the same target is not re-proposed every tick)
    cooling = decide(p, snap(running, five, history=(refused(2000.0),)), 2050)
    assert cooling.action == "hold" and cooling.reason.startswith("cooldown after the last shift")
    with pytest.raises(ValueError, match="refused shift"):
        ShiftRecord(0.0, 1.0, True, refused=True)


# -- down-shifts give GPUs back ------------------------------------------------------------------


def test_idle_model_shrinks_to_zero_and_gives_every_gpu_back() -> None:
    running = running_for(CLUSTER, demand(8.0))
    assert sum(i.num_gpus for i in running) == 4
    p = policy()
    quiet = [idle(t) for t in (10, 20, 30, 40, 50)]
    assert decide(p, snap(running, quiet[:4], rate=0.0), 40).action == "hold"
    d = decide(p, snap(running, quiet, rate=0.0), 50)
    assert d.action == "shift" and d.trigger == "down"
    assert d.target == ()
    assert d.reason.startswith("llama-7b in the down zone 5 samples in a row; shrink llama-7b:")
    assert d.price is not None and d.price.num_gpus_target == 0
    assert d.price.goodput_target_per_s == d.price.goodput_running_per_s == 0.0
    # The whole gain is the GPUs given back: 4 GPUs x 0.05 req/s x 1800 s.
    assert d.price.gain == pytest.approx(4 * 0.05 * 1800)
    assert d.price.migration_cost == 0.0 and d.price.gap_cost == 0.0


def test_idle_model_keeps_its_minimum() -> None:
    running = running_for(CLUSTER, demand(8.0))
    p = policy()
    quiet = [idle(t) for t in (10, 20, 30, 40, 50)]
    d = decide(p, snap(running, quiet, rate=0.0, min_instances=1), 50)
    assert d.action == "shift" and d.target is not None
    assert len(d.target) == 1 and d.target[0].num_gpus == 1
    assert d.price is not None and d.price.num_gpus_target == 1
    # Min 3 and 3 running: nothing to give back, nothing taken below the minimum.
    stay = decide(p, snap(running, quiet, rate=0.0, min_instances=3), 50)
    assert stay.action == "hold"
    assert all(
        a.price is None or a.price.num_gpus_target >= 4 or not a.accepted for a in stay.alternatives
    )


def test_down_shift_keeps_capacity_for_the_expected_load() -> None:
    running = running_for(CLUSTER, demand(8.0))
    p = policy()
    quiet = [idle(t) for t in (10, 20, 30, 40, 50)]
    model = ModelState(demand(0.0), tuple(quiet), expected_request_rate_per_s=1.0)
    d = decide(p, ShiftSnapshot.of(CLUSTER, running, [model]), 50)
    assert d.action == "shift" and d.target is not None
    # 1 req/s expected, kept with 25% headroom: the TP2 (4.2 req/s) goes, the rest stays.
    kept = sum(i.capacity_requests_per_s for i in d.target)
    assert kept >= 1.25
    assert sum(i.num_gpus for i in d.target) < 4


# -- resource-driven: the seed example -------------------------------------------------------------


def test_tenant_leaves_gpu1_tp2_replanned_with_bigger_kv_when_it_pays() -> None:
    running = running_for(CLUSTER, demand(8.0))
    old = next(i for i in running if set(i.gpu_ids) == {"gpu1", "gpu2"})
    p = policy()
    s = snap(running, [steady(50)], cluster=FREED, resources_changed_s=0.0)
    d = decide(p, s, 60)
    assert d.action == "shift" and d.trigger == "resource"
    assert d.reason.startswith("the GPUs free to us changed; replan: score 107.1 = gain 274.2")
    assert d.target is not None and d.price is not None
    new = next(i for i in d.target if set(i.gpu_ids) == {"gpu1", "gpu2"})
    assert new.gear.tp == old.gear.tp == 2
    assert new.kv_capacity_tokens > old.kv_capacity_tokens
    assert new.gear.max_num_seqs > old.gear.max_num_seqs
    assert d.price.removed == (instance_key(old),) and d.price.added == (instance_key(new),)
    # Same GPUs and shape re-launched: the smallest risk; the in-place gap is the main cost.
    assert d.price.risk_fraction == pytest.approx(0.05)
    assert 0 < d.price.gap_cost < d.price.gain
    assert d.score == pytest.approx(
        d.price.gain - d.price.gap_cost - d.price.migration_cost - d.price.risk
    )


def test_tenant_leaves_gpu1_under_light_load_gpus_go_back() -> None:
    """At 3 req/s either plan covers the load, so no goodput is gained; the plan for the GPUs
    free now serves it on fewer GPUs (the bigger TP2 pair replaces the L4), and with a
    positive score that resource-driven shift is taken: a GPU goes back to other tenants."""
    running = running_for(CLUSTER, demand(8.0))
    s = snap(running, [steady(50)], cluster=FREED, resources_changed_s=0.0)
    s = replace(s, models=(replace(s.models[0], demand=demand(3.0)),))
    d = decide(policy(), s, 60)
    assert d.action == "shift" and d.trigger == "resource", d.reason
    assert d.price is not None and d.price.goodput_gain_per_s == pytest.approx(0.0, abs=1e-9)
    assert d.price.num_gpus_target < d.price.num_gpus_running


def test_tenant_back_soon_the_gain_does_not_beat_the_price() -> None:
    running = running_for(CLUSTER, demand(8.0))
    p = policy()
    # gpu1 is free, but only for 1000 s more: the gain over 1000 s does not pay for the gap
    # (serving without the TP2 while it drains and cold-starts) and the risk.
    short = CLUSTER.with_gpu("gpu1", used_bytes=0.0, free_until_s=1060.0)
    d = decide(p, snap(running, [steady(50)], cluster=short, resources_changed_s=0.0), 60)
    assert d.action == "hold" and d.trigger == "resource"
    replan = next(a for a in d.alternatives if a.name == "replan")
    assert replan.price is not None and replan.price.horizon_s == pytest.approx(1000.0)
    assert replan.price.score < 0 < replan.price.gain
    assert replan.price.gain < replan.price.gap_cost + replan.price.risk
    assert "does not pay for itself" in replan.reason


def test_resource_change_must_settle_and_beat_the_margin() -> None:
    running = running_for(CLUSTER, demand(8.0))
    p = policy()
    fresh = snap(running, [steady(50)], cluster=FREED, resources_changed_s=50.0)
    assert decide(p, fresh, 60).reason == "GPUs changed 10 s ago; waiting 30 s for them to settle"
    # The plan for the freed GPU raises goodput by 2.8%: a 5% margin refuses it.
    strict = policy(triggers=TriggerParams(resource_min_gain_fraction=0.05))
    d = decide(strict, snap(running, [steady(50)], cluster=FREED, resources_changed_s=0.0), 60)
    assert d.action == "hold"
    assert "below the margin" in next(a for a in d.alternatives if a.name == "replan").reason
    # Nothing changed: no planner call, no shift.
    assert decide(p, snap(running, [steady(50)]), 60).reason.startswith("no trigger")


def test_capacity_estimate_is_injected() -> None:
    """The simulator or the controller may price with measured capacities: here the running
    TP2 was measured at 1.5x the planner's estimate, so its relaunch gains nothing."""
    running = running_for(CLUSTER, demand(8.0))
    old = next(i for i in running if i.num_gpus == 2)

    def measured(inst: PlannedInstance) -> float:
        scale = 1.5 if instance_key(inst) == instance_key(old) else 1.0
        return scale * inst.capacity_requests_per_s

    p = ShiftPolicy(planner=cached_planner, capacity=measured)
    d = decide(p, snap(running, [steady(50)], cluster=FREED, resources_changed_s=0.0), 60)
    assert d.action == "hold"
    replan = next(a for a in d.alternatives if a.name == "replan")
    assert replan.price is not None and replan.price.goodput_gain_per_s < 0


# -- GPUs going away, waking up, several models --------------------------------------------------


def test_reclaimed_gpu_shifts_at_once_even_in_cooldown() -> None:
    running = running_for(CLUSTER, demand(8.0))
    on_gpu3 = next(i for i in running if i.gpu_ids == ("gpu3",))
    leaving = CLUSTER.with_gpu("gpu3", free_until_s=150.0)  # 90 s of notice at now = 60
    recent = (ShiftRecord(0.0, 50.0, True),)
    d = decide(policy(), snap(running, [steady(55)], cluster=leaving, history=recent), 60)
    assert d.action == "shift" and d.trigger == "reclaim"
    assert d.reason.startswith(f"{on_gpu3.name}: gpu3 is reclaimed in 90 s;")
    assert d.target is not None and all("gpu3" not in i.gpu_ids for i in d.target)


def test_tenant_squeezing_an_instance_out_is_a_reclaim() -> None:
    running = running_for(FREED, demand(8.0))
    tp2 = next(i for i in running if set(i.gpu_ids) == {"gpu1", "gpu2"})
    squeezed = FREED.with_used("gpu1", 70 * 2**30, owner="tenant-b")  # back, and bigger
    d = decide(policy(), snap(running, [steady(55)], cluster=squeezed), 60)
    assert d.action == "shift" and d.trigger == "reclaim"
    assert d.reason.startswith(
        f"{tp2.name}: no longer fits beside the other tenants: room for 8912 KV tokens, "
        f"it holds {tp2.kv_capacity_tokens};"
    )
    assert d.target is not None and tp2 not in d.target


def test_reclaim_that_cannot_keep_a_minimum_still_drops_the_lost_instance() -> None:
    running = running_for(CLUSTER, demand(1.5))
    assert [i.gpu_ids for i in running] == [("gpu2",)]
    gone = CLUSTER
    for g in CLUSTER.gpu_ids:
        gone = gone.with_used(g, gone.gpu(g).capacity_bytes, owner="batch job")
    d = decide(policy(), snap(running, [steady(55)], cluster=gone, min_instances=1), 60)
    assert d.action == "shift" and d.trigger == "reclaim" and d.target == ()
    assert d.reason.endswith(
        "drop lost: no candidate keeps every minimum; the lost instances go regardless"
    )


def test_requests_waiting_for_a_scaled_to_zero_model_wake_it() -> None:
    p = policy()
    waiting = [Sample(40, 3, 100, None, None, 0.0)]
    recent = (ShiftRecord(0.0, 30.0, True),)  # in cooldown: waking does not wait for it
    d = decide(p, snap((), waiting, rate=0.0, history=recent), 40)
    assert d.action == "shift" and d.trigger == "wake"
    assert d.target is not None and len(d.target) >= 1


def test_higher_priority_model_gets_the_gpus_when_short() -> None:
    chat, batch = demand(6.0, "chat"), demand(6.0, "batch", "mistral-7b")
    running = running_for(
        FREED, replace(chat, request_rate_per_s=1.0), replace(batch, request_rate_per_s=1.0)
    )
    samples = tuple(up(t) for t in (10, 20, 30, 40, 50))
    models = [
        ModelState(chat, samples, priority=10.0),
        ModelState(batch, samples, priority=1.0, min_instances=1),
    ]
    d = decide(policy(), ShiftSnapshot.of(FREED, running, models), 50)
    assert d.action == "shift" and d.target is not None
    assert d.reason.split("; ")[1].startswith("priority-first:")
    chat_gpus = sum(i.num_gpus for i in d.target if i.model == "chat")
    batch_gpus = sum(i.num_gpus for i in d.target if i.model == "batch")
    assert chat_gpus == 3 and batch_gpus == 1  # batch keeps its minimum, chat takes the rest
    replan = next(a for a in d.alternatives if a.name == "replan")
    assert replan.score is not None and d.score is not None and replan.score < d.score


def test_candidate_below_a_minimum_is_refused_with_the_reason() -> None:
    chat, batch = demand(8.0, "chat"), demand(0.5, "batch", "mistral-7b")
    running = running_for(FREED, chat, batch)
    assert any(i.model == "batch" for i in running)
    spike = tuple(up(t) for t in (10, 20, 30, 40, 50))
    # batch needs 2 instances, it has one and the re-plan gives it one: refused, kept.
    models = [ModelState(chat, spike), ModelState(batch, (), min_instances=2)]
    d = decide(policy(), ShiftSnapshot.of(FREED, running, models), 50)
    assert d.action == "hold"
    refused = next(a for a in d.alternatives if a.name == "replan")
    assert refused.reason.startswith("replan: batch would have 1 instance(s), below its minimum")


# -- migration, determinism, config --------------------------------------------------------------


def test_migration_takes_the_cheaper_of_kv_move_and_recompute() -> None:
    running = running_for(FREED, demand(8.0))
    a = next(i for i in running if i.gpu_ids == ("gpu3",))
    b = next(i for i in running if i.gpu_ids == ("gpu0",))
    link = link_between(FREED, a, b)
    assert link is not None and link.name == "eth25"
    pm = perf_model_of(FREED, b)
    for context in (64, 2176, 32_000):
        choice = choose_migration(pm, context, link)
        kv = pm.kv_transfer_s(context, link.bandwidth_bytes_per_s, link.latency_s)
        assert choice.pause_s == min(kv, pm.prefill_s(context))
        assert choice.method == ("kv" if kv < pm.prefill_s(context) else "recompute")
    assert link_between(FREED, a, a) is None  # shared GPUs: the source stops first
    assert choose_migration(pm, 2176, None).method == "recompute"


def test_price_of_dropping_an_instance_with_long_requests() -> None:
    """Exact terms: no instance started (no gap, no risk); a third of gpu3's requests outlive
    the 30 s drain and pause for a KV move or recompute on the TP2."""
    long = replace(demand(4.0), output_tokens=1024)
    running = running_for(FREED, long)
    victim = next(i for i in running if i.gpu_ids == ("gpu3",))
    target = tuple(i for i in running if i is not victim)
    tp2 = next(i for i in target if i.num_gpus == 2)
    model = ModelState(long)
    p = price(FREED, running, target, [model], {"llama-7b": (4.0, 4.0)}, 0.0, PricingParams())
    assert p.removed == (instance_key(victim),) and p.added == ()
    assert p.gap_cost == 0.0 and p.risk == 0.0 and p.risk_fraction == 0.0
    caps = [i.capacity_requests_per_s for i in running]
    assert sum(caps) < 4.0  # short of demand: every instance's capacity is goodput
    assert p.goodput_running_per_s == pytest.approx(sum(caps))
    assert p.goodput_target_per_s == pytest.approx(sum(caps) - victim.capacity_requests_per_s)
    assert p.gain == pytest.approx((-victim.capacity_requests_per_s + 0.05) * 1800)
    share = 1 - 30.0 / victim.estimate.e2e_s
    assert 0.25 < share < 0.35
    rate = 4.0 * victim.capacity_requests_per_s / sum(caps)
    link = link_between(FREED, victim, tp2)
    assert link is not None and link.name == "eth25"
    pause = choose_migration(perf_model_of(FREED, tp2), 2048 + 512, link).pause_s
    assert p.migration_cost == pytest.approx(rate * share * pause)
    assert p.score == pytest.approx(p.gain - p.migration_cost)


def test_without_kv_hand_over_the_price_counts_recomputes_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engines that cannot hand KV over (`PricingParams.kv_moves` False, from the engine
    kind's declaration): the price of the requests still running at the deadline is their
    recompute, and no link between the instances is even looked at."""
    from flexpipe.policies.shift import pricing

    long = replace(demand(4.0), output_tokens=1024)
    running = running_for(FREED, long)
    victim = next(i for i in running if i.gpu_ids == ("gpu3",))
    target = tuple(i for i in running if i is not victim)
    tp2 = next(i for i in target if i.num_gpus == 2)
    links: list[str] = []
    real = pricing.link_between
    monkeypatch.setattr(
        pricing, "link_between", lambda c, a, b: links.append(a.name) or real(c, a, b)
    )
    loads = {"llama-7b": (4.0, 4.0)}
    no_kv = price(
        FREED, running, target, [ModelState(long)], loads, 0.0, PricingParams(kv_moves=False)
    )
    assert links == []
    rate = 4.0 * victim.capacity_requests_per_s / sum(i.capacity_requests_per_s for i in running)
    share = 1 - 30.0 / victim.estimate.e2e_s
    recompute = choose_migration(perf_model_of(FREED, tp2), 2048 + 512, None)
    assert no_kv.migration_cost == pytest.approx(rate * share * recompute.pause_s)
    price(FREED, running, target, [ModelState(long)], loads, 0.0, PricingParams())
    assert links == [victim.name]  # with KV hand-over the link is priced


def test_same_inputs_same_decision_and_it_is_json() -> None:
    running = running_for(CLUSTER, demand(1.5))
    s = snap(running, [up(t) for t in (10, 20, 30, 40, 50)])
    one, two = decide(policy(), s, 50), decide(policy(), s, 50)
    assert one.to_dict() == two.to_dict()
    text = json.dumps(one.to_dict())
    assert json.loads(text)["price"]["score"] == round(one.price.score, 3)  # type: ignore[union-attr]


def test_params_from_yaml_and_unknown_keys() -> None:
    doc = yaml.safe_load(
        """
        triggers: {num_samples: 3, cooldown_s: 240, thresholds: {up_queue: 0.6}}
        pricing: {horizon_s: 900, risk_cross_node: 0.4}
        """
    )
    params = ShiftParams.from_mapping(doc)
    assert params.triggers.num_samples == 3 and params.triggers.cooldown_s == 240
    assert params.triggers.thresholds.up_queue == 0.6
    assert params.triggers.thresholds.up_latency == 0.8
    assert params.pricing.horizon_s == 900 and params.pricing.risk_cross_node == 0.4
    with pytest.raises(ValueError, match=r"shift\.pricing: unknown key\(s\) horizon\b"):
        ShiftParams.from_mapping({"pricing": {"horizon": 900}})
    with pytest.raises(ValueError, match=r"^shift\.triggers: num_samples and max_failures"):
        ShiftParams.from_mapping({"triggers": {"num_samples": 0}})
    with pytest.raises(
        ValueError, match=r"^shift\.pricing\.horizon_s: expected a number, got '1h'"
    ):
        ShiftParams.from_mapping({"pricing": {"horizon_s": "1h"}})
    with pytest.raises(
        ValueError, match=r"^shift\.triggers\.cooldown_s: expected a finite number, got inf"
    ):
        ShiftParams.from_mapping(yaml.safe_load("triggers: {cooldown_s: .inf}"))


def test_docs_yaml_is_the_defaults() -> None:
    text = (ROOT / "docs" / "shift-policy.md").read_text()
    block = text.split("## Parameters", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert ShiftParams.from_mapping(yaml.safe_load(block)["shift"]) == ShiftParams()


def test_public_api() -> None:
    """What the controller and the simulator import; a change here is deliberate."""
    assert set(shift_pkg.__all__) == {
        *("Action", "Candidate", "Capacity", "MigrationChoice", "ModelSignal", "ModelState"),
        *("Planner", "Pressure", "Price", "PricingParams", "Sample", "ScoredCandidate"),
        *("ShiftDecision", "ShiftParams", "ShiftPolicy", "ShiftRecord", "ShiftSnapshot"),
        *("Thresholds", "Trigger", "TriggerParams", "Zone", "choose_migration"),
        *("default_planner", "goodput_per_s", "instance_key", "link_between"),
        *("perf_model_of", "planned_capacity", "price"),
    }
    assert sorted(shift_pkg.__all__) == shift_pkg.__all__
    for name in shift_pkg.__all__:
        assert hasattr(shift_pkg, name), name


def test_an_instance_that_wakes_is_priced_at_its_wake_time_not_a_cold_start() -> None:
    """The same target twice: with the added instance asleep (sleep mode), it is ready after
    its level-1 wake instead of a cold start, so its gain accrues for that much longer."""
    running = running_for(FREED, demand(4.0))
    added = running[-1]
    target, before = running, running[:-1]
    loads = {"llama-7b": (4.0, 4.0)}
    model = [ModelState(demand(4.0))]
    cold = price(FREED, before, target, model, loads, 0.0, PricingParams())
    key = instance_key(added)
    warm = price(FREED, before, target, model, loads, 0.0, PricingParams(), asleep_levels={key: 1})
    pm = perf_model_of(FREED, added)
    per_s = cold.gain / (cold.horizon_s - pm.cold_start_s())
    assert warm.gain == pytest.approx(per_s * (warm.horizon_s - pm.wake_s(1)))
    assert warm.gain - cold.gain == pytest.approx(per_s * (pm.cold_start_s() - pm.wake_s(1)))
    assert f"{key} wakes from sleep level 1 in {pm.wake_s(1):.2f} s" in warm.notes


def test_a_wake_trigger_wakes_the_sleeping_instance_rather_than_cold_starting_one() -> None:
    """A model with no instance has requests queued; its instance sleeps on gpu3: the policy
    takes the candidate that wakes it (ready after the wake, not a cold start), though the
    planner alone would place it elsewhere."""
    (asleep,) = [i for i in running_for(FREED, demand(8.0)) if i.gpu_ids == ("gpu3",)]
    waiting = [Sample(40, 3, 100, None, None, 0.0)]
    s = replace(snap((), waiting, cluster=FREED, rate=1.0), asleep=((asleep, 1),))
    d = decide(policy(), s, 40)
    assert d.action == "shift" and d.trigger == "wake", d.reason
    assert d.target == (asleep,), d.alternatives
    cold = decide(policy(), replace(s, asleep=()), 40)
    assert cold.target is not None and cold.target != (asleep,)  # no sleeper: a cold start


def test_a_model_a_time_share_swap_put_aside_is_not_below_its_floor() -> None:
    """Model a (minimum 1) sleeps on gpu3, where a swap woke model b: the swap's own decisions
    wake a back (policies/shift/time_share.py), so neither the floor nor the wake trigger
    re-plans gpu3 away from b (live, that stopped b's engine just after its wake). Asleep on
    a GPU nothing of ours runs on, a is below its floor as before."""
    (inst,) = [i for i in running_for(FREED, demand(8.0)) if i.gpu_ids == ("gpu3",)]
    a, b = replace(inst, name="a-1", model="a"), replace(inst, name="b-1", model="b")
    waiting = (Sample(40, 3, 100, None, None, 0.0),)  # a's requests wait for it
    models = [
        ModelState(demand(1.0, name="a"), waiting, min_instances=1),
        ModelState(demand(1.0, name="b"), ()),
    ]
    swapped = ShiftSnapshot.of(FREED, (b,), models, asleep=((a, 1),))
    time_share = policy(standby=StandbyParams(enabled=True, time_share=True))
    d = decide(time_share, swapped, 40)
    assert d.action == "hold" and d.trigger not in ("floor", "wake"), d.reason
    other = next(i for i in running_for(FREED, demand(8.0)) if "gpu3" not in i.gpu_ids)
    elsewhere = replace(swapped, running=(replace(other, name="b-1", model="b"),))
    floor = decide(time_share, elsewhere, 40)
    assert (floor.action, floor.trigger) == ("shift", "floor"), floor.reason
    # without time-sharing (or with its own share of the GPU's memory) a sleeper is missing
    assert decide(policy(), swapped, 40).trigger == "floor"
    shared = replace(swapped, asleep=((replace(a, gpu_memory_fraction=0.4), 1),))
    assert decide(time_share, shared, 40).trigger == "floor"
