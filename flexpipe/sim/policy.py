"""What the simulator runs: a policy decides the plan, the routing policy routes.

The seam: `Policy.decide(view, now, rng)` gets a snapshot (the cluster's free GPUs, the
demand, what runs now) and returns a new list of deployments, or None to keep what runs. The
simulator asks at t = 0 and then every `interval_s` (None: never again). Today's policies are
static; the controller's shift policy (docs/shift-policy.md) plugs in here: a decide that returns a
changed plan, and the simulator carries the change out (new instances cold-start and join the
pool when ready; instances no longer in the plan drain and leave when empty).

The live flexpipe is not a `decide` of this kind: `ShiftingPolicy` marks a run where the
controller's loop (`flexpipe.sim.controller`) drives the live shift policy instead.

Registered by name (`create_policy`):
- `flexpipe`: the live controller and shift policy (re-plans, shifts gears, reacts to the
  resource timeline), the scenario's routing;
- `round_robin`: the same, routed round robin;
- `static`: the planner's plan for the free GPUs at t = 0, never changed (the best static
  plan without shifts: what `flexpipe up` ran before the controller);
- `peak`: the planner's plan for the workload's peak rate (peak provisioning), never changed;
- `peak-slo`: `peak`, each model then given replicas until an M/M/c check of its TTFT at the
  peak rate meets its SLO (`PeakSloPolicy`), never changed;
- `autoscaler`: Knative's reactive autoscaler (KPA, flexpipe.sim.autoscaler) per model over
  replicas of its best single-instance gear, scale to zero with the activator's buffering;
- `wait-for-ideal`: seed 000 §4.1's fixed template, tp=4 on four identical, fully free,
  fast-linked GPUs, checked every minute on the cluster as it is then; serves nothing until
  such four exist;
- a scenario's own `plans:` (fixed deployments by name, e.g. the seed's forced 3-way).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from flexpipe.cluster import Cluster
from flexpipe.gears.gear import Gear
from flexpipe.model_spec import load_model_spec
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.perf.slo_capacity import mmc_wait_quantile_s
from flexpipe.policies.planner import ModelDemand, PlannedInstance, PlannerConfig, plan
from flexpipe.policies.planner.candidates import Candidate, Evaluator
from flexpipe.sim.autoscaler import KpaParams, KpaScaler
from flexpipe.sim.controller import ControllerParams
from flexpipe.sim.deployment import Deployment

if TYPE_CHECKING:
    from flexpipe.sim.scenario import Scenario


@dataclass(frozen=True, slots=True)
class PolicyView:
    cluster: Cluster  # the cluster file as the resource timeline has changed it by now
    demands: tuple[ModelDemand, ...]  # mean demand per model (what the planner is given)
    peak_demands: tuple[ModelDemand, ...]  # the same at each model's peak rate
    running: tuple[Deployment, ...]
    # requests in flight per served model: on its engines plus waiting at the gateway (what
    # Knative's queue-proxies and activator report as concurrency)
    in_flight: Mapping[str, int] = field(default_factory=dict)
    ready: frozenset[str] = frozenset()  # names of the running deployments taking requests
    draining_gpu_ids: frozenset[str] = frozenset()  # GPUs of instances still draining


class Policy(Protocol):
    """A policy may also say `buffers_at_zero = True` (read with getattr, default False): the
    simulator then holds the requests of a model with no instance in the gateway's queue
    until one is ready, as Knative's activator buffers them, instead of a 404."""

    name: str
    routing: str | None  # routing policy name; None: the scenario's / gateway default
    interval_s: float | None  # how often `decide` is asked after t = 0; None: never

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None: ...


@dataclass(slots=True)
class ShiftingPolicy:
    """The live controller and shift policy on the virtual clock (`params`: None, the
    scenario's `controller:` section)."""

    name: str = "flexpipe"
    routing: str | None = None
    interval_s: float | None = None
    params: ControllerParams | None = None

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None:
        raise TypeError("the simulator runs the controller for a ShiftingPolicy")


@dataclass(slots=True)
class FixedPlan:
    """Fixed deployments (a scenario's `plans:` entry), launched at t = 0 and never changed."""

    name: str
    deployments: tuple[Deployment, ...]
    routing: str | None = None
    interval_s: float | None = None

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None:
        return None if view.running else list(self.deployments)


@dataclass(slots=True)
class PlannerPolicy:
    """A static plan from `flexpipe.policies.planner.plan`, never changed."""

    name: str = "static"
    routing: str | None = None
    interval_s: float | None = None
    at_peak: bool = False
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # the scenario's `planner:`

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None:
        del rng
        if view.running:
            return None
        demands = view.peak_demands if self.at_peak else view.demands
        the_plan = plan(view.cluster, demands, None, config=self.planner, now_s=now)
        return [Deployment.of(i) for i in the_plan.instances]


@dataclass(slots=True)
class WaitForIdeal:
    """A fixed tp=`num_gpus` template on identical, fully free GPUs joined by fast links."""

    name: str = "wait-for-ideal"
    routing: str | None = None
    interval_s: float | None = 60.0  # it checks again every minute (the seed's retries)
    num_gpus: int = 4

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None:
        del now, rng
        if view.running:
            return None
        cluster = view.cluster
        demand = view.demands[0]
        spec = load_model_spec(demand.model)
        out: list[Deployment] = []
        fast = PlannerConfig().fast_link_bytes_per_s
        for domain in cluster.fast_domains(fast):
            by_type: dict[str, list[str]] = {}
            for gid in domain:
                gpu = cluster.gpu(gid)
                if gpu.used_bytes == 0:
                    by_type.setdefault(gpu.type, []).append(gid)
            for ids in by_type.values():
                while len(ids) >= self.num_gpus:
                    group, ids = ids[: self.num_gpus], ids[self.num_gpus :]
                    out.append(
                        Deployment(
                            f"{demand.name}-{len(out)}",
                            demand.name,
                            demand.model,
                            Gear(tp=self.num_gpus, dtype=demand.dtypes[0]),
                            (tuple(group),),
                            (spec.num_layers,),
                        )
                    )
        return out


def mmc_ttft_p99_s(instances: Sequence[PlannedInstance], rate_per_s: float) -> float:
    """A model's TTFT p99 at `rate_per_s` over `instances`, each a server of its SLO-meeting
    request rate at full load (its planned capacity / the planner's target utilisation): its
    predicted TTFT plus the M/M/c wait's 99th percentile (flexpipe.perf.slo_capacity).
    Infinite when over capacity."""
    if not instances:
        return math.inf
    util = PlannerConfig().target_utilization
    mu = sum(i.capacity_requests_per_s for i in instances) / util / len(instances)
    ttft_s = max(i.estimate.ttft_s for i in instances)
    return ttft_s + mmc_wait_quantile_s(len(instances), mu, rate_per_s)


@dataclass(slots=True)
class PeakSloPolicy:
    """Peak provisioning sized at the SLO: the planner's plan at each model's peak rate (the
    busiest report interval), then each model whose M/M/c TTFT p99 (`mmc_ttft_p99_s`) misses
    its SLO is planned again for a rate `step` times higher, until every model meets it (or
    `max_rounds`: the cluster may hold no more). Never changed."""

    name: str = "peak-slo"
    routing: str | None = None
    interval_s: float | None = None
    step: float = 1.25
    max_rounds: int = 20
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # the scenario's `planner:`

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None:
        del rng
        if view.running:
            return None
        peaks = view.peak_demands
        the_plan = peak_slo_plan(view.cluster, peaks, now, self.step, self.max_rounds, self.planner)
        return [Deployment.of(i) for i in the_plan]

    def __post_init__(self) -> None:
        if self.step <= 1:
            raise ValueError("step must be > 1")


def peak_slo_plan(
    cluster: Cluster,
    peaks: Sequence[ModelDemand],
    now: float = 0.0,
    step: float = 1.25,
    max_rounds: int = 20,
    config: PlannerConfig | None = None,
) -> tuple[PlannedInstance, ...]:
    """`PeakSloPolicy`'s plan (the tests check it fits the cluster). Under `sizing: slo`
    the planner's capacities are already the rates that meet the SLO with queueing
    (flexpipe.perf.slo_capacity): its peak plan is the answer, no M/M/c rounds."""
    config = config or PlannerConfig()
    asked = list(peaks)
    the_plan = plan(cluster, asked, None, config=config, now_s=now)
    for _ in range(max_rounds if config.sizing == "throughput" else 0):
        short = [
            m
            for m, d in enumerate(peaks)
            if mmc_ttft_p99_s(
                [i for i in the_plan.instances if i.model == d.name], d.request_rate_per_s
            )
            > d.slo.ttft_p99_s
        ]
        if not short:
            break
        for m in short:
            asked[m] = at_rate(asked[m], asked[m].request_rate_per_s * step)
        the_plan = plan(cluster, asked, None, config=config, now_s=now)
    return the_plan.instances


@dataclass(slots=True)
class _Shape:
    """A model's replica: its template gear's tensor-parallel size and dtype, and the
    concurrency a replica is meant to carry."""

    tp: int
    dtype: str
    target_concurrency: float


@dataclass(slots=True)
class KpaAutoscaler:
    """Knative's KPA per model (flexpipe.sim.autoscaler, with its defaults) over replicas of
    the model's best single-instance gear: the planner's evaluation (SLO-meeting batch and
    capacity) of every free GPU group of one stage, smallest tensor-parallel size that runs,
    best SLO-meeting capacity per GPU. Each replica goes on the best free group of that size
    (free: not running, not draining); the newest leave first. A model with no instance has
    its requests buffered at the gateway (`buffers_at_zero`) as Knative's activator does."""

    name: str = "autoscaler"
    routing: str | None = None
    interval_s: float | None = 2.0  # tick-interval
    params: KpaParams = field(default_factory=KpaParams)
    buffers_at_zero: bool = True
    _scalers: dict[str, KpaScaler] = field(default_factory=dict)
    _shapes: dict[str, _Shape | None] = field(default_factory=dict)
    _evaluator: tuple[Cluster, Evaluator] | None = None
    _num_launched: int = 0

    def _evaluator_for(self, view: PolicyView) -> Evaluator:
        if self._evaluator is None or self._evaluator[0] is not view.cluster:
            specs = tuple(load_model_spec(d.model) for d in view.demands)
            ev = Evaluator(view.cluster, view.demands, specs, GearLookup(), PlannerConfig())
            self._evaluator = (view.cluster, ev)
        return self._evaluator[1]

    def _groups(self, view: PolicyView, tp: int, taken: set[str]) -> list[tuple[str, ...]]:
        """Free groups of `tp` GPUs of one type in one fast domain, in the cluster's order."""
        out: list[tuple[str, ...]] = []
        fast = PlannerConfig().fast_link_bytes_per_s
        for domain in view.cluster.fast_domains(fast):
            by_type: dict[str, list[str]] = {}
            for gid in domain:
                if gid not in taken and view.cluster.gpu(gid).free_bytes > 0:
                    by_type.setdefault(view.cluster.gpu(gid).type, []).append(gid)
            for ids in by_type.values():
                out.extend(tuple(ids[k : k + tp]) for k in range(0, len(ids) - tp + 1, tp))
        return out

    def _best(
        self, view: PolicyView, m: int, tp: int, dtypes: Sequence[str], taken: set[str]
    ) -> Candidate | None:
        ev = self._evaluator_for(view)
        best: Candidate | None = None
        for group in self._groups(view, tp, taken):
            for dtype in dtypes:
                c = ev.evaluate(m, (group,), dtype)
                if isinstance(c, Candidate) and (
                    best is None or c.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu
                ):
                    best = c
        return best

    def _shape(self, view: PolicyView, m: int, taken: set[str]) -> _Shape | None:
        demand = view.demands[m]
        if demand.name not in self._shapes:
            shape = None
            for tp in (1, 2, 4, 8):
                best = self._best(view, m, tp, demand.dtypes, taken)
                if best is not None:
                    target = best.gear.max_num_seqs * self.params.target_utilization
                    shape = _Shape(tp, best.gear.dtype, target)
                    break
            self._shapes[demand.name] = shape
        return self._shapes[demand.name]

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None:
        del rng
        taken = {g for d in view.running for g in d.gpu_ids} | set(view.draining_gpu_ids)
        wanted = list(view.running)
        changed = False
        for m, demand in enumerate(view.demands):
            shape = self._shape(view, m, taken)
            if shape is None:
                continue
            scaler = self._scalers.get(demand.name)
            mine = [d for d in wanted if d.model == demand.name]
            if scaler is None:
                scaler = self._scalers[demand.name] = KpaScaler(
                    shape.target_concurrency, self.params
                )
                num = self.params.initial_scale
            else:
                scaler.observe(now, float(view.in_flight.get(demand.name, 0)))
                num = scaler.scale(now, sum(d.name in view.ready for d in mine))
            while len(mine) > num:
                wanted.remove(mine.pop())
                changed = True
            while len(mine) < num:
                best = self._best(view, m, shape.tp, (shape.dtype,), taken)
                if best is None:
                    break
                self._num_launched += 1
                dep = Deployment(
                    f"{demand.name}-r{self._num_launched}",
                    demand.name,
                    demand.model,
                    best.gear,
                    best.stages,
                    best.layers_per_stage,
                )
                taken.update(dep.gpu_ids)
                mine.append(dep)
                wanted.append(dep)
                changed = True
        return wanted if changed else None


POLICIES: dict[str, Callable[[], Policy]] = {
    "flexpipe": ShiftingPolicy,
    "round_robin": lambda: ShiftingPolicy(name="round_robin", routing="round_robin"),
    "static": lambda: PlannerPolicy(name="static"),
    "peak": lambda: PlannerPolicy(name="peak", at_peak=True),
    "peak-slo": PeakSloPolicy,
    "autoscaler": KpaAutoscaler,
    "wait-for-ideal": WaitForIdeal,
}


def create_policy(name: str, scenario: Scenario | None = None) -> Policy:
    """A registered policy, or one of `scenario`'s fixed `plans`."""
    if scenario is not None and name in scenario.plans:
        return FixedPlan(name, scenario.plans[name])
    factory = POLICIES.get(name)
    if factory is None:
        known = [*POLICIES, *(scenario.plans if scenario is not None else ())]
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(known)}")
    policy = factory()
    if scenario is not None and isinstance(policy, PlannerPolicy | PeakSloPolicy):
        policy.planner = scenario.planner
    return policy


def at_rate(demand: ModelDemand, rate_per_s: float) -> ModelDemand:
    return replace(demand, request_rate_per_s=rate_per_s)
