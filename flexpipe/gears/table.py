"""Gear table lookup: measured curves first, the performance model where there are none.

`GearTable.lookup(...)` answers "how does this gear run at this batch size on these GPUs?":

- a measured point at exactly that batch size: `basis="measured"`;
- between two measured batch sizes: linear interpolation of every figure, `"interpolated"`;
- outside the measured range: the performance model's prediction scaled by measured /
  predicted at the nearest measured point, `"calibrated"` (measurements correct the model);
- no measurement at all: the performance model's prediction, `"predicted"`, and the note
  says so.

The predictions compose the one performance model (flexpipe.perf) with the workload shape
(`predict_point`); they never re-derive timing.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime

from flexpipe.gears.gear import Gear, GpuSlot, Placement, uniform_placement
from flexpipe.gears.point import NO_LINK, PREDICTED, GearKey, GearPoint
from flexpipe.hardware import link_spec
from flexpipe.model_spec import ModelSpec, load_model_spec
from flexpipe.perf import Efficiency, InfeasibleGear, PerfModel
from flexpipe.policies.planner.performance import Workload, steady_state

DEFAULT_INPUT_LEN = 512
DEFAULT_OUTPUT_LEN = 128
PERF_MODEL_ENGINE = "perf-model"
PERF_MODEL_VERSION = "1"

# Figures that interpolate/scale (everything numeric that describes the curve).
_CURVE_FIELDS = tuple(
    f.name
    for f in fields(GearPoint)
    if f.name.endswith(("_s", "_per_s")) or f.name in ("peak_kv_usage",)
)


@dataclass(frozen=True, slots=True)
class GearEstimate:
    """What the table says about one gear at one batch size, and on what it rests."""

    point: GearPoint
    basis: str  # "measured" | "interpolated" | "calibrated" | "predicted"
    note: str

    @property
    def is_measured(self) -> bool:
        return self.basis in ("measured", "interpolated")


def placement_key(model: str, gear: Gear, placement: Placement) -> GearKey:
    """The table key of a gear on a placement: GPU types in order, the slowest link class."""
    types = "+".join(g.spec.name for g in placement.gpus)
    links = [s.tp_link for s in placement.stages if s.tp_link is not None]
    links += list(placement.pp_links)
    link = NO_LINK if not links else min(links, key=lambda lk: lk.bandwidth_bytes_per_s).name
    return GearKey(model, gear.key(), types, link)


def uniform_gear_placement(
    model: ModelSpec, gear: Gear, gpu_types: Sequence[str], link: str
) -> Placement:
    """Whole GPUs of the given types (one per rank, or one type for all), joined by `link`."""
    types = list(gpu_types)
    if len(types) == 1:
        types = types * gear.num_gpus
    if len(types) != gear.num_gpus:
        raise InfeasibleGear(
            f"gear {gear.key()} needs {gear.num_gpus} GPUs; {len(types)} GPU types given"
        )
    slots = [GpuSlot.whole(t, f"gpu{i}") for i, t in enumerate(types)]
    lk = link_spec(link if link != NO_LINK else "nvlink3")
    return uniform_placement(slots, gear.tp, gear.pp, model.num_layers, lk, lk)


def max_batch_that_fits(pm: PerfModel, input_len: int, output_len: int) -> int:
    """Largest concurrency whose KV fits with every sequence at full length, capped by the
    gear's max_num_seqs (the top of gear_bench's default sweep)."""
    return min(pm.gear.max_num_seqs, pm.memory.max_batch(input_len + output_len))


def predict_point(
    pm: PerfModel,
    batch_size: int,
    input_len: int = DEFAULT_INPUT_LEN,
    output_len: int = DEFAULT_OUTPUT_LEN,
    key: GearKey | None = None,
) -> GearPoint:
    """The performance model's view of `batch_size` sequences in flight with `input_len`-token
    prompts and `output_len`-token outputs (gear_bench's workload): the planner's steady state
    (flexpipe.policies.planner.steady_state, the one derivation). Percentiles are equal: the
    model has no noise."""
    pm.require_feasible()
    b = batch_size
    est = steady_state(pm, b, Workload(input_len, output_len))
    ttft, tpot, e2e = est.ttft_s, est.tpot_s, est.e2e_s
    capacity = pm.memory.kv_capacity_tokens
    peak_kv = min(1.0, b * (input_len + output_len) / capacity) if capacity else None
    k = key or placement_key(pm.model.name, pm.gear, pm.placement)
    return GearPoint(
        model=k.model,
        gear_key=k.gear_key,
        gear=str(pm.gear),
        gpu_types=k.gpu_types,
        link=k.link,
        batch_size=b,
        prefill_tokens_per_s=input_len / ttft,
        decode_tokens_per_s=est.output_tokens_per_s,
        requests_per_s=est.requests_per_s,
        ttft_p50_s=ttft,
        ttft_p90_s=ttft,
        ttft_p99_s=ttft,
        tpot_p50_s=tpot,
        tpot_p90_s=tpot,
        tpot_p99_s=tpot,
        e2e_p50_s=e2e,
        e2e_p90_s=e2e,
        e2e_p99_s=e2e,
        peak_kv_usage=peak_kv,
        cold_start_s=pm.cold_start_s(),
        source=PREDICTED,
        engine=PERF_MODEL_ENGINE,
        engine_version=PERF_MODEL_VERSION,
        input_len=input_len,
        output_len=output_len,
        num_requests=0,
        measured_at=datetime(1970, 1, 1, tzinfo=UTC),
        note="performance-model prediction",
    )


def _mix(a: GearPoint, b: GearPoint, batch_size: int) -> GearPoint:
    """Linear interpolation between two points of one curve."""
    t = (batch_size - a.batch_size) / (b.batch_size - a.batch_size)
    values: dict[str, float | None] = {}
    for name in _CURVE_FIELDS:
        va, vb = getattr(a, name), getattr(b, name)
        values[name] = None if va is None or vb is None else va + t * (vb - va)
    return replace(a, batch_size=batch_size, **values)  # type: ignore[arg-type]


def _scaled(pred: GearPoint, pred_ref: GearPoint, measured_ref: GearPoint) -> GearPoint:
    """The prediction corrected by measured / predicted at a reference batch size."""
    values: dict[str, float | None] = {}
    for name in _CURVE_FIELDS:
        p, pr, m = getattr(pred, name), getattr(pred_ref, name), getattr(measured_ref, name)
        values[name] = None if p is None or pr is None or m is None or pr == 0 else p * m / pr
    return replace(
        measured_ref,
        batch_size=pred.batch_size,
        **values,  # type: ignore[arg-type]
    )


class GearTable:
    """Curves by key, plus the performance model for everything not measured. Pure: build it
    from points (`Store.points()`), then look up."""

    def __init__(self, points: Iterable[GearPoint] = (), efficiency: Efficiency | None = None):
        self.efficiency = efficiency
        self._curves: dict[GearKey, list[GearPoint]] = {}
        for p in points:
            self._curves.setdefault(p.key, []).append(p)
        for curve in self._curves.values():
            curve.sort(key=lambda p: p.batch_size)

    @property
    def keys(self) -> list[GearKey]:
        return sorted(self._curves, key=str)

    def curve(self, key: GearKey) -> list[GearPoint]:
        return list(self._curves.get(key, ()))

    def lookup(
        self,
        model: str | ModelSpec,
        gear: Gear,
        batch_size: int,
        gpu_types: Sequence[str] = ("A100-80G-SXM",),
        link: str = "nvlink3",
        placement: Placement | None = None,
        input_len: int = DEFAULT_INPUT_LEN,
        output_len: int = DEFAULT_OUTPUT_LEN,
    ) -> GearEstimate:
        """The gear at `batch_size` on `placement` (concrete GPUs, their free memory) or on
        whole GPUs of `gpu_types` joined by `link`. Raises InfeasibleGear when the gear has
        no measurement and the performance model says it does not fit."""
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        spec = load_model_spec(model) if isinstance(model, str) else model
        if placement is None:
            placement = uniform_gear_placement(spec, gear, gpu_types, link)
        key = placement_key(spec.name, gear, placement)
        curve = [
            p
            for p in self._curves.get(key, ())
            if p.input_len == input_len and p.output_len == output_len
        ]
        if curve:
            batches = [p.batch_size for p in curve]
            i = bisect.bisect_left(batches, batch_size)
            if i < len(curve) and batches[i] == batch_size:
                p = curve[i]
                return GearEstimate(p, p.source, f"{p.source} at batch {batch_size}")
            if 0 < i < len(curve):
                lo, hi = curve[i - 1], curve[i]
                return GearEstimate(
                    _mix(lo, hi, batch_size),
                    "interpolated",
                    f"interpolated between measured batch {lo.batch_size} and {hi.batch_size}",
                )
            ref = curve[0] if i == 0 else curve[-1]
            try:
                pm = self._perf_model(spec, gear, placement)
                pred = predict_point(pm, batch_size, input_len, output_len, key)
                pred_ref = predict_point(pm, ref.batch_size, input_len, output_len, key)
            except InfeasibleGear as exc:
                return GearEstimate(
                    replace(ref, batch_size=batch_size),
                    "calibrated",
                    f"nearest measured batch {ref.batch_size} used as is ({exc})",
                )
            return GearEstimate(
                _scaled(pred, pred_ref, ref),
                "calibrated",
                f"performance model scaled to the measurement at batch {ref.batch_size} "
                f"(outside measured batches {batches[0]}..{batches[-1]})",
            )
        pm = self._perf_model(spec, gear, placement)
        return GearEstimate(
            predict_point(pm, batch_size, input_len, output_len, key),
            "predicted",
            f"no measurement of {key}: performance-model prediction",
        )

    def _perf_model(self, spec: ModelSpec, gear: Gear, placement: Placement) -> PerfModel:
        pm = PerfModel(spec, gear, placement, self.efficiency)
        pm.require_feasible()
        return pm
