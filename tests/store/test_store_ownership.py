"""Two deployments on one store (every `flexpipe up` defaults to ~/.flexpipe) never take over
each other's engines: instances, shift log entries and the controller's lease belong to one
deployment (store/instance_registry.py, store/shift_log.py, store/controller_lease.py). And
one live controller per deployment: a second is refused with one line; a stale lease (its
holder dead, or silent) is taken over — the restart after kill -9."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from flexpipe.control.api.gateway_client import GatewayClient
from flexpipe.control.controller import Controller
from flexpipe.control.controller_config import ControllerConfig
from flexpipe.control.engines.takeover import Takeover
from flexpipe.control.state.lease import pid_alive
from flexpipe.launch import EngineHandle, LocalLauncher
from flexpipe.lifecycle import State
from flexpipe.policies.planner import ModelDemand, Slo
from flexpipe.store import Store
from flexpipe.store.controller_lease import ControllerLeases, Lease, LeaseHeldError, stale
from flexpipe.store.instance_registry import InstanceRecord, InstanceRegistry
from flexpipe.store.shift_entry import ShiftEntry
from flexpipe.store.shift_log import ShiftLog

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
HOST = "host-a"


def _register(reg: InstanceRegistry, name: str) -> int:
    return reg.register(name, "m", "tp1-pp1-bf16-kvauto-s8", ["gpu0"], f"http://{name}", "sim").id


def test_a_registry_lists_adopts_and_reconciles_only_its_deployments(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        a, b = InstanceRegistry(store, "A"), InstanceRegistry(store, "B")
        a1, b1, a2 = _register(a, "a1"), _register(b, "b1"), _register(a, "a2")
        assert [r.id for r in a.live_instances()] == [a1, a2]
        assert [r.id for r in b.live_instances()] == [b1]
        assert [r.id for r in InstanceRegistry(store).live_instances()] == [a1, b1, a2]
        adopted, gone = a.reconcile({a2}, "unreachable")
        assert ([r.id for r in adopted], [r.id for r in gone]) == ([a2], [a1])
        assert b.get(b1).state is State.STARTING  # B's engine: not A's to mark gone


class _Launcher:
    """The launcher seam: what a restarted controller asked it to adopt."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    async def adopt(self, records: Sequence[InstanceRecord]) -> Mapping[int, EngineHandle]:
        self.asked.append([r.name for r in records])
        return {}


class _Gateway:
    async def instances(self) -> list[dict[str, Any]]:
        return []


def test_a_restarted_controller_takes_over_only_its_deployments_engines(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        _register(InstanceRegistry(store, "A"), "a1")
        b1 = _register(InstanceRegistry(store, "B"), "b1")
        pending_b = ShiftLog(store, "B").append(ShiftEntry(at=T0, kind="shift", trigger="up"))
        launcher = _Launcher()
        takeover = Takeover(InstanceRegistry(store, "A"), ShiftLog(store, "A"),
                            launcher,  # type: ignore[arg-type]
                            _Gateway(),  # type: ignore[arg-type]
                            "sim", None, 1.0, lambda line: None)  # fmt: skip
        assert takeover.resume_history() == []  # B's shift is not A's history
        assert ShiftLog(store).get(pending_b.id or 0).outcome == "pending"  # nor A's to abort
        assert asyncio.run(takeover.survivors()) == []
        assert launcher.asked == [["a1"]]  # never B's engine: not adopted, not stopped
        assert InstanceRegistry(store).get(b1).live


def _lease(pid: int, host: str = HOST, heartbeat_s: float = 100.0) -> Lease:
    return Lease("A", pid, host, 0.0, heartbeat_s)


def test_a_lease_is_stale_when_its_holder_is_dead_or_silent() -> None:
    alive = {7}.__contains__
    assert stale(_lease(7), 130.0, HOST, alive, 60.0) is None
    assert stale(_lease(8), 130.0, HOST, alive, 60.0) == "pid 8 is gone"
    assert stale(_lease(8, "host-b"), 130.0, HOST, alive, 60.0) is None  # not ours to probe
    assert stale(_lease(8, "host-b"), 161.0, HOST, alive, 60.0) == "no heartbeat for 61 s"
    assert stale(_lease(7), 161.0, HOST, alive, 60.0) == "no heartbeat for 61 s"


def test_one_live_controller_per_deployment(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        leases = ControllerLeases(store, stale_after_s=60.0)
        alive = {7, 8}.__contains__
        assert leases.acquire("A", 7, HOST, 100.0, alive) is None
        assert leases.acquire("A", 7, HOST, 101.0, alive) is None  # ours again: fine
        assert leases.acquire("B", 8, HOST, 101.0, alive) is None  # another deployment
        with pytest.raises(LeaseHeldError) as held:
            leases.acquire("A", 8, HOST, 102.0, alive)
        assert str(held.value).startswith(
            "deployment 'A' already has a live controller (pid 7, heartbeat 1 s ago) in store"
        )
        assert "\n" not in str(held.value)
        assert leases.renew("A", 7, HOST, 150.0) is None
        with pytest.raises(LeaseHeldError):  # 59 s after the heartbeat, from another host
            leases.acquire("A", 9, "host-b", 209.0, alive)
        taken = leases.acquire("A", 9, "host-b", 211.0, alive)  # silent for 61 s: stale
        assert taken == Lease("A", 7, HOST, 101.0, 150.0)
        assert leases.renew("A", 7, HOST, 212.0) == Lease("A", 9, "host-b", 211.0, 211.0)
        assert not leases.release("A", 7, HOST)  # not ours any more
        # kill -9 of B's holder (pid 8): its successor takes over at once
        assert leases.acquire("B", 10, HOST, 103.0, {7}.__contains__) is not None
        assert leases.release("B", 10, HOST)
        assert leases.get("B") is None


def test_pid_alive() -> None:
    assert pid_alive(os.getpid()) and not pid_alive(0)


def test_a_second_controller_of_a_deployment_is_refused_in_one_line(tmp_path: Path) -> None:
    demand = ModelDemand("m", "llama-2-7b", 1.0, 512, 64, Slo(2.0, 0.1), ("bf16",))
    config = ControllerConfig(ROOT / "examples/clusters/fragmented-4gpu.yaml", (demand,))
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        gateway = GatewayClient("http://127.0.0.1:9", None)
        # a live controller of this gateway in another process (our parent: alive, not us)
        ControllerLeases(store).acquire(gateway.url, os.getppid(), socket.gethostname(),
                                        1e12, pid_alive)  # fmt: skip
        ctl = Controller(config, LocalLauncher(), gateway,
                         lambda p, c: None,  # type: ignore[arg-type,return-value]
                         store=store, wall=lambda: 1e12 + 1)  # fmt: skip

        async def run() -> str:
            try:
                await ctl.start()
            except RuntimeError as exc:
                return str(exc)
            finally:
                await ctl.close()
            return "started"

        said = asyncio.run(run())
        assert said.startswith(
            f"deployment '{gateway.url}' already has a live controller (pid {os.getppid()}, "
        )
        assert ctl.server is None and not ctl.running  # refused before serving or launching
        assert ControllerLeases(store).get(gateway.url) is not None  # the holder's, kept


def test_the_deployment_is_the_gateway_url_unless_given(tmp_path: Path) -> None:
    demand = ModelDemand("m", "llama-2-7b", 1.0, 512, 64, Slo(2.0, 0.1), ("bf16",))
    cluster = ROOT / "examples/clusters/fragmented-4gpu.yaml"
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        for cfg, expected in (
            (ControllerConfig(cluster, (demand,)), "http://127.0.0.1:9"),
            (ControllerConfig(cluster, (demand,), deployment_id="prod"), "prod"),
        ):
            ctl = Controller(cfg, LocalLauncher(), GatewayClient("http://127.0.0.1:9/", None),
                             lambda p, c: None,  # type: ignore[arg-type,return-value]
                             store=store)  # fmt: skip
            assert ctl.deployment == ctl.status()["deployment"] == expected
            assert ctl.registry is not None and ctl.registry.deployment == expected
            assert ctl.shift_log is not None and ctl.shift_log.deployment == expected


def test_a_spawned_engine_is_never_in_the_store_without_its_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller killed right after an engine's row is written: the row already names the
    engine's process, so the successor can stop it (before, the row was written, then its
    pid in a second write: a kill between the two left an engine no one knew to stop)."""
    from flexpipe.launch import EngineSpec

    def killed(*args: Any, **kwargs: Any) -> None:
        raise SystemExit("controller killed")

    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        registry = InstanceRegistry(store, "A")
        takeover = Takeover(registry, ShiftLog(store, "A"),
                            _Launcher(),  # type: ignore[arg-type]
                            _Gateway(),  # type: ignore[arg-type]
                            "sim", None, 1.0, lambda line: None)  # fmt: skip
        monkeypatch.setattr(InstanceRegistry, "set_process", killed)
        takeover.spawned(EngineSpec("m", name="m-0", gpu_ids=("g0",)), 4321, "http://e")
        (row,) = registry.live_instances()
        assert (row.pid, row.pgid, row.endpoint) == (4321, 4321, "http://e")
