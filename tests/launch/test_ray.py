"""flexpipe on a real Ray cluster (tests/raycluster.py: a head and two workers on 127.0.0.1,
each its own `ray start`, its own logical GPUs and accelerator type), with sim engines.

The seed's fragmented cluster is spread over three Ray nodes as in the seed: node0 (an L4),
node1 (two A100s, NVLink from the cluster file), node2 (an L40S). One cluster for the module
(Ray's start-up is the cost); the test that stops a node runs last.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from raycluster import DRIVER_ENV, ROOT, LocalRayCluster
from typer.testing import CliRunner

from flexpipe import ray_client
from flexpipe.cli import app
from flexpipe.cluster import load_cluster, parse_cluster_yaml
from flexpipe.cluster.ray_inventory import OTHER_RAY_WORK, read_ray_cluster
from flexpipe.control.engines.launching import engine_spec, load_models
from flexpipe.launch import free_port
from flexpipe.launch.ray_launcher import RayEngine, RayLauncher, actor_name
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import plan
from flexpipe.store import Store
from flexpipe.store.instance_registry import InstanceRegistry

FRAGMENTED = ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"
MODELS = ROOT / "examples" / "models" / "llama-7b.yaml"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRayCluster]:
    os.environ.update(DRIVER_ENV)  # read by Ray when it is first imported (below)
    started = time.monotonic()
    cluster = LocalRayCluster()
    try:
        cluster.start_node("node0", 1, "L4", num_cpus=2)
        cluster.start_node("node1", 2, "A100")
        cluster.start_node("node2", 1, "L40S")
        ray_client.connect(cluster.address)
        _until(lambda: len([n for n in ray_client.nodes() if n.alive]) == 3, 60, "3 nodes")
        print(f"\nray: 3 nodes up in {time.monotonic() - started:.1f} s", flush=True)
        yield cluster
    finally:
        ray_client.disconnect()
        cluster.stop()


def _until(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _node_id(name: str) -> str:
    return next(n.node_id for n in ray_client.nodes() if n.labels.get("flexpipe/node") == name)


def _live_pgs(prefix: str) -> list[ray_client.RayPlacementGroup]:
    return [p for p in ray_client.placement_groups() if p.name.startswith(prefix)
            and p.state != "REMOVED"]  # fmt: skip


def _health(endpoint: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{endpoint}/health", timeout=2) as resp:
            return int(resp.status)
    except (urllib.error.URLError, OSError):
        return None


def test_discover_reads_nodes_gpus_and_other_ray_work(ray_cluster: LocalRayCluster) -> None:
    node1 = _node_id("node1")
    other = ray_client.create_placement_group([{"GPU": 1.0}], "STRICT_PACK", "someone-else",
                                              [node1], detached=False)  # fmt: skip
    try:
        assert other.ready(60)
        _until(lambda: _node("node1").available.get("GPU") == 1.0, 30, "Ray to see it")
        res = CliRunner().invoke(
            app, ["discover", "--ray", ray_cluster.address, "--cluster", str(FRAGMENTED)]
        )
        assert res.exit_code == 0, res.output
        got = parse_cluster_yaml(res.stdout, "<discovered>")
    finally:
        other.remove()
        _until(lambda: _node("node1").available.get("GPU") == 2.0, 30, "Ray to free it")
    want = load_cluster(FRAGMENTED)
    assert [n.name for n in got.nodes] == ["node0", "node1", "node2"]
    assert got.gpu_ids == want.gpu_ids
    assert [g.type for g in got.gpus] == [g.type for g in want.gpus]
    assert got.link_between("gpu1", "gpu2").name == "nvlink3"
    assert got.gpu("gpu2").owner == OTHER_RAY_WORK and got.gpu("gpu2").free_bytes == 0
    assert got.gpu("gpu1").used_bytes == want.gpu("gpu1").used_bytes  # the file's tenant


def _node(name: str) -> ray_client.RayNode:
    return next(n for n in ray_client.nodes() if n.labels.get("flexpipe/node") == name)


def test_an_instance_is_a_placement_group_on_its_planned_gpus(
    ray_cluster: LocalRayCluster,
) -> None:
    cluster = read_ray_cluster(ray_cluster.address, load_cluster(FRAGMENTED), nvml=False)
    demands = load_models(MODELS)
    planned = next(i for i in plan(cluster, demands, GearLookup([])).instances if i.gear.tp == 2)
    spec = engine_spec(planned, cluster, "", demands)  # no cluster file: the spec carries it
    launcher = RayLauncher(ray_cluster.address, deployment="t-place", sim_load_time_s=0.2,
                           ready_timeout_s=120, stop_grace_s=5)  # fmt: skip
    node1 = _node_id("node1")

    async def run() -> None:
        handle = await launcher.start(spec)
        try:
            [pg] = _live_pgs("flexpipe:t-place:")
            assert pg.name == "flexpipe:t-place:llama-7b-0:gpu2+gpu1"
            assert pg.bundles == ({"GPU": 1.0}, {"GPU": 1.0})
            assert pg.bundle_nodes == (node1, node1)
            assert _health(handle.endpoint) == 200
            mine = read_ray_cluster(ray_cluster.address, load_cluster(FRAGMENTED),
                                    deployment="t-place", nvml=False)  # fmt: skip
            assert mine.gpu("gpu2").owner is None  # ours, not other work
            seen = time.monotonic()
            _until(lambda: _node("node1").available["GPU"] == 0.0, 60, "Ray to count it")
            print(f"ray: available GPUs caught up {time.monotonic() - seen:.1f} s later")
            theirs = read_ray_cluster(ray_cluster.address, load_cluster(FRAGMENTED),
                                      deployment="another", nvml=False)  # fmt: skip
            assert theirs.gpu("gpu1").owner == theirs.gpu("gpu2").owner == OTHER_RAY_WORK
        finally:
            await handle.stop()
        assert handle.returncode == 0 or handle.returncode is not None
        assert _live_pgs("flexpipe:t-place:") == []
        _until(lambda: _health(handle.endpoint) is None, 20, "the engine to stop")

    asyncio.run(run())


_CRASHING_CONTROLLER = """
import asyncio, json, os, sys
from flexpipe.launch import EngineSpec, GpuPlace
from flexpipe.launch.ray_launcher import RayLauncher

async def main():
    launcher = RayLauncher(sys.argv[1], deployment="t-crash", sim_load_time_s=0.2,
                           ready_timeout_s=120)
    specs = [EngineSpec(model="llama-2-7b", name="kept", gpu_type="L40S", gpu_ids=("gpu3",),
                        placement=(GpuPlace("gpu3", "node2", 0, "L40S"),)),
             EngineSpec(model="llama-2-7b", name="stray", gpu_type="L4", gpu_ids=("gpu0",),
                        placement=(GpuPlace("gpu0", "node0", 0, "L4"),))]
    handles = await asyncio.gather(*(launcher.start(s) for s in specs))
    print(json.dumps({h.name: [h.endpoint, h.pg_id] for h in handles}), flush=True)
    os._exit(9)  # a crash: nothing is stopped

asyncio.run(main())
"""


def test_a_restarted_controller_adopts_what_the_store_knows_and_removes_the_rest(
    ray_cluster: LocalRayCluster, tmp_path: Path
) -> None:
    """A crashed controller left two engines serving in Ray; the store knows one of them
    (`kept`; the other, `stray`, was mid cold start) and one whose engine is gone (`ghost`).
    The restarted launcher adopts `kept` as it runs, removes `stray`, and the adopted handle
    reports its engine's death as a launched one does."""
    env = {**os.environ, **DRIVER_ENV, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _CRASHING_CONTROLLER, ray_cluster.address],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert out.returncode == 9, out.stderr[-2000:]
    left = json.loads(out.stdout.strip().splitlines()[-1])
    (kept_url, kept_pg), (stray_url, stray_pg) = left["kept"], left["stray"]
    assert {p.pg_id for p in _live_pgs("flexpipe:t-crash:")} == {kept_pg, stray_pg}
    assert _health(kept_url) == _health(stray_url) == 200  # detached: they serve on
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    registry = InstanceRegistry(store)
    kept = registry.register("kept", "llama-2-7b", "tp1", ["gpu3"], kept_url, "sim")
    registry.register("ghost", "llama-2-7b", "tp1", ["gpu1"], "http://127.0.0.1:9", "sim")
    restarted = RayLauncher(ray_cluster.address, deployment="t-crash", stop_grace_s=5)

    async def run() -> None:
        handles = await restarted.adopt(registry.live_instances())
        assert list(handles) == [kept.id]
        handle = handles[kept.id]
        assert isinstance(handle, RayEngine)
        assert (handle.endpoint, handle.pg_id, handle.returncode) == (kept_url, kept_pg, None)
        assert restarted.num_leftovers_removed == 1
        assert [p.pg_id for p in _live_pgs("flexpipe:t-crash:")] == [kept_pg]
        assert _health(kept_url) == 200
        await restarted.connect()  # what start() calls first: the adopted group stays
        assert [p.pg_id for p in _live_pgs("flexpipe:t-crash:")] == [kept_pg]
        actor = ray_client.get_actor(actor_name(kept_pg))
        assert actor is not None
        actor.kill()  # as when its node is lost
        for _ in range(300):
            if handle.returncode is not None and not _live_pgs("flexpipe:t-crash:"):
                break
            await asyncio.sleep(0.1)
        assert handle.returncode == -1
        assert _live_pgs("flexpipe:t-crash:") == []

    try:
        asyncio.run(run())
    finally:
        store.close()
    _until(lambda: _health(kept_url) is None and _health(stray_url) is None, 30,
           "the engines to stop")  # fmt: skip


def _child(parent_pid: int, word: str) -> int:
    """The pid of `parent_pid`'s child whose command line has `word` (`flexpipe controller`)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent_pid and word.encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no child {word!r} of {parent_pid}")


def test_up_on_three_ray_nodes_serves_loses_no_request_to_a_lost_node_and_cleans_up(
    ray_cluster: LocalRayCluster, tmp_path: Path
) -> None:
    port = free_port()
    env = {**os.environ, **DRIVER_ENV, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ray_cluster.address}
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    argv = [sys.executable, "-m", "flexpipe", "up", "--ray", "auto", "--cluster", str(FRAGMENTED),
            "--port", str(port), "--controller-port", str(free_port()),
            "--sim-load-time-s", "0.2", "--tick-s", "2",
            "--store", store.url]  # fmt: skip
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                          text=True, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:
        _until(lambda: any("3 instance(s) serving" in ln for ln in lines) or up.poll() is not None,
               240, "three instances")  # fmt: skip
        assert up.poll() is None, "".join(lines)
        pgs = _live_pgs("flexpipe:default:")
        assert sorted(p.name.rsplit(":", 1)[1] for p in pgs) == ["gpu0", "gpu2+gpu1", "gpu3"]
        nodes = {p.name.rsplit(":", 1)[1]: set(p.bundle_nodes) for p in pgs}
        assert nodes == {"gpu0": {_node_id("node0")}, "gpu2+gpu1": {_node_id("node1")},
                         "gpu3": {_node_id("node2")}}  # fmt: skip

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        results: list[tuple[str, str | None]] = []
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                text, finish = "", None
                stream = client.chat.completions.create(
                    model="llama-7b", stream=True, max_tokens=48,
                    messages=[{"role": "user", "content": f"request {i}: " + "word " * 300}],
                )  # fmt: skip
                for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                        finish = chunk.choices[0].finish_reason or finish
                results.append((text, finish))
            except BaseException as exc:  # collected: the assertion below shows it
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # streams in flight on every instance
        ray_cluster.stop_node("node2")  # the L40S node and its instance go away
        for t in threads:
            t.join(120)
        assert errors == [] and len(results) == 12
        assert all(finish == "length" and text for text, finish in results)
        _until(lambda: any(re.search(r"llama-7b-\d exited", ln) for ln in lines), 60,
               "the controller to notice the lost instance")  # fmt: skip

        # the controller crashes (kill -9); the engines serve on; `up` restarts it, and it
        # adopts what the store says its predecessor left serving in Ray: the same engines
        # in the same placement groups, nothing launched
        registry = InstanceRegistry(store)
        _until(lambda: len(registry.live_instances()) == 2, 30, "the lost one gone in the store")
        live = {r.id: r.endpoint for r in registry.live_instances()}
        num_records = len(registry.instances())
        before = {p.pg_id for p in _live_pgs("flexpipe:default:")}
        assert len(before) == 2
        num_lines = len(lines)
        os.kill(_child(up.pid, "controller"), signal.SIGKILL)
        killed = time.monotonic()
        answer = client.completions.create(model="llama-7b", prompt="anyone?", max_tokens=8)
        assert answer.choices[0].finish_reason == "length"  # served with no controller
        _until(lambda: any("instance(s) serving" in ln for ln in lines[num_lines:]), 180,
               "the restarted controller to serve")  # fmt: skip
        print(f"ray: restarted controller serving {time.monotonic() - killed:.1f} s after kill -9")
        since = "".join(lines[num_lines:])
        assert "adopted 2 running instance(s)" in since, since
        assert " ready at " not in since  # nothing launched
        assert {p.pg_id for p in _live_pgs("flexpipe:default:")} == before
        assert {r.id: r.endpoint for r in registry.live_instances()} == live
        assert len(registry.instances()) == num_records
        answer = client.completions.create(model="llama-7b", prompt="again", max_tokens=8)
        assert answer.choices[0].finish_reason == "length"
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(120)
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait(10)
            reader.join(10)
            store.close()
    assert up.returncode == 0, "".join(lines[-40:])
    assert _live_pgs("flexpipe:default:") == []
    ports = [url.rsplit(":", 1)[1] for url in live.values()]
    _until(lambda: not _engines_on(ports), 30, "the adopted engines to stop")


def _engines_on(ports: list[str]) -> list[int]:
    """The pids of sim engines listening on one of `ports` (by their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "flexpipe.engine.sim" in argv and any(
            a == "--port" and b in ports for a, b in itertools.pairwise(argv)
        ):
            found.append(int(entry.name))
    return found
