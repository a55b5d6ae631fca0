"""A shift cancelled while its engines load (the controller stops: Ctrl-C of `flexpipe up`
during the first plan) stops every engine it launched that is not serving yet, before the
cancellation returns — not later, when the controller's exit sends PR_SET_PDEATHSIG."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexpipe.cluster import load_cluster
from flexpipe.control.executor import Executor, LiveInstance
from flexpipe.policies.planner import PlannedInstance, parse_models, plan

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml")
(DEMAND,) = parse_models(yaml.safe_load((ROOT / "examples/models/llama-7b.yaml").read_text()), "m")


class Handle:
    def __init__(self, name: str) -> None:
        self.name = name
        self.endpoint = f"http://{name}"
        self.stopped = False
        self.cold_start_s = 1.0

    async def stop(self) -> None:
        self.stopped = True


class Launcher:
    """Engines become ready when the test says so; each start is recorded."""

    def __init__(self) -> None:
        self.ready: dict[str, asyncio.Event] = {}
        self.handles: dict[str, Handle] = {}

    async def start(self, spec: PlannedInstance) -> Handle:
        handle = self.handles[spec.name] = Handle(spec.name)
        event = self.ready.setdefault(spec.name, asyncio.Event())
        try:
            await event.wait()
        except asyncio.CancelledError:
            await handle.stop()  # what wait_ready does with an engine still loading
            raise
        return handle


class Gateway:
    """Adds instantly; `tell` (the switch to active) blocks while `block_tell` is set."""

    def __init__(self) -> None:
        self.block_tell = asyncio.Event()
        self.removed: list[str] = []

    async def add(self, url: str, *args: Any, **kwargs: Any) -> None:
        return None

    async def set_state(self, url: str, state: str) -> None:
        if state == "active" and self.block_tell.is_set():
            await asyncio.Event().wait()  # never answers

    async def remove(self, url: str) -> None:
        self.removed.append(url)

    async def hold(self, model: str, seconds: float) -> None:
        return None


def run_cancelled(block_activation: bool) -> tuple[Launcher, Gateway, dict[str, LiveInstance]]:
    first = plan(CLUSTER, [DEMAND]).instances
    assert len(first) >= 2
    launcher, gateway = Launcher(), Gateway()
    running: dict[str, LiveInstance] = {}

    async def go() -> None:
        executor = Executor(launcher, gateway, lambda p: p)  # type: ignore[arg-type,return-value]
        if block_activation:
            gateway.block_tell.set()
        shift = asyncio.ensure_future(
            executor.shift(CLUSTER, running, first, rehearse=False, all_or_nothing=False)
        )
        while len(launcher.handles) < len(first):
            await asyncio.sleep(0)
        launcher.ready.setdefault(first[0].name, asyncio.Event()).set()  # one engine ready
        if block_activation:
            for p in first:
                launcher.ready.setdefault(p.name, asyncio.Event()).set()
        for _ in range(20):
            await asyncio.sleep(0)
        shift.cancel()
        with pytest.raises(asyncio.CancelledError):
            await shift

    asyncio.run(go())
    return launcher, gateway, running


def test_cancelled_while_engines_load_stops_those_still_loading() -> None:
    """One engine is ready and serves (the first plan activates each as it is ready), the
    others still load: those are stopped; the serving one is the controller's to stop."""
    launcher, _, running = run_cancelled(block_activation=False)
    first = plan(CLUSTER, [DEMAND]).instances
    assert [i.planned.name for i in running.values()] == [first[0].name]
    assert not launcher.handles[first[0].name].stopped
    assert all(h.stopped for n, h in launcher.handles.items() if n != first[0].name)


def test_the_first_plan_serves_each_instance_as_soon_as_it_is_ready() -> None:
    """Held requests wait for the fastest engine, not the slowest."""
    first = plan(CLUSTER, [DEMAND]).instances
    launcher, gateway = Launcher(), Gateway()
    running: dict[str, LiveInstance] = {}

    async def go() -> None:
        executor = Executor(launcher, gateway, lambda p: p)  # type: ignore[arg-type,return-value]
        shift = asyncio.ensure_future(
            executor.shift(CLUSTER, running, first, rehearse=False, all_or_nothing=False)
        )
        while len(launcher.handles) < len(first):
            await asyncio.sleep(0)
        last = first[-1].name
        launcher.ready.setdefault(last, asyncio.Event()).set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert [i.planned.name for i in running.values()] == [last]  # the others still load
        assert not shift.done()
        for p in first:
            launcher.ready.setdefault(p.name, asyncio.Event()).set()
        out = await shift
        assert out.succeeded and out.reason == ""
        assert sorted(out.started) == sorted(running) and len(running) == len(first)

    asyncio.run(go())


def test_cancelled_during_the_switch_stops_what_is_not_serving_yet() -> None:
    """Every engine ready, the switch to active hangs: none serves, so all are stopped and
    taken out of the gateway's pool."""
    launcher, gateway, running = run_cancelled(block_activation=True)
    assert running == {}
    assert all(h.stopped for h in launcher.handles.values())
    assert sorted(gateway.removed) == sorted(h.endpoint for h in launcher.handles.values())
