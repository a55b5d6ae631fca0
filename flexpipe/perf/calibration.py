"""Calibrated factor sets: what measurements say a GPU type and a link class achieve.

A `GpuCalibration` replaces the generic GEMM and memory-bound efficiencies of one GPU type
with curves over the number of tokens in the step (a GEMM at 1 token streams weights, at 4,096
it is compute-bound; the fraction of the roofline reached differs, and so does the fixed cost
of a kernel). A `LinkCalibration` gives one link class its achieved all-reduce (and
send/recv) bandwidth and per-step latency. A `Calibration` is a set of both with provenance;
GPU types and links it does not name keep the generic factors of `Efficiency`.

The built-in set is fitted (`flexpipe/perf/fit.py`) from public operator profiles shipped in
`flexpipe/perf/data/` and loaded once; `flexpipe calibrate` stores more in the gear store.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any


def _sig(value: float | None) -> float | None:
    """Six significant digits: what a measurement supports, and a stable JSON file."""
    return None if value is None else float(f"{value:.6g}")


@dataclass(frozen=True, slots=True)
class EfficiencyCurve:
    """Achieved fraction of a roofline, by tokens in the step; log-linear between knots,
    flat beyond the first and last (a knot is a measured bucket, never extrapolated)."""

    knots: tuple[tuple[int, float], ...]  # (num_tokens, efficiency), increasing num_tokens
    _log_tokens: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.knots:
            raise ValueError("an efficiency curve needs at least one knot")
        tokens = [t for t, _ in self.knots]
        if tokens != sorted(set(tokens)) or tokens[0] < 1:
            raise ValueError(f"curve knots must have increasing token counts >= 1, got {tokens}")
        for t, e in self.knots:
            if not 0 < e <= 1:
                raise ValueError(f"efficiency {e} at {t} tokens is out of (0, 1]")
        object.__setattr__(self, "_log_tokens", tuple(math.log2(t) for t in tokens))

    def at(self, num_tokens: float) -> float:
        xs = self._log_tokens
        x = math.log2(max(num_tokens, 1.0))
        if x <= xs[0]:
            return self.knots[0][1]
        if x >= xs[-1]:
            return self.knots[-1][1]
        j = bisect.bisect_right(xs, x)
        a = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
        return self.knots[j - 1][1] * (1 - a) + self.knots[j][1] * a

    def as_list(self) -> list[list[float]]:
        return [[t, round(e, 4)] for t, e in self.knots]

    @classmethod
    def from_list(cls, items: Iterable[Iterable[float]]) -> EfficiencyCurve:
        return cls(tuple((int(t), float(e)) for t, e in items))


@dataclass(frozen=True, slots=True)
class KernelFactors:
    """time = floor_s + time at datasheet peak / curve(tokens)."""

    curve: EfficiencyCurve
    floor_s: float

    def time_s(self, ideal_s: float, num_tokens: float) -> float:
        return self.floor_s + ideal_s / self.curve.at(num_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {"floor_s": _sig(self.floor_s), "efficiency": self.curve.as_list()}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> KernelFactors:
        return cls(EfficiencyCurve.from_list(doc["efficiency"]), float(doc["floor_s"]))


ANY_OP = "*"


@dataclass(frozen=True, slots=True)
class GpuCalibration:
    """A GPU type's measured GEMM and memory-bound behaviour.

    GEMM time (any shape)   = gemm.floor_s + max(bytes / HBM peak, FLOPs / tensor peak) / gemm(T)
    memory-bound op time    = floor_s + bytes / HBM peak / curve(T), with the op's own factors
    (a norm, RoPE and SiLU are different kernels with different fixed costs); `*` pools them
    and prices any op not listed.
    """

    gpu_type: str  # catalog name
    gemm: KernelFactors
    memory: tuple[tuple[str, KernelFactors], ...]  # (op, factors), one of them ANY_OP
    source: str  # where the measurements came from, one line

    def __post_init__(self) -> None:
        if ANY_OP not in dict(self.memory):
            raise ValueError(f"{self.gpu_type}: memory-bound factors need a pooled '*' entry")

    def memory_for(self, op: str) -> KernelFactors:
        table = dict(self.memory)
        return table.get(op) or table[ANY_OP]

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpu_type": self.gpu_type,
            "source": self.source,
            "gemm": self.gemm.as_dict(),
            "memory": {op: k.as_dict() for op, k in self.memory},
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> GpuCalibration:
        return cls(
            gpu_type=str(doc["gpu_type"]),
            gemm=KernelFactors.from_dict(doc["gemm"]),
            memory=tuple((str(op), KernelFactors.from_dict(k)) for op, k in doc["memory"].items()),
            source=str(doc["source"]),
        )


@dataclass(frozen=True, slots=True)
class LinkCalibration:
    """A link class's measured collectives: ring all-reduce of S bytes over t ranks takes
    2(t-1) x allreduce_latency_s + 2(t-1)/t x S / allreduce_bandwidth; a send takes
    p2p_latency_s + S / p2p_bandwidth (None: not measured, the generic model is kept)."""

    link: str  # catalog name
    allreduce_bandwidth_bytes_per_s: float
    allreduce_latency_s: float
    p2p_bandwidth_bytes_per_s: float | None
    p2p_latency_s: float | None
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "link": self.link,
            "allreduce_bandwidth_bytes_per_s": _sig(self.allreduce_bandwidth_bytes_per_s),
            "allreduce_latency_s": _sig(self.allreduce_latency_s),
            "p2p_bandwidth_bytes_per_s": _sig(self.p2p_bandwidth_bytes_per_s),
            "p2p_latency_s": _sig(self.p2p_latency_s),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> LinkCalibration:
        p2p_bw, p2p_lat = doc.get("p2p_bandwidth_bytes_per_s"), doc.get("p2p_latency_s")
        return cls(
            link=str(doc["link"]),
            allreduce_bandwidth_bytes_per_s=float(doc["allreduce_bandwidth_bytes_per_s"]),
            allreduce_latency_s=float(doc["allreduce_latency_s"]),
            p2p_bandwidth_bytes_per_s=None if p2p_bw is None else float(p2p_bw),
            p2p_latency_s=None if p2p_lat is None else float(p2p_lat),
            source=str(doc["source"]),
        )


def _key(name: str) -> str:
    return name.strip().lower()


@dataclass(frozen=True, slots=True)
class Calibration:
    """A set of calibrated GPU types and link classes (looked up case-insensitively)."""

    gpus: tuple[GpuCalibration, ...] = ()
    links: tuple[LinkCalibration, ...] = ()
    provenance: tuple[tuple[str, str], ...] = ()  # (key, value): source, commit, licence, ...

    def gpu(self, gpu_type: str) -> GpuCalibration | None:
        key = _key(gpu_type)
        return next((g for g in self.gpus if _key(g.gpu_type) == key), None)

    def link(self, link: str) -> LinkCalibration | None:
        key = _key(link)
        return next((lk for lk in self.links if _key(lk.link) == key), None)

    def merged(self, newer: Calibration) -> Calibration:
        """This set with `newer`'s GPU types and links replacing the same names."""
        new_gpus = {_key(g.gpu_type) for g in newer.gpus}
        new_links = {_key(lk.link) for lk in newer.links}
        return Calibration(
            gpus=tuple(g for g in self.gpus if _key(g.gpu_type) not in new_gpus) + newer.gpus,
            links=tuple(lk for lk in self.links if _key(lk.link) not in new_links) + newer.links,
            provenance=self.provenance + newer.provenance,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "provenance": dict(self.provenance),
            "gpus": [g.as_dict() for g in self.gpus],
            "links": [lk.as_dict() for lk in self.links],
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Calibration:
        return cls(
            gpus=tuple(GpuCalibration.from_dict(g) for g in doc.get("gpus", ())),
            links=tuple(LinkCalibration.from_dict(lk) for lk in doc.get("links", ())),
            provenance=tuple((str(k), str(v)) for k, v in doc.get("provenance", {}).items()),
        )

    def to_json(self) -> str:
        text = json.dumps(self.as_dict(), indent=1)
        # One knot per line: [tokens, efficiency].
        return re.sub(r"\[\s+([-\d.e+]+),\s+([-\d.e+]+)\s+\]", r"[\1, \2]", text) + "\n"


NO_CALIBRATION = Calibration()
BUILTIN_CALIBRATION_FILE = "calibration.json"


@cache
def builtin_calibration() -> Calibration:
    """The factor sets shipped with flexpipe (flexpipe/perf/data/calibration.json)."""
    text = resources.files("flexpipe.perf").joinpath("data", BUILTIN_CALIBRATION_FILE).read_text()
    return Calibration.from_dict(json.loads(text))
