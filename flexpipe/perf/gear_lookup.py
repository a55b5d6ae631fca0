"""The one lookup from the gear table to a prediction: what `flexpipe gears show`, `plan` and
`up` all print and what the planner decides on.

`GearLookup.estimate(query, workload)` answers "how does this gear run at this concurrency on
this hardware, for requests of this shape?" and says on what the answer rests (`basis`):

1. `measured`: a point of the gear's curve at exactly that batch size and request shape;
2. `interpolated`: between two measured batch sizes of that shape, every figure linear in
   the batch size;
3. `calibrated`: otherwise, if the gear has a curve on this hardware: the performance model's
   steady state scaled by measured / modelled TTFT and TPOT at the nearest measured batch size
   (of the same request shape if measured, else of the nearest shape), throughputs derived
   from the scaled times;
4. `predicted`: no curve: the performance model's steady state, the prior.

A curve matches on model, gear family (tp, pp, dtype, KV dtype: the gear's own max_num_seqs
does not matter, the concurrency asked is the batch size looked up), GPU types in placement
order and the class of the slowest link. Figures are p99 where measured (the SLOs are p99s).
Whether the gear fits in memory is not the lookup's question: the planner checks the memory
plan on the GPUs as they are now.

`GearLookup.actuation(query)` answers "how long does this gear take to come up?": its cold
start and its wake-ups from sleep level 1 (weights from host RAM) and level 2 (weights from
storage), each as measured by gear_bench where the gear table has it (the median of the
gear's points on this hardware), else the performance model's (`PerfModel.cold_start_s`,
`wake_s`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal

from flexpipe.gears.gear import NO_LINK, Gear, GpuSlot, Placement, Stage, whole_gpu_placement
from flexpipe.gears.point import GearKey, GearPoint
from flexpipe.gears.table import GearTable
from flexpipe.hardware import LinkSpec, gpu_spec
from flexpipe.model_spec import ModelSpec
from flexpipe.perf import Efficiency, PerfModel
from flexpipe.perf.steady_state import SteadyState, Workload, steady_state

__all__ = ["Actuation", "Basis", "GearEstimate", "GearLookup", "GearQuery"]

Basis = Literal["measured", "interpolated", "calibrated", "predicted"]


@dataclass(frozen=True, slots=True)
class GearEstimate(SteadyState):
    """A gear's figures at one concurrency, and on what they rest."""

    basis: Basis
    detail: str  # "gear table: vllm 0.6.3, 2026-11-02, 200 req" / "performance model prior"

    @classmethod
    def of(cls, figures: SteadyState, basis: Basis, detail: str) -> GearEstimate:
        values = {f.name: getattr(figures, f.name) for f in fields(SteadyState)}
        return cls(**values, basis=basis, detail=detail)

    @property
    def is_measured(self) -> bool:
        return self.basis in ("measured", "interpolated")


@dataclass(frozen=True, slots=True)
class GearQuery:
    """A gear at a concurrency on a kind of hardware: what the lookup is asked. Free memory is
    not part of it (speed does not depend on it), so one answer serves every GPU of a type."""

    model: ModelSpec
    gear: Gear  # gear.max_num_seqs is the concurrency (batch) asked about
    stage_gpu_types: tuple[tuple[str, ...], ...]  # per stage, its GPUs' catalog types
    tp_links: tuple[LinkSpec | None, ...]  # per stage; None when tp == 1
    pp_links: tuple[LinkSpec, ...]  # between consecutive stages
    layers_per_stage: tuple[int, ...]

    @property
    def batch(self) -> int:
        return self.gear.max_num_seqs

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(t for stage in self.stage_gpu_types for t in stage)

    @property
    def key(self) -> GearKey:
        """The gear table key of this gear on this hardware (the slowest link's class)."""
        links = [lk for lk in self.tp_links if lk is not None] + list(self.pp_links)
        link = min(links, key=lambda lk: lk.bandwidth_bytes_per_s).name if links else NO_LINK
        return GearKey(self.model.name, self.gear.key(), "+".join(self.gpu_types), link)

    def at_batch(self, batch: int) -> GearQuery:
        return replace(self, gear=replace(self.gear, max_num_seqs=batch))

    @classmethod
    def of(cls, model: ModelSpec, gear: Gear, placement: Placement) -> GearQuery:
        return cls(
            model=model,
            gear=gear,
            stage_gpu_types=tuple(tuple(g.spec.name for g in s.gpus) for s in placement.stages),
            tp_links=tuple(s.tp_link for s in placement.stages),
            pp_links=placement.pp_links,
            layers_per_stage=tuple(s.num_layers for s in placement.stages),
        )

    @classmethod
    def on_whole_gpus(
        cls, model: ModelSpec, gear: Gear, gpu_types: Sequence[str], link: str
    ) -> GearQuery:
        """Whole GPUs of `gpu_types` joined by the catalog link `link`, layers split evenly
        (flexpipe.gears.gear.whole_gpu_placement)."""
        return cls.of(model, gear, whole_gpu_placement(gear, gpu_types, link, model.num_layers))

    def placement(self) -> Placement:
        """The query's hardware as whole GPUs: timing does not depend on free memory."""
        stages = tuple(
            Stage(
                tuple(GpuSlot.whole(t, f"s{i}g{j}") for j, t in enumerate(types)),
                self.tp_links[i],
                self.layers_per_stage[i],
            )
            for i, types in enumerate(self.stage_gpu_types)
        )
        return Placement(stages, self.pp_links)


def _provenance(p: GearPoint) -> str:
    return (
        f"gear table: {p.engine} {p.engine_version}, {p.measured_at:%Y-%m-%d}, {p.num_requests} req"
    )


def _p99(p: GearPoint) -> SteadyState:
    """A measured point's figures as the planner compares them with its SLOs: p99 latencies."""
    return SteadyState(
        batch=p.batch_size,
        output_tokens_per_s=p.decode_tokens_per_s,
        requests_per_s=p.requests_per_s,
        ttft_s=p.ttft_p99_s,
        tpot_s=p.tpot_p99_s,
        e2e_s=p.e2e_p99_s,
    )


def _interpolated(lo: GearPoint, hi: GearPoint, batch: int) -> GearEstimate:
    t = (batch - lo.batch_size) / (hi.batch_size - lo.batch_size)
    a, b = _p99(lo), _p99(hi)
    values = {f.name: (1 - t) * getattr(a, f.name) + t * getattr(b, f.name) for f in fields(a)}
    detail = f"between measured batch {lo.batch_size} and {hi.batch_size} ({_provenance(lo)})"
    return GearEstimate.of(replace(SteadyState(**values), batch=batch), "interpolated", detail)


@dataclass(frozen=True, slots=True)
class Actuation:
    """How long a gear takes to serve: from nothing (cold start), or woken from each sleep
    level; each figure's basis ("measured" by gear_bench, or "predicted")."""

    cold_start_s: float
    wake_level1_s: float
    wake_level2_s: float
    basis: tuple[Basis, Basis, Basis]  # per figure, in that order


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class GearLookup:
    """The gear table over the performance-model prior: the planner's `GearPerformance`.

    Pure once built. Caches by (query, workload): a planner asks about the same few hardware
    shapes thousands of times on a large cluster."""

    def __init__(self, points: Iterable[GearPoint] = (), efficiency: Efficiency | None = None):
        self.table = GearTable(points)
        self.efficiency = efficiency
        # (query, workload) -> estimate
        self._cache: dict[tuple[GearQuery, Workload], GearEstimate] = {}
        # query at batch 1 -> its performance model (timing does not depend on the batch cap,
        # so one model serves the whole batch ladder of a placement)
        self._models: dict[GearQuery, PerfModel] = {}

    def estimate(self, query: GearQuery, workload: Workload) -> GearEstimate:
        """Raises flexpipe.perf.InfeasibleGear when the performance model is needed and says
        the gear cannot run on that hardware (a precision the chip lacks)."""
        cached = self._cache.get((query, workload))
        if cached is None:
            cached = self._cache[(query, workload)] = self._estimate(query, workload)
        return cached

    def prior(self, query: GearQuery, workload: Workload) -> SteadyState:
        """The performance model's steady state (timing only: memory is the planner's check
        on the real GPUs)."""
        return steady_state(self._model(query), query.batch, workload)

    def actuation(self, query: GearQuery) -> Actuation:
        """Cold start and wake-ups of `query`'s gear on its hardware (module docstring)."""
        pm = self._model(query)
        modelled = (pm.cold_start_s(), pm.wake_s(1), pm.wake_s(2))
        points = self.table.points(query.key)
        out: list[float] = []
        basis: list[Basis] = []
        for name, prior in zip(
            ("cold_start_s", "wake_level1_s", "wake_level2_s"), modelled, strict=True
        ):
            measured = [v for p in points if (v := getattr(p, name)) is not None]
            out.append(_median(measured) if measured else prior)
            basis.append("measured" if measured else "predicted")
        return Actuation(out[0], out[1], out[2], (basis[0], basis[1], basis[2]))

    def _model(self, query: GearQuery) -> PerfModel:
        base = query.at_batch(1)
        pm = self._models.get(base)
        if pm is None:
            for t in query.gpu_types:
                gpu_spec(t)  # unknown types fail loudly here
            pm = PerfModel(base.model, base.gear, base.placement(), self.efficiency)
            self._models[base] = pm
        return pm

    def _estimate(self, query: GearQuery, workload: Workload) -> GearEstimate:
        shapes = self.table.curves(query.key)
        if not shapes:
            return GearEstimate.of(self.prior(query, workload), "predicted", _PRIOR)
        batch = query.batch
        shape = (workload.input_tokens, workload.output_tokens)
        curve = shapes.get(shape)
        if curve is not None:
            if batch in curve:
                p = curve[batch]
                return GearEstimate.of(_p99(p), "measured", _provenance(p))
            lower = [b for b in curve if b < batch]
            upper = [b for b in curve if b > batch]
            if lower and upper:
                return _interpolated(curve[max(lower)], curve[min(upper)], batch)
        else:
            shape = min(shapes, key=lambda s: abs(s[0] - shape[0]) + abs(s[1] - shape[1]))
            curve = shapes[shape]
        ref = curve[min(curve, key=lambda b: abs(b - batch))]
        ref_prior = self.prior(query.at_batch(ref.batch_size), Workload(*shape))
        prior = self.prior(query, workload)
        tpot_ratio = ref.tpot_p99_s / ref_prior.tpot_s if ref_prior.tpot_s else 1.0
        ttft_ratio = ref.ttft_p99_s / ref_prior.ttft_s if ref_prior.ttft_s else 1.0
        figures = SteadyState.from_times(
            batch, prior.ttft_s * ttft_ratio, prior.tpot_s * tpot_ratio, workload.output_tokens
        )
        return GearEstimate.of(
            figures,
            "calibrated",
            f"performance model calibrated to the measurement at batch {ref.batch_size}, "
            f"{ref.input_len}/{ref.output_len} tokens (TPOT x{tpot_ratio:.2f}, "
            f"TTFT x{ttft_ratio:.2f}; {_provenance(ref)})",
        )


_PRIOR = "performance model prior (no measurement of this gear on this hardware)"
