"""Cluster files: the examples, effective links, every mistake's message, the generator, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.cluster import (
    Cluster,
    ClusterError,
    load_cluster,
    parse_bytes,
    parse_cluster,
    placement_on,
)
from flexpipe.cluster.generate import NODE_KINDS, generate_cluster
from flexpipe.gears.gear import GearError
from flexpipe.hardware import DEFAULT_FAST_LINK_BYTES_PER_S, GB, GiB, link_spec

ROOT = Path(__file__).resolve().parents[2]
FRAGMENTED = ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"
TWO_NODE = ROOT / "examples" / "clusters" / "two-node-8xa100.yaml"

runner = CliRunner()


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def errors_of(path: Path) -> list[str]:
    with pytest.raises(ClusterError) as info:
        load_cluster(path)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


# -- the seed's example ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fragmented() -> Cluster:
    return load_cluster(FRAGMENTED)


def test_fragmented_example_has_the_seed_shape(fragmented: Cluster) -> None:
    assert fragmented.gpu_ids == ("gpu0", "gpu1", "gpu2", "gpu3")
    assert len(fragmented.nodes) == 3
    gpu0, gpu1, gpu2, gpu3 = fragmented.gpus
    assert gpu0.capacity_bytes == 24 * GiB and gpu0.free_bytes == 24 * GiB
    assert gpu1.node == gpu2.node and gpu3.node not in (gpu0.node, gpu1.node)
    assert gpu0.node != gpu1.node
    # GPU1: half of its memory held by another tenant.
    assert gpu1.used_bytes == pytest.approx(gpu1.capacity_bytes / 2)
    assert fragmented.slot("gpu1").free_bytes == pytest.approx(gpu1.capacity_bytes / 2)
    assert fragmented.slot("gpu2").free_bytes == gpu2.capacity_bytes
    assert gpu1.owner


def test_fragmented_example_links(fragmented: Cluster) -> None:
    fast = fragmented.link_between("gpu1", "gpu2")
    assert fast.name == "nvlink3"
    assert fast.bandwidth_bytes_per_s >= DEFAULT_FAST_LINK_BYTES_PER_S
    assert fragmented.link_between("gpu2", "gpu1") == fast
    for other in ("gpu0", "gpu1", "gpu2"):
        slow = fragmented.link_between("gpu3", other)
        assert slow.name == "eth25" and not slow.intra_node
        assert slow.bandwidth_bytes_per_s < fast.bandwidth_bytes_per_s / 50
    assert fragmented.slowest_link(["gpu0", "gpu1", "gpu2"]).name == "eth100"
    assert fragmented.slowest_link(["gpu1", "gpu2", "gpu3"]).name == "eth25"
    assert fragmented.fast_domains() == [("gpu1", "gpu2"), ("gpu0",), ("gpu3",)]
    # With a low enough bar the 100 GbE pair joins; 25 GbE never reaches 10 GB/s.
    assert fragmented.fast_domains(10 * GB) == [("gpu0", "gpu1", "gpu2"), ("gpu3",)]


def test_links_to_self_and_single_gpu_groups_are_errors(fragmented: Cluster) -> None:
    with pytest.raises(ClusterError, match="itself"):
        fragmented.link_between("gpu1", "gpu1")
    with pytest.raises(ClusterError, match="needs two GPUs"):
        fragmented.slowest_link(["gpu1"])
    with pytest.raises(ClusterError, match="unknown GPU 'gpu7'; known: gpu0, gpu1"):
        fragmented.gpu("gpu7")


def test_with_used_makes_a_changed_copy(fragmented: Cluster) -> None:
    left = fragmented.with_used("gpu1", 0)
    assert left.gpu("gpu1").free_bytes == 80 * GiB and left.gpu("gpu1").owner is None
    assert fragmented.gpu("gpu1").free_bytes == 40 * GiB  # the original is unchanged
    assert left != fragmented and left.with_used("gpu1", 40 * GiB, "tenant-b") != left
    assert left.link_between("gpu1", "gpu2") == fragmented.link_between("gpu1", "gpu2")
    assert left.total_free_bytes == fragmented.total_free_bytes + 40 * GiB
    leased = fragmented.with_gpu("gpu0", free_until_s=600.0)
    assert leased.gpu("gpu0").free_until_s == 600.0
    with pytest.raises(ClusterError, match=r"90\.0 GiB used exceeds the A100-80G-SXM's 80\.0"):
        fragmented.with_used("gpu1", 90 * GiB)
    with pytest.raises(ClusterError, match="must be >= 0"):
        fragmented.with_used("gpu1", -1)
    with pytest.raises(ClusterError, match="unknown GPU"):
        fragmented.with_used("gpu9", 0)


def test_placement_on_uses_the_effective_links(fragmented: Cluster) -> None:
    tp2 = placement_on(fragmented, [["gpu1", "gpu2"]], num_layers=32)
    assert tp2.tp == 2 and tp2.pp == 1 and tp2.pp_links == ()
    assert tp2.stages[0].tp_link is not None and tp2.stages[0].tp_link.name == "nvlink3"
    assert [s.free_bytes for s in tp2.gpus] == [40 * GiB, 80 * GiB]
    pp3 = placement_on(fragmented, [["gpu0"], ["gpu1"], ["gpu3"]], 32, layers_per_stage=[8, 16, 8])
    assert [s.num_layers for s in pp3.stages] == [8, 16, 8]
    assert [lk.name for lk in pp3.pp_links] == ["eth100", "eth25"]
    assert all(s.tp_link is None for s in pp3.stages)
    assert placement_on(fragmented, [["gpu0"], ["gpu2"]], 31).stages[0].num_layers == 16
    with pytest.raises(GearError, match="same tensor-parallel size"):
        placement_on(fragmented, [["gpu1", "gpu2"], ["gpu3"]], 32)
    with pytest.raises(GearError, match="used twice"):
        placement_on(fragmented, [["gpu1"], ["gpu1"]], 32)
    with pytest.raises(GearError, match="summing to 32"):
        placement_on(fragmented, [["gpu1"], ["gpu2"]], 32, layers_per_stage=[10, 10])
    with pytest.raises(ClusterError, match="unknown GPU 'gpu8'"):
        placement_on(fragmented, [["gpu8"]], 32)


@pytest.mark.parametrize("path", [FRAGMENTED, TWO_NODE])
def test_examples_round_trip_through_yaml(path: Path) -> None:
    cluster = load_cluster(path)
    again = parse_cluster(yaml.safe_load(cluster.to_yaml()), "again")
    assert again == cluster
    assert again.to_doc() == cluster.to_doc()


# -- links: groups, defaults and measured bandwidth ------------------------------------------


def test_two_node_example_resolves_overlapping_groups() -> None:
    cluster = load_cluster(TWO_NODE)
    assert len(cluster.gpus) == 16 and cluster.gpu("hgx0/gpu7").index == 7
    assert cluster.link_between("hgx0/gpu0", "hgx0/gpu7").name == "nvswitch-a100"
    # NVLink bridge inside a PCIe switch group: the faster one wins.
    assert cluster.link_between("pcie1/gpu0", "pcie1/gpu1").name == "nvlink3"
    assert cluster.link_between("pcie1/gpu0", "pcie1/gpu3").name == "pcie4"
    # Across the two PCIe switches: through the CPU (the default).
    assert cluster.link_between("pcie1/gpu0", "pcie1/gpu4").name == "cpu"
    assert cluster.gpu("pcie1/gpu0").used_bytes == 20 * GiB
    assert cluster.gpu("pcie1/gpu2").free_bytes == 0
    assert cluster.gpu("pcie1/gpu4").free_until_s == 1800
    domains = cluster.fast_domains()
    assert domains[0] == tuple(f"hgx0/gpu{i}" for i in range(8))
    assert domains[1:] == [(f"pcie1/gpu{i}", f"pcie1/gpu{i + 1}") for i in (0, 2, 4, 6)]


def test_measured_bandwidth_overrides_the_catalog() -> None:
    cluster = load_cluster(TWO_NODE)
    measured = cluster.link_between("pcie1/gpu4", "pcie1/gpu5")
    catalog = link_spec("nvlink3")
    assert measured.name == "nvlink3"
    assert measured.bandwidth_bytes_per_s == 210 * GB != catalog.bandwidth_bytes_per_s
    assert measured.latency_s == catalog.latency_s and measured.intra_node
    assert cluster.link_between("pcie1/gpu6", "pcie1/gpu7") == catalog
    # Network: hgx0 on ib400 (50 GB/s), pcie1 on roce200 measured at 19.5: the slower wins.
    net = cluster.link_between("hgx0/gpu0", "pcie1/gpu0")
    assert (net.name, net.bandwidth_bytes_per_s) == ("roce200", 19.5 * GB)
    assert "measured" in net.description


def test_network_defaults_and_node_pair_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        defaults: {intra_node_link: pcie4}
        nodes:
          - name: a
            gpus: [{id: a0, type: L4}, {id: a1, type: L4}]
          - name: b
            network: ib400
            gpus: [{id: b0, type: L4}]
          - name: c
            network: ib400
            gpus: [{id: c0, type: L4}]
        node_links:
          - {nodes: [b, c], link: ib400, measured_gb_per_s: 42}
        """,
    )
    cluster = load_cluster(path)
    assert cluster.name == "c"  # from the file name
    assert cluster.link_between("a0", "a1").name == "pcie4"  # defaults.intra_node_link
    assert cluster.link_between("a0", "b0").name == "eth25"  # a has the default network
    assert cluster.link_between("b0", "c0").bandwidth_bytes_per_s == 42 * GB
    assert cluster.network_between("c", "b").bandwidth_bytes_per_s == 42 * GB
    assert cluster.gpu("a1").index == 1  # index defaults to the position


def test_default_ids_and_link_members_by_index(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        nodes:
          - name: box
            gpus: [{type: A10G}, {type: A10G}, {type: A10G, index: 5}]
            links: [{gpus: [0, 5], link: pcie}]
        """,
    )
    cluster = load_cluster(path)
    assert cluster.gpu_ids == ("box/gpu0", "box/gpu1", "box/gpu5")
    assert cluster.link_between("box/gpu0", "box/gpu5").name == "pcie4"
    assert cluster.link_between("box/gpu0", "box/gpu1").name == "cpu"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40GiB", 40 * GiB),
        ("40 GB", 40e9),
        ("512MiB", 512 * 2**20),
        ("1.5gib", 1.5 * GiB),
        ("1000", 1000.0),
        (2048, 2048.0),
    ],
)
def test_parse_bytes(text: str | int, expected: float) -> None:
    assert parse_bytes(text) == expected


# -- every mistake, with its place -----------------------------------------------------------

GOOD_NODE = "  - {name: n1, gpus: [{id: ok, type: L4}]}\n"

MISTAKES = [
    (
        "nodes:\n  - name: n0\n    gpus: [{id: g0, type: A100-80G-SXM, used_gib: 90}]\n",
        "nodes[0].gpus[0].used_gib: 90.0 GiB used exceeds the A100-80G-SXM's 80.0 GiB (line 3)",
    ),
    (
        "nodes:\n  - gpus:\n      - {id: g0, type: L4, used: 100GB}\n",
        "nodes[0].gpus[0].used: 93.1 GiB used exceeds the L4's 24.0 GiB (line 3)",
    ),
    (
        "nodes:\n  - gpus:\n      - {id: g0, type: A100}\n",
        "nodes[0].gpus[0].type: unknown GPU type 'A100'; known: A100-40G-SXM, A100-80G-PCIe,",
    ),
    ("nodes:\n  - gpus:\n      - {id: g0}\n", "nodes[0].gpus[0].type: missing"),
    (
        "nodes:\n  - gpus:\n      - {id: g0, tpye: L4}\n",
        "nodes[0].gpus[0].tpye: unknown key (did you mean 'type'?); allowed here: id, type,",
    ),
    (
        "nodes:\n  - name: n0\n    netwrok: eth25\n    gpus: [{type: L4}]\n",
        "nodes[0].netwrok: unknown key (did you mean 'network'?)",
    ),
    (
        "nodse: []\n",
        "nodse: unknown key (did you mean 'nodes'?); allowed here: name, description, defaults,",
    ),
    (
        "nodes:\n  - name: n0\n    gpus: [{id: g0, type: L4}]\n"
        "    links: [{gpus: [g0, g9], link: nvlink3}]\n",
        "nodes[0].links[0].gpus[1]: no GPU 'g9' in the cluster (line 4)",
    ),
    (
        "nodes:\n  - name: n0\n    gpus: [{id: g0, type: L4}, {id: g1, type: L4}]\n"
        "    links: [{gpus: [g0, g1, 7], link: pcie4}]\n",
        "nodes[0].links[0].gpus[2]: no GPU with index 7 in node 'n0'",
    ),
    (
        "nodes:\n  - name: n0\n    gpus: [{id: g0, type: L4}]\n"
        "    links: [{gpus: [g0, ok], link: pcie4}]\n" + GOOD_NODE,
        "nodes[0].links[0].gpus[1]: GPU 'ok' is in node 'n1', not 'n0'; links between nodes "
        "go in node_links",
    ),
    (
        "nodes:\n  - name: n0\n    gpus: [{id: g0, type: L4}, {id: g1, type: L4}]\n"
        "    links: [{gpus: [g0, g1], link: warp9}]\n",
        "nodes[0].links[0].link: unknown link 'warp9'; known: ",
    ),
    (
        "nodes:\n  - name: n0\n    gpus: [{id: g0, type: L4}, {id: g1, type: L4}]\n"
        "    links: [{gpus: [g0, g1], link: ib400}]\n",
        "nodes[0].links[0].link: 'ib400' is not an intra-node link",
    ),
    (
        "nodes:\n  - name: n0\n    gpus: [{id: g0, type: L4}]\n"
        "    links: [{gpus: [g0], link: pcie4}]\n",
        "nodes[0].links[0].gpus: a link joins at least two GPUs",
    ),
    (
        "nodes:\n  - name: n0\n    network: nvlink3\n    gpus: [{type: L4}]\n",
        "nodes[0].network: 'nvlink3' is not a network (line 3)",
    ),
    (
        "nodes:\n  - {name: n0, gpus: [{id: ok, type: L4}]}\n" + GOOD_NODE,
        "nodes[1].gpus[0].id: duplicate GPU id 'ok' (also nodes[0].gpus[0]) (line 3)",
    ),
    (
        "nodes:\n  - {name: n1, gpus: [{id: a, type: L4}]}\n" + GOOD_NODE,
        "nodes[1].name: duplicate node name 'n1' (also nodes[0])",
    ),
    (
        "nodes:\n  - name: n0\n"
        "    gpus: [{id: a, type: L4, index: 2}, {id: b, type: L4, index: 2}]\n",
        "nodes[0].gpus[1].index: index 2 is already used by 'a' in node 'n0'",
    ),
    (
        "nodes:\n  - gpus: [{id: g0, type: L4, used_gib: -1}]\n",
        "nodes[0].gpus[0].used_gib: must be >= 0 (got -1)",
    ),
    (
        "nodes:\n  - gpus: [{id: g0, type: L4, free_until_s: -5}]\n",
        "nodes[0].gpus[0].free_until_s: must be >= 0 (got -5)",
    ),
    (
        "nodes:\n  - gpus: [{id: g0, type: L4, index: -1}]\n",
        "nodes[0].gpus[0].index: must be >= 0 (got -1)",
    ),
    (
        "nodes:\n  - network: {link: eth25, measured_gb_per_s: -3}\n    gpus: [{type: L4}]\n",
        "nodes[0].network.measured_gb_per_s: must be >= 0 (got -3)",
    ),
    (
        "nodes:\n  - gpus: [{id: g0, type: L4, used: lots}]\n",
        "nodes[0].gpus[0].used: expected a size like '40GiB'",
    ),
    (
        "nodes:\n  - gpus: [{id: g0, type: L4, used: 1GiB, used_gib: 1}]\n",
        "nodes[0].gpus[0].used_gib: give only one of used, used_gib",
    ),
    (
        "nodes:\n  - gpus: [{id: g0, type: L4, used_gib: half}]\n",
        "nodes[0].gpus[0].used_gib: expected a number, got a string",
    ),
    (
        "nodes:\n  - gpus: {id: g0, type: L4}\n",
        "nodes[0].gpus: expected a list, got a mapping (line 2)",
    ),
    ("name: x\n", "nodes: missing"),
    ("nodes: []\n", "nodes: a cluster needs at least one node"),
    ("- just\n- a list\n", "document: expected a mapping, got a list"),
    (
        GOOD_NODE.join(["nodes:\n", "node_links: [{nodes: [n1, n7], link: eth25}]\n"]),
        "node_links[0].nodes[1]: no node 'n7' in the cluster (line 3)",
    ),
    (
        GOOD_NODE.join(["nodes:\n", "node_links: [{nodes: [n1, n1], link: eth25}]\n"]),
        "node_links[0].nodes: a node link joins two different nodes",
    ),
    (
        GOOD_NODE.join(["nodes:\n", "node_links: [{nodes: [n1], link: eth25}]\n"]),
        "node_links[0].nodes: expected two node names, got 1",
    ),
    ("nodes:\n  - name: a\n    name: b\n", "line 3, column 5: YAML syntax error: duplicate key"),
    ("nodes:\n  - name: n0\n    gpus: [\n", "line 4, column 1: YAML syntax error: "),
    ("nodes: [\n  {name: a\n", "YAML syntax error"),
    ("", "the file is empty"),
]


@pytest.mark.parametrize(("text", "expected"), MISTAKES)
def test_each_mistake_gives_its_place_and_reason(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text, "bad.yaml")
    errors = errors_of(path)
    assert any(line.startswith(f"{path}: ") and expected in line for line in errors), errors


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    assert errors_of(tmp_path / "nope.yaml") == [
        f"{tmp_path / 'nope.yaml'}: cannot read the file: No such file or directory"
    ]


BAD = """\
name: bad
nodes:
  - name: n0
    netwrok: eth25
    gpus:
      - {id: g0, type: A100-80G-SXM, used_gib: 90}
      - {id: g0, type: A100}
      - {id: g2, type: L4, used_gib: -1}
    links:
      - {gpus: [g0, g9], link: nvlink3}
  - name: n1
    network: nvlink3
    gpus:
      - {id: g3, type: L4, used: 40GiB}
node_links:
  - {nodes: [n0, n7], link: eth25}
"""


def test_every_error_is_reported_at_once_in_file_order(tmp_path: Path) -> None:
    path = write(tmp_path, BAD, "bad.yaml")
    errors = errors_of(path)
    expected = [
        "nodes[0].netwrok: unknown key (did you mean 'network'?)",
        "nodes[0].gpus[0].used_gib: 90.0 GiB used exceeds the A100-80G-SXM's 80.0 GiB",
        "nodes[0].gpus[1].type: unknown GPU type 'A100'",
        "nodes[0].gpus[1].id: duplicate GPU id 'g0'",
        "nodes[0].gpus[2].used_gib: must be >= 0",
        "nodes[0].links[0].gpus[1]: no GPU 'g9' in the cluster",
        "nodes[1].network: 'nvlink3' is not a network",
        "nodes[1].gpus[0].used: 40.0 GiB used exceeds the L4's 24.0 GiB",
        "node_links[0].nodes[1]: no node 'n7' in the cluster",
    ]
    assert len(errors) == len(expected), errors
    for line, want in zip(errors, expected, strict=True):
        assert line.startswith(f"{path}: {want}"), (line, want)


def test_parse_cluster_reports_places_without_lines() -> None:
    doc = {"nodes": [{"gpus": [{"id": "g0", "type": "L4", "used_gib": 30}]}]}
    with pytest.raises(ClusterError) as info:
        parse_cluster(doc, "api")
    assert info.value.errors == [
        "api: nodes[0].gpus[0].used_gib: 30.0 GiB used exceeds the L4's 24.0 GiB"
    ]


# -- the generator ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big() -> Cluster:
    return generate_cluster(128, 8, seed=0)


def test_generator_size_and_mix(big: Cluster) -> None:
    assert len(big.nodes) == 128 and len(big.gpus) == 1024
    assert all(len(n.gpus) == 8 for n in big.nodes)
    assert len(set(big.gpu_ids)) == 1024
    kinds = Counter(n.note for n in big.nodes)
    assert len(kinds) >= 6 and set(kinds) <= {k.name for k in NODE_KINDS}
    assert len({g.type for g in big.gpus}) >= 6
    assert len({n.network.link for n in big.nodes}) >= 4
    full = [g for g in big.gpus if g.free_bytes == 0]
    partly = [g for g in big.gpus if 0 < g.used_bytes < g.capacity_bytes]
    free = [g for g in big.gpus if g.used_bytes == 0]
    leased = [g for g in big.gpus if g.free_until_s is not None]
    assert all(len(group) >= 50 for group in (full, partly, free, leased))
    assert any(n.network.measured_gb_per_s is not None for n in big.nodes)
    assert big.node_links
    domains = big.fast_domains()
    assert sorted(g for d in domains for g in d) == sorted(big.gpu_ids)
    assert max(len(d) for d in domains) == 8


def test_generator_is_deterministic_for_a_seed(big: Cluster) -> None:
    again = generate_cluster(128, 8, seed=0)
    assert again == big and again.to_yaml() == big.to_yaml()
    other = generate_cluster(128, 8, seed=1)
    assert other != big


def test_generated_cluster_round_trips_through_yaml(big: Cluster) -> None:
    assert parse_cluster(yaml.safe_load(big.to_yaml())) == big


@pytest.mark.parametrize(("num_nodes", "gpus_per_node"), [(1, 1), (3, 3), (2, 16)])
def test_generator_handles_odd_shapes(num_nodes: int, gpus_per_node: int) -> None:
    cluster = generate_cluster(num_nodes, gpus_per_node, seed=7)
    assert len(cluster.gpus) == num_nodes * gpus_per_node
    with pytest.raises(ClusterError, match="at least one node"):
        generate_cluster(0, 8, seed=0)


# -- the command line ------------------------------------------------------------------------


def test_cli_validate_bad_file_exits_2_with_one_line_per_error(tmp_path: Path) -> None:
    path = write(tmp_path, BAD, "bad.yaml")
    result = runner.invoke(app, ["cluster", "validate", str(path)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 9 and all(
        line.startswith(f"{path}: nodes") or line.startswith(f"{path}: node_links")
        for line in lines
    )
    assert "Traceback" not in result.output


def test_cli_validate_in_a_real_process(tmp_path: Path) -> None:
    path = write(tmp_path, BAD, "bad.yaml")
    command = [sys.executable, "-m", "flexpipe", "cluster", "validate", str(path)]
    bad = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr + bad.stdout
    assert f"{path}: nodes[0].gpus[0].used_gib: 90.0 GiB used exceeds" in bad.stderr
    command[-1] = str(FRAGMENTED)
    good = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert good.returncode == 0, good.stderr
    assert "ok: 3 nodes, 4 GPUs, 192.0 of 232.0 GiB free" in good.stdout


def test_cli_show_tables_and_json() -> None:
    result = runner.invoke(app, ["cluster", "show", str(FRAGMENTED)])
    assert result.exit_code == 0, result.output
    for text in ("gpu1", "nvlink3", "eth25", "40.0", "gpu1+gpu2 | gpu0 | gpu3"):
        assert text in result.output
    result = runner.invoke(app, ["cluster", "show", str(FRAGMENTED), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["fast_domains"] == [["gpu1", "gpu2"], ["gpu0"], ["gpu3"]]
    gpu1 = next(g for g in report["gpus"] if g["id"] == "gpu1")
    assert gpu1["free_bytes"] == 40 * GiB and gpu1["node"] == "node1"
    assert parse_cluster(report["document"]) == load_cluster(FRAGMENTED)


def test_cli_show_missing_file_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["cluster", "show", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "cannot read the file" in result.stderr and "Traceback" not in result.output


def test_cli_generate_writes_a_loadable_deterministic_file(tmp_path: Path) -> None:
    out = tmp_path / "big.yaml"
    args = ["cluster", "generate", "--nodes", "16", "--gpus-per-node", "4", "--seed", "5"]
    result = runner.invoke(app, [*args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: 16 nodes, 64 GPUs" in result.stdout
    assert load_cluster(out) == generate_cluster(16, 4, seed=5)
    stdout = runner.invoke(app, args)
    assert stdout.exit_code == 0 and stdout.stdout == out.read_text()
    validated = runner.invoke(app, ["cluster", "validate", str(out)])
    assert validated.exit_code == 0 and "ok: 16 nodes, 64 GPUs" in validated.stdout
