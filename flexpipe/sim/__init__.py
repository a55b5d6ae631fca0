"""The simulator: flexpipe's engine cores, gateway router, planner and performance model on a
virtual clock (docs/simulator.md).

    from flexpipe.sim import load_scenario, resolve, simulate, report
    result = simulate(load_scenario(resolve("seed-fragmented")), "flexpipe")
    print(report(result)["goodput_requests_per_s"])
"""

from flexpipe.sim.deployment import Deployment
from flexpipe.sim.loop import EventLoop
from flexpipe.sim.policy import POLICIES, Policy, PolicyView, create_policy
from flexpipe.sim.report import report, report_json, write_reports
from flexpipe.sim.request import SimRequest
from flexpipe.sim.scenario import (
    Scenario,
    ScenarioError,
    builtin_scenarios,
    load_scenario,
    parse_scenario,
    resolve,
)
from flexpipe.sim.simulator import SimResult, simulate

__all__ = [
    "POLICIES",
    "Deployment",
    "EventLoop",
    "Policy",
    "PolicyView",
    "Scenario",
    "ScenarioError",
    "SimRequest",
    "SimResult",
    "builtin_scenarios",
    "create_policy",
    "load_scenario",
    "parse_scenario",
    "report",
    "report_json",
    "resolve",
    "simulate",
    "write_reports",
]
