"""What a restarted controller keeps of the one before it (kill -9; `flexpipe up` starts it
again): the admin's GPU occupations (control/occupation_memory.py), read back from a real
SQLite store before the first plan, those that ran out while it was stopped dropped; and its
first log entry says what it adopted."""

from __future__ import annotations

from pathlib import Path

from flexpipe.cluster import Cluster
from flexpipe.control.controller import Controller, ControllerConfig
from flexpipe.control.gateway_client import GatewayClient
from flexpipe.control.occupation_memory import persisted, restored
from flexpipe.control.resources import Occupation, Overrides
from flexpipe.launch import LocalLauncher
from flexpipe.policies.planner import ModelDemand, Slo, plan
from flexpipe.store import Store
from flexpipe.store.gpu_occupations import GpuOccupations

ROOT = Path(__file__).resolve().parent.parent
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
        fresh = again._planner(again.cluster, (DEMAND,), T0_S + 100)
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
