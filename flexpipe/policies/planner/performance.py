"""What the planner asks about speed: the `GearPerformance` protocol, and its default
implementation backed by the performance model (the prior the gear table refines).

The key is what a gear table row is keyed by: the model, the gear (with `max_num_seqs` = the
concurrency), the GPU types of each stage, the link classes inside and between stages, and the
layer split. Free memory is not part of it: whether a gear fits the GPUs as they are *now*
comes from the performance model's memory plan, always (the planner calls it itself).

The estimate is a steady state at full concurrency `b` (continuous batching, every slot busy):
per output step the engine decodes `b` sequences (`decode_interval_s`), and prompts arrive at
the rate sequences finish, so each step also carries `b / output_tokens` prompts of prefill.
With `d` the decode interval and `P` the prefill time of one prompt on the slowest stage:

    tpot_s        = d + b * P / output_tokens          (time between two tokens of a sequence)
    requests_per_s = b / (output_tokens * tpot_s)       (Little's law: b in flight)
    ttft_s        = prefill_s(input) + tpot_s           (its own prefill + the step it joins)

TPOT here is a per-request mean; with outputs of ~100+ tokens the p99 over requests is close to
it, so the planner compares it with the TPOT p99 SLO. Queueing delay is kept bounded by loading
instances to `target_utilization` only (planner config).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Protocol

from flexpipe.gears.gear import Gear, GpuSlot, Placement, Stage
from flexpipe.hardware import LinkSpec, gpu_spec
from flexpipe.model_spec import ModelSpec
from flexpipe.perf import BatchShape, Efficiency, PerfModel

__all__ = [
    "GearEstimate",
    "GearKey",
    "GearPerformance",
    "PerfModelPerformance",
    "Workload",
]

Source = Literal["measured", "predicted"]


@dataclass(frozen=True, slots=True)
class GearKey:
    """A gear on a kind of hardware: what a gear table row is keyed by."""

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
    def link_classes(self) -> tuple[str, ...]:
        """Link names a table matches on (measured bandwidth is in the LinkSpec)."""
        inner = tuple(lk.name for lk in self.tp_links if lk is not None)
        return inner + tuple(lk.name for lk in self.pp_links)

    @classmethod
    def of(cls, model: ModelSpec, gear: Gear, placement: Placement) -> GearKey:
        return cls(
            model=model,
            gear=gear,
            stage_gpu_types=tuple(tuple(g.spec.name for g in s.gpus) for s in placement.stages),
            tp_links=tuple(s.tp_link for s in placement.stages),
            pp_links=placement.pp_links,
            layers_per_stage=tuple(s.num_layers for s in placement.stages),
        )


@dataclass(frozen=True, slots=True)
class Workload:
    """The request shape the estimate is for (means of the demand's distribution)."""

    input_tokens: int
    output_tokens: int

    @property
    def mean_context_tokens(self) -> int:
        """Average context of a decoding sequence: the prompt plus half its output."""
        return self.input_tokens + self.output_tokens // 2


@dataclass(frozen=True, slots=True)
class GearEstimate:
    batch: int  # concurrency (sequences in flight)
    output_tokens_per_s: float  # decode throughput at this concurrency
    requests_per_s: float
    ttft_s: float  # compared with the TTFT p99 SLO
    tpot_s: float  # compared with the TPOT p99 SLO
    e2e_s: float  # ttft + output x tpot
    source: Source
    detail: str  # "performance model prior" / "gear table: vllm 0.6.3, 2026-11-02, 200 req"

    @classmethod
    def from_times(
        cls,
        batch: int,
        ttft_s: float,
        tpot_s: float,
        output_tokens: int,
        source: Source,
        detail: str,
    ) -> GearEstimate:
        """Throughputs and e2e derived from TTFT and TPOT at concurrency `batch`."""
        out = max(1, output_tokens)
        return cls(
            batch=batch,
            output_tokens_per_s=batch / tpot_s,
            requests_per_s=batch / (out * tpot_s),
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            e2e_s=ttft_s + out * tpot_s,
            source=source,
            detail=detail,
        )


class GearPerformance(Protocol):
    """Speed of a gear at a concurrency. Implementations: the performance-model prior below;
    the gear table (measured rows, interpolated between batch sizes, falling back to a prior
    for rows it lacks and saying so in `source`)."""

    def estimate(self, key: GearKey, workload: Workload) -> GearEstimate:
        """Raise flexpipe.perf.InfeasibleGear when the gear cannot run on that hardware."""
        ...


def _whole_gpu_placement(key: GearKey) -> Placement:
    """The key's hardware as whole GPUs: timing does not depend on free memory."""
    stages = tuple(
        Stage(
            tuple(GpuSlot.whole(t, f"s{i}g{j}") for j, t in enumerate(types)),
            key.tp_links[i],
            key.layers_per_stage[i],
        )
        for i, types in enumerate(key.stage_gpu_types)
    )
    return Placement(stages, key.pp_links)


class PerfModelPerformance:
    """`GearPerformance` from flexpipe.perf (source "predicted"). Caches by key: a planner
    asks about the same few hardware shapes thousands of times on a large cluster."""

    def __init__(self, efficiency: Efficiency | None = None) -> None:
        self.efficiency = efficiency
        # (key, workload) -> estimate
        self._cache: dict[tuple[GearKey, Workload], GearEstimate] = {}
        # key at batch 1 -> its performance model (timing does not depend on the batch cap,
        # so one model serves the whole batch ladder of a placement)
        self._models: dict[GearKey, PerfModel] = {}

    def estimate(self, key: GearKey, workload: Workload) -> GearEstimate:
        cached = self._cache.get((key, workload))
        if cached is not None:
            return cached
        base = replace(key, gear=with_batch(key.gear, 1))
        pm = self._models.get(base)
        if pm is None:
            for types in key.stage_gpu_types:
                for t in types:
                    gpu_spec(t)  # unknown types fail loudly here
            pm = PerfModel(base.model, base.gear, _whole_gpu_placement(base), self.efficiency)
            self._models[base] = pm
        # Timing only: memory is the planner's check on the real GPUs. A precision the chip
        # lacks raises InfeasibleGear from the step-time calls.
        estimate = steady_state(pm, key.batch, workload)
        self._cache[(key, workload)] = estimate
        return estimate


def steady_state(
    pm: PerfModel, batch: int, workload: Workload, source: Source = "predicted"
) -> GearEstimate:
    """The module docstring's steady state of `pm` at concurrency `batch`."""
    out = max(1, workload.output_tokens)
    decode_s = pm.decode_interval_s(batch, workload.mean_context_tokens)
    prefill_s = pm.prefill_s(workload.input_tokens) if workload.input_tokens > 0 else 0.0
    if pm.placement.pp > 1 and workload.input_tokens > 0:
        # Prompts pipeline through the stages: the slowest stage paces prefill throughput.
        times = pm.stage_times_s(BatchShape.of(prefills=[(workload.input_tokens, 0)]))
        paced_prefill_s = prefill_s * max(times) / sum(times)
    else:
        paced_prefill_s = prefill_s
    tpot_s = decode_s + batch * paced_prefill_s / out
    ttft_s = prefill_s + tpot_s
    return GearEstimate.from_times(
        batch, ttft_s, tpot_s, workload.output_tokens, source, "performance model prior"
    )


def with_batch(gear: Gear, batch: int) -> Gear:
    return replace(gear, max_num_seqs=batch)
