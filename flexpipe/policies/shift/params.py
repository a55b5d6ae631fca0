"""Every number of the shift policy in one frozen dataclass, readable from YAML.

docs/shift-policy.md lists them with their defaults (a test checks that its YAML is them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flexpipe.policies.shift.forecast import ForecastParams
from flexpipe.policies.shift.in_place import IN_PLACE_MODES
from flexpipe.policies.shift.pricing import PricingParams
from flexpipe.policies.shift.signals import Thresholds
from flexpipe.policies.shift.standby_sleepers import StandbyParams
from flexpipe.policies.shift.triggers import TriggerParams

__all__ = ["SLEEP_MODES", "ShiftParams"]

# what a leaving instance does where the engine kind can sleep (control/core/sleeping.py):
# off: it stops; level1: it sleeps where its node's host RAM holds its weights, else stops;
# auto: level 1 where the RAM holds them, else level 2
SLEEP_MODES = ("off", "level1", "auto")


@dataclass(frozen=True, slots=True)
class ShiftParams:
    """Every number of the shift policy (docs/shift-policy.md has them as YAML)."""

    triggers: TriggerParams = field(default_factory=TriggerParams)
    pricing: PricingParams = field(default_factory=PricingParams)
    # The expected load a shift is priced at (forecast.py); computed by the caller (the
    # controller's and the simulator's `RateWindow`) into `ModelState`, not by the policy.
    forecast: ForecastParams = field(default_factory=ForecastParams)
    # A model woken from zero instances is planned for at least this rate.
    wake_request_rate_per_s: float = 0.1
    # sleep instead of stop (SLEEP_MODES). The live controller's default; the simulator's
    # scenarios default to off (flexpipe/sim/scenario.py) unless they turn it on.
    sleep_mode: str = "auto"
    # standby engines asleep ahead of demand (standby_sleepers.py); off by default
    standby: StandbyParams = field(default_factory=StandbyParams)

    def __post_init__(self) -> None:
        if self.sleep_mode not in SLEEP_MODES:
            raise ValueError(
                f"sleep_mode must be one of {', '.join(SLEEP_MODES)}, got {self.sleep_mode!r}"
            )

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any]) -> ShiftParams:
        """From a parsed `shift:` section; an unknown key is an error naming it."""

        def build(kind: type[Any], values: Mapping[str, Any], place: str) -> Any:
            if not isinstance(values, Mapping):
                raise ValueError(f"{place}: expected a mapping")
            fields = {f.name: f for f in dataclasses.fields(kind)}
            unknown = sorted(set(values) - set(fields))
            if unknown:
                raise ValueError(
                    f"{place}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}"
                )
            nested = {
                "triggers": TriggerParams,
                "pricing": PricingParams,
                "thresholds": Thresholds,
                "forecast": ForecastParams,
                "standby": StandbyParams,
            }
            kwargs = {
                k: build(nested[k], v, f"{place}.{k}") if k in nested else v
                for k, v in values.items()
            }
            for k, v in kwargs.items():
                if kind is ShiftParams and k == "sleep_mode":
                    if not isinstance(v, str):
                        raise ValueError(f"{place}.{k}: expected one of {', '.join(SLEEP_MODES)}")
                    continue
                if kind is PricingParams and k == "in_place":
                    if not isinstance(v, str):
                        modes = ", ".join(IN_PLACE_MODES)
                        raise ValueError(f"{place}.{k}: expected one of {modes}")
                    continue
                if k not in nested and fields[k].type in (bool, "bool"):  # a switch
                    if not isinstance(v, bool):
                        raise ValueError(f"{place}.{k}: expected true or false, got {v!r}")
                    continue
                if k not in nested and (isinstance(v, bool) or not isinstance(v, int | float)):
                    raise ValueError(f"{place}.{k}: expected a number, got {v!r}")
                if k not in nested and not math.isfinite(v):
                    raise ValueError(f"{place}.{k}: expected a finite number, got {v!r}")
            try:
                return kind(**kwargs)
            except ValueError as exc:
                raise ValueError(f"{place}: {exc}") from None

        params: ShiftParams = build(cls, doc, "shift")
        return params
