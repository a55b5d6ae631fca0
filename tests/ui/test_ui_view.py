"""The dashboard's pure parts, exactly: a reading of the gateway's registry and the engines'
counters, the 15-minute series (rates, bucket percentiles, tokens/s, prefix-cache hit rate,
counter resets, the ring's horizon), the GPU map the controller serves, and the view."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from flexpipe.cli.shifts import moves_text
from flexpipe.cluster import load_cluster
from flexpipe.control.api.ui_api import UiInstance, topology_doc
from flexpipe.gateway.gateway_metrics import GatewayMetrics
from flexpipe.hardware import GiB
from flexpipe.policies.planner import ModelDemand, Slo
from flexpipe.store.shift_entry import Alternative, Migrated, Phases, PlanInstance, ShiftEntry
from flexpipe.ui.reading import (
    EngineCounters,
    ModelReading,
    Reading,
    parse_engine_counters,
    read_registry,
)
from flexpipe.ui.series import History, model_point, window_point
from flexpipe.ui.view import ControllerSnapshot, ExporterState, assemble_view, shift_row

ROOT = Path(__file__).resolve().parents[2]
INF = float("inf")


def inst(url: str, model: str = "m", **kw: Any) -> dict[str, Any]:
    return {"url": url, "model": model, "state": "active", "num_waiting": 0,
            "num_in_flight": 0, **kw}  # fmt: skip


def test_read_registry_counts_outcomes_and_keeps_the_buckets() -> None:
    m = GatewayMetrics()
    for status in ("200", "200", "200", "502", "cancelled", "cancelled", "429"):
        m.request_done("a", "http://e1", status)
    m.request_done("b", "http://e2", "200")
    m.observe("ttft", "a", 0.09)
    m.observe("ttft", "a", 0.4)
    m.observe("tpot", "a", 0.02)
    got = read_registry(m.registry.collect())
    assert sorted(got) == ["a", "b"]
    a = got["a"]
    assert (a.num_ok, a.num_errors) == (3.0, 2.0)  # 502 and 429; a client that left is not
    assert dict(a.ttft)[0.075] == 0.0 and dict(a.ttft)[0.1] == 1.0 and dict(a.ttft)[0.5] == 2.0
    assert a.ttft[-1] == (INF, 2.0) and a.tpot[-1] == (INF, 1.0)
    assert got["b"] == ModelReading(1.0, 0.0, (), ())


def test_engine_counters_are_summed_over_label_sets() -> None:
    text = (
        b"# HELP vllm:generation_tokens_total tokens\n"
        b'vllm:generation_tokens_total{model_name="m",engine="0"} 120.0\n'
        b'vllm:generation_tokens_total{model_name="m",engine="1"} 30.0\n'
        b'vllm:generation_tokens_created{model_name="m"} 1.7e9\n'
        b'vllm:prefix_cache_queries_total{model_name="m"} 400\n'
        b"vllm:prefix_cache_hits_total 100\n"
        b"vllm:num_requests_running 3\n"
        b"vllm:broken_line\n"
    )
    assert parse_engine_counters(text) == EngineCounters(150.0, 400.0, 100.0)
    assert parse_engine_counters(b"") == EngineCounters()
    # the sim engine's modelled busy time; vLLM exports none (None: not known, not 0)
    busy = b'flexpipe:modelled_busy_seconds_total{model_name="m"} 12.5\n'
    assert parse_engine_counters(text + busy) == EngineCounters(150.0, 400.0, 100.0, 12.5)


R0 = Reading(
    at_s=100.0,
    models={"a": ModelReading(10, 0, ((0.1, 5), (0.5, 10), (INF, 10)), ())},
    engines={"http://u1": EngineCounters(1000, 200, 50)},
    instances=(inst("http://u1", "a", num_waiting=2, num_in_flight=3),),
    num_queued=4,
)
R1 = Reading(
    at_s=102.0,
    models={"a": ModelReading(14, 2, ((0.1, 5), (0.5, 14), (INF, 14)), ())},
    engines={"http://u1": EngineCounters(1600, 300, 100)},
    instances=(inst("http://u1", "a", num_waiting=1, num_in_flight=5),),
    num_queued=2,
)
R1_POINT = {
    "request_rate_per_s": 2.0,
    "error_rate_per_s": 1.0,
    # 4 new observations, all in (0.1, 0.5]: linear inside the bucket
    "ttft_s": {"p50": 0.3, "p95": 0.48, "p99": 0.496},
    "tpot_s": {"p50": None, "p95": None, "p99": None},
    "tokens_per_s": 300.0,
    "prefix_hit_rate": 0.5,
    "busy_s_per_s": None,  # the engine reports no busy time (vLLM): utilisation not known
    "gpu_busy": None,  # and no DCGM exporter reports its GPUs
    "queue": 3,  # the engine's 1 waiting + the gateway's 2 (one model: all of them are its)
    "in_flight": 5,
    "num_instances": 1,
}


def test_a_point_is_the_difference_of_two_readings() -> None:
    assert model_point("a", R0, R1) == R1_POINT
    with pytest.raises(ValueError, match="out of order"):
        model_point("a", R1, R0)


def test_busy_time_is_averaged_over_the_instances_that_report_it() -> None:
    """Two engines busy 1.5 and 0.5 modelled s over 2 wall s: 0.5 busy s per wall s each on
    average; a third that reports none (vLLM) counts for nothing. The view makes it busy time
    over the modelled time elapsed (capped at 1); None where no engine reports it."""
    u1, u2, u3 = inst("http://u1", "a"), inst("http://u2", "a"), inst("http://u3", "a")
    r0 = Reading(
        0.0,
        engines={
            "http://u1": EngineCounters(busy_s=10.0),
            "http://u2": EngineCounters(busy_s=4.0),
            "http://u3": EngineCounters(),
        },
        instances=(u1, u2, u3),
    )
    r1 = Reading(2.0, engines={"http://u1": EngineCounters(busy_s=11.5),
                               "http://u2": EngineCounters(busy_s=4.5),
                               "http://u3": EngineCounters()}, instances=(u1, u2, u3))  # fmt: skip
    point = model_point("a", r0, r1)
    assert point["busy_s_per_s"] == 0.5
    h = History()
    h.add(r0)
    h.add(r1)
    topo = {"time_scale": 0.25, "models": [], "instances": [], "nodes": []}
    v = assemble_view(3.0, h, ControllerSnapshot("http://ctl", topo), 2.0)
    # 2 wall s at 0.25 wall s per modelled s: 8 modelled s, 2 of them busy per engine
    assert v["models"][0]["now"]["gpu_utilization"] == 0.125
    assert v["models"][0]["now"]["gpu_utilization_source"] == "modelled"
    assert "busy_s_per_s" not in v["models"][0]["now"] and "gpu_busy" not in v["models"][0]["now"]
    v = assemble_view(3.0, h, ControllerSnapshot("http://ctl", {**topo, "time_scale": 4.0}), 2.0)
    assert v["models"][0]["now"]["gpu_utilization"] == 1.0  # capped
    only_vllm = Reading(4.0, engines={"http://u3": EngineCounters()}, instances=(u3,))
    assert model_point("a", r1, only_vllm)["busy_s_per_s"] is None


def test_restarted_and_new_engines_do_not_invent_tokens() -> None:
    r2 = Reading(
        at_s=104.0,
        models=R1.models,
        engines={"http://u1": EngineCounters(100, 0, 0), "http://u2": EngineCounters(5000, 9, 9)},
        instances=(inst("http://u1", "a"), inst("http://u2", "a")),
    )
    p = model_point("a", R1, r2)
    # u1 restarted (its counter went back): its 100 since; u2's first reading is a baseline
    assert p["tokens_per_s"] == 50.0 and p["prefix_hit_rate"] is None
    assert p["request_rate_per_s"] == 0.0 and p["num_instances"] == 2
    assert p["ttft_s"] == {"p50": None, "p95": None, "p99": None}


def test_two_models_do_not_share_the_gateway_queue() -> None:
    r = Reading(103.0, instances=(inst("http://u1", "a", num_waiting=1), inst("http://u3", "b")),
                num_queued=7)  # fmt: skip
    assert model_point("a", R1, r)["queue"] == 1 and model_point("b", R1, r)["queue"] == 0


def test_the_ring_keeps_fifteen_minutes_and_hands_out_what_is_new() -> None:
    h = History(max_age_s=10.0)
    assert h.add(Reading(0.0)) is None  # the first reading has no interval
    for t in (4.0, 8.0, 12.0, 16.0):
        assert h.add(Reading(t)) == {"t": t, "dt_s": 4.0, "models": {}}
    assert [r.at_s for r in h.readings] == [8.0, 12.0, 16.0]
    assert [p["t"] for p in h.since(None)] == [8.0, 12.0, 16.0]
    assert [p["t"] for p in h.since(12.0)] == [16.0] and h.since(16.0) == []
    assert h.add(Reading(16.0)) is None and len(h.readings) == 3  # not after the last
    with pytest.raises(ValueError):
        History(max_age_s=0)


def test_the_window_starts_at_the_oldest_reading_within_it() -> None:
    readings = [Reading(t) for t in (0.0, 30.0, 70.0, 100.0)]
    assert window_point(readings, 60.0) == {"t": 100.0, "dt_s": 30.0, "models": {}}
    assert window_point(readings, 5.0) == {"t": 100.0, "dt_s": 30.0, "models": {}}  # >= 2
    assert window_point(readings[:1], 60.0) is None


CLUSTER = ROOT / "examples/clusters/fragmented-4gpu.yaml"
TP2 = UiInstance("llama-7b|tp2|gpu1,gpu2", "llama-7b-1", "llama-7b", "tp2-pp1-bf16-kvauto-s48",
                 (("gpu1", "gpu2"),), "http://u1", "rehearsing")  # fmt: skip
DEMAND = ModelDemand("a", "llama-2-7b", 8, 2048, 256, Slo(ttft_p99_s=2.0, tpot_p99_s=0.06))


def test_dcgm_is_the_mean_over_the_models_gpus_unscaled_and_leaves_sim_engines_out() -> None:
    """Model a on two vLLM engines (three GPUs), model b on a sim engine whose GPU DCGM also
    reports: a's utilisation is the mean over its GPUs of DCGM's gauges at the readings in the
    window (wall time: never scaled); b's is its modelled busy time, scaled, whatever DCGM says
    of its GPU. Each instance shows DCGM's figure at the last reading."""
    v1, v2, s1 = inst("http://v1", "a"), inst("http://v2", "a"), inst("http://s1", "b")

    def reading(at_s: float, busy_s: float, v1_gpus: tuple[float, ...], v2_gpu: float) -> Reading:
        engines = {"http://v1": EngineCounters(), "http://v2": EngineCounters(),
                   "http://s1": EngineCounters(busy_s=busy_s)}  # fmt: skip
        gpu_busy = {"http://v1": v1_gpus, "http://v2": (v2_gpu,), "http://s1": (0.9,)}
        return Reading(at_s, engines=engines, instances=(v1, v2, s1), gpu_busy=gpu_busy)

    r0, r1, r2 = reading(0.0, 1.0, (0.5, 0.7), 0.3), reading(2.0, 2.0, (0.6, 0.8), 0.4), reading(
        4.0, 3.0, (0.2, 0.2), 0.2)  # fmt: skip
    assert model_point("a", r0, r1)["gpu_busy"] == 0.6  # (0.6 + 0.8 + 0.4) / 3: r1's gauges
    assert model_point("b", r0, r1)["gpu_busy"] is None  # a sim engine's GPU: left out
    h = History()
    for r in (r0, r1, r2):
        h.add(r)
    topo = {"time_scale": 0.5, "models": [], "instances": [], "nodes": []}
    v = assemble_view(5.0, h, ControllerSnapshot("http://ctl", topo), 2.0)
    a, b = (m["now"] for m in v["models"])
    # the window's gauges, at 2 s and 4 s: (0.6 + 0.8 + 0.4 + 3 x 0.2) / 6
    assert (a["gpu_utilization"], a["gpu_utilization_source"]) == (0.4, "dcgm")
    # 1 modelled busy s per 2 wall s, at 0.5 wall s per modelled s
    assert (b["gpu_utilization"], b["gpu_utilization_source"]) == (0.25, "modelled")
    assert [p["models"]["a"]["gpu_utilization"] for p in v["series"]] == [0.6, 0.2]
    assert [(i["url"], i["gpu_utilization"], i["gpu_utilization_source"])
            for i in v["instances"]] == [("http://v1", 0.2, "dcgm"), ("http://v2", 0.2, "dcgm"),
                                         ("http://s1", None, None)]  # fmt: skip
    # the exporters the gateway scrapes, and what each last said
    why = "cannot read the DCGM exporter at http://gpu-b:9400: connect: refused"
    dead = ExporterState("http://gpu-b:9400", 0, why)
    v = assemble_view(5.0, h, None, 2.0, exporters=[ExporterState("http://gpu-a:9400", 3), dead])
    assert v["dcgm"] == {"exporters": [
        {"url": "http://gpu-a:9400", "num_gpus": 3, "error": None},
        {"url": "http://gpu-b:9400", "num_gpus": 0, "error": why},
    ]}  # fmt: skip


def test_the_gpu_map_of_the_seed_cluster() -> None:
    doc = topology_doc(load_cluster(CLUSTER), [TP2], [DEMAND], time_scale=0.05)
    assert [n["name"] for n in doc["nodes"]] == ["node0", "node1", "node2"]
    gpu1, gpu2 = doc["nodes"][1]["gpus"]
    cap = 80 * GiB
    # tenant-b holds 40 GiB of gpu1; our engine takes the rest (under 0.9 x 80 GiB)
    assert (gpu1["others_bytes"], gpu1["flexpipe_bytes"]) == (40 * GiB, 40 * GiB)
    assert gpu1["owner"] == "tenant-b (fine-tuning job)" and gpu1["instance"] == TP2.key
    assert (gpu2["others_bytes"], gpu2["flexpipe_bytes"]) == (0.0, 0.9 * cap)
    assert doc["nodes"][0]["gpus"][0]["instance"] is None
    assert doc["nodes"][0]["gpus"][0]["flexpipe_bytes"] == 0.0
    assert doc["nodes"][1]["links"] == [
        {"gpus": ["gpu1", "gpu2"], "link": "nvlink3", "gb_per_s": 300.0, "fast": True}
    ]
    assert doc["nodes"][0]["links"] == [] and doc["nodes"][2]["network"]["link"] == "eth25"
    assert doc["node_links"] == [
        {"nodes": ["node0", "node1"], "link": "eth100", "gb_per_s": 12.5, "fast": False},
        {"nodes": ["node0", "node2"], "link": "eth25", "gb_per_s": 3.125, "fast": False},
        {"nodes": ["node1", "node2"], "link": "eth25", "gb_per_s": 3.125, "fast": False},
    ]
    assert doc["instances"] == [
        {"key": TP2.key, "name": "llama-7b-1", "model": "llama-7b", "gear": TP2.gear,
         "stages": [["gpu1", "gpu2"]], "url": "http://u1", "state": "rehearsing"}
    ]  # fmt: skip
    assert doc["models"] == [{"name": "a", "slo": {"ttft_p99_s": 2.0, "tpot_p99_s": 0.06}}]
    assert doc["time_scale"] == 0.05 and doc["cluster"] == "fragmented-4gpu"


def _entry() -> ShiftEntry:
    old = PlanInstance("a", "tp1-pp1-bf16-kvauto-s48", (("gpu2",),))
    new = PlanInstance("a", "tp2-pp1-bf16-kvauto-s48", (("gpu1", "gpu2"),))
    return ShiftEntry(
        at=datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC),
        kind="shift",
        trigger="resource",
        reason="gpu1 freed",
        current=(old,),
        target=(new,),
        score=107.1,
        alternatives=(
            Alternative("bigger", True, "best", 107.1, ("k",)),
            Alternative("keep", False, "lower score", 3.0, ()),
        ),
        outcome="succeeded",
        finished_at=datetime(2026, 12, 1, 12, 0, 42, 500000, tzinfo=UTC),
        migrated=Migrated(kv_moved=3, recomputed=1),
        phases=Phases(warm_s=27.0, drain_s=12.0),
        id=7,
    )


def test_a_shift_row_adds_from_to_and_how_long_it_took() -> None:
    e = _entry()
    row = shift_row(e.to_dict())
    assert row["from_to"] == moves_text(e) == "a tp1-pp1@gpu2 → a tp2-pp1@gpu1+gpu2"
    assert row["duration_s"] == 42.5
    assert row["alternatives"][1] == {"name": "keep", "accepted": False, "reason": "lower score",
                                      "score": 3.0, "instances": []}  # fmt: skip
    odd = shift_row({"kind": "shift", "at": "not a time", "finished_at": None})
    assert odd["from_to"] == "—" and odd["duration_s"] is None


def test_the_view_joins_gateway_controller_and_series() -> None:
    h = History()
    h.add(R0)
    h.add(
        Reading(102.0, R1.models, R1.engines,
                (inst("http://u1", "a", num_in_flight=5, num_waiting=1),
                 inst("http://u9", "a", state="ejected")), 2)
    )  # fmt: skip
    topo = topology_doc(load_cluster(CLUSTER), [TP2, _starting()], [DEMAND], time_scale=0.05)
    topo["instances"][0]["url"] = "http://u1"
    ctl = ControllerSnapshot("http://ctl", topo, [_entry().to_dict()], None, 101.0)
    v = assemble_view(103.0, h, ctl, 2.0, since_s=None, admin_enabled=True)
    assert [(i["url"], i["state"], i["gateway_state"]) for i in v["instances"]] == [
        ("http://u1", "rehearsing", "active"),  # the controller's lifecycle state
        ("http://u9", "ejected", "ejected"),  # the gateway knows it is unreachable
        ("http://u5", "starting", None),  # launched, not in the pool yet
    ]
    assert v["instances"][0]["gear"] == TP2.gear and v["instances"][0]["num_in_flight"] == 5
    assert v["time_scale"] == 0.05 and v["admin_enabled"] is True and v["num_queued"] == 2
    (model,) = v["models"]
    assert model["name"] == "a" and model["slo"] == {"ttft_p99_s": 2.0, "tpot_p99_s": 0.06}
    # wall seconds / 0.05 = modelled seconds
    assert model["now"]["ttft_s"] == {"p50": 6.0, "p95": 9.6, "p99": 9.92}
    # rates too: 2 per wall second at 0.05 wall s per modelled s
    assert model["now"]["request_rate_per_s"] == 0.1 and model["now"]["tokens_per_s"] == 15.0
    assert model["now"]["gpu_utilization"] is None  # its engine reports no busy time
    assert model["now"]["gpu_utilization_source"] is None and v["dcgm"] is None
    assert (v["instances"][0]["gpu_utilization"], v["instances"][0]["gpu_utilization_source"]) == (
        None, None)  # fmt: skip
    assert v["series"][0]["models"]["a"]["ttft_s"]["p50"] == 6.0
    assert [p["t"] for p in v["series"]] == [102.0]
    assert assemble_view(103.0, h, ctl, 2.0, since_s=102.0)["series"] == []
    gpus = {g["id"]: g for n in v["cluster"]["nodes"] for g in n["gpus"]}
    # the model as the gateway routes it, the state as the controller has it
    assert (gpus["gpu1"]["state"], gpus["gpu1"]["model"], gpus["gpu1"]["url"]) == (
        "rehearsing", "a", "http://u1")  # fmt: skip
    assert gpus["gpu3"]["state"] == "starting" and gpus["gpu0"]["state"] is None
    assert v["shifts"][0]["id"] == 7 and v["shifts"][0]["duration_s"] == 42.5
    assert v["controller"] == {"url": "http://ctl", "error": None, "at_s": 101.0}


def _starting() -> UiInstance:
    return UiInstance("a|tp1|gpu3", "a-2", "a", "tp1-pp1-fp8-kvauto-s24", (("gpu3",),),
                      "http://u5", "starting")  # fmt: skip


def test_a_view_without_controller_or_readings() -> None:
    v = assemble_view(5.0, History(), None, 2.0)
    assert v["instances"] == [] and v["models"] == [] and v["series"] == []
    assert v["cluster"] is None and v["shifts"] == [] and v["controller"] is None
    assert v["time_scale"] == 1.0 and v["version"] == 1 and v["source"] == "live"
    failed = ControllerSnapshot("http://ctl", error="cannot read the controller")
    assert assemble_view(5.0, History(), failed, 2.0)["controller"]["error"] == (
        "cannot read the controller"
    )


def test_the_window_counts_the_tokens_of_instances_replaced_within_it() -> None:
    u1, u2 = inst("http://u1", "a"), inst("http://u2", "a")
    readings = [
        Reading(0.0, engines={"http://u1": EngineCounters(0, 0, 0)}, instances=(u1,)),
        Reading(2.0, engines={"http://u1": EngineCounters(100, 10, 5),
                              "http://u2": EngineCounters(0, 0, 0)}, instances=(u1, u2)),
        Reading(4.0, engines={"http://u2": EngineCounters(300, 30, 30)}, instances=(u2,)),
    ]  # fmt: skip
    p = window_point(readings, 60.0)
    assert p is not None and p["dt_s"] == 4.0
    # u1's 100 tokens before it left, u2's 300 after it came: (100 + 300) / 4 s
    assert p["models"]["a"]["tokens_per_s"] == 100.0
    assert p["models"]["a"]["prefix_hit_rate"] == round(35 / 40, 4)
    # the two ends alone know only u2, which has no reading at the start
    assert model_point("a", readings[0], readings[2])["tokens_per_s"] == 0.0


def test_the_timeline_shows_this_runs_shifts_unless_every_one_is_asked_for() -> None:
    """The store is shared: another deployment's entries, and this deployment's from before
    this gateway started (an earlier `flexpipe up` on the same port), are left out by
    default and counted; `every_shift` (?shifts=all) shows every one, with whose it is."""
    start = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC).timestamp()

    def entry(id_: int, minutes: int, deployment: str) -> dict[str, Any]:
        at = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC) + timedelta(minutes=minutes)
        return replace(_entry(), id=id_, at=at, deployment=deployment).to_dict()

    mine, other = "http://127.0.0.1:8000", "http://127.0.0.1:18000"
    earlier, now_run, theirs = entry(1, -30, mine), entry(3, 1, mine), entry(2, -5, other)
    ctl = ControllerSnapshot("http://ctl", None, [earlier, now_run], None, 1.0,
                             [earlier, theirs, now_run], mine)  # fmt: skip
    v = assemble_view(start + 120, History(), ctl, 2.0, started_at_s=start)
    assert [e["id"] for e in v["shifts"]] == [3] and v["num_hidden_shifts"] == 2
    assert (v["shifts_scope"], v["deployment"], v["started_at_s"]) == ("run", mine, start)
    v = assemble_view(start + 120, History(), ctl, 2.0, started_at_s=start, every_shift=True)
    assert [(e["id"], e["deployment"]) for e in v["shifts"]] == [
        (1, mine), (2, other), (3, mine)]  # fmt: skip
    assert v["shifts_scope"] == "all" and v["num_hidden_shifts"] == 0


def test_the_view_carries_the_controllers_gateway_replicas() -> None:
    """The dashboard's "Gateway replicas" table reads `gateways`: the controller's fleet as
    its topology says it (control/gateway_fleet.py), [] without one."""
    fleet = [
        {"url": "http://g1", "up": True, "num_in_flight": 3, "requests_per_s": 2.5,
         "pool": "in sync", "error": None},
        {"url": "http://g2", "up": False, "num_in_flight": None, "requests_per_s": None,
         "pool": "unknown", "error": "connect: refused"},
    ]  # fmt: skip
    ctl = ControllerSnapshot("http://ctl", topology={"gateways": fleet}, at_s=1.0)
    assert assemble_view(5.0, History(), ctl, 2.0)["gateways"] == fleet
    assert assemble_view(5.0, History(), None, 2.0)["gateways"] == []
    assert assemble_view(5.0, History(), ControllerSnapshot("http://ctl"), 2.0)["gateways"] == []
