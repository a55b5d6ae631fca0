"""`GearPoint`: one point of a gear's curve (one batch size), measured or predicted.

Plain data, shared by the store, the table and its lookup, export/import and gear_bench. Times are
modelled GPU seconds (gear_bench converts a sim engine's scaled wall time back).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

MEASURED = "measured"
PREDICTED = "predicted"


@dataclass(frozen=True, slots=True)
class GearKey:
    """What a curve is keyed by: model, gear, GPU type(s) in placement order, link class."""

    model: str
    gear_key: str
    gpu_types: str  # "+"-joined: "A100-80G-SXM" or "A100-80G-SXM+L40S"
    link: str  # catalog link name of the group's slowest link, NO_LINK for one GPU

    @property
    def family(self) -> tuple[str, str, str, str]:
        """The key without the gear's batch cap (Gear.family_key): points of one family are
        one curve over concurrency, whatever max_num_seqs the engine ran with."""
        return (self.model, family_key(self.gear_key), self.gpu_types, self.link)

    def __str__(self) -> str:
        return f"{self.model} {self.gear_key} on {self.gpu_types} ({self.link})"


def family_key(gear_key: str) -> str:
    """`tp2-pp1-bf16-kvauto-s256` -> `tp2-pp1-bf16-kvauto` (Gear.family_key of a stored key)."""
    head, sep, tail = gear_key.rpartition("-s")
    return head if sep and tail.isdigit() else gear_key


@dataclass(frozen=True, slots=True)
class GearPoint:
    model: str
    gear_key: str
    gear: str  # str(Gear), parseable by flexpipe.gears.gear.parse_gear
    gpu_types: str
    link: str
    batch_size: int
    prefill_tokens_per_s: float  # one request's prompt tokens / its TTFT, mean (see docs)
    decode_tokens_per_s: float  # output tokens of the whole instance per second
    requests_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    e2e_p90_s: float
    e2e_p99_s: float
    peak_kv_usage: float | None  # fraction of the KV cache, 0..1
    cold_start_s: float | None
    source: str  # MEASURED | PREDICTED
    engine: str  # "sim", "vllm", "perf-model"
    engine_version: str
    input_len: int
    output_len: int
    num_requests: int
    num_failed: int = 0
    measured_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    note: str | None = None
    # the engine's wake-ups from vLLM's sleep mode, measured next to its cold start (level 1:
    # weights back from host RAM; level 2: from the engine's weight source); None: not
    # measured (the engine was not started able to sleep)
    wake_level1_s: float | None = None
    wake_level2_s: float | None = None

    @property
    def key(self) -> GearKey:
        return GearKey(self.model, self.gear_key, self.gpu_types, self.link)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["measured_at"] = self.measured_at.isoformat()
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "row") -> GearPoint:
        """From a JSON object or a CSV row (strings); a missing or bad field names itself."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = f.name
            value = raw.get(name)
            if value is None or value == "":
                if name in _OPTIONAL:
                    values[name] = _OPTIONAL[name]
                    continue
                raise ValueError(f"{where}: missing field {name!r}")
            try:
                values[name] = _convert(name, value)
            except (TypeError, ValueError):
                raise ValueError(f"{where}: field {name!r} has a bad value {value!r}") from None
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
        if values["source"] not in (MEASURED, PREDICTED):
            raise ValueError(f"{where}: source must be {MEASURED!r} or {PREDICTED!r}")
        if values["batch_size"] < 1:
            raise ValueError(f"{where}: batch_size must be >= 1")
        return cls(**values)


_INT_FIELDS = {"batch_size", "input_len", "output_len", "num_requests", "num_failed"}
_STR_FIELDS = {"model", "gear_key", "gear", "gpu_types", "link", "source", "engine"}
_STR_FIELDS |= {"engine_version", "note"}
_OPTIONAL: dict[str, Any] = {"peak_kv_usage": None, "cold_start_s": None, "note": None}
_OPTIONAL |= {"num_failed": 0, "wake_level1_s": None, "wake_level2_s": None}


def _convert(name: str, value: Any) -> Any:
    if name in _INT_FIELDS:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(name)
        return int(value)
    if name in _STR_FIELDS:
        return str(value)
    if name == "measured_at":
        stamp = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
        return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)
    number = float(value)
    if number != number or number < 0:  # NaN or negative
        raise ValueError(name)
    return number


POINT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GearPoint))
