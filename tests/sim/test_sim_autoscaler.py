"""The baselines the elasticity question is asked against: Knative's KPA (flexpipe.sim.autoscaler
and the `autoscaler` policy), `peak-slo`, on/off arrivals and the rebuilt bursty-serverless."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from test_sim_shift import ROOT, SEED_CLUSTER, seven_b

from flexpipe.cluster.generate import generate_cluster
from flexpipe.perf.slo_capacity import erlang_c
from flexpipe.policies.planner import ModelDemand, parse_models, plan
from flexpipe.sim import simulate
from flexpipe.sim.arrivals import generate_requests, model_demands
from flexpipe.sim.autoscaler import KpaParams, KpaScaler
from flexpipe.sim.policy import (
    KpaAutoscaler,
    PolicyView,
    create_policy,
    mmc_ttft_p99_s,
    peak_slo_plan,
)
from flexpipe.sim.scenario import ScenarioError, load_scenario, parse_scenario, resolve
from flexpipe.sim.workload import Bursts, LengthDist, Synthetic


def _feed(scaler: KpaScaler, series: list[tuple[float, float]], num_ready: int) -> list[int]:
    """Each (time, concurrency): observed, then scaled with `num_ready` ready; the counts."""
    out = []
    for t, c in series:
        scaler.observe(t, c)
        out.append(scaler.scale(t, num_ready))
    return out


def _ticks(start_s: float, end_s: float, concurrency: float) -> list[tuple[float, float]]:
    """A sample every 2 s (the KPA tick) in [start_s, end_s)."""
    return [(start_s + 2.0 * k, concurrency) for k in range(int((end_s - start_s) / 2))]


def test_stable_mode_follows_the_stable_window_average() -> None:
    s = KpaScaler(target_per_replica=10.0)
    # 25 in flight with 3 ready: ceil(25 / 10) = 3; the panic window asks 3, 3 / 3 < 2
    assert _feed(s, _ticks(0, 10, 25.0), 3) == [3, 3, 3, 3, 3]
    assert not s.panicking
    # it rises to 45 (the panic window asks at most 5 of 3 ready: no panic): the stable
    # average climbs, 170 / 6 = 28.3, then 215 / 7 = 30.7, ...; ceil(avg / 10) follows
    counts = _feed(s, _ticks(10, 20, 45.0), 3)
    assert counts == [3, 4, 4, 4, 4] and not s.panicking


def test_panic_scales_up_at_once_and_never_down_for_a_stable_window() -> None:
    s = KpaScaler(target_per_replica=10.0)
    _feed(s, _ticks(0, 60, 5.0), 1)  # a minute at 5: 1 replica
    # a burst of 60 in flight: the panic window (6 s: the samples after now - 6) averages
    # (5 + 5 + 60) / 3 -> 3 replicas, 3 / 1 ready >= 2: panic; then 5, then 6; the stable
    # window alone (60 s) would ask ceil(~6.7 / 10) = 1
    assert _feed(s, _ticks(60, 66, 60.0), 1) == [3, 5, 6]
    assert s.panicking
    # the burst ends: the panic window still asks 4 at 66 s and 2 at 68 s (over the
    # threshold: 2 / 1 >= 2), then 0; panicking keeps the 6 ...
    assert _feed(s, _ticks(66, 130, 0.0), 1) == [6] * 32
    # ... until a stable window after the last time over the threshold (68 + 60 < 130 s);
    # then the stable window's samples (70..130) are all 0 and the history covers the
    # window: to zero (ready 1: scale-down may take it to 0)
    assert s.panic_since_s == 68.0
    assert _feed(s, [(130.0, 0.0)], 1) == [0] and not s.panicking


def test_scale_to_zero_waits_for_a_stable_window_of_no_requests() -> None:
    s = KpaScaler(target_per_replica=10.0)
    # no request from t = 0: within the first stable window the initial scale holds
    assert _feed(s, _ticks(0, 60, 0.0), 0) == [1] * 30
    # one sample at 60 s: the samples reach back a full window (first at 0 s): zero
    assert _feed(s, [(60.0, 0.0)], 1) == [0]
    # one request in flight in the window keeps one replica for the window
    s.observe(62.0, 1.0)
    assert s.scale(62.0, 0) == 1
    assert _feed(s, _ticks(64, 122, 0.0), 1) == [1] * 29
    assert _feed(s, [(122.0, 0.0)], 1) == [0]  # 62 s is out of (62, 122]


def test_rate_limits_bound_each_evaluation() -> None:
    s = KpaScaler(target_per_replica=10.0)
    _feed(s, _ticks(0, 60, 100.0), 10)  # 10 ready at 100 in flight
    # all requests gone: the stable average falls slowly; once it asks few, the scale-down
    # rate (2) floors it at ready / 2 per evaluation
    _feed(s, _ticks(60, 120, 0.0), 10)
    assert s.scale(120.0, 10) == 5  # floor(10 / 2), not 0
    assert s.scale(120.0, 5) == 2  # floor(5 / 2)
    assert s.scale(120.0, 2) == 1
    # scale-up rate: at 2 (not Knative's 1000), one ready may become at most 2
    up = KpaScaler(target_per_replica=10.0, params=KpaParams(max_scale_up_rate=2.0))
    assert _feed(up, [(0.0, 100.0)], 1) == [2]
    assert _feed(up, [(2.0, 100.0)], 2) == [4]


def test_params_are_checked() -> None:
    with pytest.raises(ValueError, match="target_utilization"):
        KpaParams(target_utilization=0)
    with pytest.raises(ValueError, match="panic_window_s"):
        KpaParams(panic_window_s=61)


def _one_model(duration_s: float, workload: dict[str, Any]) -> Any:
    doc = {
        "name": "kpa", "duration_s": duration_s, "seed": 0, "report_interval_s": 10,
        "cluster": {"file": str(SEED_CLUSTER)}, "models": [seven_b("chat")],
        "workloads": [{"model": "chat", **workload}],
    }  # fmt: skip
    return parse_scenario(doc, ROOT)


def test_the_policy_places_replicas_of_one_gear_on_distinct_free_gpus() -> None:
    sc = _one_model(60, {"arrivals": {"rate_per_s": 1}})
    demands, peaks = model_demands(sc, generate_requests(sc))
    pol = create_policy("autoscaler")
    assert isinstance(pol, KpaAutoscaler) and pol.interval_s == 2.0
    rng = random.Random(0)
    first = pol.decide(PolicyView(sc.cluster, demands, peaks, ()), 0.0, rng)
    assert first is not None and [d.name for d in first] == ["chat-r1"]  # initial-scale 1
    gear = first[0].gear
    target = pol._scalers["chat"].target_per_replica
    assert target == gear.max_num_seqs * 0.7
    # 4 x the target in flight with one ready: panic, 4 replicas, on GPUs no other holds
    view = PolicyView(sc.cluster, demands, peaks, tuple(first), {"chat": round(4 * target)},
                      frozenset({"chat-r1"}))  # fmt: skip
    wanted = pol.decide(view, 2.0, rng)
    assert wanted is not None and [d.name for d in wanted] == [
        "chat-r1", "chat-r2", "chat-r3", "chat-r4"]  # fmt: skip
    gpus = [g for d in wanted for g in d.gpu_ids]
    assert len(gpus) == len(set(gpus)) and all(d.gear.tp == gear.tp for d in wanted)
    # a draining instance's GPUs are not free: the same ask with them held places fewer
    pol2 = create_policy("autoscaler")
    pol2.decide(PolicyView(sc.cluster, demands, peaks, ()), 0.0, rng)
    held = frozenset(gpus[1:])
    view2 = PolicyView(sc.cluster, demands, peaks, tuple(first), {"chat": round(4 * target)},
                       frozenset({"chat-r1"}), held)  # fmt: skip
    again = pol2.decide(view2, 2.0, rng)
    assert again is None or not (set(g for d in again for g in d.gpu_ids) - {gpus[0]}) & held


def test_a_model_at_zero_is_buffered_and_woken_by_its_requests() -> None:
    """Idle for 100 s (to zero after the stable window), then 2 req/s from 100 s: the
    activator's buffering holds the requests through the cold start: none is a 404."""
    sc = _one_model(160, {"arrivals": {"rate_per_s": 2, "start_s": 100},
                          "prompt_tokens": {"dist": "fixed", "mean": 512},
                          "output_tokens": {"dist": "fixed", "mean": 128}})  # fmt: skip
    r = simulate(sc, "autoscaler")
    first, *rest = r.instances
    assert first.launched_s == 0.0 and 60.0 <= first.stopped_s <= 64.0  # to zero
    assert rest and 100.0 < rest[0].launched_s <= 104.0  # woken by the first request
    assert all(q.completed for q in r.requests), {q.failed for q in r.requests}
    early = [q for q in r.requests if q.arrival_s < rest[0].ready_s]
    assert early and all(q.first_token_s >= rest[0].ready_s for q in early)


def test_on_off_arrivals_come_in_bursts() -> None:
    on_off = Bursts(off_mean_s=200.0, burst_min_s=10.0, burst_max_s=60.0)
    src = Synthetic(20.0, LengthDist(), LengthDist(), arrival="onoff", bursts=on_off)
    times = [a[0] for a in src.arrivals(random.Random(1), 20_000.0)]
    assert times == [a[0] for a in src.arrivals(random.Random(1), 20_000.0)]  # seeded
    assert times == sorted(times) and times[-1] <= 20_000.0
    # bursts: split at gaps over 5 s (a 20 req/s Poisson gap that long: e^-100)
    bursts: list[list[float]] = [[times[0]]]
    for a, b in itertools.pairwise(times):
        if b - a > 5.0:
            bursts.append([])
        bursts[-1].append(b)
    spans = [b[-1] - b[0] for b in bursts]
    # (two bursts an off period shorter than 5 s apart count as one here)
    assert 40 <= len(bursts) <= 110 and min(spans) >= 5.0
    assert sum(span <= 60.0 for span in spans) >= 0.9 * len(spans)
    # the mean rate is the burst rate x the duty (35 / 235)
    assert len(times) / 20_000.0 == pytest.approx(20.0 * on_off.duty, rel=0.2)


def test_on_off_keys_are_checked() -> None:
    with pytest.raises(ScenarioError, match="burst_max_s: must be >= burst_min_s"):
        _one_model(60, {"arrivals": {"process": "onoff", "rate_per_s": 1, "burst_min_s": 30,
                                     "burst_max_s": 10}})  # fmt: skip
    with pytest.raises(ScenarioError, match="are for process: onoff"):
        _one_model(60, {"arrivals": {"rate_per_s": 1, "off_mean_s": 30}})


def test_bursty_serverless_is_serverless_and_its_peak_slo_plan_fits() -> None:
    sc = load_scenario(resolve("bursty-serverless"))
    assert len(sc.models) >= 8
    assert all(isinstance(w.source, Synthetic) and w.source.bursts for w in sc.workloads)
    demands, peaks = model_demands(sc, generate_requests(sc))
    # the peak is far above the mean: most models idle most of the time
    mean = sum(d.request_rate_per_s for d in demands)
    assert sum(p.request_rate_per_s for p in peaks) >= 4 * mean
    instances = peak_slo_plan(sc.cluster, peaks)
    gpus = [g for i in instances for g in i.gpu_ids]
    assert len(gpus) == len(set(gpus)) and set(gpus) <= set(sc.cluster.gpu_ids)
    assert {i.model for i in instances} == {d.name for d in demands}  # every model placed
    assert len(gpus) < len(sc.cluster.gpu_ids)  # it fits, with GPUs to spare
    assert load_scenario(resolve("bursty-serverless-small")).name == "bursty-serverless-small"


def test_erlang_c_and_the_mmc_check() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: the utilisation
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # (1/2 / (1 - 1/2)) / (1 + 1 + 1)


def test_peak_slo_replicates_until_the_mmc_ttft_meets_the_slo() -> None:
    """16 req/s on one 7B instance of ~22 req/s (SLO-meeting, at 0.85 load): the M/M/1 wait
    puts its TTFT p99 near 0.47 s. A 2 s SLO: peak-slo is the planner's peak plan; 300 ms:
    a second instance."""
    cluster = generate_cluster(1, 8, 1)

    def chat(ttft_ms: int) -> tuple[ModelDemand, ...]:
        entry = {**seven_b("chat"), "slo": {"ttft_p99_ms": ttft_ms, "tpot_p99_ms": 60}}
        entry["demand"] = {**entry["demand"], "request_rate_per_s": 16}
        return parse_models({"models": [entry]}, "test")

    loose = peak_slo_plan(cluster, chat(2000))
    assert loose == plan(cluster, chat(2000)).instances and len(loose) == 1
    assert 0.3 < mmc_ttft_p99_s(loose, 16.0) < 2.0
    tight = peak_slo_plan(cluster, chat(300))
    assert len(tight) == 2 and mmc_ttft_p99_s(tight, 16.0) <= 0.3
