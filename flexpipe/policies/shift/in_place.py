"""How an in-place step re-gears: side by side, through a pre-started sleeper, or rolling
(pure; docs/controller.md, "In place").

An in-place step replaces instances whose GPUs its successors need (`step_order.py`). Rolling
(`shift.pricing.in_place: rolling`, the default) drains and releases them, then cold-starts
the successors: the model lacks that capacity for the drain plus a cold start (~28 s for the
seed's TP2). `make_before_break` chooses per step, in this order:

1. `side_by_side`: on every GPU of the step, what the leaving engines hold (weights, reserve,
   the KV cache they were launched with) plus what the successors will hold fits in the
   memory other tenants leave: the successors start, rehearse and serve beside them, and they
   then drain as any leaving instance does. No capacity is lost.
2. `wake`: the successors start beside them as sleepers instead: loaded, rehearsed and put to
   sleep at once (vLLM's sleep mode), so that on the GPUs they hold only what a sleeping
   engine keeps (its reserve) next to the leaving engines. Level 1 keeps their weights in the
   node's host RAM where it holds them (next to what level-1 sleepers hold already); else
   level 2, whose wake reads the weights from storage again. The leaving engines then drain
   for the short `in_place_drain_s` (what would outlive it moves at once), are released, and
   the successors wake: the gap is that drain plus a wake (`PerfModel.wake_s`), not a cold
   start.
3. `cold`: neither fits (or the engine kind cannot sleep): rolling, as before.

The procedure (`control/core/shift_procedure.py`) carries the choice out and the pricing
(`pricing.py`) prices it with the same function, the wake at the source it reads from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from flexpipe.cluster import Cluster
from flexpipe.perf import PerfModel
from flexpipe.perf.weights import HOST_RAM, STORAGE
from flexpipe.policies.planner import PlannedInstance

__all__ = [
    "COLD",
    "IN_PLACE_MODES",
    "MAKE_BEFORE_BREAK",
    "ROLLING",
    "SIDE_BY_SIDE",
    "WAKE",
    "InPlaceChoice",
    "choose_in_place",
    "gpu_footprint_bytes",
]

ROLLING = "rolling"
MAKE_BEFORE_BREAK = "make_before_break"
IN_PLACE_MODES = (ROLLING, MAKE_BEFORE_BREAK)

SIDE_BY_SIDE = "side_by_side"
WAKE = "wake"
COLD = "cold"


@dataclass(frozen=True, slots=True)
class InPlaceChoice:
    """How one in-place step goes. `level`: the sleep level the pre-started successors wait
    at (`wake` only); `source`: where their weights come from when they wake (`host_ram` for
    level 1, `storage` for level 2; "" otherwise); `why`: one line for the shift log."""

    how: str
    level: int = 0
    source: str = ""
    why: str = ""


def gpu_footprint_bytes(
    pm: PerfModel, kv_capacity_tokens: int, asleep: bool = False
) -> dict[str, float]:
    """GPU -> bytes an engine holds there: its weights, its reserve (CUDA context, buffers)
    and the KV cache of `kv_capacity_tokens` it was sized for; asleep, only the reserve."""
    out: dict[str, float] = {}
    for g in pm.memory.per_gpu:
        held = g.reserve_bytes
        if not asleep:
            held += g.weights_bytes + kv_capacity_tokens * g.kv_bytes_per_token
        out[g.name] = out.get(g.name, 0.0) + held
    return out


def _fits(cluster: Cluster, held: Sequence[Mapping[str, float]]) -> str:
    """ "" when every GPU holds the sum of `held`, else the first GPU that does not."""
    total: dict[str, float] = {}
    for one in held:
        for gpu, b in one.items():
            total[gpu] = total.get(gpu, 0.0) + b
    for gpu, b in sorted(total.items()):
        free = cluster.gpu(gpu).free_bytes
        if b > free:
            return f"{gpu} would need {b / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free"
    return ""


def choose_in_place(
    cluster: Cluster,
    blockers: Sequence[PlannedInstance],
    adds: Sequence[PlannedInstance],
    perf_model: Callable[[PlannedInstance], PerfModel],
    kind_levels: Sequence[int],
    host_ram_free_bytes: Mapping[str, float] | None = None,
) -> InPlaceChoice:
    """The way one in-place step (`blockers` out, `adds` in on their GPUs) re-gears under
    `make_before_break` (module docstring). `kind_levels`: the sleep levels the engine kind
    has; `host_ram_free_bytes`: node -> host RAM not held by level-1 sleepers (None: each
    node's capacity)."""
    pms = {id(a): perf_model(a) for a in (*blockers, *adds)}
    old = [gpu_footprint_bytes(pms[id(b)], b.kv_capacity_tokens) for b in blockers]
    new = [gpu_footprint_bytes(pms[id(a)], a.kv_capacity_tokens) for a in adds]
    short = _fits(cluster, [*old, *new])
    if not short:
        return InPlaceChoice(SIDE_BY_SIDE, why="both fit in memory: the successor starts beside")
    if not kind_levels:
        return InPlaceChoice(COLD, why=f"not side by side ({short}); the engines cannot sleep")
    asleep = [gpu_footprint_bytes(pms[id(a)], a.kv_capacity_tokens, asleep=True) for a in adds]
    no_room = _fits(cluster, [*old, *asleep])
    if no_room:
        return InPlaceChoice(COLD, why=f"not even a sleeping successor fits ({no_room})")
    free = (
        dict(host_ram_free_bytes)
        if host_ram_free_bytes is not None
        else {n.name: n.host_ram_capacity_bytes for n in cluster.nodes}
    )
    need: dict[str, float] = {}
    for a in adds:
        for g in pms[id(a)].memory.per_gpu:
            node = cluster.gpu(g.name).node
            need[node] = need.get(node, 0.0) + g.weights_bytes
    if 1 in kind_levels and all(b <= free.get(n, 0.0) for n, b in need.items()):
        why = f"not side by side ({short}): pre-started asleep at level 1, weights in host RAM"
        return InPlaceChoice(WAKE, 1, HOST_RAM, why)
    if 2 in kind_levels:
        why = f"not side by side ({short}), host RAM short: pre-started asleep at level 2"
        return InPlaceChoice(WAKE, 2, STORAGE, why)
    return InPlaceChoice(COLD, why=f"not side by side ({short}); host RAM short for level 1")
