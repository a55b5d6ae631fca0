"""Which weights serve which precision: the models file's `weights:` and `checkpoints:`, the
planner's precision filter (a precision no checkpoint serves is not planned), and the one-line
errors of `flexpipe plan` for a checkpoint it cannot launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.examples import example_path
from flexpipe.policies.planner import Checkpoint, ModelsFileError, parse_models
from flexpipe.policies.planner.checkpoint import checkpoint_for, servable, unplanned_notes

runner = CliRunner(env={"COLUMNS": "200"})


def _doc(**extra: Any) -> dict[str, Any]:
    item = {
        "name": "llama-7b",
        "model": "llama-2-7b",
        "demand": {"request_rate_per_s": 2, "input_tokens": 512, "output_tokens": 128},
        "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 80},
        **extra,
    }
    return {"models": [item]}


def _errors(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(ModelsFileError) as info:
        parse_models(doc, "m.yaml")
    return info.value.errors


def test_weights_default_to_the_catalogs_repo_and_bf16_fp8_come_from_them() -> None:
    (d,) = parse_models(_doc(dtypes=["bf16", "fp8"]))
    assert d.weights == "meta-llama/Llama-2-7b-hf"
    assert d.dtypes == ("bf16", "fp8") and d.dtypes_without_checkpoint == ()
    assert checkpoint_for("bf16", d.weights, d.checkpoints) == Checkpoint(
        "bf16", "meta-llama/Llama-2-7b-hf", None
    )
    # fp8 is quantized from the bf16 weights as the engine loads them (dynamic)
    assert checkpoint_for("fp8", d.weights, d.checkpoints) == Checkpoint(
        "fp8", "meta-llama/Llama-2-7b-hf", "fp8"
    )


def test_a_local_path_and_a_config_folder_are_weights() -> None:
    (d,) = parse_models(_doc(weights="/models/llama-2-7b"))
    assert d.weights == "/models/llama-2-7b"


def test_int8_and_int4_need_a_named_checkpoint_and_are_left_out_without_one() -> None:
    (d,) = parse_models(_doc(dtypes=["bf16", "int8", "int4"]))
    assert d.dtypes == ("bf16",)
    assert d.dtypes_without_checkpoint == ("int8", "int4-awq")
    assert unplanned_notes((d,)) == [
        "llama-7b: int8, int4-awq not planned: no checkpoint (name one under `checkpoints:` "
        "in the models file, with its quantization method)"
    ]


def test_a_named_checkpoint_serves_its_precision_and_its_method_picks_the_int4_variant() -> None:
    (d,) = parse_models(
        _doc(
            dtypes=["bf16", "int4", "int8"],
            checkpoints={
                "int4": {"path": "TheBloke/Llama-2-7B-GPTQ", "quantization": "gptq"},
                "w8a8": {"path": "org/llama-2-7b-w8a8", "quantization": "compressed-tensors"},
            },
        )
    )
    assert d.dtypes == ("bf16", "int4-gptq", "int8")
    assert d.checkpoints == (
        Checkpoint("int4-gptq", "TheBloke/Llama-2-7B-GPTQ", "gptq"),
        Checkpoint("int8", "org/llama-2-7b-w8a8", "compressed-tensors"),
    )
    assert checkpoint_for("int4-gptq", d.weights or "", d.checkpoints) == d.checkpoints[0]


def test_files_that_name_no_checkpoint_plan_what_they_planned_before() -> None:
    """(the simulator's scenarios name none: their plans must not change)"""
    assert servable(("bf16", "fp8"), "w", ()) == (("bf16", "fp8"), ())
    assert servable(("fp16", "fp32"), "w", ()) == (("fp16", "fp32"), ())
    for path in example_path("models/llama-7b.yaml").parent.glob("*.yaml"):
        for d in parse_models(yaml.safe_load(path.read_text()), str(path)):
            assert d.weights and d.dtypes_without_checkpoint == (), path


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (
            {"checkpoints": {"int4": {"path": "TheBloke/Llama-2-7B-AWQ"}}},
            "m.yaml: models[0].checkpoints.int4: a checkpoint for int4 needs its quantization "
            "method (one of awq, awq_marlin, gptq, gptq_marlin, compressed-tensors)",
        ),
        (
            {"checkpoints": {"int8": {"path": "x/y", "quantization": "smoothquant"}}},
            "m.yaml: models[0].checkpoints.int8: unknown int8 quantization method "
            "'smoothquant'; use one of compressed-tensors",
        ),
        (
            {"checkpoints": {"bf16": {"path": "x/y", "quantization": "awq"}}},
            "m.yaml: models[0].checkpoints.bf16: bf16 weights are not quantized: drop "
            "`quantization: awq`",
        ),
        (
            {"dtypes": ["int8"]},
            "m.yaml: models[0].dtypes: no checkpoint serves int8; name one under "
            "`checkpoints:` (e.g. int8: {path: REPO, quantization: METHOD}) or accept bf16",
        ),
        (
            {"checkpoints": {"int4": "TheBloke/Llama-2-7B-AWQ"}},
            "m.yaml: models[0].checkpoints.int4: expected {path: REPO_OR_PATH, "
            "quantization: METHOD}",
        ),
        (
            {"weights": ""},
            "m.yaml: models[0].weights: expected a Hugging Face repo id or a local path",
        ),
    ],
)
def test_a_checkpoint_that_cannot_be_launched_is_one_line(
    extra: dict[str, Any], error: str
) -> None:
    assert _errors(_doc(**extra)) == [error]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


_MODEL = """models:
  - name: llama-7b
    model: llama-2-7b
    demand: {request_rate_per_s: 2, input_tokens: 512, output_tokens: 128}
    slo: {ttft_p99_ms: 2000, tpot_p99_ms: 80}
"""


def test_flexpipe_plan_says_which_precisions_it_left_out(tmp_path: Path) -> None:
    models = _write(tmp_path, _MODEL + "    dtypes: [bf16, int4]\n")
    store = ["--store", f"sqlite:///{tmp_path / 'fp.db'}"]
    result = runner.invoke(app, ["plan", "--models", str(models), *store])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == (
        "llama-7b: int4-awq not planned: no checkpoint (name one under `checkpoints:` in the "
        "models file, with its quantization method)"
    )


def test_flexpipe_plan_with_an_unlaunchable_checkpoint_is_one_line(tmp_path: Path) -> None:
    models = _write(tmp_path, _MODEL + "    checkpoints: {int4: {path: a/b, quantization: q9}}\n")
    store = ["--store", f"sqlite:///{tmp_path / 'fp.db'}"]
    result = runner.invoke(app, ["plan", "--models", str(models), *store])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [
        f"error: {models}: models[0].checkpoints.int4: unknown int4 quantization method 'q9'; "
        "use one of awq, awq_marlin, gptq, gptq_marlin, compressed-tensors"
    ]
