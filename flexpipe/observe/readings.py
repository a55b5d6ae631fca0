"""Fetch one reading: the controller's `GET /admin/status`, the gateway's `/metrics` and its
dashboard view (`/ui/api/view`: each model's figures, computed where the dashboard's are) and
each instance's engine `/metrics`. Blocking (the CLI); every failure to reach the controller is a
`ControllerError` with one readable line; a gateway or engine that does not answer is recorded
(`None`) and shown as such, since that is what an operator needs to see."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from flexpipe.control.api.client import ControllerClient, ControllerError

__all__ = ["Readings", "fetch_text", "read"]

# the view without its series: only points after this unix time (none)
_VIEW_PATH = "/ui/api/view?since=1e18"


@dataclass(frozen=True)
class Readings:
    """Everything one snapshot is built from, as fetched at `at_s` (unix seconds)."""

    at_s: float
    controller_url: str
    status: dict[str, Any]  # the controller's /admin/status
    gateway_metrics: str | None  # None: the gateway did not answer
    engine_metrics: dict[str, str | None] = field(default_factory=dict)  # url -> text | None
    gateway_view: dict[str, Any] | None = None  # the dashboard's view; None: not got


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
    ours = [f"{gateway}/metrics", f"{gateway}{_VIEW_PATH}"] if gateway else []
    targets = ours + [f"{u}/metrics" for u in urls]
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(targets)))) as pool:
        texts = list(pool.map(lambda t: fetch_text(t, timeout_s), targets))
    gateway_text, view_text = (texts.pop(0), texts.pop(0)) if gateway else (None, None)
    return Readings(
        time.time(),
        controller.base,
        status,
        gateway_text,
        dict(zip(urls, texts, strict=True)),
        _json(view_text),
    )


def _json(text: str | None) -> dict[str, Any] | None:
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
