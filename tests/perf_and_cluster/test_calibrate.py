"""`flexpipe calibrate`: measurements -> factors -> store -> every command's model, tested on
CPU with a recorded measurement CSV (the format the command writes with --out)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.perf import microbench, perf_model_for
from flexpipe.perf.calibration import builtin_calibration
from flexpipe.perf.sample import read_samples_csv
from flexpipe.store import Store

RECORDED = Path(__file__).parents[1] / "data" / "calibrate_recorded_h100.csv"
runner = CliRunner()


def _calibrate(tmp_path: Path, *extra: str) -> str:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    result = runner.invoke(
        app,
        ["calibrate", "--model", "llama-2-7b", "--from-csv", str(RECORDED), "--store", url, *extra],
    )
    assert result.exit_code == 0, result.output
    return url


def test_recorded_measurements_are_fitted_stored_and_used(tmp_path: Path) -> None:
    url = _calibrate(tmp_path)
    with Store(url) as st:
        stored = st.calibration()
        eff = st.efficiency()
    h100 = stored.gpu("H100-80G-SXM")
    link = stored.link("nvswitch-h100")
    assert h100 is not None and link is not None
    assert h100.source == link.source == "recorded measurements calibrate_recorded_h100.csv"
    # The stored set replaces the built-in one for H100 and keeps the others.
    assert eff.calibration.gpu("H100-80G-SXM") == h100
    assert eff.calibration.gpu("A100-80G-SXM") == builtin_calibration().gpu("A100-80G-SXM")
    assert h100 != builtin_calibration().gpu("H100-80G-SXM")
    # `estimate --store` prices with it: the number any PerfModel built with the store's
    # efficiency gives (what plan / up / sim hand the model).
    result = runner.invoke(
        app,
        [
            "estimate",
            "--model",
            "llama-2-7b",
            "--gpus",
            "H100-80G-SXM:1",
            "--batch",
            "8",
            "--store",
            url,
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["factors"]["H100-80G-SXM"].endswith("calibrate_recorded_h100.csv")
    pm = perf_model_for("llama-2-7b", "tp=1", gpu_type="H100-80G-SXM", efficiency=eff)
    assert report["steps"][0]["decode_step_ms"] == round(pm.decode_step_s(8, 1024 + 128) * 1e3, 3)
    builtin_pm = perf_model_for("llama-2-7b", "tp=1", gpu_type="H100-80G-SXM")
    assert pm.decode_step_s(8, 1152) != builtin_pm.decode_step_s(8, 1152)


def test_calibrating_again_replaces_the_same_gpu_type(tmp_path: Path) -> None:
    url = _calibrate(tmp_path)
    _calibrate(tmp_path)
    with Store(url) as st:
        assert len(st.calibration().gpus) == 1 and len(st.calibration().links) == 1
        assert st.delete_calibration("H100-80G-SXM") == 1
        assert st.calibration().gpu("H100-80G-SXM") is None


def test_out_writes_the_measurements_in_the_format_it_reads(tmp_path: Path) -> None:
    out = tmp_path / "m.csv"
    _calibrate(tmp_path, "--out", str(out))
    assert read_samples_csv(out.read_text()) == read_samples_csv(RECORDED.read_text())


def test_the_summary_compares_generic_and_calibrated_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    result = runner.invoke(
        app,
        ["calibrate", "--model", "llama-2-7b", "--from-csv", str(RECORDED), "--store", url],
    )
    assert "stored factors for H100-80G-SXM, nvswitch-h100" in result.output
    assert "generic" in result.output and "calibrated" in result.output


def test_without_torch_it_says_how_to_install_it_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(microbench, "torch_available", lambda: False)
    result = runner.invoke(
        app, ["calibrate", "--model", "llama-2-7b", "--store", f"sqlite:///{tmp_path / 's.db'}"]
    )
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'flexpipe[calibrate]'" in lines[0]


def test_a_bad_measurement_csv_names_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text(RECORDED.read_text().replace("attn_pre_proj,0.", "attn_pre_proj,-0.", 1))
    result = runner.invoke(
        app,
        [
            "calibrate",
            "--model",
            "llama-2-7b",
            "--from-csv",
            str(bad),
            "--store",
            f"sqlite:///{tmp_path / 's.db'}",
        ],
    )
    assert result.exit_code == 2 and "bad.csv line 2" in result.output
