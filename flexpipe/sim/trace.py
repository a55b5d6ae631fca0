"""Trace replay: the Azure LLM inference trace (2023) and the Mooncake trace (FAST'25).

- Azure: CSV `TIMESTAMP,ContextTokens,GeneratedTokens`, TIMESTAMP like
  `2023-11-16 18:15:46.6805900`; rows are replayed in time order (stable), in seconds from
  the earliest row (across days and months: the full date counts).
- Mooncake: JSONL `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`;
  each hash id is a 512-token block, shared leading ids are a shared prefix (so at most
  ceil(input_length / 512) ids, each in [0, 2^30)); replayed in time order.

`speedup` compresses time (2: twice the rate), `offset_s` shifts the replay. Rows with no
prompt or no output are skipped (a completion of 0 tokens is not a request we can time); a
malformed row (negative counts, a bad timestamp) is an error naming its line, and so is a
trace with no request left.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from flexpipe.sim.request import PREFIX_BLOCK_TOKENS
from flexpipe.sim.workload import Arrival, WorkloadError

TRACE_KINDS = ("azure", "mooncake")
MAX_HASH_ID = (1 << 30) - 1  # synthetic shared prefixes use ids from 1 << 30 (workload.py)
_STAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")


def _stamp_ns(stamp: str) -> int:
    """Nanoseconds since 0001-01-01 of a TIMESTAMP `YYYY-MM-DD hh:mm:ss[.fffffff]` (the
    Azure trace's, 7 fractional digits), exact; ValueError when it is not one."""
    m = _STAMP.fullmatch(stamp.strip())
    if m is None:
        raise ValueError(f"TIMESTAMP {stamp.strip()!r} is not YYYY-MM-DD hh:mm:ss.fffffff")
    y, mo, d, hh, mm, ss = (int(g) for g in m.groups()[:6])
    day = datetime(y, mo, d, hh, mm, ss).date().toordinal()  # ValueError: no such date
    frac = (m.group(7) or "").ljust(9, "0")
    return ((day * 86_400 + hh * 3600 + mm * 60 + ss) * 10**9) + int(frac)


def _count(value: str, name: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"{name} must be >= 0 (got {n})")
    return n


def read_azure(path: Path) -> list[Arrival]:
    """The rows in time order (stable), in seconds from the earliest row."""
    stamped: list[tuple[int, int, int]] = []
    t0: int | None = None  # the earliest row's, a skipped one's too
    with path.open(encoding="utf-8") as f:
        header = f.readline().strip().split(",")
        if header[:3] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise WorkloadError(
                f"{path}: not an Azure LLM trace (header TIMESTAMP,ContextTokens,GeneratedTokens)"
            )
        for num, line in enumerate(f, start=2):
            if not line.strip():
                continue
            cols = line.strip().split(",")
            try:
                if len(cols) < 3:
                    raise ValueError("expected TIMESTAMP,ContextTokens,GeneratedTokens")
                t_ns = _stamp_ns(cols[0])
                prompt = _count(cols[1], "ContextTokens")
                output = _count(cols[2], "GeneratedTokens")
            except ValueError as exc:
                raise WorkloadError(f"{path}:{num}: cannot read {line.strip()!r}: {exc}") from None
            t0 = t_ns if t0 is None else min(t0, t_ns)
            if prompt > 0 and output > 0:
                stamped.append((t_ns, prompt, output))
    stamped.sort(key=lambda r: r[0])
    if t0 is None:
        return []
    return [((t - t0) / 1e9, prompt, output, ()) for t, prompt, output in stamped]


def _mooncake_row(row: object, num_blocks: int) -> tuple[float, int, int, tuple[int, ...]]:
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    for key in ("timestamp", "input_length", "output_length"):
        if key not in row:
            raise ValueError(f"missing {key}")
    t = row["timestamp"]
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise ValueError(f"timestamp must be a finite number of ms >= 0 (got {t!r})")
    counts = []
    for key in ("input_length", "output_length"):
        n = row[key]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{key} must be an integer >= 0 (got {n!r})")
        counts.append(n)
    ids = row.get("hash_ids", [])
    if not isinstance(ids, list):
        raise ValueError(f"hash_ids must be a list of integers (got {ids!r})")
    for h in ids:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID:
            raise ValueError(f"hash_ids must be integers in [0, {MAX_HASH_ID}] (got {h!r})")
    most = -(-counts[0] // num_blocks)
    if len(ids) > most:
        raise ValueError(
            f"{len(ids)} hash_ids for input_length {counts[0]}: at most {most} blocks of "
            f"{num_blocks} tokens"
        )
    return t / 1000.0, counts[0], counts[1], tuple(ids)


def read_mooncake(path: Path) -> list[Arrival]:
    out: list[Arrival] = []
    with path.open(encoding="utf-8") as f:
        for num, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                t, prompt, output, ids = _mooncake_row(json.loads(line), PREFIX_BLOCK_TOKENS)
            except ValueError as exc:  # json.JSONDecodeError is one
                raise WorkloadError(f"{path}:{num}: not a Mooncake trace row: {exc}") from None
            if prompt > 0 and output > 0:
                out.append((t, prompt, output, ids))
    out.sort(key=lambda a: a[0])
    return out


@dataclass(frozen=True, slots=True)
class TraceReplay:
    kind: str
    path: Path
    speedup: float = 1.0
    offset_s: float = 0.0
    _rows: list[Arrival] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in TRACE_KINDS:
            raise WorkloadError(f"kind: unknown trace kind {self.kind!r}: use azure or mooncake")
        if not (math.isfinite(self.speedup) and self.speedup > 0):
            raise WorkloadError(f"speedup: must be a finite number > 0 (got {self.speedup:g})")
        if not (math.isfinite(self.offset_s) and self.offset_s >= 0):
            raise WorkloadError(f"offset_s: must be a finite number >= 0 (got {self.offset_s:g})")

    def rows(self) -> list[Arrival]:
        """The trace's requests (read once); an error when it has none."""
        if self._rows is not None:
            return self._rows
        if not self.path.is_file():
            raise WorkloadError(f"trace file {self.path} does not exist")
        rows = read_azure(self.path) if self.kind == "azure" else read_mooncake(self.path)
        if not rows:
            raise WorkloadError(f"{self.path}: no requests in the trace (rows with tokens)")
        object.__setattr__(self, "_rows", rows)  # frozen: a cache, not state
        return rows

    def arrivals(self, until_s: float) -> Iterator[Arrival]:
        for t, prompt, output, ids in self.rows():
            at = self.offset_s + t / self.speedup
            if at > until_s:
                return
            yield at, prompt, output, ids
