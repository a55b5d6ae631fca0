"""`flexpipe estimate` as a user runs it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from flexpipe.cli import app

runner = CliRunner()


def test_estimate_prints_plan_and_steps() -> None:
    result = runner.invoke(
        app,
        [
            "estimate",
            "--model",
            "llama-2-7b",
            "--gear",
            "tp=2,pp=1,dtype=bf16",
            "--gpus",
            "A100-80G-SXM:2",
            "--link",
            "nvlink3",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Memory plan" in result.output and "decode tokens/s" in result.output


def test_estimate_json_has_batches_1_8_32_and_max() -> None:
    result = runner.invoke(app, ["estimate", "--model", "llama-2-7b", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    batches = [s["batch"] for s in report["steps"]]
    assert batches[:3] == [1, 8, 32] and batches[-1] == report["memory"]["max_batch"]
    tokens_per_s = [s["decode_tokens_per_s"] for s in report["steps"]]
    assert tokens_per_s == sorted(tokens_per_s)


def test_estimate_reports_an_infeasible_gear_with_its_reason() -> None:
    result = runner.invoke(app, ["estimate", "--model", "llama-2-70b", "--json"])
    assert result.exit_code == 0
    report = json.loads(result.output)
    assert report["feasible"] is False and "GiB per GPU" in report["reason"]


def test_estimate_bad_input_is_one_line_and_exit_2() -> None:
    for args in (
        ["estimate", "--model", "no-such-model"],
        ["estimate", "--model", "llama-2-7b", "--gear", "tp=two"],
        ["estimate", "--model", "llama-2-7b", "--gpus", "B200:1"],
        ["estimate", "--model", "llama-2-7b", "--gear", "tp=2", "--gpus", "A100-80G-SXM:1"],
        ["estimate", "--model", "llama-2-7b", "--set", "hbm_eficiency=1"],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "error:" in result.output and "Traceback" not in result.output
