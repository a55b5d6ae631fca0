"""The gear table as the planner's `GearPerformance`: measured curves where they exist, the
performance-model prior elsewhere (and the estimate says which).

Matching a planner key to a curve: same model, same tp/pp/dtype/KV dtype (the curve's own
max_num_seqs does not matter: the planner's concurrency is the batch size looked up), same
GPU types in order, same slowest link class, same request shape (input/output tokens). Then:

- the concurrency is a measured batch size, or between two: measured / interpolated;
- outside the measured batch sizes, or measured with another request shape: the prior scaled
  by measured / prior at the nearest measured point ("predicted", calibrated; detail says so);
- no curve: the prior.
"""

from __future__ import annotations

from collections.abc import Iterable

from flexpipe.gears.point import NO_LINK, GearPoint
from flexpipe.policies.planner.performance import (
    GearEstimate,
    GearKey,
    GearPerformance,
    PerfModelPerformance,
    Workload,
    with_batch,
)


def _family(gear_key: str) -> str:
    """`tp2-pp1-bf16-kvauto-s256` -> `tp2-pp1-bf16-kvauto` (the gear without its batch cap)."""
    head, sep, tail = gear_key.rpartition("-s")
    return head if sep and tail.isdigit() else gear_key


def _link_class(key: GearKey) -> str:
    links = [lk for lk in key.tp_links if lk is not None] + list(key.pp_links)
    if not links:
        return NO_LINK
    return min(links, key=lambda lk: lk.bandwidth_bytes_per_s).name


def _estimate_of(p: GearPoint, batch: float, source: str, detail: str) -> GearEstimate:
    return GearEstimate(
        batch=int(batch),
        output_tokens_per_s=p.decode_tokens_per_s,
        requests_per_s=p.requests_per_s,
        ttft_s=p.ttft_p99_s,
        tpot_s=p.tpot_p99_s,
        e2e_s=p.e2e_p99_s,
        source="measured" if source == "measured" else "predicted",
        detail=detail,
    )


def _lerp(a: float, b: float, t: float) -> float:
    return a + t * (b - a)


class TablePerformance:
    """Implements the planner's GearPerformance over gear-table points."""

    def __init__(self, points: Iterable[GearPoint], prior: GearPerformance | None = None) -> None:
        self.prior = prior or PerfModelPerformance()
        # (model, family, gpu types, link) -> {(input, output): {batch: point}}
        self._curves: dict[tuple[str, str, str, str], dict[tuple[int, int], dict[int, GearPoint]]]
        self._curves = {}
        for p in points:
            k = (p.model, _family(p.gear_key), p.gpu_types, p.link)
            by_shape = self._curves.setdefault(k, {}).setdefault((p.input_len, p.output_len), {})
            old = by_shape.get(p.batch_size)
            if old is None or p.measured_at > old.measured_at:
                by_shape[p.batch_size] = p

    def estimate(self, key: GearKey, workload: Workload) -> GearEstimate:
        k = (key.model.name, _family(key.gear.key()), "+".join(key.gpu_types), _link_class(key))
        shapes = self._curves.get(k)
        if not shapes:
            return self.prior.estimate(key, workload)
        batch = key.batch
        shape = (workload.input_tokens, workload.output_tokens)
        curve = shapes.get(shape)
        if curve is not None:
            batches = sorted(curve)
            if batch in curve:
                p = curve[batch]
                return _estimate_of(p, batch, "measured", self._provenance(p))
            lower = [b for b in batches if b < batch]
            upper = [b for b in batches if b > batch]
            if lower and upper:
                lo, hi = curve[lower[-1]], curve[upper[0]]
                t = (batch - lo.batch_size) / (hi.batch_size - lo.batch_size)
                return GearEstimate(
                    batch=batch,
                    output_tokens_per_s=_lerp(lo.decode_tokens_per_s, hi.decode_tokens_per_s, t),
                    requests_per_s=_lerp(lo.requests_per_s, hi.requests_per_s, t),
                    ttft_s=_lerp(lo.ttft_p99_s, hi.ttft_p99_s, t),
                    tpot_s=_lerp(lo.tpot_p99_s, hi.tpot_p99_s, t),
                    e2e_s=_lerp(lo.e2e_p99_s, hi.e2e_p99_s, t),
                    source="measured",
                    detail=f"gear table: interpolated between batch {lo.batch_size} and "
                    f"{hi.batch_size} ({self._provenance(lo)})",
                )
        # Calibrate the prior at the nearest measured point (same shape if any, else the
        # closest shape).
        if curve is None:
            shape = min(shapes, key=lambda s: abs(s[0] - shape[0]) + abs(s[1] - shape[1]))
            curve = shapes[shape]
        ref_batch = min(curve, key=lambda b: abs(b - batch))
        ref = curve[ref_batch]
        ref_prior = self.prior.estimate(
            GearKey(
                key.model,
                with_batch(key.gear, ref_batch),
                key.stage_gpu_types,
                key.tp_links,
                key.pp_links,
                key.layers_per_stage,
            ),
            Workload(ref.input_len, ref.output_len),
        )
        prior = self.prior.estimate(key, workload)
        ratio_tpot = ref.tpot_p99_s / ref_prior.tpot_s if ref_prior.tpot_s else 1.0
        ratio_ttft = ref.ttft_p99_s / ref_prior.ttft_s if ref_prior.ttft_s else 1.0
        tpot = prior.tpot_s * ratio_tpot
        ttft = prior.ttft_s * ratio_ttft
        return GearEstimate.from_times(
            batch,
            ttft,
            tpot,
            workload.output_tokens,
            "predicted",
            f"performance model calibrated by the gear table at batch {ref_batch}, "
            f"{ref.input_len}/{ref.output_len} tokens (TPOT x{ratio_tpot:.2f}, "
            f"TTFT x{ratio_ttft:.2f})",
        )

    @staticmethod
    def _provenance(p: GearPoint) -> str:
        return (
            f"gear table: {p.engine} {p.engine_version}, {p.measured_at:%Y-%m-%d}, "
            f"{p.num_requests} req"
        )
