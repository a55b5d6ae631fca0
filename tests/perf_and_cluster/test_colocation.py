"""The contention model of engines sharing one GPU (flexpipe.perf.colocation)."""

from __future__ import annotations

import pytest

from flexpipe.perf.colocation import (
    busy_share,
    fits_together,
    memory_fraction,
    shared_capacity_per_s,
    stretch,
)


def test_stretch_is_k_times_plus_the_switch_overhead() -> None:
    assert stretch(1) == 1.0
    assert stretch(2) == pytest.approx(2.1)  # 2 x (1 + 0.05)
    assert stretch(3) == pytest.approx(3.3)  # 3 x (1 + 0.10)
    assert stretch(2, switch_overhead=0.0) == 2.0
    with pytest.raises(ValueError):
        stretch(0)


def test_busy_share_is_load_over_throughput() -> None:
    assert busy_share(1.0, 4.0) == 0.25
    with pytest.raises(ValueError):
        busy_share(1.0, 0.0)


def test_shared_capacity_is_what_the_others_leave() -> None:
    # alone: throughput 10/s, capacity 8.5/s at 0.85; the other is busy 30% of the time
    cap = shared_capacity_per_s(8.5, 10.0, 0.3, 2, switch_overhead=0.0)
    assert cap == pytest.approx(5.5)
    cap = shared_capacity_per_s(8.5, 10.0, 0.3, 2)  # 8.5 / 1.05 - 3
    assert cap == pytest.approx(8.5 / 1.05 - 3.0)
    assert shared_capacity_per_s(8.5, 10.0, 0.9, 2) == 0.0


def test_a_group_fits_exactly_when_each_load_is_within_its_shared_capacity() -> None:
    # two engines, throughput 10/s and 20/s, loads 3/s and 8/s: shares 0.3 and 0.4
    assert fits_together([0.3, 0.4], 0.85) is True  # 0.7 x 1.05 = 0.735
    assert fits_together([0.4, 0.42], 0.85) is False  # 0.82 x 1.05 = 0.861
    cap_a = shared_capacity_per_s(10.0 * 0.85, 10.0, 0.42, 2)
    assert cap_a < 4.0  # the same verdict from the capacity side
    cap_a = shared_capacity_per_s(10.0 * 0.85, 10.0, 0.4, 2)
    assert cap_a >= 3.0


def test_memory_fraction_rounds_up_to_the_step() -> None:
    gib = 2.0**30
    # 16 GiB weights + 4 GiB reserve + 1 MiB/token x 8192 tokens = 28 GiB of 80 -> 0.35
    assert memory_fraction(16 * gib, 4 * gib, 2.0**20, 8192, 80 * gib) == pytest.approx(0.35)
    # one byte more rounds up
    assert memory_fraction(16 * gib + 1, 4 * gib, 2.0**20, 8192, 80 * gib) == pytest.approx(0.36)
