"""bench/gpu_check.sh without a GPU stops at once with one line; its comparison step gives
the error table of docs/performance-model.md for recorded measurements."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench._gpu_check_compare import compare
from flexpipe.perf.calibration import builtin_calibration
from flexpipe.perf.sample import read_samples_csv

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _run(tmp_path: Path, extra_path: str = "") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "PYTHONPATH": extra_path,
    }
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_without_pytorch_it_fails_cleanly_with_one_line(tmp_path: Path) -> None:
    try:
        import torch  # noqa: F401

        pytest.skip("PyTorch is installed here")
    except ImportError:
        pass
    res = _run(tmp_path)
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        "gpu_check: no GPU to check: no PyTorch here (pip install 'flexpipe[calibrate]')"
    ]
    assert not (tmp_path / "out").exists()


def test_without_a_cuda_device_it_fails_cleanly_with_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        "__version__ = '9.9.9+cpu'\n"
        "class cuda:\n"
        "    @staticmethod\n"
        "    def is_available():\n"
        "        return False\n"
    )
    res = _run(tmp_path, str(fake))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "gpu_check: no GPU to check: no CUDA GPU visible to PyTorch 9.9.9+cpu"
    ]


def test_the_comparison_is_the_error_table_for_this_gpu() -> None:
    samples = read_samples_csv((ROOT / "tests/data/calibrate_recorded_h100.csv").read_text())
    table = compare(samples, builtin_calibration()).splitlines()
    assert table[0] == (
        "| setup | group | size | n | generic median | generic p90 | shipped median "
        "| shipped p90 | fitted here median | fitted here p90 |"
    )
    assert table[2] == (
        "| H100-80G-SXM | gemm | decode-sized | 32 | 17.4% | 34.2% | 3.5% | 10.5% | 3.2% | 9.2% |"
    )
    assert len(table) == 10
    # a GPU type with no shipped set says so
    h100 = [s for s in samples if s.gpu_type == "H100-80G-SXM"]
    renamed = [dataclasses.replace(s, gpu_type="L40S") for s in h100]
    assert "| L40S (no shipped set) | gemm |" in compare(renamed, builtin_calibration())
