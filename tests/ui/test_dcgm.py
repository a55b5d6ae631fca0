"""GPU metrics from real GPUs: a recorded DCGM exposition parsed and joined to the instances
on its GPUs by (hostname, device index); the board's DCGM queries use the exporter's names
and labels; the controller's join series carries DCGM's label names."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_see_it import BOARD, SCRAPE, board_expressions, metric_names

from flexpipe.cluster import load_cluster
from flexpipe.control.api.controller_metrics import ControllerMetrics
from flexpipe.control.api.ui_api import UiInstance, topology_doc
from flexpipe.control.engines.launching import gpu_places
from flexpipe.examples import DEFAULT_CLUSTER
from flexpipe.launch import GpuPlace
from flexpipe.observe.dcgm import (
    GpuReading,
    gpu_busy_by_instance,
    gpu_instance_labels,
    instance_busy,
    join_instances,
    parse_dcgm,
    topology_places,
)

EXPOSITION = (Path(__file__).parents[1] / "data" / "dcgm_exposition.txt").read_text()
MiB = 1024 * 1024

PLACEMENTS = {
    "llama-7b-0": (
        GpuPlace("gpu1", "node1", 0, "A100-80G-SXM"),
        GpuPlace("gpu2", "node1", 1, "A100-80G-SXM"),
    ),
    "llama-7b-1": (GpuPlace("gpu3", "node2", 0, "L40S"),),
    "qwen-0": (GpuPlace("gpu9", "node3", 0, "H100-80G-SXM"),),  # no exporter there
}


def test_parse_reads_each_gpu_with_the_best_busy_metric_it_has() -> None:
    readings = parse_dcgm(EXPOSITION)
    assert sorted(readings) == [("node1", 0), ("node1", 1), ("node2", 0)]
    assert readings["node1", 0] == GpuReading(
        hostname="node1",
        index=0,
        uuid="GPU-3c4f3f2b-7e0a-4f4e-9b61-2b8f1c6d9a01",
        model_name="NVIDIA A100-SXM4-80GB",
        busy=0.912345,
        busy_metric="DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        memory_used_bytes=78106 * MiB,
        memory_free_bytes=2811 * MiB,
        power_w=312.518,
    )
    # the L40S's exporter has no profiling metrics: GPU_UTIL (percent) stands in
    l40s = readings["node2", 0]
    assert (l40s.busy, l40s.busy_metric) == (0.35, "DCGM_FI_DEV_GPU_UTIL")


def test_join_puts_each_reading_on_the_instance_whose_gpu_it_is() -> None:
    rows = join_instances(parse_dcgm(EXPOSITION), PLACEMENTS)
    assert [
        (r.instance, r.gpu_id, r.hostname, r.index, r.reading and r.reading.busy) for r in rows
    ] == [
        ("llama-7b-0", "gpu1", "node1", 0, 0.912345),
        ("llama-7b-0", "gpu2", "node1", 1, 0.604118),
        ("llama-7b-1", "gpu3", "node2", 0, 0.35),
        ("qwen-0", "gpu9", "node3", 0, None),
    ]
    assert instance_busy(rows) == {"llama-7b-0": (0.912345 + 0.604118) / 2, "llama-7b-1": 0.35}


def test_node_names_map_to_the_hostnames_dcgm_reports() -> None:
    fqdn = EXPOSITION.replace('Hostname="node1"', 'Hostname="GPU-A.example.com"')
    rows = join_instances(parse_dcgm(fqdn), PLACEMENTS, {"node1": "gpu-a"})
    assert [r.reading is not None for r in rows] == [True, True, True, False]
    assert join_instances(parse_dcgm(fqdn), PLACEMENTS)[0].reading is None  # unmapped


def test_the_example_clusters_instances_are_placed_by_node_and_index() -> None:
    cluster = load_cluster(DEFAULT_CLUSTER)
    places = gpu_places(cluster, ["gpu1", "gpu2", "gpu3"])
    assert [(p.node, p.index) for p in places] == [("node1", 0), ("node1", 1), ("node2", 0)]
    rows = join_instances(parse_dcgm(EXPOSITION), {"llama-7b-0": places})
    assert [r.reading.model_name if r.reading else None for r in rows] == [
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA L40S",
    ]


def test_the_gateway_finds_each_instances_gpus_on_the_controllers_map() -> None:
    """The gateway knows instances by URL and their GPUs from the controller's GPU map
    (`GET /admin/topology`): node and device index, what DCGM's readings are joined on."""
    tp2 = UiInstance(
        "k1", "llama-7b-0", "llama-7b", "tp2", (("gpu1", "gpu2"),), "http://u1", "active"
    )
    l40s = UiInstance("k2", "llama-7b-1", "llama-7b", "tp1", (("gpu3",),), "http://u2", "active")
    places = topology_places(topology_doc(load_cluster(DEFAULT_CLUSTER), [tp2, l40s], []))
    assert places == {
        "http://u1": (
            GpuPlace("gpu1", "node1", 0, "A100-80G-SXM"),
            GpuPlace("gpu2", "node1", 1, "A100-80G-SXM"),
        ),
        "http://u2": (GpuPlace("gpu3", "node2", 0, "L40S"),),
    }
    rows = join_instances(parse_dcgm(EXPOSITION), places)
    assert gpu_busy_by_instance(rows) == {"http://u1": (0.912345, 0.604118), "http://u2": (0.35,)}
    assert topology_places(None) == {} and topology_places({"instances": [{"url": "x"}]}) == {
        "x": ()
    }


def test_the_controllers_join_series_uses_dcgms_label_names() -> None:
    labels = gpu_instance_labels(PLACEMENTS, {"llama-7b-0": "llama-7b", "llama-7b-1": "llama-7b"})
    assert labels[0] == {
        "Hostname": "node1",
        "gpu": "0",
        "flexpipe_instance": "llama-7b-0",
        "model": "llama-7b",
    }
    metrics = ControllerMetrics()
    metrics.set_gpu_instances(labels)
    (family,) = [
        f
        for f in text_string_to_metric_families(metrics.render().decode())
        if f.name == "flexpipe_gpu_instance"
    ]
    assert sorted((s.labels["Hostname"], s.labels["gpu"], s.value) for s in family.samples) == [
        ("node1", "0", 1.0),
        ("node1", "1", 1.0),
        ("node2", "0", 1.0),
        ("node3", "0", 1.0),
    ]


def test_the_boards_dcgm_queries_read_what_the_exporter_exposes() -> None:
    board = json.loads(BOARD.read_text())
    wanted = set().union(*(metric_names(e) for e in board_expressions(board)))
    dcgm = {n for n in wanted if n.startswith("DCGM_")}
    assert dcgm == {"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"}
    exposed = {f.name for f in text_string_to_metric_families(EXPOSITION)}
    assert dcgm <= exposed
    joins = [e for e in board_expressions(board) if "DCGM_" in e]
    assert all("on (Hostname, gpu) group_left" in e and "flexpipe_gpu_instance" in e for e in joins)
    jobs = {j["job_name"]: j for j in yaml.safe_load(SCRAPE.read_text())["scrape_configs"]}
    assert jobs["dcgm"]["static_configs"][0]["targets"] == ["127.0.0.1:9400"]
