"""The gear table: measured (or predicted) curves of each gear, lookup with interpolation and
a performance-model fallback, CSV/JSON exchange."""

from flexpipe.gears.io import GearTableFormatError, export_points, import_points
from flexpipe.gears.point import MEASURED, NO_LINK, PREDICTED, GearKey, GearPoint
from flexpipe.gears.table import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    GearEstimate,
    GearTable,
    max_batch_that_fits,
    placement_key,
    predict_point,
    uniform_gear_placement,
)

__all__ = [
    "DEFAULT_INPUT_LEN",
    "DEFAULT_OUTPUT_LEN",
    "MEASURED",
    "NO_LINK",
    "PREDICTED",
    "GearEstimate",
    "GearKey",
    "GearPoint",
    "GearTable",
    "GearTableFormatError",
    "export_points",
    "import_points",
    "max_batch_that_fits",
    "placement_key",
    "predict_point",
    "uniform_gear_placement",
]
