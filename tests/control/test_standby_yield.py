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
DEMANDS = (A, replace(A, name="b"), replace(A, name="c"))
(TEMPLATE, *_) = plan(CLUSTER, (A,)).instances
HOLDER = replace(TEMPLATE, name="a-0", stages=(("gpu2",),), layers_per_stage=(32,))
OTHER = replace(TEMPLATE, name="a-1", stages=(("gpu3",),), layers_per_stage=(32,))
STANDBY = replace(HOLDER, name="b-0", model="b")
SHARE = StandbyParams(enabled=True, time_share=True)


@dataclass
class Inst:
    planned: PlannedInstance

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:1/{self.planned.name}"


@dataclass
class World:
    """The fake controller's state and each change beside: (trigger, target, what was awake
    on the target's GPUs as it began, beside the change's own running instances)."""

    running: dict[str, Inst]
    sleepers: dict[str, Inst] = field(default_factory=dict)
    load_fails: bool = False
    loading: asyncio.Event | None = None  # set: a standby's launch may end
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
            elif self.loading is not None and trigger == "standby":
                await self.loading.wait()
                running[k] = Inst(t)
            else:
                running[k] = Inst(t)

    async def hold_all(self, models: list[str], hold_s: float) -> None:
        self.held.append(models)


def shell(w: World, kind: str) -> StandbySleepers:
    ctl: Any = SimpleNamespace(
        cfg=SimpleNamespace(
            shift=SimpleNamespace(standby=SHARE), engine_kind=kind, demands=DEMANDS
        ),
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


def pool(w: World, in_flight: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """The gateway's pool records of what runs (`in_flight`: by instance name, else 0)."""
    return [
        {"url": i.url, "model": i.planned.model, "state": "active", "max_num_seqs": 8,
         "num_in_flight": (in_flight or {}).get(i.planned.name, 0)}
        for i in w.running.values()
    ]  # fmt: skip


def start(w: World, kind: str, in_flight: dict[str, int] | None = None,
          queued: dict[str, int] | None = None) -> StandbySleepers:  # fmt: skip
    """`start_standbys([STANDBY])` on the pool and queue as a look read them."""
    beside = shell(w, kind)
    asyncio.run(beside.start_standbys([STANDBY], pool(w, in_flight), queued or {}))
    return beside


def test_the_holder_sleeps_the_standby_loads_and_sleeps_the_holder_wakes() -> None:
    w = world()
    start(w, "vllm")
    assert w.log == [
        ("standby-yield", ["a-1"], []),
        ("standby", ["b-0"], []),  # nothing awake on gpu2 as the standby starts
        ("standby", [], []),
        ("standby-return", ["a-0", "a-1"], []),
    ]
    assert sorted(w.running) == sorted([instance_key(HOLDER), instance_key(OTHER)])
    assert list(w.sleepers) == [instance_key(STANDBY)]
    # the holds lifted: the yielded holder's model's (b serves nothing yet: none of it)
    assert w.held == [["a"]]


def test_the_sim_engine_loads_beside_the_awake_holder() -> None:
    w = world()
    start(w, "sim")
    assert w.log == [("standby", ["b-0"], ["a-0"]), ("standby", [], [])]
    assert list(w.sleepers) == [instance_key(STANDBY)]


def test_nothing_yields_while_the_shift_in_progress_uses_the_holder() -> None:
    w = world()
    beside = shell(w, "vllm")
    beside.main_keys = {instance_key(HOLDER)}
    asyncio.run(beside.start_standbys([STANDBY], pool(w), {}))
    beside.main_keys, beside.main_gpus = set(), {"gpu2"}
    asyncio.run(beside.start_standbys([STANDBY], pool(w), {}))
    assert w.log == [] and w.sleepers == {} and beside.aside_gpus == set()
    assert w.held == []  # nothing changed: no hold lifted (the shift's own may stand)


def test_a_failed_load_still_wakes_the_holder() -> None:
    w = world(load_fails=True)
    with pytest.raises(RuntimeError, match="not enough free GPU memory"):
        start(w, "vllm")
    assert [t for t, _, _ in w.log] == ["standby-yield", "standby", "standby-return"]
    assert sorted(w.running) == sorted([instance_key(HOLDER), instance_key(OTHER)])


def test_holders_to_yield_by_engine_kind() -> None:
    running = [HOLDER, OTHER]
    idle: dict[str, Any] = {"priorities": {}, "pressed_models": (), "in_flight_by_key": {},
                            "queued_by_model": {}}  # fmt: skip
    assert holders_to_yield([STANDBY], running, False, **idle) == ([STANDBY], [HOLDER])
    assert holders_to_yield([STANDBY], running, True, **idle) == ([STANDBY], [])
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


def test_only_an_idle_holder_that_yields_to_the_standby_s_model_sleeps() -> None:
    """A holder yields for a standby's whole cold start only as a swap's holder would
    (`yields_to`) and only idle: else that standby waits for a later look."""
    key = instance_key(HOLDER)
    alone = replace(STANDBY, name="b-1", stages=(("gpu1",),))  # nothing runs on gpu1

    def loaded(**kw: Any) -> tuple[list[str], list[str]]:
        args: dict[str, Any] = {"priorities": {}, "pressed_models": (), "in_flight_by_key": {},
                                "queued_by_model": {}} | kw  # fmt: skip
        standbys, holders = holders_to_yield([STANDBY, alone], [HOLDER, OTHER], False, **args)
        return [s.name for s in standbys], [h.name for h in holders]

    assert loaded() == (["b-0", "b-1"], ["a-0"])
    assert loaded(in_flight_by_key={key: 1.0}) == (["b-1"], [])  # serving
    assert loaded(in_flight_by_key={instance_key(OTHER): 3.0}) == (["b-0", "b-1"], ["a-0"])
    assert loaded(queued_by_model={"a": 2}) == (["b-1"], [])  # its model's requests wait
    assert loaded(pressed_models={"a"}) == (["b-1"], [])  # its model needs more engines
    assert loaded(priorities={"a": 2.0}) == (["b-1"], [])  # a higher-priority model's
    assert loaded(priorities={"b": 2.0}) == (["b-0", "b-1"], ["a-0"])
    # a higher-priority standby does not take a serving engine ahead of demand either
    assert loaded(priorities={"b": 2.0}, in_flight_by_key={key: 1.0}) == (["b-1"], [])


def test_a_serving_holder_is_not_taken_offline_for_a_standby() -> None:
    w = world()
    start(w, "vllm", in_flight={"a-0": 1})
    assert w.log == [] and w.sleepers == {} and w.held == []
    start(w, "vllm", queued={"a": 1})
    assert w.log == [] and w.sleepers == {}


def test_a_wake_aside_goes_on_while_a_yield_s_standby_loads() -> None:
    """The load runs outside the `aside` lock: the tick's wake of another model's sleeper
    proceeds meanwhile; the yielded holder (its model pressed too) and the loading
    standby's GPUs are left alone until the holder is back."""
    c_asleep = replace(TEMPLATE, name="c-0", model="c", stages=(("gpu1",),))
    a_asleep = replace(TEMPLATE, name="a-2", stages=(("gpu2",),))  # beside the holder
    w = world()

    async def run() -> None:
        w.loading = asyncio.Event()
        beside = shell(w, "vllm")
        loading = asyncio.create_task(beside.start_standbys([STANDBY], pool(w), {}))
        while not w.log or w.log[-1][0] != "standby":
            await asyncio.sleep(0)
        w.sleepers[instance_key(c_asleep)] = Inst(c_asleep)
        w.sleepers[instance_key(a_asleep)] = Inst(a_asleep)
        assert beside.yield_keys == {instance_key(HOLDER), instance_key(STANDBY)}
        assert beside.yield_gpus == {"gpu2"}
        woke = await asyncio.wait_for(beside.wake_aside(pool(w), {"a": 1, "c": 1}), 5.0)
        assert woke
        w.loading.set()
        await loading
        assert beside.yield_keys == set() and beside.yield_gpus == set()

    asyncio.run(run())
    assert w.log == [
        ("standby-yield", ["a-1"], []),
        ("standby", ["b-0"], []),
        ("wake-aside", ["a-1", "c-0"], []),  # not a-0 nor a-2: gpu2 is the standby's
        ("standby", [], []),
        ("standby-return", ["a-0", "a-1", "c-0"], []),
    ]
    assert w.held == [["a"]]
