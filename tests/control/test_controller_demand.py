"""The controller end to end where demand moves (docs/controller.md, "Several models", "Scale to
zero"), as a user runs it: `flexpipe up` on the seed's fragmented cluster with sim engines at
`--time-scale 0.05`, load through the official openai client, what happened read back from the
controller's status, the gateway and the shift log in the store.

- Scale to zero: an idle model whose minimum is 0 gives every GPU back; the gateway keeps
  the model (held), and the first request for it waits while the controller — woken by the
  gateway's queue, not a poll — cold-starts an instance. No request fails; its time to first
  token includes the cold start. While another tenant holds every GPU that could run it, its
  requests are refused in seconds with the reason (503), not held for a cold start that
  cannot come; once the tenant gives the GPUs back it is held again and the next request is
  served.
- Two models, two priorities: the customer-facing model's load rises and it takes GPUs from
  the internal one, which keeps its minimum; no request of either fails.
- The controller killed (SIGKILL) in the middle of a shift, while the new engine cold-starts:
  `up` starts another, which ends consistent — no second launch, no orphaned engine, the
  shift log intact with the cut-short shift recorded as aborted, the gateway's pool the
  store's live instances — and no request fails meanwhile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_controller import _is_controller
from test_controller_scenarios import FLEXPIPE, SHARED, Load, Up, finished
from test_launcher import processes_with
from test_up import engines_with

from flexpipe.lifecycle import State
from flexpipe.store.instance_registry import InstanceRegistry
from flexpipe.store.shift_entry import ShiftEntry

MIN_ZERO = """
models:
  - name: {name}
    model: llama-2-7b
    demand: {{request_rate_per_s: 8, input_tokens: 2048, output_tokens: 256}}
    slo: {{ttft_p99_ms: 2000, tpot_p99_ms: 60}}
    dtypes: [bf16, fp8]
    min_instances: 0
"""

# Idle from the start: down after 3 samples. A long cooldown keeps the woken model up while
# the test looks at it (the one request it serves would not keep it out of the down zone).
ZERO = """
shift:
  triggers:
    window_s: 30
    num_samples: 3
    cooldown_s: 60
"""


def cluster_cli(up: Up, verb: str) -> subprocess.CompletedProcess[str]:
    """`flexpipe cluster occupy|release` of every GPU of the seed's cluster."""
    argv = [*FLEXPIPE, "cluster", verb, "gpu0", "gpu1", "gpu2", "gpu3"]
    argv += ["--controller", up.controller_url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def test_an_idle_model_scales_to_zero_and_its_next_request_cold_starts_one(
    tmp_path: Path,
) -> None:
    up = Up(tmp_path, ZERO, models_yaml=MIN_ZERO, extra=("--scale-to-zero",))
    try:
        up.ready()
        up.wait_until("no instance left", lambda: not up.status()["instances"], 60)
        down = [e for e in finished(up.entries("shift")) if e.trigger == "down"]
        assert down and down[0].outcome == "succeeded" and down[0].target == (), down
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="x",
                               max_retries=0, timeout=120)  # fmt: skip
        # the gateway still serves the model: held, with no instance
        assert [m.id for m in client.models.list().data] == [up.model]
        time.sleep(1.0)  # a few idle ticks at zero: nothing starts without demand
        assert not up.status()["instances"]
        # another tenant takes every GPU (no --until): no instance can come, so a request is
        # refused in seconds with the reason, not held up to the gateway's 900 s
        taken = cluster_cli(up, "occupy")
        assert taken.returncode == 0, taken.stdout + taken.stderr
        up.wait_until("the model refused", lambda: up.status()["models"][0]["refused"], 30)
        # its engine slept (sleep mode) on a GPU the tenant now holds whole: it stopped
        assert "stopped: its GPU was taken" in up.out.text and not up.status()["asleep"]
        why = up.status()["models"][0]["refused"]
        assert why.startswith(f"no GPU free to us can place {up.model}"), why
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=up.model, prompt="wake up", max_tokens=4)
        assert refused.value.status_code == 503 and time.monotonic() - t0 < 20
        assert why in refused.value.response.json()["error"]["message"]
        assert refused.value.response.headers["retry-after"]
        assert [m.id for m in client.models.list().data] == [up.model]  # still listed
        assert f"{up.model} is refused (503), not held" in up.out.text
        notes = [e.reason for e in up.entries("resources")]
        assert any(r.startswith(f"{up.model} refused, not held: ") for r in notes), notes
        given = cluster_cli(up, "release")
        assert given.returncode == 0, given.stdout + given.stderr
        up.wait_until("held again", lambda: not up.status()["models"][0]["refused"], 30)
        assert f"{up.model} can be placed again; held again" in up.out.text
        t0 = time.monotonic()
        stream = client.completions.create(
            model=up.model, prompt="wake up", max_tokens=16, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        ttft_s: float | None = None
        text = ""
        for chunk in stream:
            if ttft_s is None:
                ttft_s = time.monotonic() - t0
            text += chunk.choices[0].text if chunk.choices else ""
        assert ttft_s is not None and len(text.split()) >= 12, text

        # the request is served once the new instance is active; the shift is logged as
        # finished a moment later (after its last step), so wait for that record
        def woken_shifts() -> list[ShiftEntry]:
            return [e for e in finished(up.entries("shift")) if e.trigger == "wake"]

        up.wait_until("the wake shift logged as finished", woken_shifts, 30)
        woken = woken_shifts()
        assert woken and woken[0].outcome == "succeeded", up.out.text[-3000:]
        assert "requests wait for" in up.out.text
        live = InstanceRegistry(up.store).live_instances()
        assert live and all(r.state == "active" for r in live)
        cold_s = max(r.cold_start_s or 0.0 for r in live)
        # the request waited for the engine's cold start (and its rehearsal), then was served
        assert cold_s > 0 and ttft_s >= cold_s, (ttft_s, cold_s)
        print(f"scale from zero: TTFT {ttft_s:.2f} s wall, cold start {cold_s:.2f} s")
        # a second request finds the instance warm
        t0 = time.monotonic()
        out = client.completions.create(model=up.model, prompt="again", max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens == 4
        assert time.monotonic() - t0 < ttft_s
    finally:
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]


TWO = """
models:
  - name: {name}-hi
    model: llama-2-7b
    demand: {{request_rate_per_s: 0.2, input_tokens: 2048, output_tokens: 256}}
    slo: {{ttft_p99_ms: 2000, tpot_p99_ms: 60}}
    dtypes: [bf16, fp8]
    priority: 10
    min_instances: 1
  - name: {name}-lo
    model: llama-2-7b
    demand: {{request_rate_per_s: 8, input_tokens: 2048, output_tokens: 256}}
    slo: {{ttft_p99_ms: 2000, tpot_p99_ms: 60}}
    dtypes: [bf16, fp8]
    priority: 1
    min_instances: 1
"""

# Load-driven up-shifts only (no down-shift of the lightly loaded internal model), and one
# shift: the cooldown outlasts the test.
TRADE = """
shift:
  triggers:
    window_s: 30
    num_samples: 3
    cooldown_s: 300
    thresholds: {down_utilization: 0.0}
"""


def gpus_by_model(up: Up) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for inst in up.status()["instances"]:
        out.setdefault(inst["model"], set()).update(inst["gpus"])
    return out


def test_a_high_priority_model_takes_gpus_from_a_low_priority_one_as_its_load_rises(
    tmp_path: Path,
) -> None:
    up = Up(tmp_path, TRADE, models_yaml=TWO)
    hi, lo = f"{up.model}-hi", f"{up.model}-lo"
    loads: list[Load] = []
    try:
        up.ready()
        before = gpus_by_model(up)
        # the first plan, for the configured demand: the internal model has most GPUs
        assert len(before[lo]) > len(before[hi]) >= 1, before
        loads.append(Load(up.port, lo, num_streams=2, pause_s=0.5).start())
        # the customer-facing model's load rises far beyond its one small instance
        loads.append(Load(up.port, hi, num_streams=12, max_tokens=256).start())
        shifts = up.wait_until(
            "an up-shift for the customer-facing model",
            lambda: [e for e in finished(up.entries("shift")) if e.trigger == "up"],
            120,
        )
        shift = shifts[0]
        assert shift.outcome == "succeeded", (shift.reason, shift.error)
        assert hi in shift.reason  # its samples were in the up zone
        after = gpus_by_model(up)
        taken = after[hi] & before[lo]
        assert taken, (before, after)  # GPUs the internal model had now serve the other
        assert len(after[hi]) > len(before[hi]) or taken - before[hi]
        # the internal model keeps its minimum
        assert sum(1 for i in up.status()["instances"] if i["model"] == lo) >= 1
        print(f"priority trade: {before} -> {after}: {shift.reason}")
        time.sleep(1)
        for load in loads:
            load.stop()
        for load in loads:
            assert len(load.results) > 5 and load.failures() == [], load.failures()[:5]
    finally:
        for load in loads:
            load.stop()
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]


def pool_states(up: Up) -> dict[str, str]:
    """The gateway's pool (instance URL -> lifecycle state), from its public /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{up.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.labels["instance"]: s.labels["state"]
        for family in text_string_to_metric_families(text)
        if family.name == "flexpipe_instance_up"
        for s in family.samples
    }


def test_the_controller_killed_mid_shift_restarts_into_a_consistent_state(
    tmp_path: Path,
) -> None:
    up = Up(tmp_path, SHARED, drain_s=1)
    load: Load | None = None
    try:
        up.ready()
        registry = InstanceRegistry(up.store)
        first_ids = {r.id for r in registry.instances()}
        load = Load(up.port, up.model).start()
        time.sleep(1)
        controllers = [p for p in processes_with(str(tmp_path)) if _is_controller(p)]
        assert len(controllers) == 1
        up.set_gpu("gpu1", used_gib=0)  # the tenant leaves gpu1: an in-place shift follows

        def cold_starting() -> list[object]:
            return [r for r in registry.live_instances()
                    if r.id not in first_ids and r.state is State.STARTING]  # fmt: skip

        up.wait_until("a new engine of the shift cold-starting", cold_starting, 60)
        os.kill(controllers[0], signal.SIGKILL)  # mid-shift: its new engine is not ready
        num_entries = len(up.entries())
        up.out.wait_for("adopted", 90)
        up.wait_until(
            "the restarted controller serving, every instance active",
            lambda: (
                "instance(s) serving" in up.out.text.split("adopted", 1)[1]
                and up.status()["instances"]
                and all(i["state"] == "active" for i in up.status()["instances"])
            ),
            90,
        )
        time.sleep(1)
        # the shift log: intact, the cut-short shift recorded as such
        entries = up.entries()
        assert [e.id for e in entries] == list(range(1, len(entries) + 1))
        assert len(entries) >= num_entries
        cut = [e for e in entries if e.kind == "shift" and e.trigger == "resource"]
        assert cut and cut[0].outcome == "aborted", [(e.kind, e.outcome) for e in entries]
        assert cut[0].error == "the controller restarted mid-change"
        assert not [e for e in entries if e.outcome == "pending"]
        # the store, the engines and the gateway agree, once the engines the restarted
        # controller's plan retired have drained (drain_s) and exited
        up.wait_until(
            "one engine per live instance",
            lambda: len(engines_with(up.model)) == len(registry.live_instances()),
            30,
        )
        live = registry.live_instances()
        assert live and all(r.state is State.ACTIVE for r in live)
        gpus = [g for r in live for g in r.gpu_ids]
        assert len(gpus) == len(set(gpus)), live  # no two engines on one GPU
        groups = {r.pgid for r in live}
        # one engine per live instance (no second launch), each one's (no orphan)
        engines = engines_with(up.model)
        assert len(engines) == len(live) and {os.getpgid(p) for p in engines} == groups
        assert pool_states(up) == {r.endpoint: "active" for r in live}
        assert {i["url"] for i in up.status()["instances"]} == {r.endpoint for r in live}
        gone = [(r.name, r.gear, r.gone_reason) for r in registry.instances() if not r.live]
        print(f"after the restart: live {[(r.name, r.gear) for r in live]}, gone {gone}")
        results = load.stop()
        assert len(results) > 20 and load.failures() == [], load.failures()[:5]
    finally:
        if load is not None:
            load.stop()
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]
