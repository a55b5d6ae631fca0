"""Gears, the types layer: one way to run a model (`gear`), its measured or predicted curves
(`point`, `table`) and their CSV/JSON exchange (`io`).

Everything here sits below the performance model (flexpipe.perf imports the gear from here).
The one lookup from the table to a prediction, which uses the performance model as its prior,
is `flexpipe.perf.gear_lookup`; gear_bench, which launches engines to measure the curves, is
`flexpipe.launch.gear_bench`.
"""

from flexpipe.gears.gear import (
    NO_LINK,
    Gear,
    GearError,
    GpuSlot,
    Placement,
    Stage,
    even_layer_split,
    parse_gear,
    uniform_placement,
    whole_gpu_placement,
)
from flexpipe.gears.io import GearTableFormatError, export_points, import_points
from flexpipe.gears.point import MEASURED, PREDICTED, GearKey, GearPoint
from flexpipe.gears.table import GearTable

__all__ = [
    "MEASURED",
    "NO_LINK",
    "PREDICTED",
    "Gear",
    "GearError",
    "GearKey",
    "GearPoint",
    "GearTable",
    "GearTableFormatError",
    "GpuSlot",
    "Placement",
    "Stage",
    "even_layer_split",
    "export_points",
    "import_points",
    "parse_gear",
    "uniform_placement",
    "whole_gpu_placement",
]
