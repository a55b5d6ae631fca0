"""The gear table: measured (or predicted) points grouped into curves. Pure data: build it
from points (`Store.points()`, an imported file), then ask for a gear family's curves.
Turning them into a prediction is the lookup's job (flexpipe.perf.gear_lookup).
"""

from __future__ import annotations

from collections.abc import Iterable

from flexpipe.gears.point import GearKey, GearPoint

Shape = tuple[int, int]  # a request shape: (input_len, output_len)


class GearTable:
    """Points by gear family (GearKey.family) and request shape, the newest point per batch
    size: a curve over concurrency."""

    def __init__(self, points: Iterable[GearPoint] = ()) -> None:
        # family -> {shape: {batch_size: newest point}}
        self._families: dict[tuple[str, str, str, str], dict[Shape, dict[int, GearPoint]]] = {}
        for p in points:
            by_shape = self._families.setdefault(p.key.family, {})
            curve = by_shape.setdefault((p.input_len, p.output_len), {})
            old = curve.get(p.batch_size)
            if old is None or p.measured_at > old.measured_at:
                curve[p.batch_size] = p

    def curves(self, key: GearKey) -> dict[Shape, dict[int, GearPoint]]:
        """The curves of `key`'s family, one per request shape measured (empty: none)."""
        return {shape: dict(c) for shape, c in self._families.get(key.family, {}).items()}

    def points(self, key: GearKey) -> list[GearPoint]:
        """Every point of `key`'s family, by shape then batch size."""
        shapes = self._families.get(key.family, {})
        return [shapes[s][b] for s in sorted(shapes) for b in sorted(shapes[s])]
