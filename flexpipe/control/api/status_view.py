"""The controller's `GET /admin/status` document (what `flexpipe status`, `top` and the
Prometheus service discovery read)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from flexpipe.control.gateway_fleet import fleet_view

if TYPE_CHECKING:
    from flexpipe.control.controller import Controller

__all__ = ["controller_status"]


def controller_status(ctl: Controller) -> dict[str, Any]:
    """What `GET /admin/status` says: the instances of the running plan, the resources, where
    the gateway, engines and shift log are, each model's rates and the last decision."""
    return {
        "instances": [
            {
                "key": i.key,
                "name": i.planned.name,
                "model": i.planned.model,
                "gear": i.planned.gear.key(),
                "gpus": list(i.planned.gpu_ids),
                "url": i.url,
                "state": i.state,
            }
            for i in ctl.running.values()
        ],
        # engines asleep (sleep mode, docs/controller.md): they hold their GPUs, serve nothing
        "asleep": [
            {
                "key": i.key,
                "name": i.planned.name,
                "model": i.planned.model,
                "gear": i.planned.gear.key(),
                "gpus": list(i.planned.gpu_ids),
                "url": i.url,
                "state": i.state,
                "level": i.sleep_level,
            }
            for i in ctl.executor.sleepers.values()
        ],
        "resources": ctl.resources.to_json(),
        # what `flexpipe status` / `top` compare against and how to read the engines
        "gateway": ctl.gateway.url,  # (of several replicas: the first that answers)
        # every replica: up, in flight, requests/s, its pool against the controller's
        # (control/gateway_fleet.py); None: one gateway, driven without a fleet
        "gateways": fleet_view(ctl.gateway),
        "deployment": ctl.deployment,  # what its store rows and lease belong to
        "engine": ctl.cfg.engine_kind,
        "time_scale": ctl.cfg.time_scale,
        # where the shift log is (`flexpipe top` reads it there); not a URL with a password
        "store": _shareable(ctl.store.url) if ctl.store is not None else None,
        "models": [
            {
                "name": d.name,
                "model": d.model,
                "slo": {"ttft_p99_s": d.slo.ttft_p99_s, "tpot_p99_s": d.slo.tpot_p99_s},
                "request_rate_per_s": ctl.rates_per_s.get(d.name, d.request_rate_per_s),
                # the forecast over the next horizon (None: too little history yet)
                "expected_request_rate_per_s": ctl.expected_rates_per_s.get(d.name),
                # why its requests are refused (no GPU free to us can place it); None: not
                "refused": ctl.standby.refused.get(d.name),
            }
            for d in ctl.cfg.demands
        ],
        "last_decision": None if ctl.last_decision is None else ctl.last_decision.to_dict(),
        "last_outcome": None if ctl.last_outcome is None else ctl.last_outcome.to_dict(),
        "num_shifts": len(ctl.history),
    }


def _shareable(url: str) -> str | None:
    """A store URL safe to hand out over the admin API: None when it holds a password."""
    try:
        return None if make_url(url).password is not None else url
    except ArgumentError:
        return None
