"""Fetch one reading: the controller's `GET /admin/status`, the gateway's `/metrics` and each
instance's engine `/metrics`. Blocking (the CLI); every failure to reach the controller is a
`ControllerError` with one readable line; a gateway or engine that does not answer is recorded
(`None`) and shown as such, since that is what an operator needs to see."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from flexpipe.control.api.client import ControllerClient, ControllerError

__all__ = ["Readings", "fetch_text", "read"]


@dataclass(frozen=True)
class Readings:
    """Everything one snapshot is built from, as fetched at `at_s` (unix seconds)."""

    at_s: float
    controller_url: str
    status: dict[str, Any]  # the controller's /admin/status
    gateway_metrics: str | None  # None: the gateway did not answer
    engine_metrics: dict[str, str | None] = field(default_factory=dict)  # url -> text | None


def fetch_text(url: str, timeout_s: float) -> str | None:
    """The body of a GET, or None when nothing (or an error status) came back."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body: bytes = resp.read()
            return body.decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def read(controller: ControllerClient, timeout_s: float = 3.0) -> Readings:
    """One reading. Raises ControllerError when the controller cannot be read."""
    status = controller.status()
    if not isinstance(status, dict) or not isinstance(status.get("instances"), list):
        raise ControllerError(f"the controller at {controller.base} sent no status")
    urls = [str(i["url"]) for i in status["instances"] if i.get("url")]
    gateway = status.get("gateway")
    targets = ([f"{gateway}/metrics"] if gateway else []) + [f"{u}/metrics" for u in urls]
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(targets)))) as pool:
        texts = list(pool.map(lambda t: fetch_text(t, timeout_s), targets))
    gateway_text = texts.pop(0) if gateway else None
    return Readings(
        time.time(), controller.base, status, gateway_text, dict(zip(urls, texts, strict=True))
    )
