"""The planner's search state: the usable GPUs, per-node candidates and the lazy greedy
over them (steps 1-3 of `core`'s method). `core` drives it (fresh, relaxation-priced and
sticky rounds); `baselines` reuses its evaluator. Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from flexpipe.cluster import Cluster
from flexpipe.hardware import GB
from flexpipe.model_spec import ModelSpec, load_model_spec
from flexpipe.perf import Efficiency
from flexpipe.policies.planner.candidates import Candidate, Evaluator, Rejection, describe
from flexpipe.policies.planner.memo import EvaluationMemo, Topology
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.types import (
    Alternative,
    ModelDemand,
    PlannerConfig,
    UnusedGpu,
)

__all__ = ["TP_SIZES", "GreedyPlanner", "NodeState", "usable_gpus"]

TP_SIZES = (1, 2, 4, 8)


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
class NodeState:
    name: str
    domains: list[list[str]]  # fast-link domains restricted to this node, usable GPUs
    version: int = 0
    candidates: list[Candidate] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)


class GreedyPlanner:
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
        memo: EvaluationMemo | None = None,
    ) -> None:
        self.cluster = cluster
        self.demands = demands
        self.config = config
        self.specs: tuple[ModelSpec, ...] = tuple(load_model_spec(d.model) for d in demands)
        self.evaluator = evaluator or Evaluator(
            cluster, demands, self.specs, performance, config, efficiency, memo
        )
        # model index -> price of one of its tokens/s in the greedy's order (1: at face value)
        self.prices = list(prices) if prices is not None else [1.0] * len(demands)
        self.usable, self.unused = usable_gpus(cluster, now_s, config)
        usable = set(self.usable)
        # (what it derives from the cluster alone: kept across plans by a memo)
        topo = memo.topology(cluster) if memo is not None else Topology(cluster)
        free = topo.free()
        self.free_bytes = {g: free[g][1] for g in self.usable}
        self.nodes: dict[str, NodeState] = {}
        for domain in topo.domains(config.fast_link_bytes_per_s):
            # A domain spanning nodes is split per node (TP stays inside a node).
            per_node: dict[str, list[str]] = {}
            for gid in domain:
                if gid in usable:
                    per_node.setdefault(cluster.gpu(gid).node, []).append(gid)
            for node, ids in per_node.items():
                self.nodes.setdefault(node, NodeState(node, [])).domains.append(ids)
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

    def generate(self, state: NodeState) -> None:
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
                for tp in TP_SIZES:
                    if tp > largest or self.specs[m].num_heads % tp:
                        continue
                    self._generate_tp(state, m, dtype, tp, domains, total)

    def _generate_tp(
        self,
        state: NodeState,
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
            for tp in TP_SIZES:
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

        def push(state: NodeState) -> None:
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
                best: tuple[tuple[int, float, float, int], Candidate, NodeState] | None = None
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
        self, chosen: Candidate, state: NodeState, fixed_reason: str | None = None
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
