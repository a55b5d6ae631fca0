"""Export and import gear tables as CSV or JSON, so a table measured on one cluster is shared
and reviewed like config. Both formats hold the same columns (`POINT_FIELDS`); JSON is
`{"format": "flexpipe-gear-table", "version": 1, "points": [...]}`.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexpipe.gears.point import POINT_FIELDS, GearPoint

FORMAT_NAME = "flexpipe-gear-table"
FORMAT_VERSION = 1


class GearTableFormatError(ValueError):
    """A gear table file that cannot be read; the message names the file and the row."""


def format_for(path: str | Path, fmt: str | None = None) -> str:
    fmt = fmt.lower() if fmt else Path(path).suffix.lower().lstrip(".")
    if fmt not in ("csv", "json"):
        raise GearTableFormatError(
            f"{path}: cannot tell the format from the name; use .csv or .json (or --format)"
        )
    return fmt


def dumps(points: Sequence[GearPoint], fmt: str) -> str:
    if fmt == "json":
        doc = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "points": [p.as_dict() for p in points],
        }
        return json.dumps(doc, indent=2) + "\n"
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(POINT_FIELDS), lineterminator="\n")
    writer.writeheader()
    for p in points:
        writer.writerow({k: ("" if v is None else v) for k, v in p.as_dict().items()})
    return buf.getvalue()


def loads(text: str, fmt: str, source: str = "<gear table>") -> list[GearPoint]:
    if fmt == "json":
        try:
            doc: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GearTableFormatError(f"{source}: not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise GearTableFormatError(
                f"{source}: not a flexpipe gear table (expected an object with "
                f'"format": "{FORMAT_NAME}")'
            )
        if doc.get("version") != FORMAT_VERSION:
            raise GearTableFormatError(
                f"{source}: gear table version {doc.get('version')!r}; this flexpipe reads "
                f"version {FORMAT_VERSION}"
            )
        rows = doc.get("points")
        if not isinstance(rows, list):
            raise GearTableFormatError(f'{source}: "points" must be a list')
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise GearTableFormatError(f"{source}: points[{i}] is not an object")
            try:
                out.append(GearPoint.from_dict(row, f"{source}: points[{i}]"))
            except ValueError as exc:
                raise GearTableFormatError(str(exc)) from None
        return out
    reader = csv.DictReader(io.StringIO(text))
    missing = [f for f in ("model", "gear_key", "batch_size") if f not in (reader.fieldnames or [])]
    if missing:
        raise GearTableFormatError(f"{source}: CSV header lacks {', '.join(missing)}")
    out = []
    for line, row in enumerate(reader, start=2):
        try:
            out.append(GearPoint.from_dict(dict(row), f"{source}: line {line}"))
        except ValueError as exc:
            raise GearTableFormatError(str(exc)) from None
    return out


def export_points(points: Sequence[GearPoint], path: str | Path, fmt: str | None = None) -> None:
    Path(path).write_text(dumps(points, format_for(path, fmt)), encoding="utf-8")


def import_points(path: str | Path, fmt: str | None = None) -> list[GearPoint]:
    fmt = format_for(path, fmt)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise GearTableFormatError(f"{path}: cannot read the file: {reason}") from None
    return loads(text, fmt, str(path))
