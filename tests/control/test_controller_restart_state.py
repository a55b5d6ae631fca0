"""What a restarted controller keeps of the one before it (kill -9; `flexpipe up` starts it
again): the admin's GPU occupations (control/state/occupation_memory.py), read back from a real
SQLite store before the first plan, those that ran out while it was stopped dropped; and its
first log entry says what it adopted. Also what the controller's log says: an engine lost has
a trigger, a shift lists what it started and stopped, waiting requests are said once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

from flexpipe.cluster import Cluster
from flexpipe.control.api.gateway_client import GatewayClient
from flexpipe.control.controller import Controller, first_plan_note
from flexpipe.control.controller_config import ControllerConfig
from flexpipe.control.core.resources import Occupation, Overrides
from flexpipe.control.core.shift_outcome import ShiftOutcome
from flexpipe.control.core.wait_notice import WaitNotice
from flexpipe.control.executor import LiveInstance
from flexpipe.control.state.occupation_memory import persisted, restored
from flexpipe.launch import LocalLauncher
from flexpipe.lifecycle import State
from flexpipe.policies.planner import ModelDemand, Slo, plan
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.store import Store
from flexpipe.store.gpu_occupations import GpuOccupations
from flexpipe.store.instance_registry import InstanceRecord
from flexpipe.store.shift_entry import ShiftEntry
from flexpipe.store.shift_log import ShiftLog

ROOT = Path(__file__).resolve().parents[2]
T0_S = 1_790_000_000.0  # unix seconds: the controller's wall clock
DEMAND = ModelDemand("m", "llama-2-7b", 1.0, 512, 64, Slo(2.0, 0.1), ("bf16",))
GATEWAY = "http://127.0.0.1:9"


def _controller(
    store: Store, wall_s: float, lines: list[str] | None = None, **cfg: object
) -> Controller:
    config = ControllerConfig(ROOT / "examples/clusters/fragmented-4gpu.yaml", (DEMAND,),
                              **cfg)  # type: ignore[arg-type]  # fmt: skip
    return Controller(config, LocalLauncher(), GatewayClient(GATEWAY, None),
                      lambda p, c: None,  # type: ignore[arg-type,return-value]
                      store=store, clock=lambda: wall_s, wall=lambda: wall_s,
                      say=(lines if lines is not None else []).append)  # fmt: skip


def _occupy(ctl: Controller, gpus: list[str], until_s: float | None, now_s: float) -> None:
    ctl.change_resources(lambda: ctl.resources.occupy(gpus, "tenant", until_s, now_s))


def test_restored_drops_what_ran_out_and_persisted_leaves_the_command_lines() -> None:
    doc = {
        "gpu3": {"owner": "t", "since_s": 10.0, "until_s": 100.0},
        "gpu0": {"owner": "u", "since_s": 20.0, "until_s": None},
    }
    assert restored(doc, 99.0) == (Overrides.from_json(doc), [])
    kept, dropped = restored(doc, 100.0)
    assert kept == Overrides({"gpu0": Occupation("u", 20.0, None)})
    assert dropped == ["gpu3"]
    pinned = {"gpu1": Occupation("demo", 5.0)}
    both = Overrides({"gpu1": Occupation("demo", 5.0), "gpu0": Occupation("u", 20.0)})
    assert persisted(both, pinned) == Overrides({"gpu0": Occupation("u", 20.0)})
    # the admin took gpu1 over from the command line's tenant: the admin's, kept
    retaken = Overrides({"gpu1": Occupation("admin", 30.0)})
    assert persisted(retaken, pinned) == retaken


def test_occupations_survive_a_restart_until_they_run_out(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fp.db'}"
    with Store(url) as store:
        first = _controller(store, T0_S)
        _occupy(first, ["gpu2"], T0_S + 600, T0_S)
        _occupy(first, ["gpu0"], None, T0_S)
    lines: list[str] = []
    with Store(url) as store:  # kill -9, restarted 100 s later: both still held
        again = _controller(store, T0_S + 100, lines)
        assert set(again.resources.overrides.active(T0_S + 100)) == {"gpu0", "gpu2"}
        gpu2 = again.cluster.gpu("gpu2")
        assert (gpu2.free_bytes, gpu2.owner) == (0, "tenant")
        assert "still held: gpu0 (tenant), gpu2 (tenant)" in "\n".join(lines)
        # the first plan and the adoption's re-plan leave gpu2 alone: an instance a previous
        # controller left there is not kept (it is retired once the plan serves)
        fresh = again.planner(again.cluster, (DEMAND,), T0_S + 100)
        assert fresh.instances and all("gpu2" not in p.gpu_ids for p in fresh.instances)
        on_gpu2 = plan(_file(again), (DEMAND,), again.performance, now_s=T0_S).instances
        assert [p.gpu_ids for p in on_gpu2] == [("gpu2",)]  # where it ran before the occupation
        kept = plan(again.cluster, (DEMAND,), again.performance, running=on_gpu2,
                    now_s=T0_S + 100)  # fmt: skip
        assert all("gpu2" not in p.gpu_ids for p in kept.instances)
    lines = []
    with Store(url) as store:  # restarted after gpu2's until: dropped, and from the store too
        late = _controller(store, T0_S + 700, lines)
        assert set(late.resources.overrides.occupied) == {"gpu0"}
        assert "occupation(s) of gpu2 ran out while stopped" in "\n".join(lines)
        late._keep_occupations()  # what start() does once it holds the lease
        assert set(GpuOccupations(store).load(GATEWAY)) == {"gpu0"}
        late.change_resources(lambda: late.resources.release(["gpu0"], T0_S + 700))
        assert GpuOccupations(store).load(GATEWAY) == {}
    with Store(url) as store:
        assert _controller(store, T0_S + 800).resources.overrides.occupied == {}


def _file(ctl: Controller) -> Cluster:
    """The cluster file as read, without any occupation."""
    return ctl.resources.file


def test_occupations_belong_to_a_deployment_and_the_flags_are_not_kept(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        ctl = _controller(store, T0_S, occupied=("gpu1",), deployment_id="a")
        assert ctl.cluster.gpu("gpu1").free_bytes == 0
        _occupy(ctl, ["gpu3"], None, T0_S)
        assert set(GpuOccupations(store).load("a")) == {"gpu3"}  # not --occupy's gpu1
        other = _controller(store, T0_S + 1, deployment_id="b")
        assert other.resources.overrides.occupied == {}
        again = _controller(store, T0_S + 2, occupied=("gpu1",), deployment_id="a")
        assert set(again.resources.overrides.active(T0_S + 2)) == {"gpu1", "gpu3"}


# -- what the log says -----------------------------------------------------------------------


class _Dead:
    """An engine handle whose process exited (kill -9)."""

    endpoint = "http://127.0.0.1:9"
    returncode = -9
    cold_start_s = 1.0


def test_an_engine_that_died_is_logged_as_lost_and_a_shift_lists_what_it_changed(
    tmp_path: Path,
) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        ctl = _controller(store, T0_S)
        (p,) = ctl.planner(ctl.cluster, (DEMAND,), T0_S).instances
        ctl.running[instance_key(p)] = LiveInstance(p, _Dead(), "active")  # type: ignore[arg-type]
        asyncio.run(ctl._reap_dead(T0_S))
        (lost,) = ShiftLog(store).entries(kinds=["emergency"])
        assert (lost.trigger, lost.outcome) == ("lost", "succeeded")
        assert lost.reason == f"{instance_key(p)} exited (-9); its GPUs are re-planned"
        # a shift's entry lists the instances it started and stopped once it is done
        pending = ShiftLog(store).append(ShiftEntry(at=datetime.now(UTC), kind="reclaim",
                                                    trigger="reclaim"))  # fmt: skip
        ctl.journal.finish(pending, ShiftOutcome(started=["m|b|gpu0"], stopped=["m|a|gpu2"]))
        assert ShiftLog(store).get(pending.id or 0).notes == (
            "started m|b|gpu0",
            "stopped m|a|gpu2",
        )


def test_the_first_plan_after_a_restart_says_what_it_adopted() -> None:
    assert first_plan_note([], [], ShiftOutcome(started=["m|a|gpu2"])) == (
        "the first plan",
        ["started m|a|gpu2"],
    )
    retired = _record("m", "tp1-pp1-bf16-kvauto-s8", ("gpu3",))
    why, notes = first_plan_note(["m|a|gpu2", "m|b|gpu0"], [retired], ShiftOutcome())
    assert why == ("the first plan after a restart: adopted 2 running instance(s), retired 1 "
                   "the plan lacks")  # fmt: skip
    assert notes == [
        "adopted m|a|gpu2",
        "adopted m|b|gpu0",
        "retired m|tp1-pp1-bf16-kvauto-s8|gpu3",
    ]


def _record(model: str, gear: str, gpus: tuple[str, ...]) -> InstanceRecord:
    at = datetime(2026, 12, 1, tzinfo=UTC)
    return InstanceRecord(1, "m-0", model, gear, gpus, "http://x", "sim", State.ACTIVE, at, at,
                          None, None, None, None, None, None)  # fmt: skip


def test_requests_waiting_are_said_once_when_they_start_and_once_when_they_end() -> None:
    waits = WaitNotice()
    assert waits.queued(["a", "b"], {"a": 2}) == ["controller: requests wait for a"]
    assert waits.queued(["a", "b"], {"a": 3}) == []  # every tick of the cooldown: silent
    assert waits.queued(["a", "b"], {"a": 1, "b": 1}) == ["controller: requests wait for b"]
    assert waits.queued(["b"], {"b": 0}) == ["controller: no request waits for b any more"]
    assert waits.serving(["b"]) == []
    assert waits.serving(["a", "c"]) == [
        "controller: a serves again; the requests that waited go to it"
    ]
    assert waits.queued(["a"], {}) == [] and waits.waiting == set()


# -- end to end: kill -9 right after `flexpipe cluster occupy` --------------------------------

RESTART_SHIFT = """
shift:
  triggers: {window_s: 30, num_samples: 2, cooldown_s: 2, resource_settle_s: 1}
"""


def test_a_gpu_occupied_before_a_kill_9_stays_vacated_after_the_restart(tmp_path: Path) -> None:
    """`flexpipe cluster occupy` then kill -9 of the controller before (or while) it shifts
    off the GPU: the controller `up` starts again reads the occupation back, does not keep
    the instance left there (retired once the plan serves) and logs what it adopted."""
    from test_controller import _is_controller
    from test_controller_scenarios import Up
    from test_launcher import processes_with

    up = Up(tmp_path, RESTART_SHIFT)
    try:
        up.ready()
        single = [i["gpus"][0] for i in up.status()["instances"] if len(i["gpus"]) == 1]
        assert single, up.status()["instances"]
        gpu = single[0]
        (controller,) = [p for p in processes_with(str(tmp_path)) if _is_controller(p)]
        up.client.occupy([gpu], until_s=time.time() + 3600, owner="tenant-c")
        os.kill(controller, signal.SIGKILL)
        n = up.out.wait_for("GPU(s) occupied before the restart, still held: " + gpu, 90)
        up.out.wait_for("instance(s) serving", 90, n)
        status = up.status()
        (held,) = [g for g in status["resources"]["gpus"] if g["id"] == gpu]
        assert held["occupied"]["owner"] == "tenant-c" and held["free_bytes"] == 0
        assert gpu not in up.gpus_in_use()
        first = [e for e in up.entries("plan") if e.trigger == "restart"]
        assert len(first) == 1 and "after a restart: adopted" in first[0].reason, first
    finally:
        up.stop()
