"""The controller's engines as Prometheus HTTP service-discovery targets (`GET /sd/engines`):
engines come and go on ports the launcher picks, so a static scrape config cannot list them;
Prometheus' `http_sd_configs` reads this list instead (deploy/prometheus/prometheus.yml).

The format is Prometheus': `[{"targets": ["host:port"], "labels": {...}}]`, one group per
instance, labelled with what the board groups by (`__meta_*` labels are Prometheus' own)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["SD_PATH", "http_sd_targets"]

SD_PATH = "/sd/engines"


def http_sd_targets(instances: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One target group per instance of the controller's status (`name`, `model`, `gear`,
    `gpus`, `url`, `state`)."""
    groups = []
    for i in instances:
        where = urlsplit(str(i["url"]))
        if not where.netloc:
            continue
        groups.append(
            {
                "targets": [where.netloc],
                "labels": {
                    "flexpipe_instance": str(i["name"]),
                    "model": str(i["model"]),
                    "gear": str(i["gear"]),
                    "gpus": "+".join(str(g) for g in i["gpus"]),
                    "state": str(i["state"]),
                },
            }
        )
    return groups
