"""Trace replay: the Azure LLM inference trace (2023) and the Mooncake trace (FAST'25).

- Azure: CSV `TIMESTAMP,ContextTokens,GeneratedTokens`, TIMESTAMP like
  `2023-11-16 18:15:46.6805900`; times are taken relative to the first row.
- Mooncake: JSONL `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`;
  each hash id is a 512-token block, shared leading ids are a shared prefix.

`speedup` compresses time (2: twice the rate), `offset_s` shifts the replay. Rows with no
prompt or no output are skipped (a completion of 0 tokens is not a request we can time).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flexpipe.sim.workload import Arrival, WorkloadError

TRACE_KINDS = ("azure", "mooncake")


def _clock_s(stamp: str) -> float:
    """Seconds since midnight, plus whole days from the date (YYYY-MM-DD hh:mm:ss.fffffff)."""
    date, _, clock = stamp.strip().partition(" ")
    hh, mm, ss = clock.split(":")
    day = int(date.replace("-", "")[-2:])
    return day * 86_400.0 + int(hh) * 3600.0 + int(mm) * 60.0 + float(ss)


def read_azure(path: Path) -> list[Arrival]:
    out: list[Arrival] = []
    t0: float | None = None
    with path.open(encoding="utf-8") as f:
        header = f.readline().strip().split(",")
        if header[:3] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise WorkloadError(
                f"{path}: not an Azure LLM trace (header TIMESTAMP,ContextTokens,GeneratedTokens)"
            )
        for num, line in enumerate(f, start=2):
            if not line.strip():
                continue
            try:
                stamp, ctx, gen = line.split(",")[:3]
                t = _clock_s(stamp)
                prompt, output = int(ctx), int(gen)
            except ValueError:
                raise WorkloadError(f"{path}:{num}: cannot read {line.strip()!r}") from None
            t0 = t if t0 is None else t0
            if prompt > 0 and output > 0:
                out.append((t - t0, prompt, output, ()))
    return out


def read_mooncake(path: Path) -> list[Arrival]:
    out: list[Arrival] = []
    with path.open(encoding="utf-8") as f:
        for num, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                t = float(row["timestamp"]) / 1000.0
                prompt, output = int(row["input_length"]), int(row["output_length"])
                ids = tuple(int(h) for h in row.get("hash_ids", ()))
            except (ValueError, KeyError, TypeError):
                raise WorkloadError(f"{path}:{num}: not a Mooncake trace row") from None
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

    def __post_init__(self) -> None:
        if self.kind not in TRACE_KINDS:
            raise WorkloadError(f"unknown trace kind {self.kind!r}: use azure or mooncake")
        if self.speedup <= 0:
            raise WorkloadError("speedup must be > 0")

    def rows(self) -> list[Arrival]:
        if not self.path.is_file():
            raise WorkloadError(f"trace file {self.path} does not exist")
        return read_azure(self.path) if self.kind == "azure" else read_mooncake(self.path)

    def arrivals(self, until_s: float) -> Iterator[Arrival]:
        for t, prompt, output, ids in self.rows():
            at = self.offset_s + t / self.speedup
            if at > until_s:
                return
            yield at, prompt, output, ids
