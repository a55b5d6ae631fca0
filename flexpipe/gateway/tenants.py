"""API keys with per-key requests/min, tokens/min (token buckets) and a concurrency cap.

Keys are kept only as dictionary keys and never logged or shown: a tenant is named by
its `name` in metrics and errors.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        """Take `amount`; returns 0.0 on success, else the seconds until it would succeed."""
        self._refill(now)
        if amount <= self.level:
            self.level -= amount
            return 0.0
        return (min(amount, self.capacity) - self.level) / self.rate_per_s

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


class Tenant:
    def __init__(self, cfg: TenantConfig, now: float) -> None:
        self.name = cfg.name or "tenant"
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

    def admit(self, num_tokens: float, now: float) -> tuple[bool, float, str]:
        """(admitted, retry_after_s, why-not)."""
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
        self._by_key = {c.key: Tenant(c, now) for c in configs}  # API key -> tenant

    @property
    def enabled(self) -> bool:
        return bool(self._by_key)

    def lookup(self, authorization: str | None) -> Tenant | None:
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        return self._by_key.get(authorization[7:].strip())
