"""What moving a running request costs, from the one performance model (flexpipe.perf).

A request still running when its instance is drained either has its KV cache moved to the successor
instance (bytes over the link between them) or is continued there by recomputing the prefill of its
context; it pauses for the cheaper of the two (seed 000 §3.1; docs/controller.md, "Moving
requests"). flexpipe.perf has both times (`kv_transfer_s`, `prefill_s`); the choice between them and
the link between two instances are new here. The controller can call `choose_migration` per request
at its drain deadline; the pricing calls it for the mean context.

A recompute the gateway pre-copies (`warm=True`: flexpipe.gateway.relay.warm_up sends the
destination the context for one token while the request keeps generating on its source) does
not pause for the context's prefill: the client waits for the destination's step in progress
and one step that prefills what its prefix cache lacks (the tokens generated during the
warm-up, and the warmed context's last partial block). The gateway warms only a destination
with a free slot, so a recompute that waits for one is priced unwarmed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from flexpipe.cluster import Cluster, ClusterError, placement_on
from flexpipe.hardware import LinkSpec
from flexpipe.model_spec import ModelSpec, load_model_spec
from flexpipe.perf import Efficiency, PerfModel
from flexpipe.policies.planner import PlannedInstance

__all__ = [
    "Destination",
    "MigrationChoice",
    "MoveRequest",
    "PlannedMove",
    "choose_migration",
    "link_between",
    "outlives",
    "perf_model_of",
    "plan_moves",
    "slot_wait_s",
    "warmed_recompute_s",
]


@dataclass(frozen=True, slots=True)
class MigrationChoice:
    method: Literal["kv", "recompute"]
    kv_move_s: float | None  # None: no link to move it over (shared GPUs, source gone)
    recompute_s: float
    queue_wait_s: float = 0.0  # until the destination has a slot for it
    # a pre-copied recompute (`warmed_recompute_s`): how long the warm-up runs before the
    # cut-over, the request still generating on its source (recompute_s is then the cut-over's
    # pause); None: not warmed
    warm_up_s: float | None = None

    @property
    def warmed(self) -> bool:
        return self.method == "recompute" and self.warm_up_s is not None

    @property
    def pause_s(self) -> float:
        """How long the request stops producing tokens: the wait for a slot, then the move."""
        if self.method == "kv" and self.kv_move_s is not None:
            return self.queue_wait_s + self.kv_move_s
        return self.queue_wait_s + self.recompute_s

    @property
    def done_s(self) -> float:
        """From carrying it out until the request runs on the destination: the warm-up (when
        warmed), then the pause."""
        warm_up_s = self.warm_up_s if self.warmed and self.warm_up_s is not None else 0.0
        return warm_up_s + self.pause_s


def perf_model_of(
    cluster: Cluster,
    instance: PlannedInstance,
    efficiency: Efficiency | None = None,
    *,
    spec: ModelSpec | None = None,
) -> PerfModel:
    """The performance model of a planned instance on the cluster as it is now. `spec`: the
    instance's model spec, read by the caller (a policy reads no file); None: looked up in
    the shipped catalog here, for the callers not given it yet (pricing, triggers)."""
    if spec is None:
        spec = load_model_spec(instance.model_id)
    placement = placement_on(cluster, instance.stages, spec.num_layers, instance.layers_per_stage)
    return PerfModel(spec, instance.gear, placement, efficiency)


def link_between(
    cluster: Cluster, source: PlannedInstance, target: PlannedInstance
) -> LinkSpec | None:
    """The link KV moves over from `source` to `target`: the slowest between corresponding
    GPUs (rank i sends its shard to rank i). None when they share a GPU (the source must stop
    before the target starts) or a source GPU is gone."""
    if set(source.gpu_ids) & set(target.gpu_ids):
        return None
    try:
        links = [
            cluster.link_between(a, b) for a, b in zip(source.gpu_ids, target.gpu_ids, strict=False)
        ]
    except ClusterError:
        return None
    return min(links, key=lambda lk: lk.bandwidth_bytes_per_s)


def warmed_recompute_s(
    target: PerfModel, context_tokens: int, step_s: float, source_interval_s: float
) -> tuple[float, float]:
    """(warm-up, pause) of a pre-copied recompute onto `target`. The warm-up waits for the
    step in progress there (`step_s`) and prefills the whole context, while the request
    keeps generating on its source, one token per `source_interval_s` (0: unknown, none
    counted). The cut-over then waits for a step in progress and prefills what the prefix
    cache lacks: the warmed context's last partial block (only full blocks are cached) and
    the tokens generated meanwhile, attending over the cached rest."""
    warm_up_s = step_s + target.prefill_s(context_tokens)
    num_new = math.ceil(warm_up_s / source_interval_s) if source_interval_s > 0 else 0
    block = target.gear.block_size
    cached = context_tokens // block * block
    return warm_up_s, step_s + target.prefill_s(context_tokens + num_new, cached)


def choose_migration(
    target: PerfModel,
    context_tokens: int,
    link: LinkSpec | None,
    queue_wait_s: float = 0.0,
    *,
    warm: bool = False,
    step_s: float = 0.0,
    source_interval_s: float = 0.0,
) -> MigrationChoice:
    """Move the KV of `context_tokens` over `link` or recompute it on `target`, whichever
    pauses less (KV bytes per token are the target's: its precision is what lands there).
    `queue_wait_s`: how long the request waits for a slot on `target` before either starts
    (`slot_wait_s`); it is the same for both methods, so it prices the destination, not the
    method. `warm`: the gateway pre-copies a recompute, which then pauses for
    `warmed_recompute_s` (`step_s`: `target`'s step at its batch; `source_interval_s`: the
    request's token interval where it runs) instead of the context's prefill — only onto a
    free slot (`queue_wait_s` 0), as the gateway warms no full destination."""
    recompute_s = target.prefill_s(context_tokens)
    warm_up_s: float | None = None
    if warm and queue_wait_s <= 0:
        warm_up_s, recompute_s = warmed_recompute_s(
            target, context_tokens, step_s, source_interval_s
        )
    if link is None:
        return MigrationChoice("recompute", None, recompute_s, queue_wait_s, warm_up_s)
    kv_s = target.kv_transfer_s(context_tokens, link.bandwidth_bytes_per_s, link.latency_s)
    method: Literal["kv", "recompute"] = "kv" if kv_s < recompute_s else "recompute"
    return MigrationChoice(method, kv_s, recompute_s, queue_wait_s, warm_up_s)


def slot_wait_s(num_slots: int, remaining_s: Sequence[float], num_ahead: int) -> float:
    """How long a moved request waits for a slot on an instance running requests with
    `remaining_s` left each, when `num_ahead` moved requests were placed there before it.

    A moved request is admitted ahead of the instance's waiting queue (engine priority), so
    only running requests stand in its way: while fewer than `num_slots` run it starts at once;
    else it takes the k-th slot to free, k counted over the moved requests ahead of it. Of the
    requests in flight, the `num_slots` closest to their end are taken as the running ones (the
    queued ones have generated nothing yet). `num_slots` 0 (unknown): never waits."""
    if num_slots <= 0:
        return 0.0
    running = sorted(remaining_s)[:num_slots]
    k = num_ahead - (num_slots - len(running))
    if k < 0 or not running:  # a slot is free (or only moved requests hold them: unknown)
        return 0.0
    return running[min(k, len(running) - 1)]


@dataclass(frozen=True, slots=True)
class Destination:
    """A live instance of the model a request can move to, as the gateway sees it now."""

    name: str  # the instance's URL
    perf: PerfModel
    links: Mapping[str, LinkSpec | None]  # source name -> the link from it (None: recompute)
    num_slots: int  # max_num_seqs (0: unknown)
    remaining_s: tuple[float, ...]  # time left of each request it serves now
    # prompt tokens it is still prefilling (requests in its slots without a token yet): a
    # moved request's first token comes at the end of a step, and these fill the steps first
    num_prefill_tokens: int = 0
    # the requests in its batch and their contexts, summed: its decode step (what a warmed
    # recompute's cut-over waits for), which every request moved in grows
    num_decoding: int = 0
    decode_context_tokens: int = 0

    def step_s(self, num_moved: int = 0, moved_context_tokens: int = 0) -> float:
        """One decode step at its batch with `num_moved` requests of `moved_context_tokens`
        (summed) moved in."""
        batch = self.num_decoding + num_moved
        context = (self.decode_context_tokens + moved_context_tokens) // max(1, batch)
        return self.perf.decode_interval_s(max(1, batch), max(1, context))


@dataclass(frozen=True, slots=True)
class MoveRequest:
    """A request to move: the gateway's id, the tokens of its context (prompt + output), the
    instance it leaves and its token interval there (0: unknown)."""

    id: int
    context_tokens: int
    source: str = ""
    interval_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PlannedMove:
    id: int
    destination: str
    choice: MigrationChoice
    at_s: float = 0.0  # when to carry it out, from now: after the moves ahead of it there


def plan_moves(
    requests: Sequence[MoveRequest],
    destinations: Sequence[Destination],
    horizon_s: float = math.inf,
    *,
    warm: bool = False,
) -> list[PlannedMove]:
    """Each request to the destination and method where it pauses least, and when.

    A destination first prefills what it already admitted (`num_prefill_tokens`: the steps
    that carry it are long, and a request moved in meanwhile waits for them, paused); then
    it prefills one recompute after another (they share its steps) and a link
    carries one KV move after another (they share its bandwidth): a move placed behind others
    on the same lane is carried out when they are done (`at_s`), so that it does not wait for
    them while paused — until then it keeps generating where it is. Its pause is then its own
    move plus what is left of the wait for a slot (`slot_wait_s`, counted from now). With
    `warm` (the gateway pre-copies recomputes) a recompute onto a free slot pauses for the
    cut-over only (`warmed_recompute_s`) at the destination's step with the moves placed there
    before it (`Destination.step_s`: without them, the destination whose step is a hair
    shorter would take every move, one after another, its batch growing), and its warm-up
    holds the destination's lane before it (the warm-up's prefill would stall a cut-over
    sharing its step). Among the
    options that start within `horizon_s` (the drain deadline: after it the source is gone)
    the smallest pause wins, then the earliest start; with none, the earliest resumption.
    Shortest context first: its budget (one prefill of its context) is the smallest. Ties go
    to the earlier destination. Pure; empty when there is nowhere to go."""
    placed = [0] * len(destinations)
    placed_context = [0] * len(destinations)  # the contexts of those, summed
    lane_free_s: dict[tuple[int, str], float] = {}  # (destination, lane) -> free from
    busy_s = [
        d.perf.prefill_s(d.num_prefill_tokens) if d.num_prefill_tokens else 0.0
        for d in destinations
    ]
    out = []
    for req in sorted(requests, key=lambda r: (r.context_tokens, r.id)):
        best: tuple[tuple[bool, float, float], PlannedMove] | None = None
        for n, d in enumerate(destinations):
            slot_s = slot_wait_s(d.num_slots, d.remaining_s, placed[n])
            link = d.links.get(req.source)
            options: list[tuple[Literal["kv", "recompute"], str]] = [("recompute", "prefill")]
            if link is not None:
                options.append(("kv", f"link:{req.source}"))
            for method, lane in options:
                at_s = lane_free_s.get((n, lane), busy_s[n])
                wait_s = max(0.0, slot_s - at_s)
                priced = choose_migration(
                    d.perf,
                    req.context_tokens,
                    link,
                    wait_s,
                    warm=warm,
                    step_s=d.step_s(placed[n], placed_context[n]) if warm else 0.0,
                    source_interval_s=req.interval_s,
                )
                choice = replace(priced, method=method)
                key = (
                    at_s > horizon_s,
                    choice.pause_s if at_s <= horizon_s else 0.0,
                    at_s + choice.done_s,
                )
                if best is None or key < best[0]:
                    best = (key, PlannedMove(req.id, d.name, choice, at_s))
        if best is None:
            return []
        move = best[1]
        n = next(k for k, d in enumerate(destinations) if d.name == move.destination)
        lane = "prefill" if move.choice.method == "recompute" else f"link:{req.source}"
        lane_free_s[(n, lane)] = move.at_s + move.choice.done_s
        placed[n] += 1
        placed_context[n] += req.context_tokens
        out.append(move)
    return out


def outlives(num_tokens_left: int, interval_s: float, deadline_s: float) -> bool:
    """Whether a request with `num_tokens_left` at one token per `interval_s` is still running
    at a drain deadline `deadline_s` away: it has to move anyway, so better at once, while
    the destinations still have the free slots that the drained instance's traffic is about
    to take."""
    return num_tokens_left * interval_s > deadline_s
