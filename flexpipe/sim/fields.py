"""Typed reading of a scenario file's values: each mistake is one line naming the field's
path (`workloads[0].arrivals.rate_per_s: expected a number, got 'abc'`).

Numbers are YAML numbers or strings that read as one (PyYAML reads `1e9` as a string); they
must be finite: a NaN or infinite duration, rate or interval would never end the run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from flexpipe.sim.workload import WorkloadError


class FieldError(ValueError):
    """A scenario value of the wrong type or out of range; one line naming its path."""


def shown(value: object) -> str:
    """How a bad value is quoted in a message."""
    if value is None:
        return "nothing"
    if isinstance(value, str | int | float):
        return repr(value)
    if isinstance(value, dict):
        return "a mapping"
    return "a list" if isinstance(value, list) else f"a {type(value).__name__}"


def mapping(value: object, place: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FieldError(f"{place}: expected a mapping, got {shown(value)}")
    return value


def check_keys(doc: dict[str, Any], known: list[str] | tuple[str, ...], place: str) -> None:
    unknown = sorted(str(k) for k in set(doc) - set(known))
    if unknown:
        raise FieldError(f"{place}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")


def number(
    value: object, place: str, *, min_value: float | None = None, above: float | None = None
) -> float:
    """A finite number, >= `min_value` and > `above` when given."""
    x: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        x = float(value)
    elif isinstance(value, str):
        try:
            x = float(value)
        except ValueError:
            x = None
    if x is None:
        raise FieldError(f"{place}: expected a number, got {shown(value)}")
    if not math.isfinite(x):
        raise FieldError(f"{place}: expected a finite number, got {value}")
    if min_value is not None and x < min_value:
        raise FieldError(f"{place}: must be >= {min_value:g} (got {x:g})")
    if above is not None and x <= above:
        raise FieldError(f"{place}: must be > {above:g} (got {x:g})")
    return x


def integer(value: object, place: str, *, min_value: int | None = None) -> int:
    """An integer (a whole float or a string of one is fine), >= `min_value` when given."""
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        try:
            n = int(value)
        except ValueError:
            n = None
    if n is None:
        raise FieldError(f"{place}: expected an integer, got {shown(value)}")
    if min_value is not None and n < min_value:
        raise FieldError(f"{place}: must be >= {min_value} (got {n})")
    return n


_READERS: dict[str, Callable[[object, str], Any]] = {"float": number, "int": integer}


def build(cls: Any, value: object, place: str) -> Any:
    """A workload dataclass (`LengthDist`, `Diurnal`, `SharedPrefix`) from a mapping: known
    keys only, each read by its field's type; the class's own checks name the field too."""
    doc = mapping(value, place)
    types = {f.name: str(f.type) for f in dataclasses.fields(cls) if f.init}
    check_keys(doc, tuple(types), place)
    kwargs: dict[str, Any] = {}
    for key, raw in doc.items():
        read = _READERS.get(types[key])
        kwargs[key] = read(raw, f"{place}.{key}") if read is not None else str(raw)
    try:
        return cls(**kwargs)
    except WorkloadError as exc:
        raise FieldError(f"{place}.{exc}") from None


def find_nan(value: object, place: str) -> str | None:
    """The path of the first NaN in a parsed YAML document (never a meaningful value in any
    section, the gateway's, the models' and the shift policy's included), or None."""
    if isinstance(value, float) and math.isnan(value):
        return place
    items: list[tuple[str, object]] = []
    if isinstance(value, dict):
        items = [(f"{place}.{k}" if place else str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(f"{place}[{i}]", v) for i, v in enumerate(value)]
    for where, v in items:
        found = find_nan(v, where)
        if found is not None:
            return found
    return None
