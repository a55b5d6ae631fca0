"""gear_bench end to end against real sim engine processes with tiny sweeps, and its failure
modes: bad model, a gear that cannot fit, an engine that never becomes ready, an engine that
crashes mid-sweep, and cancellation (Ctrl-C). No process may be left behind."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
from test_launcher import marker, processes_with  # noqa: F401  (fixture)
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.gears import GearPoint
from flexpipe.gears.gear import parse_gear
from flexpipe.launch import EngineHandle, LocalEngine, LocalLauncher
from flexpipe.launch.gear_bench import (
    BenchLoad,
    BenchObserver,
    BenchTarget,
    bench,
    candidates,
    default_sweep,
)
from flexpipe.model_spec import load_model_spec
from flexpipe.perf.gear_lookup import GearLookup, GearQuery
from flexpipe.store import Store

TINY = BenchLoad(input_len=64, output_len=8, num_requests=6)
FAST = 0.02  # sim time scale: 50x faster than modelled time


def tiny_candidate(mark: str, gear: str = "tp=1,max_num_seqs=8") -> BenchTarget:
    (cand,), _ = candidates(load_model_spec("llama-2-7b"), [parse_gear(gear)], TINY)
    return replace(cand, spec=replace(cand.spec, served_model_name=mark))


def test_default_sweep() -> None:
    assert default_sweep(1) == [1]
    assert default_sweep(8) == [1, 2, 4, 8]
    assert default_sweep(24) == [1, 2, 4, 8, 16, 24]


def test_bench_cli_end_to_end_stores_the_curve(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'g.db'}"
    runner = CliRunner(env={"COLUMNS": "200"})
    res = runner.invoke(
        app,
        [
            "bench", "llama-2-7b", "--gears", "tp=1,max_num_seqs=8", "--time-scale", str(FAST),
            "--input-len", "64", "--output-len", "8", "--num-requests", "8",
            "--concurrency", "1,4", "--store", url,
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "gear_bench" in res.output and "measured (sim)" in res.output
    with Store(url) as store:
        points = store.points()
    assert [p.batch_size for p in points] == [1, 4]
    one, four = points
    assert all(p.source == "measured" and p.engine == "sim" for p in points)
    assert all(p.num_requests == 8 and p.num_failed == 0 for p in points)
    assert one.input_len == 64 and one.output_len == 8
    assert one.cold_start_s is not None and one.cold_start_s > 0
    # the engine started able to sleep: its wake-ups measured next to the cold start, the
    # same for every point of the gear (modelled: 0.53 s from host RAM, 6.7 s from storage;
    # HTTP at this time scale adds its milliseconds x 50)
    assert four.wake_level1_s == one.wake_level1_s and four.wake_level2_s == one.wake_level2_s
    assert one.wake_level1_s is not None and one.wake_level2_s is not None
    assert 0.5 < one.wake_level1_s < one.wake_level2_s < one.cold_start_s
    lookup = GearLookup(points)
    act = lookup.actuation(GearQuery.on_whole_gpus(load_model_spec("llama-2-7b"),
                                                   parse_gear("tp=1,max_num_seqs=8"),
                                                   ["A100-80G-SXM"], "nvlink3"))  # fmt: skip
    assert act.basis == ("measured", "measured", "measured")
    assert (act.cold_start_s, act.wake_level1_s) == (one.cold_start_s, one.wake_level1_s)
    # a closed loop of four clients moves more tokens than one
    assert four.decode_tokens_per_s > one.decode_tokens_per_s
    assert one.ttft_p50_s <= one.ttft_p99_s and one.tpot_p50_s > 0


def test_bad_model_name_is_one_line_and_launches_nothing(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        app, ["bench", "llama-9-7b", "--store", f"sqlite:///{tmp_path / 'g.db'}"]
    )
    assert res.exit_code == 2
    assert "unknown model 'llama-9-7b'" in res.output and "Traceback" not in res.output


def test_a_gear_that_cannot_fit_is_refused_with_the_reason(tmp_path: Path) -> None:
    res = CliRunner(env={"COLUMNS": "200"}).invoke(
        app,
        ["bench", "llama-2-70b", "--gears", "tp=1", "--gpu-type", "L4",
         "--store", f"sqlite:///{tmp_path / 'g.db'}"],
    )  # fmt: skip
    assert res.exit_code == 2
    assert "does not fit" in res.output and "GiB" in res.output
    assert "no gear to benchmark" in res.output


def test_engine_that_never_becomes_ready(marker: str, tmp_path: Path) -> None:  # noqa: F811
    launcher = LocalLauncher(
        "sim", time_scale=1.0, sim_load_time_s=1000, ready_timeout_s=1.0, log_dir=tmp_path
    )
    report = asyncio.run(bench([tiny_candidate(marker)], launcher, TINY, time_scale=1.0))
    assert report.points == []
    (failure,) = report.failures
    assert "did not become ready" in failure and "within 1 s" in failure
    assert processes_with(marker) == []


class KillAtSecondPoint(BenchObserver):
    def __init__(self) -> None:
        self.handle: LocalEngine | None = None
        self.num_points = 0

    def engine_ready(self, cand: BenchTarget, handle: EngineHandle) -> None:
        assert isinstance(handle, LocalEngine)
        self.handle = handle

    def point_started(self, cand: BenchTarget, concurrency: int, num_requests: int) -> None:
        self.num_points += 1
        if self.num_points == 2 and self.handle is not None:
            os.killpg(self.handle.pid, signal.SIGKILL)


def test_engine_that_crashes_mid_sweep(marker: str, tmp_path: Path) -> None:  # noqa: F811
    stored: list[GearPoint] = []
    launcher = LocalLauncher("sim", time_scale=FAST, log_dir=tmp_path)
    report = asyncio.run(
        bench(
            [tiny_candidate(marker)],
            launcher,
            TINY,
            time_scale=FAST,
            concurrencies=[1, 2, 4],
            store_point=stored.append,
            observer=KillAtSecondPoint(),
        )
    )
    assert [p.batch_size for p in stored] == [1]  # what was measured is kept
    (failure,) = report.failures
    assert "engine died during the sweep at concurrency 2" in failure
    assert "(exit -9)" in failure
    assert "kept 1 measured point" in failure
    assert processes_with(marker) == []


def test_cancel_stops_the_engine_and_keeps_points(marker: str, tmp_path: Path) -> None:  # noqa: F811
    stored: list[GearPoint] = []

    async def main() -> None:
        launcher = LocalLauncher("sim", time_scale=FAST, log_dir=tmp_path)
        first = asyncio.Event()

        def keep(p: GearPoint) -> None:
            stored.append(p)
            first.set()

        slow = replace(TINY, num_requests=400)  # the second point would take a while
        task = asyncio.create_task(
            bench(
                [tiny_candidate(marker)],
                launcher,
                slow,
                time_scale=FAST,
                concurrencies=[8, 1],
                store_point=keep,
            )
        )
        await asyncio.wait_for(first.wait(), 60)
        task.cancel()  # what Ctrl-C does to asyncio.run's main task
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert [p.batch_size for p in stored] == [8]
    assert processes_with(marker) == []
