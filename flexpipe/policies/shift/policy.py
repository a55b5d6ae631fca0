"""`ShiftPolicy.decide(snapshot, now, rng) -> ShiftDecision`: whether to shift gears now, and to
which plan (seed 000 §3; docs/shift-policy.md).

Order of the checks, first match wins:

1. a shift in progress: hold;
2. *reclaim*: a running instance sits on a GPU that is gone or reclaimed within
   `reclaim_lead_s` — shift now (no sample count, no cooldown) to the best plan without it
   (with fast up it moves nothing else: the lost instances are replaced on free GPUs);
3. *floor*: a model has fewer instances than its `min_instances` (its last engine died:
   without scale-to-zero every model keeps one) — re-plan now, no cooldown, any candidate
   that restores every minimum accepted (the best score wins); when none can (no GPUs for
   it), the checks below go on;
4. *wake*: a model with no instance has requests waiting — start it (no cooldown); besides
   the planner's candidates, the running plan kept as it is plus the woken models on the
   GPUs free now (`additive`), which moves nothing;
5. cooldown after the last shift: hold;
6. *up*: a model's samples were in the up zone `num_samples` times in a row;
   *down*: likewise in the down zone; *resource*: the GPUs free to us changed at least
   `resource_settle_s` ago;
7. otherwise hold.

A trigger only proposes candidates (candidates.py). A candidate the executor could not carry
out — no order of its steps keeps every model serving (step_order.py's `plan_shift`, the rule
the executor and the simulator apply) — is refused before pricing, never chosen and then
refused at every tick. Each other is priced (pricing.py) and must clear its trigger's bar —
up: more goodput, down: fewer GPUs, resource: goodput up by `resource_min_gain_fraction` —
with a positive score. The decision carries the signals, the chosen price and every
alternative with its score or why it was refused, so that a decision taken or not can be
logged as it is.

Pure: `now_s` and `rng` are arguments; `rng` only breaks exact ties between scores.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

from flexpipe.perf import Efficiency
from flexpipe.policies.planner import ModelDemand, PlannedInstance
from flexpipe.policies.shift.candidates import (
    Candidate,
    Packer,
    Planner,
    additive,
    default_planner,
    keep_minimums,
    packed,
    priority_first,
    protects_priority,
    replan,
    shrink,
    woken,
)
from flexpipe.policies.shift.decision import ScoredCandidate, ShiftDecision, Trigger
from flexpipe.policies.shift.params import ShiftParams
from flexpipe.policies.shift.pricing import Capacity, Price, planned_capacity, price
from flexpipe.policies.shift.signals import Zone
from flexpipe.policies.shift.snapshot import ModelState, ShiftSnapshot, instance_key
from flexpipe.policies.shift.step_order import plan_shift
from flexpipe.policies.shift.triggers import (
    ModelSignal,
    blacklist,
    cooldown_until,
    last_shift_end_s,
    lost_instances,
    model_signal,
    near_up,
)

__all__ = ["ShiftPolicy"]


class ShiftPolicy:
    """When to shift (see the module docstring). The planner and the capacity estimate are
    injected, so the simulator and the live controller can feed their own."""

    def __init__(
        self,
        params: ShiftParams | None = None,
        planner: Planner = default_planner,
        capacity: Capacity = planned_capacity,
        efficiency: Efficiency | None = None,
    ) -> None:
        self.params = params or ShiftParams()
        self.planner = planner
        self.capacity = capacity
        self.efficiency = efficiency

    def decide(self, snapshot: ShiftSnapshot, now_s: float, rng: random.Random) -> ShiftDecision:
        tp = self.params.triggers
        since = last_shift_end_s(snapshot.history)
        caps: dict[str, float] = {m.name: 0.0 for m in snapshot.models}
        if tp.fast_up:  # the fast path's predicted wait and the forecast read the capacity
            for inst in snapshot.running:
                caps[inst.model] = caps.get(inst.model, 0.0) + self.capacity(inst)
        signals = tuple(model_signal(m, now_s, since, tp, caps[m.name]) for m in snapshot.models)

        def hold(reason: str) -> ShiftDecision:
            return ShiftDecision(now_s, "hold", "none", reason, signals)

        if any(r.in_progress for r in snapshot.history):
            return hold("a shift is in progress")
        lost = lost_instances(snapshot.cluster, snapshot.running, now_s, tp, self.efficiency)
        if lost:
            return self._reclaim(snapshot, now_s, rng, signals, lost)
        counts = {m.name: 0 for m in snapshot.models}
        swapped_out = _swapped_out(snapshot) if self.params.standby.time_share else []
        for inst in [*snapshot.running, *swapped_out]:
            counts[inst.model] += 1
        below = [m.name for m in snapshot.models if counts[m.name] < m.min_instances]
        if below:
            floor = self._evaluate(snapshot, now_s, rng, signals, "floor", set(), set(), below)
            if floor.action == "shift":
                return floor
        waking = [
            m.name
            for m, s in zip(snapshot.models, signals, strict=True)
            if counts[m.name] == 0 and s.pressure is not None and s.pressure.queue > 0
        ]
        if waking:
            return self._evaluate(snapshot, now_s, rng, signals, "wake", set(), set(), waking)
        until = cooldown_until(snapshot.history, tp)
        up = {s.model for s in signals if s.fired is Zone.UP}
        down = {s.model for s in signals if s.fired is Zone.DOWN}
        if until is not None and now_s < until and (tp.cooldown_blocks_up or not up):
            return hold(f"cooldown after the last shift: {until - now_s:.0f} s left")
        cooling = until is not None and now_s < until  # only an up-shift gets this far
        if up:
            decision = self._evaluate(snapshot, now_s, rng, signals, "up", up, down, [])
            if decision.action == "shift" or cooling or not down or not tp.fast_up:
                return decision
            # fast up: an urgent model none can help holds no other model's down-shift
        if down:
            return self._evaluate(snapshot, now_s, rng, signals, "down", up, down, [])
        changed = snapshot.resources_changed_s
        if changed is not None:
            if now_s - changed >= tp.resource_settle_s:
                return self._evaluate(snapshot, now_s, rng, signals, "resource", up, down, [])
            return hold(
                f"GPUs changed {now_s - changed:.0f} s ago; waiting "
                f"{tp.resource_settle_s:.0f} s for them to settle"
            )
        runs = ", ".join(f"{s.model} {s.zone.value} x{s.run}" for s in signals)
        return hold(f"no trigger ({runs}; {tp.num_samples} in a row needed)")

    # -- evaluation ---------------------------------------------------------------------------

    def _loads(
        self, snapshot: ShiftSnapshot, up: set[str], waking: Sequence[str]
    ) -> dict[str, tuple[float, float]]:
        pp = self.params.pricing
        loads: dict[str, tuple[float, float]] = {}
        for m in snapshot.models:
            now, expected = m.request_rate_per_s, m.expected_rate_per_s
            if m.name in up:
                now *= 1 + pp.up_step
                queue = self._queue_now(m)
                tp = self.params.triggers
                if tp.fast_up and queue > 0:
                    # fast up: enough to serve the arrivals and drain the queue within the SLO
                    # (or `backlog_drain_s`; then the arrivals are the rate measured, which
                    # counts finished requests, plus what the queue grows by)
                    arrivals = m.request_rate_per_s
                    if tp.backlog_drain_s > 0:
                        arrivals += _queue_growth_per_s(m, tp.window_s) * snapshot.time_scale
                    drain_s = tp.backlog_drain_s or m.demand.slo.ttft_p99_s
                    now = max(now, arrivals + queue / drain_s)
                    expected = max(expected, now)
            if m.name in waking:  # (as `placeable.placement` checks it can be placed)
                now = max(now, self.params.wake_request_rate_per_s, m.declared_request_rate_per_s)
                expected = max(expected, now)
            loads[m.name] = (now, expected)
        return loads

    @staticmethod
    def _queue_now(model: ModelState) -> int:
        """The newest sample's queue (0 without one)."""
        newest = max(model.samples, key=lambda x: x.at_s, default=None)
        return 0 if newest is None else newest.queue_depth

    def _demands(
        self, snapshot: ShiftSnapshot, loads: Mapping[str, tuple[float, float]], down: set[str]
    ) -> list[ModelDemand]:
        out = []
        for m in snapshot.models:
            rate = max(loads[m.name])
            if m.name in down:
                rate *= 1 + self.params.pricing.down_headroom
            out.append(dataclasses.replace(m.demand, request_rate_per_s=rate))
        return out

    def _candidates(
        self,
        snapshot: ShiftSnapshot,
        running: Sequence[PlannedInstance],
        demands: Sequence[ModelDemand],
        now_s: float,
        down: set[str],
        adding: Sequence[str] = (),
        grow: Sequence[str] = (),
        keep_running: bool = False,
    ) -> list[Candidate]:
        """`adding`: models a candidate adds instances of, everything running kept; `grow`:
        models fast up adds to the same way (sleeping instances woken first: the cheapest
        up-shift). `keep_running`: only those (a fast up-shift moves nothing: a re-plan in
        place takes minutes, longer than the burst it answers)."""
        out: list[Candidate] = []
        if keep_running and grow:
            return self._added(snapshot, running, demands, now_s, [*adding, *grow], wake_first=True)
        for m, d in zip(snapshot.models, demands, strict=True):
            if m.name in down:
                c = shrink(running, m, d.request_rate_per_s, self.capacity)
                if c is not None:
                    out.append(c)
        if keep_running:
            if len(out) > 1:  # every idle model at once: one shift instead of one each
                both = running
                for m, d in zip(snapshot.models, demands, strict=True):
                    c = (
                        shrink(both, m, d.request_rate_per_s, self.capacity)
                        if m.name in down
                        else None
                    )
                    both = both if c is None else c.instances
                out.append(
                    Candidate(f"shrink {len(out)} models", tuple(both), "every shrink at once")
                )
            return self._with_packed(snapshot, running, demands, out, down)
        out = self._with_packed(snapshot, running, demands, out, down)
        out.append(replan(snapshot.cluster, demands, now_s, self.planner))
        pf = priority_first(
            snapshot.cluster,
            snapshot.models,
            demands,
            now_s,
            self.planner,
            running,
            self.capacity,
        )
        if pf is not None:
            out.append(pf)
        return [*out, *self._added(snapshot, running, demands, now_s, [*adding, *grow])]

    def _with_packed(
        self,
        snapshot: ShiftSnapshot,
        running: Sequence[PlannedInstance],
        demands: Sequence[ModelDemand],
        out: list[Candidate],
        down: set[str],
    ) -> list[Candidate]:
        """`out` (the shrinks) and, when the planner packs small models onto shared GPUs
        (`share_gpus`) and a model is idle, the last shrink (or the running plan) packed."""
        if not down or not isinstance(self.planner, Packer):
            return out
        base = out[-1] if out else Candidate("keep", tuple(running))
        held = [g for i in running for g in i.gpu_ids]
        held += [g for i, _ in snapshot.asleep for g in i.gpu_ids]
        c = packed(snapshot.cluster, base, demands, self.planner, held)
        return out if c is None else [*out, c]

    def _added(
        self,
        snapshot: ShiftSnapshot,
        running: Sequence[PlannedInstance],
        demands: Sequence[ModelDemand],
        now_s: float,
        names: Sequence[str],
        wake_first: bool = False,
    ) -> list[Candidate]:
        """Everything running kept, instances of `names` woken from sleep or added.
        `wake_first`: only the wake where one sleeps (the cheapest and quickest up-shift; a
        next tick adds more if the need stays)."""
        if not names:
            return []
        out: list[Candidate] = []
        wake = woken(snapshot.cluster, running, [i for i, _ in snapshot.asleep], names)
        if wake is not None:
            out.append(wake)
            if wake_first:
                return out
        add = additive(
            snapshot.cluster, running, demands, names, now_s, self.planner, self.capacity
        )
        if add is not None:
            out.append(add)
        return out

    def _score(
        self,
        snapshot: ShiftSnapshot,
        running: Sequence[PlannedInstance],
        candidates: Sequence[Candidate],
        loads: Mapping[str, tuple[float, float]],
        now_s: float,
        trigger: Trigger,
        signals: Sequence[ModelSignal] = (),
    ) -> list[ScoredCandidate]:
        tp = self.params.triggers
        banned = blacklist(snapshot.history, now_s, tp)
        pressed = {s.model for s in signals if near_up(s, tp)} if tp.protect_priority else set()
        running_keys = {instance_key(i) for i in running}
        out: list[ScoredCandidate] = []
        seen: dict[frozenset[str], str] = {}  # instance keys -> the first candidate with them
        for cand in candidates:
            fixed = keep_minimums(cand, running, snapshot.models)
            if isinstance(fixed, str):
                out.append(ScoredCandidate(cand.name, False, fixed, None, cand.instances))
                continue
            keys = {instance_key(i) for i in fixed.instances}
            hit = sorted(k for k in keys - running_keys if k in banned)
            if hit:
                until = max(banned[k] for k in hit)
                reason = f"blacklisted until {until:.0f} s: {', '.join(hit)}"
                out.append(ScoredCandidate(fixed.name, False, reason, None, fixed.instances))
                continue
            if keys == running_keys and trigger != "reclaim":
                reason = "the same plan as the running one"
                out.append(ScoredCandidate(fixed.name, False, reason, None, fixed.instances))
                continue
            twin = seen.get(frozenset(keys))
            if twin is not None:
                reason = f"the same plan as {twin}"
                out.append(ScoredCandidate(fixed.name, False, reason, None, fixed.instances))
                continue
            seen[frozenset(keys)] = fixed.name
            robbed = protects_priority(fixed, running, snapshot.models, pressed)
            if robbed is not None:
                out.append(ScoredCandidate(fixed.name, False, robbed, None, fixed.instances))
                continue
            # what the executor checks first, from what truly runs (lost instances included);
            # a model the target leaves out (its minimum allows it) leaves on purpose
            refusal = plan_shift(snapshot.running, fixed.instances, scale_to_zero=True).refusal
            if refusal:
                reason = f"cannot be carried out: {refusal}"
                out.append(ScoredCandidate(fixed.name, False, reason, None, fixed.instances))
                continue
            p = price(
                snapshot.cluster,
                running,
                fixed.instances,
                snapshot.models,
                loads,
                now_s,
                self.params.pricing,
                self.capacity,
                self.efficiency,
                snapshot.asleep_levels,
            )
            cap_running = sum(self.capacity(i) for i in running)
            cap_target = sum(self.capacity(i) for i in fixed.instances)
            headroom = (cap_target - cap_running) / cap_running if cap_running > 0 else 0.0
            short = self._short_of_headroom(snapshot.models, running, fixed.instances, loads)
            ok, reason = self._clears_bar(trigger, p, headroom, short)
            if fixed.note:
                reason = f"{reason} ({fixed.note})"
            out.append(ScoredCandidate(fixed.name, ok, reason, p, fixed.instances))
        return out

    def _short_of_headroom(
        self,
        models: Sequence[ModelState],
        running: Sequence[PlannedInstance],
        target: Sequence[PlannedInstance],
        loads: Mapping[str, tuple[float, float]],
    ) -> list[str]:
        """The models `target` leaves less capacity than `running` and less than a down-shift
        keeps: (1 + down_headroom) x max(load now, expected). Priced goodput counts a plan
        loaded to its planned capacity as losing nothing; the SLO's tail says otherwise (the
        seed's cluster: 2 GPUs for 8 req/s at 100 % of their capacity missed 4x the TPOT
        SLOs of the 3 they replaced)."""
        keep = 1 + self.params.pricing.down_headroom
        out = []
        for m in models:
            before = sum(self.capacity(i) for i in running if i.model == m.name)
            after = sum(self.capacity(i) for i in target if i.model == m.name)
            if after < before and after < keep * max(loads[m.name]):
                out.append(m.name)
        return out

    def _clears_bar(
        self, trigger: Trigger, p: Price, headroom: float = 0.0, short: Sequence[str] = ()
    ) -> tuple[bool, str]:
        """`headroom`: the target's SLO-meeting capacity over the running plan's, minus 1. A
        resource-driven shift (with a positive score) pays in goodput at the load, or — when
        the load is covered either way — in capacity (the seed's freed gpu1: a bigger KV
        cache and batch) or in GPUs given back at no loss of goodput, keeping for each model
        it shrinks the capacity a down-shift keeps (`short`: the models it does not)."""
        s = (
            f"score {p.score:.1f} = gain {p.gain:.1f} - gap {p.gap_cost:.1f}"
            f" - migration {p.migration_cost:.1f} - risk {p.risk:.1f}"
        )
        if trigger in ("reclaim", "floor"):  # must happen: the best that keeps the minimums
            return True, s
        if p.score <= 0:
            return False, f"{s}: does not pay for itself"
        if trigger in ("up", "wake") and p.goodput_gain_per_s <= 0:
            return False, f"{s}: no goodput gained"
        if trigger == "down" and p.num_gpus_target >= p.num_gpus_running:
            return False, f"{s}: gives no GPU back"
        if trigger == "resource":
            margin = self.params.triggers.resource_min_gain_fraction
            need = margin * p.goodput_running_per_s
            gains = p.goodput_gain_per_s > 0 and p.goodput_gain_per_s >= need
            # the same goodput on fewer GPUs: some go back to other tenants
            gives_back = (
                p.num_gpus_target < p.num_gpus_running and p.goodput_gain_per_s >= 0 and not short
            )
            if not gains and not gives_back and headroom < max(margin, 1e-9):
                kept = f"; {', '.join(short)} below the down-shift's headroom" if short else ""
                return False, (
                    f"{s}: goodput +{p.goodput_gain_per_s:.3f}/s is below the margin {need:.3f}/s "
                    f"and capacity +{headroom:.1%} below {margin:.0%}{kept}"
                )
        return True, s

    def _choose(
        self,
        now_s: float,
        rng: random.Random,
        signals: tuple[ModelSignal, ...],
        trigger: Trigger,
        why: str,
        scored: list[ScoredCandidate],
        running: tuple[PlannedInstance, ...],
    ) -> ShiftDecision:
        scored = [
            *scored,
            ScoredCandidate(
                "keep", False, "the running plan: score 0, the bar to beat", None, running
            ),
        ]
        accepted = [c for c in scored if c.accepted and c.price is not None]
        if not accepted:
            return ShiftDecision(
                now_s,
                "hold",
                trigger,
                f"{why}; no candidate clears the bar",
                signals,
                alternatives=tuple(scored),
            )
        best_score = max(c.price.score for c in accepted if c.price is not None)
        ties = [c for c in accepted if c.price is not None and c.price.score == best_score]
        best = ties[0] if len(ties) == 1 else rng.choice(ties)
        return ShiftDecision(
            now_s,
            "shift",
            trigger,
            f"{why}; {best.name}: {best.reason}",
            signals,
            target=best.instances,
            price=best.price,
            alternatives=tuple(c for c in scored if c is not best),
        )

    def _evaluate(
        self,
        snapshot: ShiftSnapshot,
        now_s: float,
        rng: random.Random,
        signals: tuple[ModelSignal, ...],
        trigger: Trigger,
        up: set[str],
        down: set[str],
        waking: Sequence[str],
    ) -> ShiftDecision:
        fast = sorted(s.model for s in signals if s.fast)
        ahead = sorted(s.model for s in signals if s.ahead)
        # a model fired by the forecast is planned at its forecast, not at a stepped-up rate
        loads = self._loads(snapshot, up - set(ahead), waking)
        demands = self._demands(snapshot, loads, down)
        tp = self.params.triggers
        adding = waking if trigger == "wake" else ()
        grow = sorted(up) if trigger == "up" and tp.fast_up else []
        slow = sorted(up - set(fast) - set(ahead))
        # fast up moves nothing running: an up-shift of urgent models only adds, a down-shift
        # only shrinks (a re-plan in place holds every trigger for minutes)
        keep_running = tp.fast_up and ((trigger == "up" and not slow) or trigger == "down")
        candidates = self._candidates(
            snapshot, snapshot.running, demands, now_s, down, adding, grow, keep_running
        )
        scored = self._score(snapshot, snapshot.running, candidates, loads, now_s, trigger, signals)
        n = tp.num_samples
        why_up = "; ".join(
            [
                *([f"{', '.join(slow)} in the up zone {n} samples in a row"] if slow else []),
                *(
                    [f"{', '.join(fast)} urgent {tp.fast_up_samples} sample(s) in a row (fast up)"]
                    if fast
                    else []
                ),
                *(
                    [
                        f"{', '.join(ahead)} forecast over {tp.ahead_capacity_fraction:.0%} of "
                        "the running capacity (ahead of the curve)"
                    ]
                    if ahead
                    else []
                ),
            ]
        )
        why = {
            "up": why_up,
            "down": f"{', '.join(sorted(down))} in the down zone {n} samples in a row",
            "resource": "the GPUs free to us changed",
            "wake": f"requests wait for {', '.join(waking)}, which has no instance",
            "floor": "; ".join(
                f"{n} has {sum(i.model == n for i in snapshot.running)} instance(s), below its "
                f"minimum of {snapshot.model(n).min_instances}"
                for n in waking
            ),
        }.get(trigger, trigger)
        return self._choose(now_s, rng, signals, trigger, why, scored, snapshot.running)

    def _reclaim(
        self,
        snapshot: ShiftSnapshot,
        now_s: float,
        rng: random.Random,
        signals: tuple[ModelSignal, ...],
        lost: list[tuple[PlannedInstance, str]],
    ) -> ShiftDecision:
        """GPUs going away: the running plan without the lost instances is the floor; a
        re-plan replaces it when it scores better."""
        lost_keys = {instance_key(i) for i, _ in lost}
        degraded = tuple(i for i in snapshot.running if instance_key(i) not in lost_keys)
        loads = self._loads(snapshot, set(), [])
        demands = self._demands(snapshot, loads, set())
        drop = Candidate("drop lost", degraded, "the running plan without the lost instances")
        if self.params.triggers.fast_up:
            # fast up moves nothing that runs: the lost instances are replaced on free GPUs
            # (or by sleepers woken); a re-plan would hold every trigger while it moves the
            # rest (cluster-1024: ten minutes of a lease's reclaim, no up-shift meanwhile)
            lost_models = sorted({i.model for i, _ in lost})
            candidates = [drop, *self._added(snapshot, degraded, demands, now_s, lost_models)]
        else:
            candidates = [drop, *self._candidates(snapshot, degraded, demands, now_s, set())]
        scored = self._score(snapshot, degraded, candidates, loads, now_s, "reclaim")
        why = "; ".join(f"{i.name}: {reason}" for i, reason in lost)
        if not any(c.accepted for c in scored):
            # The GPUs go whatever we decide: without a plan that keeps every minimum (or
            # one not blacklisted), drop the lost instances and say so.
            forced = ScoredCandidate(
                "drop lost",
                True,
                "no candidate keeps every minimum; the lost instances go regardless",
                price(
                    snapshot.cluster,
                    degraded,
                    degraded,
                    snapshot.models,
                    loads,
                    now_s,
                    self.params.pricing,
                    self.capacity,
                    self.efficiency,
                ),
                degraded,
            )
            scored = [forced, *(c for c in scored if c.name != "drop lost")]
        return self._choose(now_s, rng, signals, "reclaim", why, scored, degraded)


def _swapped_out(snapshot: ShiftSnapshot) -> list[PlannedInstance]:
    """With time-sharing on, the instances asleep on a GPU another model's running instance
    holds: a time-share swap put them aside, and its own decisions wake them back
    (policies/shift/time_share.py). They count as their model's for the floor and the wake
    triggers, which would otherwise re-plan the GPU away from the model the swap woke
    (docs/shift-policy.md, "Time-sharing, live"). Not an instance with its own share of the
    GPU's memory (`gpu_memory_fraction`, GPU sharing): it wakes beside the other, so the
    wake trigger still wakes it."""
    held = {g: i.model for i in snapshot.running for g in i.gpu_ids}
    return [
        i
        for i, _ in snapshot.asleep
        if i.gpu_memory_fraction is None
        and any(g in held and held[g] != i.model for g in i.gpu_ids)
    ]


def _queue_growth_per_s(model: ModelState, window_s: float) -> float:
    """How fast the queue grew over the samples of the last `window_s`, per second of their
    clock (0: it did not, or fewer than two samples). The rate measured counts finished
    requests over about that long; a saturated model (or one still starting) finishes fewer
    than arrive, and the difference waits."""
    newest = max(model.samples, key=lambda x: x.at_s, default=None)
    if newest is None:
        return 0.0
    oldest = min(
        (x for x in model.samples if x.at_s >= newest.at_s - window_s), key=lambda x: x.at_s
    )
    if newest.at_s <= oldest.at_s:
        return 0.0
    return max(0.0, (newest.queue_depth - oldest.queue_depth) / (newest.at_s - oldest.at_s))
