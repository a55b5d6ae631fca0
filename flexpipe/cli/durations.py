"""Durations and times on the command line, one grammar for every command: `flexpipe shifts
--since` (before now) and `flexpipe cluster occupy --until` (after now).

A duration is `90s`, `10m`, `1.5h`, `2d` or a sum of them from days down to seconds (`1h30m`,
`1d12h`, `2m30s`; spaces between the parts allowed). A time is ISO 8601 (`2026-12-01T15:00`,
`2026-12-01T15:00:00Z`); without a zone, `--since` reads UTC (the shift log's times) and
`--until` this machine's local time (as `occupy` prints it)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

__all__ = ["DURATION_HELP", "parse_duration_s", "parse_since", "parse_until"]

DURATION_HELP = "90s, 10m, 2h, 1h30m, 1d"
_DURATION_RE = re.compile(
    r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$"
)
_UNIT_S = (86400.0, 3600.0, 60.0, 1.0)


def parse_duration_s(text: str) -> float | None:
    """Seconds, or None when `text` is not a duration."""
    value = "".join(text.split()).lower()
    match = _DURATION_RE.match(value)
    if not value or match is None or not any(match.groups()):
        return None
    return sum(float(g) * u for g, u in zip(match.groups(), _UNIT_S, strict=True) if g)


def _iso(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        return None


def parse_since(text: str, now: datetime) -> datetime:
    """`--since`: a duration before `now`, or an ISO time (no zone: UTC); a UTC datetime."""
    seconds = parse_duration_s(text)
    if seconds is not None:
        return now - timedelta(seconds=seconds)
    at = _iso(text)
    if at is None:
        raise ValueError(
            f"bad --since {text!r}: expected a duration ({DURATION_HELP}) or an ISO time "
            "(2026-12-01T12:00:00Z)"
        )
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def parse_until(text: str, now_s: float) -> float:
    """`--until`: a duration after `now_s`, or an ISO time (no zone: local time); unix seconds,
    after `now_s`."""
    seconds = parse_duration_s(text)
    if seconds is not None:
        if seconds <= 0:
            raise ValueError(f"--until {text!r}: the duration must be more than 0")
        return now_s + seconds
    when = _iso(text)
    if when is None:
        raise ValueError(
            f"--until {text!r}: expected a duration ({DURATION_HELP}) or an ISO time "
            "(2026-12-01T15:00, 2026-12-01T15:00:00Z)"
        )
    until_s = when.timestamp()  # naive: local time
    if until_s <= now_s:
        raise ValueError(f"--until {text!r} is in the past ({now_s - until_s:.0f} s ago)")
    return until_s
