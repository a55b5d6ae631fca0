"""The `flexpipe` command line. Each subcommand lives in its own module with a
`register(app)` function; this module only assembles them."""

from __future__ import annotations

from typing import Annotated

import typer

import flexpipe
from flexpipe.cli import (
    calibrate,
    cluster,
    controller,
    engine,
    estimate,
    gateway,
    gears,
    plan,
    replay,
    shifts,
    sim,
    status,
    up,
)

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="flexpipe: serve LLMs on the GPUs a cluster actually has free.",
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"flexpipe {flexpipe.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """flexpipe: serve LLMs on the GPUs a cluster actually has free."""


for _module in (
    estimate,
    calibrate,
    cluster,
    engine,
    gateway,
    controller,
    gears,
    plan,
    up,
    shifts,
    status,
    sim,
    replay,
):
    _module.register(app)


def main() -> None:
    app()
