"""The shift procedure (control/core/shift_procedure.py) stepped by hand: a fake world answers
each command in plain Python (no asyncio, no event loop), and the tests pin the exact commands
in their order: make-before-break, moves before the release, the in-place hold and its
release, the hold to zero, a rollback."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from flexpipe.cluster import load_cluster
from flexpipe.control.core.instance_names import unique_name
from flexpipe.control.core.shift_commands import (
    AwaitReady,
    Command,
    Continue,
    Drain,
    Drained,
    Failed,
    Hold,
    Join,
    Launch,
    Move,
    Moved,
    NextReady,
    Rehearse,
    Release,
    Reply,
    SetState,
    Sleep,
    StillAlive,
    StopRouting,
    Survey,
    Surveyed,
    Wait,
    Wake,
)
from flexpipe.control.core.shift_outcome import ShiftOutcome, in_place_gap_s
from flexpipe.control.core.shift_procedure import (
    ShiftParams,
    ShiftProcedure,
    in_place_hold_s,
)
from flexpipe.policies.planner import PlannedInstance, parse_models, plan
from flexpipe.policies.shift.in_place import SIDE_BY_SIDE, WAKE, InPlaceChoice
from flexpipe.policies.shift.snapshot import instance_key

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml")
(DEMAND,) = parse_models(yaml.safe_load((ROOT / "examples/models/llama-7b.yaml").read_text()), "m")
# llama-7b-0 on gpu1+gpu2 (48 slots), llama-7b-1 on gpu3 (L40S, 16), llama-7b-2 on gpu0 (L4, 2)
PAIR, L40S, L4 = plan(CLUSTER, [DEMAND]).instances


@dataclass
class Inst:
    """An instance as the fake world runs it."""

    planned: PlannedInstance
    cold_start_s: float = 12.5
    active: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return instance_key(self.planned)

    @property
    def url(self) -> str:
        return f"http://{self.planned.name}"


def req(call_id: int, output: int, max_tokens: int, prompt: int = 1000) -> dict[str, Any]:
    return {"id": call_id, "num_prompt_tokens": prompt, "num_output_tokens": output,
            "max_tokens": max_tokens}  # fmt: skip


def relaunched(p: PlannedInstance) -> PlannedInstance:
    """The same GPUs in another gear (an in-place target)."""
    return replace(p, gear=replace(p.gear, max_num_seqs=p.gear.max_num_seqs + 8))


class FakeWorld:
    """Answers every command at once (Wait and the waits for engines advance the clock);
    records each as a short line. `missed`: instance names whose rehearsal misses."""

    def __init__(
        self, missed: tuple[str, ...] = (), dead: tuple[str, ...] = (), awake: tuple[str, ...] = ()
    ) -> None:
        self.now_s = 100.0
        self.log: list[str] = []
        self.missed = missed
        self.dead = dead  # sleeping instances whose engine died: their wake fails
        self.awake = awake  # instances that do not fall asleep

    def names(self, instances: Any) -> str:
        return ",".join(i.planned.name for i in instances)

    def answer(self, c: Command) -> Any:
        match c:
            case Launch(planned):
                self.log.append(f"launch {','.join(p.name for p in planned)}")
                return [Inst(p) for p in planned]
            case AwaitReady(tokens) | NextReady(tokens):
                self.now_s += 12.5
                self.log.append(f"ready {self.names(tokens)}")
                return list(tokens) if isinstance(c, AwaitReady) else [(t, t) for t in tokens]
            case Join(instances):
                self.log.append(f"join {self.names(instances)}")
                return [""] * len(instances)
            case SetState(instances, state):
                for i in instances:
                    i.active = state == "active"
                self.log.append(f"{state} {self.names(instances)}")
                return None
            case Rehearse(instances):
                self.now_s += 1.0
                self.log.append(f"rehearse {self.names(instances)}")
                return [{"instance": i.key, "passed": i.planned.name not in self.missed,
                         "why": f"{i.planned.name} slow"} for i in instances]  # fmt: skip
            case StillAlive(instances):
                return list(instances)
            case Hold(model, seconds):
                self.log.append(f"hold {model} {seconds:g}")
                return ""
            case Release(instances):
                self.log.append(f"release {self.names(instances)}")
                return None
            case Wait(seconds):
                self.now_s += seconds
                self.log.append(f"wait {seconds:.3f}")
                return None
            case StopRouting(instances):
                for i in instances:
                    i.active = False
                self.log.append(f"stop routing {self.names(instances)}")
                return sum(len(i.requests) for i in instances)
            case Survey(sources, candidates):
                self.log.append(f"survey {self.names(sources)}")
                return Surveyed(
                    CLUSTER, tuple(tuple(s.requests) for s in sources),
                    tuple((d, tuple(d.requests)) for d in candidates if d.active),
                )  # fmt: skip
            case Drain(instances, deadline_s, waves):
                self.log.append(f"drain {self.names(instances)} {deadline_s:g} s")
                moved = [self.carry(w.moves, "early") for w in waves]
                for i in instances:  # what has 10 tokens or fewer left ends by the deadline
                    for r in [
                        r for r in i.requests if r["max_tokens"] - r["num_output_tokens"] <= 10
                    ]:
                        self.log.append(f"finished {r['id']}")
                        i.requests.remove(r)
                self.now_s += deadline_s if any(i.requests for i in instances) else 0.0
                outcomes = tuple(o for m in moved for o in m.outcomes)
                return Drained(tuple(not i.requests for i in instances),
                               Moved(outcomes, len(outcomes)))  # fmt: skip
            case Move(wave):
                return self.carry(wave.moves, "move")
            case Continue(requests):
                self.log.append(f"continue {len(requests)}")
                return []
            case Sleep(instances, level):
                self.now_s += 2.0
                self.log.append(f"sleep {self.names(instances)} level {level}")
                return [
                    Failed("no sleep") if i.planned.name in self.awake else i for i in instances
                ]
            case Wake(instances):
                self.now_s += 0.5
                self.log.append(f"wake {self.names(instances)}")
                return [
                    Failed("engine died") if i.planned.name in self.dead else i for i in instances
                ]
        raise AssertionError(c)

    def carry(self, moves: Any, what: str) -> Moved:
        outcomes = []
        for m in moves:
            m.source.requests = [r for r in m.source.requests if r["id"] != m.id]
            outcomes.append("kv_moved" if m.method == "kv" else "recomputed")
            self.log.append(f"{what} {m.id} {m.method} {m.source.planned.name}->"
                            f"{m.destination.planned.name}")  # fmt: skip
        return Moved(tuple(outcomes), len(outcomes))


def drive(gen: Generator[Command, Reply, ShiftOutcome], world: FakeWorld) -> ShiftOutcome:
    try:
        command = next(gen)
        while True:
            value = world.answer(command)
            command = gen.send(Reply(world.now_s, value))
    except StopIteration as stop:
        out: ShiftOutcome = stop.value
        return out


def running_of(*planned: PlannedInstance) -> dict[str, Inst]:
    return {instance_key(p): Inst(p, active=True) for p in planned}


def test_new_instances_serve_before_any_old_one_drains() -> None:
    """Make-before-break: the L4 retires for the pair and the L40S on free GPUs; both are
    active before the L4 stops taking requests, and it is released last."""
    running = running_of(L4)
    world = FakeWorld()
    params = ShiftParams(drain_deadline_s=30.0)
    out = drive(ShiftProcedure(running, [PAIR, L40S], params).run(world.now_s), world)
    assert world.log == [
        "launch llama-7b-0,llama-7b-1",
        "ready llama-7b-0,llama-7b-1",
        "join llama-7b-0,llama-7b-1",
        "rehearsing llama-7b-0,llama-7b-1",
        "rehearse llama-7b-0,llama-7b-1",
        "active llama-7b-0",
        "active llama-7b-1",
        "stop routing llama-7b-2",
        "survey llama-7b-2",
        "drain llama-7b-2 30 s",
        "drain llama-7b-2 10 s",
        "release llama-7b-2",
    ]
    assert out.succeeded and out.reason == ""
    assert out.started == [instance_key(PAIR), instance_key(L40S)]
    assert out.stopped == [instance_key(L4)]
    assert sorted(running) == sorted([instance_key(PAIR), instance_key(L40S)])
    assert out.phases_s == {"warm": 12.5, "rehearse": 1.0, "switch": 0.0, "drain": 0.0,
                            "migrate": 0.0, "release": 0.0}  # fmt: skip


def test_the_leaving_engine_is_released_only_after_its_requests_moved() -> None:
    """A leaves; B (its NVLink neighbour, one slot free) and the L40S (across 25 GbE) stay.
    What outlives the 4 s deadline moves at once (early, during the drain), what is short
    finishes in place, the rest moves at the deadline: over NVLink as KV, to the L40S by
    recompute; the release comes after the last move."""
    a = replace(PAIR, name="llama-7b-a", stages=(("gpu1",),),
                gear=replace(PAIR.gear, tp=1, max_num_seqs=32))  # fmt: skip
    b = replace(a, name="llama-7b-b", stages=(("gpu2",),), gear=replace(a.gear, max_num_seqs=3))
    running = running_of(a, b, L40S)
    running[instance_key(b)].requests = [req(10, 5, 2000), req(11, 5, 2000)]
    source = running[instance_key(a)]
    source.requests = [req(1, 10, 2000, prompt=900), req(2, 20, 2000, prompt=3900),
                       req(3, 60, 64), req(4, 0, 64), req(5, 25, 40, prompt=6000),
                       req(6, 0, 40, prompt=6000)]  # fmt: skip
    world = FakeWorld()
    params = ShiftParams(drain_deadline_s=4.0)
    out = drive(ShiftProcedure(running, [b, L40S], params).run(world.now_s), world)
    assert world.log == [
        "stop routing llama-7b-a",
        "survey llama-7b-a",
        "drain llama-7b-a 4 s",
        "early 1 kv llama-7b-a->llama-7b-b",
        "early 2 recompute llama-7b-a->llama-7b-1",
        "finished 3",  # 4 tokens left: within the deadline
        "survey llama-7b-a",
        "move 4 kv llama-7b-a->llama-7b-b",
        "move 6 recompute llama-7b-a->llama-7b-1",
        "wait 0.270",  # after the recompute ahead of it on the L40S
        "move 5 recompute llama-7b-a->llama-7b-1",
        "drain llama-7b-a 10 s",
        "release llama-7b-a",
    ]
    last_move = max(i for i, line in enumerate(world.log) if "->" in line)
    assert world.log.index("release llama-7b-a") > last_move
    # 6 in flight: 2 moved early, 3 at the deadline, 1 finished in place
    assert out.migrated == {"kv_moved": 2, "recomputed": 3, "finished_in_place": 1}
    assert out.succeeded and out.stopped == [instance_key(a)] and source.requests == []
    assert out.phases_s["drain"] == 4.0


def test_engines_that_cannot_hand_kv_over_have_every_request_recomputed() -> None:
    """The same drain between engines of a kind without KV export/import (vLLM, SGLang:
    flexpipe/engine_kinds.py): no move is offered as a KV move, the NVLink neighbour included;
    the same requests move, each by recompute."""
    a = replace(PAIR, name="llama-7b-a", stages=(("gpu1",),),
                gear=replace(PAIR.gear, tp=1, max_num_seqs=32))  # fmt: skip
    b = replace(a, name="llama-7b-b", stages=(("gpu2",),), gear=replace(a.gear, max_num_seqs=8))
    running = running_of(a, b)
    running[instance_key(a)].requests = [req(1, 10, 2000, prompt=900), req(2, 0, 64)]
    world = FakeWorld()
    params = ShiftParams(drain_deadline_s=4.0, kv_moves=False)
    out = drive(ShiftProcedure(running, [b], params).run(world.now_s), world)
    moves = [line for line in world.log if "->" in line]
    assert moves == ["early 1 recompute llama-7b-a->llama-7b-b",
                     "move 2 recompute llama-7b-a->llama-7b-b"]  # fmt: skip
    assert out.migrated == {"recomputed": 2}


def test_an_in_place_step_holds_its_model_for_two_cold_starts_and_the_drain() -> None:
    """The L40S is replaced on its own GPU: its model is held for 2 * 12.5 s (its cold
    start) + 30 s (the drain) + 30 s while it is released and its successor starts, and
    let go after."""
    running = running_of(PAIR, L40S, L4)
    new = relaunched(L40S)
    world = FakeWorld()
    out = drive(ShiftProcedure(running, [PAIR, new, L4], ShiftParams()).run(world.now_s), world)
    assert in_place_hold_s(12.5, 30.0) == 85.0
    assert world.log == [
        "hold llama-7b 85",
        "stop routing llama-7b-1",
        "survey llama-7b-1",
        "drain llama-7b-1 30 s",
        "drain llama-7b-1 10 s",
        "release llama-7b-1",
        "launch llama-7b-1",
        "ready llama-7b-1",
        "join llama-7b-1",
        "rehearsing llama-7b-1",
        "rehearse llama-7b-1",
        "active llama-7b-1",
        "hold llama-7b 0",
    ]
    assert out.succeeded and out.started == [instance_key(new)]
    assert out.in_place == ["rolling, capacity away 13.500 s"]
    assert list(out.phases_s) == [
        f"{p}_in_place" for p in ("drain", "migrate", "release", "warm", "rehearse", "switch")
    ]


def test_a_model_scaled_to_zero_is_held_for_the_standby_hold() -> None:
    running = running_of(L4)
    world = FakeWorld()
    params = ShiftParams(standby_hold_s=123.0)
    out = drive(ShiftProcedure(running, [], params).run(world.now_s), world)
    assert world.log[0] == "hold llama-7b 123"
    assert world.log[-1] == "release llama-7b-2" and out.succeeded and running == {}


def test_a_failed_in_place_successor_rolls_back() -> None:
    """The L4 starts on its free GPU, then the L40S's successor misses its rehearsal: it is
    released, the old L40S starts again (no rehearsal) and the L4 the shift started leaves;
    the shift did not succeed."""
    running = running_of(PAIR, L40S)
    new = relaunched(L40S)
    world = FakeWorld(missed=("llama-7b-1",))
    out = drive(ShiftProcedure(running, [PAIR, new, L4], ShiftParams()).run(world.now_s), world)
    assert world.log == [
        "launch llama-7b-2",
        "ready llama-7b-2",
        "join llama-7b-2",
        "rehearsing llama-7b-2",
        "rehearse llama-7b-2",
        "active llama-7b-2",
        "hold llama-7b 85",
        "stop routing llama-7b-1",
        "survey llama-7b-1",
        "drain llama-7b-1 30 s",
        "drain llama-7b-1 10 s",
        "release llama-7b-1",
        "launch llama-7b-1",
        "ready llama-7b-1",
        "join llama-7b-1",
        "rehearsing llama-7b-1",
        "rehearse llama-7b-1",
        "release llama-7b-1",  # the successor that missed
        "launch llama-7b-1",  # the old one again
        "ready llama-7b-1",
        "join llama-7b-1",
        "active llama-7b-1",
        "stop routing llama-7b-2",  # what the shift started leaves
        "survey llama-7b-2",
        "drain llama-7b-2 30 s",
        "drain llama-7b-2 10 s",
        "release llama-7b-2",
        "hold llama-7b 0",
    ]
    assert not out.succeeded and not out.refused
    assert out.reason == "rehearsal missed: llama-7b-1 slow"
    assert out.started == []
    assert sorted(running) == sorted([instance_key(PAIR), instance_key(L40S)])
    assert out.stopped == [instance_key(L40S), instance_key(L4)]


def test_each_instance_gets_a_name_no_earlier_one_had() -> None:
    """The planner names instances per plan (`llama-7b-1` again in the next plan): given the
    deployment's names, the procedure launches each under a new one."""
    assert unique_name("llama-7b-1", {"llama-7b-1", "llama-7b-1.2"}) == "llama-7b-1.3"
    running = running_of(PAIR, L40S)
    names = {"llama-7b-0", "llama-7b-1", "llama-7b-2"}  # the L4 ran once and left
    world = FakeWorld()
    drive(ShiftProcedure(running, [PAIR, L40S, L4], ShiftParams(), names).run(0.0), world)
    assert world.log[0] == "launch llama-7b-2.2"
    assert "llama-7b-2.2" in names


def test_a_model_scaled_to_zero_sleeps_and_a_later_target_wakes_it() -> None:
    """Down to zero with a sleep level: drained, then put to sleep, not released; the next
    target with the same model, gear and GPUs wakes it (no launch, no rehearsal)."""
    running = running_of(L4)
    sleepers: dict[str, Any] = {}
    world = FakeWorld()
    params = ShiftParams(standby_hold_s=123.0)
    levels = {instance_key(L4): 1}
    out = drive(
        ShiftProcedure(running, [], params, None, None, sleepers, levels).run(world.now_s), world
    )
    assert world.log == [
        "hold llama-7b 123",
        "stop routing llama-7b-2",
        "survey llama-7b-2",
        "drain llama-7b-2 30 s",
        "drain llama-7b-2 10 s",
        "sleep llama-7b-2 level 1",
    ]
    assert out.succeeded and out.slept == [instance_key(L4)] and out.stopped == []
    assert running == {} and list(sleepers) == [instance_key(L4)]
    assert out.phases_s["sleep"] == 2.0 and "release" not in out.phases_s
    world.log.clear()
    out = drive(ShiftProcedure(running, [L4], params, None, None, sleepers).run(world.now_s), world)
    assert world.log == ["wake llama-7b-2", "active llama-7b-2"]
    assert out.succeeded and out.woken == out.started == [instance_key(L4)]
    assert list(running) == [instance_key(L4)] and sleepers == {}
    assert out.phases_s == {"wake": 0.5}


def test_without_a_sleep_level_the_leaving_instance_is_released_as_before() -> None:
    running = running_of(L4)
    world = FakeWorld()
    out = drive(ShiftProcedure(running, [], ShiftParams(), None, None, {}, {}).run(100.0), world)
    assert world.log[-1] == "release llama-7b-2" and out.slept == []


def test_a_wake_that_fails_releases_the_sleeper_and_cold_starts_the_instance() -> None:
    sleepers: dict[str, Any] = {instance_key(L4): Inst(L4)}
    running: dict[str, Inst] = {}
    world = FakeWorld(dead=("llama-7b-2",))
    out = drive(ShiftProcedure(running, [L4], ShiftParams(), None, None, sleepers).run(1.0), world)
    assert world.log == [
        "wake llama-7b-2",
        "release llama-7b-2",
        "launch llama-7b-2",
        "ready llama-7b-2",
        "join llama-7b-2",
        "rehearsing llama-7b-2",
        "rehearse llama-7b-2",
        "active llama-7b-2",
    ]
    assert out.succeeded and out.woken == [] and out.stopped == [instance_key(L4)]
    assert out.started == [instance_key(L4)] and sleepers == {}


def test_a_sleeper_on_gpus_another_target_needs_is_released_first() -> None:
    """The L4 sleeps on gpu0; the target puts another gear there: the sleeper stops before
    the launch (its engine holds the GPU); a sleeper no target needs sleeps on."""
    other = relaunched(L4)
    sleepers: dict[str, Any] = {instance_key(L4): Inst(L4), instance_key(L40S): Inst(L40S)}
    running: dict[str, Inst] = {}
    world = FakeWorld()
    out = drive(
        ShiftProcedure(running, [other], ShiftParams(), None, None, sleepers).run(1.0), world
    )
    assert world.log[:2] == ["release llama-7b-2", "launch llama-7b-2"]
    assert list(sleepers) == [instance_key(L40S)] and out.stopped == [instance_key(L4)]


def test_a_sleeper_beside_an_instance_the_target_keeps_sleeps_on() -> None:
    """Time-sharing: another gear sleeps on gpu0 beside the running L4, which the target
    keeps; the target adds the L40S elsewhere. Only the GPUs of new instances are needed:
    the sleeper is not released (it was, when kept instances counted as needing theirs)."""
    beside = relaunched(L4)
    sleepers: dict[str, Any] = {instance_key(beside): Inst(beside)}
    running: dict[str, Inst] = {instance_key(L4): Inst(L4)}
    world = FakeWorld()
    out = drive(
        ShiftProcedure(running, [L4, L40S], ShiftParams(), None, None, sleepers).run(1.0), world
    )
    assert out.succeeded and out.stopped == [] and "release_asleep" not in out.phases_s
    assert list(sleepers) == [instance_key(beside)]
    assert not [line for line in world.log if line.startswith("release")]
    assert sorted(running) == sorted([instance_key(L4), instance_key(L40S)])


# -- in place, make-before-break (policies/shift/in_place.py) ---------------------------------


def choosing(choice: InPlaceChoice) -> Any:
    """A chooser that answers `choice` for every in-place step (the shell's is the cluster's)."""
    return lambda blockers, adds: choice


def test_an_in_place_successor_pre_started_asleep_replaces_its_predecessor_by_a_wake() -> None:
    """Make-before-break where memory does not allow both: the L40S's successor starts beside
    it, rehearses and sleeps at level 1 while the old one serves; then the old one drains for
    the short in-place deadline (2 s), is released, and the successor wakes and serves: no
    cold start in the gap, no second rehearsal."""
    running = running_of(PAIR, L40S, L4)
    new = relaunched(L40S)
    world = FakeWorld()
    sleepers: dict[str, Any] = {}
    choice = choosing(InPlaceChoice(WAKE, 1, "host_ram", "too big"))
    procedure = ShiftProcedure(
        running, [PAIR, new, L4], ShiftParams(), None, None, sleepers, None, choice
    )
    out = drive(procedure.run(world.now_s), world)
    assert world.log == [
        "launch llama-7b-1",
        "ready llama-7b-1",
        "join llama-7b-1",
        "rehearsing llama-7b-1",
        "rehearse llama-7b-1",
        "sleep llama-7b-1 level 1",
        "hold llama-7b 85",
        "stop routing llama-7b-1",
        "survey llama-7b-1",
        "drain llama-7b-1 2 s",
        "drain llama-7b-1 10 s",
        "release llama-7b-1",
        "wake llama-7b-1",
        "active llama-7b-1",
        "hold llama-7b 0",
    ]
    assert out.succeeded and out.started == out.woken == [instance_key(new)]
    assert out.stopped == [instance_key(L40S)] and sleepers == {}
    # the pre-start (12.5 s load, 1 s rehearsal, 2 s sleep) is not a gap: the old one serves;
    # the gap is the drain (the fake world's instance is empty at once) and the wake
    assert out.in_place == ["wake, capacity away 0.500 s: too big"]
    assert out.phases_s == {"warm_prestart_in_place": 12.5, "rehearse_prestart_in_place": 1.0,
                            "sleep_prestart_in_place": 2.0, "drain_in_place": 0.0,
                            "migrate_in_place": 0.0, "release_in_place": 0.0,
                            "wake_in_place": 0.5}  # fmt: skip
    assert sorted(running) == sorted(map(instance_key, (PAIR, new, L4)))
    # what `bench shift` reads back from the shift log's notes
    notes = ["started x", *(f"in place: {line}" for line in out.in_place)]
    assert in_place_gap_s([*notes, "in place: rolling, capacity away 13.500 s"]) == 14.0
    assert in_place_gap_s(["started x"]) is None


def test_an_in_place_successor_that_fits_beside_serves_before_its_predecessor_drains() -> None:
    """Side by side: the successor starts, rehearses and serves, then the old one drains
    for the usual deadline and is released; the model is never held."""
    running = running_of(PAIR, L40S, L4)
    new = relaunched(L40S)
    world = FakeWorld()
    choice = choosing(InPlaceChoice(SIDE_BY_SIDE, why="fits"))
    procedure = ShiftProcedure(
        running, [PAIR, new, L4], ShiftParams(), None, None, {}, None, choice
    )
    out = drive(procedure.run(world.now_s), world)
    assert world.log == [
        "launch llama-7b-1",
        "ready llama-7b-1",
        "join llama-7b-1",
        "rehearsing llama-7b-1",
        "rehearse llama-7b-1",
        "active llama-7b-1",
        "stop routing llama-7b-1",
        "survey llama-7b-1",
        "drain llama-7b-1 30 s",
        "drain llama-7b-1 10 s",
        "release llama-7b-1",
    ]
    assert out.succeeded and out.started == [instance_key(new)] and out.woken == []
    assert out.in_place == ["side_by_side, capacity away 0.000 s: fits"]


def test_a_pre_started_successor_that_cannot_sleep_is_stopped_and_cold_started_in_place() -> None:
    """The successor did not fall asleep: it stops, and the step goes as rolling (drained
    for the short deadline, released, cold-started and rehearsed)."""
    running = running_of(PAIR, L40S, L4)
    new = relaunched(L40S)
    world = FakeWorld(awake=("llama-7b-1",))
    choice = choosing(InPlaceChoice(WAKE, 2, "storage"))
    procedure = ShiftProcedure(
        running, [PAIR, new, L4], ShiftParams(), None, None, {}, None, choice
    )
    out = drive(procedure.run(world.now_s), world)
    assert world.log[5:] == [
        "sleep llama-7b-1 level 2",
        "release llama-7b-1",  # the successor that stayed awake
        "hold llama-7b 85",
        "stop routing llama-7b-1",
        "survey llama-7b-1",
        "drain llama-7b-1 2 s",
        "drain llama-7b-1 10 s",
        "release llama-7b-1",
        "launch llama-7b-1",
        "ready llama-7b-1",
        "join llama-7b-1",
        "rehearsing llama-7b-1",
        "rehearse llama-7b-1",
        "active llama-7b-1",
        "hold llama-7b 0",
    ]
    assert out.succeeded and out.woken == [] and out.started == [instance_key(new)]
    # the cold start (12.5 s) and the rehearsal (1 s) in the gap, as rolling
    assert out.in_place == ["cold, capacity away 13.500 s"]


def test_a_pre_started_successor_that_misses_its_rehearsal_leaves_the_old_one_serving() -> None:
    """The rehearsal runs before anything stopped: a miss releases the successor and fails
    the shift; the old instance never stopped taking requests (nothing to roll back)."""
    running = running_of(PAIR, L40S, L4)
    new = relaunched(L40S)
    world = FakeWorld(missed=("llama-7b-1",))
    choice = choosing(InPlaceChoice(WAKE, 1, "host_ram"))
    procedure = ShiftProcedure(
        running, [PAIR, new, L4], ShiftParams(), None, None, {}, None, choice
    )
    out = drive(procedure.run(world.now_s), world)
    assert world.log == [
        "launch llama-7b-1",
        "ready llama-7b-1",
        "join llama-7b-1",
        "rehearsing llama-7b-1",
        "rehearse llama-7b-1",
        "release llama-7b-1",
    ]
    assert not out.succeeded and out.reason == "rehearsal missed: llama-7b-1 slow"
    assert sorted(running) == sorted(map(instance_key, (PAIR, L40S, L4)))
