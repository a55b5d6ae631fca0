"""The gateway's holds and refusals outlive a shift longer than the hold (control/standby.py):
the tick that renews them waits while a shift runs, so the shift renews them itself.

- `renewal`, exactly: what is renewed, and how often;
- end to end, on the real clock: a controller scaled to zero, with a 1 s hold and engines
  whose cold start takes several times that; a request queued before the wake and one sent
  well after the hold would have lapsed, both during the wake shift's cold start, are served
  (never a 404). Real HTTP on 127.0.0.1 (an in-process gateway, the controller's client, sim
  engine processes), the official `openai` client;
- the simulator's controller renews the same on its virtual clock: a model no GPU can place
  stays refused (503 with the reason, not a 404) through a shift longer than the hold.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import openai
import yaml
from test_controller_demand import ZERO
from test_gateway_api import Running
from test_gateway_fakes import LoopThread

from flexpipe.control.api.gateway_client import GatewayClient
from flexpipe.control.controller import Controller
from flexpipe.control.controller_config import ControllerConfig
from flexpipe.control.engines.launching import engine_spec
from flexpipe.control.standby import Renewal, renewal
from flexpipe.gateway.core.holds import STANDBY_HOLD_S
from flexpipe.launch import LocalLauncher, free_port
from flexpipe.policies.planner import parse_models
from flexpipe.policies.shift import ShiftParams
from flexpipe.sim import simulate
from flexpipe.sim.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[2]
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


def test_the_renewal_runs_while_the_shift_does_and_stops_however_it_ends(
    lt: LoopThread,
) -> None:
    """`Controller._renewing` around a shift that raises, and one cancelled (the controller
    stops): renewed while it runs (held past its hold), stopped and awaited when it ends (no
    renewing task left; the hold lapses)."""
    gateway = Running(lt, [], admin_token="gw")
    demands = parse_models(yaml.safe_load(MODELS), "models")
    cfg = ControllerConfig(CLUSTER, demands, tick_s=10.0, standby_hold_s=HOLD_S)
    ctl = Controller(cfg, LocalLauncher(), GatewayClient(gateway.url, "gw"),
                     lambda p, c: engine_spec(p, c, str(CLUSTER), demands))  # fmt: skip

    def renewing() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks(lt.loop) if "keep" in repr(t.get_coro())]

    async def shift(fails: bool) -> None:
        await ctl.gateway.hold("held-m", HOLD_S)  # as the tick before the shift does
        async with ctl._renewing(["held-m"]):
            await asyncio.sleep(1.5 * HOLD_S)
            assert gateway.gw.held("held-m") and len(renewing()) == 1  # renewed
            if fails:
                raise RuntimeError("the shift failed")
            await asyncio.Event().wait()  # until cancelled

    async def cancelled() -> None:
        task = asyncio.create_task(shift(fails=False))
        await asyncio.sleep(2 * HOLD_S)
        task.cancel()
        await asyncio.wait([task])
        assert task.cancelled()

    try:
        for end in (shift(fails=True), cancelled()):
            try:
                lt.run(end)
            except RuntimeError as exc:
                assert str(exc) == "the shift failed"
            assert renewing() == []
            time.sleep(1.2 * HOLD_S)  # a renewal under way ended before the shift did
            assert not gateway.gw.held("held-m")  # the hold lapsed: nobody renews it
    finally:
        lt.run(ctl.gateway.close())
        gateway.close()


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


# the wake must cold-start (in sleep mode it would wake the engine the down shift put to sleep)
COLD = ShiftParams.from_mapping({**yaml.safe_load(ZERO)["shift"], "sleep_mode": "off"})


def test_a_held_model_stays_held_through_a_wake_shift_longer_than_the_hold(
    lt: LoopThread,
) -> None:
    demands = parse_models(yaml.safe_load(MODELS), "models")
    gateway = Running(lt, [], admin_token="gw")
    cfg = ControllerConfig(
        CLUSTER, demands, port=free_port(), tick_s=TICK_S, drain_deadline_s=2.0,
        time_scale=TIME_SCALE, engine_admin_token="engines", min_instances_floor=0,
        standby_hold_s=HOLD_S, shift=COLD,
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
        # (the deployment's second instance on that plan slot: a name no earlier one had)
        ready_s = said.when("held-m-0.2 ready at", shift_s)
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


def _zero(name: str, model: str) -> dict[str, Any]:
    """A model with no instance until its requests come (min 0, no demand planned)."""
    demand = {"request_rate_per_s": 0, "input_tokens": 64, "output_tokens": 16}
    return {"name": name, "model": model, "min_instances": 0, "dtypes": ["bf16"],
            "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 200}, "demand": demand}  # fmt: skip


def _short(model: str, start_s: float) -> dict[str, Any]:
    return {"model": model, "arrivals": {"rate_per_s": 0.05, "start_s": start_s},
            "prompt_tokens": {"dist": "fixed", "mean": 64},
            "output_tokens": {"dist": "fixed", "mean": 16}}  # fmt: skip


def test_the_simulator_keeps_a_refusal_through_a_shift_longer_than_the_hold(
    tmp_path: Path,
) -> None:
    """The seed's cluster (gpu1 freed at 100 s, gpu3 another tenant's). `a` serves 50k-token
    answers on two instances (gpu2, gpu1); `c` (13B: not on the L4) wakes at 610 s, and its
    shift moves `a`'s gpu1 instance to the L4 (fp8) and starts `c` on gpu1 once that instance
    drains those answers (a 3000 s drain deadline): a shift far longer than the hold.
    `big` (a 405B-shaped model) fits on no GPU free to us: refused at every tick; its requests
    that arrive more than a hold after the shift began are still refused with the reason,
    at once (before the renewal: a 404, the refusal had lapsed)."""
    shape = json.loads((ROOT / "flexpipe/data/models/llama-3.1-70b.json").read_text())["config"]
    shape.update(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                 num_attention_heads=128)  # fmt: skip
    big = tmp_path / "big.json"
    big.write_text(json.dumps(shape))
    long = {"name": "a", "model": "llama-3.1-8b", "max_model_len": 65536, "min_instances": 2,
            "demand": {"request_rate_per_s": 1, "input_tokens": 256, "output_tokens": 1024},
            "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 200},
            "dtypes": ["bf16", "fp8"]}  # fmt: skip
    doc = {
        "name": "renew", "duration_s": 1300, "seed": 0, "cluster": {"file": str(CLUSTER)},
        "controller": {"drain_deadline_s": 3000, "min_instances_floor": 0,
                       "shift": {"triggers": {"thresholds": {"down_utilization": 0.0}}}},
        "models": [long, _zero("c", "llama-2-13b"), _zero("big", str(big))],
        "resources": [{"at_s": 0, "occupy": ["gpu3"], "owner": "batch"},
                      {"at_s": 100, "release": ["gpu1"]}],
        "workloads": [{"model": "a", "arrivals": {"rate_per_s": 0.02, "start_s": 30},
                       "prompt_tokens": {"dist": "fixed", "mean": 256},
                       "output_tokens": {"dist": "fixed", "mean": 50000}},
                      _short("c", 600), _short("big", 1220)],
    }  # fmt: skip
    r = simulate(parse_scenario(doc, ROOT), "flexpipe")
    (wake,) = [s for s in r.shifts if s["trigger"] == "wake"]
    assert wake["succeeded"] and wake["at_s"] == 610.0
    assert wake["finished_s"] - wake["at_s"] > STANDBY_HOLD_S + 200, wake  # far longer
    refused = [q for q in r.requests if q.model == "big"]
    # each arrived after the refusal of the tick before the shift would have lapsed
    assert refused and all(
        wake["at_s"] + STANDBY_HOLD_S < q.arrival_s < wake["finished_s"] for q in refused
    )
    why = "503: The model `big` cannot be served now: no GPU free to us can place big"
    assert all(q.failed.startswith(why) and q.finish_s == q.arrival_s for q in refused), {
        q.failed for q in refused
    }
    assert all(q.completed for q in r.requests if q.model != "big")
