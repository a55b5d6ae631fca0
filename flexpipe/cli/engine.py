"""`flexpipe engine sim [vllm serve flags]`: run a sim engine (see docs/sim-engine.md)."""

from __future__ import annotations

import typer

engine_app = typer.Typer(
    no_args_is_help=True, help="Inference engines: `flexpipe engine sim MODEL [vllm serve flags]`."
)


@engine_app.command(
    "sim",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def sim(ctx: typer.Context) -> None:
    """A vLLM-compatible server whose timing is the performance model.

    Takes `vllm serve` flags (`--model`, `--tensor-parallel-size`, `--max-num-seqs`, ...) plus
    --gpu-type/--link or --cluster/--gpu-ids, --time-scale, --seed, --load-time-s,
    --admin-token. Secrets stay out of `ps` with --api-key-file / --admin-token-file or the
    environment (VLLM_API_KEY, FLEXPIPE_ADMIN_TOKEN). `flexpipe engine sim --help` lists them
    all.
    """
    from flexpipe.engine.sim import main

    raise typer.Exit(main(list(ctx.args)))


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `flexpipe` app."""
    app.add_typer(engine_app, name="engine")
