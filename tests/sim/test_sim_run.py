"""Whole simulated runs: a golden event sequence, determinism, conservation, the policies,
the reports and the `flexpipe sim` command."""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.gears.gear import Gear
from flexpipe.perf import BatchShape
from flexpipe.sim import builtin_scenarios, load_scenario, report, report_json, resolve, simulate
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.engine_factory import engine_config
from flexpipe.sim.policy import PolicyView
from flexpipe.sim.report import percentile, requests_csv, timeline_csv
from flexpipe.sim.scenario import ScenarioError, parse_scenario

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_sim_stretch import Fixed

DATA = Path(__file__).parents[1] / "data"
TWO_GPUS = {"name": "a", "nodes": [{"name": "n0", "gpus": [
    {"id": "g0", "type": "A100-80G-SXM"}, {"id": "g1", "type": "L4"}]}]}  # fmt: skip
MODEL = {"name": "m", "model": "llama-2-7b", "slo": {"ttft_p99_ms": 500, "tpot_p99_ms": 30}}
DEPS = (
    Deployment("a100", "m", "llama-2-7b", Gear(max_num_seqs=4), (("g0",),)),
    Deployment("l4", "m", "llama-2-7b", Gear(max_num_seqs=4), (("g1",),)),
)


def _golden_scenario():  # type: ignore[no-untyped-def]
    doc = {
        "name": "golden", "duration_s": 32.2, "seed": 0, "report_interval_s": 10,
        "cluster": {"inline": TWO_GPUS}, "models": [MODEL],
        "workloads": [{"model": "m", "trace": {
            "kind": "azure", "file": "azure_conv_head.csv", "offset_s": 30, "speedup": 4}}],
    }  # fmt: skip
    return parse_scenario(doc, DATA)


GOLDEN_FILE = DATA / "sim_golden_events.txt"
REGENERATE = "FLEXPIPE_REGENERATE_GOLDEN"


def golden_lines(log: Sequence[tuple[float, str, str]], result: Any) -> list[str]:
    """Every gateway event at its time (microseconds), then each instance's step count and
    busy time: what the golden file holds."""
    lines = [f"{t:.6f} {e} {d}" for t, e, d in log]
    for rec in result.instances:
        inst = rec.instance
        lines.append(f"instance {rec.dep.name} steps {inst.num_steps} busy_s {inst.busy_s:.6f}")
    return lines


def test_golden_event_sequence() -> None:
    """Two instances (max 4 sequences each) and the first 11 rows of the Azure trace at 4x:
    every gateway event, in order, at its exact time (performance-model arithmetic only),
    against tests/data/sim_golden_events.txt. A change of behaviour fails here; after an
    intended one, regenerate the file (FLEXPIPE_REGENERATE_GOLDEN=1 pytest -k golden) and
    review its diff."""
    log: list[tuple[float, str, str]] = []
    result = simulate(_golden_scenario(), Fixed(DEPS), log=log)
    lines = golden_lines(log, result)
    if os.environ.get(REGENERATE):
        header = [line for line in GOLDEN_FILE.read_text().splitlines() if line.startswith("#")]
        GOLDEN_FILE.write_text("\n".join([*header, *lines]) + "\n")
    expected = [x for x in GOLDEN_FILE.read_text().splitlines() if not x.startswith("#")]
    assert lines == expected
    assert len(expected) > 30 and {"route", "done"} <= {x.split()[1] for x in expected}
    # the first request reached an idle engine: its TTFT is one prefill step of its prompt
    first = result.requests[0]
    pm = engine_config(DEPS[0], _golden_scenario().cluster).pm
    assert first.ttft_s == pytest.approx(
        pm.step_time_s(BatchShape.of(prefills=[(374, 0)])), rel=1e-12
    )
    assert first.num_generated_tokens == 44 and first.instance == "a100"


def test_same_seed_same_bytes_and_another_seed_differs() -> None:
    sc = replace(load_scenario(resolve("seed-fragmented")), duration_s=120)
    a, b = simulate(sc), simulate(sc)
    assert report_json(a) == report_json(b)
    assert requests_csv(a) == requests_csv(b) and timeline_csv(a) == timeline_csv(b)
    c = simulate(replace(sc, seed=1))
    assert requests_csv(c) != requests_csv(a)


def test_conservation_every_request_ends_and_tokens_add_up() -> None:
    doc = {
        "name": "c", "duration_s": 60, "seed": 4, "report_interval_s": 10,
        "cluster": {"inline": TWO_GPUS}, "models": [MODEL],
        "workloads": [{"model": "m", "arrivals": {"process": "gamma", "rate_per_s": 8, "cv": 2},
                       "prompt_tokens": {"dist": "lognormal", "mean": 800, "cv": 1, "max": 6000},
                       "output_tokens": {"dist": "exponential", "mean": 150, "max": 800}}],
        "gateway": {"max_queue": 5, "max_queue_wait_s": 1.0, "max_concurrency_per_instance": 4},
    }  # fmt: skip
    sc = parse_scenario(doc, DATA)
    result = simulate(sc, Fixed(DEPS))
    reqs = result.requests
    assert all(r.completed != bool(r.failed) and r.finish_s >= r.arrival_s for r in reqs)
    done = [r for r in reqs if r.completed]
    assert all(r.num_generated_tokens == r.num_output_tokens for r in done)
    assert all(r.arrival_s <= r.first_token_s <= r.last_token_s <= r.finish_s for r in done)
    reasons = {r.failed.split(":")[0] for r in reqs if r.failed}
    assert reasons == {"404", "400", "429"}  # cold start, too long for 4096, queue full/timeout
    rep = report(result)
    assert rep["num_completed"] + rep["num_failed"] == len(reqs)
    # GPU-seconds add up: the timeline's reserved and busy GPU time are the totals, to the
    # run's end (the last request ended after the 60 s of arrivals: its GPU time is billed)
    u = result.usage
    assert u.end_s == result.end_s > sc.duration_s
    assert sum(u.reserved_gpu_s) == pytest.approx(2 * u.end_s)
    busy = sum(rec.instance.busy_s for rec in result.instances if rec.instance)
    assert sum(u.busy_gpu_s) == pytest.approx(busy)
    assert rep["utilisation"] == pytest.approx(sum(u.busy_gpu_s) / sum(u.reserved_gpu_s), abs=1e-6)


def test_wait_for_ideal_serves_nothing_on_the_fragmented_cluster() -> None:
    sc = replace(load_scenario(resolve("seed-fragmented")), duration_s=60)
    rep = report(simulate(sc, "wait-for-ideal"))
    assert rep["num_completed"] == 0 and rep["gpu_hours_reserved"] == 0
    assert rep["models"]["llama-7b"]["failed_by_reason"] == {"404": rep["num_requests"]}
    # each failure says why: the model was never placed, and the note says why not
    assert {r["why"] for r in rep["failures"]} == {
        "404: no instance of model 'llama-7b' was ever placed (the notes say why)"
    }
    assert any(
        n.startswith("llama-7b (llama-2-7b): policy wait-for-ideal never placed")
        for n in rep["notes"]
    )
    # (cut to 60 s, the scenario's events at 300 s and 2,400 s never came: said too)
    assert sum(1 for n in rep["notes"] if n.endswith("did not happen: the run ended at 60 s")) == 2


def test_wait_for_ideal_runs_tp4_when_four_identical_gpus_exist() -> None:
    doc = {
        "name": "hgx", "duration_s": 60, "seed": 0,
        "cluster": {"inline": {"name": "hgx", "nodes": [{"name": "n", "gpus": [
            {"id": f"g{i}", "type": "A100-80G-SXM"} for i in range(4)],
            "links": [{"gpus": ["g0", "g1", "g2", "g3"], "link": "nvlink3"}]}]}},
        "models": [MODEL],
        "workloads": [{"model": "m", "arrivals": {"rate_per_s": 2, "start_s": 40},
                       "prompt_tokens": {"mean": 100}, "output_tokens": {"mean": 10}}],
    }  # fmt: skip
    rep = report(simulate(parse_scenario(doc, DATA), "wait-for-ideal"))
    assert [i["gear"].split("-")[0] for i in rep["instances"]] == ["tp4"]
    assert rep["num_completed"] == rep["num_requests"] > 0


def test_round_robin_and_peak_policies() -> None:
    sc = replace(load_scenario(resolve("seed-fragmented")), duration_s=90)
    rr = report(simulate(sc, "round_robin"))
    assert rr["routing"] == "round_robin" and rr["policy"] == "round_robin"
    flex = report(simulate(sc, "flexpipe"))
    assert flex["routing"] == "prefix_affinity"
    peak = report(simulate(sc, "peak"))  # steady load: the peak interval is above the mean
    assert peak["reservation"]["share_of_peak"] == 1.0
    # like for like: the peak-provisioned baseline priced over flexpipe's own span (a down
    # shift once the requests have ended releases GPUs after the last of them, and so
    # lengthens flexpipe's span past the peak run's, whose raw GPU-hours then read lower)
    assert flex["reservation"]["share_of_peak"] <= 1.0
    assert flex["reservation"]["peak_gpus"] == peak["reservation"]["peak_gpus"]


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0
    assert percentile([5.0], 99) == 5.0


def test_builtin_scenarios_load() -> None:
    names = builtin_scenarios()
    assert {"seed-fragmented", "azure-conversation", "mooncake-prefix"} <= set(names)
    for path in names.values():
        load_scenario(path)


def test_bad_scenarios_are_one_line_errors(tmp_path: Path) -> None:
    base = {"name": "x", "duration_s": 10, "cluster": {"inline": TWO_GPUS}, "models": [MODEL],
            "workloads": [{"model": "m", "arrivals": {"rate_per_s": 1}}]}  # fmt: skip
    for change, msg in (
        ({"duration_s": -1}, "duration_s must be a positive number"),
        ({"workloads": [{"model": "nope", "arrivals": {"rate_per_s": 1}}]}, "is not one of"),
        ({"workloads": [{"model": "m", "arrivals": {"rate_per_s": 1, "bogus": 2}}]}, "bogus"),
        ({"workloads": [{"model": "m", "trace": {"kind": "azure", "file": "x.csv"}}]}, "x.csv"),
        ({"colour": 1}, "unknown key"),
        ({"cluster": {}}, "give `file`, `inline` or `generate`"),
    ):
        with pytest.raises(ScenarioError, match=msg):
            sc = parse_scenario({**base, **change}, tmp_path)
            simulate(sc)


def test_cli_list_run_compare_and_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["sim", "list"])
    assert out.exit_code == 0 and "seed-fragmented" in out.output
    out = runner.invoke(
        app, ["sim", "seed-fragmented", "--duration-s", "60",
              "--compare", "flexpipe,wait-for-ideal", "--out", str(tmp_path)],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "goodput req/s" in out.output and "wait-for-ideal" in out.output
    rep = json.loads((tmp_path / "flexpipe" / "report.json").read_text())
    assert rep["policy"] == "flexpipe" and rep["num_completed"] > 0
    assert (tmp_path / "wait-for-ideal" / "requests.csv").read_text().startswith("request_id,")
    out = runner.invoke(app, ["sim", "seed-fragmented", "--duration-s", "30", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["duration_s"] == 30
    out = runner.invoke(app, ["sim", "seed-fragmented", "--policy", "magic"])
    assert out.exit_code == 2 and "unknown policy 'magic'" in out.output
    out = runner.invoke(app, ["sim", str(tmp_path / "missing.yaml")])
    assert out.exit_code == 2 and "cannot read the file" in out.output


@dataclass
class Switch:
    """A policy seam test: runs a100 first, then from t = 40 only l4 (a plan change)."""

    name: str = "switch"
    routing: str | None = None
    interval_s: float | None = 20.0

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None:
        # 32 slots each: the L4 alone keeps up with the load (4 would not: the gateway caps
        # in-flight requests at max_num_seqs, as live, and the queue would time out)
        a100, l4 = (replace(d, gear=Gear(max_num_seqs=32)) for d in DEPS)
        return [a100] if now < 40 else [l4]


def test_a_policy_that_changes_the_plan_launches_and_drains() -> None:
    doc = {
        "name": "switch", "duration_s": 120, "seed": 2, "report_interval_s": 10,
        "cluster": {"inline": TWO_GPUS}, "models": [MODEL],
        "workloads": [{"model": "m", "arrivals": {"rate_per_s": 1, "start_s": 28},
                       "prompt_tokens": {"mean": 300}, "output_tokens": {"mean": 300}}],
    }  # fmt: skip
    result = simulate(parse_scenario(doc, DATA), Switch())
    a100, l4 = result.instances
    assert (a100.dep.name, a100.launched_s, a100.stopped_s) == ("a100", 0.0, 40.0)
    assert (l4.dep.name, l4.launched_s, l4.stopped_s, l4.released_s) == ("l4", 40.0, -1.0, -1.0)
    on_a100 = [r for r in result.requests if r.instance == "a100"]
    assert on_a100 and all(r.completed and r.arrival_s < 40 for r in on_a100)
    assert a100.released_s == max(r.finish_s for r in on_a100) > 40  # drained, then freed
    later = [r for r in result.requests if r.arrival_s > l4.ready_s + 1]
    assert later and all(r.instance == "l4" for r in later)
    # between the drain and l4's cold start nothing serves the model: the naive swap's gap
    # (503 while the draining a100 is still in the pool, 404 once it has left)
    gap = [r for r in result.requests if 40 < r.arrival_s < l4.ready_s]
    assert gap and {r.failed[:3] for r in gap} == {"503", "404"}
    reserved = sum(result.usage.reserved_gpu_s)  # l4 held to the run's end
    assert reserved == pytest.approx(a100.released_s + (result.usage.end_s - 40))


def test_public_api() -> None:
    import flexpipe.sim as sim

    assert sorted(sim.__all__) == sorted(
        ["POLICIES", "Deployment", "EventLoop", "Policy", "PolicyView", "Scenario",
         "ScenarioError", "SimRequest", "SimResult", "builtin_scenarios", "create_policy",
         "load_scenario", "parse_scenario", "report", "report_json", "resolve", "simulate",
         "write_reports"]
    )  # fmt: skip
    assert all(hasattr(sim, name) for name in sim.__all__)
    assert set(sim.POLICIES) == {"flexpipe", "round_robin", "static", "peak", "peak-slo",
                                 "autoscaler", "wait-for-ideal"}  # fmt: skip


def test_the_gateway_queue_serves_in_order_and_times_out() -> None:
    """One slot, 30-token answers (~0.28 s each): the second request waits and starts the
    instant the first ends; the third gives up after max_queue_wait_s; a fourth finds the
    queue full."""
    doc = {
        "name": "q", "duration_s": 40, "seed": 0, "cluster": {"inline": TWO_GPUS},
        "models": [MODEL],
        "workloads": [{"model": "m", "arrivals": {"rate_per_s": 1000, "start_s": 30},
                       "prompt_tokens": {"mean": 100}, "output_tokens": {"mean": 30}}],
        "gateway": {"max_concurrency_per_instance": 1, "max_queue": 2, "max_queue_wait_s": 0.4},
    }  # fmt: skip
    sc = parse_scenario(doc, DATA)
    sc = replace(sc, duration_s=30.0035)  # a handful of requests at 1000/s
    log: list[tuple[float, str, str]] = []
    result = simulate(sc, Fixed(DEPS[:1]), log=log)
    reqs = result.requests
    assert len(reqs) >= 4
    first, second, third, fourth = reqs[:4]
    assert first.completed and second.completed
    assert second.instance == "a100"
    route_second = next(t for t, e, d in log if e == "route" and d.startswith("1 "))
    assert route_second == first.finish_s  # woken by the freed slot, at once
    assert third.failed.startswith("429: all instances stayed busy")
    assert third.finish_s == pytest.approx(third.arrival_s + 0.4)
    assert fourth.failed == "429: all instances are busy and the queue is full"
    assert fourth.finish_s == fourth.arrival_s


def test_failure_reasons_group_without_their_numbers_and_instance() -> None:
    from flexpipe.sim.report import why_class

    a = "400: the context is 9000 tokens, over 8192 (a100-0)"
    b = "400: the context is 8500 tokens, over 8192 (l4-1)"
    assert why_class(a) == why_class(b) == "400: the context is N tokens, over N"
    lost = "503: no healthy instance serves model `m` right now (its instance was lost)"
    assert why_class(lost) == lost  # an explanation in parentheses stays


def test_a_model_never_placed_is_explained_and_one_without_requests_has_no_latency() -> None:
    """llama-2-7b on one L4 with 1,000-token prompts within a 2 s TTFT: the planner places
    nothing. Each failure and a note say so (the gateway alone could only say "not yet";
    once the controller ticks, it refuses m7 with the planner's reason);
    the model with no request reports no latency, not a latency of 0."""
    doc = {
        "name": "unplaced", "duration_s": 20, "seed": 1, "report_interval_s": 10,
        "cluster": {"inline": {"name": "t", "nodes": [
            {"name": "n0", "gpus": [{"id": "g0", "type": "L4", "index": 0}]}]}},
        "models": [{"name": "m7", "model": "llama-2-7b",
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}},
                   {"name": "idle", "model": "llama-2-7b",
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}}],
        "workloads": [{"model": "m7", "arrivals": {"rate_per_s": 1},
                       "prompt_tokens": {"dist": "fixed", "mean": 1000},
                       "output_tokens": {"dist": "fixed", "mean": 64}}],
    }  # fmt: skip
    rep = report(simulate(parse_scenario(doc, DATA), "flexpipe"))
    assert rep["num_requests"] > 5 and rep["num_completed"] == 0
    # before the controller's first tick (the first plan loading) the gateway does not know
    # m7: 404; from then on no GPU free to us can place it, so it is refused with the reason
    never = "404: no instance of model 'm7' was ever placed (the notes say why)"
    refused = (
        "503: The model `m7` cannot be served now: no GPU free to us can place m7 "
        "(llama-N-7b): m7: minimum of N instance(s) not met, N fit on the GPUs left "
        "(left out: g0 no model's gear fits it within the SLOs)"
    )
    by_why = rep["failed_by_why"]
    assert set(by_why) == {never, refused} and by_why[refused] > by_why[never] > 0
    assert sum(by_why.values()) == rep["num_requests"]
    (note,) = [n for n in rep["notes"] if n.startswith("m7 ")]
    assert "never placed an instance" in note and "1000 tokens in / 64 out" in note
    assert "g0: no model's gear fits it within the SLOs" in note
    assert rep["models"]["idle"]["num_requests"] == 0
    assert rep["models"]["idle"]["ttft_s"] == {"p50": None, "p90": None, "p99": None}
    assert all(row["ttft_p50_s"] is None for row in rep["timeline"])


def test_requests_queued_through_the_cold_start_do_not_wait_out_the_whole_hold() -> None:
    """The first plan's models are held while their engines load (600 s, renewed). Requests
    queued then wait, once the hold ends, the queue's own wait, no longer: when every
    instance is lost at 45 s, nothing sits in the queue until the hold's old end."""
    doc = {
        "name": "lost", "duration_s": 90, "seed": 1,
        "cluster": {"generate": {"nodes": 1, "gpus_per_node": 4, "seed": 0}},
        "models": [{"name": "m7", "model": "llama-2-7b",
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}}],
        "workloads": [{"model": "m7", "arrivals": {"rate_per_s": 6},
                       "prompt_tokens": {"dist": "fixed", "mean": 512},
                       "output_tokens": {"dist": "fixed", "mean": 64}}],
        "resources": [{"at_s": 45, "fail": ["a10g-000/gpu1", "a10g-000/gpu2", "a10g-000/gpu3"]}],
    }  # fmt: skip
    result = simulate(parse_scenario(doc, DATA), "flexpipe")
    queue_wait_s = result.scenario.gateway.max_queue_wait_s
    # the hold ends when the first plan's engines are ready (before the loss at 45 s); no
    # failed request waited longer than to the loss and one queue wait after it (before:
    # one queued at the start waited until the hold's end, 600 s)
    hold_end_s = max(r.ready_s for r in result.instances if r.launched_s == 0.0)
    assert hold_end_s < 45
    waited = [r.finish_s - r.arrival_s for r in result.requests if r.failed]
    assert waited and max(waited) <= 45 + queue_wait_s + 1e-6
