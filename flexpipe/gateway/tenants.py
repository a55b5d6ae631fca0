"""API keys with per-key requests/min, tokens/min (token buckets) and a concurrency cap.

Tokens are charged twice: an estimate on admission (prompt + max_tokens, so a burst cannot
overrun the budget), then settled against what the request really used when it ends (the
difference is given back, or taken as debt that later requests wait out). A request whose
estimate exceeds the whole budget can never be admitted and is refused outright.

Keys are kept only as dictionary keys and never logged or shown: a tenant is named by
its `name` in metrics and errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson

from flexpipe.gateway.config import TenantConfig


@dataclass(slots=True)
class TokenBucket:
    """`rate_per_s` refill, `capacity` burst (a minute's worth). `now` is injected."""

    rate_per_s: float
    capacity: float
    level: float
    updated_s: float

    def _refill(self, now: float) -> None:
        if now > self.updated_s:
            self.level = min(self.capacity, self.level + (now - self.updated_s) * self.rate_per_s)
            self.updated_s = now

    def try_take(self, amount: float, now: float) -> float:
        """Take `amount`; returns 0.0 on success, else the seconds until it would succeed
        (`math.inf` for an amount above the capacity: it never will)."""
        if amount > self.capacity:
            return math.inf
        self._refill(now)
        if amount <= self.level:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate_per_s

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)

    def settle(self, charged: float, used: float, now: float) -> None:
        """A request charged `charged` on admission really used `used`: return the rest, or
        take the excess as debt (the level may go below zero; refills pay it off)."""
        self._refill(now)
        if used < charged:
            self.give_back(charged - used)
        else:
            self.level -= used - charged


class Tenant:
    def __init__(self, cfg: TenantConfig, now: float, tenant_id: str = "") -> None:
        self.name = cfg.name or "tenant"
        self.id = tenant_id  # what gateway workers and replicas share its budget under
        self.max_concurrency = cfg.max_concurrency
        self.num_in_flight = 0
        self.requests = (
            TokenBucket(cfg.requests_per_min / 60, cfg.requests_per_min, cfg.requests_per_min, now)
            if cfg.requests_per_min > 0
            else None
        )
        self.tokens = (
            TokenBucket(cfg.tokens_per_min / 60, cfg.tokens_per_min, cfg.tokens_per_min, now)
            if cfg.tokens_per_min > 0
            else None
        )

    def too_large(self, num_tokens: float) -> str | None:
        """Why a request estimated at `num_tokens` can never be admitted, or None."""
        if self.tokens is not None and num_tokens > self.tokens.capacity:
            return (
                f"request too large for tenant {self.name}: about {math.ceil(num_tokens)} "
                f"tokens (prompt + max_tokens) against a limit of "
                f"{self.tokens.capacity:g} tokens per minute; lower max_tokens"
            )
        return None

    def settle(self, charged_tokens: float, used_tokens: float, now: float) -> None:
        """The request admitted with `charged_tokens` ended having used `used_tokens`."""
        if self.tokens is not None:
            self.tokens.settle(charged_tokens, used_tokens, now)

    def admit(self, num_tokens: float, now: float) -> tuple[bool, float, str]:
        """(admitted, retry_after_s, why-not). Check `too_large` first."""
        if self.max_concurrency and self.num_in_flight >= self.max_concurrency:
            return False, 1.0, "concurrency limit reached"
        if self.requests is not None:
            wait = self.requests.try_take(1, now)
            if wait > 0:
                return False, wait, "requests per minute exceeded"
        if self.tokens is not None:
            wait = self.tokens.try_take(num_tokens, now)
            if wait > 0:
                if self.requests is not None:
                    self.requests.give_back(1)
                return False, wait, "tokens per minute exceeded"
        return True, 0.0, ""


class Tenants:
    def __init__(self, configs: list[TenantConfig], now: float) -> None:
        # API key -> tenant
        self._by_key = {c.key: Tenant(c, now, tid) for tid, c in tenant_ids(configs).items()}

    @property
    def enabled(self) -> bool:
        return bool(self._by_key)

    def lookup(self, authorization: str | None) -> Tenant | None:
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        return self._by_key.get(authorization[7:].strip())


def tenant_ids(configs: list[TenantConfig]) -> dict[str, TenantConfig]:
    """Each tenant's id, the same in every gateway worker and replica given the same list
    (its place and name: never its key, which is not to be sent or stored elsewhere)."""
    return {f"{i}:{c.name or 'tenant'}": c for i, c in enumerate(configs)}


def completion_tokens(body: bytes) -> int | None:
    """`usage.completion_tokens` of a non-streamed response, if it says (what a tenant's
    request used, settled against its token budget)."""
    try:
        usage = orjson.loads(body).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) else None
