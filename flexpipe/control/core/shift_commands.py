"""What the shift procedure (`shift_procedure.py`) asks of the world, and what it hears back.

The procedure is a generator: it yields one command at a time and is sent a `Reply` (the
driver's clock when the command was done, and the command's result). A driver carries each
command out on its clock: the live executor through the launcher and the gateway's admin API
(asyncio, wall seconds), the simulator on its event loop (virtual seconds). Times in commands
are in the driver's seconds; instances are the driver's objects (`ShiftInstance`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from flexpipe.cluster import Cluster
from flexpipe.policies.planner import PlannedInstance

__all__ = [
    "AwaitReady",
    "Command",
    "Continue",
    "Drain",
    "Drained",
    "Failed",
    "Hold",
    "Join",
    "Launch",
    "Move",
    "MoveOrder",
    "Moved",
    "NextReady",
    "Record",
    "Rehearse",
    "Release",
    "Reply",
    "SetState",
    "ShiftInstance",
    "Sleep",
    "StillAlive",
    "StopRouting",
    "Survey",
    "Surveyed",
    "Wait",
    "Wake",
    "Wave",
]

Record = dict[str, Any]  # a request as the gateway lists it: id, num_prompt_tokens, ...


class ShiftInstance(Protocol):
    """An instance as the procedure sees it (the live `LiveInstance`, the simulator's
    `InstanceRecord`)."""

    @property
    def key(self) -> str: ...

    @property
    def planned(self) -> Any: ...  # PlannedInstance (the simulator's record: Optional)

    @property
    def url(self) -> str: ...  # its address: what moves name it by

    @property
    def cold_start_s(self) -> float: ...  # how long its engine took to load


@dataclass(frozen=True, slots=True)
class Reply:
    """The driver's answer to a command: its clock when the command was done, the result."""

    now_s: float
    value: Any = None


@dataclass(frozen=True, slots=True)
class Failed:
    """An instance that did not come up, and why (the sentence the outcome records)."""

    why: str


# ---------------------------------------------------------------- bringing instances up
@dataclass(frozen=True, slots=True)
class Launch:
    """Start the engines of `planned` (at once, side by side). Reply: per planned instance a
    token to wait on (`AwaitReady`, `NextReady`), or `Failed` when it could not start."""

    planned: tuple[PlannedInstance, ...]


@dataclass(frozen=True, slots=True)
class AwaitReady:
    """Wait until every launched engine is loaded. Reply: per token, the instance, or
    `Failed` (it did not start, or died loading)."""

    tokens: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class NextReady:
    """Wait until the next of `tokens` is loaded (or failed). Reply: [(token, instance or
    `Failed`)] for those done by then, in the order of `tokens`."""

    tokens: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Join:
    """Loaded engines into the gateway's pool as `starting` (not routed). Reply: per
    instance "" or why the gateway refused it (its engine is then stopped)."""

    instances: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class SetState:
    """The gateway's pool (and the instance) follows the lifecycle: rehearsing, active."""

    instances: tuple[Any, ...]
    state: str


@dataclass(frozen=True, slots=True)
class Rehearse:
    """One probe through each engine, against the gear table's prediction. Reply: one check
    per instance ({"instance", "passed", "why", ...})."""

    instances: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class StillAlive:
    """Which of `instances` still run (an engine dies with its GPUs). Reply: per instance,
    itself or `Failed`."""

    instances: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Hold:
    """The gateway queues `model`'s requests for `seconds` (0: no longer) instead of
    refusing them. Reply: "" or why it could not."""

    model: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Release:
    """Stop the engines and take them out of the gateway's pool: their GPUs are free."""

    instances: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    seconds: float


# ---------------------------------------------------------------- sleeping and waking
@dataclass(frozen=True, slots=True)
class Sleep:
    """Put the engines of drained `instances` to sleep at `level` (vLLM's sleep mode: 1
    keeps the weights in host RAM, 2 drops them) instead of stopping them; the gateway's pool
    marks them asleep (never routed). Requests still on them finish first. Reply: per
    instance, itself or `Failed` (then the procedure releases it)."""

    instances: tuple[Any, ...]
    level: int


@dataclass(frozen=True, slots=True)
class Wake:
    """Wake sleeping engines (waking, then loaded: the procedure sets them active). Reply:
    per instance, itself or `Failed` (its engine died, or its GPUs were taken meanwhile:
    the procedure releases it and cold-starts the planned instance instead)."""

    instances: tuple[Any, ...]


# ---------------------------------------------------------------- draining and moving
@dataclass(frozen=True, slots=True)
class StopRouting:
    """No new requests to `instances` (draining). Reply: how many requests they still run."""

    instances: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Survey:
    """What runs on `sources` and on the `candidates` a request of theirs could move to.
    Reply: `Surveyed`."""

    sources: tuple[Any, ...]
    candidates: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Surveyed:
    cluster: Cluster  # the cluster as it is now (links, GPUs)
    requests: tuple[tuple[Record, ...], ...]  # per source
    destinations: tuple[tuple[Any, tuple[Record, ...]], ...]  # the active candidates


@dataclass(frozen=True, slots=True)
class MoveOrder:
    """Move request `id` from `source` to `destination` by `method` ("kv" | "recompute");
    `warm_timeout_s`: how long the gateway may pre-copy a recompute (driver seconds);
    `pause_s`: the pause it was planned at (modelled seconds)."""

    id: int
    method: str
    source: Any
    destination: Any
    pause_s: float
    warm_timeout_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Wave:
    """Moves carried out together, `at_s` (driver seconds) after the moves were planned."""

    at_s: float
    moves: tuple[MoveOrder, ...]


@dataclass(frozen=True, slots=True)
class Moved:
    """What a batch of moves did: the gateway's outcome per request that left its instance
    (kv_moved, recomputed, rerun, ...), how many left, and until when the last KV is on its
    way (the source holds it until then; 0: nothing in transit)."""

    outcomes: tuple[str, ...] = ()
    num_moved: int = 0
    busy_until_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Drain:
    """Wait until `instances` are empty, at most `deadline_s`, carrying out `waves` (the
    early moves) at their times meanwhile; no wave starts after the drain ended. Reply:
    `Drained`."""

    instances: tuple[Any, ...]
    deadline_s: float
    waves: tuple[Wave, ...] = ()


@dataclass(frozen=True, slots=True)
class Drained:
    empty: tuple[bool, ...]  # per instance
    moved: Moved = field(default_factory=Moved)


@dataclass(frozen=True, slots=True)
class Move:
    """Carry one wave out now. Reply: `Moved`, once the gateway answered for every move."""

    wave: Wave


@dataclass(frozen=True, slots=True)
class Continue:
    """Requests with nowhere to go at the deadline: the gateway continues them wherever it
    can when their instance stops. Reply: the outcome per request it moved now (may be
    none: it moves them when the instance stops)."""

    requests: tuple[tuple[Any, Record], ...]  # (source, request)


Command = (
    Launch
    | AwaitReady
    | NextReady
    | Join
    | SetState
    | Rehearse
    | StillAlive
    | Hold
    | Release
    | Wait
    | Sleep
    | Wake
    | StopRouting
    | Survey
    | Drain
    | Move
    | Continue
)
