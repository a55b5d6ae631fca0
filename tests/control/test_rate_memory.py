"""The measured rates survive a controller restart (control/state/rate_memory.py): written to a real
SQLite store a sample a minute, pruned past what the forecast reads, and read back into a new
controller's clock, so "the same time yesterday" is there at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from flexpipe.control.api.gateway_client import GatewayClient
from flexpipe.control.controller import Controller
from flexpipe.control.controller_config import ControllerConfig
from flexpipe.control.core.observe import RateWindow
from flexpipe.control.state.rate_memory import RateMemory
from flexpipe.launch import LocalLauncher
from flexpipe.policies.planner import ModelDemand, Slo
from flexpipe.policies.shift import ShiftParams
from flexpipe.policies.shift.forecast import ForecastParams
from flexpipe.store import Store
from flexpipe.store.rate_history import RateHistory

ROOT = Path(__file__).resolve().parents[2]
DAY_S = 86400.0
T0_WALL_S = 1_790_000_000.0  # an epoch second, yesterday


def test_the_history_writes_reads_in_order_and_prunes(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        history = RateHistory(store)
        assert history.append([("b", 20.0, 2.0), ("a", 30.0, 3.0), ("a", 10.0, 1.0)]) == 3
        assert history.since(["a", "b"], 0.0) == {
            "a": [(10.0, 1.0), (30.0, 3.0)],
            "b": [(20.0, 2.0)],
        }
        assert history.since(["a"], 15.0) == {"a": [(30.0, 3.0)]}
        assert history.since([], 0.0) == {}
        assert history.prune(25.0) == 2
        assert history.since(["a", "b"], 0.0) == {"a": [(30.0, 3.0)]}
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:  # in the file, for the next process
        assert RateHistory(store).since(["a"], 0.0) == {"a": [(30.0, 3.0)]}


def test_a_window_takes_back_only_what_is_older_than_what_it_measured() -> None:
    rates = RateWindow({"a": 0.0}, keep_s=1000.0)
    rates.observe(100.0, {"a": 0.0}, ["a"])
    rates.observe(110.0, {"a": 50.0}, ["a"])  # 5 req/s measured at 110
    assert rates.restore("a", [(50.0, 1.0), (80.0, 2.0), (110.0, 9.0), (120.0, 9.0)]) == 2
    assert list(rates.series["a"]) == [(50.0, 1.0), (80.0, 2.0), (110.0, 5.0)]
    assert RateWindow({}, keep_s=0.0).restore("a", [(1.0, 1.0)]) == 0  # no forecast: not kept


def test_keep_writes_a_sample_a_minute_of_what_was_measured_now(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        memory = RateMemory(RateHistory(store), keep_s=DAY_S + 600)
        rates = RateWindow({"a": 7.0, "b": 7.0}, keep_s=DAY_S + 600)
        assert memory.keep(rates, 0.0, T0_WALL_S) == 0  # nothing measured yet: no sample
        done = 0.0
        for tick in range(0, 31):  # 5 minutes of 10-s ticks, model "a" only
            done += 40.0
            rates.observe(tick * 10.0, {"a": done}, ["a"])
            memory.keep(rates, tick * 10.0, T0_WALL_S + tick * 10.0)
        kept = RateHistory(store).since(["a", "b"], 0.0)
        assert list(kept) == ["a"]
        assert [at - T0_WALL_S for at, _ in kept["a"]] == [10.0, 70.0, 130.0, 190.0, 250.0]
        assert all(r == pytest.approx(4.0) for _, r in kept["a"])
        # a day later the first samples are past what the forecast reads: pruned
        memory._pruned_wall_s = -float("inf")
        rates.observe(400.0, {"a": done + 40}, ["a"])
        assert memory.keep(rates, 400.0, T0_WALL_S + DAY_S + 600 + 100) == 1
        left = RateHistory(store).since(["a"], 0.0)["a"]
        assert [at - T0_WALL_S for at, _ in left] == [130.0, 190.0, 250.0, DAY_S + 700]


def _controller(store: Store, clock_s: float, wall_s: float, lines: list[str]) -> Controller:
    demand = ModelDemand("m", "llama-2-7b", 1.0, 512, 64, Slo(2.0, 0.1), ("bf16",))
    config = ControllerConfig(ROOT / "examples/clusters/fragmented-4gpu.yaml", (demand,),
                              shift=ShiftParams(forecast=ForecastParams()))  # fmt: skip
    return Controller(config, LocalLauncher(), GatewayClient("http://127.0.0.1:9", None),
                      lambda p, c: None,  # type: ignore[arg-type,return-value]
                      store=store, clock=lambda: clock_s, wall=lambda: wall_s,
                      say=lines.append)  # fmt: skip


def test_a_restarted_controller_forecasts_from_yesterday_at_once(tmp_path: Path) -> None:
    params = ForecastParams()
    url = f"sqlite:///{tmp_path / 'fp.db'}"
    with Store(url) as store:
        first = _controller(store, 5000.0, T0_WALL_S, [])
        assert first.rate_memory is not None
        done = 0.0
        for minute in range(30):  # yesterday: 30 minutes, a 9 req/s peak in minutes 10-19
            rate = 9.0 if 10 <= minute < 20 else 1.0
            for tick in range(6):
                done += rate * 10.0
                now_s = 5000.0 + minute * 60 + tick * 10
                first._rates.observe(now_s, {"m": done}, ["m"])
                first.rate_memory.keep(first._rates, now_s, T0_WALL_S + now_s - 5000.0)
    # a day later, a new process (its monotonic clock starts near 0), five minutes before the
    # hour of yesterday's peak
    lines: list[str] = []
    with Store(url) as store:
        restarted = _controller(store, 3.0, T0_WALL_S + DAY_S + 300.0, lines)
        expected = restarted._rates.expected_rates_per_s(3.0, params)
        assert expected["m"] == pytest.approx(9.0, rel=0.05)  # yesterday's peak, ahead
        assert any("rate sample(s) of the last 24.1 h read back" in line for line in lines), lines
    with Store(f"sqlite:///{tmp_path / 'other.db'}") as store:  # an empty store: nothing yet
        assert _controller(store, 3.0, T0_WALL_S + DAY_S, []).expected_rates_per_s == {}
        fresh = _controller(store, 3.0, T0_WALL_S + DAY_S + 300.0, [])
        assert fresh._rates.expected_rates_per_s(3.0, params) == {}


def test_a_store_that_fails_leaves_the_controller_serving(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        memory = RateMemory(RateHistory(store), keep_s=DAY_S)
        rates = RateWindow({"a": 0.0}, keep_s=DAY_S)
        rates.observe(0.0, {"a": 0.0}, ["a"])
        rates.observe(10.0, {"a": 10.0}, ["a"])
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE rate_samples")
        assert memory.keep(rates, 10.0, T0_WALL_S) == 0  # logged, not raised
        assert memory.restore(RateWindow({}, keep_s=DAY_S), ["a"], 0.0, T0_WALL_S) == 0
        with pytest.raises(OperationalError):  # the failure was real
            RateHistory.since(memory.history, ["a"], 0.0)
