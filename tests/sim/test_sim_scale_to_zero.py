"""The simulator scales a model to zero and wakes it as the live controller does
(`flexpipe up --scale-to-zero`: tests/control/test_controller_demand.py): the shift that takes a
model's last instance is carried out (before, the simulator's shift refused it: "every
instance leaves"), the model is held while it has none, and its next requests wait for the
wake's cold start instead of failing with a 404."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from test_sim_shift import ROOT, SEED_CLUSTER, fixed_workload, seven_b

from flexpipe.sim import simulate
from flexpipe.sim.report import report
from flexpipe.sim.scenario import parse_scenario


def _idle_then_busy(code_start_s: float, code_rate_per_s: float) -> Any:
    """chat busy from 30 s; code idle until `code_start_s`; every model's floor is 0."""
    model, workload = seven_b, fixed_workload
    doc = {
        "name": "idle-then-busy", "duration_s": code_start_s + 100, "seed": 0,
        "report_interval_s": 30, "cluster": {"file": str(SEED_CLUSTER)},
        "models": [model("chat"), model("code")],
        "workloads": [workload("chat", 1, 30), workload("code", code_rate_per_s, code_start_s)],
        "controller": {"min_instances_floor": 0,
                       "shift": {"triggers": {"window_s": 30, "num_samples": 3,
                                              "cooldown_s": 60}}},
    }  # fmt: skip
    return parse_scenario(doc, ROOT)


def test_an_idle_model_goes_to_zero_is_held_and_wakes_for_its_requests() -> None:
    r = simulate(_idle_then_busy(300.0, 1.0), "flexpipe")
    down = next(s for s in r.shifts if s["trigger"] == "down")
    assert down["outcome"] == "succeeded", down["why_failed"]
    assert down["started"] == [] and [k.split("|")[0] for k in down["stopped"]] == ["code"]
    wake = next(s for s in r.shifts if s["trigger"] == "wake")
    assert wake["outcome"] == "succeeded"
    assert 300.0 < wake["at_s"] < 300.0 + 20.0  # the first queued request wakes it
    assert [k.split("|")[0] for k in wake["started"]] == ["code"]
    # planned for its configured demand (1 req/s), not for `wake_request_rate_per_s` (0.1):
    # a one-slot instance there queued its requests into 429s until the up trigger came
    assert int(wake["started"][0].split("|")[1].split("-s")[-1]) >= 8
    code = sorted((q for q in r.requests if q.model == "code"), key=lambda q: q.arrival_s)
    # held at zero: every request is served, the first ones after the wake's cold start
    assert code and all(q.completed for q in code), {q.failed for q in code}
    ready_s = wake["finished_s"]
    waited = [q for q in code if q.arrival_s < ready_s]
    assert len(waited) >= 2 and all(q.first_token_s > ready_s for q in waited)
    # first come, first served: the woken instance takes them in arrival order
    firsts = [q.first_token_s for q in code]
    assert firsts == sorted(firsts)


def _sleepy(sleep_mode: str) -> Any:
    sc = _idle_then_busy(300.0, 1.0)
    shift = replace(sc.controller.shift, sleep_mode=sleep_mode)
    return replace(sc, controller=replace(sc.controller, shift=shift))


def test_with_sleep_mode_the_idle_model_sleeps_and_its_engine_wakes_for_its_requests() -> None:
    """`controller.shift.sleep_mode: auto`: the down shift puts code's engine to sleep (level
    1: its weights fit the node's host RAM) instead of stopping it; the wake shift wakes that
    same engine in the modelled wake time, far sooner than the cold start it replaces."""
    cold = simulate(_sleepy("off"), "flexpipe")
    r = simulate(_sleepy("auto"), "flexpipe")
    down = next(s for s in r.shifts if s["trigger"] == "down")
    assert down["outcome"] == "succeeded" and down["stopped"] == []
    assert "sleep" in down["phases_s"] and "release" not in down["phases_s"]
    wake = next(s for s in r.shifts if s["trigger"] == "wake")
    cold_wake = next(s for s in cold.shifts if s["trigger"] == "wake")
    assert wake["outcome"] == "succeeded" and [k.split("|")[0] for k in wake["started"]] == ["code"]
    assert "warm" not in wake["phases_s"] and "rehearse" not in wake["phases_s"]
    (rec,) = [x for x in r.instances if x.dep.model == "code"]  # one engine, slept and woken
    assert rec.sleep is not None and (rec.sleep.num_sleeps, rec.sleep.num_wakes) == (1, 1)
    pm = rec.instance.cfg.pm if rec.instance is not None else None
    assert pm is not None
    assert wake["phases_s"]["wake"] == round(pm.wake_s(1), 6)
    assert down["phases_s"]["sleep"] == round(pm.sleep_s(1), 6)
    code = [q for q in r.requests if q.model == "code"]
    assert code and all(q.completed for q in code)
    first = min(code, key=lambda q: q.arrival_s)
    cold_first = min((q for q in cold.requests if q.model == "code"), key=lambda q: q.arrival_s)
    woken_ttft_s = first.first_token_s - first.arrival_s
    cold_ttft_s = cold_first.first_token_s - cold_first.arrival_s
    print(
        f"simulated: wake {wake['phases_s']['wake']:.2f} s, first token {woken_ttft_s:.2f} s "
        f"after arrival; cold: warm {cold_wake['phases_s']['warm']:.2f} s, first token "
        f"{cold_ttft_s:.2f} s"
    )
    assert woken_ttft_s < cold_ttft_s / 4  # (both wait for the controller to notice)
    # the chat model never noticed: same requests served either way
    assert all(q.completed for q in r.requests if q.model == "chat")
    # the report counts the sleeping engine's time apart from the GPU-hours reserved
    ((t0, t1, level, gpu_bytes, host_bytes),) = rec.asleep_spans
    assert (t0, t1, level) == (down["finished_s"] - pm.sleep_s(1), wake["at_s"], 1.0)
    assert host_bytes == sum(g.weights_bytes for g in pm.memory.per_gpu)
    assert gpu_bytes == sum(g.reserve_bytes for g in pm.memory.per_gpu)
    asleep = report(r)["asleep"]
    assert asleep == {
        "gpu_hours": round((t1 - t0) / 3600, 6),
        "gpu_memory_gib_hours": round(gpu_bytes * (t1 - t0) / 3600 / 1024**3, 6),
        "host_ram_gib_hours": round(host_bytes * (t1 - t0) / 3600 / 1024**3, 6),
    }
    assert "asleep" not in report(cold)
