"""Standby sleepers (policies/shift/standby_sleepers.py), pure: which standby engines to
start, which sleepers wake or which engines sleep beside the shifts, and the planner's view
of the GPUs sleepers hold. Exact, on the seed's 4-GPU cluster with gpu1 freed and a fake
planner (one 1-GPU instance per GPU with free memory, in the cluster's order, 5 req/s each),
so that every placement is known in advance."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parents[0]))
from test_shift_policy import FREED, demand, running_for

from flexpipe.cluster import Cluster
from flexpipe.policies.planner import ModelDemand, Plan, PlannedInstance
from flexpipe.policies.shift import ShiftParams
from flexpipe.policies.shift.candidates import keepable
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_sleepers import (
    StandbyParams,
    idle_since,
    most_awake,
    peak_rates,
    pressed,
    recent_rates,
    sleeps_aside,
    standby_rate_per_s,
    standby_wanted,
    wakes_aside,
    with_sleepers,
)

TEMPLATE = running_for(FREED, demand(1.0, "a"))[0]
GIB = 2**30


def inst(model: str, gpu: str, capacity: float = 5.0, seqs: int = 64) -> PlannedInstance:
    return replace(
        TEMPLATE,
        name=f"{model}-0",
        model=model,
        gear=replace(TEMPLATE.gear, max_num_seqs=seqs),
        stages=((gpu,),),
        layers_per_stage=(32,),
        capacity_requests_per_s=capacity,
    )


def fake_planner(cluster: Cluster, demands: tuple[ModelDemand, ...], now_s: float) -> Plan:
    """One instance of the (only) demand on every GPU with free memory, in order."""
    (d,) = demands
    free = [g for g in cluster.gpu_ids if cluster.gpu(g).free_bytes > 0]
    return Plan(tuple(inst(d.name, g) for g in free), ())


def where(instances: list[PlannedInstance]) -> list[tuple[str, str]]:
    return [(i.model, i.gpu_ids[0]) for i in instances]


ON = StandbyParams(enabled=True, rate_factor=1.0)
A, B = demand(8.0, "a"), demand(4.0, "b", "mistral-7b")  # a wants 2 engines of 5, b 1


def wanted(*, params: StandbyParams = ON, **kw: object) -> list[tuple[str, str]]:
    args: dict[str, object] = {
        "cluster": FREED,
        "demands": (A, B),
        "awake": (),
        "asleep": (),
        "peak_counts": {},
        "peak_rates_per_s": {},
        "planner": fake_planner,
        "now_s": 0.0,
        "params": params,
    }
    args.update(kw)
    return where(standby_wanted(**args))  # type: ignore[arg-type]


def test_standbys_cover_each_models_rate_one_per_model_a_round() -> None:
    """a needs 8 req/s (two of 5), b 4 (one): a, b, then a again, on the GPUs in order."""
    assert FREED.gpu_ids == ("gpu0", "gpu1", "gpu2", "gpu3")
    assert wanted() == [("a", "gpu0"), ("b", "gpu1"), ("a", "gpu2")]


def test_off_by_default_nothing_is_started() -> None:
    assert StandbyParams().enabled is False
    assert wanted(params=StandbyParams()) == []


def test_what_a_model_has_awake_or_asleep_counts_and_its_gpus_are_not_taken() -> None:
    """b sleeps on gpu1 already (covers it); a runs on gpu3: a needs one more, on gpu0."""
    got = wanted(awake=(inst("a", "gpu3"),), asleep=(inst("b", "gpu1"),))
    assert got == [("a", "gpu0")]


def test_the_rate_is_the_declared_times_the_factor_or_the_peak_measured() -> None:
    params = StandbyParams(enabled=True, rate_factor=3.0)
    assert standby_rate_per_s(B, {}, params) == 12.0
    assert standby_rate_per_s(B, {"b": 20.0}, params) == 20.0
    # b at 12 req/s wants three engines of 5; a at 24 wants 5, capped at max_per_model 2
    got = wanted(params=replace(params, max_per_model=2))
    assert got == [("a", "gpu0"), ("b", "gpu1"), ("a", "gpu2"), ("b", "gpu3")]


def test_at_least_num_per_model_and_as_many_as_it_had_awake() -> None:
    params = replace(ON, rate_factor=0.0, num_per_model=1)
    assert wanted(params=params) == [("a", "gpu0"), ("b", "gpu1")]
    assert wanted(params=params, peak_counts={"b": 2}) == [
        ("a", "gpu0"),
        ("b", "gpu1"),
        ("b", "gpu2"),
    ]


def test_a_model_with_requests_waiting_gets_no_standby_and_no_gpu_left_stops_it() -> None:
    assert wanted(skip={"a"}) == [("b", "gpu0")]
    full = [inst("x", g) for g in ("gpu0", "gpu1", "gpu2")]
    assert wanted(awake=full) == [("a", "gpu3")]


def test_share_gpus_places_where_another_model_sleeps_once_no_gpu_is_free() -> None:
    asleep = tuple(inst("x", g) for g in FREED.gpu_ids)
    assert wanted(asleep=asleep) == []
    # (not where a standby just chosen goes: one engine of ours awake there at a time)
    assert wanted(asleep=asleep, params=replace(ON, share_gpus=True)) == [
        ("a", "gpu0"),
        ("b", "gpu1"),
        ("a", "gpu2"),
    ]


def pool(model: str, state: str, in_flight: int, seqs: int, waiting: int = 0) -> dict[str, object]:
    return {
        "model": model,
        "state": state,
        "num_in_flight": in_flight,
        "max_num_seqs": seqs,
        "num_waiting": waiting,
    }


def test_pressed_by_the_gateway_queue_an_engine_queue_or_busy_slots() -> None:
    records = [
        pool("a", "active", 10, 100),
        pool("a", "active", 20, 100),  # a: 30 of 200 slots
        pool("b", "active", 0, 64, waiting=1),  # b: its engine queues
        pool("c", "draining", 90, 100),  # not active: not counted
        pool("d", "active", 16, 64),  # d: a quarter of its slots
    ]
    assert pressed(records, {"e": 2, "f": 0}, 0.0) == {"b": 1, "e": 1}
    assert pressed(records, {}, 0.25) == {"b": 1, "d": 1}
    assert pressed(records, {}, 0.15) == {"a": 1, "b": 1, "d": 1}


def test_wakes_aside_skip_what_a_shift_or_an_engine_holds_and_take_the_best_first() -> None:
    weak, strong = inst("a", "gpu0", 2.0), inst("a", "gpu2", 9.0)
    held = inst("a", "gpu1")  # on a GPU a running instance holds
    other = inst("b", "gpu3")
    asleep = (weak, held, strong, other)
    running = (inst("x", "gpu1"),)
    got = wakes_aside(FREED, running, asleep, {"a": 1, "c": 1}, ())
    assert where(got) == [("a", "gpu2"), ("a", "gpu0")]
    assert where(wakes_aside(FREED, running, asleep, {"a": 1}, (), (), 1)) == [("a", "gpu2")]
    assert where(wakes_aside(FREED, running, asleep, {"a": 1, "b": 1}, ("gpu2",))) == [
        ("a", "gpu0"),
        ("b", "gpu3"),
    ]
    busy = (instance_key(weak),)
    assert where(wakes_aside(FREED, running, asleep, {"a": 1}, (), busy)) == [("a", "gpu2")]
    gone = FREED.with_used("gpu2", FREED.gpu("gpu2").capacity_bytes, owner="tenant")
    assert where(wakes_aside(gone, running, asleep, {"a": 1}, ())) == [("a", "gpu0")]


def test_idle_models_sleep_aside_after_sleep_idle_s() -> None:
    records = [pool("a", "active", 0, 64), pool("b", "active", 3, 64), pool("c", "asleep", 0, 8)]
    idle = idle_since({"a": 5.0, "b": 1.0}, records, {}, 20.0)
    assert idle == {"a": 5.0}  # b serves, c has no active engine
    assert idle_since({}, records, {"a": 1}, 20.0) == {}  # a request waits for a
    assert idle_since({}, records, {}, 20.0) == {"a": 20.0}
    running = (inst("a", "gpu0"), inst("b", "gpu1"), inst("a", "gpu2"))
    params = replace(ON, sleep_idle_s=10.0)
    assert where(sleeps_aside(running, idle, 14.0, params)) == []
    assert where(sleeps_aside(running, idle, 15.0, params)) == [("a", "gpu0"), ("a", "gpu2")]
    busy = (instance_key(running[0]),)
    assert where(sleeps_aside(running, idle, 15.0, params, busy)) == [("a", "gpu2")]
    assert sleeps_aside(running, idle, 99.0, ON) == []  # sleep_idle_s 0: off


def test_with_sleepers_counts_what_they_hold_and_keep_for_wake_takes_all_but_a_byte() -> None:
    pair = replace(inst("a", "gpu1"), stages=(("gpu1",), ("gpu2",)))
    view = with_sleepers(FREED, [(pair, 4 * GIB), (inst("b", "gpu9"), GIB)])
    assert view.gpu("gpu1").used_bytes == 2 * GIB and view.gpu("gpu2").used_bytes == 2 * GIB
    assert view.gpu("gpu1").owner == "flexpipe-asleep"
    assert view.gpu("gpu0").used_bytes == FREED.gpu("gpu0").used_bytes
    kept = with_sleepers(FREED, [(pair, 4 * GIB)], keep_for_wake=True)
    assert kept.gpu("gpu1").free_bytes == 1.0
    assert keepable(kept, pair.gpu_ids)  # the sleeper may still wake there


def test_rates_and_counts_remembered() -> None:
    seen = [(0.0, {"a": 10.0, "b": 0.0}), (5.0, {"a": 20.0}), (10.0, {"a": 60.0, "b": 4.0})]
    assert recent_rates(seen) == {"a": 5.0, "b": 0.4}
    assert recent_rates(seen[:1]) == {}
    assert peak_rates({"a": 6.0}, {"a": 5.0, "b": 0.4}) == {"a": 6.0, "b": 0.4}
    running = (inst("a", "gpu0"), inst("a", "gpu1"), inst("b", "gpu2"))
    assert most_awake({"a": 1, "c": 3}, running) == {"a": 2, "b": 1, "c": 3}


def test_the_shift_config_reads_standby() -> None:
    p = ShiftParams.from_mapping(
        {"standby": {"enabled": True, "rate_factor": 8, "wakes_per_tick": 2}}
    )
    assert p.standby == StandbyParams(enabled=True, rate_factor=8, wakes_per_tick=2)
    assert ShiftParams().standby == StandbyParams()
    with pytest.raises(ValueError, match=r"shift\.standby: unknown key"):
        ShiftParams.from_mapping({"standby": {"enable": True}})
    with pytest.raises(ValueError, match=r"shift\.standby\.enabled: expected true or false"):
        ShiftParams.from_mapping({"standby": {"enabled": 1}})
    with pytest.raises(ValueError, match="must be >= 0"):
        StandbyParams(wakes_per_tick=-1)


def test_the_docs_yaml_is_the_defaults() -> None:
    text = (Path(__file__).parents[2] / "docs" / "controller.md").read_text()
    block = text.split("## Standby sleepers", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert ShiftParams.from_mapping(yaml.safe_load(block)["shift"]).standby == StandbyParams()
