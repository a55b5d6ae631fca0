"""The `flexpipe` command line. Each subcommand lives in its own module with a
`register(app)` function; this module only assembles them."""

from __future__ import annotations

import typer

from flexpipe.cli import cluster, engine, estimate, gateway, gears, plan, sim, up

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="flexpipe: serve LLMs on the GPUs a cluster actually has free.",
)


@app.callback()
def _root() -> None:
    """flexpipe: serve LLMs on the GPUs a cluster actually has free."""


for _module in (estimate, cluster, engine, gateway, gears, plan, up, sim):
    _module.register(app)


def main() -> None:
    app()
