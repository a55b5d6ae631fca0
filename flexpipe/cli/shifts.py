"""`flexpipe shifts`: the shift log — every decision, why, and what became of it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.console import JustifyMethod
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


def entries_table(
    entries: Sequence[ShiftEntry], now: datetime, title: str, with_deployment: bool = False
) -> Table:
    """`with_deployment`: a column saying which deployment wrote each entry."""
    table = Table(title=title, title_justify="left")
    columns: tuple[tuple[str, JustifyMethod, bool], ...] = (
        ("id", "right", True),
        ("time (UTC)", "left", True),
        *((("deployment", "left", True),) if with_deployment else ()),
        ("kind", "left", True),
        ("trigger", "left", True),
        ("from → to", "left", False),
        ("score", "right", True),
        ("phases s\nwarm/reh/sw/drain/mig/rel/sleep/wake", "left", True),
        ("migrated\nkv/rc/fin/rerun", "left", True),
        ("rehearsal", "left", True),
        ("outcome", "left", True),
        ("why", "left", False),
    )
    for name, justify, no_wrap in columns:
        table.add_column(
            name,
            justify=justify,
            no_wrap=no_wrap,
            overflow="ellipsis" if no_wrap else "fold",
        )
    for e in entries:
        stamp = f"{e.at:%H:%M:%S}" if e.at.date() == now.date() else f"{e.at:%Y-%m-%d %H:%M:%S}"
        passed = e.rehearsal_passed
        table.add_row(
            str(e.id),
            stamp,
            *((e.deployment or "—",) if with_deployment else ()),
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


@dataclass(frozen=True, slots=True)
class _Found:
    entries: list[ShiftEntry]  # the ones to show
    num_matching: int  # of the deployment shown (every deployment's with --all)
    deployment: str | None  # whose; None: every deployment's
    num_others: int  # matching entries other deployments wrote


def _read(
    url: str | None,
    since: datetime | None,
    kinds: list[str] | None,
    limit: int,
    deployment: str | None,
    every: bool,
) -> _Found:
    """The entries to show: of `deployment`, else of the one that wrote the newest entry (the
    store is shared: other ports, tests and earlier runs log there too), or every
    deployment's with `every`. A store that cannot be read is one line."""
    try:
        with Store(url, create=False) as st:  # a read: never a new store
            log = ShiftLog(st)
            mine = None if every else deployment or log.newest_deployment()
            entries = log.entries(since=since, kinds=kinds, limit=limit or None, deployment=mine)
            num = log.count(since=since, kinds=kinds, deployment=mine)
            others = 0 if mine is None else log.count(since=since, kinds=kinds) - num
            return _Found(entries, num, mine, others)
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
        deployment: Annotated[
            str | None,
            typer.Option(
                help="Only this deployment's entries (its id: the gateway URL of its `flexpipe "
                "up`) [default: the one that wrote the newest entry]."
            ),
        ] = None,
        every: Annotated[
            bool, typer.Option("--all", help="Every deployment's entries (the store is shared).")
        ] = False,
    ) -> None:
        """The shift log: every decision (holds too), its trigger, score, phases, requests
        migrated and outcome; one deployment's (the newest's by default), or --all."""
        now = datetime.now(UTC)
        with user_errors():
            start = None if since is None else parse_since(since, now)
            if limit < 0:
                raise ValueError(f"bad --limit {limit}: expected >= 0")
            if every and deployment is not None:
                raise ValueError("give --deployment or --all, not both")
            found = _read(store, start, kind, limit, deployment, every)
        entries = found.entries
        if as_json:
            typer.echo(json.dumps([e.to_dict() for e in entries], indent=2))
            return
        out = make_console()
        where = f" since {start:%Y-%m-%d %H:%M:%S} UTC" if start is not None else ""
        whose = f" of {found.deployment}" if found.deployment else ""
        if not entries:
            out.print(f"no shift log entries{whose}{where}", highlight=False)
        else:
            title = f"shift log{whose}{where}: {len(entries)} of {found.num_matching} entries"
            several = len({e.deployment for e in entries}) > 1  # then say whose each is
            out.print(entries_table(entries, now, title, with_deployment=several))
            if len(entries) < found.num_matching:
                out.print(f"(the newest {len(entries)}; --limit 0 shows all)", highlight=False)
        if found.num_others:
            out.print(
                f"({found.num_others} entries of other deployments; --all shows them)",
                highlight=False,
            )
