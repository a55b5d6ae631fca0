"""Gear table lookup (interpolation, calibrated and predicted fallbacks) and CSV/JSON
exchange, plus `flexpipe gears list|show|export|import` through the real CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_store import make_point
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.gears.gear import parse_gear
from flexpipe.gears.io import GearTableFormatError, export_points, import_points
from flexpipe.gears.table import GearTable, max_batch_that_fits, predict_point
from flexpipe.perf import InfeasibleGear, perf_model_for
from flexpipe.store import Store

TP1 = parse_gear("tp=1")


def test_exact_and_interpolated_lookup() -> None:
    table = GearTable([make_point(1), make_point(4), make_point(16)])
    exact = table.lookup("llama-2-7b", TP1, 4)
    assert exact.basis == "measured" and exact.point == make_point(4)
    mid = table.lookup("llama-2-7b", TP1, 10)
    assert mid.basis == "interpolated"
    assert "4 and 16" in mid.note
    # linear in batch size between the neighbours: decode 100*b is exact at b=10
    assert mid.point.decode_tokens_per_s == pytest.approx(1000.0)
    assert mid.point.tpot_p99_s == pytest.approx(0.012 + 0.010)
    assert mid.point.batch_size == 10


def test_outside_the_measured_range_is_calibrated_by_the_model() -> None:
    measured = make_point(4)
    table = GearTable([measured])
    est = table.lookup("llama-2-7b", TP1, 32)
    assert est.basis == "calibrated" and "batch 4" in est.note
    pm = perf_model_for("llama-2-7b", TP1)
    p32, p4 = predict_point(pm, 32), predict_point(pm, 4)
    expected = p32.tpot_p50_s * measured.tpot_p50_s / p4.tpot_p50_s
    assert est.point.tpot_p50_s == pytest.approx(expected)


def test_no_measurement_falls_back_to_the_model_and_says_so() -> None:
    table = GearTable([make_point(4)])
    est = table.lookup("llama-2-7b", parse_gear("tp=2"), 8, link="nvlink3")
    assert est.basis == "predicted"
    assert "no measurement" in est.note and "performance-model" in est.note
    assert est.point.source == "predicted" and est.point.engine == "perf-model"
    assert est.point.gpu_types == "A100-80G-SXM+A100-80G-SXM"
    # more batch -> more throughput, slower tokens
    est32 = table.lookup("llama-2-7b", parse_gear("tp=2"), 32, link="nvlink3")
    assert est32.point.decode_tokens_per_s > est.point.decode_tokens_per_s
    assert est32.point.tpot_p50_s > est.point.tpot_p50_s


def test_other_workload_shapes_do_not_match_the_curve() -> None:
    table = GearTable([make_point(4, input_len=2048)])
    assert table.lookup("llama-2-7b", TP1, 4).basis == "predicted"


def test_a_gear_that_does_not_fit_raises() -> None:
    with pytest.raises(InfeasibleGear, match="GiB"):
        GearTable().lookup("llama-2-70b", TP1, 1, gpu_types=("L4",))


def test_max_batch_that_fits_is_capped_by_memory_and_max_num_seqs() -> None:
    pm = perf_model_for("llama-2-7b", "tp=1,max_num_seqs=8")
    assert max_batch_that_fits(pm, 512, 128) == 8
    pm_big = perf_model_for("llama-2-13b", "tp=1,max_num_seqs=1024", gpu_type="L40S")
    fits = max_batch_that_fits(pm_big, 512, 128)
    assert 0 < fits < 1024 and fits == pm_big.memory.max_batch(640)


@pytest.mark.parametrize("suffix", ["csv", "json"])
def test_export_import_round_trip(tmp_path: Path, suffix: str) -> None:
    points = [make_point(1), make_point(8, peak_kv_usage=None, note='a, "quoted" note')]
    path = tmp_path / f"table.{suffix}"
    export_points(points, path)
    assert import_points(path) == points


def test_bad_files_name_the_row(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    doc = {"format": "flexpipe-gear-table", "version": 1, "points": [make_point(1).as_dict()]}
    del doc["points"][0]["ttft_p50_s"]  # type: ignore[index]
    path.write_text(json.dumps(doc))
    with pytest.raises(GearTableFormatError, match=r"points\[0\]: missing field 'ttft_p50_s'"):
        import_points(path)
    csv_path = tmp_path / "t.csv"
    export_points([make_point(1)], csv_path)
    csv_path.write_text(csv_path.read_text().replace(",200,", ",many,"))
    with pytest.raises(GearTableFormatError, match="line 2: field 'num_requests'"):
        import_points(csv_path)
    with pytest.raises(GearTableFormatError, match=r"use \.csv or \.json"):
        import_points(tmp_path / "t.txt")


def test_gears_cli_list_show_export_import(tmp_path: Path) -> None:
    runner = CliRunner(env={"COLUMNS": "250"})
    url = f"sqlite:///{tmp_path / 'a.db'}"
    with Store(url) as store:
        store.put_points([make_point(1), make_point(4), replace(make_point(1), model="mistral-7b")])
    res = runner.invoke(app, ["gears", "list", "--store", url])
    assert res.exit_code == 0, res.output
    assert "llama-2-7b" in res.output and "mistral-7b" in res.output
    res = runner.invoke(
        app, ["gears", "show", "llama-2-7b", "--gear", "tp=1", "--store", url, "--batch", "2"]
    )
    assert res.exit_code == 0, res.output
    assert "interpolated" in res.output
    out = tmp_path / "t.csv"
    res = runner.invoke(app, ["gears", "export", str(out), "--store", url, "--model", "llama-2-7b"])
    assert res.exit_code == 0, res.output
    url_b = f"sqlite:///{tmp_path / 'b.db'}"
    res = runner.invoke(app, ["gears", "import", str(out), "--store", url_b])
    assert res.exit_code == 0, res.output
    assert "2 points" in res.output
    with Store(url_b) as store:
        assert store.points() == [make_point(1), make_point(4)]


def test_gears_cli_errors_are_one_line(tmp_path: Path) -> None:
    runner = CliRunner(env={"COLUMNS": "250"})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    res = runner.invoke(app, ["gears", "import", str(bad), "--store", "sqlite://"])
    assert res.exit_code == 2
    assert "not valid JSON" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["gears", "show", "no-such-model", "--store", "sqlite://"])
    assert res.exit_code == 2 and "no-such-model" in res.output


def planner_key(gear: str, batch: int) -> object:
    from flexpipe.gears.table import uniform_gear_placement
    from flexpipe.model_spec import load_model_spec
    from flexpipe.policies.planner import GearKey

    spec = load_model_spec("llama-2-7b")
    g = replace(parse_gear(gear), max_num_seqs=batch)
    return GearKey.of(spec, g, uniform_gear_placement(spec, g, ["A100-80G-SXM"], "nvlink3"))


def test_the_planner_reads_the_gear_table() -> None:
    from flexpipe.gears.performance import TablePerformance
    from flexpipe.policies.planner import GearKey, Workload

    perf = TablePerformance([make_point(1), make_point(4), make_point(16)])
    w = Workload(512, 128)
    key4 = planner_key("tp=1", 4)
    assert isinstance(key4, GearKey)
    exact = perf.estimate(key4, w)
    assert exact.source == "measured" and exact.tpot_s == make_point(4).tpot_p99_s
    assert "gear table: sim" in exact.detail
    mid = perf.estimate(planner_key("tp=1", 10), w)  # type: ignore[arg-type]
    assert mid.source == "measured" and "interpolated" in mid.detail
    assert mid.tpot_s == pytest.approx(0.012 + 0.010)
    far = perf.estimate(planner_key("tp=1", 64), w)  # type: ignore[arg-type]
    assert far.source == "predicted" and "calibrated" in far.detail and "batch 16" in far.detail
    other = perf.estimate(planner_key("tp=2", 4), w)  # type: ignore[arg-type]
    assert other.source == "predicted" and other.detail == "performance model prior"
