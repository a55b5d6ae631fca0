"""The live controller and shift policy on the virtual clock: exact shift decisions and phases
on the seed's cluster, the resource timeline (reclaim with notice, failure without), the
step order shared with the executor, and the reports (figures by hand, HTML, CSV, compare)."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.cluster import load_cluster
from flexpipe.control.core.observe import RateWindow
from flexpipe.control.core.shift_plan import probe_tokens
from flexpipe.gears.gear import Gear
from flexpipe.policies.planner import plan
from flexpipe.policies.shift import instance_key
from flexpipe.policies.shift.step_order import plan_shift
from flexpipe.sim import report, simulate
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.engine_factory import engine_config
from flexpipe.sim.report import write_reports
from flexpipe.sim.scenario import ScenarioError, Workload, parse_scenario
from flexpipe.sim.shift_run import rehearse
from flexpipe.sim.timeline import TimelineEvent, apply_event
from flexpipe.sim.workload import LengthDist, Synthetic

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_sim_stretch import Fixed

ROOT = Path(__file__).resolve().parents[2]
SEED_CLUSTER = ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"
DATA = Path(__file__).parents[1] / "data"


def _seed(duration_s: float, resources: list[dict[str, Any]], **extra: Any) -> Any:
    """The seed's cluster, llama-2-7b at 8 req/s (1024 in, 256 out) from t = 30 s; `extra`:
    more of the scenario (a `controller:` section)."""
    doc = {
        "name": "seed-short", "duration_s": duration_s, "seed": 0, "report_interval_s": 30,
        "cluster": {"file": str(SEED_CLUSTER)},
        "models": [{"name": "llama-7b", "model": "llama-2-7b",
                    "demand": {"request_rate_per_s": 8, "input_tokens": 1024,
                               "output_tokens": 256},
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}, "dtypes": ["bf16", "fp8"]}],
        "workloads": [{"model": "llama-7b", "arrivals": {"rate_per_s": 8, "start_s": 30},
                       "prompt_tokens": {"dist": "lognormal", "mean": 1024, "cv": 0.5,
                                         "max": 3072},
                       "output_tokens": {"dist": "exponential", "mean": 256, "max": 1024}}],
        "resources": resources,
        **extra,
    }  # fmt: skip
    return parse_scenario(doc, ROOT)


# The seed's give-back at 8 req/s (the L40S, the two A100s left at 100 % of their planned
# capacity) needs no down-shift headroom: the in-place shift the tests below read.
LAX = {"controller": {"shift": {"pricing": {"down_headroom": 0}}}}


@pytest.fixture(scope="module")
def tenant_leaves() -> Any:
    """The other tenant leaves gpu1 at t = 100 s (seed 000 §4.1). The plan for the GPUs free
    then (two A100s for the 8 req/s) gives the L40S back at 100 % of its capacity: with no
    down-shift headroom asked (`down_headroom: 0`; 0.25 by default keeps the three), the
    in-place shift the seed describes."""
    return simulate(_seed(220, [{"at_s": 100, "release": ["gpu1"]}], **LAX), "flexpipe")


def test_the_first_plan_is_the_planners_and_serves_once_loaded(tenant_leaves: Any) -> None:
    r = tenant_leaves
    first = r.shifts[0]
    cluster = load_cluster(SEED_CLUSTER)
    demand = r.demands[0]
    planned = plan(cluster, (demand,), now_s=0.0).instances
    # each instance serves as soon as it is loaded (as the executor does): fastest first
    load_s = {instance_key(p): engine_config(Deployment.of(p), cluster).load_time_s
              for p in planned}  # fmt: skip
    by_load = sorted(load_s, key=lambda k: (load_s[k], list(load_s).index(k)))
    assert first["trigger"] == "plan" and first["started"] == by_load
    assert len(set(load_s.values())) > 1  # the order says something
    cold = max(load_s.values())
    assert first["phases_s"] == {"warm": round(cold, 6), "switch": 0.0}
    assert first["finished_s"] == pytest.approx(cold)
    assert report(r)["first_served_s"] > 30  # the first request arrives at 30 s


def test_tenant_leaves_gpu1_an_in_place_shift_at_the_expected_time(tenant_leaves: Any) -> None:
    r = tenant_leaves
    assert [s["trigger"] for s in r.shifts] == ["plan", "resource"]
    shift = r.shifts[1]
    # the event wakes the controller at 100 s; the policy waits resource_settle_s (30 s), and
    # the controller ticks every 10 s from the wake-up: 110, 120, 130
    assert shift["at_s"] == 130.0
    assert shift["succeeded"] and shift["why_failed"] == ""
    assert "the GPUs free to us changed; replan" in shift["reason"] and shift["score"] > 0
    # gpu1's half-memory instance is relaunched in place with the whole GPU; gpu3 is given back
    assert shift["started"] == ["llama-7b|tp1-pp1-bf16-kvauto-s64|gpu1"]
    assert shift["stopped"] == [
        "llama-7b|tp1-pp1-bf16-kvauto-s32|gpu1",
        "llama-7b|tp1-pp1-fp8-kvauto-s48|gpu3",
    ]
    phases = shift["phases_s"]
    assert list(phases) == [
        "drain_in_place", "migrate_in_place", "release_in_place",
        "warm_in_place", "rehearse_in_place", "switch_in_place",
        "drain_rest", "migrate_rest", "release_rest",
    ]  # fmt: skip
    new = next(i for i in r.instances if i.planned is not None and i.launched_s > 100)
    old = next(i for i in r.instances if i.dep.gpu_ids == ("gpu1",) and i.launched_s == 0)
    # in place: the new instance starts when the old one is released, and warms for its cold
    # start (the performance model's), then rehearses for the probe's modelled time
    assert new.launched_s == old.released_s == pytest.approx(130 + phases["drain_in_place"])
    assert phases["warm_in_place"] == pytest.approx(new.ready_s - new.launched_s, abs=1e-6)
    freed = load_cluster(SEED_CLUSTER).with_used("gpu1", 0.0)
    cold_s = engine_config(new.dep, freed).load_time_s
    assert new.ready_s - new.launched_s == pytest.approx(cold_s, rel=1e-12)
    probe = rehearse(new.planned, load_cluster(SEED_CLUSTER).with_used("gpu1", 0.0), 2.0)
    assert shift["rehearsal"] == [probe] and probe["passed"]
    assert phases["rehearse_in_place"] == pytest.approx(probe["measured_s"], abs=1e-6)
    assert 0 < phases["drain_in_place"] < 30 and 0 < phases["drain_rest"] < 30
    assert new.num_kv_blocks > old.num_kv_blocks  # the larger KV cache the tenant left
    # every request on a leaving instance finished there before the 30 s deadline
    assert set(shift["migrated"]) == {"finished_in_place"}
    assert shift["finished_s"] == pytest.approx(130 + sum(v for k, v in phases.items()), abs=1e-6)
    rep = report(r)
    assert rep["num_failed"] == 0 and rep["num_completed"] == rep["num_requests"] > 1000
    assert rep["shifts_by_kind"] == {"plan": 1, "resource": 1}


def test_a_reclaim_with_notice_is_vacated_in_time_and_a_failure_loses_no_request() -> None:
    sc = _seed(300, [
        {"at_s": 60, "reclaim": ["gpu3"], "notice_s": 200, "owner": "batch"},
        {"at_s": 230, "fail": ["gpu0"]},
    ])  # fmt: skip
    r = simulate(sc, "flexpipe")
    rep = report(r)
    reclaim = r.shifts[1]
    # reclaim_lead_s (120 s) before the lease ends at 260 s
    assert reclaim["trigger"] == "reclaim" and reclaim["at_s"] == 140.0
    on_gpu3 = next(i for i in r.instances if i.dep.gpu_ids == ("gpu3",))
    assert on_gpu3.released_s < 260 and on_gpu3.died == ""
    # the reclaim moved gpu3's model onto gpu0, which then fails without notice at 230 s
    on_gpu0 = next(i for i in r.instances if i.dep.gpu_ids == ("gpu0",))
    assert on_gpu0.launched_s == 140.0 and on_gpu0.died == "gpu0 failed"
    assert on_gpu0.released_s == 230.0
    assert rep["num_failed"] == 0
    moved = rep["requests_migrated_by_method"]
    assert moved.get("failover_recomputed", 0) + moved.get("failover_rerun", 0) > 0
    # a moved request's tokens are its own: one answer of max_tokens, across both engines
    for req in r.requests:
        assert req.num_generated_tokens == req.num_output_tokens
    # the failovers, and what the reclaim moved at once (it would have outlived the deadline)
    by_shift = sum(
        n for s in r.shifts for k, n in s["migrated"].items() if k != "finished_in_place"
    )
    assert rep["num_requests_moved"] == sum(r.failovers.values()) + by_shift
    # the static plan has the same GPUs taken away and nothing re-planned
    static = simulate(sc, "static")
    died = sorted((i.dep.gpu_ids, i.died, i.released_s) for i in static.instances if i.died)
    assert died == [(("gpu3",), "gpu3 taken by batch", 260.0)]  # no instance on gpu0 there
    assert report(static)["shifts_by_kind"] == {} and report(static)["num_failed"] == 0
    assert sum(static.failovers.values()) > 0


def test_timeline_events_change_the_cluster_file() -> None:
    cluster = load_cluster(SEED_CLUSTER)
    freed = apply_event(cluster, TimelineEvent(5, "release", ("gpu1",)))
    assert freed.gpu("gpu1").used_bytes == 0 and freed.gpu("gpu1").owner is None
    taken = apply_event(freed, TimelineEvent(6, "occupy", ("gpu2",), owner="x"))
    assert taken.gpu("gpu2").free_bytes == 0 and taken.gpu("gpu2").owner == "x"
    lease = apply_event(cluster, TimelineEvent(7, "reclaim", ("gpu0",), notice_s=60))
    assert lease.gpu("gpu0").free_until_s == 67
    gone = apply_event(cluster, TimelineEvent(8, "fail", ("gpu2",)))
    assert gone.gpu_ids == ("gpu0", "gpu1", "gpu3")
    base = {"name": "t", "duration_s": 10, "cluster": {"file": str(SEED_CLUSTER)},
            "models": [{"name": "m", "model": "llama-2-7b"}],
            "workloads": [{"arrivals": {"rate_per_s": 1}}]}  # fmt: skip
    sc = parse_scenario({**base, "resources": [{"at_s": 9, "reclaim": "gpu0", "notice_s": 5}]},
                        ROOT)  # fmt: skip
    assert [(e.at_s, e.kind) for e in sc.resources] == [(9, "reclaim"), (14, "occupy")]
    for bad, msg in (
        ([{"at_s": 1, "fail": ["gpu9"]}], "unknown GPU"),
        ([{"at_s": 1, "fail": ["gpu0"], "release": ["gpu1"]}], "exactly one of"),
        ([{"at_s": -1, "release": ["gpu1"]}], "at_s must be"),
        ([{"at_s": 1, "fail_node": "node9"}], "node9"),
    ):
        with pytest.raises(ScenarioError, match=msg):
            parse_scenario({**base, "resources": bad}, ROOT)


def test_shift_steps_in_place_roll_and_a_whole_model_in_place_is_refused() -> None:
    cluster = load_cluster(SEED_CLUSTER)
    freed = cluster.with_used("gpu1", 0.0)
    r = simulate(_seed(1, []), "static")
    demand = r.demands[0]
    running = plan(cluster, (demand,), now_s=0).instances
    target = plan(freed, (demand,), now_s=0).instances
    steps = plan_shift(running, target)
    assert steps.refusal == "" and steps.now_adds == ()
    ((blockers, adds),) = steps.steps
    assert [b.gpu_ids for b in blockers] == [("gpu1",)] and [a.gpu_ids for a in adds] == [("gpu1",)]
    keys = {instance_key(t) for t in target}
    leaving = [i for i in running if instance_key(i) not in keys]
    assert list(steps.leaving) == [*blockers, *(i for i in leaving if i not in blockers)]
    # one instance replaced in place by one on the same GPU: serving would stop in between
    alone = running[:1]
    bigger = (replace(alone[0], gear=replace(alone[0].gear, max_num_seqs=8)),)
    refused = plan_shift(alone, bigger)
    assert "serving would stop in between" in refused.refusal
    assert probe_tokens(0.1, 0.02, 0.0, 0.05) == 16
    assert probe_tokens(0.1, 0.001, 1.0, 0.05) == 256
    assert probe_tokens(0.1, 0.01, 1.0, 0.05) == 41  # (0.5 - 0.1) / 0.01 + 1


def test_rate_window_is_the_rate_over_the_last_minute_of_readings() -> None:
    w = RateWindow({"m": 5.0})
    assert w.observe(0.0, {"m": 0}, ["m"]) == {"m": 5.0}
    assert w.observe(10.0, {"m": 30}, ["m"]) == {"m": 3.0}
    for t, n in ((20, 40), (30, 50), (40, 60), (50, 70), (60, 80), (70, 90)):
        w.observe(float(t), {"m": n}, ["m"])
    assert w.rates_per_s["m"] == pytest.approx((90 - 40) / (70 - 20))


# -- reports ----------------------------------------------------------------------------------


TWO = {"name": "a", "nodes": [{"name": "n0", "gpus": [
    {"id": "g0", "type": "A100-80G-SXM"}, {"id": "g1", "type": "L4"}]}]}  # fmt: skip


def _tiny() -> Any:
    doc = {"name": "tiny", "duration_s": 40, "seed": 0, "report_interval_s": 10,
           "cluster": {"inline": TWO},
           "models": [{"name": "m", "model": "llama-2-7b",
                       "slo": {"ttft_p99_ms": 200, "tpot_p99_ms": 30}}],
           "workloads": [{"model": "m", "arrivals": {"rate_per_s": 1, "start_s": 30}}],
           "resources": [{"at_s": 35, "occupy": ["g1"], "owner": "t2"}]}  # fmt: skip
    sc = parse_scenario(doc, DATA)
    # four requests by hand: 30, 31, 32, 33 s; 100 prompt tokens, 10 / 20 / 30 / 40 output
    fixed = [(30.0 + i, 100, 10 * (i + 1)) for i in range(4)]

    class Hand(Synthetic):
        def arrivals(self, rng: Any, until_s: float) -> Any:
            for t, p, o in fixed:
                yield (t, p, o, ())

    wl = Workload("m", Hand(1.0, prompt=LengthDist(), output=LengthDist()))
    return replace(sc, workloads=(wl,))


def test_report_figures_against_hand_computed_values(tmp_path: Path) -> None:
    sc = _tiny()
    dep = Deployment("a100", "m", "llama-2-7b", Gear(max_num_seqs=4), (("g0",),))
    r = simulate(sc, Fixed((dep,)))
    rep = report(r)
    reqs = r.requests
    assert [q.num_output_tokens for q in reqs] == [10, 20, 30, 40]
    assert all(q.completed for q in reqs) and rep["num_failed"] == 0
    good = [q for q in reqs if q.ttft_s <= 0.2 and q.tpot_s <= 0.03]
    assert rep["goodput_requests_per_s"] == round(len(good) / 40, 6)
    assert rep["slo_attainment"] == round(len(good) / 4, 6)
    assert rep["models"]["m"]["throughput_tokens_per_s"] == round(100 / 40, 6)
    span = max(q.finish_s for q in reqs) - 30.0
    assert rep["models"]["m"]["span_throughput_tokens_per_s"] == round(100 / span, 6)
    # one GPU held from 0 s to the end of the run (40 s): 40 GPU-seconds
    assert rep["gpu_hours_reserved"] == round(40 / 3600, 6)
    busy = sum(r.usage.busy_gpu_s)
    assert rep["utilisation"] == round(busy / 40, 6)
    # the peak-provisioned plan: the planner's for the busiest 10 s (4 requests: 0.4 req/s)
    peak_gpus = rep["reservation"]["peak_gpus"]
    assert peak_gpus >= 1
    assert rep["reservation"]["share_of_peak"] == round(40 / (peak_gpus * 40), 6)
    assert rep["first_served_s"] == round(reqs[0].first_token_s, 6)
    # phases cut at the timeline's event (35 s): completions counted where they ended
    p0, p1 = rep["phases"]
    assert (p0["start_s"], p0["end_s"], p1["start_s"], p1["end_s"]) == (0, 35, 35, 40)
    before = [q for q in reqs if q.finish_s < 35]
    assert p0["completed"] == len(before)
    assert p0["tokens_per_s"] == round(sum(q.num_generated_tokens for q in before) / 35, 6)
    assert p1["after"] == "t2 takes g1 (whole)"
    # occupancy: our instance on g0 the whole run; the tenant on g1 from 35 s
    occ = {row["gpu"]: row["segments"] for row in rep["gpu_occupancy"]}
    assert occ["g0"] == [{"start_s": 0.0, "end_s": 40.0, "holder": "a100", "model": "m"}]
    assert occ["g1"] == [{"start_s": 35.0, "end_s": 40.0, "holder": "tenant:t2"}]
    # timeline rows: interval 3 (30-40 s) holds every completion
    row = rep["timeline"][3]
    assert row["completed"] == 4 and row["tokens_per_s"] == round(100 / 10, 6)
    paths = write_reports(r, tmp_path)
    assert {p.name for p in paths} == {"report.json", "report.html", "requests.csv",
                                       "timeline.csv", "shifts.csv"}  # fmt: skip
    assert json.loads((tmp_path / "report.json").read_text()) == rep


def test_html_is_self_contained_and_has_the_plots(tenant_leaves: Any, tmp_path: Path) -> None:
    write_reports(tenant_leaves, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert page.startswith("<!doctype html>")
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", page)
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert page.count("<svg") == 4  # throughput, goodput, latency, occupancy
    assert 'aria-label="GPU occupancy"' in page and "Throughput over time" in page
    assert page.count('class="mark"') >= 2  # the shift and the tenant leaving, marked
    for gpu in ("gpu0", "gpu1", "gpu2", "gpu3"):
        assert f"{gpu} " in page
    shifts = (tmp_path / "shifts.csv").read_text().splitlines()
    assert shifts[0].startswith("at_s,finished_s,trigger") and len(shifts) == 3
    assert shifts[2].split(",")[2] == "resource"


def test_compare_table_and_scenario_plans() -> None:
    runner = CliRunner()
    out = runner.invoke(
        app, ["sim", "seed-3way", "--compare", "tp2-fast-pair,forced-3way", "--duration-s", "35",
              "--quiet"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "tp2-fast-pair" in out.output and "forced-3way" in out.output
    assert "tokens/s over the span" in out.output and "reservation / peak" in out.output
    out = runner.invoke(app, ["sim", "list"])
    for name in ("seed-fragmented", "seed-3way", "bursty-serverless", "multi-model-diurnal",
                 "cluster-1024"):  # fmt: skip
        assert name in out.output
    out = runner.invoke(app, ["sim", "seed-3way", "--policy", "nope"])
    assert out.exit_code == 2 and "tp2-fast-pair" in out.output  # the scenario's plans listed


def test_builtin_scenario_files_parse() -> None:
    for name in ("bursty-serverless", "multi-model-diurnal", "cluster-1024", "seed-3way"):
        doc = yaml.safe_load((ROOT / "flexpipe" / "sim" / "scenarios" / f"{name}.yaml")
                             .read_text())  # fmt: skip
        assert doc["name"] == name


def test_each_workload_keeps_its_model() -> None:
    """Several workloads merge in time order, each request labelled with its own model."""
    from flexpipe.sim.arrivals import generate_requests

    base = {"name": "t", "duration_s": 60, "cluster": {"file": str(SEED_CLUSTER)},
            "models": [{"name": "a", "model": "llama-2-7b"}, {"name": "b", "model": "mistral-7b"}],
            "workloads": [{"model": "a", "arrivals": {"rate_per_s": 2}},
                          {"model": "b",
                           "arrivals": {"rate_per_s": 1, "start_s": 30}}]}  # fmt: skip
    reqs = generate_requests(parse_scenario(base, ROOT))
    assert {r.model for r in reqs} == {"a", "b"}
    assert all(r.arrival_s >= 30 for r in reqs if r.model == "b")
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


def test_wait_for_ideal_starts_when_four_identical_linked_gpus_join() -> None:
    join = {"node": "node1", "links": [{"gpus": ["gpu1", "gpu2", "gpu4", "gpu5"],
                                        "link": "nvlink3"}],
            "gpus": [{"id": "gpu4", "type": "A100-80G-SXM", "index": 2},
                     {"id": "gpu5", "type": "A100-80G-SXM", "index": 3}]}  # fmt: skip
    sc = _seed(100, [{"at_s": 10, "release": ["gpu1"]}, {"at_s": 60, "join": join}])
    r = simulate(sc, "wait-for-ideal")
    (rec,) = r.instances
    assert rec.launched_s == 60.0 and rec.dep.gear.tp == 4
    assert set(rec.dep.gpu_ids) == {"gpu1", "gpu2", "gpu4", "gpu5"}
    rep = report(r)
    assert rep["first_served_s"] > rec.ready_s > 60
    early = [q for q in r.requests if q.arrival_s < rec.ready_s]
    assert early and all(q.failed.startswith("404") for q in early)
    occ = {row["gpu"]: row["segments"] for row in rep["gpu_occupancy"]}
    # held to the run's end: the drain after the 100 s of arrivals, until the last request
    end = rep["run_end_s"]
    assert end == pytest.approx(max(q.finish_s for q in r.requests), abs=1e-6) and end > 100
    assert occ["gpu4"] == [{"start_s": 60.0, "end_s": end, "holder": rec.dep.name,
                            "model": "llama-7b"}]  # fmt: skip
    with pytest.raises(ScenarioError, match="already in the cluster"):
        _seed(10, [{"at_s": 1, "join": {"node": "node1", "gpus": [{"id": "gpu0", "type": "L4"}]}}])


def test_requests_left_at_the_drain_deadline_are_moved_by_kv_or_recompute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 0.5 s drain deadline leaves requests running on the leaving instances: each one is
    moved (KV over NVLink from gpu1 where that beats recomputing, else recomputed), admitted
    on its destination ahead of the queue (priority -1, as the gateway sends it), and ends
    with all its tokens; none fails."""
    from flexpipe.gateway.core.warm_up import MOVE_PRIORITY
    from flexpipe.sim.gateway import SimGateway

    placed: list[int] = []  # the priority of each request a move placed
    place = SimGateway.place

    def spy_place(self: SimGateway, req: Any, url: str, now: float) -> None:
        placed.append(req.priority)
        place(self, req, url, now)

    monkeypatch.setattr(SimGateway, "place", spy_place)
    sc = _seed(220, [{"at_s": 100, "release": ["gpu1"]}], **LAX)
    r = simulate(replace(sc, controller=replace(sc.controller, drain_deadline_s=0.5)), "flexpipe")
    rep = report(r)
    shift = r.shifts[1]
    # what would outlive the deadline moves at once (`plan_moves` waves): the in-place
    # instance empties before its deadline; on the other, requests are still left at it
    # (the drain ends once the early recompute moves, pre-copied, have cut over, as the
    # executor awaits them: at most their warm-up's bound and as long again)
    assert 0 < shift["phases_s"]["drain_in_place"] < 0.5
    # (and, since a warm-up waits for the fence of a cut-over before it on its destination,
    # up to MAX_FENCE_S more: here 0.631 s)
    assert 0.5 <= shift["phases_s"]["drain_rest"] < 0.7
    moved = shift["migrated"]
    assert moved.get("kv_moved", 0) > 0 and moved.get("recomputed", 0) > 0
    # the in-place instance's KV crosses NVLink: its migrate phase is the longest transfer
    assert 0 < shift["phases_s"]["migrate_in_place"] < 0.1
    assert rep["num_failed"] == 0
    assert rep["num_requests_moved"] == moved["kv_moved"] + moved["recomputed"] + moved.get(
        "rerun", 0
    )
    for req in r.requests:
        if r.num_moves.get(req.request_id):
            assert req.completed and req.num_generated_tokens == req.num_output_tokens
    assert placed == [MOVE_PRIORITY] * rep["num_requests_moved"]


def seven_b(name: str) -> dict[str, Any]:
    """A llama-2-7b model entry configured for 1 req/s of 512 + 128 tokens."""
    return {"name": name, "model": "llama-2-7b",
            "demand": {"request_rate_per_s": 1, "input_tokens": 512, "output_tokens": 128},
            "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}, "dtypes": ["bf16"]}  # fmt: skip


def fixed_workload(name: str, rate_per_s: float, start_s: float) -> dict[str, Any]:
    """Poisson arrivals from `start_s`, 512 prompt and 128 output tokens each."""
    return {"model": name, "arrivals": {"rate_per_s": rate_per_s, "start_s": start_s},
            "prompt_tokens": {"dist": "fixed", "mean": 512},
            "output_tokens": {"dist": "fixed", "mean": 128}}  # fmt: skip


def _two_models(duration_s: float) -> Any:
    """chat and code (llama-2-7b each, 1 req/s from 30 s) on the seed's cluster; chat's load
    rises by 20 req/s at 60 s."""
    model, workload = seven_b, fixed_workload
    doc = {
        "name": "two-models", "duration_s": duration_s, "seed": 0, "report_interval_s": 30,
        "cluster": {"file": str(SEED_CLUSTER)}, "models": [model("chat"), model("code")],
        "workloads": [workload("chat", 1, 30), workload("code", 1, 30), workload("chat", 20, 60)],
    }  # fmt: skip
    return parse_scenario(doc, ROOT)


def test_two_models_the_one_whose_load_rises_shifts_up() -> None:
    """The controller reads each model's share of the gateway's wait queue
    (`queued_by_model`): chat's requests wait there, not in its engine (it is registered with
    its max_num_seqs), so without it chat's queue reads 0 and no up-shift ever comes."""
    r = simulate(_two_models(120), "flexpipe")
    assert [s["trigger"] for s in r.shifts] == ["plan", "up"]
    first, up = r.shifts
    assert first["started"] == ["chat|tp1-pp1-bf16-kvauto-s96|gpu2",
                                "code|tp1-pp1-bf16-kvauto-s48|gpu3"]  # fmt: skip
    assert up["at_s"] == pytest.approx(116.738415616, abs=1e-6)
    assert up["outcome"] == "succeeded" and up["stopped"] == []
    assert up["started"] == ["chat|tp1-pp1-bf16-kvauto-s64|gpu1"]  # chat gets a second one
    decision = next(d for d in r.decisions if d["action"] == "shift" and d["trigger"] == "up")
    assert decision["reason"].startswith("chat in the up zone 5 samples in a row")


def test_a_shift_the_step_plan_refuses_is_recorded_refused_never_blacklisted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A target that replaces a model's only instance in place (`plan_shift` refuses it:
    serving would stop in between) changes nothing, is recorded refused (the shift log's
    `refused`, `ShiftRecord.refused`), and twice refused is not blacklisted (two failures
    would be: `max_failures` 2)."""
    from flexpipe.policies.shift import ShiftPolicy
    from flexpipe.policies.shift.pricing import Price
    from flexpipe.policies.shift.triggers import blacklist

    real = ShiftPolicy.decide
    seen: list[Any] = []  # the snapshots after the forced shifts

    def decide(self: ShiftPolicy, snapshot: Any, now_s: float, rng: Any) -> Any:
        decision = real(self, snapshot, now_s, rng)
        if not snapshot.running:
            return decision
        forced = sum(1 for h in snapshot.history if h.started_s > 0)
        if forced >= 2:
            seen.append((snapshot, now_s, self.params.triggers))
            return decision
        (alone,) = (i for i in snapshot.running if i.gpu_ids == ("gpu2",))
        bigger = replace(alone, gear=replace(alone.gear, max_num_seqs=8))
        others = tuple(i for i in snapshot.running if i is not alone)
        price = Price(1.0, 2.0, 1, 1, 600.0, 600.0, 0.0, 0.0, 0.0, 0.0,
                      (instance_key(bigger),), (instance_key(alone),), ())  # fmt: skip
        return replace(decision, action="shift", trigger="up", reason="forced: in place",
                       target=(*others, bigger), price=price)  # fmt: skip

    monkeypatch.setattr(ShiftPolicy, "decide", decide)
    sc = replace(_two_models(70), workloads=_two_models(70).workloads[:2])
    r = simulate(sc, "flexpipe")
    refused = r.shifts[1:]
    assert len(refused) == 2
    for s in refused:
        assert s["outcome"] == "refused" and s["refused"] and not s["succeeded"]
        assert "serving would stop in between" in s["why_failed"]
        assert s["phases_s"] == {} and s["started"] == [] and s["stopped"] == []
    assert len(r.instances) == 2 and all(i.released_s < 0 for i in r.instances)
    snapshot, now_s, params = seen[0]
    records = [h for h in snapshot.history if h.started_s > 0]
    assert [(h.refused, h.failed, h.succeeded) for h in records] == [(True, False, False)] * 2
    assert blacklist(snapshot.history, now_s, params) == {}
    failed = [replace(h, refused=False) for h in snapshot.history]
    assert blacklist(failed, now_s, params)  # the same two as failures: blacklisted


def test_instances_go_through_the_pool_lifecycle_as_the_executor_tells_the_gateway(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every state the gateway's pool holds, per instance, in order: the first plan's join
    starting and go active (nothing to rehearse against); the in-place shift's new instance
    is starting (loaded), rehearsing, active; the ones it replaces drain and are gone. Every
    change is checked by the pool against the one lifecycle (an illegal one would raise)."""
    from flexpipe.gateway.core.pool import Pool
    from flexpipe.lifecycle import State

    states: dict[str, list[str]] = {}
    add, set_state, remove = Pool.add, Pool.set_state, Pool.remove

    def spy_add(self: Pool, url: str, *args: Any, **kw: Any) -> Any:
        inst = add(self, url, *args, **kw)
        states.setdefault(url, []).append(inst.state.value)
        return inst

    def spy_set_state(self: Pool, url: str, state: State) -> Any:
        inst = set_state(self, url, state)
        if states[url][-1] != inst.state.value:
            states[url].append(inst.state.value)
        return inst

    def spy_remove(self: Pool, url: str) -> Any:
        inst = remove(self, url)
        states[url].append(inst.state.value)
        return inst

    monkeypatch.setattr(Pool, "add", spy_add)
    monkeypatch.setattr(Pool, "set_state", spy_set_state)
    monkeypatch.setattr(Pool, "remove", spy_remove)
    r = simulate(_seed(220, [{"at_s": 100, "release": ["gpu1"]}], **LAX), "flexpipe")
    shift = r.shifts[1]
    url_of = {rec.key: rec.instance.url for rec in r.instances}
    first = r.shifts[0]["started"]
    for key in first:
        assert states[url_of[key]] == (
            ["starting", "active", "draining", "gone"] if key in shift["stopped"]
            else ["starting", "active"]
        )  # fmt: skip
    (new,) = shift["started"]
    assert states[url_of[new]] == ["starting", "rehearsing", "active"]
    assert len(states) == len(r.instances) == len(first) + 1


def test_sim_engines_schedule_as_the_launcher_starts_them() -> None:
    """The sim's engine cores take the scheduling policy `flexpipe up` launches engines with
    (a moved request's priority -1 admits it ahead of the queue only under "priority")."""
    from flexpipe.engine.args import parse_engine_args
    from flexpipe.launch.base import EngineSpec
    from flexpipe.launch.command import vllm_flags

    launched = parse_engine_args(vllm_flags(EngineSpec("llama-2-7b"), "127.0.0.1", 8000))
    dep = Deployment("a", "m", "llama-2-7b", Gear(max_num_seqs=4), (("gpu2",),))
    sim = engine_config(dep, load_cluster(SEED_CLUSTER))
    assert sim.scheduling_policy == launched.scheduling_policy == "priority"


def test_the_controller_sees_each_ttft_when_the_first_token_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the live gateway observes TTFT when a stream's first token reaches its client (not
    when the request ends), so does the simulated one the controller reads: once a client
    request, warm-ups and continuations not counted."""
    from flexpipe.sim.controller import SimController

    seen: list[tuple[str, float, float]] = []  # model, TTFT, virtual time observed
    original = SimController.first_token

    def spy(self: SimController, model: str, ttft_s: float) -> None:
        seen.append((model, ttft_s, self.world.loop.now_s))
        original(self, model, ttft_s)

    monkeypatch.setattr(SimController, "first_token", spy)
    # the tenant leaves gpu1 at 100 s: an in-place shift with a 1 s drain deadline moves
    # requests (warm-ups, continuations)
    sc = _seed(220, [{"at_s": 100, "release": ["gpu1"]}], **LAX)
    controller = replace(sc.controller, drain_deadline_s=1.0)
    result = simulate(replace(sc, controller=controller), "flexpipe")
    assert result.num_moves and result.warm_ups
    served = sorted(
        (r for r in result.requests if r.first_token_s >= 0), key=lambda r: r.first_token_s
    )
    assert len(served) > 50
    assert len(seen) == len(served)
    for (model, ttft_s, at_s), r in zip(sorted(seen, key=lambda s: s[2]), served, strict=True):
        assert model == r.model
        assert ttft_s == pytest.approx(r.ttft_s, abs=1e-9)
        assert at_s == pytest.approx(r.first_token_s, abs=1e-9)
    # seen well before the end: the window the shift policy reads does not lag by a decode
    long = [r for r in served if r.completed and r.num_generated_tokens > 100]
    assert long and all(r.first_token_s < r.finish_s - 1.0 for r in long)


def test_a_model_no_gpu_can_place_is_refused_with_the_reason_then_held_again() -> None:
    """Another tenant takes every GPU at 60 s and gives them back at 200 s. As live: while no
    GPU free to us can place llama-7b its requests fail at once with a 503 and the planner's
    reason (not a 404, not a wait for a cold start that cannot come); from the release it is
    held again, the floor re-plans it, and the requests that arrive meanwhile wait for it."""
    gpus = ["gpu0", "gpu1", "gpu2", "gpu3"]
    sc = _seed(300, [{"at_s": 60, "occupy": gpus, "owner": "batch"},
                     {"at_s": 200, "release": gpus}])  # fmt: skip
    r = simulate(sc, "flexpipe")
    gap = [q for q in r.requests if 60 <= q.arrival_s < 200]
    assert gap and all(
        q.failed.startswith("503: The model `llama-7b` cannot be served now: no GPU free to us "
                            "can place llama-7b") and q.finish_s == q.arrival_s
        for q in gap
    )  # fmt: skip
    assert "gpu0 fully held by batch" in gap[0].failed  # the planner's words
    after = [q for q in r.requests if q.arrival_s >= 200]
    assert after and all(q.completed for q in after), {q.failed for q in after}
    assert [(s["at_s"], s["trigger"]) for s in r.shifts] == [(0.0, "plan"), (200.0, "floor")]
