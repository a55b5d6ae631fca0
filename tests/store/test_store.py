"""The store: a real SQLite file; points round-trip, replace on the same key, filter."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import inspect

from flexpipe.gears import MEASURED, GearPoint
from flexpipe.store import Store, StoreError
from flexpipe.store.instance_registry import InstanceRegistry
from flexpipe.store.shift_log import ShiftLog


def make_point(batch_size: int = 1, **changes: object) -> GearPoint:
    base = GearPoint(
        model="llama-2-7b",
        gear_key="tp1-pp1-bf16-kvauto-s256",
        gear="tp=1,pp=1,dtype=bf16,kv_cache_dtype=auto,max_num_seqs=256",
        gpu_types="A100-80G-SXM",
        link="none",
        batch_size=batch_size,
        prefill_tokens_per_s=10000.0 / batch_size,
        decode_tokens_per_s=100.0 * batch_size,
        requests_per_s=0.5 * batch_size,
        ttft_p50_s=0.05 * batch_size,
        ttft_p90_s=0.06 * batch_size,
        ttft_p99_s=0.07 * batch_size,
        tpot_p50_s=0.010 + 0.001 * batch_size,
        tpot_p90_s=0.011 + 0.001 * batch_size,
        tpot_p99_s=0.012 + 0.001 * batch_size,
        e2e_p50_s=1.0 + 0.1 * batch_size,
        e2e_p90_s=1.1 + 0.1 * batch_size,
        e2e_p99_s=1.2 + 0.1 * batch_size,
        peak_kv_usage=0.01 * batch_size,
        cold_start_s=27.0,
        source=MEASURED,
        engine="sim",
        engine_version="0.1.0",
        input_len=512,
        output_len=128,
        num_requests=200,
        measured_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_points_round_trip_through_a_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sub' / 'fp.db'}"
    points = [make_point(b) for b in (1, 4, 16)]
    with Store(url) as store:
        assert store.put_points(points) == 3
    assert (tmp_path / "sub" / "fp.db").is_file()
    with Store(url) as store:  # a fresh connection reads what the first wrote
        assert store.points() == points


def test_same_key_and_batch_replaces_the_old_point(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        store.put_points([make_point(4), make_point(8)])
        newer = make_point(4, decode_tokens_per_s=999.0, engine="vllm")
        store.put_points([newer])
        got = store.points()
        assert [p.batch_size for p in got] == [4, 8]
        assert got[0] == newer


def test_filters_and_curves(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:
        store.put_points(
            [
                make_point(1),
                make_point(2),
                make_point(1, gear_key="tp2-pp1-bf16-kvauto-s256", link="nvlink3"),
                make_point(1, model="mistral-7b"),
            ]
        )
        assert len(store.points(model="llama-2-7b")) == 3
        assert len(store.points(link="nvlink3")) == 1
        curves = store.curves("llama-2-7b")
        assert sorted(len(c) for c in curves.values()) == [1, 2]
        assert store.delete_points(model="mistral-7b") == 1
        assert store.points(model="mistral-7b") == []


def test_the_store_has_one_shift_log(tmp_path: Path) -> None:
    """Instances and shifts are written through InstanceRegistry and ShiftLog only: opening a
    store makes no second, free-form `shifts` table beside `shift_log`."""
    url = f"sqlite:///{tmp_path / 'fp.db'}"
    with Store(url) as store:
        ShiftLog(store)
        InstanceRegistry(store)
        tables = set(inspect(store.engine).get_table_names())
    assert "shifts" not in tables
    assert {"shift_log", "instances", "instance_transitions"} <= tables


def test_env_var_selects_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXPIPE_STORE", f"sqlite:///{tmp_path / 'env.db'}")
    with Store() as store:
        store.put_points([make_point(1)])
    assert (tmp_path / "env.db").is_file()


def test_bad_url_is_one_clear_error() -> None:
    with pytest.raises(StoreError, match="not a database URL"):
        Store("no such thing")
    with pytest.raises(StoreError, match="cannot open store"):
        Store("nosuchdialect://x/y")
