"""Sleep mode as vLLM has it: what is asleep, what the GPUs and host RAM hold, what each
sleep and wake-up costs (the performance model prices it). Pure state; the HTTP handlers in
flexpipe.engine.api serialise the operations and wait the modelled time.

vLLM (vllm/v1/engine/core.py `sleep` / `wake_up` / `is_sleeping`, vllm/device_allocator/
cumem.py) tags its GPU memory "weights" and "kv_cache". Level 1 offloads the weights to
(pinned) host RAM and discards the KV cache; level 2 discards both; level 0 only pauses
scheduling. `wake_up(tags)` restores the tags given (all when none), a tag that is not
asleep is a no-op, and scheduling resumes only once nothing is asleep: `is_sleeping` is true
while scheduling is paused or any tag is asleep. Sleeping while asleep is a no-op too.
docs/sim-engine.md ("Sleep mode") lists what the sim does and where it differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flexpipe.perf import PerfModel
from flexpipe.perf.weights import WeightSource

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
SCHEDULING = "scheduling"  # vLLM's tag for waking a level-0 sleep (scheduling only)
TAGS = (WEIGHTS, KV_CACHE)
MODES = ("abort", "wait", "keep")  # vLLM's pause modes: what happens to in-flight requests
# vllm:engine_sleep_state's sleep_state label values
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


@dataclass(frozen=True, slots=True)
class SleepOp:
    """One finished sleep or wake-up: what it did and its modelled time (unscaled)."""

    op: str  # "sleep" | "wake_up"
    level: int
    tags: tuple[str, ...]  # the tags it put to sleep or woke
    duration_s: float


@dataclass
class SleepState:
    """What is asleep. `level`: the level of the current sleep (None: awake)."""

    pm: PerfModel
    level2_source: WeightSource | None = None  # where a level-2 wake loads from (None: storage)
    level: int | None = None
    paused: bool = False  # scheduling paused (every level)
    asleep: set[str] = field(default_factory=set)
    weights_on_host: bool = False  # level 1's copy in host RAM
    last: SleepOp | None = None
    num_sleeps: int = 0
    num_wakes: int = 0

    @property
    def is_sleeping(self) -> bool:
        return self.paused or bool(self.asleep)

    def sleep_plan(self, level: int) -> tuple[tuple[str, ...], float]:
        """(tags this sleep puts to sleep, its modelled seconds); nothing if already asleep."""
        if self.is_sleeping:
            return (), 0.0
        tags = () if level == 0 else TAGS
        return tags, self.pm.sleep_s(level)

    def apply_sleep(self, level: int, tags: tuple[str, ...], duration_s: float) -> SleepOp:
        self.level = level
        self.paused = True
        self.asleep = set(tags)
        self.weights_on_host = level == 1
        self.num_sleeps += 1
        self.last = SleepOp("sleep", level, tags, duration_s)
        return self.last

    def wake_plan(
        self, tags: tuple[str, ...] | None, node_of: Callable[[str], str] | None = None
    ) -> tuple[tuple[str, ...], float]:
        """(tags this wake-up restores, its modelled seconds). `tags` None: all. Tags that are
        not asleep (or unknown) are skipped, as vLLM's allocator skips them."""
        wanted = TAGS if tags is None else tuple(t for t in TAGS if t in tags)
        waking = tuple(t for t in wanted if t in self.asleep)
        duration_s = 0.0
        if WEIGHTS in waking and self.level is not None:
            # the KV cache is re-mapped empty: nothing to copy
            duration_s = self.pm.wake_s(self.level, self.level2_source, node_of)
        return waking, duration_s

    def apply_wake(self, tags: tuple[str, ...], duration_s: float) -> SleepOp:
        level = self.level if self.level is not None else 0
        self.asleep.difference_update(tags)
        if WEIGHTS in tags:
            self.weights_on_host = False
        if not self.asleep:
            self.paused = False
            self.level = None
        self.num_wakes += 1
        self.last = SleepOp("wake_up", level, tags, duration_s)
        return self.last

    # --- memory, for the controller's accounting -----------------------------------------
    @property
    def gpu_memory_bytes(self) -> float:
        """What the instance's GPUs hold now (all GPUs together): the reserve (CUDA context,
        NCCL buffers, activations: not in vLLM's sleep pool) always; weights and KV cache
        when awake."""
        total = 0.0
        for g in self.pm.memory.per_gpu:
            total += g.reserve_bytes
            if WEIGHTS not in self.asleep:
                total += g.weights_bytes
            if KV_CACHE not in self.asleep:
                total += max(g.kv_bytes, 0.0)
        return total

    @property
    def host_memory_bytes(self) -> float:
        """Host RAM held for the sleeping copy of the weights (level 1)."""
        if not self.weights_on_host:
            return 0.0
        return sum(g.weights_bytes for g in self.pm.memory.per_gpu)

    @property
    def sleep_state(self) -> str:
        """vllm:engine_sleep_state's label that is 1 now."""
        if not self.is_sleeping:
            return "awake"
        return "weights_offloaded" if self.level == 1 else "discard_all"

    def as_dict(self) -> dict[str, object]:
        last = self.last
        return {
            "is_sleeping": self.is_sleeping,
            "level": self.level,
            "sleeping_tags": sorted(self.asleep),
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "host_memory_bytes": self.host_memory_bytes,
            "num_sleeps": self.num_sleeps,
            "num_wakes": self.num_wakes,
            "last": None
            if last is None
            else {
                "op": last.op,
                "level": last.level,
                "tags": list(last.tags),
                "modelled_s": last.duration_s,
            },
        }


__all__ = [
    "KV_CACHE",
    "MODES",
    "SCHEDULING",
    "SLEEP_STATES",
    "TAGS",
    "WEIGHTS",
    "SleepOp",
    "SleepState",
]
