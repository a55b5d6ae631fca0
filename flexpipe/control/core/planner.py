"""The controller's planner (pure): `plan` with the gear table, for the GPUs free now, with
one memo of the planner's evaluations kept across re-plans (a tick re-plans often, mostly for
the same GPUs and demand). The live controller's and the simulator's, and what the shift
policy and the standby check (`placeable`) call."""

from __future__ import annotations

from collections.abc import Sequence

from flexpipe.cluster import Cluster
from flexpipe.perf import Efficiency
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import ModelDemand, Plan, PlannedInstance, PlannerConfig, plan
from flexpipe.policies.planner.memo import EvaluationMemo
from flexpipe.policies.planner.sharing import pack_running

__all__ = ["ControllerPlanner"]


class ControllerPlanner:
    def __init__(
        self,
        performance: GearLookup,
        efficiency: Efficiency | None = None,
        config: PlannerConfig | None = None,
    ) -> None:
        """`performance`: the gear table (the store's points, or the built-in one);
        `config`: the planner's knobs (None: its defaults)."""
        self.performance = performance
        self.efficiency = efficiency
        self.config = config
        self.memo = EvaluationMemo()

    def __call__(
        self, cluster: Cluster, demands: Sequence[ModelDemand], now_s: float = 0.0
    ) -> Plan:
        """Planned fresh for `cluster`. The running plan is not passed (`plan(running=...)`
        keeps what runs unless replacing it gains more than a margin at the demand as
        measured): the shift policy prices each candidate against the running plan itself,
        at the current and the expected load, so a bigger KV cache that pays only at the
        expected load (the seed's freed gpu1) is still found."""
        return plan(
            cluster,
            demands,
            self.performance,
            config=self.config,
            now_s=now_s,
            efficiency=self.efficiency,
            memo=self.memo,
        )

    def pack(
        self,
        cluster: Cluster,
        demands: Sequence[ModelDemand],
        instances: Sequence[PlannedInstance],
        spare: Sequence[str],
    ) -> tuple[PlannedInstance, ...] | None:
        """`instances` with small models packed onto shared GPUs (`share_gpus`,
        docs/gpu-sharing.md), on `spare` GPUs where it can; None when the option is off or
        nothing packs (the shift policy's `packed` candidate)."""
        if self.config is None or not self.config.share_gpus:
            return None
        return pack_running(
            cluster, demands, instances, spare, self.performance, self.config, self.efficiency
        )
