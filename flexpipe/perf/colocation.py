"""Engines that share one GPU in memory: what each one gets (docs/gpu-sharing.md).

Memory. vLLM's `--gpu-memory-utilization` is a per-instance fraction of the GPU's *total*
memory: the engine sizes its KV cache so that its own allocation stays within
`fraction x total` (docs.vllm.ai, engine args: "This is a per-instance limit, and only
applies to the current vLLM instance. It does not matter if you have another vLLM instance
running on the same GPU. For example, if you have two vLLM instances running on the same
GPU, you can set the GPU memory utilization to 0.5 for each instance."; Anyscale's Ray
Data LLM guide gives 0.45 for two instances on one GPU). So co-located engines each get
their fraction (`flexpipe.perf.memory.engine_budget_bytes`), and the fractions of one GPU
must sum to at most the share the planner allows itself (`gpu_memory_utilization`).

Compute. Engines are separate processes with separate CUDA contexts; without MPS the driver
time-slices the GPU between contexts, round robin with equal slices (NVIDIA's
`nvidia-smi compute-policy --set-timeslice`; Red Hat's "GPU timeslicing" module). While `k`
co-located engines are busy, each one's step therefore takes about `k` times its step
alone, plus the cost of switching contexts. NVIDIA does not publish that cost (NVIDIA
developer forum, "Multi Process context switching"): `SWITCH_OVERHEAD` (5% per extra busy
engine) is an assumption of this model, not a measurement.

Capacity. Engine `i` alone would be busy `load_i / throughput_i` of the time (its GPU-time
share). Time-sliced, the GPU is shared out by those shares: an engine's capacity is what
the others' expected load leaves (`shared_capacity_per_s`), and a group fits when the
shares, inflated by the switch overhead, sum to at most the planner's target utilisation.
Latency is checked at the worst case, every engine busy (`stretch(k)`).

Pure functions, no state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "SWITCH_OVERHEAD",
    "busy_share",
    "fits_together",
    "memory_fraction",
    "shared_capacity_per_s",
    "stretch",
]

# Extra step time per additional busy engine on the GPU (context switches): an assumption.
SWITCH_OVERHEAD = 0.05
# Fractions are passed to engines rounded up to this step (two decimals, as users write them).
FRACTION_STEP = 0.01


def stretch(num_busy: int, switch_overhead: float = SWITCH_OVERHEAD) -> float:
    """How much longer a step takes while `num_busy` engines (itself included) are busy on
    its GPU: 1 alone; `k x (1 + overhead x (k - 1))` for k busy."""
    if num_busy < 1:
        raise ValueError("num_busy counts the engine itself: at least 1")
    return num_busy * (1.0 + switch_overhead * (num_busy - 1))


def busy_share(load_per_s: float, throughput_per_s: float) -> float:
    """The share of the GPU's time an engine serving `load_per_s` requests/s is busy alone,
    when it completes `throughput_per_s` at full load."""
    if throughput_per_s <= 0:
        raise ValueError("throughput_per_s must be positive")
    return load_per_s / throughput_per_s


def shared_capacity_per_s(
    capacity_per_s: float,
    throughput_per_s: float,
    others_busy_share: float,
    num_engines: int,
    switch_overhead: float = SWITCH_OVERHEAD,
) -> float:
    """An engine's planned capacity (requests/s) while it shares its GPU with `num_engines - 1`
    others whose busy shares alone sum to `others_busy_share`: its capacity alone
    (`capacity_per_s`, at the planner's target utilisation) divided by the switch overhead,
    less the requests/s of its full throughput that the others' time takes. A load within it
    is exactly a group that `fits_together`."""
    inflate = 1.0 + switch_overhead * (num_engines - 1)
    return max(0.0, capacity_per_s / inflate - others_busy_share * throughput_per_s)


def fits_together(
    busy_shares: Sequence[float],
    target_utilization: float,
    switch_overhead: float = SWITCH_OVERHEAD,
) -> bool:
    """Whether engines with these busy shares (alone) can share one GPU at the planner's
    target utilisation: their shares, inflated by the switch overhead, sum to at most it.
    Equivalent to every engine's load being within its `shared_capacity_per_s` (throughput
    sizing, where capacity alone is throughput x target utilisation)."""
    inflate = 1.0 + switch_overhead * (len(busy_shares) - 1)
    return sum(busy_shares) * inflate <= target_utilization + 1e-12


def memory_fraction(
    weights_bytes: float,
    reserve_bytes: float,
    kv_bytes_per_token: float,
    kv_tokens: int,
    gpu_memory_bytes: float,
    step: float = FRACTION_STEP,
) -> float:
    """The `--gpu-memory-utilization` an engine needs on a GPU of `gpu_memory_bytes`: its
    weights, its reserve (context, activations) and KV for `kv_tokens`, rounded up to
    `step`."""
    need = weights_bytes + reserve_bytes + kv_bytes_per_token * kv_tokens
    # (a hair below the step, so that an exact multiple is not rounded up by float noise)
    return round(math.ceil(need / gpu_memory_bytes / step - 1e-9) * step, 6)
