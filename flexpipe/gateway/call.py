"""One client request on its way through the gateway: what it asked, what it holds, which
instances failed it. Plain data shared by the proxy (`app`) and the stream relay (`relay`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flexpipe.gateway.tenants import Tenant
from flexpipe.http.client import UpstreamResponse
from flexpipe.policies.routing import RoutingRequest


@dataclass(slots=True, eq=False)
class Call:
    """One client request on its way through the gateway."""

    path: str
    chat: bool
    model: str
    body: dict[str, Any]
    raw: bytes
    stream: bool
    routing: RoutingRequest
    num_tokens: float
    t0: float
    tenant: Tenant | None
    excluded: set[str] = field(default_factory=set)  # busy for this call: avoid if possible
    failed: set[str] = field(default_factory=set)  # failed this call: never again
    num_retries: int = 0
    num_migrations: int = 0  # re-runs and continuations after an instance failed
    num_prompt_tokens: int = 0  # estimated, as routing counts them
    num_output_tokens: int | None = None  # what a finished non-streamed response reported
    upstream: UpstreamResponse | None = None  # the response being read (non-streamed)
    ended: bool = False  # `Gateway.end_call` done
