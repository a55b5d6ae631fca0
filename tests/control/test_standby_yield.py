"""A standby loading beside an awake engine (control/standby_live.py,
`StandbySleepers.start_standbys`) stepped by hand, with a fake controller and a fake change
beside as in test_standby_swap.py. Pins the order an engine kind that cannot load beside an
awake engine needs (`EngineKind.loads_beside_awake` false, vLLM and SGLang): the holder
sleeps, the standby launches and sleeps, the holder wakes; the sim engine loads beside it
with nothing put to sleep; nothing moves while the shift in progress uses the holder; a
failed load still wakes the holder."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flexpipe.cluster import load_cluster
from flexpipe.control.core.standby_aside import holders_to_yield, launched_first
from flexpipe.control.standby_live import StandbySleepers
from flexpipe.engine_kinds import ENGINE_KINDS
from flexpipe.policies.planner import ModelDemand, PlannedInstance, Slo, plan
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_sleepers import StandbyParams

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml").with_used("gpu1", 0.0)
A = ModelDemand("a", "llama-2-7b", 1.0, 2048, 256, Slo(2.0, 0.05), ("bf16",))
(TEMPLATE, *_) = plan(CLUSTER, (A,)).instances
HOLDER = replace(TEMPLATE, name="a-0", stages=(("gpu2",),), layers_per_stage=(32,))
OTHER = replace(TEMPLATE, name="a-1", stages=(("gpu3",),), layers_per_stage=(32,))
STANDBY = replace(HOLDER, name="b-0", model="b")
SHARE = StandbyParams(enabled=True, time_share=True)


@dataclass
class Inst:
    planned: PlannedInstance


@dataclass
class World:
    """The fake controller's state and each change beside: (trigger, target, what was awake
    on the target's GPUs as it began, beside the change's own running instances)."""

    running: dict[str, Inst]
    sleepers: dict[str, Inst] = field(default_factory=dict)
    load_fails: bool = False
    log: list[tuple[str, list[str], list[str]]] = field(default_factory=list)
    held: list[list[str]] = field(default_factory=list)

    async def run_aside(self, running: dict[str, Inst], target: list[PlannedInstance],
                        trigger: str) -> None:  # fmt: skip
        """As the shift procedure: the running instances the target lacks sleep, the
        sleepers it names wake, the others launch (unless `load_fails`)."""
        gpus = {g for t in target for g in t.gpu_ids}
        awake = sorted(i.planned.name for i in self.running.values() if set(i.planned.gpu_ids)
                       & gpus and i.planned not in target)  # fmt: skip
        self.log.append((trigger, sorted(t.name for t in target), awake))
        keys = {instance_key(t) for t in target}
        for k in [k for k in running if k not in keys]:
            self.sleepers[k] = running.pop(k)
        for t in target:
            k = instance_key(t)
            if k in running:
                continue
            if k in self.sleepers:
                running[k] = self.sleepers.pop(k)
            elif self.load_fails:
                raise RuntimeError(f"{t.name}: not enough free GPU memory")
            else:
                running[k] = Inst(t)

    async def hold_all(self, models: list[str], hold_s: float) -> None:
        self.held.append(models)


def shell(w: World, kind: str) -> StandbySleepers:
    ctl: Any = SimpleNamespace(
        cfg=SimpleNamespace(shift=SimpleNamespace(standby=SHARE), engine_kind=kind),
        running=w.running,
        executor=SimpleNamespace(sleepers=w.sleepers),
        cluster=CLUSTER,
        _lock=asyncio.Lock(),
        takeover=SimpleNamespace(sweep_spawned=lambda: None),
        _hold_all=w.hold_all,
    )
    beside = StandbySleepers(ctl)
    beside.run_aside = w.run_aside  # type: ignore[method-assign,assignment]
    return beside


def world(**kw: Any) -> World:
    return World({instance_key(HOLDER): Inst(HOLDER), instance_key(OTHER): Inst(OTHER)}, **kw)


def test_the_holder_sleeps_the_standby_loads_and_sleeps_the_holder_wakes() -> None:
    w = world()
    asyncio.run(shell(w, "vllm").start_standbys([STANDBY]))
    assert w.log == [
        ("standby-yield", ["a-1"], []),
        ("standby", ["b-0"], []),  # nothing awake on gpu2 as the standby starts
        ("standby", [], []),
        ("standby-return", ["a-0", "a-1"], []),
    ]
    assert sorted(w.running) == sorted([instance_key(HOLDER), instance_key(OTHER)])
    assert list(w.sleepers) == [instance_key(STANDBY)]
    assert w.held == [[]]  # b serves nothing yet: no hold of it to lift


def test_the_sim_engine_loads_beside_the_awake_holder() -> None:
    w = world()
    asyncio.run(shell(w, "sim").start_standbys([STANDBY]))
    assert w.log == [("standby", ["b-0"], ["a-0"]), ("standby", [], [])]
    assert list(w.sleepers) == [instance_key(STANDBY)]


def test_nothing_yields_while_the_shift_in_progress_uses_the_holder() -> None:
    w = world()
    beside = shell(w, "vllm")
    beside.main_keys = {instance_key(HOLDER)}
    asyncio.run(beside.start_standbys([STANDBY]))
    beside.main_keys, beside.main_gpus = set(), {"gpu2"}
    asyncio.run(beside.start_standbys([STANDBY]))
    assert w.log == [] and w.sleepers == {} and beside.aside_gpus == set()


def test_a_failed_load_still_wakes_the_holder() -> None:
    w = world(load_fails=True)
    with pytest.raises(RuntimeError, match="not enough free GPU memory"):
        asyncio.run(shell(w, "vllm").start_standbys([STANDBY]))
    assert [t for t, _, _ in w.log] == ["standby-yield", "standby", "standby-return"]
    assert sorted(w.running) == sorted([instance_key(HOLDER), instance_key(OTHER)])


def test_holders_to_yield_by_engine_kind() -> None:
    running = [HOLDER, OTHER]
    assert holders_to_yield([STANDBY], running, loads_beside_awake=False) == [HOLDER]
    assert holders_to_yield([STANDBY], running, loads_beside_awake=True) == []
    assert {k: v.loads_beside_awake for k, v in ENGINE_KINDS.items()} == {
        "sim": True,
        "vllm": False,
        "sglang": False,
    }


B_PLANNED = replace(TEMPLATE, name="b-9", model="b", stages=(("gpu0",),), layers_per_stage=(32,))
STANDBY_ALONE = replace(HOLDER, name="b-1", model="b", stages=(("gpu1",),))


def test_the_first_plan_launches_no_standby_beside_another_engine_of_a_vllm_kind() -> None:
    planned = [HOLDER, OTHER, B_PLANNED]
    # beside the holder on gpu2: left to the standby looks; alone on gpu1: launched
    assert launched_first([STANDBY, STANDBY_ALONE], planned, False) == [STANDBY_ALONE]
    # b's only standby left out: b's planned instance (gpu0) comes back, nothing shares
    assert launched_first([STANDBY], planned, False) == []
    # ... and then shares gpu0 with c's standby, which is left out in the next round
    on_gpu0 = replace(STANDBY_ALONE, name="c-0", model="c", stages=(("gpu0",),))
    assert launched_first([STANDBY, on_gpu0], planned, False) == []
    assert launched_first([STANDBY_ALONE, on_gpu0], planned, False) == [STANDBY_ALONE, on_gpu0]
    assert launched_first([STANDBY, STANDBY_ALONE], planned, True) == [STANDBY, STANDBY_ALONE]


def test_the_shell_s_first_plan_by_engine_kind() -> None:
    for kind, names in (("vllm", ["a-0", "a-1", "b-9"]), ("sim", ["a-0", "a-1", "b-0"])):
        beside = shell(world(), kind)
        beside.standbys = lambda queued: [STANDBY]  # type: ignore[method-assign]
        first = beside.first_plan([HOLDER, OTHER, B_PLANNED])
        assert sorted(i.name for i in first) == names, kind
        assert beside.to_sleep == ({instance_key(STANDBY)} if kind == "sim" else set())
