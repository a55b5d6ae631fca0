"""`simulate(scenario)`: the scenario's workload through the same gateway router and engine
cores as the live system, on a virtual clock, under one policy.

Order of a run: requests are generated (pure, seeded), the policy decides the first plan at
t = 0, each instance cold-starts for its modelled load time and joins the gateway's pool,
arrivals are routed as they come, and after `duration_s` no new request arrives; the run
goes on until every accepted request has ended (at most `max_drain_s` more: whatever is still
running then fails as "unfinished"). Every request ends completed or failed.
"""

from __future__ import annotations

import functools
import heapq
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from flexpipe.policies.planner import ModelDemand, ModelsFileError, parse_models
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.engine_factory import engine_config
from flexpipe.sim.gateway import SimGateway
from flexpipe.sim.instance import SimInstance
from flexpipe.sim.loop import ARRIVAL, CONTROL, EventLoop
from flexpipe.sim.policy import Policy, PolicyView, at_rate, create_policy
from flexpipe.sim.request import SimRequest
from flexpipe.sim.scenario import Scenario, ScenarioError
from flexpipe.sim.trace import TraceReplay
from flexpipe.sim.usage import Usage
from flexpipe.sim.workload import Arrival

MAX_DRAIN_S = 3600.0


@dataclass(slots=True)
class InstanceRecord:
    dep: Deployment
    launched_s: float
    ready_s: float
    stopped_s: float = -1.0  # left the plan (drain began); -1: ran to the end
    released_s: float = -1.0  # drained and empty: its GPUs are free again
    num_kv_blocks: int = 0
    max_model_len: int = 0
    instance: SimInstance | None = None


@dataclass
class SimResult:
    scenario: Scenario
    policy: str
    routing: str
    demands: tuple[ModelDemand, ...]
    requests: list[SimRequest]
    instances: list[InstanceRecord]
    usage: Usage
    end_s: float = 0.0
    num_events: int = 0
    notes: list[str] = field(default_factory=list)


def generate_requests(scenario: Scenario) -> list[SimRequest]:
    """Every workload's arrivals, merged in time order (ties: workload order)."""
    streams: list[Iterator[tuple[float, int, int, Arrival]]] = []
    for w, wl in enumerate(scenario.workloads):
        src = wl.source
        if isinstance(src, TraceReplay):
            it: Iterator[Arrival] = src.arrivals(scenario.duration_s)
        else:
            it = src.arrivals(random.Random(f"{scenario.seed}:{w}"), scenario.duration_s)
        streams.append(((a[0], w, n, a) for n, a in enumerate(it)))
    out: list[SimRequest] = []
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
    window = scenario.report_interval_s
    for entry in scenario.models:
        name = str(entry.get("name", entry.get("model")))
        mine = [r for r in requests if r.model == name]
        counts: dict[int, int] = {}
        for r in mine:
            k = int(r.arrival_s // window)
            counts[k] = counts.get(k, 0) + 1
        peaks[name] = max(counts.values(), default=0) / window
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
    peak = tuple(at_rate(d, max(d.request_rate_per_s, peaks[d.name])) for d in demands)
    return demands, peak


class _Run:
    def __init__(
        self, scenario: Scenario, policy: Policy, stretches: bool, requests: list[SimRequest]
    ) -> None:
        self.scenario = scenario
        self.policy = policy
        self.stretches = stretches
        self.loop = EventLoop()
        self.rng = random.Random(scenario.seed)
        gw_cfg = scenario.gateway
        if policy.routing is not None and policy.routing != gw_cfg.policy:
            gw_cfg = replace(gw_cfg, policy=policy.routing, policy_params={})
        self.routing = gw_cfg.policy
        self.gateway = SimGateway(gw_cfg, self.loop, random.Random(gw_cfg.seed), self._ended)
        self.requests = requests
        self.demands, self.peaks = model_demands(scenario, requests)
        self.usage = Usage(scenario.duration_s, scenario.report_interval_s)
        self.records: list[InstanceRecord] = []  # every instance launched, in order
        self.live: dict[str, InstanceRecord] = {}  # deployment name -> record, in the plan
        self.draining: list[InstanceRecord] = []
        self.notes: list[str] = []
        self.num_open = 0  # requests submitted and not ended

    # --- policy --------------------------------------------------------------------------
    def _decide(self, now: float) -> None:
        running = tuple(r.dep for r in self.live.values())
        view = PolicyView(self.scenario.cluster, self.demands, self.peaks, running)
        wanted = self.policy.decide(view, now, self.rng)
        if wanted is not None:
            self._apply_plan(list(wanted), now)
        if self.policy.interval_s is not None:
            self.loop.at(now + self.policy.interval_s, CONTROL, self._decide)

    def _apply_plan(self, wanted: list[Deployment], now: float) -> None:
        names = {d.name for d in wanted}
        for name in [n for n in self.live if n not in names]:
            self._stop(self.live.pop(name), now)
        max_len = {d.name: d.max_model_len for d in self.demands}
        for dep in wanted:
            if dep.name in self.live:
                continue
            try:
                cfg = engine_config(dep, self.scenario.cluster, max_len.get(dep.model))
            except ValueError as exc:
                self.notes.append(f"{dep.name} cannot run: {exc}")
                continue
            inst = SimInstance(
                dep, cfg, self.loop, self.gateway.done, self._busy, stretches=self.stretches
            )
            rec = InstanceRecord(
                dep, now, now + cfg.load_time_s, num_kv_blocks=cfg.num_kv_blocks,
                max_model_len=cfg.max_model_len, instance=inst,
            )  # fmt: skip
            self.records.append(rec)
            self.live[dep.name] = rec
            self.loop.at(rec.ready_s, CONTROL, functools.partial(self._ready, rec))

    def _ready(self, rec: InstanceRecord, now: float) -> None:
        if rec.stopped_s < 0:  # still wanted once loaded
            assert rec.instance is not None
            self.gateway.add_instance(rec.instance, now)

    def _stop(self, rec: InstanceRecord, now: float) -> None:
        """Drain: out of routing now; the GPUs are held until its last request ends."""
        rec.stopped_s = now
        self.draining.append(rec)
        inst = rec.instance
        assert inst is not None
        if inst.url in self.gateway.pool.instances:
            self.gateway.drain_instance(inst.url)
        self._release_drained(now)

    def _release_drained(self, now: float) -> None:
        for rec in [r for r in self.draining if r.instance and not r.instance.requests]:
            self.draining.remove(rec)
            rec.released_s = now
            assert rec.instance is not None
            if rec.instance.url in self.gateway.pool.instances:
                self.gateway.remove_instance(rec.instance.url)

    # --- work ----------------------------------------------------------------------------
    def _busy(self, inst: SimInstance, start_s: float, end_s: float) -> None:
        self.usage.busy(inst.dep.num_gpus, start_s, end_s)

    def _ended(self, req: SimRequest) -> None:
        self.num_open -= 1
        if self.draining:
            self._release_drained(req.finish_s)

    def _arrive(self, index: int, now: float) -> None:
        req = self.requests[index]
        self.num_open += 1
        self.gateway.submit(req, now)
        if index + 1 < len(self.requests):
            nxt = self.requests[index + 1]
            self.loop.at(nxt.arrival_s, ARRIVAL, lambda t: self._arrive(index + 1, t))

    def run(self, progress: Callable[[float], None] | None) -> SimResult:
        scenario = self.scenario
        self.loop.at(0.0, CONTROL, self._decide)
        if self.requests:
            first = self.requests[0].arrival_s
            self.loop.at(first, ARRIVAL, lambda t: self._arrive(0, t))
        t = 0.0
        step = scenario.report_interval_s
        while t < scenario.duration_s:
            t = min(scenario.duration_s, t + step)
            self.loop.run(t)
            if progress is not None:
                progress(t)
        end = scenario.duration_s
        while self.num_open > 0 and end < scenario.duration_s + MAX_DRAIN_S:
            end += step
            self.loop.run(end)
        for req in self.requests:
            if req.finish_s < 0:
                req.failed = "unfinished: still running when the run ended"
                req.finish_s = end
        for rec in self.records:
            stop = rec.released_s if rec.released_s >= 0 else scenario.duration_s
            self.usage.reserve(rec.dep.num_gpus, rec.launched_s, stop)
        if not self.records:
            self.notes.append(f"policy {self.policy.name} runs no instance on this cluster")
        return SimResult(
            scenario, self.policy.name, self.routing, self.demands, self.requests,
            list(self.records), self.usage,
            max((r.finish_s for r in self.requests), default=0.0), self.loop.num_events,
            self.notes,
        )  # fmt: skip


def simulate(
    scenario: Scenario,
    policy: str | Policy | None = None,
    *,
    stretches: bool = True,
    progress: Callable[[float], None] | None = None,
    log: list[tuple[float, str, str]] | None = None,
) -> SimResult:
    """Run `scenario` under `policy` (default: the scenario's). `stretches=False` steps every
    engine iteration as its own event (the reference the closed form is checked against).
    `log`: a list that receives the gateway's events (time, event, detail) in order."""
    pol = policy if policy is not None and not isinstance(policy, str) else None
    pol = pol or create_policy(policy if isinstance(policy, str) else scenario.policy)
    requests = generate_requests(scenario)
    run = _Run(scenario, pol, stretches, requests)
    run.gateway.log = log  # the gateway's events, in order, when a list is given
    return run.run(progress)


__all__ = ["InstanceRecord", "SimResult", "generate_requests", "model_demands", "simulate"]
