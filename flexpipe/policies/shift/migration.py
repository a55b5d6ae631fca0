"""What moving a running request costs, from the one performance model (flexpipe.perf).

A request still running when its instance is drained either has its KV cache moved to the
successor instance (bytes over the link between them) or is continued there by recomputing
the prefill of its context; it pauses for the cheaper of the two (seed 000 §3.1, issue 9 §4).
flexpipe.perf has both times (`kv_transfer_s`, `prefill_s`); the choice between them and the
link between two instances are new here. The controller can call `choose_migration` per
request at its drain deadline; the pricing calls it for the mean context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flexpipe.cluster import Cluster, ClusterError, placement_on
from flexpipe.hardware import LinkSpec
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import Efficiency, PerfModel
from flexpipe.policies.planner import PlannedInstance

__all__ = ["MigrationChoice", "choose_migration", "link_between", "perf_model_of"]


@dataclass(frozen=True, slots=True)
class MigrationChoice:
    method: Literal["kv", "recompute"]
    kv_move_s: float | None  # None: no link to move it over (shared GPUs, source gone)
    recompute_s: float

    @property
    def pause_s(self) -> float:
        """How long the request stops producing tokens."""
        if self.method == "kv" and self.kv_move_s is not None:
            return self.kv_move_s
        return self.recompute_s


def perf_model_of(
    cluster: Cluster, instance: PlannedInstance, efficiency: Efficiency | None = None
) -> PerfModel:
    """The performance model of a planned instance on the cluster as it is now."""
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


def choose_migration(
    target: PerfModel, context_tokens: int, link: LinkSpec | None
) -> MigrationChoice:
    """Move the KV of `context_tokens` over `link` or recompute it on `target`, whichever is
    faster (KV bytes per token are the target's: its precision is what lands there)."""
    recompute_s = target.prefill_s(context_tokens)
    if link is None:
        return MigrationChoice("recompute", None, recompute_s)
    kv_s = target.kv_transfer_s(context_tokens, link.bandwidth_bytes_per_s, link.latency_s)
    return MigrationChoice("kv" if kv_s < recompute_s else "recompute", kv_s, recompute_s)
