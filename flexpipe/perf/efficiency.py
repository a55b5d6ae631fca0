"""Every efficiency factor and fixed cost of the performance model, in one place.

Defaults are justified in docs/performance-model.md; override them from a YAML/JSON mapping
(`Efficiency.from_mapping`) or the CLI (`--set hbm_efficiency=0.7`).

`calibration` carries the per-GPU-type and per-link factor sets fitted to measurements
(flexpipe/perf/calibration.py); it travels with the scalars so that every caller that passes
an `Efficiency` (planner, gear table, sim engine) gets the same calibrated model. GPU types and
links it does not name use the generic scalars below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from flexpipe.perf.calibration import Calibration, builtin_calibration

GiB = float(2**30)


@dataclass(frozen=True, slots=True)
class Efficiency:
    # Achieved fraction of HBM bandwidth when streaming weights and KV (decode GEMV, paged
    # attention). vLLM reaches 75-85% model-bandwidth utilisation on A100/H100 at small batch.
    hbm_efficiency: float = 0.80
    # Achieved fraction of dense tensor-core peak in large GEMMs (prefill): 55-65% MFU.
    compute_efficiency: float = 0.60
    # Attention kernels (FlashAttention-2 prefill, paged decode) reach less of peak.
    attention_compute_efficiency: float = 0.45
    # NCCL/custom all-reduce bus bandwidth against the link's line rate.
    allreduce_bandwidth_efficiency: float = 0.75
    # Point-to-point send/recv (pipeline hand-offs, KV transfer) against line rate.
    p2p_bandwidth_efficiency: float = 0.80
    # Fixed CPU cost of one engine iteration (scheduling, input prep, CUDA-graph launch,
    # sampling), and what each running sequence adds to it.
    step_overhead_s: float = 0.0010
    per_seq_overhead_s: float = 0.000010
    # Memory the engine cannot give to weights or KV: CUDA context, allocator slack, NCCL
    # buffers (per GPU), plus activations sized by the token budget (see memory.py).
    cuda_context_bytes: float = 0.75 * GiB
    nccl_buffer_bytes: float = 0.25 * GiB  # only when tp > 1 or pp > 1
    # Cold start: weights are read once from storage (safetensors on local NVMe, page cache
    # cold) and the engine starts (CUDA init, NCCL, profiling run, CUDA-graph capture).
    storage_bandwidth_bytes_per_s: float = 2.0e9
    engine_startup_s: float = 20.0
    # Pinned host<->device copies (vLLM's sleep level 1 offload and its wake-up) against the
    # host link's datasheet rate: cudaMemcpy of pinned buffers reaches ~80% of PCIe x16
    # (~25 GB/s on gen4, ~50 GB/s on gen5, as the PCIe links of the catalog).
    host_link_efficiency: float = 0.80
    # Context length an engine is launched with unless told (vLLM's --max-model-len).
    default_max_model_len: int = 4096
    # Calibrated factor sets (built-in: fitted to public operator profiles).
    calibration: Calibration = field(default_factory=builtin_calibration)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "calibration":
                continue
            value = getattr(self, f.name)
            if value < 0 or (f.name.endswith("efficiency") and not 0 < value <= 1):
                raise ValueError(f"efficiency {f.name}={value} is out of range")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], base: Efficiency | None = None) -> Efficiency:
        """Override defaults from a mapping; unknown keys are an error (typos are caught)."""
        known = {f.name: f for f in fields(cls) if f.name != "calibration"}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(
                f"unknown efficiency factor(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        parsed: dict[str, Any] = {}
        for key, raw in values.items():
            try:
                parsed[key] = int(raw) if key == "default_max_model_len" else float(raw)
            except (TypeError, ValueError):
                raise ValueError(f"efficiency factor {key} must be a number, got {raw!r}") from None
        return replace(base or cls(), **parsed)

    def as_dict(self) -> dict[str, float]:
        """The scalar factors (the calibration is reported on its own)."""
        return {
            f.name: float(getattr(self, f.name)) for f in fields(self) if f.name != "calibration"
        }

    def with_calibration(self, calibration: Calibration) -> Efficiency:
        return replace(self, calibration=calibration)


DEFAULT_EFFICIENCY = Efficiency()
