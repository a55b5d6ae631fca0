"""Fast up, slow down (docs/shift-policy.md): hand-made sample series on a fake clock.

The knobs are off by default; each test turns on only what it checks.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from test_shift_policy import (
    CLUSTER,
    FREED,
    GENERIC,
    cached_planner,
    demand,
    idle,
    running_for,
    up,
)

from flexpipe.policies.shift import (
    Candidate,
    ModelState,
    Sample,
    ShiftDecision,
    ShiftParams,
    ShiftPolicy,
    ShiftRecord,
    ShiftSnapshot,
    TriggerParams,
    Zone,
)
from flexpipe.policies.shift.candidates import protects_priority
from flexpipe.policies.shift.triggers import model_signal, near_up, urgent_run

FAST = TriggerParams(fast_up_samples=1, cooldown_blocks_up=False)


def q(t: float, depth: int) -> Sample:
    """A sample with `depth` requests waiting, latency and utilisation in the hold zone."""
    return Sample(t, depth, 100, 1.0, 0.025, 0.6)


def model(samples: list[Sample], rate: float = 1.0) -> ModelState:
    return ModelState(demand(rate), tuple(samples))  # TTFT SLO 2 s


def fast_policy(triggers: TriggerParams = FAST) -> ShiftPolicy:
    params = replace(ShiftParams(), triggers=triggers)
    return ShiftPolicy(params, planner=cached_planner, efficiency=GENERIC)


def decide(p: ShiftPolicy, s: ShiftSnapshot, now_s: float) -> ShiftDecision:
    return p.decide(s, now_s, random.Random(7))


def test_fast_up_fires_on_the_second_sample_of_a_growing_queue() -> None:
    # capacity 100 req/s: 12 waiting drain in 0.12 s, far inside the 2 s SLO; only the rise
    first = model_signal(model([q(10, 5)]), 10, None, FAST, capacity_per_s=100.0)
    assert (first.urgent_run, first.fired, first.fast) == (0, Zone.HOLD, False)
    second = model_signal(model([q(10, 5), q(20, 12)]), 20, None, FAST, capacity_per_s=100.0)
    assert (second.urgent_run, second.fired, second.fast) == (1, Zone.UP, True)
    two = replace(FAST, fast_up_samples=2)
    assert model_signal(model([q(10, 5), q(20, 12)]), 20, None, two, 100.0).fired is Zone.HOLD
    rising = model([q(10, 5), q(20, 12), q(30, 20)])
    assert model_signal(rising, 30, None, two, 100.0).fired is Zone.UP


def test_fast_up_does_not_fire_on_a_flat_or_falling_queue() -> None:
    for depths in ([5, 5, 5], [20, 12, 5], [0, 0, 0]):
        samples = [q(10 * (i + 1), d) for i, d in enumerate(depths)]
        s = model_signal(model(samples), 30, None, FAST, capacity_per_s=100.0)
        assert (s.urgent_run, s.fired) == (0, Zone.HOLD), depths


def test_a_queue_that_would_wait_past_the_slo_or_outruns_the_capacity_is_urgent() -> None:
    # 50 waiting at 10 req/s: 5 s > the 2 s SLO, on the first sample already
    assert urgent_run([q(10, 50)], 2.0, 1.0, 10.0) == 1
    assert urgent_run([q(10, 19)], 2.0, 1.0, 10.0) == 0  # 1.9 s: inside it
    # the measured rate over the capacity: the newest sample only
    assert urgent_run([q(10, 3), q(20, 3)], 2.0, 12.0, 10.0) == 1
    assert urgent_run([q(10, 0)], 2.0, 12.0, 10.0) == 0  # nothing waits (yet)
    # no instance: anything waiting waits past the SLO
    assert urgent_run([q(10, 1)], 2.0, 0.0, 0.0) == 1


def test_defaults_unchanged_a_growing_queue_alone_never_fires() -> None:
    d = TriggerParams()
    assert (d.fast_up_samples, d.cooldown_blocks_up, d.protect_priority) == (0, True, False)
    s = model_signal(model([q(10, 5), q(20, 50)]), 20, None, d, capacity_per_s=1.0)
    assert (s.urgent_run, s.fired, s.fast) == (0, Zone.HOLD, False)
    running = running_for(CLUSTER, demand(1.5))
    snap = ShiftSnapshot.of(CLUSTER, running, [model([q(10, 5), q(20, 50)])])
    held = decide(ShiftPolicy(planner=cached_planner, efficiency=GENERIC), snap, 20)
    assert held.action == "hold" and held.trigger == "none"


def test_cooldown_does_not_block_an_slo_needed_up_shift_but_blocks_a_down_shift() -> None:
    running = running_for(CLUSTER, demand(1.5))
    just = (ShiftRecord(started_s=0.0, finished_s=100.0, succeeded=True),)  # cooldown to 280
    growing = [q(110, 20), q(120, 80)]
    snap = ShiftSnapshot.of(CLUSTER, running, [model(growing, rate=6.0)], just)
    d = decide(fast_policy(), snap, 120)
    assert (d.action, d.trigger) == ("shift", "up")
    assert d.reason.startswith("llama-7b urgent 1 sample(s) in a row (fast up); add llama-7b:")
    assert d.target is not None and set(running) < set(d.target)  # nothing running moved
    # the cooldown still holds it where it blocks ups (the default)
    blocked = decide(fast_policy(replace(FAST, cooldown_blocks_up=True)), snap, 120)
    assert (blocked.action, blocked.reason) == ("hold", "cooldown after the last shift: 160 s left")
    # an idle model in the down zone 5 samples in a row waits for the cooldown
    idle_snap = ShiftSnapshot.of(
        CLUSTER, running, [model([idle(t) for t in (110, 120, 130, 140, 150)])], just
    )
    down = decide(fast_policy(), idle_snap, 150)
    assert (down.action, down.reason) == ("hold", "cooldown after the last shift: 130 s left")
    after = ShiftSnapshot.of(
        CLUSTER, running, [model([idle(t) for t in (290, 300, 310, 320, 330)])], just
    )
    assert decide(fast_policy(), after, 330).trigger == "down"


def test_a_sleeping_instance_is_woken_before_any_is_added() -> None:
    running = running_for(CLUSTER, demand(1.5))
    (spare,) = [i for i in running_for(FREED, demand(8.0)) if i.gpu_ids == ("gpu3",)]
    growing = [q(10, 20), q(20, 80)]
    snap = ShiftSnapshot.of(FREED, running, [model(growing, rate=6.0)], asleep=((spare, 1),))
    d = decide(fast_policy(), snap, 20)
    assert (d.action, d.trigger) == ("shift", "up")
    assert d.reason.split("; ")[1].startswith("wake llama-7b:")
    assert d.target == (*running, spare)
    assert [a.name for a in d.alternatives] == ["keep"]  # the wake alone, no cold start


def test_priority_protects_a_pressed_model_from_a_lower_one() -> None:
    chat, batch = demand(6.0, "chat"), demand(6.0, "batch", "mistral-7b")
    running = running_for(FREED, chat)
    taken = running[0]
    thief = replace(running_for(FREED, batch)[0], stages=taken.stages)
    cand = Candidate("replan", (thief,))
    models = [ModelState(chat, (), priority=10.0), ModelState(batch, (), priority=1.0)]
    why = protects_priority(cand, running, models, {"chat"})
    gpu = taken.gpu_ids[0]
    assert why == (
        f"takes {gpu} from {taken.name} (chat, priority 10, near its up zone) for batch "
        "(priority 1)"
    )
    assert protects_priority(cand, running, models, set()) is None  # chat not pressed
    same = [ModelState(chat, (), priority=1.0), ModelState(batch, (), priority=1.0)]
    assert protects_priority(cand, running, same, {"chat"}) is None  # not lower
    kept = Candidate("keep chat", (*running,))
    assert protects_priority(kept, running, models, {"chat"}) is None
    # near the up zone: urgent, or both pressures over half their up thresholds
    p = TriggerParams(fast_up_samples=1, protect_priority=True)
    near = model_signal(
        ModelState(chat, (Sample(10, 40, 100, 0.9, None, 0.5),)), 10, None, p, 100.0
    )
    assert near_up(near, p)
    far = model_signal(ModelState(chat, (Sample(10, 30, 100, 0.9, None, 0.5),)), 10, None, p, 100.0)
    assert not near_up(far, p)


def test_a_replan_that_robs_the_urgent_higher_priority_model_is_refused() -> None:
    """chat (priority 10) is urgent, batch (priority 1) in the up zone: the re-plan gives
    chat's gpu1 to batch; with `protect_priority` it is refused before pricing."""
    chat, batch = demand(6.0, "chat"), demand(1.0, "batch", "mistral-7b")
    running = running_for(FREED, chat, batch)
    assert [(i.name, i.gpu_ids) for i in running] == [
        ("chat-0", ("gpu1", "gpu2")),
        ("chat-1", ("gpu3",)),
        ("batch-0", ("gpu0",)),
    ]
    models = [
        ModelState(replace(chat, request_rate_per_s=2.0), (q(40, 10), q(50, 30)), priority=10.0),
        ModelState(
            replace(batch, request_rate_per_s=12.0),
            tuple(up(t) for t in (10, 20, 30, 40, 50)),
            priority=1.0,
        ),
    ]
    snap = ShiftSnapshot.of(FREED, running, models)
    guarded = decide(fast_policy(replace(FAST, protect_priority=True)), snap, 50)
    replan = next(a for a in guarded.alternatives if a.name == "replan")
    assert not replan.accepted and replan.score is None
    assert replan.reason == (
        "takes gpu1 from chat-0 (chat, priority 10, near its up zone) for batch (priority 1)"
    )
    assert guarded.target is not None
    assert [(i.name, i.gpu_ids) for i in guarded.target] == [
        ("chat-0", ("gpu1", "gpu2")),
        ("chat-1", ("gpu3",)),
        ("chat-2", ("gpu0",)),
    ]
    unguarded = decide(fast_policy(), snap, 50)
    priced = next(a for a in unguarded.alternatives if a.name == "replan")
    assert priced.score is not None  # the rule is off: pricing alone judges it


def test_the_switches_read_from_yaml_as_booleans_only() -> None:
    doc = {"triggers": {"fast_up_samples": 1, "cooldown_blocks_up": False}}
    assert ShiftParams.from_mapping(doc).triggers == FAST
    with pytest.raises(
        ValueError, match=r"^shift\.triggers\.cooldown_blocks_up: expected true or false, got 0$"
    ):
        ShiftParams.from_mapping({"triggers": {"cooldown_blocks_up": 0}})
    with pytest.raises(ValueError, match="fast_up_samples must be >= 0"):
        TriggerParams(fast_up_samples=-1)
