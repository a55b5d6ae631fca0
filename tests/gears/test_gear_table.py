"""The one gear-table lookup (measured, interpolated, calibrated, predicted) and CSV/JSON
exchange, plus `flexpipe gears list|show|export|import` through the real CLI, and `gears show`
agreeing with the planner."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_store import make_point
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.gears import GearError, GearTable, whole_gpu_placement
from flexpipe.gears.gear import parse_gear
from flexpipe.gears.io import GearTableFormatError, export_points, import_points
from flexpipe.launch.gear_bench import max_batch_that_fits
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import PerfModel, perf_model_for
from flexpipe.perf.gear_lookup import Actuation, GearLookup, GearQuery
from flexpipe.perf.steady_state import Workload, steady_state
from flexpipe.store import Store

SPEC = load_model_spec("llama-2-7b")
SHAPE = Workload(512, 128)  # make_point's request shape


def query(gear: str = "tp=1", batch: int = 1, gpu_type: str = "A100-80G-SXM") -> GearQuery:
    g = replace(parse_gear(gear), max_num_seqs=batch)
    return GearQuery.on_whole_gpus(SPEC, g, [gpu_type], "nvlink3")


def test_a_measured_batch_is_the_measurement() -> None:
    lookup = GearLookup([make_point(1), make_point(4), make_point(16)])
    est = lookup.estimate(query(batch=4), SHAPE)
    p4 = make_point(4)
    assert est.basis == "measured" and est.is_measured
    assert (est.batch, est.tpot_s, est.ttft_s, est.e2e_s) == (
        4,
        p4.tpot_p99_s,
        p4.ttft_p99_s,
        p4.e2e_p99_s,
    )
    assert (est.output_tokens_per_s, est.requests_per_s) == (
        p4.decode_tokens_per_s,
        p4.requests_per_s,
    )
    assert est.detail == "gear table: sim 0.1.0, 2026-01-02, 200 req"


def test_between_measured_batches_every_figure_is_linear_in_the_batch() -> None:
    lookup = GearLookup([make_point(1), make_point(4), make_point(16)])
    mid = lookup.estimate(query(batch=10), SHAPE)
    assert mid.basis == "interpolated" and mid.is_measured and mid.batch == 10
    assert "between measured batch 4 and 16" in mid.detail
    # make_point's figures are linear in b, so the interpolation is exact at b=10
    assert mid.output_tokens_per_s == pytest.approx(100.0 * 10)
    assert mid.requests_per_s == pytest.approx(0.5 * 10)
    assert mid.tpot_s == pytest.approx(0.012 + 0.001 * 10)
    assert mid.ttft_s == pytest.approx(0.07 * 10)


def test_the_curve_matches_the_gear_family_whatever_its_max_num_seqs() -> None:
    """gear_bench stores `...-s256`; the planner asks with max_num_seqs = the concurrency."""
    lookup = GearLookup([make_point(4, gear_key="tp1-pp1-bf16-kvauto-s8")])
    assert lookup.estimate(query(batch=4), SHAPE).basis == "measured"


def test_the_newest_point_of_a_batch_wins() -> None:
    old = make_point(4)
    new = replace(old, gear_key="tp1-pp1-bf16-kvauto-s8", tpot_p99_s=0.5)
    new = replace(new, measured_at=old.measured_at.replace(year=2027))
    assert GearLookup([new, old]).estimate(query(batch=4), SHAPE).tpot_s == 0.5


def test_outside_the_measured_batches_the_model_is_calibrated_to_the_nearest() -> None:
    measured = make_point(4)
    lookup = GearLookup([measured, make_point(2)])
    est = lookup.estimate(query(batch=32), SHAPE)
    assert est.basis == "calibrated" and not est.is_measured
    assert "batch 4, 512/128 tokens" in est.detail
    pm = perf_model_for("llama-2-7b", "tp=1")
    prior32, prior4 = steady_state(pm, 32, SHAPE), steady_state(pm, 4, SHAPE)
    tpot = prior32.tpot_s * measured.tpot_p99_s / prior4.tpot_s
    ttft = prior32.ttft_s * measured.ttft_p99_s / prior4.ttft_s
    assert est.tpot_s == pytest.approx(tpot) and est.ttft_s == pytest.approx(ttft)
    # throughputs follow from the calibrated times (Little's law), not from the measurement
    assert est.output_tokens_per_s == pytest.approx(32 / tpot)
    assert est.requests_per_s == pytest.approx(32 / (128 * tpot))
    assert est.e2e_s == pytest.approx(ttft + 128 * tpot)


def test_another_request_shape_calibrates_from_the_nearest_shape() -> None:
    lookup = GearLookup([make_point(4, input_len=2048), make_point(4, input_len=100)])
    est = lookup.estimate(query(batch=4), SHAPE)
    assert est.basis == "calibrated" and "batch 4, 100/128 tokens" in est.detail


def test_no_measurement_is_the_prior_and_says_so() -> None:
    lookup = GearLookup([make_point(4)])
    q = query("tp=2", 8)
    assert q.key.gpu_types == "A100-80G-SXM+A100-80G-SXM" and q.key.link == "nvlink3"
    est = lookup.estimate(q, SHAPE)
    assert est.basis == "predicted" and "no measurement" in est.detail
    pm = PerfModel(SPEC, parse_gear("tp=2,max_num_seqs=1"), q.placement())
    assert est.tpot_s == steady_state(pm, 8, SHAPE).tpot_s
    # more batch -> more throughput, slower tokens
    est32 = lookup.estimate(query("tp=2", 32), SHAPE)
    assert est32.output_tokens_per_s > est.output_tokens_per_s and est32.tpot_s > est.tpot_s


def test_the_table_groups_a_family_by_shape_and_batch() -> None:
    table = GearTable([make_point(16), make_point(1), make_point(4, input_len=64)])
    key = query().key
    assert sorted(table.curves(key)) == [(64, 128), (512, 128)]
    assert [(p.input_len, p.batch_size) for p in table.points(key)] == [
        (64, 4),
        (512, 1),
        (512, 16),
    ]
    assert table.curves(query("tp=2").key) == {}


def test_whole_gpu_placement_needs_one_type_per_rank() -> None:
    with pytest.raises(GearError, match="needs 2 GPUs; 3 GPU types"):
        whole_gpu_placement(parse_gear("tp=2"), ["L4", "L4", "L4"], "pcie4", 32)


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

    res = runner.invoke(
        app, ["gears", "show", "llama-2-70b", "--gpu-type", "L4", "--store", "sqlite://"]
    )
    assert res.exit_code == 2 and "GiB" in res.output and "Traceback" not in res.output


def test_gears_show_prints_the_figures_the_planner_uses(tmp_path: Path) -> None:
    """For every instance `flexpipe plan` chooses — on a calibrated, an interpolated and a
    predicted estimate — `flexpipe gears show` at its gear, GPUs and batch prints the same
    figures, bit for bit."""
    root = Path(__file__).resolve().parents[2]
    url = f"sqlite:///{tmp_path / 'g.db'}"
    shape = {"input_len": 2048, "output_len": 256}  # examples/models/llama-7b.yaml
    l40s = {"gear_key": "tp1-pp1-fp8-kvauto-s256", "gpu_types": "L40S", **shape}
    a100 = {"gear_key": "tp2-pp1-bf16-kvauto-s256", "link": "nvlink3", **shape}
    a100["gpu_types"] = "A100-80G-SXM+A100-80G-SXM"
    with Store(url) as store:
        store.put_points([make_point(b, **l40s) for b in (1, 2)])
        store.put_points([make_point(b, **a100) for b in (1, 64)])
    runner = CliRunner(env={"COLUMNS": "250"})
    cluster = root / "examples" / "clusters" / "fragmented-4gpu.yaml"
    models = tmp_path / "models.yaml"  # the example at 5x the load: every GPU is needed
    example = (root / "examples" / "models" / "llama-7b.yaml").read_text()
    models.write_text(example.replace("request_rate_per_s: 8", "request_rate_per_s: 40"))
    args = ["plan", "--cluster", str(cluster), "--models", str(models), "--store", url, "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    instances = json.loads(res.output)["instances"]
    hardware = {"gpu0": "L4", "gpu1": "A100-80G-SXM", "gpu2": "A100-80G-SXM", "gpu3": "L40S"}
    bases = set()
    for inst in instances:
        types = "+".join(hardware[g] for stage in inst["stages"] for g in stage)
        show = ["gears", "show", inst["model_id"], "--gear", inst["gear"], "--gpu-type", types]
        show += ["--link", "nvlink3", "--batch", str(inst["batch"]), "--store", url, "--json"]
        show += ["--input-len", "2048", "--output-len", "256"]
        res = runner.invoke(app, show)
        assert res.exit_code == 0, res.output
        (est,) = json.loads(res.output)["estimates"]
        for field in ("batch", "ttft_s", "tpot_s", "e2e_s", "output_tokens_per_s", "basis"):
            assert est[field] == inst[field], (inst["name"], field)
        assert est["detail"] == inst["detail"]
        bases.add(est["basis"])
    assert bases == {"calibrated", "interpolated", "predicted"}


def test_the_gears_package_sits_below_the_performance_model() -> None:
    """flexpipe.perf imports the gear from flexpipe.gears: the package itself must not import
    the performance model (the lookup and the bench are imported from their modules)."""
    import subprocess
    import sys

    code = "import sys, flexpipe.gears; print(sorted(m for m in sys.modules if 'flexpipe' in m))"
    root = str(Path(__file__).resolve().parents[2])  # this checkout's package, not another
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout
    assert "flexpipe.gears.gear" in loaded and "flexpipe.gears.table" in loaded
    for later in (
        "flexpipe.perf",
        "flexpipe.perf.gear_lookup",
        "flexpipe.launch.gear_bench",
        "flexpipe.policies",
    ):
        assert f"'{later}" not in loaded, later


def test_actuation_is_the_performance_model_until_gear_bench_measured_it() -> None:
    """Cold start and wakes of a 7B tp=1 on an A100: modelled (20 s + 13.5 GB at 2 GB/s; the
    weights back over PCIe 4 from host RAM; from storage again), then the gear table's: the
    median over the gear's points; a figure not measured stays the model's."""
    prior = GearLookup().actuation(query())
    assert prior == Actuation(
        26.738415616, 0.5264384, 6.738415616, ("predicted", "predicted", "predicted")
    )
    points = [make_point(b, cold_start_s=c, wake_level1_s=w) for b, c, w in
              ((1, 30.0, 0.7), (4, 31.0, 0.8), (16, 35.0, None))]  # fmt: skip
    measured = GearLookup(points).actuation(query())
    assert measured == Actuation(31.0, 0.75, 6.738415616, ("measured", "measured", "predicted"))
