"""Candidate instances: a model's gear on concrete GPUs, evaluated once.

An instance is a chain of pipeline stages, each a tensor-parallel group. Evaluating one:
balance the layers over the stages (flexpipe.policies.partition, with stage costs taken from
the performance model), check the memory plan on the GPUs as they are now (free memory), then
walk the batch ladder and keep the largest concurrency whose TTFT and TPOT meet the SLOs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from flexpipe.cluster import Cluster, placement_on
from flexpipe.gears.gear import Gear, GpuSlot, Placement
from flexpipe.hardware import GiB, LinkSpec
from flexpipe.model_spec import ModelSpec
from flexpipe.perf import BatchShape, Efficiency, InfeasibleGear, PerfModel, memory_plan
from flexpipe.perf.efficiency import DEFAULT_EFFICIENCY
from flexpipe.perf.gear_lookup import GearEstimate, GearQuery
from flexpipe.perf.slo_capacity import SloShape, slo_rate_per_s
from flexpipe.policies.partition import InfeasiblePartition, StageCost, partition_layers
from flexpipe.policies.planner.memo import EvaluationMemo, Topology
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.types import ModelDemand, PlannerConfig


@dataclass(frozen=True, slots=True)
class Candidate:
    model_index: int
    stages: tuple[tuple[str, ...], ...]
    gear: Gear  # max_num_seqs = the chosen concurrency
    layers_per_stage: tuple[int, ...]
    estimate: GearEstimate
    capacity_tokens_per_s: float  # SLO-meeting, at target utilisation
    capacity_requests_per_s: float
    kv_capacity_tokens: int
    max_concurrency: int

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(g for s in self.stages for g in s)

    @property
    def num_gpus(self) -> int:
        return sum(map(len, self.stages))  # (the greedy asks it of every candidate it ranks)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.capacity_tokens_per_s / self.num_gpus


@dataclass(frozen=True, slots=True)
class Rejection:
    model_index: int
    stages: tuple[tuple[str, ...], ...]
    gear: Gear
    reason: str
    memory: bool = False  # rejected because it does not fit (more stages may help)

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(g for s in self.stages for g in s)


def describe(stages: tuple[tuple[str, ...], ...], gear: Gear) -> str:
    """`tp=2 on gpu1+gpu2`, `tp=1,pp=3 on gpu0 | gpu1 | gpu2` (stages split by |)."""
    shape = f"tp={gear.tp}" + (f",pp={gear.pp}" if gear.pp > 1 else "")
    if gear.dtype != "bf16":
        shape += f",{gear.dtype}"
    return f"{shape} on {' | '.join('+'.join(s) for s in stages)}"


class Evaluator:
    """Evaluates candidates for a cluster snapshot; caches what repeats across nodes, and
    (`memo`) across the plans of one controller."""

    def __init__(
        self,
        cluster: Cluster,
        demands: tuple[ModelDemand, ...],
        specs: tuple[ModelSpec, ...],
        performance: GearPerformance,
        config: PlannerConfig,
        efficiency: Efficiency | None = None,
        memo: EvaluationMemo | None = None,
    ) -> None:
        self.cluster = cluster
        self.demands = demands
        self.specs = specs
        self.performance = performance
        self.config = config
        self.efficiency = efficiency or DEFAULT_EFFICIENCY
        self.memo = memo
        if memo is not None:
            memo.bind(performance, config, self.efficiency)
        self._ladder = tuple(sorted(set(config.batch_ladder)))
        # (model index, dtype, stage hardware, free bytes) -> stage costs for the partitioner
        self._stage_costs: dict[tuple[object, ...], list[StageCost] | str] = {}
        # (model index, dtype, hardware signature) -> result for the first GPUs evaluated
        self._by_hardware: dict[tuple[object, ...], Candidate | Rejection] = {}
        topo = memo.topology(cluster) if memo is not None else Topology(cluster)
        self._tp_links: dict[tuple[str, ...], LinkSpec] = topo.tp_links
        self._pair_links: dict[tuple[str, str], LinkSpec] = topo.pair_links
        # model index -> (stages, dtype) -> result: the cluster is fixed, so is this (and so
        # across the plans a memo sees on this very cluster, for the same model shape)
        self._results = [
            topo.results.setdefault(
                (
                    m,
                    specs[m],
                    d.max_model_len,
                    d.input_tokens,
                    d.output_tokens,
                    d.slo,
                    *_burstiness(d, config),
                ),
                {},
            )
            for m, d in enumerate(demands)
        ]
        # GPU id -> (type, free bytes)
        self._free = topo.free()

    # -- partitioning ------------------------------------------------------------------

    def _probe(self, spec: ModelSpec, gear: Gear, placement: Placement, layers: int) -> PerfModel:
        probe_model = replace(spec, num_layers=layers * placement.pp)
        stages = tuple(replace(s, num_layers=layers) for s in placement.stages)
        probe = Placement(stages, placement.pp_links)
        return PerfModel(
            probe_model, gear, probe, self.efficiency, self.config.gpu_memory_utilization
        )

    def stage_costs(
        self, m: int, gear: Gear, placement: Placement, max_model_len: int
    ) -> list[StageCost] | str:
        """Per-stage costs for the partitioner, derived from two probe performance models
        (one and two layers per stage): time and memory are linear in a stage's layers."""
        key = (
            m,
            gear,
            tuple(
                (tuple((g.spec.name, g.free_bytes) for g in s.gpus), s.tp_link)
                for s in placement.stages
            ),
            placement.pp_links,
        )
        cached = self._stage_costs.get(key)
        if cached is not None:
            return cached
        spec = self.specs[m]
        one = self._probe(spec, gear, placement, 1)
        two = self._probe(spec, gear, placement, 2)
        demand = self.demands[m]
        micro = 16  # decode micro-batch the split is balanced for
        shape = BatchShape(
            num_decode_seqs=micro,
            decode_context_tokens=micro * demand.workload.mean_context_tokens,
        )
        try:
            t1, t2 = one.stage_times_s(shape), two.stage_times_s(shape)
        except InfeasibleGear as exc:
            self._stage_costs[key] = str(exc)
            return str(exc)
        costs: list[StageCost] = []
        tp = gear.tp
        for k in range(placement.pp):
            per_layer = max(t2[k] - t1[k], 1e-12)
            fixed = max(t1[k] - per_layer, 0.0)
            handoff = one.handoff_s(shape, placement.pp_links[k]) if k < placement.pp - 1 else 0.0
            max_layers = spec.num_layers
            for r in range(tp):
                g1 = one.memory.per_gpu[k * tp + r]
                g2 = two.memory.per_gpu[k * tp + r]
                w_layer = g2.weights_bytes - g1.weights_bytes
                kv_layer = g1.kv_bytes_per_token
                fixed_bytes = g1.weights_bytes - w_layer + g1.reserve_bytes
                room = g1.budget_bytes - fixed_bytes
                per = w_layer + kv_layer * max_model_len
                max_layers = min(max_layers, int(room // per) if room > 0 else 0)
            costs.append(StageCost(f"stage{k}", per_layer, max_layers, fixed, handoff))
        self._stage_costs[key] = costs
        return costs

    # -- evaluation --------------------------------------------------------------------

    def evaluate(
        self, m: int, stages: tuple[tuple[str, ...], ...], dtype: str
    ) -> Candidate | Rejection:
        results = self._results[m]
        key = (stages, dtype)
        cached = results.get(key)
        if cached is not None:
            return cached
        flat = [g for s in stages for g in s]
        if len(set(flat)) != len(flat) or any(g not in self._free for g in flat):
            result = self._evaluate(m, stages, dtype)  # an error names the GPUs
        else:
            # The result depends on the hardware only (types, free memory, links), and a large
            # cluster repeats the same few shapes: evaluate a shape once, rebind it to GPU ids.
            hardware = self.hardware(stages)
            sig = (m, dtype, hardware)
            hit = self._by_hardware.get(sig)
            if hit is None:
                result = self._by_hardware[sig] = self._first_of_shape(m, stages, dtype, hardware)
            elif isinstance(hit, Candidate) or not any(g in hit.reason for g in hit.gpu_ids):
                result = replace(hit, stages=stages)
            else:  # the reason names the GPUs it was about
                result = self._evaluate(m, stages, dtype)
        results[key] = result
        return result

    def _first_of_shape(
        self, m: int, stages: tuple[tuple[str, ...], ...], dtype: str, hardware: tuple[object, ...]
    ) -> Candidate | Rejection:
        """`_evaluate` of the first GPUs of a hardware shape in this plan, or the memo's
        evaluation of that shape (an earlier plan's) rebound to these GPUs and this model
        index, unless its reason names the GPUs it was about."""
        memo = self.memo
        if memo is None:
            return self._evaluate(m, stages, dtype)
        d = self.demands[m]
        key: tuple[object, ...] = (self.specs[m], d.max_model_len, d.input_tokens)
        key += (d.output_tokens, d.slo, dtype, hardware, *_burstiness(d, self.config))
        hit = memo.get(key)
        if hit is not None and (
            isinstance(hit, Candidate) or not any(g in hit.reason for g in hit.gpu_ids)
        ):
            return replace(hit, model_index=m, stages=stages)
        result = self._evaluate(m, stages, dtype)
        memo.put(key, result)
        return result

    def hardware(self, stages: tuple[tuple[str, ...], ...]) -> tuple[object, ...]:
        """What an evaluation depends on besides the model and precision: per stage its GPUs'
        types and free memory and its TP link; the links between consecutive stages."""
        shape = tuple(
            (tuple(self._free[g] for g in s), self.tp_link(s) if len(s) > 1 else None)
            for s in stages
        )
        links = tuple(
            min(
                (self._link(a, b) for a, b in zip(prev, nxt, strict=False)),
                key=lambda link: link.bandwidth_bytes_per_s,
            )
            for prev, nxt in itertools.pairwise(stages)
        )
        return shape, links

    def _link(self, a: str, b: str) -> LinkSpec:
        link = self._pair_links.get((a, b))
        if link is None:
            link = self._pair_links[(a, b)] = self.cluster.link_between(a, b)
        return link

    def _evaluate(
        self, m: int, stages: tuple[tuple[str, ...], ...], dtype: str
    ) -> Candidate | Rejection:
        spec = self.specs[m]
        demand = self.demands[m]
        tp, pp = len(stages[0]), len(stages)
        top = max(self._ladder)
        gear = Gear(tp=tp, pp=pp, dtype=dtype, max_num_seqs=top)
        if spec.num_heads % tp:
            return Rejection(m, stages, gear, f"tp={tp} does not divide {spec.num_heads} heads")
        if pp > spec.num_layers:
            return Rejection(m, stages, gear, f"pp={pp} exceeds {spec.num_layers} layers")
        try:
            placement = placement_on(self.cluster, stages, spec.num_layers)
        except ValueError as exc:
            return Rejection(m, stages, gear, str(exc))
        model_len = demand.max_model_len or min(
            spec.max_position_embeddings, self.efficiency.default_max_model_len
        )
        if pp > 1:
            costs = self.stage_costs(m, gear, placement, model_len)
            if isinstance(costs, str):
                return Rejection(m, stages, gear, costs)
            try:
                split = partition_layers(spec.num_layers, costs).layers_per_stage
            except InfeasiblePartition as exc:
                return Rejection(m, stages, gear, f"layers do not fit: {exc}", memory=True)
            placement = Placement(
                tuple(
                    replace(s, num_layers=n) for s, n in zip(placement.stages, split, strict=True)
                ),
                placement.pp_links,
            )
        mem = memory_plan(
            spec, gear, placement, self.efficiency, self.config.gpu_memory_utilization, model_len
        )
        if not mem.feasible:
            return Rejection(m, stages, gear, mem.reason or "does not fit", memory=True)
        context = demand.input_tokens + demand.output_tokens
        max_concurrency = mem.max_batch(context)
        # The largest concurrency on the ladder whose TTFT and TPOT meet the SLOs: both grow
        # with the batch, so the feasible batches are a prefix of the ladder (binary search).
        ladder = [b for b in self._ladder if b <= max_concurrency]
        if not ladder:
            reason = f"KV for {context}-token sequences fits only {max_concurrency} at once"
            return Rejection(m, stages, gear, reason)
        slo = demand.slo

        def at(batch: int) -> GearEstimate:
            query = GearQuery.of(spec, replace(gear, max_num_seqs=batch), placement)
            return self.performance.estimate(query, demand.workload)

        def meets(est: GearEstimate) -> bool:
            return est.tpot_s <= slo.tpot_p99_s and est.ttft_s <= slo.ttft_p99_s

        try:
            one = best = at(ladder[0])
            if not meets(best):
                return Rejection(m, stages, gear, _slo_miss(best, slo.tpot_p99_s, slo.ttft_p99_s))
            lo, hi = 0, len(ladder)  # ladder[lo] meets the SLOs; ladder[hi:] do not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                est = at(ladder[mid])
                if meets(est):
                    lo = mid
                    if est.requests_per_s > best.requests_per_s:
                        best = est
                else:
                    hi = mid
            capacity = self.capacity_per_s(m, best, one)
            if self.config.sizing == "slo":
                # The queue's tail, not the throughput, decides: a smaller batch (shorter
                # steps, more TPOT headroom) may take more requests/s within the SLOs (the
                # three below the largest: further down the throughput falls away).
                for b in ladder[max(0, lo - 3) : lo]:
                    est = at(b)
                    rate = self.capacity_per_s(m, est, one)
                    if rate > capacity:
                        best, capacity = est, rate
        except InfeasibleGear as exc:
            return Rejection(m, stages, gear, str(exc))
        if capacity <= 0:
            return Rejection(m, stages, gear, _queue_miss(best))
        return Candidate(
            model_index=m,
            stages=stages,
            gear=replace(gear, max_num_seqs=best.batch),
            layers_per_stage=tuple(s.num_layers for s in placement.stages),
            estimate=best,
            capacity_tokens_per_s=best.output_tokens_per_s * capacity / best.requests_per_s,
            capacity_requests_per_s=capacity,
            kv_capacity_tokens=mem.kv_capacity_tokens,
            max_concurrency=max_concurrency,
        )

    def capacity_per_s(self, m: int, est: GearEstimate, one: GearEstimate | None) -> float:
        """The requests/s an instance with figures `est` (and `one`, its figures at
        concurrency 1) is planned to serve: by `config.sizing`, its throughput at
        `target_utilization`, or the arrival rate at which it meets the SLOs
        (flexpipe.perf.slo_capacity, with the demand's burstiness)."""
        if self.config.sizing == "throughput" or one is None:
            return est.requests_per_s * self.config.target_utilization
        demand = self.demands[m]
        shape = SloShape(
            batch=est.batch,
            requests_per_s=est.requests_per_s,
            ttft_full_s=est.ttft_s,
            tpot_full_s=est.tpot_s,
            tpot_one_s=one.tpot_s,
            output_tokens=demand.output_tokens,
        )
        slo = demand.slo
        return slo_rate_per_s(shape, slo.ttft_p99_s, slo.tpot_p99_s, demand.arrival_cv2)

    def evaluate_as_is(
        self,
        m: int,
        stages: tuple[tuple[str, ...], ...],
        gear: Gear,
        layers: tuple[int, ...],
        gpu_memory_fraction: float | None = None,
    ) -> Candidate | Rejection:
        """A running instance on the GPUs as they are now, unchanged (its gear, its batch, its
        layer split, its memory fraction when it shares its GPU: `gpu_memory_fraction`): a
        Candidate when it still fits (memory plan, KV for its batch, SLOs at its batch alone),
        else why not. Not cached: called once per running instance."""
        spec = self.specs[m]
        demand = self.demands[m]
        flat = [g for s in stages for g in s]
        if any(g not in self._free for g in flat):
            missing = ", ".join(g for g in flat if g not in self._free)
            return Rejection(m, stages, gear, f"{missing} no longer in the cluster")
        if spec.num_heads % gear.tp or len(stages) != gear.pp or sum(layers) != spec.num_layers:
            return Rejection(m, stages, gear, "gear and stages do not match the model")
        try:
            placement = placement_on(self.cluster, stages, spec.num_layers, layers)
        except ValueError as exc:
            return Rejection(m, stages, gear, str(exc))
        model_len = demand.max_model_len or min(
            spec.max_position_embeddings, self.efficiency.default_max_model_len
        )
        # The memory plan as `evaluate` makes it (at the ladder's top), so that an unchanged
        # instance on unchanged GPUs comes out exactly as it was planned.
        mem = memory_plan(
            spec,
            replace(gear, max_num_seqs=max(self._ladder)),
            placement,
            self.efficiency,
            gpu_memory_fraction or self.config.gpu_memory_utilization,
            model_len,
        )
        if not mem.feasible:
            return Rejection(m, stages, gear, mem.reason or "does not fit", memory=True)
        context = demand.input_tokens + demand.output_tokens
        max_concurrency = mem.max_batch(context)
        if max_concurrency < gear.max_num_seqs:
            reason = (
                f"KV for {context}-token sequences fits only {max_concurrency} at once "
                f"(batch {gear.max_num_seqs})"
            )
            return Rejection(m, stages, gear, reason, memory=True)
        query = GearQuery.of(spec, gear, placement)
        try:
            est = self.performance.estimate(query, demand.workload)
        except InfeasibleGear as exc:
            return Rejection(m, stages, gear, str(exc))
        slo = demand.slo
        if est.tpot_s > slo.tpot_p99_s or est.ttft_s > slo.ttft_p99_s:
            return Rejection(m, stages, gear, _slo_miss(est, slo.tpot_p99_s, slo.ttft_p99_s))
        one = None
        if self.config.sizing == "slo":
            try:
                one = self.performance.estimate(
                    GearQuery.of(spec, replace(gear, max_num_seqs=1), placement), demand.workload
                )
            except InfeasibleGear as exc:
                return Rejection(m, stages, gear, str(exc))
        capacity = self.capacity_per_s(m, est, one)
        if capacity <= 0:
            return Rejection(m, stages, gear, _queue_miss(est))
        return Candidate(
            model_index=m,
            stages=stages,
            gear=gear,
            layers_per_stage=layers,
            estimate=est,
            capacity_tokens_per_s=est.output_tokens_per_s * capacity / est.requests_per_s,
            capacity_requests_per_s=capacity,
            kv_capacity_tokens=mem.kv_capacity_tokens,
            max_concurrency=max_concurrency,
        )

    def tp_link(self, ids: tuple[str, ...]) -> LinkSpec | None:
        if len(ids) < 2:
            return None
        link = self._tp_links.get(ids)
        if link is None:
            link = self._tp_links[ids] = self.cluster.slowest_link(ids)
        return link


def _burstiness(demand: ModelDemand, config: PlannerConfig) -> tuple[float, ...]:
    """What of the demand's burstiness an evaluation depends on: nothing unless sized at the
    SLO."""
    return (demand.arrival_cv2,) if config.sizing == "slo" else ()


def _slo_miss(est: GearEstimate, tpot_slo_s: float, ttft_slo_s: float) -> str:
    if est.tpot_s > tpot_slo_s:
        return (
            f"TPOT p99 at batch {est.batch} is {est.tpot_s * 1e3:.1f} ms > SLO "
            f"{tpot_slo_s * 1e3:.0f} ms"
        )
    return (
        f"TTFT p99 at batch {est.batch} is {est.ttft_s * 1e3:.0f} ms > SLO "
        f"{ttft_slo_s * 1e3:.0f} ms"
    )


def _queue_miss(est: GearEstimate) -> str:
    return (
        f"at batch {est.batch} no arrival rate meets the SLOs with queueing "
        f"(TTFT {est.ttft_s * 1e3:.0f} ms, TPOT {est.tpot_s * 1e3:.1f} ms at full load)"
    )


def slot_summary(slot: GpuSlot) -> str:
    return f"{slot.name} ({slot.spec.name}, {slot.free_bytes / GiB:.0f} GiB free)"


__all__ = ["Candidate", "Evaluator", "Rejection", "describe", "slot_summary"]
