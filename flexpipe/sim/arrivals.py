"""The scenario's requests (every workload's arrivals, merged in time order) and the model
demands the planner is given for them (the mean, and the busiest report interval's peak)."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace

from flexpipe.perf.slo_capacity import dispersion_of_counts
from flexpipe.policies.planner import ModelDemand
from flexpipe.policies.planner.demand import ModelsFileError, parse_models
from flexpipe.sim.request import SimRequest
from flexpipe.sim.scenario import Scenario, ScenarioError
from flexpipe.sim.trace import TraceReplay
from flexpipe.sim.workload import Arrival

__all__ = ["generate_requests", "model_demands"]


def _keyed(it: Iterator[Arrival], w: int) -> Iterator[tuple[float, int, int, Arrival]]:
    """(time, workload, n, arrival): the merge key. A function, not a generator expression in
    the loop, so that each stream keeps its own `w` (a generator expression reads it late)."""
    for n, a in enumerate(it):
        yield a[0], w, n, a


def generate_requests(scenario: Scenario) -> list[SimRequest]:
    """Every workload's arrivals, merged in time order (ties: workload order)."""
    sources: list[Iterator[Arrival]] = []
    for w, wl in enumerate(scenario.workloads):
        src = wl.source
        if isinstance(src, TraceReplay):
            sources.append(src.arrivals(scenario.duration_s))
        else:
            sources.append(src.arrivals(random.Random(f"{scenario.seed}:{w}"), scenario.duration_s))
    out: list[SimRequest] = []
    if len(sources) == 1:  # (what the merge of one stream gives, without its keys)
        model = scenario.workloads[0].model
        for t, prompt, output, prefix in sources[0]:
            out.append(SimRequest(len(out), t, model, prompt, output, prefix))
        return out
    streams = [_keyed(it, w) for w, it in enumerate(sources)]
    for t, w, _, (_, prompt, output, prefix) in heapq.merge(*streams):
        out.append(SimRequest(len(out), t, scenario.workloads[w].model, prompt, output, prefix))
    return out


def model_demands(
    scenario: Scenario, requests: Sequence[SimRequest]
) -> tuple[tuple[ModelDemand, ...], tuple[ModelDemand, ...]]:
    """(mean demands, peak demands): a model's `demand` from the scenario, or its workload's
    mean; the peak rate is the busiest report interval's."""
    entries = []
    peaks: dict[str, float] = {}
    cv2s: dict[str, tuple[float, float]] = {}  # name -> (over the run, in the busiest interval)
    window = scenario.report_interval_s
    for entry in scenario.models:
        name = str(entry.get("name", entry.get("model")))
        mine = [r for r in requests if r.model == name]
        counts: dict[int, int] = {}
        for r in mine:
            k = int(r.arrival_s // window)
            counts[k] = counts.get(k, 0) + 1
        peaks[name] = max(counts.values(), default=0) / window
        cv2s[name] = _burstiness(scenario, mine, max(counts, key=counts.__getitem__, default=0))
        if "demand" not in entry:
            n = max(1, len(mine))
            entry = {
                **entry,
                "demand": {
                    "request_rate_per_s": len(mine) / scenario.duration_s,
                    "input_tokens": max(1, round(sum(r.num_prompt_tokens for r in mine) / n)),
                    "output_tokens": max(1, round(sum(r.num_output_tokens for r in mine) / n)),
                },
            }
        entries.append(entry)
    try:
        demands = parse_models({"models": entries}, f"{scenario.name}: models")
    except ModelsFileError as exc:
        raise ScenarioError(str(exc).replace("\n", "; ")) from None
    demands = tuple(replace(d, arrival_cv2=cv2s[d.name][0]) for d in demands)
    peak = tuple(
        replace(d, request_rate_per_s=max(d.request_rate_per_s, peaks[d.name]))
        for d in (replace(d, arrival_cv2=cv2s[d.name][1]) for d in demands)
    )
    return demands, peak


# Arrivals are counted in windows of the controller's default tick (what it samples at) to
# measure their burstiness.
BURSTINESS_WINDOW_S = 10.0


def _burstiness(
    scenario: Scenario, mine: Sequence[SimRequest], busiest: int
) -> tuple[float, float]:
    """A model's arrival burstiness (flexpipe.perf.slo_capacity.dispersion_of_counts over
    windows of BURSTINESS_WINDOW_S): over the run, and within its busiest report interval
    (what the peak plan is for); 1 (Poisson) where it cannot be measured."""
    window = BURSTINESS_WINDOW_S
    num = max(1, math.ceil(scenario.duration_s / window))
    counts = [0.0] * num
    for r in mine:
        counts[min(num - 1, int(r.arrival_s // window))] += 1
    start = int(mine[0].arrival_s // window) if mine else 0  # (a workload may start late)
    per = max(1, round(scenario.report_interval_s / window))
    first = int(busiest * scenario.report_interval_s // window)
    run = _positive(dispersion_of_counts(counts[start:]))
    busiest_cv2 = _positive(dispersion_of_counts(counts[max(start, first) : first + per]))
    # A handful of windows measure little: the busiest interval's is taken as at least
    # Poisson's and at most the run's (an on/off process is at its burst rate there).
    return run, min(run, max(1.0, busiest_cv2))


def _positive(cv2: float | None) -> float:
    """None (not measured): Poisson; a near-deterministic stream: a small floor."""
    return 1.0 if cv2 is None else max(0.05, cv2)
