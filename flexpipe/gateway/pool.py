"""The pool of engine instances the gateway routes to: a plain, scriptable object.

The controller (and the admin API) drive it: `add`, `remove`, `drain`, `set_weight`.
Health probing, passive failures and metrics scraping write into the `Instance` records;
the request path reads them to build routing snapshots. No I/O here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from flexpipe.policies.routing import InstanceView


class InstanceState(enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"  # no new requests; in-flight ones finish
    EJECTED = "ejected"  # unhealthy; probed again after `ejected_until_s`


@dataclass(slots=True)
class Instance:
    url: str
    model: str | None
    weight: float = 1.0
    max_concurrency: int = 256
    api_key: str | None = None
    state: InstanceState = InstanceState.ACTIVE
    num_in_flight: int = 0
    # from the engine's /metrics (producer: scraper)
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    scraped_at_s: float | None = None
    num_scraped_tokens: float = 0.0  # (running + waiting) x mean tokens per request at scrape
    num_tokens_sent_since_scrape: float = 0.0  # corrected by what this gateway sent since
    # measured here
    speed_tokens_per_s: float = 0.0  # EWMA of per-request decode speed
    num_consecutive_failures: int = 0
    backoff_s: float = 0.0
    ejected_until_s: float = 0.0
    num_ejections: int = 0
    removed: bool = False
    draining: bool = False  # asked to drain: stays out of routing even after re-admission
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.url

    @property
    def num_queued_tokens(self) -> float:
        return max(0.0, self.num_scraped_tokens + self.num_tokens_sent_since_scrape)

    def view(self, num_prefix_blocks_matched: int = 0) -> InstanceView:
        return InstanceView(
            name=self.url,
            weight=self.weight,
            num_in_flight=self.num_in_flight,
            max_concurrency=self.max_concurrency,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_usage=self.kv_usage,
            num_queued_tokens=self.num_queued_tokens,
            speed_tokens_per_s=self.speed_tokens_per_s,
            scraped_at_s=self.scraped_at_s,
            num_prefix_blocks_matched=num_prefix_blocks_matched,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "url": self.url,
            "model": self.model,
            "state": self.state.value,
            "weight": self.weight,
            "max_concurrency": self.max_concurrency,
            "num_in_flight": self.num_in_flight,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_usage": self.kv_usage,
            "num_queued_tokens": round(self.num_queued_tokens, 1),
            "speed_tokens_per_s": round(self.speed_tokens_per_s, 2),
            "num_ejections": self.num_ejections,
        }


class PoolError(ValueError):
    pass


class Pool:
    def __init__(self, default_max_concurrency: int = 256) -> None:
        self.default_max_concurrency = default_max_concurrency
        self.instances: dict[str, Instance] = {}  # url -> instance
        self._listeners: list[Callable[[], None]] = []

    def on_change(self, callback: Callable[[], None]) -> None:
        """Called after any change that may free capacity (wakes queued requests)."""
        self._listeners.append(callback)

    def _changed(self) -> None:
        for cb in self._listeners:
            cb()

    def add(
        self,
        url: str,
        model: str | None = None,
        weight: float = 1.0,
        max_concurrency: int = 0,
        api_key: str | None = None,
    ) -> Instance:
        url = url.rstrip("/")
        if url in self.instances:
            raise PoolError(f"instance {url} is already in the pool")
        if weight <= 0:
            raise PoolError("weight must be > 0")
        inst = Instance(
            url=url,
            model=model,
            weight=weight,
            max_concurrency=max_concurrency or self.default_max_concurrency,
            api_key=api_key,
        )
        self.instances[url] = inst
        self._changed()
        return inst

    def get(self, url: str) -> Instance:
        inst = self.instances.get(url.rstrip("/"))
        if inst is None:
            raise PoolError(f"no instance {url} in the pool")
        return inst

    def remove(self, url: str) -> Instance:
        """Take the instance out now; requests already on it keep their connection."""
        inst = self.get(url)
        del self.instances[inst.url]
        inst.removed = True
        self._changed()
        return inst

    def drain(self, url: str) -> Instance:
        inst = self.get(url)
        inst.draining = True
        if inst.state is InstanceState.ACTIVE:
            inst.state = InstanceState.DRAINING
        self._changed()
        return inst

    def activate(self, url: str) -> Instance:
        inst = self.get(url)
        inst.draining = False
        inst.state = InstanceState.ACTIVE
        inst.num_consecutive_failures = 0
        self._changed()
        return inst

    def set_weight(self, url: str, weight: float) -> Instance:
        if weight <= 0:
            raise PoolError("weight must be > 0")
        inst = self.get(url)
        inst.weight = weight
        self._changed()
        return inst

    def eject(
        self, inst: Instance, now: float, base_backoff_s: float, max_backoff_s: float
    ) -> None:
        """Out of routing until `now` + a backoff that doubles per ejection (reset on success)."""
        doubled = inst.backoff_s * 2 if inst.backoff_s else base_backoff_s
        inst.backoff_s = min(max_backoff_s, doubled)
        inst.ejected_until_s = now + inst.backoff_s
        inst.state = InstanceState.EJECTED
        inst.num_ejections += 1

    def readmit(self, inst: Instance) -> None:
        """Back into routing after a successful probe (or into draining if it was asked to)."""
        inst.state = InstanceState.DRAINING if inst.draining else InstanceState.ACTIVE
        inst.num_consecutive_failures = 0
        self._changed()

    def routable(self, model: str) -> list[Instance]:
        return [
            i
            for i in self.instances.values()
            if i.state is InstanceState.ACTIVE and i.model == model
        ]

    def models(self) -> list[str]:
        return sorted({i.model for i in self.instances.values() if i.model is not None})

    def has_model(self, model: str) -> bool:
        return any(i.model == model for i in self.instances.values())
