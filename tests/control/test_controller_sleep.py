"""Sleep instead of stop, live (docs/controller.md, "Sleep instead of stop"): `flexpipe up` on
the seed's fragmented cluster with sim engines at `--time-scale 0.2`, two models, load through
the official openai client.

The idle model (minimum 0) scales to zero: its engine is put to sleep (vLLM's sleep mode,
level 1: the weights in host RAM), not stopped, and the gateway lists it asleep (never routed
to). A burst for it arrives: the controller, woken by the gateway's queue, wakes that engine
instead of cold-starting one, and the burst is served from it, its first token far sooner
than a cold start. The other model is served throughout and no request of it fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import openai
from test_controller_demand import pool_states
from test_controller_scenarios import Load, Up, finished

from flexpipe.cluster import load_cluster
from flexpipe.gears.gear import parse_gear
from flexpipe.lifecycle import State
from flexpipe.perf import perf_model_for
from flexpipe.store.instance_registry import InstanceRegistry
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
    demand: {{request_rate_per_s: 1, input_tokens: 512, output_tokens: 64}}
    slo: {{ttft_p99_ms: 2000, tpot_p99_ms: 60}}
    dtypes: [bf16]
    min_instances: 0
"""

# idle from the start: down after 3 samples; a long cooldown keeps the woken model up
SLEEPY = """
shift:
  sleep_mode: auto
  triggers:
    window_s: 30
    num_samples: 3
    cooldown_s: 60
"""

# wall seconds per modelled second: slower than the other live tests' 0.05, so that the modelled
# second of slack in the bound below is a fifth of a wall second on a busy machine
TIME_SCALE = 0.2


async def burst(port: int, model: str, n: int) -> list[tuple[float, str]]:
    """`n` streamed completions at once: (wall TTFT, text or the error) each."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                max_retries=0, timeout=120)  # fmt: skip

    async def one(i: int) -> tuple[float, str]:
        t0 = time.monotonic()
        ttft_s = -1.0
        text = ""
        try:
            stream = await client.completions.create(
                model=model, prompt=f"burst {i}", max_tokens=16, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for ch in stream:
                if ttft_s < 0:
                    ttft_s = time.monotonic() - t0
                text += ch.choices[0].text if ch.choices else ""
        except openai.APIError as exc:
            return ttft_s, f"error: {exc}"
        return ttft_s, text

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await client.close()


def test_an_idle_model_sleeps_and_a_burst_is_served_by_its_woken_engine(tmp_path: Path) -> None:
    up = Up(
        tmp_path,
        SLEEPY,
        models_yaml=TWO,
        extra=("--scale-to-zero", "--time-scale", str(TIME_SCALE)),
    )
    steady, idle = f"{up.model}-steady", f"{up.model}-idle"
    load: Load | None = None
    try:
        up.ready()
        load = Load(up.port, steady, num_streams=2, pause_s=0.2, max_tokens=16).start()
        registry = InstanceRegistry(up.store)

        def asleep() -> list[object]:
            return [r for r in registry.live_instances(model=idle) if r.state is State.ASLEEP]

        up.wait_until("the idle model's engine asleep", asleep, 90)
        (sleeper,) = asleep()
        assert not [i for i in up.status()["instances"] if i["model"] == idle]
        (listed,) = up.status()["asleep"]  # the controller's status lists it apart
        assert (listed["name"], listed["state"], listed["level"]) == (sleeper.name, "asleep", 1)
        down = [e for e in finished(up.entries("shift")) if e.trigger == "down"]
        assert down and down[0].outcome == "succeeded", down
        assert down[0].phases.sleep_s is not None and down[0].phases.release_s is None
        # the gateway keeps it, asleep (never routed to)
        assert pool_states(up)[sleeper.endpoint] == "asleep"
        pid_before = sleeper.pid
        time.sleep(1.0)  # idle ticks: nothing wakes without demand
        assert registry.get(sleeper.id).state is State.ASLEEP

        results = asyncio.run(burst(up.port, idle, 4))
        assert all(not text.startswith("error") and len(text.split()) >= 12 for _, text in results)

        def woken_shifts() -> list[ShiftEntry]:
            return [e for e in finished(up.entries("shift")) if e.trigger == "wake"]

        up.wait_until("the wake shift logged", woken_shifts, 30)
        wake = woken_shifts()[0]
        assert wake.outcome == "succeeded" and wake.phases.wake_s is not None, wake.phases
        assert wake.phases.warm_s is None  # no cold start
        woke = registry.get(sleeper.id)
        assert woke.state is State.ACTIVE and woke.pid == pid_before  # the same engine
        steps = [h.to_state for h in registry.history(sleeper.id)]
        assert steps[-3:] == [State.ASLEEP, State.WAKING, State.ACTIVE], steps
        ttft_s = min(t for t, _ in results)
        cold_s = woke.cold_start_s or 0.0
        # the modelled bound: the level-1 wake, the prefill, and 1 s for the rest (the
        # gateway's queue waking the controller, its tick, the first decode step)
        gpu_type = load_cluster(up.cluster).gpu(woke.gpu_ids[0]).type
        pm = perf_model_for("llama-2-7b", parse_gear(woke.gear), gpu_type)
        bound_s = (pm.wake_s(1) + pm.prefill_s(16) + 1.0) * TIME_SCALE
        print(
            f"wake from sleep: first token {ttft_s:.3f} s wall ({ttft_s / TIME_SCALE:.2f} s "
            f"modelled; bound {bound_s:.3f} s wall: wake {pm.wake_s(1):.2f} s + prefill + 1 s), "
            f"wake phase {wake.phases.wake_s:.3f} s; the engine's cold start {cold_s:.3f} s wall"
        )
        assert ttft_s <= bound_s < cold_s, (ttft_s, bound_s, cold_s)
        time.sleep(0.5)
        load.stop()
        assert len(load.results) > 5 and load.failures() == [], load.failures()[:5]
    finally:
        if load is not None:
            load.stop()
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]


def test_a_sleeping_engine_that_died_is_replaced_by_a_cold_start(tmp_path: Path) -> None:
    """The sleeping engine is killed (SIGKILL): the controller notices, and the burst that
    follows is served by a cold-started instance; no request fails."""
    up = Up(tmp_path, SLEEPY, models_yaml=TWO, extra=("--scale-to-zero",))
    idle = f"{up.model}-idle"
    try:
        up.ready()
        registry = InstanceRegistry(up.store)

        def asleep() -> list[object]:
            return [r for r in registry.live_instances(model=idle) if r.state is State.ASLEEP]

        up.wait_until("the idle model's engine asleep", asleep, 90)
        (sleeper,) = asleep()
        assert sleeper.pid is not None
        os.kill(sleeper.pid, signal.SIGKILL)
        up.wait_until(
            "the dead sleeper gone", lambda: registry.get(sleeper.id).state is State.GONE, 30
        )
        assert f"sleeping instance {sleeper.name} exited" in up.out.text
        results = asyncio.run(burst(up.port, idle, 2))
        assert all(not text.startswith("error") and len(text.split()) >= 12 for _, text in results)
        (fresh,) = [r for r in registry.live_instances(model=idle) if r.state is State.ACTIVE]
        assert fresh.id != sleeper.id and fresh.pid != sleeper.pid
        cold_s = fresh.cold_start_s or 0.0
        assert min(t for t, _ in results) >= cold_s > 0  # it waited for a cold start
    finally:
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]


def test_a_restarted_controller_stops_the_engine_its_predecessor_left_asleep(
    tmp_path: Path,
) -> None:
    """kill -9 of the controller while an engine sleeps: the controller `up` starts again
    does not adopt it (it serves nothing and holds its GPU) but stops it, and serves."""
    from test_controller import _is_controller
    from test_launcher import processes_with

    up = Up(tmp_path, SLEEPY, models_yaml=TWO, extra=("--scale-to-zero",))
    idle = f"{up.model}-idle"
    try:
        up.ready()
        registry = InstanceRegistry(up.store)

        def asleep() -> list[object]:
            return [r for r in registry.live_instances(model=idle) if r.state is State.ASLEEP]

        up.wait_until("the idle model's engine asleep", asleep, 90)
        (sleeper,) = asleep()
        (controller,) = [p for p in processes_with(str(tmp_path)) if _is_controller(p)]
        os.kill(controller, signal.SIGKILL)
        up.out.wait_for("instance(s) serving", 90, len(up.out.lines))
        gone = registry.get(sleeper.id)
        assert gone.state is State.GONE, gone
        assert gone.gone_reason == "not in the plan after a controller restart"
        assert sleeper.pid is not None and not _alive(sleeper.pid)
    finally:
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]


def _alive(pid: int) -> bool:
    """Running (a zombie no parent reaped yet is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
