"""Tables of the store (SQLAlchemy 2 declarative).

`gear_points`: one row per (model, gear, GPU types, link class, batch size) — a point of a
gear's curve, measured by gear_bench or predicted by the performance model, with its
provenance. `calibrations`: the performance model's factor sets per GPU type and link
class, fitted by `flexpipe calibrate`. `instances`: the engines the controllers launched, with
their lifecycle, written and read through `InstanceRegistry` (instance_registry.py). The other
tables live beside the code that owns them: `shift_log` (shift_log.py), `instance_transitions`
(instance_registry.py), `controller_leases`, `gpu_occupations`, `rate_samples` (rate_history.py).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, Float, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class GearPointRow(Base):
    __tablename__ = "gear_points"
    __table_args__ = (
        UniqueConstraint("model", "gear_key", "gpu_types", "link", "batch_size", name="uq_point"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # key
    model: Mapped[str] = mapped_column(String(200), index=True)
    gear_key: Mapped[str] = mapped_column(String(120))  # Gear.key(): tp2-pp1-bf16-kvauto-s256
    gear: Mapped[str] = mapped_column(String(300))  # str(Gear): parseable by parse_gear
    gpu_types: Mapped[str] = mapped_column(String(300))  # "+"-joined, placement order
    link: Mapped[str] = mapped_column(String(60))  # link class of the group ("none" for 1 GPU)
    batch_size: Mapped[int] = mapped_column(Integer)  # concurrency the point was driven at
    # curve values, all in modelled (GPU) time
    prefill_tokens_per_s: Mapped[float] = mapped_column(Float)
    decode_tokens_per_s: Mapped[float] = mapped_column(Float)
    requests_per_s: Mapped[float] = mapped_column(Float)
    ttft_p50_s: Mapped[float] = mapped_column(Float)
    ttft_p90_s: Mapped[float] = mapped_column(Float)
    ttft_p99_s: Mapped[float] = mapped_column(Float)
    tpot_p50_s: Mapped[float] = mapped_column(Float)
    tpot_p90_s: Mapped[float] = mapped_column(Float)
    tpot_p99_s: Mapped[float] = mapped_column(Float)
    e2e_p50_s: Mapped[float] = mapped_column(Float)
    e2e_p90_s: Mapped[float] = mapped_column(Float)
    e2e_p99_s: Mapped[float] = mapped_column(Float)
    peak_kv_usage: Mapped[float | None] = mapped_column(Float, nullable=True)  # fraction 0..1
    cold_start_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    wake_level1_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # sleep mode
    wake_level2_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # provenance
    source: Mapped[str] = mapped_column(String(20))  # "measured" | "predicted"
    engine: Mapped[str] = mapped_column(String(40))  # "sim" | "vllm" | "perf-model"
    engine_version: Mapped[str] = mapped_column(String(80))
    input_len: Mapped[int] = mapped_column(Integer)
    output_len: Mapped[int] = mapped_column(Integer)
    num_requests: Mapped[int] = mapped_column(Integer)
    num_failed: Mapped[int] = mapped_column(Integer, default=0)
    measured_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    note: Mapped[str | None] = mapped_column(Text, nullable=True)


class CalibrationRow(Base):
    """A calibrated factor set of one GPU type or link class (`flexpipe calibrate`), as the
    JSON of `GpuCalibration` / `LinkCalibration`; the newest row of a name wins."""

    __tablename__ = "calibrations"
    __table_args__ = (UniqueConstraint("kind", "name", name="uq_calibration"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(10))  # "gpu" | "link"
    name: Mapped[str] = mapped_column(String(120))  # catalog GPU type or link class
    factors_json: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(Text)  # where the measurements came from
    measured_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class InstanceRow(Base):
    """An engine instance a launcher started (for the controller and the shift log)."""

    __tablename__ = "instances"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    gear: Mapped[str] = mapped_column(String(300))
    gpu_ids: Mapped[str] = mapped_column(String(500))  # ","-joined cluster GPU ids
    endpoint: Mapped[str] = mapped_column(String(300))
    engine: Mapped[str] = mapped_column(String(40))
    state: Mapped[str] = mapped_column(String(20))  # a lifecycle.State value
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    cold_start_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # lifecycle (flexpipe/lifecycle.py; history in instance_transitions)
    state_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the engine's process
    pgid: Mapped[int | None] = mapped_column(Integer, nullable=True)  # its process group
    plan_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # shift_log entry
    gone_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the deployment whose controller owns it (InstanceRegistry(store, deployment)); NULL:
    # written before deployments were recorded, owned by none
    deployment: Mapped[str | None] = mapped_column(String(300), nullable=True)
