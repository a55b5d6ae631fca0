"""The live executor's Sleep and Wake against a real sim engine process (sleep mode on): a
request running when the sleep is asked finishes first, whole (`mode=wait`: never lost); the
gateway's pool follows asleep, then waking; a wake fails cleanly, for the procedure to
cold-start instead, when the engine died or another tenant took its GPU since the decision."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexpipe.cluster import load_cluster
from flexpipe.control.core.shift_commands import Failed
from flexpipe.control.executor import Executor, LiveInstance
from flexpipe.engine.testing import EngineProc, request, sim_engine
from flexpipe.policies.planner import parse_models, plan

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml")
(DEMAND,) = parse_models(yaml.safe_load((ROOT / "examples/models/llama-7b.yaml").read_text()), "m")
(L40S,) = [p for p in plan(CLUSTER, [DEMAND]).instances if p.gpu_ids == ("gpu3",)]
ADMIN = "admintok"
ARGS = ["llama-2-7b", "--load-time-s", "0", "--max-model-len", "512", "--admin-token", ADMIN]


@dataclass
class Handle:
    endpoint: str
    returncode: int | None = None
    cold_start_s: float = 1.0


@dataclass
class Gateway:
    """Records the lifecycle the executor tells the gateway."""

    states: list[str] = field(default_factory=list)

    async def set_state(self, url: str, state: str) -> None:
        self.states.append(state)


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProc]:
    # real time: 7B decode steps of ~10 ms, so a 100-token request runs ~1 s
    args = [*ARGS, "--time-scale", "1", "--enable-sleep-mode"]
    with sim_engine(args, env={"VLLM_SERVER_DEV_MODE": "1"}) as e:
        yield e


def executor(gateway: Gateway, cluster_now: Any = None) -> Executor:
    return Executor(None, gateway, lambda p: None, cluster_now=cluster_now)  # type: ignore[arg-type]


def complete(e: EngineProc, max_tokens: int) -> dict[str, Any]:
    body = {"model": "llama-2-7b", "prompt": "a long answer", "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip
    r = request("POST", e.url + "/v1/completions", body)
    assert r.status == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def running(e: EngineProc, max_tokens: int) -> concurrent.futures.Future[dict[str, Any]]:
    """A completion in a thread; returns once the engine runs it."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(complete, e, max_tokens)
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        reqs = request("GET", e.url + "/admin/requests", headers={"x-admin-token": ADMIN})
        if any(r["num_output_tokens"] > 0 for r in reqs.json()["requests"]):
            return fut
        time.sleep(0.005)
    raise AssertionError("the request never started")


def test_a_request_running_when_the_engine_sleeps_finishes_whole_first(engine: EngineProc) -> None:
    gateway = Gateway()
    ex = executor(gateway, lambda: CLUSTER)
    inst = LiveInstance(L40S, Handle(engine.url), "draining")  # type: ignore[arg-type]

    async def go() -> tuple[Any, Any]:
        try:
            asleep = await ex._sleep(inst, 1)
            return asleep, await ex._wake(inst, CLUSTER)
        finally:
            await ex.close()

    fut = running(engine, 100)
    asleep, woken = asyncio.run(go())
    assert fut.done()  # the sleep answered only once the request had ended
    out = fut.result(0)
    assert (out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]) == (
        "length",
        100,
    )
    assert asleep is inst and woken is inst and inst.sleep_level == 0
    assert gateway.states == ["asleep", "waking"] and inst.state == "waking"
    assert request("GET", engine.url + "/is_sleeping").json() == {"is_sleeping": False}


def test_a_wake_fails_cleanly_when_the_engine_died_or_its_gpu_was_taken(
    engine: EngineProc,
) -> None:
    taken = CLUSTER.with_used("gpu3", CLUSTER.gpu("gpu3").capacity_bytes, owner="tenant-b")
    gateway = Gateway()
    ex = executor(gateway, lambda: taken)
    inst = LiveInstance(L40S, Handle(engine.url), "asleep", sleep_level=1)  # type: ignore[arg-type]
    dead = LiveInstance(L40S, Handle(engine.url, returncode=-9), "asleep", sleep_level=1)  # type: ignore[arg-type]

    async def go() -> tuple[Any, Any]:
        try:
            return await ex._wake(inst, CLUSTER), await executor(gateway)._wake(dead, CLUSTER)
        finally:
            await ex.close()

    stolen, gone = asyncio.run(go())
    assert stolen == Failed(f"instance {L40S.name}: its GPU gpu3 was taken by tenant-b meanwhile")
    assert gone == Failed(f"instance {L40S.name} did not wake: its engine exited (-9)")
    assert gateway.states == ["waking"]  # (only the dead one got as far as waking)
