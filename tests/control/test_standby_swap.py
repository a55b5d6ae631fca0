"""The live standby shell's swap (control/standby_live.py, `StandbySleepers.swap_aside`)
stepped by hand: a fake controller (plain data: its running plan, its sleepers, the
gateway's pool records) and a fake change beside that records each step and moves instances
as the shift procedure would. Pins the order (the holder sleeps, then the sleeper wakes),
the refusal while a shift uses the holder, the in-flight count read from the gateway's pool
by URL, and the holder woken back when the sleeper does not come up."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flexpipe.cluster import load_cluster
from flexpipe.control.standby_live import StandbySleepers
from flexpipe.policies.planner import ModelDemand, PlannedInstance, Slo, plan
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_sleepers import StandbyParams

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml").with_used("gpu1", 0.0)
A = ModelDemand("a", "llama-2-7b", 1.0, 2048, 256, Slo(2.0, 0.05), ("bf16",))
(TEMPLATE, *_) = plan(CLUSTER, (A,)).instances
HOLDER = replace(TEMPLATE, name="a-0", stages=(("gpu2",),), layers_per_stage=(32,))
OTHER = replace(TEMPLATE, name="a-1", stages=(("gpu3",),), layers_per_stage=(32,))
SLEEPER = replace(HOLDER, name="b-0", model="b")
SHARE = StandbyParams(enabled=True, time_share=True)


@dataclass
class Inst:
    planned: PlannedInstance
    url: str


@dataclass
class World:
    """The fake controller's state and what each change beside did."""

    running: dict[str, Inst]
    sleepers: dict[str, Inst]
    wake_fails: bool = False
    log: list[tuple[str, list[str]]] = field(default_factory=list)

    async def run_aside(self, running: dict[str, Inst], target: list[PlannedInstance],
                        trigger: str) -> None:  # fmt: skip
        """As the shift procedure: the running instances the target lacks sleep, the
        sleepers it names wake (unless `wake_fails`: released, and its cold start fails)."""
        self.log.append((trigger, sorted(t.name for t in target)))
        keys = {instance_key(t) for t in target}
        for k in [k for k in running if k not in keys]:
            self.sleepers[k] = running.pop(k)
        for k in sorted(keys - set(running)):
            inst = self.sleepers.pop(k)
            if not (self.wake_fails and inst.planned.model == "b"):
                running[k] = inst


def shell(
    world: World, priorities: dict[str, float], params: StandbyParams = SHARE
) -> StandbySleepers:
    demands = [replace(A, name=m, priority=p) for m, p in priorities.items()]
    ctl: Any = SimpleNamespace(
        cfg=SimpleNamespace(shift=SimpleNamespace(standby=params), demands=demands),
        running=world.running,
        executor=SimpleNamespace(sleepers=world.sleepers),
        cluster=CLUSTER,
    )
    beside = StandbySleepers(ctl)
    beside.run_aside = world.run_aside  # type: ignore[method-assign,assignment]
    return beside


def pool(num_in_flight: float) -> list[dict[str, Any]]:
    """The gateway's pool records: the holder serves `num_in_flight` requests."""
    return [
        {"url": "http://h", "model": "a", "state": "active", "num_in_flight": num_in_flight},
        {"url": "http://o", "model": "a", "state": "active", "num_in_flight": 0},
    ]


def world(**kw: Any) -> World:
    running = {instance_key(HOLDER): Inst(HOLDER, "http://h"),
               instance_key(OTHER): Inst(OTHER, "http://o")}  # fmt: skip
    return World(running, {instance_key(SLEEPER): Inst(SLEEPER, "http://s")}, **kw)


def swap(w: World, beside: StandbySleepers, num_in_flight: float = 0.0) -> bool:
    return asyncio.run(beside.swap_aside(pool(num_in_flight), {"b": 1}))


def test_the_holder_sleeps_first_then_the_sleeper_wakes() -> None:
    w = world()
    assert swap(w, shell(w, {"a": 1, "b": 2}), num_in_flight=3)  # b outranks a: a drains
    assert w.log == [("swap-sleep", ["a-1"]), ("swap-wake", ["a-1", "b-0"])]
    assert sorted(w.running) == sorted([instance_key(OTHER), instance_key(SLEEPER)])
    assert list(w.sleepers) == [instance_key(HOLDER)]


def test_an_equal_holder_yields_only_when_the_gateway_says_it_serves_nothing() -> None:
    w = world()
    assert not swap(w, shell(w, {"a": 1, "b": 1}), num_in_flight=1) and w.log == []
    assert swap(w, shell(w, {"a": 1, "b": 1}), num_in_flight=0)
    assert [t for t, _ in w.log] == ["swap-sleep", "swap-wake"]


def test_no_swap_touches_a_holder_the_shift_in_progress_uses() -> None:
    w = world()
    beside = shell(w, {"a": 1, "b": 2})
    beside.main_keys = {instance_key(HOLDER)}
    assert not swap(w, beside) and w.log == []
    beside.main_keys, beside.main_gpus = set(), {"gpu2"}
    assert not swap(w, beside) and w.log == []
    beside.main_gpus = set()
    assert swap(w, beside)


def test_a_sleeper_that_does_not_come_up_wakes_its_holder_back() -> None:
    w = world(wake_fails=True)
    assert swap(w, shell(w, {"a": 1, "b": 2}))
    assert w.log == [
        ("swap-sleep", ["a-1"]),
        ("swap-wake", ["a-1", "b-0"]),
        ("swap-back", ["a-0", "a-1"]),
    ]
    assert sorted(w.running) == sorted([instance_key(HOLDER), instance_key(OTHER)])


def test_without_time_share_nothing_is_swapped() -> None:
    w = world()
    beside = shell(w, {"a": 1, "b": 2}, replace(SHARE, time_share=False))
    assert not swap(w, beside) and w.log == []


def test_a_busy_guest_gives_its_host_the_gpu_back() -> None:
    """`hosts_take_back`: the holder is a guest (a standby placed beside b's engine): it
    yields to b while it serves, where a holder of equal priority would not."""
    w = world()
    beside = shell(w, {"a": 1, "b": 1}, replace(SHARE, hosts_take_back=True))
    assert not swap(w, beside, num_in_flight=2) and w.log == []
    beside.guest_keys = {instance_key(HOLDER)}
    assert swap(w, beside, num_in_flight=2)
    assert w.log == [("swap-sleep", ["a-1"]), ("swap-wake", ["a-1", "b-0"])]
