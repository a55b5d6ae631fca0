"""The gateway fleet's pure core (control/core/gateway_sync.py): the catch-up of a replica that
missed commands, the tick's one view of several pools and Prometheus texts, request ids
tagged with their replica, and the deployment id of a fleet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flexpipe.cli.controller import replica_urls
from flexpipe.control.core.gateway_sync import (
    AddInstance,
    Intent,
    Registration,
    RemoveInstance,
    SendHold,
    SendRefusal,
    SetState,
    SetWeight,
    catch_up,
    choose_deployment,
    differences,
    fleet_request_id,
    local_request_id,
    merge_metrics,
    merge_pools,
    replica_load,
    state_path,
)
from flexpipe.control.core.samples import (
    TTFT_HISTOGRAM,
    gateway_totals,
    parse_histograms,
)

A, B, C = "http://10.0.0.1:9001", "http://10.0.0.2:9001", "http://10.0.0.3:9001"


def _reg(url: str, state: str = "active", model: str = "m") -> Registration:
    return Registration(url, model, 8, state, "tok")


def _seen(url: str, state: str, **extra: Any) -> dict[str, Any]:
    return {"url": url, "model": "m", "state": state, "weight": 1.0, **extra}


def test_state_path_walks_the_lifecycle_never_routing_on_the_way_when_it_can() -> None:
    assert state_path("starting", "draining") == ["rehearsing", "draining"]
    assert state_path("starting", "active") == ["active"]
    assert state_path("asleep", "active") == ["waking", "active"]
    assert state_path("active", "waking") == ["asleep", "waking"]
    assert state_path("active", "active") == []
    assert state_path("draining", "rehearsing") is None  # no way back
    assert state_path("gone", "active") is None


def test_a_replica_back_from_a_restart_gets_the_pool_and_the_holds_with_their_time_left() -> None:
    intent = Intent()
    intent.registered(_reg(A))
    intent.registered(_reg(B, "starting"))
    intent.set_state(B, "rehearsing")
    intent.registered(_reg(C))
    intent.set_state(C, "asleep")
    intent.hold("idle", 600.0, now_s=1000.0)
    intent.refuse("huge", "no GPU can place it", 600.0, now_s=1100.0)
    steps = catch_up(intent, [], now_s=1200.0, standby=True)
    assert steps == [
        AddInstance(_reg(A), "active"),
        AddInstance(Registration(B, "m", 8, "rehearsing", "tok"), "rehearsing"),
        AddInstance(Registration(C, "m", 8, "asleep", "tok"), "active"),
        SetState(C, "asleep"),
        SendRefusal("huge", "no GPU can place it", 500.0),
        SendHold("idle", 400.0),
    ]


def test_a_lagging_replica_walks_each_instance_to_its_state_and_loses_what_was_removed() -> None:
    intent = Intent()
    for url in (A, B, C):
        intent.registered(_reg(url, "starting"))
    intent.set_state(A, "active")
    intent.set_state(A, "draining")
    intent.set_state(B, "rehearsing")
    intent.set_weight(B, 2.0)
    intent.remove(C)
    seen = [_seen(A, "starting"), _seen(B, "draining"), _seen(C, "active")]
    assert intent.version == 8  # every change counted (a catch-up under way starts again)
    assert catch_up(intent, seen, 0.0, standby=False) == [
        RemoveInstance(C),
        SetState(A, "rehearsing"),
        SetState(A, "draining"),
        # draining cannot go back to rehearsing: out, and in again as the controller has it
        RemoveInstance(B),
        AddInstance(Registration(B, "m", 8, "rehearsing", "tok", weight=2.0), "rehearsing"),
        SetWeight(B, 2.0),
    ]
    assert differences(intent, seen) == [
        f"{C} removed, still there",
        f"{A} starting, not draining",
        f"{B} draining, not rehearsing",
    ]


def test_an_up_to_date_replica_needs_nothing_and_unknown_instances_are_left_alone() -> None:
    intent = Intent()
    intent.registered(_reg(A))
    seen = [_seen(A, "active"), _seen("http://static:1", "active")]
    assert catch_up(intent, seen, 0.0, standby=False) == []
    assert differences(intent, seen) == []


def test_releases_are_sent_again_until_the_hold_they_lifted_would_have_run_out() -> None:
    intent = Intent()
    intent.hold("m", 60.0, now_s=0.0)
    intent.hold("m", 0.0, now_s=10.0)  # released: a replica that missed it still holds m
    assert catch_up(intent, [], 20.0, standby=True) == [SendHold("m", 0.0)]
    assert catch_up(intent, [], 20.0, standby=False) == []
    intent.expire(61.0)
    assert catch_up(intent, [], 61.0, standby=True) == []
    # a refusal replaced by a hold: the hold is what is sent
    intent.refuse("n", "why", 100.0, now_s=0.0)
    intent.hold("n", 50.0, now_s=10.0)
    assert catch_up(intent, [], 20.0, standby=True) == [SendHold("n", 40.0)]


def test_merge_pools_lists_what_the_replicas_in_step_hold_and_adds_up_what_each_routed() -> None:
    intent = Intent()
    intent.registered(_reg(A))
    one = [
        _seen(A, "active", num_in_flight=3, num_running=5, num_queued_tokens=10.0, healthy=False),
        _seen(B, "active", num_in_flight=1, num_running=2, num_queued_tokens=0.0),
    ]
    lagging = [_seen(A, "starting", num_in_flight=2, num_running=5, num_queued_tokens=4.5)]
    # the lagging replica (A not yet active there) does not hide B; its load on A counts
    assert merge_pools([one, lagging], intent) == [
        _seen(A, "active", num_in_flight=5, num_running=5, num_queued_tokens=14.5, healthy=True),
        _seen(B, "active", num_in_flight=1, num_running=2, num_queued_tokens=0.0, healthy=True),
    ]
    # none in step (a controller that just started): what every replica holds
    assert merge_pools([one, lagging], Intent()) == [
        _seen(A, "active", num_in_flight=5, num_running=5, num_queued_tokens=14.5, healthy=True)
    ]
    assert merge_pools([one]) == one  # one replica: its pool as it is


def _gateway_text(num_ok: int, ttft_s: list[float], queued: int, in_flight: int) -> str:
    r = CollectorRegistry()
    requests = Counter("flexpipe_requests", "Requests.", ["model", "status"], registry=r)
    requests.labels("m", "200").inc(num_ok)
    ttft = Histogram(TTFT_HISTOGRAM, "TTFT.", ["model"], buckets=(0.1, 1.0), registry=r)
    for t in ttft_s:
        ttft.labels("m").observe(t)
    Gauge("flexpipe_queued_requests", "Queue.", registry=r).set(queued)
    per_model = Gauge("flexpipe_model_queued_requests", "Queue.", ["model"], registry=r)
    per_model.labels("m").set(queued)
    Gauge("flexpipe_in_flight_requests", "In flight.", ["instance"], registry=r).labels(A).set(
        in_flight
    )
    return generate_latest(r).decode()


def test_merge_metrics_adds_up_counts_queues_and_histogram_buckets_as_the_core_reads_them() -> None:
    one = _gateway_text(3, [0.05, 0.5], queued=2, in_flight=4)
    two = _gateway_text(4, [0.05, 2.0, 3.0], queued=1, in_flight=1)
    merged = merge_metrics([one, two])
    totals = gateway_totals(merged)
    assert (totals.num_queued, totals.queued_by_model, totals.done_by_model) == (
        3,
        {"m": 3},
        {"m": 7.0},
    )
    assert parse_histograms(merged, [TTFT_HISTOGRAM]) == {
        (TTFT_HISTOGRAM, "m"): ((0.1, 2.0), (1.0, 3.0), (float("inf"), 5.0))
    }
    assert replica_load(merged) == (5, 7.0)
    assert replica_load(one) == (4, 3.0)
    assert merge_metrics([one]) == one


def test_request_ids_carry_their_replica() -> None:
    assert fleet_request_id(7, 0) == 7168
    assert local_request_id(fleet_request_id(7, 3)) == (7, 3)
    assert local_request_id(fleet_request_id(0, 1023)) == (0, 1023)
    with pytest.raises(ValueError):
        fleet_request_id(1, 1024)


def test_the_deployment_id_survives_a_replica_added_or_retired() -> None:
    # new: one gateway keeps the name a single gateway's deployment always had
    assert choose_deployment(None, [A + "/"], {}, ()) == A
    assert choose_deployment(None, [B, A], {}, ()) == f"{A},{B}"
    # the store recorded the fleet {A, B} under an id: adding C, or keeping only B, keeps it
    fleets = {f"{A},{B}": [A, B], "other": ["http://elsewhere:1"]}
    assert choose_deployment(None, [A, B, C], fleets, ()) == f"{A},{B}"
    assert choose_deployment(None, [B], fleets, ()) == f"{A},{B}"
    # a single gateway's deployment from before replicas were recorded: found by its URL
    assert choose_deployment(None, [A, C], {}, known_ids=[A]) == A
    assert choose_deployment("prod-eu", [A, C], fleets, ()) == "prod-eu"
    with pytest.raises(ValueError, match=r"belong to 2 deployments.*--deployment-id"):
        choose_deployment(None, [A, C], {"x": [A], "y": [C]}, ())


def test_the_replicas_are_read_from_flags_comma_lists_and_a_yaml_list(tmp_path: Path) -> None:
    listed = tmp_path / "gateways.yaml"
    listed.write_text(f"gateways: [{C}, {A}]\n")
    assert replica_urls([f"{A}/", f"{B},{A}"], listed) == [A, B, C]
    listed.write_text(f"- {C}\n")
    assert replica_urls([], listed) == [C]
    assert replica_urls([], None) == ["http://127.0.0.1:8000"]
    with pytest.raises(ValueError, match="expected an http:// or https:// URL"):
        replica_urls(["gw-0:8000"], None)
    listed.write_text("gateways: 3\n")
    with pytest.raises(ValueError, match="expected a list of gateway URLs"):
        replica_urls([], listed)
