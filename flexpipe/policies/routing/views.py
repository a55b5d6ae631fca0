"""The plain data a routing policy sees: one view per candidate instance and the request.

Producers (the gateway's metrics scraper, its prefix index, its in-flight counters) fill
these in; policies only read them. Slotted, so a snapshot is cheap to build per request, and
read-only (`read_only`), so a policy cannot change one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

_T = TypeVar("_T")

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform

    @dataclass_transform(frozen_default=True)
    def read_only(cls: type[_T]) -> type[_T]:
        """A slotted dataclass that the type checker treats as frozen."""

else:

    def read_only(cls):
        """A slotted dataclass, hashable, frozen for the type checker (mypy strict rejects
        any assignment to a field) but not at run time: a frozen dataclass's `__init__` sets
        each field through `object.__setattr__`, five times the cost of a plain one, and
        these are built for every candidate of every request (and every simulated one)."""
        return dataclass(slots=True, unsafe_hash=True)(cls)


@read_only
class InstanceView:
    """What a policy knows about one instance at decision time."""

    name: str
    weight: float = 1.0
    num_in_flight: int = 0  # requests this gateway has open on it
    max_concurrency: int = 0  # the gateway's cap on in-flight requests; 0 = unlimited
    num_slots: int = 0  # sequences the engine runs at once (max_num_seqs); 0 = unknown
    num_running: int = 0  # vllm:num_requests_running at the last scrape
    num_waiting: int = 0  # vllm:num_requests_waiting at the last scrape
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1
    num_queued_tokens: float = 0.0  # estimated queued + running tokens (scrape + sent since)
    speed_tokens_per_s: float = 0.0  # measured decode speed; 0 = not yet measured
    scraped_at_s: float | None = None  # when its metrics were last read; None = never
    num_prefix_blocks_matched: int = 0  # from the prefix index, for this request

    @property
    def is_full(self) -> bool:
        return self.max_concurrency > 0 and self.num_in_flight >= self.max_concurrency


@read_only
class RoutingRequest:
    """The request being routed, reduced to what routing needs."""

    num_prompt_tokens: int = 0
    num_expected_output_tokens: int = 0
    block_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's blocks
    session_key: str = ""  # optional affinity key (e.g. `user`), unused by most policies


@read_only
class RoutingSnapshot:
    instances: tuple[InstanceView, ...]
    request: RoutingRequest = field(default_factory=RoutingRequest)
    max_metrics_age_s: float = 5.0  # older metrics make an instance count as saturated

    def is_stale(self, view: InstanceView, now: float) -> bool:
        return view.scraped_at_s is None or now - view.scraped_at_s > self.max_metrics_age_s


@read_only
class Decision:
    """Instance names, best first (the framework tries them in order), and why."""

    ranked: tuple[str, ...]
    reason: str

    @property
    def best(self) -> str | None:
        return self.ranked[0] if self.ranked else None
