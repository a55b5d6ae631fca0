"""Fit calibrated factor sets to measured kernel times, and measure the model's error.

Pure: samples in, `Calibration` or error rows out. Used for the built-in factors (from public
operator profiles, see bench/perf_model_error.py) and by `flexpipe calibrate` (from the
user's GPUs); both go through the same code.

GPU types: for each GPU, the GEMM samples give a floor (a kernel's fixed cost, picked from a
grid) and an efficiency curve: in each log2 bucket of tokens, the median of
`roofline at peak / (measured - floor)`. Each memory-bound op gets its floor and curve the
same way, and all of them pooled give the `*` entry. Medians, not means: a profile's
outliers (a throttled run, a shape that hits a bad tile) should not move the factor every
other shape gets.

Links: all-reduce `t = 2(r-1) a + 2(r-1)/r S / B` and send/recv `t = a + S / B` are linear in
(a, 1/B); least squares weighted by 1/t^2 (relative error) gives both in closed form.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from flexpipe.hardware import GpuSpec, gpu_spec, link_spec
from flexpipe.model_spec import ModelSpec
from flexpipe.perf.calibration import (
    ANY_OP,
    Calibration,
    EfficiencyCurve,
    GpuCalibration,
    KernelFactors,
    LinkCalibration,
)
from flexpipe.perf.efficiency import Efficiency
from flexpipe.perf.model import perf_model_for
from flexpipe.perf.operator import GEMM_OPS, MEMORY_OPS, LayerShape, OperatorCost, gemm_bytes_flops
from flexpipe.perf.sample import Sample
from flexpipe.perf.step_time import BatchShape, LinkCost
from flexpipe.precision import PRECISIONS, compute_flops_per_s

# Profiles and `flexpipe calibrate` run 16-bit kernels.
_FP16 = PRECISIONS["fp16"]
_ELEMENT_BYTES = 2.0
FLOOR_GRID_S = tuple(i * 0.5e-6 for i in range(25))  # 0 .. 12 us
# Token counts up to this are decode-sized (a decode batch), above prefill-sized (a chunk).
DECODE_SIZED_MAX_TOKENS = 256
# Messages up to this many bytes are decode-sized (256 tokens x 4096 hidden x 2 B = 2 MiB).
DECODE_SIZED_MAX_BYTES = 2 * 2**20


def _shape(s: Sample) -> LayerShape:
    head_dim = s.head_dim or s.hidden_size // s.num_heads
    return LayerShape(s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, head_dim)


def operator_cost(gpu: GpuSpec, eff: Efficiency, calibration: Calibration) -> OperatorCost:
    """How the performance model prices a 16-bit kernel on `gpu` under `calibration`."""
    return OperatorCost(
        gpu.hbm_bandwidth_bytes_per_s,
        compute_flops_per_s(gpu, _FP16),
        eff.hbm_efficiency,
        eff.compute_efficiency,
        calibration.gpu(gpu.name),
    )


def _roofline_at_peak(s: Sample, gpu: GpuSpec) -> float:
    """The kernel's time at datasheet peak (efficiency 1, no floor)."""
    cost = OperatorCost(gpu.hbm_bandwidth_bytes_per_s, compute_flops_per_s(gpu, _FP16), 1, 1, None)
    if s.op in GEMM_OPS:
        k, n = _shape(s).gemm_dims(s.tp)[s.op]
        num_bytes, flops = gemm_bytes_flops(s.num_tokens, k, n, _ELEMENT_BYTES, _ELEMENT_BYTES)
        return cost.gemm_s(num_bytes, flops, s.num_tokens)
    elements = _shape(s).memory_elements_per_token(s.tp)[s.op]
    return s.num_tokens * elements * _ELEMENT_BYTES / gpu.hbm_bandwidth_bytes_per_s


def predict_s(s: Sample, eff: Efficiency, calibration: Calibration) -> float:
    """What the performance model says one measured kernel takes."""
    if s.op in ("all_reduce", "send_recv"):
        link = link_spec(s.link)
        cost = LinkCost.of(
            link,
            eff.allreduce_bandwidth_efficiency,
            eff.p2p_bandwidth_efficiency,
            calibration.link(link.name),
        )
        if s.op == "all_reduce":
            return cost.allreduce_s(s.message_bytes, s.num_ranks)
        return cost.p2p_s(s.message_bytes)
    ops = operator_cost(gpu_spec(s.gpu_type), eff, calibration)
    if s.op in GEMM_OPS:
        k, n = _shape(s).gemm_dims(s.tp)[s.op]
        # As the model does: generic factors see weight bytes only (see PerfModel).
        act = _ELEMENT_BYTES if ops.calibration is not None else 0.0
        num_bytes, flops = gemm_bytes_flops(s.num_tokens, k, n, _ELEMENT_BYTES, act)
        return ops.gemm_s(num_bytes, flops, s.num_tokens)
    if s.op in MEMORY_OPS:
        elements = _shape(s).memory_elements_per_token(s.tp)[s.op]
        return ops.memory_s(s.num_tokens * elements * _ELEMENT_BYTES, s.num_tokens, s.op)
    raise ValueError(f"the model has no prediction for op {s.op!r}")


# -- fitting ---------------------------------------------------------------------------------


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an already sorted list."""
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def _bucket(num_tokens: int) -> int:
    return int(2 ** round(math.log2(max(num_tokens, 1))))


def _fit_kernel(points: Sequence[tuple[int, float, float]]) -> KernelFactors:
    """(num_tokens, time at peak, measured time) -> the curve and floor with the smallest
    median + p90 relative error over the points."""
    best: tuple[float, EfficiencyCurve, float] | None = None
    for floor in FLOOR_GRID_S:
        by_bucket: dict[int, list[float]] = defaultdict(list)
        for tokens, ideal, measured in points:
            by_bucket[_bucket(tokens)].append(ideal / max(measured - floor, ideal))
        curve = EfficiencyCurve(
            tuple((t, statistics.median(v)) for t, v in sorted(by_bucket.items()))
        )
        errors = sorted(
            abs((floor + ideal / curve.at(tokens)) / measured - 1)
            for tokens, ideal, measured in points
        )
        score = statistics.median(errors) + _quantile(errors, 0.9)
        if best is None or score < best[0]:
            best = (score, curve, floor)
    if best is None:
        raise ValueError("no samples to fit")
    return KernelFactors(best[1], best[2])


def fit_gpu(
    samples: Iterable[Sample], label: str, source: str, spec_of: Callable[[str], GpuSpec] = gpu_spec
) -> GpuCalibration:
    """One factor set from the GEMM and memory-bound samples given (of one GPU type, or of
    several pooled: the curves are fractions of each GPU's own peak)."""
    gemm: list[tuple[int, float, float]] = []
    memory: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for s in samples:
        if s.op in GEMM_OPS:
            gemm.append((s.num_tokens, _roofline_at_peak(s, spec_of(s.gpu_type)), s.time_s))
        elif s.op in MEMORY_OPS:
            point = (s.num_tokens, _roofline_at_peak(s, spec_of(s.gpu_type)), s.time_s)
            memory[s.op].append(point)
            memory[ANY_OP].append(point)
    if not gemm or not memory:
        raise ValueError(f"{label}: need both GEMM and memory-bound samples to calibrate")
    return GpuCalibration(
        label,
        _fit_kernel(gemm),
        tuple((op, _fit_kernel(points)) for op, points in sorted(memory.items())),
        source,
    )


def _fit_linear(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of t = a x1 + b x2 weighted by 1/t^2; a, b clamped to >= tiny."""
    s11 = s12 = s22 = y1 = y2 = 0.0
    for x1, x2, t in rows:
        w = 1.0 / (t * t)
        s11 += w * x1 * x1
        s12 += w * x1 * x2
        s22 += w * x2 * x2
        y1 += w * x1 * t
        y2 += w * x2 * t
    det = s11 * s22 - s12 * s12
    if det <= 0:
        raise ValueError("collective samples do not separate latency from bandwidth")
    a = (y1 * s22 - y2 * s12) / det
    b = (s11 * y2 - s12 * y1) / det
    return max(a, 1e-9), max(b, 1e-15)


def fit_link(samples: Iterable[Sample], link: str, source: str) -> LinkCalibration:
    ar: list[tuple[float, float, float]] = []
    p2p: list[tuple[float, float, float]] = []
    for s in samples:
        if s.op == "all_reduce" and s.num_ranks > 1:
            steps = 2.0 * (s.num_ranks - 1)
            ar.append((steps, steps / s.num_ranks * s.message_bytes, s.time_s))
        elif s.op == "send_recv":
            p2p.append((1.0, float(s.message_bytes), s.time_s))
    if not ar:
        raise ValueError(f"{link}: no all-reduce samples to calibrate")
    ar_latency, ar_inverse_bw = _fit_linear(ar)
    p2p_fit = _fit_linear(p2p) if p2p else None
    return LinkCalibration(
        link=link_spec(link).name,
        allreduce_bandwidth_bytes_per_s=1.0 / ar_inverse_bw,
        allreduce_latency_s=ar_latency,
        p2p_bandwidth_bytes_per_s=None if p2p_fit is None else 1.0 / p2p_fit[1],
        p2p_latency_s=None if p2p_fit is None else p2p_fit[0],
        source=source,
    )


def fit(
    samples: Sequence[Sample], source: str, provenance: Mapping[str, str] | None = None
) -> Calibration:
    """Every GPU type and link class the samples measure, fitted."""
    by_gpu: dict[str, list[Sample]] = defaultdict(list)
    by_link: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        if s.op in GEMM_OPS or s.op in MEMORY_OPS:
            by_gpu[gpu_spec(s.gpu_type).name].append(s)
        elif s.op in ("all_reduce", "send_recv") and s.link:
            by_link[link_spec(s.link).name].append(s)
    return Calibration(
        gpus=tuple(fit_gpu(v, gpu, source) for gpu, v in sorted(by_gpu.items())),
        links=tuple(
            fit_link(v, lk, source)
            for lk, v in sorted(by_link.items())
            if any(s.op == "all_reduce" for s in v)
        ),
        provenance=tuple((provenance or {"source": source}).items()),
    )


def leave_one_gpu_out(samples: Sequence[Sample], gpu_type: str, source: str) -> Calibration:
    """Factors for `gpu_type` fitted only on the OTHER GPUs' samples (pooled)."""
    name = gpu_spec(gpu_type).name
    others = [
        s
        for s in samples
        if (s.op in GEMM_OPS or s.op in MEMORY_OPS) and gpu_spec(s.gpu_type).name != name
    ]
    return Calibration(gpus=(fit_gpu(others, name, f"{source}, without {name}"),))


# -- whole layers: the fitted model against a measured layer -----------------------------------


def layer_batch(s: Sample) -> BatchShape:
    """The batch a `layer_prefill` / `layer_decode` sample ran."""
    seqs = max(1, s.num_seqs)
    if s.op == "layer_prefill":
        return BatchShape.of(prefills=[(s.num_tokens // seqs, 0)] * seqs)
    if s.op == "layer_decode":
        return BatchShape(num_decode_seqs=seqs, decode_context_tokens=seqs * s.context_len)
    raise ValueError(f"{s.op!r} is not a whole-layer sample")


def predict_layer_s(s: Sample, model: ModelSpec, eff: Efficiency) -> float:
    """The performance model's time for one layer of `model` as `s` ran it (16 bit, tp=1)."""
    pm = perf_model_for(model, "tp=1,dtype=fp16", gpu_type=s.gpu_type, efficiency=eff)
    return pm.layer_time_s(layer_batch(s))


# -- error report ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorRow:
    """Absolute relative error of the model over one family of samples."""

    setup: str  # GPU type or link class
    group: str  # "gemm" | "memory-bound" | "all_reduce" | "send_recv"
    size: str  # "decode-sized" | "prefill-sized"
    num_samples: int
    median: float
    p90: float


def group_of(s: Sample) -> str:
    if s.op in GEMM_OPS:
        return "gemm"
    if s.op in MEMORY_OPS:
        return "memory-bound"
    return s.op


def size_of(s: Sample) -> str:
    if s.op in ("all_reduce", "send_recv"):
        small = s.message_bytes <= DECODE_SIZED_MAX_BYTES
    else:
        small = s.num_tokens <= DECODE_SIZED_MAX_TOKENS
    return "decode-sized" if small else "prefill-sized"


def error_rows(
    samples: Iterable[Sample], eff: Efficiency, calibration: Calibration
) -> list[ErrorRow]:
    """The model's error per (setup, operator group, size), sorted."""
    errors: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for s in samples:
        group = group_of(s)
        if group not in ("gemm", "memory-bound", "all_reduce", "send_recv"):
            continue
        setup = link_spec(s.link).name if s.op in ("all_reduce", "send_recv") else s.gpu_type
        err = abs(predict_s(s, eff, calibration) / s.time_s - 1)
        errors[(setup, group, size_of(s))].append(err)
    rows = []
    for (setup, group, size), values in sorted(errors.items()):
        values.sort()
        rows.append(
            ErrorRow(
                setup, group, size, len(values), statistics.median(values), _quantile(values, 0.9)
            )
        )
    return rows
