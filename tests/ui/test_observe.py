"""`flexpipe status` / `top`'s pure cores: a snapshot built from fixed readings (the gateway's
metrics made by the gateway's own metrics class, its dashboard view made by the dashboard's
own functions, engine texts in vLLM's names) gives exact numbers, the dashboard's for each
model, and draws exactly the same text every time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from flexpipe.gateway.gateway_metrics import GatewayMetrics
from flexpipe.hardware import GiB
from flexpipe.observe.readings import Readings
from flexpipe.observe.render import (
    gateways_table,
    gpus_table,
    header,
    instances_table,
    models_table,
)
from flexpipe.observe.status_snapshot import Snapshot, parse_samples, snapshot
from flexpipe.ui.reading import EngineCounters, Reading, read_registry
from flexpipe.ui.series import History
from flexpipe.ui.view import ControllerSnapshot, assemble_view

E1, E2 = "http://127.0.0.1:9001", "http://127.0.0.1:9002"
GOLDEN = Path(__file__).parents[1] / "data" / "observe_tables.txt"


def status(time_scale: float = 0.5) -> dict[str, Any]:
    def inst(name: str, url: str, gpus: list[str], state: str) -> dict[str, Any]:
        return {"key": name, "name": name, "model": "m", "gear": "tp1-pp1-bf16-kvauto-s8",
                "gpus": gpus, "url": url, "state": state}  # fmt: skip

    gpu = {"node": "n0", "type": "A100-80G-SXM", "capacity_bytes": 80 * GiB, "owner": None,
           "free_until_s": None, "occupied": None}  # fmt: skip
    return {
        "instances": [inst("m-0", E1, ["g0"], "active"), inst("m-1", E2, ["g1"], "rehearsing")],
        "resources": {
            "cluster": "c",
            "gpus": [
                {**gpu, "id": "g0", "used_bytes": 0.0},
                {**gpu, "id": "g1", "used_bytes": 0.0},
                {
                    **gpu,
                    "id": "g2",
                    "used_bytes": 40 * GiB,
                    "owner": "tenant-b",
                    "occupied": {"owner": "alice", "since_s": 0, "until_s": None},
                },
            ],
        },
        "gateway": "http://127.0.0.1:9000",
        "engine": "sim",
        "time_scale": time_scale,
        "models": [
            {
                "name": "m",
                "model": "llama-2-7b",
                "slo": {"ttft_p99_s": 2.0, "tpot_p99_s": 0.05},
                "request_rate_per_s": 1.0,
            }
        ],
        "last_decision": {"action": "hold", "trigger": "none", "reason": "in the band"},
        "last_outcome": {"succeeded": True, "reason": "", "phases_s": {"warm": 2.0, "drain": 1.5}},
        "num_shifts": 3,
    }


def engine_text(running: int, waiting: int, kv: float, hits: float, queries: float,
                busy_s: float, tokens: float) -> str:  # fmt: skip
    lab = '{model_name="m",engine="0"}'
    return (
        f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{lab} {running}\n"
        f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{lab} {waiting}\n"
        f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{lab} {kv}\n"
        f"# TYPE flexpipe:max_num_seqs gauge\nflexpipe:max_num_seqs{lab} 8\n"
        f"# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{lab} {hits}\n"
        f"# TYPE vllm:prefix_cache_queries counter\n"
        f"vllm:prefix_cache_queries_total{lab} {queries}\n"
        f"# TYPE flexpipe:modelled_busy_seconds counter\n"
        f"flexpipe:modelled_busy_seconds_total{lab} {busy_s}\n"
        f"# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{lab} {tokens}\n"
    )


def _pool(waiting: int, in_flight: int) -> tuple[dict[str, Any], ...]:
    """The gateway pool's instances, as `Instance.as_dict()` has them."""
    e1 = {"url": E1, "model": "m", "state": "active", "num_waiting": waiting,
          "num_in_flight": in_flight}  # fmt: skip
    return (e1, {"url": E2, "model": "m", "state": "draining", "num_waiting": 0})


def gateway_view(gm: GatewayMetrics, history: History, at_s: float, time_scale: float,
                 engines: dict[str, EngineCounters], waiting: int, queued: int,
                 in_flight: int) -> dict[str, Any]:  # fmt: skip
    """The gateway's dashboard view after one more of its readings, made as the gateway does
    (flexpipe/gateway/ui_routes.py: its registry, the engines' counters, the pool)."""
    history.add(Reading(at_s, read_registry(gm.registry.collect()), engines,
                        _pool(waiting, in_flight), queued))  # fmt: skip
    ctl = ControllerSnapshot("http://127.0.0.1:9100", {"time_scale": time_scale})
    return assemble_view(at_s + 1, history, ctl, 2.0)


def readings(busy_reported: bool = True) -> tuple[Readings, Readings]:
    """Two readings 10 s apart (wall) at time scale 0.5: 20 modelled seconds. The gateway's
    dashboard took its readings at the same two times."""
    gm = GatewayMetrics()
    history = History()
    gm.instance_up.labels(E1, "active").set(1)
    gm.instance_up.labels(E2, "draining").set(0)
    for _ in range(10):
        gm.request_done("m", E1, "200")
        gm.observe("ttft", "m", 0.04)
        gm.observe("tpot", "m", 0.012)
    engines = {E1: engine_text(1, 0, 0.1, 10, 100, 5.0, 100), E2: engine_text(0, 0, 0, 0, 0, 0, 0)}
    busy = (5.0, 0.0, 15.0) if busy_reported else (None, None, None)
    counters = {E1: EngineCounters(100, 100, 10, busy[0]), E2: EngineCounters(0, 0, 0, busy[1])}
    view = gateway_view(gm, history, 1000.0, 0.5, counters, 0, 0, 0)
    before = Readings(1000.0, "http://127.0.0.1:9100", status(), gm.exposition().decode(),
                      engines, view)  # fmt: skip
    # in the window: 20 requests (one 502), TTFTs 19 x 40 ms and 1 x 700 ms, TPOTs 12 ms
    for i in range(20):
        gm.request_done("m", E1, "502" if i == 0 else "200")
        gm.observe("ttft", "m", 0.7 if i == 0 else 0.04)
        gm.observe("tpot", "m", 0.012)
    gm.queued.set(2)
    gm.in_flight.labels(E1).set(5)
    engines = {E1: engine_text(4, 1, 0.25, 40, 200, 15.0, 500), E2: None}
    view = gateway_view(gm, history, 1010.0, 0.5, {E1: EngineCounters(500, 200, 40, busy[2])},
                        1, 2, 5)  # fmt: skip
    now = Readings(1010.0, "http://127.0.0.1:9100", status(), gm.exposition().decode(), engines,
                   view)  # fmt: skip
    return before, now


def test_parse_samples_keeps_counter_names() -> None:
    s = parse_samples(engine_text(1, 2, 0.5, 3, 4, 5, 6))
    assert s["vllm:prefix_cache_hits_total"] == [({"model_name": "m", "engine": "0"}, 3.0)]
    assert parse_samples(None) == {} and parse_samples("") == {}


def test_snapshot_over_a_window_in_modelled_seconds() -> None:
    before, now = readings()
    snap = snapshot(now, before)
    assert snap.window_s == 10.0 and snap.time_scale == 0.5 and snap.gateway_window_s == 60.0
    (m,) = snap.models
    assert m.measured and m.request_rate_per_s == 19 / 20  # answered over 20 modelled s
    assert m.error_rate == 1 / 20
    # p95 of the window: rank 19 of 20 falls at the top of the 25-50 ms bucket: 50 ms wall
    assert m.ttft_p95_s == 0.05 / 0.5
    # all 20 TPOTs in the 10-15 ms bucket: 10 + 5 * 19/20 = 14.75 ms wall
    assert m.tpot_p95_s is not None and abs(m.tpot_p95_s - 0.01475 / 0.5) < 1e-12
    assert (m.ttft_slo_s, m.tpot_slo_s) == (2.0, 0.05)
    assert m.num_queued == 1 + 2  # waiting in its engine + the gateway's queue (lone model)
    assert m.prefix_hit_rate == 30 / 100
    assert m.generation_tokens_per_s == 400 / 20
    # e1 busy 10 modelled s of 20; e2 unreachable: the model's utilisation is e1's
    assert m.gpu_utilization == 0.5
    e1, e2 = snap.instances
    assert (e1.health, e1.num_running, e1.num_waiting, e1.num_in_flight) == ("ok", 4, 1, 5)
    assert (e1.max_num_seqs, e1.kv_usage, e1.prefix_hit_rate) == (8, 0.25, 0.3)
    assert e1.gpu_utilization == 0.5
    assert (e2.health, e2.state, e2.num_running, e2.gpu_utilization) == (
        "unreachable", "rehearsing", None, None)  # fmt: skip
    g0, g1, g2 = snap.gpus
    assert (g0.instance, g0.state, g1.instance, g2.instance) == ("m-0", "active", "m-1", None)
    assert (g2.owner, g2.occupied_by, g2.used_by_others_bytes) == ("tenant-b", "alice", 40 * GiB)
    assert snap.last_decision == "hold (none): in the band"
    assert snap.last_outcome == "succeeded in 3.5 s"
    assert snap.num_gateway_queued == 2 and snap.gateway_up and snap.num_shifts == 3


def test_status_shows_the_dashboards_figures_from_one_reading() -> None:
    """One `flexpipe status` (no earlier reading of its own) shows each model's figures as
    the dashboard has them: the gateway's view, not "—" for lack of a window."""
    _, now = readings()
    assert now.gateway_view is not None
    (fig,) = [m["now"] for m in now.gateway_view["models"]]
    (m,) = snapshot(now).models
    assert m.measured
    assert m.generation_tokens_per_s == fig["tokens_per_s"] == 20.0
    assert m.gpu_utilization == fig["gpu_utilization"] == 0.5
    assert m.request_rate_per_s == fig["request_rate_per_s"]
    assert (m.ttft_p95_s, m.tpot_p95_s) == (fig["ttft_s"]["p95"], fig["tpot_s"]["p95"])
    assert (m.prefix_hit_rate, m.num_queued) == (fig["prefix_hit_rate"], fig["queue"])
    instance = snapshot(now).instances[0]
    assert instance.gpu_utilization is None  # an instance's busy time needs its own window


def test_gpu_utilisation_not_reported_is_said_so_and_no_view_is_a_dash() -> None:
    """Engines that report no busy time (vLLM): "n/a" with why, as on the dashboard; a
    gateway whose view did not come back: "—" (nothing measured)."""
    before, now = readings(busy_reported=False)
    (m,) = snapshot(now, before).models
    assert m.measured and m.gpu_utilization is None and m.generation_tokens_per_s == 20.0
    drawn = _text(models_table(snapshot(now, before)))
    assert " n/a " in drawn and "GPU util n/a: no DCGM exporter reports its GPUs" in drawn
    (m,) = snapshot(replace(now, gateway_view=None)).models
    assert not m.measured and m.generation_tokens_per_s is None and m.num_queued is None
    drawn = _text(models_table(snapshot(replace(now, gateway_view=None))))
    assert "n/a" not in drawn


def test_json_round_trips() -> None:
    before, now = readings()
    doc = snapshot(now, before).to_json()
    assert doc["models"][0]["name"] == "m" and doc["instances"][1]["health"] == "unreachable"
    assert set(doc) == set(Snapshot.__dataclass_fields__)


def _text(table: Any) -> str:
    out = Console(width=160, color_system=None, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    out.print(table)
    return "\n".join(line.rstrip() for line in out.export_text().splitlines())


def test_tables_draw_exactly() -> None:
    """The golden drawing: tests/data/observe_tables.txt (regenerate it by hand, and read it)."""
    before, now = readings()
    snap = snapshot(now, before)
    drawn = "\n".join(
        _text(t) for t in (models_table(snap), instances_table(snap), gpus_table(snap))
    )
    assert drawn + "\n" == GOLDEN.read_text(encoding="utf-8")


def test_health_is_the_gateways_routing_not_the_lifecycle() -> None:
    from flexpipe.observe.status_snapshot import _health

    assert _health(True, ("active", 1.0)) == "ok"
    assert _health(True, ("active", 0.0)) == "ejected"  # active but failed its probes
    assert _health(True, ("draining", 0.0)) == "ok"  # not routed by its lifecycle, healthy
    assert _health(True, None) == "not routed"
    assert _health(False, ("active", 1.0)) == "unreachable"


def test_a_refused_model_shows_its_reason_in_the_models_table() -> None:
    """`flexpipe status`: the controller's `refused` (no GPU free to us can place the model)
    is drawn on the model's row; a model that is not refused draws as before (the golden)."""
    before, now = readings()
    why = "no GPU free to us can place m (llama-2-7b): every GPU held by batch"
    doc = status()
    doc["models"][0]["refused"] = why
    refused_now = replace(now, status=doc)
    snap = snapshot(refused_now, before)
    assert snap.models[0].refused == why
    drawn = " ".join(_text(models_table(snap)).split())
    assert "m (refused)" in drawn and f"m refused: {why}" in drawn
    assert snapshot(now, before).models[0].refused is None


def test_an_engine_asleep_is_listed_with_its_level_and_counted_by_no_model() -> None:
    """`flexpipe status`: the controller's `asleep` engines (sleep mode) are drawn in the
    instances table with their state and level; the model's instance count is of those that
    serve."""
    before, now = readings()
    doc = status()
    awake = snapshot(now, before).models[0].num_instances
    doc["asleep"] = [{"key": "k", "name": "m-0.2", "model": "m", "gear": "tp1-pp1-bf16",
                      "gpus": ["gpu0"], "url": "http://127.0.0.1:9", "state": "asleep",
                      "level": 1}]  # fmt: skip
    snap = snapshot(replace(now, status=doc), before)
    sleeper = snap.instances[-1]
    assert (sleeper.name, sleeper.state, sleeper.health) == ("m-0.2", "asleep", "asleep (level 1)")
    assert sleeper.gpu_utilization is None and sleeper.num_in_flight is None
    assert snap.models[0].num_instances == awake
    drawn = " ".join(_text(instances_table(snap)).split())
    assert "m-0.2" in drawn and "asleep (level 1)" in drawn


def test_gateway_replicas_are_drawn_with_their_load_and_their_pool_against_the_controllers() -> (
    None
):
    """`flexpipe status` with a controller driving two gateway replicas (control/gateway_fleet.py):
    one row each, exactly; the header counts those up; one replica draws no table."""
    before, now = readings()
    doc = status()
    doc["gateways"] = [
        {"url": "http://10.0.0.1:8000", "up": True, "error": None, "seen_s_ago": 0.4,
         "num_in_flight": 12, "requests_per_s": 31.25, "num_instances": 2, "pool": "in sync",
         "num_catch_ups": 0},
        {"url": "http://10.0.0.2:8000", "up": False, "error": "gateway http://10.0.0.2:8000/"
         "admin/instances: connect: refused", "seen_s_ago": 42.0, "num_in_flight": None,
         "requests_per_s": None, "num_instances": None, "pool": "unknown", "num_catch_ups": 1},
    ]  # fmt: skip
    snap = snapshot(replace(now, status=doc), before)
    lines = _text(gateways_table(snap)).splitlines()
    assert lines[:7] == [
        "gateways",
        "┏━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━┳━━━━━━━━━━━┳━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━┓",
        "┃ gateway              ┃ up   ┃ in flight ┃ req/s ┃     seen ┃ pool    ┃",
        "┡━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━╇━━━━━━━━━━━╇━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━┩",
        "│ http://10.0.0.1:8000 │ up   │        12 │ 31.25 │  0 s ago │ in sync │",
        "│ http://10.0.0.2:8000 │ DOWN │         — │     — │ 42 s ago │ unknown │",
        "└──────────────────────┴──────┴───────────┴───────┴──────────┴─────────┘",
    ]
    assert " ".join(lines[7:]) == (  # why the one down is down, under the table
        "http://10.0.0.2:8000: gateway http://10.0.0.2:8000/admin/instances: connect: refused"
    )
    assert "replicas 1/2 up" in _text(header(snap))
    assert "replicas" not in _text(header(snapshot(now, before)))
    assert snapshot(now, before).gateways == ()
