"""`flexpipe shifts`: the shift log — every decision, why, and what became of it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.table import Table
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from flexpipe.cli.common import console as make_console
from flexpipe.cli.common import user_errors
from flexpipe.cli.durations import parse_since
from flexpipe.store import Store, StoreError, default_store_url
from flexpipe.store.shift_entry import KINDS, METHODS, PHASES, PlanInstance, ShiftEntry
from flexpipe.store.shift_log import ShiftLog

__all__ = ["entries_table", "moves_text", "parse_since", "register"]


def _short(i: PlanInstance) -> str:
    shape = "-".join(i.gear.split("-")[:2])  # tp2-pp1
    return f"{i.model} {shape}@{'+'.join(i.gpu_ids)}"


def moves_text(entry: ShiftEntry) -> str:
    """What the change stops → what it starts (instances both plans share are left out)."""
    if entry.target is None:
        return "—"
    current = {i.key for i in entry.current}
    target = {i.key for i in entry.target}
    removed = [_short(i) for i in entry.current if i.key not in target]
    added = [_short(i) for i in entry.target if i.key not in current]
    return f"{', '.join(removed) or '∅'} → {', '.join(added) or '∅'}"


def _phases_text(entry: ShiftEntry) -> str:
    """Seconds per phase in PHASES order, `-` for one not run; empty when none ran."""
    if not entry.phases.items():
        return ""
    values = [getattr(entry.phases, f"{p}_s") for p in PHASES]
    return "/".join("-" if v is None else f"{v:.1f}" for v in values)


def _migrated_text(entry: ShiftEntry) -> str:
    if entry.migrated is None:
        return ""
    return "/".join(str(getattr(entry.migrated, m)) for m in METHODS)


def _why_text(entry: ShiftEntry) -> str:
    return entry.reason if not entry.error else f"{entry.reason}\n→ {entry.error}"


def entries_table(entries: Sequence[ShiftEntry], now: datetime, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    columns = (
        ("id", "right", True),
        ("time (UTC)", "left", True),
        ("kind", "left", True),
        ("trigger", "left", True),
        ("from → to", "left", False),
        ("score", "right", True),
        ("phases s\nwarm/reh/sw/drain/mig/rel", "left", True),
        ("migrated\nkv/rc/fin/rerun", "left", True),
        ("rehearsal", "left", True),
        ("outcome", "left", True),
        ("why", "left", False),
    )
    for name, justify, no_wrap in columns:
        table.add_column(
            name,
            justify=justify,  # type: ignore[arg-type]
            no_wrap=no_wrap,
            overflow="ellipsis" if no_wrap else "fold",
        )
    for e in entries:
        stamp = f"{e.at:%H:%M:%S}" if e.at.date() == now.date() else f"{e.at:%Y-%m-%d %H:%M:%S}"
        passed = e.rehearsal_passed
        table.add_row(
            str(e.id),
            stamp,
            e.kind,
            e.trigger,
            moves_text(e),
            "" if e.score is None else f"{e.score:,.1f}",
            _phases_text(e),
            _migrated_text(e),
            "" if passed is None else ("ok" if passed else "missed"),
            e.outcome,
            _why_text(e),
        )
    return table


def _first_line(exc: BaseException) -> str:
    """SQLAlchemy's messages add the SQL and a link on lines of their own."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _read(
    url: str | None, since: datetime | None, kinds: list[str] | None, limit: int
) -> tuple[list[ShiftEntry], int]:
    """The entries to show and how many match; a store that cannot be read is one line."""
    try:
        with Store(url, create=False) as st:  # a read: never a new store
            log = ShiftLog(st)
            return log.entries(since=since, kinds=kinds, limit=limit or None), log.count(
                since=since, kinds=kinds
            )
    except StoreError as exc:
        raise StoreError(_first_line(exc)) from None
    except OSError as exc:  # the SQLite file's folder cannot be made
        raise StoreError(f"cannot open store {_display(url)}: {exc.strerror or exc}") from None
    except SQLAlchemyError as exc:  # e.g. a file locked or broken after it was opened
        where = _display(url)
        raise StoreError(f"cannot read the shift log in {where}: {_first_line(exc)}") from None


def _display(url: str | None) -> str:
    return make_url(url or default_store_url()).render_as_string(hide_password=True)


StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="SQLAlchemy URL (default: $FLEXPIPE_STORE or ~/.flexpipe)."),
]


def register(app: typer.Typer) -> None:
    """Add `shifts` to the `flexpipe` app."""

    @app.command("shifts")
    def shifts(
        since: Annotated[
            str | None,
            typer.Option(help="Only entries since: a duration (10m, 2h, 1h30m) or an ISO time."),
        ] = None,
        kind: Annotated[
            list[str] | None,
            typer.Option(help=f"Only this kind (repeatable): {', '.join(KINDS)}."),
        ] = None,
        limit: Annotated[int, typer.Option(help="The newest N entries (0: all).")] = 50,
        as_json: Annotated[bool, typer.Option("--json", help="Print the entries as JSON.")] = False,
        store: StoreOpt = None,
    ) -> None:
        """The shift log: every decision (holds too), its trigger, score, phases, requests
        migrated and outcome."""
        now = datetime.now(UTC)
        with user_errors():
            start = None if since is None else parse_since(since, now)
            if limit < 0:
                raise ValueError(f"bad --limit {limit}: expected >= 0")
            entries, total = _read(store, start, kind, limit)
        if as_json:
            typer.echo(json.dumps([e.to_dict() for e in entries], indent=2))
            return
        out = make_console()
        where = f" since {start:%Y-%m-%d %H:%M:%S} UTC" if start is not None else ""
        if not entries:
            out.print(f"no shift log entries{where}", highlight=False)
            return
        title = f"shift log{where}: {len(entries)} of {total} entries"
        out.print(entries_table(entries, now, title))
        if len(entries) < total:
            out.print(f"(the newest {len(entries)}; --limit 0 shows all)", highlight=False)
