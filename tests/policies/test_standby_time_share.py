"""Time-sharing a GPU between models (policies/shift/standby_sleepers.py, pure): a standby
placed beside another model's awake engine where its asleep footprint fits, and the swap
that wakes it (the holder put to sleep first) unless the holder is busier or of higher
priority. Exact, on the seed's 4-GPU cluster with gpu1 freed (24, 80, 80, 48 GiB), the
fake planner of test_standby_sleepers.py, an engine awake taking 0.9 of its GPU and one
asleep 6 GiB."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[0]))
from test_shift_policy import FREED, demand
from test_standby_sleepers import GIB, ON, fake_planner, inst, where

from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_sleepers import (
    StandbyParams,
)
from flexpipe.policies.shift.time_share import (
    Swap,
    standby_time_shared,
    swaps_aside,
    time_share_view,
    yields_to,
)

SHARE = replace(ON, time_share=True)


def footprint(i: PlannedInstance, awake: bool) -> float:
    if awake:
        return sum(0.9 * FREED.gpu(g).capacity_bytes for g in i.gpu_ids)
    return 6.0 * GIB * len(i.gpu_ids)


def shared(
    rate_per_s: float,
    awake: tuple[PlannedInstance, ...],
    asleep: tuple[PlannedInstance, ...] = (),
    params: StandbyParams = SHARE,
) -> list[tuple[str, str]]:
    got = standby_time_shared(
        FREED,
        (demand(rate_per_s, "a"),),
        awake,
        asleep,
        {},
        {},
        fake_planner,
        0.0,
        params,
        footprint,
    )
    return where(got)


# a runs on gpu0 (5 req/s); x, x, y run on gpu1, gpu2, gpu3
AWAKE = (inst("a", "gpu0"), inst("x", "gpu1"), inst("x", "gpu2"), inst("y", "gpu3"))


def test_the_view_is_the_gpus_once_the_other_models_sleep() -> None:
    view = time_share_view(FREED, "a", AWAKE, (inst("b", "gpu1"),), footprint)
    assert view.gpu("gpu0").free_bytes == 0  # a's own: held whole
    assert view.gpu("gpu1").used_bytes == 12 * GIB  # x asleep and b asleep
    assert view.gpu("gpu2").used_bytes == 6 * GIB
    assert view.gpu("gpu1").owner == "flexpipe-asleep"


def test_a_standby_sleeps_beside_another_models_awake_engine_where_it_fits() -> None:
    # 8 req/s: one more engine of 5, beside x on gpu1 (72 + 6 <= 80 GiB)
    assert shared(8.0, AWAKE) == [("a", "gpu1")]
    # 12 req/s: two more, gpu1 and gpu2 (no two of a on one GPU)
    assert shared(12.0, AWAKE) == [("a", "gpu1"), ("a", "gpu2")]
    # 20 req/s wants a third: beside y on gpu3 it does not fit (43.2 + 6 > 48 GiB)
    assert shared(20.0, AWAKE) == [("a", "gpu1"), ("a", "gpu2")]
    # b already sleeps beside x on gpu1: 72 + 6 + 6 > 80, and a model tries once a round
    assert shared(8.0, AWAKE, (inst("b", "gpu1"),)) == []


def test_time_sharing_is_off_unless_asked() -> None:
    assert shared(8.0, AWAKE, params=ON) == []
    assert shared(8.0, AWAKE, params=replace(SHARE, enabled=False)) == []


def test_yields_to_by_priority_and_pressure() -> None:
    x = inst("x", "gpu1")
    assert yields_to(x, "a", {}, (), 0.0)  # same priority, idle
    assert not yields_to(x, "a", {}, (), 1.0)  # same priority, serving
    assert yields_to(x, "a", {"a": 2.0}, (), 3.0)  # lower priority: even while serving
    assert not yields_to(x, "a", {"x": 2.0}, (), 0.0)  # higher priority: never
    assert not yields_to(x, "a", {"a": 2.0}, ("x",), 0.0)  # x needs more engines itself
    assert not yields_to(x, "x", {}, (), 0.0)  # its own model


X1, Y2 = inst("x", "gpu1"), inst("y", "gpu2")
WEAK, STRONG = inst("a", "gpu1", 5.0), inst("a", "gpu2", 9.0)
ASLEEP = (WEAK, STRONG, inst("b", "gpu3"))


def swaps(**kw: object) -> list[tuple[str, list[str]]]:
    args: dict[str, object] = {
        "cluster": FREED,
        "running": (X1, Y2),
        "asleep": ASLEEP,
        "waiting_by_model": {"a": 1, "b": 1},
        "priorities": {},
        "in_flight_by_key": {},
        "busy_gpu_ids": (),
    }
    args.update(kw)
    out: list[Swap] = swaps_aside(**args)  # type: ignore[arg-type]
    return [(f"{s.wake.model}@{s.wake.gpu_ids[0]}", [h.model for h in s.sleep]) for s in out]


def test_a_swap_wakes_the_best_sleeper_once_the_holder_sleeps() -> None:
    # b's sleeper on gpu3 has nothing running beside it: wakes_aside's, not a swap
    assert swaps() == [("a@gpu2", ["y"]), ("a@gpu1", ["x"])]
    assert swaps(max_per_model=1) == [("a@gpu2", ["y"])]
    assert swaps(busy_gpu_ids=("gpu2",)) == [("a@gpu1", ["x"])]
    assert swaps(busy_keys=(instance_key(X1),)) == [("a@gpu2", ["y"])]
    assert swaps(waiting_by_model={"a": 0}) == []


def test_a_busy_or_higher_priority_holder_keeps_its_gpu() -> None:
    busy = {instance_key(Y2): 2.0}
    assert swaps(in_flight_by_key=busy) == [("a@gpu1", ["x"])]
    # a of higher priority: y yields though it serves; x of higher priority than a never
    assert swaps(in_flight_by_key=busy, priorities={"a": 2.0, "x": 3.0}) == [("a@gpu2", ["y"])]
    # y's own model needs more engines: it keeps its GPU
    assert swaps(waiting_by_model={"a": 1, "y": 1}) == [("a@gpu1", ["x"])]


def test_the_higher_priority_model_swaps_first_and_no_gpu_is_in_two_swaps() -> None:
    c = inst("c", "gpu1", 5.0)
    got = swaps(asleep=(WEAK, c), waiting_by_model={"a": 1, "c": 1}, priorities={"c": 3.0})
    assert got == [("c@gpu1", ["x"])]
    assert swaps(asleep=(WEAK, c), waiting_by_model={"a": 1, "c": 1}) == [("a@gpu1", ["x"])]
