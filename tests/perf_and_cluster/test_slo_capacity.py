"""flexpipe.perf.slo_capacity: the queue an instance is sized by (docs/planner.md, "Sized at
the SLO"). The calibration against the simulator is tests/sim/test_sim_slo_sizing.py."""

from __future__ import annotations

import math

import pytest

from flexpipe.perf.slo_capacity import (
    MU_SCALE,
    SloShape,
    dispersion_of_counts,
    erlang_c,
    miss_share,
    mmc_wait_quantile_s,
    slo_rate_per_s,
    tpot_miss_share,
    ttft_miss_share,
)

# llama-2-7b on one A100-80G (bf16), 1,024 tokens in and 256 out: the planner's figures at
# batch 64 (the largest meeting TPOT 60 ms) and at batch 1.
A100_7B = SloShape(
    batch=64,
    requests_per_s=4.70524822859636,
    ttft_full_s=0.12282307715847027,
    tpot_full_s=0.053132159634132294,
    tpot_one_s=0.011178973636452537,
    output_tokens=256,
)


def test_erlang_c_and_the_mmc_wait() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: the utilisation
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(2.7, 1.0) == erlang_c(2, 1.0)  # Hayward's fractional servers: rounded down
    assert erlang_c(4, 0.0) == 0.0 and erlang_c(4, 4.0) == 1.0
    assert erlang_c(512, 500.0) < 1.0  # stable for hundreds of servers
    # M/M/1 at half load: P(wait) 0.5, the tail decays at mu - lambda: ln(0.5 / 0.01) / 0.5
    assert mmc_wait_quantile_s(1, 1.0, 0.5) == pytest.approx(math.log(50) / 0.5)
    assert mmc_wait_quantile_s(2, 1.0, 2.0) == math.inf
    assert mmc_wait_quantile_s(2, 1.0, 0.0) == 0.0


def test_the_shape_runs_from_one_slot_to_every_slot() -> None:
    # Little's law with TPOT linear in the concurrency: at the full throughput, every slot
    assert A100_7B.busy_slots(A100_7B.requests_per_s) == pytest.approx(64)
    assert A100_7B.tpot_at_s(A100_7B.requests_per_s) == pytest.approx(A100_7B.tpot_full_s)
    assert A100_7B.tpot_at_s(0.0) == A100_7B.tpot_one_s
    assert A100_7B.prefill_s == pytest.approx(0.12282307715847027 - 0.053132159634132294)


def test_misses_grow_with_the_rate_and_the_burstiness() -> None:
    rates = [0.5, 2.0, 3.5, 4.0]
    ttft = [ttft_miss_share(A100_7B, r, 2.0) for r in rates]
    tpot = [tpot_miss_share(A100_7B, r, 0.06) for r in rates]
    assert ttft == sorted(ttft) and tpot == sorted(tpot)
    assert ttft_miss_share(A100_7B, 4.0, 2.0) == pytest.approx(0.009512, abs=1e-6)
    assert tpot_miss_share(A100_7B, 4.0, 0.06) == pytest.approx(0.001193, abs=1e-6)
    assert miss_share(A100_7B, 4.0, 2.0, 0.06) == pytest.approx(0.010705, abs=1e-6)
    assert ttft_miss_share(A100_7B, 4.0, 2.0, 4.0) > ttft_miss_share(A100_7B, 4.0, 2.0)
    assert tpot_miss_share(A100_7B, 4.0, 0.06, 4.0) > tpot_miss_share(A100_7B, 4.0, 0.06)
    # past the calibrated saturation every request waits too long
    assert ttft_miss_share(A100_7B, A100_7B.requests_per_s * MU_SCALE, 2.0) == 1.0


def test_the_slo_rate_is_the_calibrated_one() -> None:
    """The figures of docs/planner.md's calibration table: Poisson 0.848 of the steady-state
    throughput (the simulator: 0.99 attainment up to ~0.855), gamma gaps of cv 2 0.684 (~0.69),
    cv 3 0.470."""
    mu = A100_7B.requests_per_s
    assert slo_rate_per_s(A100_7B, 2.0, 0.06) / mu == pytest.approx(0.848, abs=5e-4)
    assert slo_rate_per_s(A100_7B, 2.0, 0.06, 4.0) / mu == pytest.approx(0.684, abs=5e-4)
    assert slo_rate_per_s(A100_7B, 2.0, 0.06, 9.0) / mu == pytest.approx(0.470, abs=5e-4)
    # a TTFT SLO below the full batch's own TTFT: no rate meets it
    assert slo_rate_per_s(A100_7B, 0.1, 0.06) == 0.0
    # at the rate found, the misses are at the budget (1 %) over a trickle's
    rate = slo_rate_per_s(A100_7B, 2.0, 0.06)
    trickle = miss_share(A100_7B, mu * MU_SCALE * 1e-3, 2.0, 0.06)
    assert miss_share(A100_7B, rate, 2.0, 0.06) == pytest.approx(trickle + 0.01, abs=1e-4)


def test_dispersion_of_counts() -> None:
    assert dispersion_of_counts([1, 3, 1, 3]) == 1.0  # mean 2, mean squared step 4 / 2
    assert dispersion_of_counts([2, 2, 2, 2]) == 0.0
    # a slow trend is not burstiness: a steady ramp has a small dispersion
    ramp = dispersion_of_counts([float(k) for k in range(10, 110)])
    assert ramp is not None and ramp < 0.01
    assert dispersion_of_counts([0, 0, 0]) is None  # nothing arrived
    assert dispersion_of_counts([1, 2]) is None  # too few windows
