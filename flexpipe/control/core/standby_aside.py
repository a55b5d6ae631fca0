"""What both controllers' shells need to drive standby sleepers beside the shifts (pure;
`policies/shift/standby_sleepers.py` decides which to start, wake and put to sleep,
docs/controller.md, "Standby sleepers"):

- `standby_view`: the GPUs as the planner and the shift policy see them beside standby
  sleepers: the memory each sleeper still holds is used (`with_sleepers`), and a standby
  loading beside the shifts holds its GPUs whole (the policy does not see it until it
  sleeps, so nothing else may be planned there meanwhile);
- `asleep_gpu_bytes`: what a sleeping engine still holds on its GPUs (all together): the
  reserve (CUDA context, NCCL buffers, activations), which vLLM's sleep pool does not free at
  either level; the live controller counts it from the performance model, the simulator
  reads its sim engine's `SleepState.gpu_memory_bytes` (the same sum).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from flexpipe.cluster import Cluster
from flexpipe.perf import PerfModel
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.standby_sleepers import with_sleepers

__all__ = ["ASIDE_REASONS", "asleep_gpu_bytes", "standby_view"]

# each change beside the policy's shifts, as both controllers log it (trigger -> reason)
ASIDE_REASONS = {
    "standby": "standby engines asleep ahead of demand (shift.standby)",
    "wake-aside": "requests wait: sleepers woken beside the shift in progress",
    "sleep-aside": "idle: its engines put to sleep beside the shift in progress",
    "swap-sleep": "time-sharing: a running instance put to sleep for another model's wake",
    "swap-wake": "time-sharing: a sleeper woken on the GPUs a swap freed",
}


def standby_view(
    cluster: Cluster,
    held: Sequence[tuple[PlannedInstance, float]],
    keep_for_wake: bool,
    loading_gpu_ids: Collection[str],
) -> Cluster:
    """`cluster` with each sleeper's held bytes used (`held`: (instance, bytes on all its
    GPUs together); `keep_for_wake`: its GPUs kept for its wake) and the GPUs of standbys
    loading beside the shifts (`loading_gpu_ids`) held whole; GPUs that are gone are
    skipped."""
    view = with_sleepers(cluster, held, keep_for_wake)
    for g in sorted(set(loading_gpu_ids) & set(view.gpu_ids)):
        view = view.with_used(g, view.gpu(g).capacity_bytes, owner="flexpipe")
    return view


def asleep_gpu_bytes(pm: PerfModel) -> float:
    """The GPU memory an engine asleep (level 1 or 2) still holds, all its GPUs together:
    each GPU's reserve; its weights and KV cache are offloaded or dropped."""
    return sum(g.reserve_bytes for g in pm.memory.per_gpu)
