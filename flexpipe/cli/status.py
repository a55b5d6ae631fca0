"""`flexpipe status` and `flexpipe top`: what a running flexpipe is doing, in the terminal.

Both read the controller's admin API (`GET /admin/status`: instances, lifecycle states, GPUs,
SLOs, the gateway's URL), the gateway's `/metrics` and every engine's `/metrics`
(flexpipe/observe/readings.py), build a snapshot (observe/status_snapshot.py, pure) and draw it
(observe/render.py, pure). `top` adds the shift log's last changes, read from the store as
`flexpipe shifts` does and drawn with its table."""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import RenderableType
from rich.live import Live
from rich.text import Text

from flexpipe.cli.cluster import ControllerUrl, TimeoutS, Token, TokenFile, connect
from flexpipe.cli.common import console as make_console
from flexpipe.cli.common import err_console
from flexpipe.cli.shifts import entries_table
from flexpipe.control.api.client import ControllerClient, ControllerError
from flexpipe.observe.readings import Readings, read
from flexpipe.observe.render import status_view, top_view
from flexpipe.observe.status_snapshot import snapshot
from flexpipe.store import Store
from flexpipe.store.shift_entry import KINDS
from flexpipe.store.shift_log import ShiftLog

__all__ = ["register"]


def _fail(message: str, code: int) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _client(
    controller: str | None, token: str | None, token_file: Path | None, timeout_s: float
) -> ControllerClient:
    try:
        return connect(controller, token, token_file, timeout_s)
    except ValueError as exc:
        raise _fail(str(exc), 2) from None


def _read(client: ControllerClient, timeout_s: float) -> Readings:
    try:
        return read(client, timeout_s)
    except ControllerError as exc:
        raise _fail(str(exc), 1) from None


def _last_shifts(store: str | None, num: int, deployment: str | None) -> RenderableType:
    """The newest changes `deployment` logged (holds left out; the store is shared with other
    deployments), or why they cannot be shown."""
    kinds = [k for k in KINDS if k != "hold"]
    try:
        with Store(store) as st:
            entries = ShiftLog(st).entries(kinds=kinds, limit=num, deployment=deployment)
    except Exception as exc:  # a store that cannot be read must not take the screen down
        return Text(f"shift log: cannot read the store: {str(exc).splitlines()[0]}", style="red")
    if not entries:
        return Text("shift log: no changes yet", style="dim")
    return entries_table(
        entries, datetime.now(UTC), f"last {len(entries)} changes (flexpipe shifts)"
    )


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """Stdin in cbreak mode (single keys, no echo) when it is a terminal; yields whether."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(wait_s: float, keys: bool) -> bool:
    """Wait `wait_s`; True when q was typed meanwhile."""
    if not keys:
        time.sleep(wait_s)
        return False
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sys.stdin], [], [], left)
        if ready and os.read(sys.stdin.fileno(), 1) in (b"q", b"Q"):
            return True
    return False


Interval = Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between refreshes.")]


def register(app: typer.Typer) -> None:
    """Add `status` and `top` to the `flexpipe` app."""

    @app.command("status")
    def status(
        as_json: Annotated[
            bool, typer.Option("--json", help="Print the snapshot as JSON.")
        ] = False,
        watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C.")] = False,
        interval: Interval = 2.0,
        controller: ControllerUrl = None,
        token: Token = None,
        token_file: TokenFile = None,
        timeout_s: TimeoutS = 5.0,
    ) -> None:
        """Instances (gear, GPUs, lifecycle state, health, load), each model's rate, TTFT and
        TPOT p95 against its SLO, queue, prefix-cache hit rate, GPU utilisation, and the GPUs."""
        client = _client(controller, token, token_file, timeout_s)
        out = make_console()
        before: Readings | None = None
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                now = _read(client, timeout_s)
                snap = snapshot(now, before)
                if as_json:
                    typer.echo(json.dumps(snap.to_json(), indent=None if watch else 2))
                else:
                    if watch and out.is_terminal:
                        out.clear()
                    out.print(status_view(snap))
                if not watch:
                    return
                before = now
                time.sleep(interval)

    @app.command("top")
    def top(
        interval: Interval = 2.0,
        controller: ControllerUrl = None,
        token: Token = None,
        token_file: TokenFile = None,
        timeout_s: TimeoutS = 5.0,
        store: Annotated[
            str | None,
            typer.Option(help="The shift log's store URL (default: the one the controller uses)."),
        ] = None,
        num_shifts: Annotated[int, typer.Option("--shifts", min=0, help="Changes shown.")] = 5,
        frames: Annotated[
            int, typer.Option(min=0, help="Stop after this many refreshes (0: until q).")
        ] = 0,
    ) -> None:
        """A live full-screen view for machines without a browser: per model rates, TTFT and
        TPOT p95 against the SLO, queue, prefix hit rate, GPU utilisation; instances, GPUs and
        the last shifts. q or Ctrl-C quits."""
        client = _client(controller, token, token_file, timeout_s)
        out = make_console()
        before = _read(client, timeout_s)
        store = store or before.status.get("store")  # the shift log the controller writes
        mine = before.status.get("deployment")  # what it writes its entries as
        view: RenderableType = top_view(snapshot(before), _last_shifts(store, num_shifts, mine))
        num_frames = 0
        with (
            contextlib.suppress(KeyboardInterrupt),
            _keys() as keys,
            Live(view, console=out, screen=out.is_terminal, auto_refresh=False) as live,
        ):
            live.refresh()
            while not frames or num_frames < frames:
                if _quit_pressed(interval, keys):
                    break
                try:
                    now = read(client, timeout_s)
                except ControllerError as exc:
                    live.update(Text(f"{exc} (retrying; q quits)", style="bold red"), refresh=True)
                    continue
                live.update(
                    top_view(snapshot(now, before), _last_shifts(store, num_shifts, mine)),
                    refresh=True,
                )
                before = now
                num_frames += 1
