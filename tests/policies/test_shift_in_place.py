"""How an in-place step re-gears (policies/shift/in_place.py) and what it is priced at
(pricing.py): the seed's TP2 on gpu1+gpu2 getting twice the KV cache once the other tenant
leaves gpu1. Pure, exact values."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from flexpipe.cluster import Cluster, load_cluster, parse_cluster
from flexpipe.perf import Efficiency, PerfModel
from flexpipe.perf.calibration import NO_CALIBRATION
from flexpipe.policies.planner import ModelDemand, PlannedInstance, Slo, plan
from flexpipe.policies.shift import ModelState, PricingParams, ShiftParams, perf_model_of, price
from flexpipe.policies.shift.in_place import (
    COLD,
    SIDE_BY_SIDE,
    WAKE,
    InPlaceChoice,
    choose_in_place,
    gpu_footprint_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_FILE = ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml"
CLUSTER = load_cluster(CLUSTER_FILE)
FREED = CLUSTER.with_used("gpu1", 0.0)  # the other tenant left gpu1
GENERIC = Efficiency(calibration=NO_CALIBRATION)  # the seed's numbers (test_shift_policy.py)
DEMAND = ModelDemand("llama-7b", "llama-2-7b", 8.0, 2048, 256, Slo(2.0, 0.05), ("bf16", "fp8"))


def pair(cluster: Cluster) -> tuple[tuple[PlannedInstance, ...], PlannedInstance]:
    instances = plan(cluster, [DEMAND], now_s=0.0, efficiency=GENERIC).instances
    return instances, next(i for i in instances if set(i.gpu_ids) == {"gpu1", "gpu2"})


RUNNING, OLD = pair(CLUSTER)  # TP2, 131 680 tokens of KV (40 GiB of gpu1 were taken)
TARGET, NEW = pair(FREED)  # TP2, 262 752 tokens


def pm(p: PlannedInstance) -> PerfModel:
    return perf_model_of(FREED, p, GENERIC)


def test_the_seed_pair_does_not_fit_beside_its_successor_so_it_wakes_from_host_ram() -> None:
    assert (OLD.kv_capacity_tokens, NEW.kv_capacity_tokens) == (131680, 262752)
    # what each engine holds per GPU: the old one about its 40 GiB budget, the new one 72
    assert gpu_footprint_bytes(pm(OLD), OLD.kv_capacity_tokens)["gpu1"] == 42917355520.0
    assert gpu_footprint_bytes(pm(NEW), NEW.kv_capacity_tokens)["gpu1"] == 77278117888.0
    asleep = gpu_footprint_bytes(pm(NEW), NEW.kv_capacity_tokens, asleep=True)
    assert asleep == {"gpu1": 1660846080.0, "gpu2": 1660846080.0}  # its reserve only
    choice = choose_in_place(FREED, [OLD], [NEW], pm, (1, 2))
    assert choice == InPlaceChoice(
        WAKE,
        1,
        "host_ram",
        "not side by side (gpu1 would need 111.9 GiB of 80.0 GiB free): pre-started asleep "
        "at level 1, weights in host RAM",
    )


def test_without_host_ram_it_sleeps_at_level_2_and_without_sleep_mode_it_rolls() -> None:
    short_ram = {"node1": 1e9}  # level-1 sleepers hold the rest of node1's RAM
    c = choose_in_place(FREED, [OLD], [NEW], pm, (1, 2), short_ram)
    assert (c.how, c.level, c.source) == (WAKE, 2, "storage")
    assert choose_in_place(FREED, [OLD], [NEW], pm, (1,), short_ram).how == COLD
    assert choose_in_place(FREED, [OLD], [NEW], pm, ()).how == COLD


def test_a_successor_that_fits_beside_starts_beside() -> None:
    small = replace(NEW, kv_capacity_tokens=1000)
    assert choose_in_place(FREED, [OLD], [small], pm, (1, 2)).how == SIDE_BY_SIDE
    # with the tenant still on gpu1, not even a sleeping successor fits beside the old one
    full = CLUSTER.with_used("gpu1", 40 * 2**30 + 1)
    assert choose_in_place(full, [OLD], [NEW], pm, (1, 2)).how == COLD


def seed_price(cluster: Cluster, in_place: str) -> tuple[float, float, list[str]]:
    """(gap cost, score, the in-place notes) of the seed's shift at 8 req/s."""
    models = [ModelState(DEMAND, ())]
    params = PricingParams(in_place=in_place)
    p = price(cluster, RUNNING, TARGET, models, {"llama-7b": (8.0, 8.0)}, 0.0, params,
              efficiency=GENERIC)  # fmt: skip
    notes = [n for n in p.notes if "in place" in n or "ready after" in n]
    return round(p.gap_cost, 1), round(p.score, 1), notes


def test_pricing_uses_the_wake_of_the_source_chosen() -> None:
    """Rolling: drain 9.8 s + cold start 26.7 s. Make-before-break: the 2 s in-place drain
    plus a wake from host RAM (0.26 s), or from storage (6.74 s) where the RAM is short."""
    assert seed_price(FREED, "rolling") == (
        153.4,
        107.1,
        [
            "in place: llama-7b|tp2-pp1-bf16-kvauto-s48|gpu2,gpu1 drains 9.8 s, then "
            "llama-7b|tp2-pp1-bf16-kvauto-s64|gpu1,gpu2 cold-starts 26.7 s",
            "gain accrues for 1763 s: the target is ready after 36.6 s",
        ],
    )
    assert seed_price(FREED, "make_before_break") == (
        9.5,
        251.7,
        [
            "in place: llama-7b|tp2-pp1-bf16-kvauto-s64|gpu1,gpu2 pre-started asleep at level "
            "1; the old drain 2.0 s, then it wakes from host_ram in 0.26 s",
            "gain accrues for 1771 s: the target is ready after 29.3 s",
        ],
    )
    doc = yaml.safe_load(CLUSTER_FILE.read_text())
    next(n for n in doc["nodes"] if n["name"] == "node1")["host_ram_gib"] = 1
    no_ram = parse_cluster(doc).with_used("gpu1", 0.0)
    assert seed_price(no_ram, "make_before_break") == (
        36.6,
        223.6,
        [
            "in place: llama-7b|tp2-pp1-bf16-kvauto-s64|gpu1,gpu2 pre-started asleep at level "
            "2; the old drain 2.0 s, then it wakes from storage in 6.74 s",
            "gain accrues for 1765 s: the target is ready after 35.5 s",
        ],
    )


def test_the_switch_reads_from_yaml_and_refuses_what_it_does_not_know() -> None:
    doc = {"pricing": {"in_place": "make_before_break", "in_place_drain_s": 1}}
    assert ShiftParams.from_mapping(doc).pricing.in_place == "make_before_break"
    with pytest.raises(ValueError, match="in_place must be one of rolling, make_before_break"):
        ShiftParams.from_mapping({"pricing": {"in_place": "fast"}})
    with pytest.raises(ValueError, match="expected one of rolling, make_before_break"):
        ShiftParams.from_mapping({"pricing": {"in_place": 1}})
