"""The controller's tick core (control/core/tick.py, core/standby.py), pure and exact: plain
readings in, the decision, the holds and refusals and the plan changes out; then the live
`Controller` and the `SimController` driven through their own shells with the same readings
(a fake gateway client for the one, a fake world for the other) reach the same decision.

The planner is the real one on the seed's fragmented 4-GPU cluster (the built-in gear table).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from flexpipe.cluster import load_cluster
from flexpipe.control.api.gateway_client import GatewayClient
from flexpipe.control.controller import Controller
from flexpipe.control.controller_config import ControllerConfig
from flexpipe.control.core.planner import ControllerPlanner
from flexpipe.control.core.resources import Resources
from flexpipe.control.core.samples import TTFT_HISTOGRAM, Buckets
from flexpipe.control.core.shift_outcome import ShiftOutcome
from flexpipe.control.core.standby import RefusalChange, Renewal, StandbyCommand
from flexpipe.control.core.tick import Decided, Readings, TickCore, TickParams, decision_brief
from flexpipe.control.executor import LiveInstance
from flexpipe.gateway.core.holds import STANDBY_HOLD_S
from flexpipe.launch import LocalLauncher
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import ModelDemand, PlannedInstance, Slo
from flexpipe.policies.shift import Sample, ShiftParams, ShiftPolicy, ShiftRecord
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.sim.controller import ControllerParams, SimController

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_FILE = ROOT / "examples/clusters/fragmented-4gpu.yaml"
CLUSTER = load_cluster(CLUSTER_FILE)
M = ModelDemand("m", "llama-2-7b", 1.5, 2048, 256, Slo(2.0, 0.05), ("bf16", "fp8"))
# scaled to zero when idle: no demand planned, no minimum
Z = ModelDemand("z", "llama-2-7b", 0.0, 512, 64, Slo(2.0, 0.2), ("bf16",), min_instances=0)
TIMES_S = (10.0, 20.0, 30.0, 40.0, 50.0)
NOT_PLACED = (
    "no GPU free to us can place z (llama-2-7b): z: minimum of 1 instance(s) not met, 0 fit "
    "on the GPUs left (left out: gpu0 fully held by batch; gpu1 fully held by batch; gpu2 "
    "fully held by batch; gpu3 fully held by batch)"
)


def core(*demands: ModelDemand, floor: int = 1) -> TickCore:
    planner = ControllerPlanner(GearLookup())
    policy = ShiftPolicy(ShiftParams(), planner=planner)
    return TickCore(TickParams(demands, STANDBY_HOLD_S, 10.0, floor), policy, planner,
                    random.Random(0))  # fmt: skip


def running_m() -> tuple[PlannedInstance, ...]:
    return ControllerPlanner(GearLookup())(CLUSTER, (M,), 0.0).instances


def pool(k: int) -> list[dict[str, Any]]:
    """The gateway's record of m's one engine at the k-th tick: full, its queue growing."""
    return [{"url": "http://127.0.0.1:9001", "model": "m", "state": "active",
             "max_concurrency": 8, "num_running": 8, "num_in_flight": 14 + k,
             "num_waiting": 6 + k}]  # fmt: skip


def ttft(n: int) -> dict[tuple[str, str], Buckets]:
    """`n` first tokens so far, each between 1 and 2.5 s (an SLO of 2 s)."""
    inf = math.inf
    return {(TTFT_HISTOGRAM, "m"): ((0.5, 0.0), (1.0, 0.0), (2.5, float(n)), (inf, float(n)))}


# -- the core alone --------------------------------------------------------------------------


def test_a_queue_growing_five_ticks_in_a_row_is_an_up_shift() -> None:
    c = core(M)
    running = running_m()
    assert [(i.name, i.gpu_ids, i.gear.key()) for i in running] == [
        ("m-0", ("gpu2",), "tp1-pp1-bf16-kvauto-s24")
    ]
    decided: list[Decided] = []
    for k, t in enumerate(TIMES_S):
        c.observe(t, Readings(pool(k), ttft(10 * (k + 1)), 0, {"m": 0}, {"m": 15.0 * (k + 1)}))
        decided.append(c.decide(t, CLUSTER, running))
    # each sample: the queue over the slots, the p99 inside the (1, 2.5] bucket, all busy
    assert c.samples["m"] == [Sample(t, 6 + k, 8, 2.485, None, 1.0) for k, t in enumerate(TIMES_S)]
    assert c.rates.rates_per_s == {"m": 1.5}  # 60 more finished in the 40 s since the first
    assert [(d.decision.action, d.shift) for d in decided[:4]] == [("hold", False)] * 4
    assert [d.logged for d in decided] == [False, False, False, False, True]
    up = decided[-1]
    assert up.shift and up.renewal is None  # nothing held: nothing to renew
    assert decision_brief(up.decision) == {
        "at_s": 50.0, "action": "shift", "trigger": "up",
        "reason": "m in the up zone 5 samples in a row; replan: score 177.3 = gain 186.7 - "
        "gap 0.0 - migration 0.0 - risk 9.3 (the planner's plan for the GPUs free now)",
        "score": 177.32, "target": ["m-0", "m-1"],
    }  # fmt: skip
    assert up.decision.target is not None
    assert [(i.gpu_ids, i.gear.key()) for i in up.decision.target] == [
        (("gpu2",), "tp1-pp1-bf16-kvauto-s24"),
        (("gpu1",), "tp1-pp1-bf16-kvauto-s16"),
    ]
    # entered in the policy's history at once (its cooldown counts from the start)
    added = ("m|tp1-pp1-bf16-kvauto-s16|gpu1",)
    assert c.history == [ShiftRecord(50.0, target_keys=added)]


def test_a_dead_instance_leaves_the_plan_and_its_gpus_are_replanned() -> None:
    c = core(M)
    (planned,) = running_m()
    dead, alive, other = object(), object(), object()
    running = {instance_key(planned): dead, "m|other|gpu0": alive}
    # `other` is no longer in the plan (replaced under its key): not dropped
    assert c.drop_dead(running, [dead, other], 7.0) == [(instance_key(planned), dead)]
    assert running == {"m|other|gpu0": alive}
    assert c.resources_changed_s == 7.0
    c.observe(7.0, Readings([], {}, 0, {"m": 0}, {"m": 0.0}))
    lost = c.decide(7.0, CLUSTER, [])
    assert (lost.decision.action, lost.decision.trigger, lost.shift) == ("shift", "floor", True)
    assert lost.decision.reason.startswith("m has 0 instance(s), below its minimum of 1; replan:")
    assert lost.decision.target == (planned,)  # the same instance again, on gpu2
    # a shift that succeeds answers the change; one that fails is a failure of its target
    c.shift_finished(ShiftOutcome(), 9.0)
    assert c.resources_changed_s is None
    assert c.history == [ShiftRecord(7.0, 9.0, True, (instance_key(planned),))]
    assert c.drop_dead(running, [], 10.0) == [] and c.resources_changed_s is None


def test_a_model_at_zero_is_held_refused_when_nothing_can_place_it_and_woken() -> None:
    c = core(Z, floor=0)
    free = Resources.of(CLUSTER, 0.0)
    full, _ = free.occupy(list(CLUSTER.gpu_ids), "batch", None, 0.0)
    back_soon, _ = free.occupy(list(CLUSTER.gpu_ids), "batch", 500.0, 0.0)
    hold = StandbyCommand("z", STANDBY_HOLD_S, None, standby=True)
    refuse = StandbyCommand("z", STANDBY_HOLD_S, NOT_PLACED, standby=True)

    assert c.standby([], free, 5.0, 5.0) == [hold]
    assert c.standby_state.settle(hold) is None and c.standby_state.held == {"z"}
    # every GPU held by another tenant: refused (a 503 with the reason), said once
    assert c.standby([], full, 5.0, 5.0) == [refuse]
    assert c.standby_state.settle(refuse) == RefusalChange("z", NOT_PLACED, None, True)
    assert c.standby_state.settle(refuse) is None
    # a GPU due back within the hold: held for it, not refused
    assert c.standby([], back_soon, 5.0, 5.0) == [hold]
    # a shift renews the refusal as a refusal (a hold would lift it), every tick at most
    assert c.renewal(["z"]) == Renewal((), (("z", NOT_PLACED),), 10.0)
    assert c.standby([], free, 6.0, 6.0) == [hold]
    assert c.standby_state.settle(hold) == RefusalChange("z", None, NOT_PLACED, True)
    assert c.renewal([]) == Renewal(("z",), (), 10.0)

    # its requests queue: a wake, with its hold renewed while the engine loads
    c.observe(20.0, Readings([], {}, 3, {"z": 3}, {"z": 0.0}))
    wake = c.decide(20.0, CLUSTER, [])
    assert (wake.decision.trigger, wake.shift) == ("wake", True)
    assert wake.decision.target is not None
    assert [(i.name, i.gpu_ids) for i in wake.decision.target] == [("z-0", ("gpu2",))]
    assert wake.renewal == Renewal(("z",), (), 10.0)
    # it serves again: released (a hold of 0 s), no longer held
    release = StandbyCommand("z", 0.0, None, standby=False)
    assert c.standby(["z"], free, 30.0, 30.0) == [release]
    assert c.standby_state.settle(release) is None and c.standby_state.held == set()
    assert c.standby(["z"], free, 40.0, 40.0) == []


def test_an_idle_model_shifted_to_zero_is_held_while_its_last_instance_drains() -> None:
    c = core(Z, floor=0)
    busy = replace(Z, request_rate_per_s=1.0, min_instances=1)  # as it was planned
    running = ControllerPlanner(GearLookup())(CLUSTER, (busy,), 0.0).instances
    assert [i.name for i in running] == ["z-0"]
    idle = [{"url": "http://127.0.0.1:9001", "model": "z", "state": "active",
             "max_concurrency": 8}]  # fmt: skip
    for t in TIMES_S:
        c.observe(t, Readings(idle, {}, 0, {"z": 0}, {"z": 0.0}))
        down = c.decide(t, CLUSTER, running)
    assert (down.decision.trigger, down.decision.target, down.shift) == ("down", (), True)
    # not held before (it served): the shift holds it at zero itself, renewed while it runs
    assert c.standby_state.held == set()
    assert down.renewal == Renewal(("z",), (), 10.0)


def test_sim_engines_at_a_time_scale_are_read_in_the_models_seconds() -> None:
    """0.05 wall s per modelled s: latencies 20 times longer, rates 20 times lower."""
    planner = ControllerPlanner(GearLookup())
    policy = ShiftPolicy(ShiftParams(), planner=planner)
    c = TickCore(
        TickParams((M,), STANDBY_HOLD_S, time_scale=0.05), policy, planner, random.Random(0)
    )
    for k, t in enumerate((10.0, 20.0)):
        c.observe(t, Readings(pool(k), ttft(10 * (k + 1)), 0, {"m": 0}, {"m": 15.0 * (k + 1)}))
    assert c.samples["m"][-1] == Sample(20.0, 7, 8, 2.485 / 0.05, None, 1.0)
    assert c.rates.rates_per_s == {"m": 1.5 * 0.05}


def test_a_renewal_sends_the_refusals_then_the_holds() -> None:
    kept = Renewal(("a", "b"), (("big", "why"),), 2.0)
    assert kept.commands(6.0) == [
        StandbyCommand("big", 6.0, "why"),
        StandbyCommand("a", 6.0),
        StandbyCommand("b", 6.0),
    ]


def test_the_core_imports_no_io() -> None:
    """In a fresh process: the tick's core pulls in neither asyncio nor a module of the
    gateway, the store, HTTP, the launchers or the live executor."""
    code = (
        "import sys; import flexpipe.control.core.tick, flexpipe.control.core.standby; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'asyncio' or m.startswith("
        "('flexpipe.store', 'flexpipe.gateway', 'flexpipe.http', 'flexpipe.launch', "
        "'flexpipe.control.executor', 'flexpipe.control.api.gateway_client'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert out.stdout.strip() == "[]"


# -- the two shells ---------------------------------------------------------------------------


@dataclass
class FakeGateway:
    """The live controller's gateway client at the I/O seam: canned readings, the holds and
    refusals it was sent."""

    readings: Readings
    url: str = "http://127.0.0.1:9"
    sent: list[tuple[str, str, float]] = field(default_factory=list)

    async def hold(self, model: str, seconds: float) -> None:
        self.sent.append(("hold", model, seconds))

    async def refuse(self, model: str, why: str, seconds: float) -> None:
        self.sent.append(("refuse", model, seconds))

    async def instances(self) -> list[dict[str, Any]]:
        return [dict(i) for i in self.readings.instances]

    async def metrics(self) -> str:
        """The readings as the gateway's Prometheus text."""
        r = self.readings
        lines = [
            "# TYPE flexpipe_queued_requests gauge",
            f"flexpipe_queued_requests {r.num_queued}",
            "# TYPE flexpipe_model_queued_requests gauge",
        ]
        for model, n in (r.queued_by_model or {}).items():
            lines.append(f'flexpipe_model_queued_requests{{model="{model}"}} {n}')
        lines.append("# TYPE flexpipe_requests_total counter")  # (as prometheus_client writes it)
        for model, done in r.done_by_model.items():
            lines.append(f'flexpipe_requests_total{{model="{model}",status="200"}} {done}')
        lines.append(f"# TYPE {TTFT_HISTOGRAM} histogram")
        for (name, model), buckets in r.histograms.items():
            for bound, count in buckets:
                le = "+Inf" if math.isinf(bound) else repr(bound)
                lines.append(f'{name}_bucket{{model="{model}",le="{le}"}} {count}')
            lines.append(f'{name}_count{{model="{model}"}} {buckets[-1][1]}')
            lines.append(f'{name}_sum{{model="{model}"}} 0.0')
        return "\n".join(lines) + "\n"


class FakeWorld:
    """The simulator's world, as far as its controller's tick reaches."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, float]] = []
        self.loop = SimpleNamespace(at=lambda at_s, priority, call: None)

    def hold(self, model: str, seconds: float, now: float) -> None:
        self.sent.append(("hold", model, seconds))

    def refuse(self, model: str, why: str, seconds: float, now: float) -> None:
        self.sent.append(("refuse", model, seconds))


@dataclass
class Handle:
    endpoint: str
    returncode: int | None = None


def shells(
    demand: ModelDemand, floor: int, running: tuple[PlannedInstance, ...], readings: Readings
) -> tuple[Controller, FakeGateway, SimController, FakeWorld, list[Any], list[Any]]:
    """A live controller and a simulated one, both running `running`, their shifts recorded
    instead of carried out."""
    gateway = FakeGateway(readings)
    clock = [0.0]
    cfg = ControllerConfig(CLUSTER_FILE, (demand,), min_instances_floor=floor)
    live = Controller(cfg, LocalLauncher(), cast(GatewayClient, gateway),
                      lambda p, c: cast(Any, None), clock=lambda: clock[0],
                      wall=lambda: clock[0], say=lambda line: None)  # fmt: skip
    world = FakeWorld()
    sim = SimController(
        cast(Any, world), CLUSTER, (demand,), lambda: [dict(i) for i in gateway.readings.instances],
        lambda: gateway.readings.num_queued, lambda: dict(gateway.readings.queued_by_model or {}),
        ControllerParams(min_instances_floor=floor), random.Random(0), lambda record: None,
    )  # fmt: skip
    for p in running:
        handle = cast(Any, Handle("http://127.0.0.1:9001"))
        live.running[instance_key(p)] = LiveInstance(p, handle, "active")
        sim.running[instance_key(p)] = SimpleNamespace(planned=p)
    live_shifts: list[Any] = []
    sim_shifts: list[Any] = []

    async def live_carry_out(decided: Decided) -> None:
        live_shifts.append(decided)

    live._carry_out = live_carry_out  # type: ignore[method-assign]

    def sim_carry_out(target: Any, now: float, decision: Any, kept: Any, **_: Any) -> None:
        sim_shifts.append((decision, kept))

    sim._carry_out = sim_carry_out  # type: ignore[method-assign,assignment]
    return live, gateway, sim, world, live_shifts, sim_shifts


def tick_both(live: Controller, sim: SimController, gateway: FakeGateway, now_s: float) -> Any:
    """One tick of each at `now_s`, on the gateway's current readings; the live decision."""
    live.clock = live.wall = lambda: now_s
    decision = asyncio.run(live.tick())
    sim._tick(now_s, sim._tick_version)
    return decision


def served(sim: SimController, k: int) -> Readings:
    """The k-th tick's gateway: 10 more first tokens in 2 s, 15 more requests done, as the
    simulated gateway saw them; the live one's readings say the same."""
    for _ in range(10):
        sim.first_token("m", 2.0)
    for _ in range(15):
        sim.request_ended(cast(Any, SimpleNamespace(model="m", completed=False)))
    return Readings(pool(k), sim.ttft.read(), 0, {"m": 0}, {"m": 15.0 * (k + 1)})


def test_the_live_and_the_simulated_controller_decide_the_same_up_shift() -> None:
    live, gateway, sim, world, live_shifts, sim_shifts = shells(M, 1, running_m(), Readings(
        pool(0), ttft(10), 0, {"m": 0}, {"m": 15.0}))  # fmt: skip
    decisions = []
    for k, t in enumerate(TIMES_S):
        gateway.readings = served(sim, k)
        decisions.append(tick_both(live, sim, gateway, t))
    assert live.core.samples == sim.core.samples
    assert live.core.samples["m"][-1] == Sample(50.0, 10, 8, 1.995, None, 1.0)  # in (1.5, 2]
    assert live.rates_per_s == sim.core.rates.rates_per_s == {"m": 1.5}
    assert [d.action for d in decisions] == ["hold"] * 4 + ["shift"]
    # the same record in the simulator's report, and the same shift handed to each shell
    assert sim.decisions == [decision_brief(decisions[-1])]
    assert sim.decisions[0]["trigger"] == "up" and sim.decisions[0]["target"] == ["m-0", "m-1"]
    ((sim_decision, sim_kept),) = sim_shifts
    (live_decided,) = live_shifts
    assert sim_decision.to_dict() == live_decided.decision.to_dict()
    assert sim_kept == live_decided.renewal is None
    assert (
        live.history
        == sim.core.history
        == [ShiftRecord(50.0, target_keys=("m|tp1-pp1-bf16-kvauto-s16|gpu1",))]
    )
    assert gateway.sent == world.sent == []  # m serves: nothing held


def test_the_live_and_the_simulated_controller_hold_and_wake_a_model_at_zero_alike() -> None:
    live, gateway, sim, world, live_shifts, sim_shifts = shells(
        Z, 0, (), Readings([], {}, 0, {"z": 0}, {"z": 0.0})
    )
    assert tick_both(live, sim, gateway, 10.0).action == "hold"
    gateway.readings = Readings([], {}, 3, {"z": 3}, {"z": 0.0})  # its requests queue
    woken = tick_both(live, sim, gateway, 20.0)
    held = ("hold", "z", STANDBY_HOLD_S)
    assert gateway.sent == world.sent == [held, held]
    assert sim.decisions == [decision_brief(woken)]
    assert sim.decisions[0]["trigger"] == "wake" and sim.decisions[0]["target"] == ["z-0"]
    ((_, sim_kept),) = sim_shifts
    assert sim_kept == live_shifts[0].renewal == Renewal(("z",), (), 10.0)
