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
- `wait-for-ideal`: seed 000 §4.1's fixed template, tp=4 on four identical, fully free,
  fast-linked GPUs, checked every minute on the cluster as it is then; serves nothing until
  such four exist;
- a scenario's own `plans:` (fixed deployments by name, e.g. the seed's forced 3-way).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from flexpipe.cluster import Cluster
from flexpipe.gears.gear import Gear
from flexpipe.model_spec import load_model_spec
from flexpipe.policies.planner import ModelDemand, PlannerConfig, plan
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


class Policy(Protocol):
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

    def decide(
        self, view: PolicyView, now: float, rng: random.Random
    ) -> Sequence[Deployment] | None:
        del rng
        if view.running:
            return None
        demands = view.peak_demands if self.at_peak else view.demands
        the_plan = plan(view.cluster, demands, None, config=PlannerConfig(), now_s=now)
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


POLICIES: dict[str, Callable[[], Policy]] = {
    "flexpipe": ShiftingPolicy,
    "round_robin": lambda: ShiftingPolicy(name="round_robin", routing="round_robin"),
    "static": lambda: PlannerPolicy(name="static"),
    "peak": lambda: PlannerPolicy(name="peak", at_peak=True),
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
    return factory()


def at_rate(demand: ModelDemand, rate_per_s: float) -> ModelDemand:
    return replace(demand, request_rate_per_s=rate_per_s)
