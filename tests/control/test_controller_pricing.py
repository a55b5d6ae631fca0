"""The controller prices a shift with the drain deadline its executor keeps (one fact): a
shift config's own `pricing.drain_deadline_s` cannot disagree with `--drain-deadline-s`."""

from __future__ import annotations

from pathlib import Path

from flexpipe.control.api.gateway_client import GatewayClient
from flexpipe.control.controller import Controller
from flexpipe.control.controller_config import ControllerConfig
from flexpipe.launch import LocalLauncher
from flexpipe.policies.planner import ModelDemand, Slo
from flexpipe.policies.shift import PricingParams, ShiftParams

ROOT = Path(__file__).resolve().parents[2]


def test_the_policy_prices_with_the_executors_drain_deadline() -> None:
    demand = ModelDemand("m", "llama-2-7b", 1.0, 512, 64, Slo(2.0, 0.1), ("bf16",))
    shift = ShiftParams(pricing=PricingParams(drain_deadline_s=30.0, horizon_s=600.0))
    config = ControllerConfig(
        ROOT / "examples/clusters/fragmented-4gpu.yaml",
        (demand,),
        drain_deadline_s=4.0,
        shift=shift,
    )
    ctl = Controller(config, LocalLauncher(), GatewayClient("http://127.0.0.1:9", None),
                     lambda p, c: None,  # type: ignore[arg-type,return-value]
                     clock=lambda: 0.0, wall=lambda: 0.0, say=lambda line: None)  # fmt: skip
    pricing = ctl.policy.params.pricing
    assert pricing.drain_deadline_s == 4.0  # the executor's, not the shift config's
    assert pricing.horizon_s == 600.0  # the rest of the shift config is kept
    assert ctl.executor.drain_deadline_s == 4.0
