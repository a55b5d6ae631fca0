"""Time-sharing a GPU between two models, live (docs/shift-policy.md, "Time-sharing, live"):
`flexpipe up` on one A100 with sim engines at `--time-scale 0.1`, `shift.standby.time_share`
on. Model A serves on the GPU; the only room for model B is beside it: B's standby engine is
started there and put to sleep (its reserve fits in what A's engine leaves). A burst for B,
the higher-priority model, swaps: A's engine drains (its requests in flight finish) and
sleeps, then B's sleeper wakes and answers, the gateway's pool following each step. Once B is
idle it sleeps and A wakes again; nothing the gateway accepted fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_controller_demand import pool_states
from test_controller_scenarios import Load, Up, finished
from test_controller_sleep import burst

from flexpipe.lifecycle import State
from flexpipe.store.instance_registry import InstanceRecord, InstanceRegistry
from flexpipe.store.shift_entry import ShiftEntry

ONE_GPU = """
name: one-a100
description: one A100 two models share in time
nodes:
  - name: node0
    network: eth100
    gpus:
      - {id: gpu0, type: A100-80G-SXM, index: 0}
"""

TWO = """
models:
  - name: {name}-a
    model: llama-2-7b
    demand: {{request_rate_per_s: 1, input_tokens: 512, output_tokens: 64}}
    slo: {{ttft_p99_ms: 2000, tpot_p99_ms: 60}}
    dtypes: [bf16]
    min_instances: 1
  - name: {name}-b
    model: llama-2-7b
    priority: 2
    demand: {{request_rate_per_s: 0, input_tokens: 512, output_tokens: 64}}
    slo: {{ttft_p99_ms: 2000, tpot_p99_ms: 60}}
    dtypes: [bf16]
    min_instances: 0
"""

# the policy's own triggers slow (no shift in the test's time): what sleeps, wakes and swaps
# does so beside the shifts; an idle model sleeps after 2 s
TIME_SHARE = """
shift:
  sleep_mode: auto
  standby: {enabled: true, aside_tick_s: 0.25, sleep_idle_s: 2, time_share: true}
  triggers:
    window_s: 300
    num_samples: 200
    cooldown_s: 300
"""


def test_a_burst_for_b_swaps_it_in_on_the_gpu_a_serves_from(tmp_path: Path) -> None:
    up = Up(
        tmp_path,
        TIME_SHARE,
        models_yaml=TWO,
        cluster_yaml=ONE_GPU,
        extra=("--scale-to-zero", "--time-scale", "0.1"),
    )
    a, b = f"{up.model}-a", f"{up.model}-b"
    load: Load | None = None
    try:
        up.ready()
        # A serves throughout (never idle at an aside tick's look, so it never sleeps idle):
        # requests in flight when the swap comes, more while B holds the GPU
        load = Load(up.port, a, num_streams=2, pause_s=0.0, max_tokens=64).start()
        registry = InstanceRegistry(up.store)

        def live(model: str, state: State) -> list[InstanceRecord]:
            return [r for r in registry.live_instances(model=model) if r.state is state]

        def shifts(trigger: str) -> list[ShiftEntry]:
            return [e for e in finished(up.entries("shift")) if e.trigger == trigger]

        # the first plan: the standby set in place, A's engine and B's standby beside it on
        # gpu0, launched together; those nothing waits for then sleep (`standby`); A's
        # requests wake A (`wake-aside`), B sleeps on beside it
        up.wait_until(
            "A serving, B's standby asleep beside it",
            lambda: live(a, State.ACTIVE) and live(b, State.ASLEEP),
            60,
        )
        ((holder,), (sleeper,)) = live(a, State.ACTIVE), live(b, State.ASLEEP)
        assert holder.gpu_ids == sleeper.gpu_ids == ("gpu0",)
        (start,) = [e for e in up.entries("plan") if e.trigger == "start"]
        assert sorted(p.model for p in start.current) == [a, b], start
        (first_sleep,) = shifts("standby")
        assert first_sleep.outcome == "succeeded" and first_sleep.phases.sleep_s is not None
        assert b not in {p.model for p in first_sleep.target or ()}
        assert pool_states(up) == {holder.endpoint: "active", sleeper.endpoint: "asleep"}

        results = asyncio.run(burst(up.port, b, 4))
        assert all(not text.startswith("error") and len(text.split()) >= 12 for _, text in results)

        (slept,) = shifts("swap-sleep")
        (woken,) = up.wait_until("the swap's wake logged", lambda: shifts("swap-wake"), 30)
        assert slept.outcome == woken.outcome == "succeeded"
        assert [p.model for p in slept.current] == [a] and slept.target == ()
        assert [p.model for p in woken.target] == [b]
        # A's requests in flight finished on it before it slept; none moved, none failed
        moved = slept.migrated
        assert moved is not None and moved.finished_in_place >= 1, moved
        assert moved.kv_moved == moved.recomputed == 0
        assert slept.phases.sleep_s is not None and woken.phases.wake_s is not None
        assert woken.phases.warm_s is None  # B woke: no cold start
        assert shifts("swap-back") == []
        assert [h.to_state for h in registry.history(holder.id)][-2:] == [
            State.DRAINING,
            State.ASLEEP,
        ]
        assert [h.to_state for h in registry.history(sleeper.id)] == [
            State.STARTING,  # the standby: launched in the first plan, then put to sleep
            State.ACTIVE,
            State.DRAINING,
            State.ASLEEP,
            State.WAKING,  # the swap
            State.ACTIVE,
        ]
        # the controller's status and the gateway's pool: B serves, A's engine sleeps
        status = up.status()
        assert [(i["model"], i["state"]) for i in status["instances"]] == [(b, "active")]
        assert [(i["model"], i["state"], i["level"]) for i in status["asleep"]] == [
            (a, "asleep", 1)
        ]
        assert pool_states(up) == {holder.endpoint: "asleep", sleeper.endpoint: "active"}
        ttft_s = min(t for t, _ in results)
        cold_s = registry.get(sleeper.id).cold_start_s or 0.0
        print(f"time-share: B's first token {ttft_s:.3f} s wall; its cold start {cold_s:.3f} s")
        assert 0 < ttft_s < cold_s

        # B idle: it sleeps, and A (whose requests queued meanwhile) wakes on gpu0 again
        up.wait_until("B asleep again", lambda: live(b, State.ASLEEP), 30)
        up.wait_until("A active again", lambda: live(a, State.ACTIVE), 30)
        assert [r.id for r in live(a, State.ACTIVE)] == [holder.id]  # the same engine
        load.stop()
        assert len(load.results) > 5 and load.failures() == [], load.failures()[:5]
        assert not [e for e in finished(up.entries("shift")) if e.outcome != "succeeded"]
    finally:
        if load is not None:
            load.stop()
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]
