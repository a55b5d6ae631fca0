"""The built-in examples ship in the package (a wheel installed anywhere runs `flexpipe up`);
the repository's examples/ is the same folder, not a copy."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

import flexpipe
from flexpipe.cli import app
from flexpipe.cluster import load_cluster
from flexpipe.control.engines.launching import load_models
from flexpipe.examples import DEFAULT_CLUSTER, DEFAULT_MODELS, example_path
from flexpipe.gateway.config import load_config, validate

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_package_data() -> None:
    package = Path(flexpipe.__file__).parent / "data" / "examples"
    assert package / "clusters" / "fragmented-4gpu.yaml" == DEFAULT_CLUSTER
    assert package / "models" / "llama-7b.yaml" == DEFAULT_MODELS
    assert load_cluster(DEFAULT_CLUSTER).name == "fragmented-4gpu"
    assert [d.name for d in load_models(DEFAULT_MODELS)] == ["llama-7b"]


def test_repository_examples_are_the_package_folder() -> None:
    assert (ROOT / "examples").resolve() == (Path(flexpipe.__file__).parent / "data" / "examples")


def test_example_gateway_config_is_valid() -> None:
    cfg = load_config(example_path("gateway.yaml"))
    validate(cfg)
    assert cfg.policy == "prefix_affinity" and cfg.backends == []


def test_a_missing_example_is_one_clear_error() -> None:
    try:
        example_path("clusters/nope.yaml")
    except FileNotFoundError as exc:
        assert "built-in example 'clusters/nope.yaml' is missing" in str(exc)
    else:
        raise AssertionError("no error")


def test_version() -> None:
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output == f"flexpipe {flexpipe.__version__}\n"
