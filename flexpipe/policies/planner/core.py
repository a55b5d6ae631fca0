"""The planner: which instances (model, gear, concrete GPUs) to run on the free GPUs now.

Objective: maximise priority-weighted goodput, `sum over models of priority x min(request
rate, SLO-meeting capacity)` in requests/s, with every model at its `min_instances` where the
GPUs allow (highest priority first); then the fewest GPUs. With a running plan, instances of
it that still fit are kept unless replacing them gains more than `replace_margin`
(`sticky.py`).

Method (lazy greedy over candidates generated per node; see docs/planner.md):

1. Usable GPUs: some memory free, and free for at least `min_lease_s` more.
2. Per node, per model and precision, candidates: for each TP size, the best TP group of every
   fast-link domain (TP never crosses a slow link); when no single group fits, pipeline chains
   of the node's best groups (layers balanced by the partitioner), the smallest `pp` that fits
   and one more. Each is evaluated once (`Evaluator`): memory plan, batch ladder, SLOs.
3. Minimums first (highest priority first): each model below `min_instances` takes its best
   candidate. Then repeatedly take the candidate with the highest *marginal* value per GPU,
   `priority x min(capacity, unmet rate) / num_gpus`, re-generating the candidates of the node
   it used. Values only fall as demand gets covered, so stale heap entries are re-scored lazily.

Pure: no I/O, no clock (`now` is an argument), no randomness.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from flexpipe.cluster import Cluster
from flexpipe.gears.lookup import GearLookup
from flexpipe.hardware import GB
from flexpipe.model_spec import ModelSpec, load_model_spec
from flexpipe.perf import Efficiency
from flexpipe.policies.planner.candidates import Candidate, Evaluator, Rejection, describe
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.relaxation import Relaxation, solve_relaxation
from flexpipe.policies.planner.sticky import keep_running, switch_where_it_pays
from flexpipe.policies.planner.types import (
    Alternative,
    Baseline,
    InstanceChange,
    ModelDemand,
    ModelOutcome,
    Plan,
    PlannedInstance,
    PlannerConfig,
    UnusedGpu,
)

__all__ = ["plan", "plan_score", "single_group_baseline", "usable_gpus"]

_TP_SIZES = (1, 2, 4, 8)


def usable_gpus(
    cluster: Cluster, now_s: float, config: PlannerConfig
) -> tuple[list[str], list[UnusedGpu]]:
    """GPUs the planner may use, and why each other one is left out."""
    usable: list[str] = []
    unused: list[UnusedGpu] = []
    for gpu in cluster.gpus:
        if gpu.free_bytes <= 0:
            owner = f" by {gpu.owner}" if gpu.owner else ""
            unused.append(UnusedGpu(gpu.id, f"fully held{owner}"))
        elif gpu.free_until_s is not None and gpu.free_until_s - now_s < config.min_lease_s:
            left = max(0.0, gpu.free_until_s - now_s)
            unused.append(
                UnusedGpu(
                    gpu.id,
                    f"free only {left:.0f} s more (< min_lease_s {config.min_lease_s:.0f} s)",
                )
            )
        else:
            usable.append(gpu.id)
    return usable, unused


@dataclass
class _NodeState:
    name: str
    domains: list[list[str]]  # fast-link domains restricted to this node, usable GPUs
    version: int = 0
    candidates: list[Candidate] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)


class _Planner:
    def __init__(
        self,
        cluster: Cluster,
        demands: tuple[ModelDemand, ...],
        performance: GearPerformance,
        config: PlannerConfig,
        now_s: float,
        efficiency: Efficiency | None,
        evaluator: Evaluator | None = None,
        prices: Sequence[float] | None = None,
    ) -> None:
        self.cluster = cluster
        self.demands = demands
        self.config = config
        self.specs: tuple[ModelSpec, ...] = tuple(load_model_spec(d.model) for d in demands)
        self.evaluator = evaluator or Evaluator(
            cluster, demands, self.specs, performance, config, efficiency
        )
        # model index -> price of one of its tokens/s in the greedy's order (1: at face value)
        self.prices = list(prices) if prices is not None else [1.0] * len(demands)
        self.usable, self.unused = usable_gpus(cluster, now_s, config)
        usable = set(self.usable)
        self.free_bytes = {g: cluster.gpu(g).free_bytes for g in self.usable}
        self.nodes: dict[str, _NodeState] = {}
        for domain in cluster.fast_domains(config.fast_link_bytes_per_s):
            # A domain spanning nodes is split per node (TP stays inside a node).
            per_node: dict[str, list[str]] = {}
            for gid in domain:
                if gid in usable:
                    per_node.setdefault(cluster.gpu(gid).node, []).append(gid)
            for node, ids in per_node.items():
                self.nodes.setdefault(node, _NodeState(node, [])).domains.append(ids)
        # model index -> SLO-meeting requests/s still to serve; instances chosen; its minimum
        self.remaining = [d.request_rate_per_s for d in demands]
        self.counts = [0] * len(demands)
        self.min_counts = [d.min_instances for d in demands]
        self.initial: list[Candidate] = []  # every node's candidates before the greedy ran
        self.fixed: dict[int, str] = {}  # id(candidate) -> why it was fixed before the greedy
        self.pinned: set[int] = set()  # id(candidate): kept running instances, never altered
        self.notes: list[str] = []

    # -- candidates ----------------------------------------------------------------------

    def _sorted(self, ids: list[str]) -> list[str]:
        return sorted(ids, key=lambda g: (-self.free_bytes[g], g))

    def generate(self, state: _NodeState) -> None:
        state.candidates = []
        state.rejections = []
        domains = [self._sorted(d) for d in state.domains if d]
        if not domains:
            return
        largest = max(len(d) for d in domains)
        total = sum(len(d) for d in domains)
        for m, demand in enumerate(self.demands):
            if self.remaining[m] <= 0 and self.counts[m] >= self.min_counts[m]:
                continue
            for dtype in demand.dtypes:
                for tp in _TP_SIZES:
                    if tp > largest or self.specs[m].num_heads % tp:
                        continue
                    self._generate_tp(state, m, dtype, tp, domains, total)

    def _generate_tp(
        self,
        state: _NodeState,
        m: int,
        dtype: str,
        tp: int,
        domains: list[list[str]],
        total: int,
    ) -> None:
        seen: set[tuple[object, ...]] = set()
        for d in domains:
            if len(d) < tp:
                continue
            group = tuple(d[:tp])
            sig = (
                tuple((self.cluster.gpu(g).type, self.free_bytes[g]) for g in group),
                self.evaluator.tp_link(group),
            )
            if sig in seen:
                continue
            seen.add(sig)
            result = self.evaluator.evaluate(m, (group,), dtype)
            if isinstance(result, Candidate):
                state.candidates.append(result)
            else:
                state.rejections.append(result)
        # Pipeline chains of the node's best groups, even when one group fits: more stages
        # pool memory for KV (larger batches), and small fragments become useful.
        groups = [tuple(d[i * tp : (i + 1) * tp]) for d in domains for i in range(len(d) // tp)]
        groups.sort(key=lambda grp: (-min(self.free_bytes[g] for g in grp), grp))
        for pp in range(2, self.config.max_pp + 1):
            if pp > len(groups) or pp * tp > total:
                break
            result = self.evaluator.evaluate(m, tuple(groups[:pp]), dtype)
            if isinstance(result, Candidate):
                state.candidates.append(result)
            else:
                state.rejections.append(result)
                if not result.memory:
                    break

    def pool(self) -> list[Candidate]:
        """Candidates for the LP relaxation: per node, every model x precision x tp x pp on
        aligned blocks of the node's GPUs (sorted by free memory inside each fast domain):
        TP groups are consecutive `tp` GPUs of a domain, chains consecutive `pp` groups, so
        that disjoint blocks let the LP mix shapes like a buddy allocator (a tp=4 block, a
        tp=2 pair and two singles)."""
        out: dict[tuple[object, ...], Candidate] = {}

        def add_chain(m: int, chain: tuple[tuple[str, ...], ...]) -> None:
            if len(chain) > 1 and len({g for grp in chain for g in grp}) < sum(map(len, chain)):
                return  # overlapping groups (small clusters offer both ends of a domain)
            for dtype in self.demands[m].dtypes:
                if (m, chain, dtype) not in out:
                    result = self.evaluator.evaluate(m, chain, dtype)
                    if isinstance(result, Candidate):
                        out[(m, chain, dtype)] = result

        def add(m: int, groups: list[tuple[str, ...]], aligned: bool) -> None:
            for pp in range(1, self.config.max_pp + 1):
                for start in range(0, len(groups) - pp + 1, pp if aligned else 1):
                    add_chain(m, tuple(groups[start : start + pp]))

        def by_free(groups: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
            return sorted(groups, key=lambda grp: (-min(self.free_bytes[g] for g in grp), grp))

        # Up to max_cross_node_gpus, chains of every window of the cluster's groups (by free
        # memory) too: two nodes' fragments in one pipeline can be the best instance there is;
        # up to max_subset_gpus, every set of groups.
        cross = len(self.usable) <= self.config.max_cross_node_gpus
        for m in range(len(self.demands)):
            if self.remaining[m] <= 0 and self.min_counts[m] == 0:
                continue
            everywhere: list[tuple[str, ...]] = []
            tails: list[tuple[str, ...]] = []
            for tp in _TP_SIZES:
                if self.specs[m].num_heads % tp:
                    continue
                for state in self.nodes.values():
                    domains = [self._sorted(d) for d in state.domains if d]
                    groups = [
                        tuple(d[i * tp : (i + 1) * tp])
                        for d in domains
                        for i in range(len(d) // tp)
                    ]
                    add(m, groups, aligned=True)
                    add(m, by_free(groups), aligned=True)
                    everywhere.extend(groups)
                    # Small clusters: also the groups taken from the least free end of each
                    # domain (three GPUs with 80, 11 and 11 GiB free: 11+11 is a group too).
                    tails.extend(
                        tuple(d[len(d) - (i + 1) * tp : len(d) - i * tp])
                        for d in domains
                        for i in range(len(d) // tp)
                    )
                if len(self.usable) <= self.config.max_subset_gpus:
                    # Small clusters: every set of up to max_pp groups, as chains that cross
                    # each node boundary once (every order of the nodes; by free memory inside
                    # a node): hand-offs over the network are the slow ones, and which node
                    # holds the embedding or the lm_head matters for memory.
                    ordered = by_free([*everywhere, *(t for t in tails if t not in everywhere)])
                    for pp in range(1, self.config.max_pp + 1):
                        for chain in itertools.combinations(ordered, pp):
                            blocks: dict[str, list[tuple[str, ...]]] = {}
                            for grp in chain:
                                blocks.setdefault(self.cluster.gpu(grp[0]).node, []).append(grp)
                            for nodes in itertools.permutations(blocks):
                                add_chain(m, tuple(g for n in nodes for g in blocks[n]))
                elif cross:
                    add(m, by_free(everywhere), aligned=False)
                    add(m, by_free(tails), aligned=False)
                everywhere = []
                tails = []
        return list(out.values())

    # -- greedy ----------------------------------------------------------------------------

    def value(self, c: Candidate) -> float:
        """Marginal priority-weighted goodput per GPU (requests/s)."""
        m = c.model_index
        served = min(c.capacity_requests_per_s, self.remaining[m])
        return self.demands[m].priority * served / c.num_gpus

    def priced(self, c: Candidate) -> float:
        """The greedy's order: marginal value per GPU at the model's price."""
        return self.prices[c.model_index] * self.value(c)

    def take(self, c: Candidate) -> None:
        """Serve with `c`: its GPUs leave its node state, its capacity covers demand."""
        m = c.model_index
        self.remaining[m] -= min(c.capacity_requests_per_s, self.remaining[m])
        self.counts[m] += 1
        taken = set(c.gpu_ids)
        for node in {self.cluster.gpu(g).node for g in taken}:  # a chain may cross nodes
            state = self.nodes[node]
            state.domains = [[g for g in d if g not in taken] for d in state.domains]
            state.version += 1

    def run(
        self,
        fixed: Sequence[tuple[Candidate, str]] = (),
        others: dict[str, list[Candidate]] | None = None,
    ) -> list[tuple[Candidate, list[Alternative]]]:
        """The greedy, after taking the `fixed` instances (each with why it was fixed; `others`:
        node -> the candidates they were chosen among, for their explanations), then the
        local search."""
        heap: list[tuple[float, int, int, str, int, Candidate]] = []
        counter = itertools.count()
        chosen: list[tuple[Candidate, list[Alternative]]] = []
        for c, reason in fixed:
            self.fixed[id(c)] = reason
            state = self.nodes[self._node_of(c)]
            if others is None:
                self.generate(state)
            else:
                state.candidates, state.rejections = others.get(state.name, []), []
            alternatives = self.alternatives(c, state, reason)
            chosen.append((c, alternatives))
            self.take(c)
        self.take_minimums(chosen)

        def push(state: _NodeState) -> None:
            for c in state.candidates:
                v = self.priced(c)
                if v > 0:
                    entry = (-v, c.num_gpus, next(counter), state.name, state.version, c)
                    heapq.heappush(heap, entry)

        for state in self.nodes.values():
            self.generate(state)
            self.initial.extend(state.candidates)
            push(state)
        while heap:
            neg, _, _, node, version, c = heapq.heappop(heap)
            state = self.nodes[node]
            if version != state.version:
                continue
            v = self.priced(c)
            if v <= 0:
                continue
            if v < -neg * (1 - 1e-12):
                heapq.heappush(heap, (-v, c.num_gpus, next(counter), node, version, c))
                continue
            alternatives = self.alternatives(c, state)
            chosen.append((c, alternatives))
            self.take(c)
            self.generate(state)
            push(state)
        self.absorb_leftovers(chosen)
        return chosen

    def take_minimums(self, chosen: list[tuple[Candidate, list[Alternative]]]) -> None:
        """Every model below its minimum takes a candidate, highest priority first, until it
        is at its minimum or nothing of it fits the GPUs left: the fewest GPUs (a minimum is
        about being served at all, and a small footprint leaves room for the next model's
        minimum), then value per GPU, then capacity. The greedy, the local search and the LP
        round then decide where the capacity goes."""
        order = sorted(range(len(self.demands)), key=lambda m: (-self.demands[m].priority, m))
        for m in order:
            while self.counts[m] < self.min_counts[m]:
                best: tuple[tuple[int, float, float, int], Candidate, _NodeState] | None = None
                for state in self.nodes.values():
                    self.generate(state)
                    for k, c in enumerate(state.candidates):
                        if c.model_index != m:
                            continue
                        key = (c.num_gpus, -self.value(c), -c.capacity_requests_per_s, k)
                        if best is None or key < best[0]:
                            best = (key, c, state)
                if best is None:
                    d = self.demands[m]
                    self.notes.append(
                        f"{d.name}: minimum of {d.min_instances} instance(s) not met, "
                        f"{self.counts[m]} fit on the GPUs left"
                    )
                    break
                _, c, state = best
                reason = f"{self.demands[m].name}'s minimum of {self.min_counts[m]} instance(s)"
                self.fixed[id(c)] = reason
                chosen.append((c, self.alternatives(c, state, reason)))
                self.take(c)

    def absorb_leftovers(self, chosen: list[tuple[Candidate, list[Alternative]]]) -> None:
        """Local search after the greedy, per node. Value per GPU can strand a fragment (a GPU
        too small to serve alone) or keep two small instances apart whose memory, pooled in one
        pipeline, holds far larger batches. Moves: extend an instance with left-over groups as
        extra stages; merge two instances of one model (and tp) into one chain. The best
        improving move is applied until none improves the served demand."""
        capacity = [0.0] * len(self.demands)
        for c, _ in chosen:
            capacity[c.model_index] += c.capacity_requests_per_s
        demand = [d.request_rate_per_s for d in self.demands]
        # node -> evaluated moves (instances replaced, the result, a label); a node's moves are
        # re-evaluated only when a move changed it (gains are re-scored every round).
        moves: dict[str, list[tuple[tuple[Candidate, ...], Candidate, str]]] = {}
        dirty = {self._node_of(c) for c, _ in chosen}
        while True:
            for node in dirty:
                moves[node] = self._moves(
                    node,
                    [c for c, _ in chosen if self._node_of(c) == node and id(c) not in self.pinned],
                )
            dirty = set()
            best: tuple[float, tuple[Candidate, ...], Candidate, str] | None = None
            for node_moves in moves.values():
                for members, result, label in node_moves:
                    m = result.model_index
                    if self.counts[m] - len(members) + 1 < self.min_counts[m]:
                        continue  # a merge would take the model below its minimum
                    served = min(demand[m], capacity[m])
                    removed = sum(c.capacity_requests_per_s for c in members)
                    gain = min(demand[m], capacity[m] - removed + result.capacity_requests_per_s)
                    gain = (gain - served) * self.demands[m].priority
                    if gain > 1e-6 * max(1e-3, served) and (best is None or gain > best[0]):
                        best = (gain, members, result, label)
            if best is None:
                break
            gain, members, result, label = best
            old = [(c, alts) for c, alts in chosen if any(c is x for x in members)]
            notes = [
                Alternative(
                    describe(c.stages, c.gear) + f" batch {c.estimate.batch}",
                    c.gpu_ids,
                    c.tokens_per_s_per_gpu,
                    f"replaced: {label}, +{gain:.3g} weighted req/s served",
                )
                for c, _ in old
            ]
            alternatives = [a for _, alts in old for a in alts]
            chosen[:] = [(c, alts) for c, alts in chosen if not any(c is x for x in members)]
            chosen.append((result, notes + alternatives))
            m = result.model_index
            capacity[m] += result.capacity_requests_per_s - sum(
                c.capacity_requests_per_s for c in members
            )
            self.counts[m] += 1 - len(members)
            node = self._node_of(result)
            state = self.nodes[node]
            taken = set(result.gpu_ids)
            state.domains = [[g for g in d if g not in taken] for d in state.domains]
            dirty.add(node)
        self.remaining = [max(0.0, d - cap) for d, cap in zip(demand, capacity, strict=True)]

    def _node_of(self, c: Candidate) -> str:
        return self.cluster.gpu(c.gpu_ids[0]).node

    def _moves(
        self, node: str, instances: list[Candidate]
    ) -> list[tuple[tuple[Candidate, ...], Candidate, str]]:
        state = self.nodes[node]
        max_pp = self.config.max_pp
        out: list[tuple[tuple[Candidate, ...], Candidate, str]] = []
        for c in instances:
            m, tp = c.model_index, c.gear.tp
            groups = [
                tuple(d[i * tp : (i + 1) * tp])
                for d in (self._sorted(d) for d in state.domains if d)
                for i in range(len(d) // tp)
            ]
            groups.sort(key=lambda grp: (-min(self.free_bytes[g] for g in grp), grp))
            tried: list[tuple[tuple[Candidate, ...], tuple[tuple[str, ...], ...], str]] = []
            for extra in range(1, min(max_pp - c.gear.pp, len(groups)) + 1):
                added = ", ".join(g for grp in groups[:extra] for g in grp)
                tried.append(((c,), (*c.stages, *groups[:extra]), f"extended with {added}"))
            for other in instances:
                if (
                    other is c
                    or other.model_index != m
                    or other.gear.tp != tp
                    or c.gear.pp + other.gear.pp > max_pp
                ):
                    continue
                merged = "+".join(other.gpu_ids)
                tried.append(((c, other), (*c.stages, *other.stages), f"merged with {merged}"))
                wide = (*c.gpu_ids, *other.gpu_ids)
                if (
                    c.gear.pp == other.gear.pp == 1
                    and self.specs[m].num_heads % len(wide) == 0
                    and self.cluster.slowest_link(wide).bandwidth_bytes_per_s
                    >= self.config.fast_link_bytes_per_s
                ):
                    tried.append(((c, other), (wide,), f"joined with {merged} as tp={len(wide)}"))
            for members, stages, label in tried:
                result = self.evaluator.evaluate(m, stages, c.gear.dtype)
                if isinstance(result, Candidate):
                    out.append((members, result, label))
        return out

    # -- explanations --------------------------------------------------------------------

    def alternatives(
        self, chosen: Candidate, state: _NodeState, fixed_reason: str | None = None
    ) -> list[Alternative]:
        value = self.value(chosen)
        out: list[Alternative] = []
        others = sorted(
            (
                c
                for c in state.candidates
                if c.model_index == chosen.model_index and c is not chosen
            ),
            key=lambda c: -self.value(c),
        )
        for c in others:
            v = self.value(c)
            reason = f"{v:.3g} weighted req/s per GPU < {value:.3g}"
            if fixed_reason is not None:
                reason = f"{v:.3g} weighted req/s per GPU (this one: {value:.3g}); {fixed_reason}"
            elif v >= value * (1 - 1e-12):
                reason = f"{v:.3g} weighted req/s per GPU, tie: fewer GPUs or earlier wins"
            out.append(
                Alternative(
                    describe(c.stages, c.gear) + f" batch {c.estimate.batch}",
                    c.gpu_ids,
                    c.tokens_per_s_per_gpu,
                    reason,
                )
            )
        for r in state.rejections:
            if r.model_index == chosen.model_index:
                out.append(Alternative(describe(r.stages, r.gear), r.gpu_ids, None, r.reason))
        out = out[: self.config.max_alternatives]
        out.extend(self.slow_tp_alternatives(chosen))
        return out

    def slow_tp_alternatives(self, chosen: Candidate) -> list[Alternative]:
        """On small clusters, what TP across a slow link would have given (not allowed)."""
        if len(self.usable) > self.config.max_baseline_gpus or chosen.gear.pp > 1:
            return []
        group = chosen.gpu_ids
        tp = 2 * chosen.gear.tp
        outside = [g for g in self._sorted(list(self.free_bytes)) if g not in group]
        if len(group) + len(outside) < tp or self.specs[chosen.model_index].num_heads % tp:
            return []
        wider = (*group, *outside[: tp - len(group)])
        link = self.cluster.slowest_link(wider)
        if link.bandwidth_bytes_per_s >= self.config.fast_link_bytes_per_s:
            return []
        result = self.evaluator.evaluate(chosen.model_index, (wider,), chosen.gear.dtype)
        numbers = (
            f"would give {result.tokens_per_s_per_gpu:.0f} tok/s per GPU; "
            if isinstance(result, Candidate)
            else f"{result.reason}; "
        )
        return [
            Alternative(
                describe((wider,), replace(chosen.gear, tp=tp)),
                wider,
                result.tokens_per_s_per_gpu if isinstance(result, Candidate) else None,
                numbers
                + f"not allowed: TP over {link.name} ({link.bandwidth_bytes_per_s / GB:.1f} GB/s"
                f" < fast-link threshold {self.config.fast_link_bytes_per_s / GB:.0f} GB/s)",
            )
        ]


def _why(
    c: Candidate, demand: ModelDemand, remaining_before: float, fixed: str | None = None
) -> str:
    est = c.estimate
    slo = demand.slo
    per_gpu = c.capacity_requests_per_s / c.num_gpus
    weight = f" (priority {demand.priority:g})" if demand.priority != 1 else ""
    if fixed is not None:
        head = f"{per_gpu:.3g} SLO-meeting req/s per GPU{weight}; {fixed}"
    elif c.capacity_requests_per_s <= remaining_before:
        head = f"{per_gpu:.3g} SLO-meeting req/s per GPU{weight}, the best left for {demand.name}"
    else:
        head = f"covers the last {remaining_before:.3g} req/s of {demand.name} with the fewest GPUs"
    return (
        f"{head}: batch {est.batch}, TPOT p99 {est.tpot_s * 1e3:.1f} ms (SLO "
        f"{slo.tpot_p99_s * 1e3:.0f}), TTFT p99 {est.ttft_s * 1e3:.0f} ms (SLO "
        f"{slo.ttft_p99_s * 1e3:.0f}), {est.basis}"
    )


_Chosen = list[tuple[Candidate, list[Alternative]]]


def plan_score(
    demands: Sequence[ModelDemand], instances: Sequence[Candidate]
) -> tuple[float, float, int]:
    """What plans are compared by, in this order: minimums met (each instance up to a model's
    minimum counts its priority), priority-weighted goodput (requests/s), fewest GPUs."""
    counts = [0] * len(demands)
    capacity = [0.0] * len(demands)
    for c in instances:
        counts[c.model_index] += 1
        capacity[c.model_index] += c.capacity_requests_per_s
    met = sum(d.priority * min(n, d.min_instances) for d, n in zip(demands, counts, strict=True))
    goodput = sum(
        d.priority * min(d.request_rate_per_s, cap)
        for d, cap in zip(demands, capacity, strict=True)
    )
    return round(met, 9), round(goodput, 9), -sum(c.num_gpus for c in instances)


def plan(
    cluster: Cluster,
    demands: Sequence[ModelDemand],
    performance: GearPerformance | None = None,
    running: Plan | Sequence[PlannedInstance] | None = None,
    config: PlannerConfig | None = None,
    now_s: float = 0.0,
    efficiency: Efficiency | None = None,
) -> Plan:
    """Plan instances for `demands` on `cluster`'s free GPUs at time `now_s`. With `running`
    (the plan the cluster runs now, or its instances; `cluster` shows its GPUs as free to
    us), instances of it that still fit are kept unless replacing them gains more than
    `config.replace_margin`, and the plan's `changes` say per instance whether it is kept, new
    or stopped."""
    config = config or PlannerConfig()
    demands = tuple(demands)
    names = [d.name for d in demands]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique; got {names}")
    performance = performance or GearLookup(efficiency=efficiency)
    planner, chosen, notes = _fresh(cluster, demands, performance, config, now_s, efficiency)
    if running is None:
        return _assemble(planner, chosen, notes, {}, {}, [])
    if not isinstance(running, Plan):
        running = Plan(tuple(running), ())
    return _sticky(
        cluster, demands, performance, config, now_s, efficiency, planner, chosen, notes, running
    )


def _fresh(
    cluster: Cluster,
    demands: tuple[ModelDemand, ...],
    performance: GearPerformance,
    config: PlannerConfig,
    now_s: float,
    efficiency: Efficiency | None,
) -> tuple[_Planner, _Chosen, list[str]]:
    """The best plan from scratch: price rounds of the greedy, then the LP round when demand
    is short."""
    # Price rounds (docs/planner.md): the greedy ranks candidates by value per GPU, which lets
    # a model that is easy to cover take GPUs another model cannot do without. After each
    # round, the models it covered get a lower price (their requests count less in the
    # greedy's order, never in the score), so the short models choose first in the next
    # round. The best round wins (plan_score). Rounds share one evaluation cache.
    prices = [1.0] * len(demands)
    evaluator: Evaluator | None = None
    best: tuple[tuple[float, float, int], _Planner, _Chosen] | None = None
    rounds: list[str] = []
    for r in range(config.price_rounds):
        planner = _Planner(
            cluster, demands, performance, config, now_s, efficiency, evaluator, prices
        )
        evaluator = planner.evaluator
        chosen = planner.run()
        score = plan_score(demands, [c for c, _ in chosen])
        label = ", ".join(
            f"{d.name} {p:g}" for d, p in zip(demands, prices, strict=True) if p != 1.0
        )
        rounds.append(
            f"greedy{f' price round {r} ({label})' if r else ''}: weighted goodput "
            f"{score[1]:.4g} req/s on {-score[2]} GPUs"
        )
        if best is None or score > best[0]:
            best = (score, planner, chosen)
        short = [m for m, rem in enumerate(planner.remaining) if rem > 1e-9]
        covered = [m for m in range(len(demands)) if m not in short]
        if not short or not covered:
            break
        for m in covered:
            prices[m] *= config.price_step
    assert best is not None
    demand_total = sum(d.priority * d.request_rate_per_s for d in demands)
    if best[0][1] < demand_total * (1 - 1e-9):
        # Demand is short: solve the LP relaxation over a richer pool and round it, asking
        # for the minimums the greedy met (those it could not meet cannot be met).
        counts = [0] * len(demands)
        for c, _ in best[2]:
            counts[c.model_index] += 1
        min_counts = [min(d.min_instances, n) for d, n in zip(demands, counts, strict=True)]
        lp = _relaxation_round(
            cluster, demands, performance, config, now_s, efficiency, evaluator, best[2], min_counts
        )
        if lp is None:
            rounds.append("LP relaxation skipped: highspy is not installed or found no optimum")
        else:
            score, planner, chosen, note = lp
            won = score > best[0]
            rounds.append(note + ("; chosen" if won else "; the greedy's plan kept"))
            if won:
                best = (score, planner, chosen)
    else:
        rounds[-1] += "; every demand covered (no LP round)"
    _, planner, chosen = best
    return planner, chosen, [*planner.notes, *rounds]


def _relaxation_round(
    cluster: Cluster,
    demands: tuple[ModelDemand, ...],
    performance: GearPerformance,
    config: PlannerConfig,
    now_s: float,
    efficiency: Efficiency | None,
    evaluator: Evaluator | None,
    greedy: _Chosen,
    min_counts: list[int],
) -> tuple[tuple[float, float, int], _Planner, _Chosen, str] | None:
    """Round the LP relaxation (relaxation.py) over the node pool plus the greedy's candidates:
    take its whole columns, then fractional ones by LP value while their GPUs are free and
    their model is short; the minimums, the greedy and the local search fill the rest."""
    planner = _Planner(cluster, demands, performance, config, now_s, efficiency, evaluator)
    pool: dict[tuple[object, ...], Candidate] = {}
    for c in [*planner.pool(), *(c for c, _ in greedy)]:
        pool.setdefault((c.model_index, c.stages, c.gear.dtype), c)
    candidates = list(pool.values())
    # Small clusters: the pool is small (hundreds of columns), so solve it as the ILP itself.
    integral = len(planner.usable) <= config.max_cross_node_gpus
    what = "ILP" if integral else "LP relaxation"
    relaxation = solve_relaxation(candidates, demands, integral=integral, min_counts=min_counts)
    if relaxation is None:
        return None
    # Two rules for the fractional column to fix next (largest x; largest value it adds):
    # each wins on some clusters, and rounding is cheap next to the fill, so keep the better.
    roundings = [
        _round(candidates, demands, min_counts, relaxation, what, by_value)
        for by_value in (False, True)
    ]
    fixed = max(roundings, key=lambda f: plan_score(demands, [c for c, _ in f]))
    by_node: dict[str, list[Candidate]] = {}
    for c in candidates:
        by_node.setdefault(cluster.gpu(c.gpu_ids[0]).node, []).append(c)
    chosen = planner.run(fixed, by_node)
    score = plan_score(demands, [c for c, _ in chosen])
    note = (
        f"{what} over {len(candidates)} candidates: bound {relaxation.objective:.4g} weighted "
        f"req/s; rounded ({len(fixed)} instances) and filled by the greedy: weighted goodput "
        f"{score[1]:.4g} req/s on {-score[2]} GPUs"
    )
    return score, planner, chosen, note


def _round(
    candidates: list[Candidate],
    demands: tuple[ModelDemand, ...],
    min_counts: list[int],
    relaxation: Relaxation,
    what: str,
    by_value: bool,
    max_solves: int = 4,
) -> list[tuple[Candidate, str]]:
    """Iterative rounding: fix the solution's whole columns and one fractional column (while
    its GPUs are free and its model short): the largest x, or (`by_value`) the one that adds
    the most priority-weighted goodput; re-solve the LP over the candidates left for the
    demand left, and repeat; after `max_solves`, fix every fractional column in that order.
    Fixing every fractional column by x at once can strand a model (128 GPUs, seed 1: four
    single-H100 8B columns at x=0.28 lose to a Mixtral column at 0.72 over the same GPUs, and
    the 8B stays 26.5 req/s short, 4.5% below the bound)."""
    fixed: list[tuple[Candidate, str]] = []
    taken: set[str] = set()
    remaining = [d.request_rate_per_s for d in demands]
    counts = [0] * len(demands)
    pool = list(range(len(candidates)))
    lp: Relaxation | None = relaxation
    for solve in range(max_solves):
        if lp is None:
            break
        x = dict(zip(pool, lp.x, strict=True))
        whole = [j for j in pool if x[j] >= 1 - 1e-6]

        def adds(j: int) -> float:
            c = candidates[j]
            m = c.model_index
            return demands[m].priority * min(c.capacity_requests_per_s, remaining[m])

        fractional = sorted(
            (j for j in pool if 1e-6 < x[j] < 1 - 1e-6),
            key=lambda j: (
                (-adds(j), -x[j], j)
                if by_value
                else (-x[j], -candidates[j].capacity_requests_per_s, j)
            ),
        )
        last = solve == max_solves - 1 or not fractional
        for j in [*whole, *(fractional if last else fractional[:1])]:
            c = candidates[j]
            m = c.model_index
            short = remaining[m] > 1e-9 or counts[m] < min_counts[m]
            if not short or not taken.isdisjoint(c.gpu_ids):
                continue
            label = f"the {what} over {len(candidates)} candidates chose this (x={x[j]:.2f}"
            fixed.append((c, label + (f", solve {solve + 1})" if solve else ")")))
            taken.update(c.gpu_ids)
            remaining[m] -= min(remaining[m], c.capacity_requests_per_s)
            counts[m] += 1
        if last:
            break
        pool = [j for j in pool if taken.isdisjoint(candidates[j].gpu_ids)]
        residual = tuple(
            replace(d, request_rate_per_s=remaining[m], min_instances=0)
            for m, d in enumerate(demands)
        )
        lp = solve_relaxation(
            [candidates[j] for j in pool],
            residual,
            min_counts=[max(0, n - k) for n, k in zip(min_counts, counts, strict=True)],
        )
    return fixed


def _sticky(
    cluster: Cluster,
    demands: tuple[ModelDemand, ...],
    performance: GearPerformance,
    config: PlannerConfig,
    now_s: float,
    efficiency: Efficiency | None,
    fresh_planner: _Planner,
    fresh: _Chosen,
    notes: list[str],
    running: Plan,
) -> Plan:
    """Start from the running plan: keep every instance of it that still fits (sticky.py),
    fill the GPUs it leaves free, then switch to the fresh plan's instances one group of
    overlapping instances at a time, where the switch pays more than the margin."""
    planner = _Planner(
        cluster, demands, performance, config, now_s, efficiency, fresh_planner.evaluator
    )
    kept, stopped = keep_running(planner.evaluator, running, demands, set(planner.usable))
    running_of = {id(c): inst for c, inst in kept}
    planner.pinned = set(running_of)
    chosen = planner.run([(c, f"kept: the running {inst.name} still fits") for c, inst in kept])
    alternatives = {id(c): alts for c, alts in [*chosen, *fresh]}
    final, switches = switch_where_it_pays(
        demands,
        [c for c, _ in chosen],
        [c for c, _ in fresh],
        set(running_of),
        config.replace_margin,
        plan_score,
    )
    planner.fixed.update(fresh_planner.fixed)
    kept_ids = {id(c) for c in final if id(c) in running_of}
    for c, inst in kept:
        if id(c) not in kept_ids:
            stopped.append((inst, switches.get(id(c), "replaced")))
    reasons = {i: switches.get(i, "") for i in map(id, final)}
    result = [(c, alternatives.get(id(c), [])) for c in final]
    kept_map = {i: running_of[i] for i in kept_ids}
    order = {id(c): k for k, (c, _) in enumerate(kept)}
    result.sort(key=lambda item: order.get(id(item[0]), len(order)))
    stick_note = (
        f"running plan: {len(kept_ids)} instance(s) kept, "
        f"{len(final) - len(kept_ids)} new, {len(stopped)} stopped "
        f"(replace_margin {config.replace_margin:g})"
    )
    return _assemble(planner, result, [*notes, stick_note], kept_map, reasons, stopped)


def _assemble(
    planner: _Planner,
    chosen: _Chosen,
    notes: Sequence[str],
    kept: dict[int, PlannedInstance],
    reasons: dict[int, str],
    stopped: Sequence[tuple[PlannedInstance, str]],
) -> Plan:
    """The Plan: instances named (kept ones keep their running name, new ones take the first
    free `<model>-<n>`), demand shared by capacity, outcomes, unused GPUs, baselines, and the
    diff from the running plan (`kept`: id(candidate) -> the running instance it is)."""
    demands = planner.demands
    capacity = [0.0] * len(demands)
    capacity_tokens = [0.0] * len(demands)
    for c, _ in chosen:
        capacity[c.model_index] += c.capacity_requests_per_s
        capacity_tokens[c.model_index] += c.capacity_tokens_per_s
    served = [min(d.request_rate_per_s, cap) for d, cap in zip(demands, capacity, strict=True)]
    remaining = [d.request_rate_per_s for d in demands]
    taken_names = {i.name for i, _ in stopped} | {i.name for i in kept.values()}
    instances: list[PlannedInstance] = []
    changes: list[InstanceChange] = []
    counts = [0] * len(demands)
    for c, alternatives in chosen:
        m = c.model_index
        d = demands[m]
        share = c.capacity_requests_per_s / capacity[m] if capacity[m] else 0.0
        assigned = served[m] * share
        previous = kept.get(id(c))
        if previous is not None:
            inst = replace(
                previous,
                estimate=c.estimate,
                capacity_tokens_per_s=c.capacity_tokens_per_s,
                capacity_requests_per_s=c.capacity_requests_per_s,
                assigned_requests_per_s=assigned,
                kv_capacity_tokens=c.kv_capacity_tokens,
                max_concurrency=c.max_concurrency,
            )
            reason = "still fits its GPUs; nothing pays more than the margin to replace it"
            changes.append(InstanceChange(inst.name, "kept", reason))
        else:
            name = f"{d.name}-{counts[m]}"
            while name in taken_names:
                counts[m] += 1
                name = f"{d.name}-{counts[m]}"
            why = _why(c, d, remaining[m], planner.fixed.get(id(c)))
            inst = PlannedInstance(
                name=name,
                model=d.name,
                model_id=planner.specs[m].name,
                gear=c.gear,
                stages=c.stages,
                layers_per_stage=c.layers_per_stage,
                estimate=c.estimate,
                capacity_tokens_per_s=c.capacity_tokens_per_s,
                capacity_requests_per_s=c.capacity_requests_per_s,
                assigned_requests_per_s=assigned,
                kv_capacity_tokens=c.kv_capacity_tokens,
                max_concurrency=c.max_concurrency,
                why=why,
                alternatives=tuple(alternatives),
            )
            reason = reasons.get(id(c)) or ("no running plan" if not kept and not stopped else "")
            changes.append(InstanceChange(name, "new", reason or "on GPUs the running plan left"))
        taken_names.add(inst.name)
        remaining[m] -= min(remaining[m], c.capacity_requests_per_s)
        instances.append(inst)
        counts[m] += 1
    changes.extend(InstanceChange(i.name, "stopped", why) for i, why in stopped)
    used = {g for i in instances for g in i.gpu_ids}
    unused = list(planner.unused)
    covered = all(r <= 1e-9 for r in remaining)
    for gid in planner.usable:
        if gid not in used:
            reason = (
                "not needed: every demand is covered"
                if covered
                else "no model's gear fits it within the SLOs"
            )
            unused.append(UnusedGpu(gid, reason))
    outcomes = tuple(
        ModelOutcome(
            name=d.name,
            demand_tokens_per_s=d.demand_tokens_per_s,
            served_tokens_per_s=served[m] * d.output_tokens,
            capacity_tokens_per_s=capacity_tokens[m],
            num_instances=sum(1 for i in instances if i.model == d.name),
            num_gpus=sum(i.num_gpus for i in instances if i.model == d.name),
            priority=d.priority,
            min_instances=d.min_instances,
            demand_requests_per_s=d.request_rate_per_s,
            served_requests_per_s=served[m],
            capacity_requests_per_s=capacity[m],
        )
        for m, d in enumerate(demands)
    )
    baselines: list[Baseline] = []
    if len(planner.usable) <= planner.config.max_baseline_gpus and demands and used:
        baselines = _baselines(planner, sorted(used, key=planner.usable.index))
    return Plan(
        tuple(instances),
        outcomes,
        tuple(unused),
        tuple(baselines),
        tuple(notes),
        tuple(changes),
        tuple(i for i, _ in stopped),
    )


# -- baselines -------------------------------------------------------------------------------


def _factorisations(n: int, num_heads: int) -> list[tuple[int, int]]:
    return [(tp, n // tp) for tp in range(1, n + 1) if n % tp == 0 and num_heads % tp == 0]


def single_group_baseline(
    planner_or_cluster: _Planner | Cluster,
    demands: Sequence[ModelDemand] | None,
    gpu_ids: Sequence[str],
    model_index: int = 0,
    performance: GearPerformance | None = None,
    config: PlannerConfig | None = None,
) -> Candidate | Rejection:
    """The best single instance over exactly `gpu_ids`, TP allowed across any link (the
    "forced one big group" a fixed deployment template builds). Tries every tp x pp and stage
    order; small groups only."""
    if isinstance(planner_or_cluster, _Planner):
        evaluator = planner_or_cluster.evaluator
        demand = planner_or_cluster.demands[model_index]
    else:
        assert demands is not None
        cfg = config or PlannerConfig()
        demands = tuple(demands)
        specs = tuple(load_model_spec(d.model) for d in demands)
        evaluator = Evaluator(planner_or_cluster, demands, specs, performance or GearLookup(), cfg)
        demand = demands[model_index]
    ids = list(gpu_ids)
    best: Candidate | Rejection | None = None
    spec = evaluator.specs[model_index]
    for tp, pp in _factorisations(len(ids), spec.num_heads):
        for order in itertools.permutations(ids):
            stages = tuple(tuple(order[k * tp : (k + 1) * tp]) for k in range(pp))
            for dtype in demand.dtypes:
                result = evaluator.evaluate(model_index, stages, dtype)
                if isinstance(result, Candidate):
                    if not isinstance(best, Candidate) or (
                        result.capacity_tokens_per_s > best.capacity_tokens_per_s
                    ):
                        best = result
                elif best is None:
                    best = result
    assert best is not None
    return best


def _baselines(planner: _Planner, used: list[str]) -> list[Baseline]:
    out: list[Baseline] = []
    m = 0
    demand = planner.demands[m]
    group = single_group_baseline(planner, None, used, m)
    if isinstance(group, Candidate):
        goodput = min(demand.demand_tokens_per_s, group.capacity_tokens_per_s)
        detail = f"{describe(group.stages, group.gear)}, batch {group.estimate.batch}"
    else:
        goodput = 0.0
        detail = group.reason
    out.append(
        Baseline(
            "one-group",
            f"one {demand.name} instance over all {len(used)} GPUs the plan uses "
            "(TP allowed across any link)",
            goodput,
            detail,
        )
    )
    out.append(_wait_for_identical(planner, m, 4))
    return out


def _wait_for_identical(planner: _Planner, m: int, n: int) -> Baseline:
    """A fixed template: tp=n on n identical, fully free GPUs joined by fast links."""
    demand = planner.demands[m]
    name = f"wait-for-{n}-identical"
    description = f"a fixed tp={n} template that needs {n} identical, fully free, fast-linked GPUs"
    for domain in planner.cluster.fast_domains(planner.config.fast_link_bytes_per_s):
        by_type: dict[str, list[str]] = {}
        for gid in domain:
            gpu = planner.cluster.gpu(gid)
            if gpu.used_bytes == 0 and gid in planner.free_bytes:
                by_type.setdefault(gpu.type, []).append(gid)
        for ids in by_type.values():
            if len(ids) >= n:
                result = planner.evaluator.evaluate(m, (tuple(ids[:n]),), demand.dtypes[0])
                if isinstance(result, Candidate):
                    return Baseline(
                        name,
                        description,
                        min(demand.demand_tokens_per_s, result.capacity_tokens_per_s),
                        describe(result.stages, result.gear),
                    )
    return Baseline(
        name, description, 0.0, f"no {n} such GPUs are free now: it serves nothing until they are"
    )
