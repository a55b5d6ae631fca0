"""The gateway's holds and refusals outlive a shift longer than the hold (control/standby.py):
the tick that renews them waits while a shift runs, so the shift renews them itself.

- `renewal`, exactly: what is renewed, and how often;
- end to end, on the real clock: a controller scaled to zero, with a 1 s hold and engines
  whose cold start takes several times that; a request queued before the wake and one sent
  well after the hold would have lapsed, both during the wake shift's cold start, are served
  (never a 404). Real HTTP on 127.0.0.1 (an in-process gateway, the controller's client, sim
  engine processes), the official `openai` client;
- the simulator's controller renews the same on its virtual clock, only while its shift runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from test_controller_demand import ZERO
from test_gateway_api import Running
from test_gateway_fakes import LoopThread

from flexpipe.control.controller import Controller, ControllerConfig
from flexpipe.control.gateway_client import GatewayClient
from flexpipe.control.launching import engine_spec
from flexpipe.control.standby import Renewal, renewal
from flexpipe.launch import LocalLauncher, free_port
from flexpipe.policies.planner import parse_models
from flexpipe.policies.shift import ShiftParams

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples/clusters/fragmented-4gpu.yaml"
# one instance (gpu2) at this rate; min 0: idle, it scales to zero under --scale-to-zero
MODELS = """
models:
  - name: held-m
    model: llama-2-7b
    demand: {request_rate_per_s: 0.5, input_tokens: 512, output_tokens: 64}
    slo: {ttft_p99_ms: 2000, tpot_p99_ms: 60}
    dtypes: [bf16]
    min_instances: 0
"""
HOLD_S = 1.0  # the gateway's hold of a model with no instance, renewed...
TICK_S = 0.5  # ... every tick, and while a shift runs every min(tick, hold / 3)
TIME_SCALE = 0.05
LOAD_S = 80.0  # modelled: an engine loads 4 s of wall time, 4 holds


def test_a_renewal_keeps_the_holds_and_refusals_a_tick_would_and_at_a_third_of_the_hold() -> None:
    why = "no GPU free to us can place big: every GPU is held by batch"
    # a refused model stays refused (a hold would lift its refusal): not renewed as a hold
    assert renewal({"b", "a", "big"}, {"big": why}, 10.0, 600.0) == Renewal(
        ("a", "b"), (("big", why),), 10.0
    )
    assert renewal(["a"], {}, 10.0, 6.0) == Renewal(("a",), (), 2.0)  # three times a hold
    assert renewal(["a"], {}, 0.5, 1.0) == Renewal(("a",), (), 1.0 / 3)
    assert renewal([], {"big": why}, 0.5, 3.0) == Renewal((), (("big", why),), 0.5)
    assert renewal([], {}, 10.0, 600.0) is None  # nothing held: nothing to keep
    assert renewal(["a"], {}, 10.0, 0.0) is None  # no hold to keep alive


class Said:
    """The controller's lines, with when each was said."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def __call__(self, line: str) -> None:
        self.lines.append((time.monotonic(), line))

    def when(self, needle: str, after_s: float = 0.0) -> float | None:
        return next((t for t, s in self.lines if needle in s and t >= after_s), None)

    def wait(self, needle: str, timeout_s: float, after_s: float = 0.0) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            t = self.when(needle, after_s)
            if t is not None:
                return t
            time.sleep(0.05)
        text = "\n".join(s for _, s in self.lines)
        raise AssertionError(f"no {needle!r} within {timeout_s} s in:\n{text}")


def test_a_held_model_stays_held_through_a_wake_shift_longer_than_the_hold(
    lt: LoopThread,
) -> None:
    demands = parse_models(yaml.safe_load(MODELS), "models")
    gateway = Running(lt, [], admin_token="gw")
    cfg = ControllerConfig(
        CLUSTER, demands, port=free_port(), tick_s=TICK_S, drain_deadline_s=2.0,
        time_scale=TIME_SCALE, engine_admin_token="engines", min_instances_floor=0,
        standby_hold_s=HOLD_S, shift=ShiftParams.from_mapping(yaml.safe_load(ZERO)["shift"]),
    )  # fmt: skip
    said = Said()
    ctl = Controller(
        cfg, LocalLauncher("sim", time_scale=TIME_SCALE, sim_load_time_s=LOAD_S),
        GatewayClient(gateway.url, "gw"),
        lambda p, c: engine_spec(p, c, str(CLUSTER), demands, cfg.engine_admin_token),
        say=said,
    )  # fmt: skip
    stop = asyncio.Event()
    running: Any = None
    client = gateway.client(timeout=60)
    try:
        lt.run(ctl.start(), timeout_s=90)
        running = asyncio.run_coroutine_threadsafe(ctl.run(stop), lt.loop)
        said.wait("controller: shift done", 60)  # idle: down to zero
        assert not ctl.running
        assert [m.id for m in client.models.list().data] == ["held-m"]  # held
        time.sleep(3 * HOLD_S)  # at zero for a few holds: the ticks renew the hold

        first: list[Any] = []

        def ask() -> None:
            try:
                first.append(client.completions.create(model="held-m", prompt="wake", max_tokens=4))
            except openai.APIError as exc:
                first.append(exc)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()  # queued for the cold start its demand triggers
        shift_s = said.wait("controller: shift (wake)", 30)
        # the hold the last tick renewed has lapsed, unless the shift renews it
        time.sleep(max(0.0, shift_s + 2.5 * HOLD_S - time.monotonic()))
        sent_s = time.monotonic()
        out = client.completions.create(model="held-m", prompt="during the shift", max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens == 4
        ready_s = said.when("held-m-0 ready at", shift_s)
        # it was sent during the cold start, well after the hold would have lapsed
        assert ready_s is not None and shift_s + 2 * HOLD_S < sent_s < ready_s, (
            shift_s, sent_s, ready_s,
        )  # fmt: skip
        asker.join(60)
        assert len(first) == 1 and not isinstance(first[0], Exception), first
        assert first[0].usage.completion_tokens == 4
    finally:
        lt.loop.call_soon_threadsafe(stop.set)
        if running is not None:
            running.result(60)
        lt.run(ctl.close(), timeout_s=60)
        gateway.close()
