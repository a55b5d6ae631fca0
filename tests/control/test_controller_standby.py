"""Standby sleepers, live (docs/controller.md, "Standby sleepers"): `flexpipe up` on the seed's
fragmented cluster with sim engines at `--time-scale 0.1`, two models, `shift.standby` on.

The idle model declares no demand, so the planner gives it no instance; the first plan has the
standby set in place instead (each model's standby engines, as the simulator starts), and once
it serves, the standbys nothing waits for are put to sleep (level 1). A burst for the idle
model arrives: its sleeper is woken beside the policy's shifts (no cold start) and serves it;
idle again, the model is put back to sleep. The other model is served throughout (its
requests wake it if it slept at the start), nothing fails.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from test_controller_demand import pool_states
from test_controller_scenarios import Load, Up, finished
from test_controller_sleep import burst

from flexpipe.lifecycle import State
from flexpipe.store.instance_registry import InstanceRecord, InstanceRegistry
from flexpipe.store.shift_entry import ShiftEntry

TWO = """
models:
  - name: {name}-steady
    model: llama-2-7b
    demand: {{request_rate_per_s: 1, input_tokens: 512, output_tokens: 64}}
    slo: {{ttft_p99_ms: 2000, tpot_p99_ms: 60}}
    dtypes: [bf16]
    min_instances: 1
  - name: {name}-idle
    model: llama-2-7b
    demand: {{request_rate_per_s: 0, input_tokens: 512, output_tokens: 64}}
    slo: {{ttft_p99_ms: 2000, tpot_p99_ms: 60}}
    dtypes: [bf16]
    min_instances: 0
"""

# the policy's own triggers slow (no down shift in the test's time): what sleeps and wakes
# here does so beside the shifts; an idle model sleeps after 2 s
STANDBY = """
shift:
  sleep_mode: auto
  standby: {enabled: true, aside_tick_s: 0.25, sleep_idle_s: 2}
  triggers:
    window_s: 300
    num_samples: 200
    cooldown_s: 300
"""

TIME_SCALE = 0.1


def test_a_standby_sleeps_ahead_of_demand_and_a_burst_is_served_after_its_wake(
    tmp_path: Path,
) -> None:
    up = Up(
        tmp_path,
        STANDBY,
        models_yaml=TWO,
        extra=("--scale-to-zero", "--time-scale", str(TIME_SCALE)),
    )
    steady, idle = f"{up.model}-steady", f"{up.model}-idle"
    load: Load | None = None
    try:
        up.ready()
        # busy throughout (never idle at an aside tick's look): it never sleeps
        load = Load(up.port, steady, num_streams=2, pause_s=0.0, max_tokens=64).start()
        registry = InstanceRegistry(up.store)

        def asleep() -> list[InstanceRecord]:
            return [r for r in registry.live_instances(model=idle) if r.state is State.ASLEEP]

        def shifts(trigger: str) -> list[ShiftEntry]:
            return [e for e in finished(up.entries("shift")) if e.trigger == trigger]

        up.wait_until("a standby of the idle model asleep", asleep, 60)
        (sleeper,) = asleep()
        # launched in the first plan, then put to sleep
        (start,) = [e for e in up.entries("plan") if e.trigger == "start"]
        assert sorted(p.model for p in start.current) == [idle, steady], start
        (first_sleep,) = shifts("standby")
        assert first_sleep.outcome == "succeeded" and first_sleep.phases.sleep_s is not None
        assert idle not in {p.model for p in first_sleep.target or ()}
        assert pool_states(up)[sleeper.endpoint] == "asleep"
        time.sleep(1.0)  # nothing wakes without demand
        assert registry.get(sleeper.id).state is State.ASLEEP

        results = asyncio.run(burst(up.port, idle, 4))
        assert all(not text.startswith("error") and len(text.split()) >= 12 for _, text in results)

        def woken(model: str) -> list[ShiftEntry]:
            return [e for e in shifts("wake-aside") if any(model in n for n in e.notes)]

        up.wait_until("the wake beside logged", lambda: woken(idle), 30)
        (wake,) = woken(idle)
        assert wake.outcome == "succeeded" and wake.phases.wake_s is not None, wake.phases
        assert wake.phases.warm_s is None  # no cold start
        steps = [h.to_state for h in registry.history(sleeper.id)]
        assert steps[-3:] == [State.ASLEEP, State.WAKING, State.ACTIVE], steps
        cold_s = registry.get(sleeper.id).cold_start_s or 0.0
        ttft_s = min(t for t, _ in results)
        print(f"standby: first token {ttft_s:.3f} s wall; its cold start {cold_s:.3f} s wall")
        assert 0 < ttft_s < cold_s

        # idle again: put back to sleep beside the shifts, the same engine
        up.wait_until("the idle model asleep again", lambda: shifts("sleep-aside"), 30)
        up.wait_until("its engine asleep again", asleep, 30)
        assert [r.id for r in asleep()] == [sleeper.id]
        assert not [e for e in finished(up.entries("shift")) if e.outcome != "succeeded"]
        assert len(woken(steady)) <= 1  # asleep at most from the first plan to its load
        # and needs no standby: its engine covers its rate (measured per modelled second)
        assert [r.state for r in registry.live_instances(model=steady)] == [State.ACTIVE]
        load.stop()
        assert len(load.results) > 5 and load.failures() == [], load.failures()[:5]
    finally:
        if load is not None:
            load.stop()
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]
