"""Several gateway replicas, one pool (pure): what the controller wants every replica to hold,
what one that missed commands must be told to catch up, and one view of the fleet for the
tick (docs/controller.md, "Several gateways").

The controller's `Intent` is built from the admin commands it sent (register, lifecycle
state, weight, remove, hold, refuse), never from what a replica says: a replica that was down
or restarted cannot talk another one into a stale pool. `catch_up` turns the difference
between the intent and one replica's pool into the commands that close it: a missing
instance is registered again and walked along its lifecycle to its state, a lagging one is
walked there, one the controller removed goes, and the holds and refusals still running are
sent again with the seconds they have left. An instance the controller never spoke of (a
static `--backend`, or what a replica left over from before this controller started) is left
alone: the tick's view lists only instances every replica that answered holds.

A gateway request id is a replica's own counter, so two replicas can hand out the same one:
`fleet_request_id` tags it with the replica, and a move goes to the replica that holds the
stream (`local_request_id`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from flexpipe.gateway.core.pool import ADDABLE_STATES
from flexpipe.lifecycle import TRANSITIONS, State

__all__ = [
    "MAX_REPLICAS",
    "AddInstance",
    "Intent",
    "Registration",
    "RemoveInstance",
    "SendHold",
    "SendRefusal",
    "SetState",
    "SetWeight",
    "Standby",
    "Step",
    "catch_up",
    "choose_deployment",
    "derived_deployment",
    "differences",
    "fleet_request_id",
    "local_request_id",
    "merge_metrics",
    "merge_pools",
    "replica_load",
    "state_path",
]

# A fleet request id is `local id * MAX_REPLICAS + the replica's index` (no more replicas).
MAX_REPLICAS = 1024
# Instance fields that add up over replicas (each counts what it routed); the others are the
# engine's own (scraped by every replica alike) or the instance's settings.
_ADDITIVE_FIELDS = ("num_in_flight", "num_queued_tokens")
# how many removed instances are remembered for a replica that was away (the oldest forgotten)
_MAX_REMOVED = 4096


@dataclass(frozen=True, slots=True)
class Registration:
    """One instance as the controller registered it, and the state it wants it in."""

    url: str
    model: str
    max_num_seqs: int
    state: str  # a lifecycle state (flexpipe/lifecycle.py)
    admin_token: str | None = None
    api_key: str | None = None
    weight: float | None = None  # None: the gateway's default


@dataclass(frozen=True, slots=True)
class Standby:
    """A hold (`reason` None) or a refusal of a model with no instance, until `until_s`."""

    model: str
    until_s: float  # unix s
    reason: str | None = None


@dataclass
class Intent:
    """What every replica should hold, as the controller's commands left it."""

    pool: dict[str, Registration] = field(default_factory=dict)  # url -> registration
    removed: deque[str] = field(default_factory=lambda: deque(maxlen=_MAX_REMOVED))
    standby: dict[str, Standby] = field(default_factory=dict)  # model -> hold or refusal
    # model -> when the hold or refusal it lifted would have run out (unix s): a replica that
    # missed the release is told again until then
    released: dict[str, float] = field(default_factory=dict)
    version: int = 0  # counts the changes: a catch-up under way sees one came meanwhile

    def registered(self, reg: Registration) -> None:
        self.version += 1
        self.pool[reg.url] = reg
        if reg.url in self.removed:
            self.removed.remove(reg.url)

    def set_state(self, url: str, state: str) -> None:
        self.version += 1
        if state == State.GONE.value:
            self.remove(url)
        elif url in self.pool:
            self.pool[url] = replace(self.pool[url], state=state)

    def set_weight(self, url: str, weight: float) -> None:
        self.version += 1
        if url in self.pool:
            self.pool[url] = replace(self.pool[url], weight=weight)

    def remove(self, url: str) -> None:
        self.version += 1
        self.pool.pop(url, None)
        if url not in self.removed:
            self.removed.append(url)

    def hold(self, model: str, seconds: float, now_s: float) -> None:
        """A hold of `seconds` (0: the end of its hold or refusal, as the gateway's)."""
        self.version += 1
        if seconds > 0:
            self.standby[model] = Standby(model, now_s + seconds)
            self.released.pop(model, None)
            return
        lifted = self.standby.pop(model, None)
        if lifted is not None:
            self.released[model] = max(lifted.until_s, self.released.get(model, 0.0))

    def refuse(self, model: str, reason: str, seconds: float, now_s: float) -> None:
        self.version += 1
        self.standby[model] = Standby(model, now_s + seconds, reason)
        self.released.pop(model, None)

    def expire(self, now_s: float) -> None:
        """Forget the holds, refusals and releases whose time ran out (on every replica
        alike: a replica drops a lapsed hold by itself)."""
        for model in [m for m, s in self.standby.items() if s.until_s <= now_s]:
            del self.standby[model]
        for model in [m for m, t in self.released.items() if t <= now_s]:
            del self.released[model]


# ------------------------------------------------------------------------- catch-up steps
@dataclass(frozen=True, slots=True)
class AddInstance:
    reg: Registration
    state: str  # the state it joins as (one the gateway takes at registration)


@dataclass(frozen=True, slots=True)
class SetState:
    url: str
    state: str


@dataclass(frozen=True, slots=True)
class SetWeight:
    url: str
    weight: float


@dataclass(frozen=True, slots=True)
class RemoveInstance:
    url: str


@dataclass(frozen=True, slots=True)
class SendHold:
    model: str
    seconds: float  # 0: released


@dataclass(frozen=True, slots=True)
class SendRefusal:
    model: str
    reason: str
    seconds: float


Step = AddInstance | SetState | SetWeight | RemoveInstance | SendHold | SendRefusal


def state_path(start: str, goal: str) -> list[str] | None:
    """The shortest walk from `start` to `goal` along the lifecycle (the states after
    `start`; [] when already there); None when there is none (`gone` is final)."""
    if start == goal:
        return []
    try:
        first, last = State(start), State(goal)
    except ValueError:
        return None
    came: dict[State, State] = {first: first}
    todo = deque([first])
    while todo:
        at = todo.popleft()
        # in a fixed order, active last: of two equally short walks the one that is never
        # routed to on the way (starting -> rehearsing -> draining)
        for nxt in sorted(TRANSITIONS[at], key=lambda s: (s is State.ACTIVE, s.value)):
            if nxt in came:
                continue
            came[nxt] = at
            if nxt is last:
                path = [nxt]
                while came[path[-1]] is not first:
                    path.append(came[path[-1]])
                return [s.value for s in reversed(path)]
            todo.append(nxt)
    return None


def _joins_as(state: str) -> tuple[str, list[str]]:
    """The state an instance in `state` is registered as, and the walk from there."""
    if state in {s.value for s in ADDABLE_STATES}:
        return state, []
    return State.ACTIVE.value, state_path(State.ACTIVE.value, state) or []


def catch_up(
    intent: Intent, seen: Sequence[Mapping[str, Any]], now_s: float, standby: bool
) -> list[Step]:
    """What brings a replica whose pool is `seen` (its `GET /admin/instances`) to `intent`,
    in order: what the controller removed goes first, then each missing instance joins and
    each lagging one walks its lifecycle (one with no legal walk, such as draining back to
    rehearsing, is removed and joins again), then weights; with `standby` (the replica missed
    a command, or came back: its holds cannot be read) every hold and refusal still running,
    with the seconds it has left, and every release."""
    have = {str(i.get("url")): i for i in seen}
    steps: list[Step] = [RemoveInstance(url) for url in intent.removed if url in have]
    for url, reg in intent.pool.items():
        there = have.get(url)
        state = None if there is None else str(there.get("state"))
        path = None if state is None else state_path(state, reg.state)
        if state is not None and path is None:
            steps.append(RemoveInstance(url))
        if path is None:
            joins, path = _joins_as(reg.state)
            steps.append(AddInstance(reg, joins))
        steps += [SetState(url, s) for s in path]
        weight = None if there is None or path is None else there.get("weight")
        if reg.weight is not None and weight != reg.weight:
            steps.append(SetWeight(url, reg.weight))
    if standby:
        for s in sorted(intent.standby.values(), key=lambda s: s.model):
            left_s = s.until_s - now_s
            if left_s <= 0:
                continue
            if s.reason is None:
                steps.append(SendHold(s.model, left_s))
            else:
                steps.append(SendRefusal(s.model, s.reason, left_s))
        steps += [SendHold(m, 0.0) for m, t in sorted(intent.released.items()) if t > now_s]
    return steps


def differences(intent: Intent, seen: Sequence[Mapping[str, Any]]) -> list[str]:
    """How a replica's pool differs from the intent, one phrase each ([]: in sync)."""
    have = {str(i.get("url")): str(i.get("state")) for i in seen}
    out = [f"{url} removed, still there" for url in intent.removed if url in have]
    for url, reg in intent.pool.items():
        if url not in have:
            out.append(f"{url} missing")
        elif have[url] != reg.state:
            out.append(f"{url} {have[url]}, not {reg.state}")
    return out


# ------------------------------------------------------------------------- the tick's view
def merge_pools(
    pools: Sequence[Sequence[Mapping[str, Any]]], intent: Intent | None = None
) -> list[dict[str, Any]]:
    """One pool from the pools of the replicas that answered. Its instances are those every
    replica in step with the intent holds (a replica that lags, say restarted a moment ago, is
    caught up rather than trusted; when none is in step, every one counts, and an instance
    one of them lacks is registered again by whoever reads this), in the first's order. What
    each replica routed there (in flight, queued tokens) is added up over every replica, the
    engine's own figures (running, waiting, KV) are as the first saw them, it is healthy where
    any sees it so, and in the state the controller wants where it said one. One pool is
    returned as it is."""
    if len(pools) == 1:
        return [dict(i) for i in pools[0]]
    in_step = [p for p in pools if intent is None or not differences(intent, p)]
    deciding = in_step or list(pools)
    by_url = [{str(i.get("url")): i for i in pool} for pool in pools]
    members = [{str(i.get("url")) for i in pool} for pool in deciding]
    out = []
    for first in deciding[0] if deciding else ():
        url = str(first.get("url"))
        if not all(url in m for m in members):
            continue
        theirs = [p[url] for p in by_url if url in p]
        merged = dict(first)
        for name in _ADDITIVE_FIELDS:
            if name in first:
                merged[name] = sum(_num(t.get(name)) for t in theirs)
        merged["healthy"] = any(bool(t.get("healthy", True)) for t in theirs)
        wanted = None if intent is None else intent.pool.get(url)
        if wanted is not None:
            merged["state"] = wanted.state
        out.append(merged)
    return out


def _num(x: Any) -> float | int:
    return x if isinstance(x, int | float) and not isinstance(x, bool) else 0


def merge_metrics(texts: Sequence[str]) -> str:
    """One Prometheus text from several replicas': every sample with the same name and labels
    added up (counts, queues, in-flight, histogram buckets all add over replicas), each
    family once, in the order first seen. One text is returned as it is."""
    if len(texts) == 1:
        return texts[0]
    families: dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            entry = families.setdefault(family.name, (family.type, family.documentation, {}))
            samples = entry[2]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in samples:
                    samples[key] = float(s.value)
                elif s.name.endswith("_created"):  # a time, not a count: the earliest
                    samples[key] = min(samples[key], float(s.value))
                else:
                    samples[key] += float(s.value)
    lines = []
    for family_name, (kind, doc, samples) in families.items():
        # a counter's family is named without `_total` by the parser, with it in the text
        name = f"{family_name}_total" if kind == "counter" else family_name
        if doc:
            lines.append(f"# HELP {name} {_escape_help(doc)}")
        lines.append(f"# TYPE {name} {kind}")
        for (sample, labels), value in samples.items():
            inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
            head = f"{sample}{{{inner}}}" if inner else sample
            lines.append(f"{head} {_number(value)}")
    return "\n".join(lines) + "\n"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(x)


def replica_load(text: str) -> tuple[int, float]:
    """(requests open now, requests finished so far) of one replica, from its /metrics."""
    in_flight = 0.0
    finished = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "flexpipe_in_flight_requests":
            in_flight += sum(s.value for s in family.samples)
        elif family.name == "flexpipe_requests":
            finished += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return round(in_flight), finished


# ------------------------------------------------------------------------- request ids
def fleet_request_id(local_id: int, index: int) -> int:
    """A replica's request id, tagged with the replica's index in the fleet."""
    if not 0 <= index < MAX_REPLICAS:
        raise ValueError(f"replica index {index} outside 0..{MAX_REPLICAS - 1}")
    return local_id * MAX_REPLICAS + index


def local_request_id(fleet_id: int) -> tuple[int, int]:
    """(the replica's own request id, the replica's index) of a fleet request id."""
    return divmod(fleet_id, MAX_REPLICAS)


# ------------------------------------------------------------------------- deployment id
def derived_deployment(urls: Iterable[str]) -> str:
    """The deployment id of a new fleet: its one URL (what a single gateway's deployment has
    always been called), else its URLs sorted, joined by commas."""
    return ",".join(sorted({u.rstrip("/") for u in urls}))


def choose_deployment(
    configured: str | None,
    urls: Collection[str],
    fleets: Mapping[str, Collection[str]],
    known_ids: Collection[str],
) -> str:
    """The deployment this controller serves: `configured` when given; else the one deployment
    of the store whose recorded replicas (`fleets`: id -> URLs) share one with `urls` (a
    replica added or retired keeps the deployment, its engines and its shift log), or the one
    of `urls` that is already a deployment of the store and is no recorded fleet's replica
    (`known_ids`: a single gateway's, from before replicas were recorded); else
    `derived_deployment(urls)`. Two candidates are
    a ValueError (one line): which is meant is the operator's to say."""
    if configured:
        return configured
    mine = {u.rstrip("/") for u in urls}
    recorded = {d: {u.rstrip("/") for u in theirs} for d, theirs in fleets.items()}
    listed = set().union(*recorded.values())
    matching = sorted(
        {d for d, theirs in recorded.items() if mine & theirs}
        | {u for u in mine & set(known_ids) if u not in listed}
    )
    if len(matching) > 1:
        raise ValueError(
            f"the gateways {', '.join(sorted(mine))} belong to {len(matching)} deployments in "
            f"the store ({', '.join(matching)}): name one with --deployment-id"
        )
    return matching[0] if matching else derived_deployment(mine)
