"""A measured link latency in a cluster file, next to the measured bandwidth, and the
performance model using it."""

from __future__ import annotations

import pytest
import yaml

from flexpipe.cluster import ClusterError, parse_cluster, placement_on
from flexpipe.gears.gear import parse_gear
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import PerfModel


def _cluster(link_extra: str, network_extra: str = "") -> dict[str, object]:
    doc = yaml.safe_load(
        f"""
name: t
nodes:
  - name: n0
    network: {{link: eth25{network_extra}}}
    gpus:
      - {{id: g0, type: A100-80G-SXM}}
      - {{id: g1, type: A100-80G-SXM}}
    links:
      - {{gpus: [g0, g1], link: pcie4{link_extra}}}
  - name: n1
    gpus:
      - {{id: g2, type: A100-80G-SXM}}
"""
    )
    assert isinstance(doc, dict)
    return doc


def test_measured_latency_replaces_the_catalog_latency_and_round_trips() -> None:
    cluster = parse_cluster(
        _cluster(", measured_gb_per_s: 20, measured_latency_us: 12.5", ", measured_latency_us: 80")
    )
    link = cluster.link_between("g0", "g1")
    assert link.latency_s == pytest.approx(12.5e-6) and link.latency_measured
    assert link.bandwidth_bytes_per_s == 20e9 and link.bandwidth_measured
    network = cluster.link_between("g0", "g2")
    assert network.latency_s == pytest.approx(80e-6) and not network.bandwidth_measured
    assert parse_cluster(yaml.safe_load(cluster.to_yaml())) == cluster


def test_the_model_pays_the_measured_latency_on_every_all_reduce_step() -> None:
    spec = load_model_spec("llama-2-7b")
    gear = parse_gear("tp=2")
    steps = []
    for latency_us in (5, 25):
        cluster = parse_cluster(_cluster(f", measured_latency_us: {latency_us}"))
        placement = placement_on(cluster, [["g0", "g1"]], spec.num_layers)
        steps.append(PerfModel(spec, gear, placement).decode_step_s(1, 512))
    # 2 all-reduces per layer, each a ring of 2(t-1) = 2 steps over tp=2: 4 latencies a layer.
    assert steps[1] - steps[0] == pytest.approx(spec.num_layers * 4 * 20e-6, rel=1e-6)


def test_a_bad_latency_is_a_clear_error() -> None:
    with pytest.raises(ClusterError, match="measured_latency_us"):
        parse_cluster(_cluster(", measured_latency_us: 0"))
    with pytest.raises(ClusterError, match="measured_latency_us"):
        parse_cluster(_cluster(", measured_latency_us: fast"))
