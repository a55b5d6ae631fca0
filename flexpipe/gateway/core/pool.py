"""The pool of engine instances the gateway routes to: a plain, scriptable object.

The controller (and the admin API) drive it: `add`, `set_state`, `drain`, `activate`,
`remove`, `set_weight`. Each instance has the one lifecycle of flexpipe/lifecycle.py
(starting → rehearsing → active → draining → gone), every change checked there; health is a
separate flag: an instance ejected after failed probes or requests keeps its state and is
only out of routing until a probe succeeds. Routing takes instances that are active and
healthy. Health probing, passive failures and metrics scraping write into the `Instance`
records; the request path reads them to build routing snapshots. No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flexpipe.lifecycle import LifecycleError, State, check_transition
from flexpipe.policies.routing import InstanceView

QUEUE_ALLOWANCE_RATIO = 0.125  # requests queued in the engine beyond its slots: slots // 8


SPEED_EWMA_WEIGHT = 0.2  # of the newest stream in `Instance.speed_tokens_per_s`


def stream_tpot_s(num_tokens: int, t_first_s: float, t_last_s: float) -> float | None:
    """A stream's mean time per output token after the first (None: too short to tell)."""
    if num_tokens >= 2 and t_last_s > t_first_s:
        return (t_last_s - t_first_s) / (num_tokens - 1)
    return None


def derive_max_concurrency(
    configured: int, max_num_seqs: int, num_kv_slots: int, ceiling: int
) -> tuple[int, str]:
    """The cap on requests in flight to one instance, and where it came from.

    An explicit value (backend config, admin API) always wins. Otherwise the engine's slots
    (max_num_seqs, from registration or the engine's report; else what its KV cache holds)
    plus a small queue in the engine, slots // 8 (none below 8 slots: a request queued
    behind a 2-slot instance waits a whole request, one queued at the gateway takes the first
    slot freed anywhere), never above the gateway-wide `ceiling`. Without either: `ceiling`.
    """
    if configured > 0:
        return configured, "configured"
    if max_num_seqs > 0:
        slots, source = max_num_seqs, "max_num_seqs"
    elif num_kv_slots > 0:
        slots, source = num_kv_slots, "kv_cache"
    else:
        return ceiling, "default"
    return max(1, min(ceiling, slots + int(slots * QUEUE_ALLOWANCE_RATIO))), source


def share_slots(max_concurrency: int, index: int, num_workers: int) -> int:
    """Worker `index`'s part of an instance's cap, of `num_workers` on one host: the cap split
    as evenly as it goes (the kernel spreads connections evenly), at least one each, so that
    the engine never sees more than its cap (plus at most one a worker where the cap is below
    the number of workers) from all of them together."""
    if num_workers <= 1:
        return max_concurrency
    part = max_concurrency // num_workers + (1 if index < max_concurrency % num_workers else 0)
    return max(1, part)


# states an instance may be registered in (a rehearsed one joins as active)
ADDABLE_STATES = frozenset({State.STARTING, State.REHEARSING, State.ACTIVE})


@dataclass(slots=True)
class Instance:
    url: str
    model: str | None
    weight: float = 1.0
    max_concurrency: int = 256  # the cap the gateway enforces (`update_capacity`)
    api_key: str | None = None
    # capacity: what was configured, registered or reported (`derive_max_concurrency`)
    max_concurrency_configured: int = 0  # explicit; 0 = derive
    max_concurrency_ceiling: int = 256  # the gateway-wide limit
    max_concurrency_source: str = "default"
    max_num_seqs: int = 0  # sequences the engine runs at once; 0 = unknown
    num_kv_tokens: int = 0  # its KV cache (vllm:cache_config_info num_gpu_blocks x block_size)
    num_kv_slots: int = 0  # requests of the mean size that fit in it
    state: State = State.ACTIVE  # the lifecycle; only `active` takes new requests
    healthy: bool = True  # False: ejected, probed again after `ejected_until_s`
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
    # moves cutting over to it (a key per move -> until when): new requests keep off it
    # meanwhile while another candidate has a slot (`Pool.fence`, cut_over.fence_until_s)
    fences: dict[object, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    share: tuple[int, int] = (0, 1)  # (this worker, workers on the host): `share_slots`

    @property
    def name(self) -> str:
        return self.url

    @property
    def routable(self) -> bool:
        """Takes new requests: active and healthy."""
        return self.state is State.ACTIVE and self.healthy

    @property
    def fenced_until_s(self) -> float:
        """Until when a move cutting over to it keeps new requests off (0: none does)."""
        return max(self.fences.values(), default=0.0)

    @property
    def num_queued_tokens(self) -> float:
        return max(0.0, self.num_scraped_tokens + self.num_tokens_sent_since_scrape)

    @property
    def num_slots(self) -> int:
        """Sequences it runs at once, as routing sees them (0 = unknown: the cap stands in)."""
        return self.max_num_seqs or self.num_kv_slots

    def observe_tpot(self, tpot_s: float) -> None:
        """A stream's measured time per output token into the decode speed EWMA."""
        speed = 1.0 / tpot_s
        old = self.speed_tokens_per_s
        self.speed_tokens_per_s = speed if not old else old + SPEED_EWMA_WEIGHT * (speed - old)

    def update_capacity(self) -> None:
        cap, self.max_concurrency_source = derive_max_concurrency(
            self.max_concurrency_configured,
            self.max_num_seqs,
            self.num_kv_slots,
            self.max_concurrency_ceiling,
        )
        self.max_concurrency = share_slots(cap, *self.share)

    def view(self, num_prefix_blocks_matched: int = 0) -> InstanceView:
        # Positional, in InstanceView's field order (tests/gateway/test_gateway_router.py checks
        # it), and the properties `num_slots` and `num_queued_tokens` written out: built for every
        # candidate of every request, and keywords cost twice as much.
        return InstanceView(
            self.url,  # name
            self.weight,
            self.num_in_flight,
            self.max_concurrency,
            self.max_num_seqs or self.num_kv_slots,  # num_slots
            self.num_running,
            self.num_waiting,
            self.kv_usage,
            max(0.0, self.num_scraped_tokens + self.num_tokens_sent_since_scrape),  # queued
            self.speed_tokens_per_s,
            self.scraped_at_s,
            num_prefix_blocks_matched,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "url": self.url,
            "model": self.model,
            "state": self.state.value,
            "healthy": self.healthy,
            "weight": self.weight,
            "max_concurrency": self.max_concurrency,
            "max_concurrency_source": self.max_concurrency_source,
            "max_num_seqs": self.max_num_seqs,
            "num_kv_tokens": self.num_kv_tokens,
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


class TransitionError(PoolError):
    """An illegal change of an instance's lifecycle state (the message names both ends)."""


class Pool:
    def __init__(self, default_max_concurrency: int = 256, share: tuple[int, int] = (0, 1)) -> None:
        self.default_max_concurrency = default_max_concurrency
        self.share = share  # (this worker, workers on the host): each instance's slots split
        self.instances: dict[str, Instance] = {}  # url -> instance
        self._listeners: list[Callable[[], None]] = []
        # the latest fence's end over all instances, ever (`fence`): routing looks at fences
        # only before then
        self.fenced_until_s = 0.0

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
        max_num_seqs: int = 0,
        state: State = State.ACTIVE,
    ) -> Instance:
        """`max_concurrency` > 0 is an explicit cap; else it is derived from `max_num_seqs`
        (what the engine was launched with) or what the engine reports (`report_capacity`).
        `state`: starting or rehearsing for an instance the controller is still bringing up
        (visible, not routed), active (the default) for one that serves."""
        url = url.rstrip("/")
        if url in self.instances:
            raise PoolError(f"instance {url} is already in the pool")
        if weight <= 0:
            raise PoolError("weight must be > 0")
        if max_concurrency < 0 or max_num_seqs < 0:
            raise PoolError("max_concurrency and max_num_seqs must be >= 0")
        if state not in ADDABLE_STATES:
            names = ", ".join(sorted(s.value for s in ADDABLE_STATES))
            raise PoolError(f"an instance joins the pool as one of {names}, not {state.value}")
        inst = Instance(
            url=url,
            model=model,
            weight=weight,
            api_key=api_key,
            max_concurrency_configured=max_concurrency,
            max_concurrency_ceiling=self.default_max_concurrency,
            max_num_seqs=max_num_seqs,
            state=state,
            share=self.share,
        )
        inst.update_capacity()
        self.instances[url] = inst
        self._changed()
        return inst

    def get(self, url: str) -> Instance:
        inst = self.instances.get(url.rstrip("/"))
        if inst is None:
            raise PoolError(f"no instance {url} in the pool")
        return inst

    def set_state(self, url: str, state: State) -> Instance:
        """Move an instance along its lifecycle (a no-op when it is there already); an
        illegal move is a `PoolError` naming both ends. `gone` takes it out (`remove`)."""
        inst = self.get(url)
        if inst.state is state:
            return inst
        try:
            check_transition(inst.state, state)
        except LifecycleError as exc:
            raise TransitionError(f"instance {inst.url}: {exc}") from None
        if state is State.GONE:
            return self.remove(url)
        inst.state = state
        if state is State.ACTIVE:
            inst.num_consecutive_failures = 0
        self._changed()
        return inst

    def remove(self, url: str) -> Instance:
        """Take the instance out now (gone); requests already on it keep their connection."""
        inst = self.get(url)
        del self.instances[inst.url]
        inst.state = State.GONE
        self._changed()
        return inst

    def drain(self, url: str) -> Instance:
        """No new requests; those in flight finish (or are moved by the controller)."""
        return self.set_state(url, State.DRAINING)

    def activate(self, url: str) -> Instance:
        return self.set_state(url, State.ACTIVE)

    def report_capacity(
        self, inst: Instance, max_num_seqs: int, num_kv_tokens: int, mean_request_tokens: float
    ) -> None:
        """What the engine reports (0 = not reported): its max_num_seqs replaces a registered
        one (the engine knows best), its KV cache bounds the slots when max_num_seqs is
        unknown. Wakes queued requests when the cap grows."""
        old = inst.max_concurrency
        if max_num_seqs > 0:
            inst.max_num_seqs = max_num_seqs
        if num_kv_tokens > 0:
            inst.num_kv_tokens = num_kv_tokens
            inst.num_kv_slots = max(1, int(num_kv_tokens // max(1.0, mean_request_tokens)))
        inst.update_capacity()
        if inst.max_concurrency > old:
            self._changed()

    def fence(self, url: str, key: object, until_s: float, now: float) -> Instance:
        """A move (`key`) cuts over to `url`: new requests keep off it until `until_s`, or
        until `unfence` (the moved stream's first token there), while another candidate has
        a slot (`Router.pick`). Two moves into one instance keep it fenced until both end.
        Fences past their end by `now` are dropped."""
        inst = self.get(url)
        fences = inst.fences
        for k in [k for k, t in fences.items() if t <= now]:
            del fences[k]
        fences[key] = max(fences.get(key, 0.0), until_s)
        self.fenced_until_s = max(self.fenced_until_s, until_s)
        return inst

    def unfence(self, url: str, key: object) -> None:
        """The move `key` is through on `url` (its stream's first token came there)."""
        inst = self.instances.get(url.rstrip("/"))
        if inst is not None:
            inst.fences.pop(key, None)

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
        inst.healthy = False
        inst.num_ejections += 1

    def readmit(self, inst: Instance) -> None:
        """Healthy again after a successful probe; its lifecycle state never changed."""
        inst.healthy = True
        inst.num_consecutive_failures = 0
        self._changed()

    def routable(self, model: str) -> list[Instance]:
        out = []  # (a loop: under Python 3.11 a comprehension is a function call more)
        for i in self.instances.values():
            if i.model == model and i.routable:
                out.append(i)
        return out

    def models(self) -> list[str]:
        return sorted({i.model for i in self.instances.values() if i.model is not None})

    def has_model(self, model: str) -> bool:
        for i in self.instances.values():  # noqa: SIM110 (cheaper than any() of a generator)
            if i.model == model:
                return True
        return False
