"""An in-place re-gear made before the break, live (docs/controller.md, "In place"): `flexpipe
up` on the seed's fragmented cluster, sim engines at `--time-scale 0.2`, load through the
official openai client, `shift.pricing.in_place: make_before_break`. The other tenant leaves
gpu1: the successor on the TP2's GPUs cannot fit beside it, so it is pre-started, rehearsed
and put to sleep while the TP2 serves; the TP2 then drains for 2 s and is released, and the
successor wakes from host RAM. The model lacks the TP2's capacity for seconds, not a cold
start; no request fails."""

from __future__ import annotations

import re
import time
from pathlib import Path

from test_controller_scenarios import Load, Up, finished

from flexpipe.lifecycle import State
from flexpipe.store.instance_registry import InstanceRegistry

MAKE_BEFORE_BREAK = """
shift:
  triggers:
    window_s: 30
    num_samples: 2
    cooldown_s: 60
    resource_settle_s: 0.5
    thresholds: {down_utilization: 0.0}
    resource_min_gain_fraction: 0.0
  pricing: {horizon_s: 7200, in_place: make_before_break}
"""
TIME_SCALE = 0.2  # wall s per modelled s: a machine stall of 0.2 s is 1 modelled s


def test_the_seed_pair_is_re_geared_by_a_wake_not_a_cold_start(tmp_path: Path) -> None:
    up = Up(tmp_path, MAKE_BEFORE_BREAK, extra=("--time-scale", str(TIME_SCALE)))
    load: Load | None = None
    try:
        up.ready()
        load = Load(up.port, up.model, num_streams=4, max_tokens=24).start()
        time.sleep(1.0)
        up.set_gpu("gpu1", used_gib=0)  # the other tenant leaves gpu1
        (shift,) = up.wait_until(
            "the resource shift done",
            lambda: [e for e in finished(up.entries("shift")) if e.trigger == "resource"][:1],
            90,
        )
        assert shift.outcome == "succeeded", (shift.error, shift.notes)
        steps = [n for n in shift.notes if n.startswith("in place: ")]
        assert steps and all(n.startswith("in place: wake, capacity away ") for n in steps), steps
        away_s = sum(float(m.group(1)) for n in steps if (m := re.search(r"away ([\d.]+)", n)))
        print(f"in place: capacity away {away_s:.3f} s wall = {away_s / TIME_SCALE:.2f} s "
              f"modelled; phases {shift.phases.to_dict()}")  # fmt: skip
        assert away_s / TIME_SCALE <= 5.0, steps
        # rehearsed and put to sleep before the break, woken after it
        assert None not in (shift.phases.rehearse_s, shift.phases.sleep_s, shift.phases.wake_s)
        # the successor on gpu1: starting, rehearsing, asleep beside the TP2, then woken
        registry = InstanceRegistry(up.store)
        (new,) = [r for r in registry.live_instances(model=up.model) if "gpu1" in r.gpu_ids]
        states = [h.to_state for h in registry.history(new.id)]
        assert states == [State.STARTING, State.REHEARSING, State.ASLEEP, State.WAKING,
                          State.ACTIVE], states  # fmt: skip
        time.sleep(0.5)
        load.stop()
        assert len(load.results) > 10 and load.failures() == [], load.failures()[:5]
    finally:
        if load is not None:
            load.stop()
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]
