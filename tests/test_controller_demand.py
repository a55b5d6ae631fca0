"""The controller end to end where demand moves (issue 9 §3, §5), as a user runs it: `flexpipe
up` on the seed's fragmented cluster with sim engines at `--time-scale 0.05`, load through the
official openai client, what happened read back from the controller's status, the gateway and
the shift log in the store.

- Scale to zero: an idle model whose minimum is 0 gives every GPU back; the gateway keeps
  the model (held), and the first request for it waits while the controller — woken by the
  gateway's queue, not a poll — cold-starts an instance. No request fails; its time to first
  token includes the cold start.
- Two models, two priorities: the customer-facing model's load rises and it takes GPUs from
  the internal one, which keeps its minimum; no request of either fails.
"""

from __future__ import annotations

import time
from pathlib import Path

import openai
from test_controller_scenarios import Load, Up, finished

from flexpipe.store.instance_registry import InstanceRegistry

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


def test_an_idle_model_scales_to_zero_and_its_next_request_cold_starts_one(
    tmp_path: Path,
) -> None:
    up = Up(tmp_path, ZERO, models_yaml=MIN_ZERO)
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
        woken = [e for e in finished(up.entries("shift")) if e.trigger == "wake"]
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
