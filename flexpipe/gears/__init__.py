"""Gears: one way to run a model (`gear`), its measured or predicted curves (`point`,
`table`), CSV/JSON exchange (`io`), the one lookup from the table to a prediction (`lookup`)
and gear_bench, which measures the curves (`bench`).

This package exports only what sits below the performance model (the gear, its points and
table, their exchange): flexpipe.perf imports the gear from here. Import the lookup and the bench
from their modules.
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
