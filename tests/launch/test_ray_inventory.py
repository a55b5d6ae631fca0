"""The Ray inventory's pure core, the Ray watch and the spec's placement, exactly, without
Ray: nodes and their GPUs from hand-built Ray node records laid over the seed's fragmented
cluster file, GPUs held by other Ray work told from our own placement groups, nodes leaving
as `lost` events, and the placement an engine on a worker node needs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from flexpipe.cluster import Cluster, ClusterError, load_cluster, parse_cluster
from flexpipe.cluster.ray_inventory import (
    OTHER_RAY_WORK,
    catalog_type,
    cluster_doc,
    node_name,
    pg_name,
)
from flexpipe.cluster.topology import sub_cluster
from flexpipe.control.core.resources import EventKind
from flexpipe.control.engines.launching import engine_spec, load_models
from flexpipe.control.watch.ray_watch import RayWatch
from flexpipe.hardware import GiB
from flexpipe.launch.ray_launcher import RayLauncher
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import plan
from flexpipe.ray_client import RayNode, RayPlacementGroup

ROOT = Path(__file__).resolve().parents[2]
FRAGMENTED = ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"


def ray_node(
    node_id: str, name: str | None, gpus: int, accel: str = "A100", free: float | None = None
) -> RayNode:
    total = {"CPU": 1.0, "GPU": float(gpus), f"accelerator_type:{accel}": float(gpus)}
    if gpus == 0:
        total = {"CPU": 1.0}
    labels = {"ray.io/node-id": node_id} | ({"flexpipe/node": name} if name else {})
    available = dict(total) | ({"GPU": free} if free is not None else {})
    return RayNode(node_id, True, "127.0.0.1", "vm", labels, total, available)


def three_nodes(node1_free: float = 2.0) -> list[RayNode]:
    return [
        ray_node("aa" * 28, "node0", 1, "L4"),
        ray_node("bb" * 28, "node1", 2, "A100", free=node1_free),
        ray_node("cc" * 28, "node2", 1, "L40S"),
        ray_node("dd" * 28, None, 0),  # a CPU-only node: nothing to plan on
    ]


def pg(name: str, node_ids: list[str], state: str = "CREATED") -> RayPlacementGroup:
    return RayPlacementGroup("01" * 18, name, state, tuple({"GPU": 1.0} for _ in node_ids),
                             tuple(node_ids))  # fmt: skip


def inventory(nodes: list[RayNode], pgs: Sequence[RayPlacementGroup] = ()) -> Cluster:
    return parse_cluster(cluster_doc(nodes, list(pgs), load_cluster(FRAGMENTED)), "ray://t")


def test_three_ray_nodes_over_the_fragmented_file_give_the_files_cluster() -> None:
    got = inventory(three_nodes())
    want = load_cluster(FRAGMENTED)
    assert [n.name for n in got.nodes] == ["node0", "node1", "node2"]
    assert got.gpu_ids == want.gpu_ids == ("gpu0", "gpu1", "gpu2", "gpu3")
    for gpu in want.gpus:
        assert got.gpu(gpu.id) == gpu  # type, index, the tenant's 40 GiB on gpu1
    assert got.link_between("gpu1", "gpu2").name == "nvlink3"
    assert got.network_between("node0", "node1") == want.network_between("node0", "node1")
    assert got.network_between("node1", "node2").name == "eth25"


def test_gpus_held_by_other_ray_work_look_fully_used_from_the_highest_index() -> None:
    got = inventory(three_nodes(node1_free=1.0))
    assert got.gpu("gpu2").owner == OTHER_RAY_WORK
    assert got.gpu("gpu2").free_bytes == 0.0
    assert got.gpu("gpu1").used_bytes == 40 * GiB  # the file's tenant, untouched


def test_our_own_placement_groups_are_not_other_work() -> None:
    node1 = "bb" * 28
    ours = pg(pg_name("default", "llama-7b-1", ["gpu2"]), [node1])
    got = inventory(three_nodes(node1_free=1.0), [ours])
    assert got.gpu("gpu2").owner is None and got.gpu("gpu1").owner != OTHER_RAY_WORK
    # another deployment's placement group is other work; ours on gpu2 pushes it to gpu1
    theirs = pg(pg_name("other", "x-0", ["gpu9"]), [node1])
    got = inventory(three_nodes(node1_free=0.0), [ours, theirs])
    assert got.gpu("gpu1").owner == OTHER_RAY_WORK and got.gpu("gpu2").owner is None
    # a removed placement group holds nothing
    gone = pg(pg_name("default", "llama-7b-1", ["gpu2"]), [node1], state="REMOVED")
    got = inventory(three_nodes(node1_free=1.0), [gone])
    assert got.gpu("gpu2").owner == OTHER_RAY_WORK


def test_without_a_file_nodes_and_gpus_are_named_by_ray() -> None:
    nodes = [ray_node("ab" * 28, None, 2, "A100"), ray_node("cd" * 28, "box", 1, "L40S")]
    got = parse_cluster(cluster_doc(nodes, []), "ray://t")
    assert [n.name for n in got.nodes] == ["box", "ray-abababab"]  # by name: a stable order
    assert got.gpu_ids == ("box/gpu0", "ray-abababab/gpu0", "ray-abababab/gpu1")
    assert [g.type for g in got.gpus] == ["L40S", "A100-80G-SXM", "A100-80G-SXM"]
    assert got.link_between("ray-abababab/gpu0", "ray-abababab/gpu1").name == "cpu"
    assert node_name(nodes[1]) == "box"


def test_a_node_that_left_is_not_in_the_cluster_and_bad_types_say_what_to_do() -> None:
    nodes = three_nodes()
    nodes[2] = RayNode(nodes[2].node_id, False, "", "", nodes[2].labels, nodes[2].total, {})
    assert "gpu3" not in inventory(nodes).gpu_ids
    assert catalog_type("A100-40G") == "A100-40G-SXM" and catalog_type("l40s") == "L40S"
    with pytest.raises(ClusterError, match="flexpipe/gpu-type"):
        catalog_type("T4")
    with pytest.raises(ClusterError, match="no live node"):
        cluster_doc([ray_node("ee" * 28, None, 0)], [])


def test_ray_watch_reports_a_lost_node_at_once_and_other_work_after_two_reads() -> None:
    reads = [inventory(three_nodes())]
    watch = RayWatch(lambda: reads[-1], report=lambda line: None)
    nodes = three_nodes()
    nodes[2] = RayNode(nodes[2].node_id, False, "", "", nodes[2].labels, nodes[2].total, {})
    reads.append(inventory(nodes))
    change = watch.poll(100.0)
    assert change is not None
    assert [(e.gpu, e.kind) for e in change[1]] == [("gpu3", EventKind.LOST)]
    busy = three_nodes(node1_free=1.0)
    busy[2] = nodes[2]
    reads.append(inventory(busy))
    assert watch.poll(101.0) is None  # one read of other work: not yet
    change = watch.poll(102.0)
    assert change is not None
    assert [(e.gpu, e.kind) for e in change[1]] == [("gpu2", EventKind.OCCUPIED)]
    reads.append(inventory(nodes))
    assert watch.poll(103.0) is None  # given back: also after two reads
    assert watch.poll(104.0) is not None


def test_a_spec_carries_its_placement_and_topology_not_a_local_path() -> None:
    cluster = load_cluster(FRAGMENTED)
    demands = load_models(ROOT / "examples" / "models" / "llama-7b.yaml")
    the_plan = plan(cluster, demands, GearLookup([]))
    planned = next(i for i in the_plan.instances if i.gear.tp == 2)
    assert planned.stages == (("gpu2", "gpu1"),)
    spec = engine_spec(planned, cluster, str(FRAGMENTED), demands)
    assert [(p.gpu_id, p.node, p.index, p.type) for p in spec.placement] == [
        ("gpu2", "node1", 1, "A100-80G-SXM"),
        ("gpu1", "node1", 0, "A100-80G-SXM"),
    ]
    assert spec.topology is not None
    topo = parse_cluster(yaml.safe_load(spec.topology), "<spec>")
    assert topo.gpu_ids == ("gpu1", "gpu2")
    assert topo.link_between("gpu1", "gpu2") == cluster.link_between("gpu1", "gpu2")
    assert topo.gpu("gpu1").used_bytes == 40 * GiB
    argv, _env = RayLauncher("127.0.0.1:1").command(spec)
    assert argv[:3] == ["{python}", "-m", "flexpipe.engine.sim"]
    assert argv[argv.index("--port") + 1] == "{port}"
    assert argv[argv.index("--host") + 1] == "{host}"
    assert argv[argv.index("--cluster") + 1] == "{topology}"
    assert argv[argv.index("--gpu-ids") + 1] == "gpu2,gpu1"
    assert str(FRAGMENTED) not in argv


def test_sub_cluster_keeps_only_the_placement() -> None:
    cluster = load_cluster(FRAGMENTED)
    sub = sub_cluster(cluster, ["gpu1", "gpu3"])
    assert [n.name for n in sub.nodes] == ["node1", "node2"]
    assert sub.nodes[0].links == ()  # gpu2 is not in it: no group left
    assert sub.network_between("node1", "node2") == cluster.network_between("node1", "node2")
    with pytest.raises(ClusterError, match="unknown GPU"):
        sub_cluster(cluster, ["gpu9"])
