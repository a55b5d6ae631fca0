"""The shift log and the instance lifecycle in a real SQLite file; the controller's metrics;
`flexpipe shifts` as a user runs it."""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.cli.shifts import moves_text, parse_since
from flexpipe.cluster import load_cluster
from flexpipe.control.api.controller_metrics import ControllerMetrics
from flexpipe.lifecycle import (
    LIVE_STATES,
    TRANSITIONS,
    LifecycleError,
    State,
    can_transition,
    check_transition,
)
from flexpipe.policies.planner import ModelDemand, Slo
from flexpipe.policies.shift import (
    ModelState,
    Sample,
    ShiftParams,
    ShiftPolicy,
    ShiftRecord,
    ShiftSnapshot,
    default_planner,
    instance_key,
)
from flexpipe.store import Store, StoreError
from flexpipe.store.instance_registry import InstanceRegistry
from flexpipe.store.migrate import SchemaGrowthError, add_missing_columns
from flexpipe.store.schema import Base
from flexpipe.store.shift_entry import (
    After,
    Alternative,
    Migrated,
    Phases,
    PlanInstance,
    PriceTerms,
    RehearsalCheck,
    ShiftEntry,
    SignalValues,
)
from flexpipe.store.shift_log import ShiftLog, ShiftLogError

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
OLD = PlanInstance("llama-7b", "tp1-pp1-bf16-kvauto-s64", (("gpu2",),))
NEW = PlanInstance("llama-7b", "tp2-pp1-bf16-kvauto-s128", (("gpu1", "gpu2"),))
KEEP = PlanInstance("llama-7b", "tp1-pp1-bf16-kvauto-s64", (("gpu0",),))


def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'fp.db'}"


def full_entry(**changes: object) -> ShiftEntry:
    """An entry with every field set (the JSON and SQLite round trips must keep all)."""
    base = ShiftEntry(
        at=T0,
        kind="shift",
        trigger="resource",
        reason="the GPUs free to us changed; replan: score 107.1",
        signals=(SignalValues("llama-7b", 0.1, 0.5, 0.6, "hold", 3, "hold", 7),),
        current=(KEEP, OLD),
        target=(KEEP, NEW),
        score=107.125,
        price=PriceTerms(274.2, 150.0, 0.5, 16.575, 1800.0, 4.0, 4.5, 2, 3, ("in place: a",)),
        alternatives=(
            Alternative("replan", True, "best score", 107.125, (KEEP.key, NEW.key)),
            Alternative("keep", False, "beaten", 0.0, (KEEP.key, OLD.key)),
            Alternative("shrink", False, "below the minimum", None, ()),
        ),
        notes=("started " + NEW.key, "stopped " + OLD.key),
        outcome="succeeded",
        error=None,
        finished_at=T0 + timedelta(seconds=41.5),
        rehearsal=(RehearsalCheck(NEW.key, "tpot_p50_s", 0.02, 0.021, 0.25, True),),
        migrated=Migrated(kv_moved=3, recomputed=2, finished_in_place=11, rerun=1),
        phases=Phases(27.25, 5.0, 0.01, 30.0, 0.75, 0.5),
        after=After(60.0, 7.9, 7.5, 1.2, 0.04, 0),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


# -- entries: JSON round trip, store round trip ---------------------------------------------------


def test_entry_json_round_trip_is_exact() -> None:
    entry = full_entry(id=4)
    text = json.dumps(entry.to_dict())
    assert ShiftEntry.from_dict(json.loads(text)) == entry
    d = json.loads(text)
    assert d["at"] == "2026-12-01T12:00:00+00:00"
    assert d["migrated"] == {"kv_moved": 3, "recomputed": 2, "finished_in_place": 11, "rerun": 1}
    assert d["phases"]["warm_s"] == 27.25 and d["rehearsal_passed"] is True
    assert d["current"][1] == {"model": "llama-7b", "gear": OLD.gear, "stages": [["gpu2"]]}
    hold = ShiftEntry(at=T0, kind="hold", outcome="held")
    assert ShiftEntry.from_dict(json.loads(json.dumps(hold.to_dict()))) == hold


def test_entry_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown shift log kind 'shfit'"):
        ShiftEntry(at=T0, kind="shfit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no zone"):
        ShiftEntry(at=datetime(2026, 12, 1), kind="shift")
    with pytest.raises(ValueError, match="a hold entry's outcome is 'held', not 'pending'"):
        ShiftEntry(at=T0, kind="hold")
    with pytest.raises(ValueError, match="a resources entry's outcome is 'noted'"):
        ShiftEntry(at=T0, kind="resources", outcome="succeeded")
    with pytest.raises(ValueError, match="outcome 'held' is only for hold, resources"):
        ShiftEntry(at=T0, kind="shift", outcome="held")
    with pytest.raises(ValueError, match="phase drain took -1"):
        Phases(drain_s=-1.0)
    # another zone is kept as the same instant in UTC
    cet = datetime(2026, 12, 1, 13, 0, tzinfo=UTC).astimezone(timezone(timedelta(hours=1)))
    assert ShiftEntry(at=cet, kind="plan").at == datetime(2026, 12, 1, 13, 0, tzinfo=UTC)


def test_plan_instance_key_is_the_policys_instance_key() -> None:
    cluster = load_cluster(ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml")
    d = ModelDemand("llama-7b", "llama-2-7b", 8.0, 2048, 256, Slo(2.0, 0.05), ("bf16",))
    for inst in default_planner(cluster, (d,), 0.0).instances:
        p = PlanInstance.from_planned(inst)
        assert p.key == instance_key(inst) and PlanInstance.from_key(p.key) == p
    with pytest.raises(ValueError, match="bad instance key 'x'"):
        PlanInstance.from_key("x")


def test_entries_survive_a_fresh_connection(tmp_path: Path) -> None:
    with Store(url(tmp_path)) as store:
        written = ShiftLog(store).append(full_entry())
        hold = ShiftLog(store).append(ShiftEntry(at=T0, kind="hold", outcome="held"))
    assert (written.id, hold.id) == (1, 2)
    with Store(url(tmp_path)) as store:  # e.g. the controller restarted
        log = ShiftLog(store)
        assert log.get(1) == full_entry(id=1)
        assert log.entries() == [full_entry(id=1), replace(hold, id=2)]
        with pytest.raises(ShiftLogError, match="no shift log entry 9"):
            log.get(9)
        with pytest.raises(ShiftLogError, match="already has id 1"):
            log.append(written)


def test_decision_of_the_real_policy_becomes_an_entry(tmp_path: Path) -> None:
    cluster = load_cluster(ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml")
    d = ModelDemand("llama-7b", "llama-2-7b", 1.5, 2048, 256, Slo(2.0, 0.05), ("bf16", "fp8"))
    running = default_planner(cluster, (d,), 0.0).instances
    up = [Sample(t, 80, 100, 1.9, 0.045, 0.95) for t in (10, 20, 30, 40, 50)]
    snapshot = ShiftSnapshot.of(
        cluster, running, [ModelState(replace(d, request_rate_per_s=8.0), tuple(up))], ()
    )
    policy = ShiftPolicy(ShiftParams())
    decision = policy.decide(snapshot, 50.0, random.Random(7))
    assert decision.action == "shift" and decision.target is not None
    assert decision.price is not None

    entry = ShiftEntry.from_decision(decision, T0, running)
    assert (entry.kind, entry.trigger, entry.outcome) == ("shift", "up", "pending")
    assert entry.reason == decision.reason and entry.score == decision.score
    assert [i.key for i in entry.current] == [instance_key(i) for i in running]
    assert [i.key for i in entry.target or ()] == [instance_key(i) for i in decision.target]
    assert entry.signals[0].model == "llama-7b" and entry.signals[0].run == 5
    assert entry.signals[0].zone == "up" and entry.signals[0].fired == "up"
    assert [a.name for a in entry.alternatives] == [a.name for a in decision.alternatives]
    assert entry.price is not None and entry.price.gain == round(decision.price.gain, 3)
    assert entry.price.num_gpus_target == 4
    with Store(url(tmp_path)) as store:
        stored = ShiftLog(store).append(entry)
        assert ShiftLog(store).get(stored.id or 0) == stored

    held = policy.decide(
        replace(snapshot, models=(replace(snapshot.models[0], samples=tuple(up[:4])),)),
        40.0,
        random.Random(7),
    )
    hold = ShiftEntry.from_decision(held, T0, running)
    assert (hold.kind, hold.outcome, hold.target) == ("hold", "held", None)
    assert ShiftEntry.from_decision(decision, T0, running, kind="emergency").kind == "emergency"


# -- update_outcome: fills in, never rewrites ----------------------------------------------------


def test_update_outcome_fills_in_later_results(tmp_path: Path) -> None:
    with Store(url(tmp_path)) as store:
        log = ShiftLog(store)
        e = log.append(ShiftEntry(at=T0, kind="shift", trigger="up", current=(OLD,), target=(NEW,)))
        assert e.id == 1 and e.outcome == "pending" and e.migrated is None
        log.update_outcome(1, phases=Phases(warm_s=27.0))
        log.update_outcome(1, phases=Phases(warm_s=27.0, rehearse_s=5.0))  # replay: no-op
        check = RehearsalCheck(NEW.key, "tpot_p50_s", 0.02, 0.0205, 0.25, True)
        log.update_outcome(1, rehearsal=(check,))
        done = log.update_outcome(
            1,
            outcome="succeeded",
            at=T0 + timedelta(seconds=70),
            phases=Phases(switch_s=0.02, drain_s=30.0, migrate_s=0.4, release_s=0.6),
            migrated=Migrated(kv_moved=2, recomputed=1),
        )
        assert done.finished_at == T0 + timedelta(seconds=70)
        assert done.phases == Phases(27.0, 5.0, 0.02, 30.0, 0.4, 0.6)
        assert done.rehearsal_passed is True
        log.update_outcome(1, after=After(60.0, 8.0, 7.9, 1.1, 0.04, 0))
    with Store(url(tmp_path)) as store:
        got = ShiftLog(store).get(1)
    assert got.outcome == "succeeded" and got.migrated == Migrated(2, 1, 0, 0)
    assert got.after == After(60.0, 8.0, 7.9, 1.1, 0.04, 0)
    assert got.phases.total_s == pytest.approx(63.02)


def test_update_outcome_refuses_to_rewrite_a_fact(tmp_path: Path) -> None:
    with Store(url(tmp_path)) as store:
        log = ShiftLog(store)
        log.append(ShiftEntry(at=T0, kind="shift"))
        log.append(ShiftEntry(at=T0, kind="hold", outcome="held"))
        log.update_outcome(1, outcome="rolled_back", error="rehearsal missed", at=T0)
        with pytest.raises(ShiftLogError, match="outcome is already 'rolled_back', not 'succ"):
            log.update_outcome(1, outcome="succeeded")
        log.update_outcome(1, outcome="rolled_back")  # the same again: fine
        with pytest.raises(ShiftLogError, match="error is already 'rehearsal missed'"):
            log.update_outcome(1, error="other")
        log.update_outcome(1, phases=Phases(warm_s=20.0))
        with pytest.raises(ShiftLogError, match=r"phase warm is already 20\.0, not 21\.0"):
            log.update_outcome(1, phases=Phases(warm_s=21.0))
        log.update_outcome(1, migrated=Migrated(rerun=1))
        with pytest.raises(ShiftLogError, match="migrated is already"):
            log.update_outcome(1, migrated=Migrated(rerun=2))
        with pytest.raises(ShiftLogError, match="outcome is already 'held'"):
            log.update_outcome(2, outcome="succeeded")
        with pytest.raises(ShiftLogError, match="'pending' is not a final outcome"):
            log.update_outcome(2, outcome="pending")
        with pytest.raises(ShiftLogError, match="no shift log entry 3"):
            log.update_outcome(3, outcome="failed")
        assert log.get(1).finished_at == T0  # the first final outcome's time stays


# -- queries -------------------------------------------------------------------------------------


def test_query_by_time_range_and_kind(tmp_path: Path) -> None:
    kinds = ["plan", "hold", "hold", "shift", "rollback", "hold", "reclaim", "emergency"]
    with Store(url(tmp_path)) as store:
        log = ShiftLog(store)
        for n, kind in enumerate(kinds):
            outcome = "held" if kind == "hold" else "pending"
            log.append(ShiftEntry(at=T0 + timedelta(minutes=n), kind=kind, outcome=outcome))  # type: ignore[arg-type]
        at = [e.at for e in log.entries()]
        assert at == [T0 + timedelta(minutes=n) for n in range(8)]
        window = log.entries(since=T0 + timedelta(minutes=2), until=T0 + timedelta(minutes=5))
        assert [e.id for e in window] == [3, 4, 5]
        assert [e.id for e in log.entries(kinds=["hold"])] == [2, 3, 6]
        assert [e.id for e in log.entries(kinds=["hold", "shift"], limit=2)] == [4, 6]
        assert log.count(kinds=["hold"]) == 3 and log.count(since=T0 + timedelta(minutes=7)) == 1
        # a since in another zone is the same instant
        plus1 = T0.astimezone(timezone(timedelta(hours=1)))
        assert [e.id for e in log.entries(since=plus1 + timedelta(minutes=6))] == [7, 8]
        with pytest.raises(ShiftLogError, match="unknown shift log kind shfit"):
            log.entries(kinds=["shfit"])
        assert [e.id for e in log.pending()] == [1, 4, 5, 7, 8]


def test_history_rebuilds_the_policys_shift_records(tmp_path: Path) -> None:
    with Store(url(tmp_path)) as store:
        log = ShiftLog(store)
        log.append(ShiftEntry(at=T0, kind="shift", current=(KEEP, OLD), target=(KEEP, NEW)))
        log.append(ShiftEntry(at=T0, kind="hold", outcome="held"))
        log.append(ShiftEntry(at=T0, kind="plan", target=(KEEP,)))  # not the policy's
        later = T0 + timedelta(minutes=10)
        log.append(ShiftEntry(at=later, kind="reclaim", current=(KEEP,), target=()))
        log.update_outcome(1, outcome="rolled_back", at=T0 + timedelta(seconds=40))
        log.append(ShiftEntry(at=later, kind="shift", current=(KEEP, OLD), target=(KEEP, NEW)))
        log.update_outcome(5, outcome="refused", at=later + timedelta(seconds=1))
        history = log.history()
    assert history == (
        ShiftRecord(T0.timestamp(), T0.timestamp() + 40, False, (NEW.key,)),
        ShiftRecord(later.timestamp(), None, None, ()),
        ShiftRecord(later.timestamp(), later.timestamp() + 1, False, (NEW.key,), refused=True),
    )
    assert [r.failed for r in history] == [True, False, False]


# -- the schema grows in place ----------------------------------------------------------------


def test_a_store_from_before_the_lifecycle_columns_opens_and_grows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # `instances` as flexpipe wrote it before this change
        db.execute(
            "CREATE TABLE instances (id INTEGER PRIMARY KEY, name VARCHAR(200), model "
            "VARCHAR(200), gear VARCHAR(300), gpu_ids VARCHAR(500), endpoint VARCHAR(300), "
            "engine VARCHAR(40), state VARCHAR(20), started_at DATETIME, stopped_at DATETIME, "
            "cold_start_s FLOAT)"
        )
        db.execute(
            "INSERT INTO instances VALUES (1, 'llama-7b-0', 'llama-2-7b', 'tp=1', 'gpu0', "
            "'http://127.0.0.1:9001', 'sim', 'active', '2026-11-30 10:00:00.000000', NULL, 2.5)"
        )
    with Store(f"sqlite:///{path}") as store:
        (rec,) = InstanceRegistry(store).live_instances()
        assert (rec.id, rec.state, rec.pid, rec.plan_id) == (1, State.ACTIVE, None, None)
        assert rec.state_at == rec.started_at == datetime(2026, 11, 30, 10, tzinfo=UTC)
        assert rec.gone_reason is None
    with sqlite3.connect(path) as db:
        columns = [r[1] for r in db.execute("PRAGMA table_info(instances)")]
    assert columns[-6:] == ["state_at", "pid", "pgid", "plan_id", "gone_reason", "deployment"]
    with Store(f"sqlite:///{path}") as store:  # opening again adds nothing
        assert add_missing_columns(store.engine, Base.metadata.sorted_tables) == []


def test_a_missing_not_null_column_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE shift_log (id INTEGER PRIMARY KEY, at DATETIME)")
    with pytest.raises(SchemaGrowthError, match="shift_log lacks column kind, which is NOT NULL"):
        Store(f"sqlite:///{path}")


# -- lifecycle --------------------------------------------------------------------------------


def test_lifecycle_transition_table() -> None:
    legal = {(a.value, b.value) for a in State for b in State if can_transition(a, b)}
    assert legal == {
        ("starting", "rehearsing"),
        ("starting", "active"),
        ("starting", "asleep"),
        ("starting", "gone"),
        ("rehearsing", "active"),
        ("rehearsing", "draining"),
        ("rehearsing", "asleep"),
        ("rehearsing", "gone"),
        ("active", "draining"),
        ("active", "asleep"),
        ("active", "gone"),
        ("draining", "active"),
        ("draining", "asleep"),
        ("draining", "gone"),
        ("asleep", "waking"),
        ("asleep", "gone"),
        ("waking", "active"),
        ("waking", "gone"),
    }
    assert set(TRANSITIONS) == set(State)
    assert {
        State.STARTING,
        State.REHEARSING,
        State.ACTIVE,
        State.DRAINING,
        State.ASLEEP,
        State.WAKING,
    } == LIVE_STATES
    assert check_transition("active", "draining") is State.DRAINING
    with pytest.raises(
        LifecycleError,
        match="illegal transition active → rehearsing: from active only to asleep, draining, gone",
    ):
        check_transition("active", "rehearsing")
    with pytest.raises(LifecycleError, match="already active"):
        check_transition("active", "active")
    with pytest.raises(LifecycleError, match="gone → active: gone is final"):
        check_transition("gone", "active")
    # an asleep engine wakes before it serves: never straight back to active
    with pytest.raises(LifecycleError, match="asleep → active: from asleep only to gone, waking"):
        check_transition("asleep", "active")
    with pytest.raises(LifecycleError, match="unknown instance state 'removed': expected one"):
        check_transition("active", "removed")


def test_instance_lifecycle_persisted_with_its_history(tmp_path: Path) -> None:
    t = [T0 + timedelta(seconds=s) for s in range(6)]
    with Store(url(tmp_path)) as store:
        reg = InstanceRegistry(store)
        a = reg.register(
            "llama-7b-0",
            "llama-2-7b",
            NEW.gear,
            ("gpu1", "gpu2"),
            "http://127.0.0.1:9001",
            "sim",
            plan_id=7,
            at=t[0],
        )
        assert (a.id, a.state, a.gpu_ids, a.plan_id) == (1, State.STARTING, ("gpu1", "gpu2"), 7)
        reg.set_process(a.id, pid=4242, pgid=4242, cold_start_s=2.5)
        reg.transition(a.id, "rehearsing", at=t[1])
        reg.transition(a.id, State.ACTIVE, at=t[2], reason="rehearsal passed")
        with pytest.raises(
            LifecycleError,
            match=r"instance 1 \(llama-7b-0\): illegal transition "
            "active → starting",
        ):
            reg.transition(a.id, "starting", at=t[3])
        reg.transition(a.id, "draining", at=t[3], reason="shift 8")
        b = reg.register(
            "llama-7b-1", "llama-2-7b", OLD.gear, ("gpu0",), "http://127.0.0.1:9002", "sim", at=t[3]
        )
        gone = reg.mark_gone(a.id, "drained", at=t[4])
        assert (gone.state, gone.stopped_at, gone.gone_reason) == (State.GONE, t[4], "drained")
        with pytest.raises(LifecycleError, match="gone is final"):
            reg.mark_gone(a.id, "again")
        with pytest.raises(StoreError, match="no instance 99"):
            reg.transition(99, "active")
    with Store(url(tmp_path)) as store:  # a fresh connection sees the same
        reg = InstanceRegistry(store)
        got = reg.get(1)
        assert (got.pid, got.pgid, got.cold_start_s, got.state_at) == (4242, 4242, 2.5, t[4])
        steps = [(h.from_state, h.to_state, h.at, h.reason) for h in reg.history(1)]
        assert steps == [
            (None, State.STARTING, t[0], None),
            (State.STARTING, State.REHEARSING, t[1], None),
            (State.REHEARSING, State.ACTIVE, t[2], "rehearsal passed"),
            (State.ACTIVE, State.DRAINING, t[3], "shift 8"),
            (State.DRAINING, State.GONE, t[4], "drained"),
        ]
        assert [r.id for r in reg.live_instances()] == [b.id]
        assert [r.id for r in reg.instances([State.GONE])] == [1]


def test_a_restarted_controller_adopts_reachable_instances(tmp_path: Path) -> None:
    with Store(url(tmp_path)) as store:
        reg = InstanceRegistry(store)
        ids = []
        for n, model in enumerate(["a", "a", "b", "b"]):
            rec = reg.register(
                f"{model}-{n}", model, "tp1", (f"gpu{n}",), f"http://h:{n}", "sim", at=T0
            )
            ids.append(rec.id)
        reg.transition(ids[0], "active", at=T0)
        reg.transition(ids[1], "active", at=T0)
        reg.transition(ids[2], "gone", reason="failed to start", at=T0)
    # the controller is killed here; its successor opens the same store
    with Store(url(tmp_path)) as store:
        reg = InstanceRegistry(store)
        assert [r.id for r in reg.live_instances()] == [1, 2, 4]
        assert [r.id for r in reg.live_instances(model="a")] == [1, 2]
        later = T0 + timedelta(minutes=1)
        adopted, gone = reg.reconcile({1, 4}, "unreachable after controller restart", at=later)
        assert [r.id for r in adopted] == [1, 4] and [r.id for r in gone] == [2]
        assert reg.get(2).gone_reason == "unreachable after controller restart"
        assert reg.get(3).gone_reason == "failed to start"
        assert [r.id for r in reg.live_instances()] == [1, 4]


# -- metrics -------------------------------------------------------------------------------------


def samples(metrics: ControllerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_controller_metrics_exposition() -> None:
    m = ControllerMetrics()
    m.observe_decision(ShiftEntry(at=T0, kind="hold", outcome="held"))
    m.observe_decision(full_entry())
    m.observe_finished(full_entry())
    m.observe_finished(
        full_entry(
            kind="reclaim",
            trigger="reclaim",
            outcome="failed",
            migrated=Migrated(rerun=2),
            phases=Phases(warm_s=0.3),
        )
    )
    with pytest.raises(ValueError, match="not a finished change"):
        m.observe_finished(full_entry(outcome="pending"))
    m.set_instances(
        [
            ("llama-7b", State.ACTIVE),
            ("llama-7b", State.ACTIVE),
            ("llama-7b", State.GONE),
            ("mistral", State.STARTING),
        ]
    )
    got = samples(m)
    assert got["flexpipe_controller_decisions_total", (("decision", "hold"),)] == 1
    assert got["flexpipe_controller_decisions_total", (("decision", "shift"),)] == 1
    key = (("kind", "shift"), ("outcome", "succeeded"), ("trigger", "resource"))
    assert got["flexpipe_shifts_total", key] == 1
    key = (("kind", "reclaim"), ("outcome", "failed"), ("trigger", "reclaim"))
    assert got["flexpipe_shifts_total", key] == 1
    assert got["flexpipe_requests_migrated_total", (("method", "kv_moved"),)] == 3
    assert got["flexpipe_requests_migrated_total", (("method", "rerun"),)] == 3
    assert got["flexpipe_requests_migrated_total", (("method", "finished_in_place"),)] == 11
    assert got["flexpipe_shift_phase_seconds_count", (("phase", "warm"),)] == 2
    assert got["flexpipe_shift_phase_seconds_sum", (("phase", "warm"),)] == pytest.approx(27.55)
    assert got["flexpipe_shift_phase_seconds_bucket", (("le", "0.5"), ("phase", "warm"))] == 1
    assert got["flexpipe_shift_phase_seconds_count", (("phase", "drain"),)] == 1
    assert got["flexpipe_instances", (("model", "llama-7b"), ("state", "active"))] == 2
    assert got["flexpipe_instances", (("model", "llama-7b"), ("state", "draining"))] == 0
    assert got["flexpipe_instances", (("model", "mistral"), ("state", "starting"))] == 1
    assert not any(
        name == "flexpipe_instances" and ("state", "gone") in labels for name, labels in got
    )
    m.set_instances([("mistral", State.ACTIVE)])  # llama-7b gone entirely: its series go
    assert not any(("model", "llama-7b") in labels for _, labels in samples(m))


def test_metric_names_follow_prometheus_conventions() -> None:
    text = ControllerMetrics().render().decode()
    # prometheus_client's `_created` timestamps (a gauge family each) are not ours to name
    families = {
        f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")
    }
    assert {n: f.type for n, f in families.items()} == {
        "flexpipe_controller_decisions": "counter",
        "flexpipe_shifts": "counter",
        "flexpipe_shift_phase_seconds": "histogram",
        "flexpipe_requests_migrated": "counter",
        "flexpipe_instances": "gauge",
        "flexpipe_slo_seconds": "gauge",
        "flexpipe_gpu_instance": "gauge",
    }
    for name, f in families.items():
        assert name.startswith("flexpipe_") and name == name.lower()
        assert f.documentation
        for s in f.samples:  # counters expose _total; nothing else does
            assert s.name.endswith("_total") == (
                f.type == "counter" and not s.name.endswith("_created")
            )


# -- flexpipe shifts ---------------------------------------------------------------------------


runner = CliRunner()


def test_parse_since() -> None:
    now = T0
    assert parse_since("10m", now) == T0 - timedelta(minutes=10)
    assert parse_since("1.5h", now) == T0 - timedelta(minutes=90)
    assert parse_since("30s", now) == T0 - timedelta(seconds=30)
    assert parse_since("2d", now) == T0 - timedelta(days=2)
    assert parse_since("2026-12-01T11:00:00", now) == datetime(2026, 12, 1, 11, tzinfo=UTC)
    assert parse_since("2026-12-01T12:30:00+01:00", now) == datetime(
        2026, 12, 1, 11, 30, tzinfo=UTC
    )
    for bad in ("10x", "yesterday", "-5m", ""):
        with pytest.raises(ValueError, match="bad --since"):
            parse_since(bad, now)


def test_moves_text_names_what_stops_and_what_starts() -> None:
    assert moves_text(full_entry()) == "llama-7b tp1-pp1@gpu2 → llama-7b tp2-pp1@gpu1+gpu2"
    assert moves_text(full_entry(current=(), target=(KEEP,))) == "∅ → llama-7b tp1-pp1@gpu0"
    assert moves_text(ShiftEntry(at=T0, kind="hold", outcome="held")) == "—"


def test_shifts_command_table_and_json(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    with Store(url(tmp_path)) as store:
        log = ShiftLog(store)
        log.append(full_entry(at=now - timedelta(hours=2), kind="plan", trigger="none"))
        log.append(full_entry(at=now - timedelta(minutes=5)))
        log.append(
            ShiftEntry(
                at=now - timedelta(minutes=1),
                kind="hold",
                outcome="held",
                reason="no trigger (llama-7b up x4; 5 in a row needed)",
            )
        )
    result = runner.invoke(
        app, ["shifts", "--store", url(tmp_path), "--since", "10m"], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "2 of 2 entries" in out and "│ plan " not in out
    rows = [line for line in out.splitlines() if line.startswith("│  ")]
    shift_row = [c.strip() for c in rows[0].split("│")[1:-1]]
    assert shift_row[0] == "2" and shift_row[2:4] == ["shift", "resource"]
    assert shift_row[4] == "llama-7b tp1-pp1@gpu2 → llama-7b tp2-pp1@gpu1+gpu2"
    assert shift_row[5:10] == [
        "107.1",
        "27.2/5.0/0.0/30.0/0.8/0.5/-/-",
        "3/2/11/1",
        "ok",
        "succeeded",
    ]
    hold_row = [c.strip() for c in rows[1].split("│")[1:-1]]
    assert hold_row[2:] == [
        "hold",
        "none",
        "—",
        "",
        "",
        "",
        "",
        "held",
        "no trigger (llama-7b up x4; 5 in a row needed)",
    ]

    result = runner.invoke(app, ["shifts", "--store", url(tmp_path), "--json", "--kind", "plan"])
    assert result.exit_code == 0, result.output
    (doc,) = json.loads(result.output)
    assert ShiftEntry.from_dict(doc) == full_entry(
        id=1, at=now - timedelta(hours=2), kind="plan", trigger="none"
    )
    result = runner.invoke(app, ["shifts", "--store", url(tmp_path), "--limit", "1"])
    assert "1 of 3 entries" in result.output and "--limit 0 shows all" in result.output
    result = runner.invoke(app, ["shifts", "--store", url(tmp_path), "--since", "1s"])
    assert result.exit_code == 0 and "no shift log entries since" in result.output


def test_shifts_command_shows_one_deployment_unless_all(tmp_path: Path) -> None:
    """The store is shared (other ports, tests, earlier runs): `flexpipe shifts` shows the
    entries of the deployment that wrote the newest one, --deployment another's, --all every
    deployment's with a column saying whose."""
    now = datetime.now(UTC)
    with Store(url(tmp_path)) as store:
        old, new = ShiftLog(store, "http://127.0.0.1:18000"), ShiftLog(store, "http://b:8000")
        old.append(full_entry(at=now - timedelta(hours=3), kind="plan", trigger="none"))
        old.append(full_entry(at=now - timedelta(hours=2), trigger="up"))
        new.append(full_entry(at=now - timedelta(minutes=2), kind="plan", trigger="none"))
    env = {"COLUMNS": "250"}
    res = runner.invoke(app, ["shifts", "--store", url(tmp_path)], env=env)
    assert res.exit_code == 0, res.output
    assert "shift log of http://b:8000: 1 of 1 entries" in res.output
    assert "(2 entries of other deployments; --all shows them)" in res.output
    assert "┃ deployment" not in res.output  # one deployment: no column saying whose
    res = runner.invoke(app, ["shifts", "--store", url(tmp_path), "--json"])
    assert [(e["id"], e["deployment"]) for e in json.loads(res.output)] == [(3, "http://b:8000")]
    res = runner.invoke(app, ["shifts", "--store", url(tmp_path), "--all", "--json"])
    assert [e["deployment"] for e in json.loads(res.output)] == [
        "http://127.0.0.1:18000", "http://127.0.0.1:18000", "http://b:8000"]  # fmt: skip
    res = runner.invoke(app, ["shifts", "--store", url(tmp_path), "--all"], env=env)
    assert "3 of 3 entries" in res.output and "other deployments" not in res.output
    assert "┃ deployment " in res.output and "│ http://127.0.0.1:18000 │" in res.output
    res = runner.invoke(
        app, ["shifts", "--store", url(tmp_path), "--deployment", "http://127.0.0.1:18000"],
        env=env,
    )  # fmt: skip
    assert "of http://127.0.0.1:18000: 2 of 2 entries" in res.output
    assert "(1 entries of other deployments" in res.output
    res = runner.invoke(app, ["shifts", "--store", url(tmp_path), "--all", "--deployment", "x"])
    assert res.exit_code == 2 and "not both" in res.output


def test_shifts_command_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    Store(url(tmp_path)).close()  # the store the bad arguments are read against
    blocker = tmp_path / "file"
    blocker.write_text("")
    garbage = tmp_path / "garbage.db"
    garbage.write_text("not a database, but long enough to be read as a header " * 4)
    for args, message in (
        (["--since", "10x"], "bad --since '10x'"),
        (["--kind", "shfit"], "unknown shift log kind shfit"),
        (["--limit", "-1"], "bad --limit -1"),
        (["--store", "nonsense://"], "cannot open store nonsense://"),
        (["--store", f"sqlite:///{blocker}/sub/fp.db"], "cannot open store"),
        (["--store", f"sqlite:///{tmp_path}"], "cannot open store"),  # a folder, not a file
        (["--store", f"sqlite:///{garbage}"], "file is not a database"),
        (["--store", f"sqlite:///{tmp_path}/no/dir/x.db"], "no such file (a read creates none)"),
    ):
        if "--store" not in args:
            args = [*args, "--store", url(tmp_path)]
        result = runner.invoke(app, ["shifts", *args])
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
        assert "Traceback" not in result.output
    assert not (tmp_path / "no").exists()  # a read-only command made no folder and no store


def test_public_api() -> None:
    import flexpipe.control.api.controller_metrics as metrics
    import flexpipe.lifecycle as lifecycle
    import flexpipe.store.instance_registry as registry
    import flexpipe.store.migrate as migrate
    import flexpipe.store.shift_entry as shift_entry
    import flexpipe.store.shift_log as shift_log

    for module in (lifecycle, metrics, registry, migrate, shift_entry, shift_log):
        assert all(hasattr(module, name) for name in module.__all__), module.__name__
    assert set(shift_log.__all__) == {"SHIFT_KINDS", "ShiftLog", "ShiftLogError", "ShiftLogRow"}
    assert set(registry.__all__) == {
        "InstanceRecord",
        "InstanceRegistry",
        "Transition",
        "TransitionRow",
    }


def test_from_what_the_controller_measures() -> None:
    """Adapters from the controller's own records: phase seconds (an in-place second round
    adds to its phase), the gateway's move results, a rehearsal probe."""
    phases = Phases.from_seconds(
        {"warm": 2.0, "rehearse": 0.5, "switch": 0.01, "drain": 3.0, "migrate": 0.2,
         "release": 0.3, "warm_in_place": 4.0, "switch_in_place": 0.02}
    )  # fmt: skip
    assert phases == Phases(6.0, 0.5, 0.03, 3.0, 0.2, 0.3)
    with pytest.raises(ValueError, match="unknown shift phase 'warmup'"):
        Phases.from_seconds({"warmup": 1.0})
    migrated = Migrated.from_counts({"kv": 3, "recompute": 2, "rerun": 1, "finished_in_place": 4})
    assert migrated == Migrated(kv_moved=3, recomputed=2, finished_in_place=4, rerun=1)
    with pytest.raises(ValueError, match="unknown migration method 'teleport'"):
        Migrated.from_counts({"teleport": 1})
    probe = {"instance": NEW.key, "passed": False, "why": "probe took 0.9 s against 0.3 s",
             "predicted_s": 0.3, "measured_s": 0.9, "ratio": 3.0}  # fmt: skip
    check = RehearsalCheck.from_probe(probe, tolerance=2.0)
    assert check == RehearsalCheck(NEW.key, "probe_s", 0.3, 0.9, 2.0, False,
                                   "probe took 0.9 s against 0.3 s")  # fmt: skip
    assert check.ratio == pytest.approx(3.0)
    failed = RehearsalCheck.from_probe({"instance": NEW.key, "passed": False, "why": "503"}, 2.0)
    assert (failed.predicted, failed.measured, failed.ratio) == (None, None, None)
    entry = ShiftEntry(at=T0, kind="rollback", outcome="rolled_back", rehearsal=(failed,))
    assert ShiftEntry.from_dict(json.loads(json.dumps(entry.to_dict()))) == entry
    assert entry.rehearsal_passed is False


def test_resource_changes_are_noted_between_decisions(tmp_path: Path) -> None:
    with Store(url(tmp_path)) as store:
        log = ShiftLog(store)
        e = log.append(ShiftEntry(at=T0, kind="resources", outcome="noted",
                                  reason="gpu1: the other tenant left",
                                  notes=("gpu1 free 80 GiB",)))  # fmt: skip
        assert log.get(e.id or 0) == e and log.pending() == []
        with pytest.raises(ShiftLogError, match="outcome is already 'noted'"):
            log.update_outcome(e.id or 0, outcome="succeeded")
        shift = log.append(ShiftEntry(at=T0, kind="shift"))
        with pytest.raises(ShiftLogError, match="'noted' is not a final outcome of a change"):
            log.update_outcome(shift.id or 0, outcome="noted")
