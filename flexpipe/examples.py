"""The built-in examples, shipped in the package (flexpipe/data/examples/; the repository's
examples/ is a link to that folder): the seed's fragmented 4-GPU cluster, the models files and
an example gateway config. `flexpipe up`, `plan` and `controller` default to them, so a wheel
installed anywhere runs without a checkout."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["DEFAULT_CLUSTER", "DEFAULT_MODELS", "DEFAULT_SHIFT", "example_path"]


def example_path(relative: str) -> Path:
    """The file `relative` (e.g. "clusters/fragmented-4gpu.yaml") of the built-in examples,
    as a path on disk (processes it starts are given the path)."""
    resource = files("flexpipe").joinpath("data", "examples", *relative.split("/"))
    path = Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(f"built-in example {relative!r} is missing from {path.parent}")
    return path


DEFAULT_CLUSTER = example_path("clusters/fragmented-4gpu.yaml")
DEFAULT_MODELS = example_path("models/llama-7b.yaml")
# The live shift profile (fast up, slow down): what `flexpipe up` and `flexpipe controller` run
# without --shift-config. The policy's code defaults stay the simulator's.
DEFAULT_SHIFT = example_path("shift/live.yaml")
