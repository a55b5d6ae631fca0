"""`flexpipe gears list|show|export|import`, `flexpipe bench` (gear_bench) and
`flexpipe discover` (cluster inventory through NVML)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from flexpipe.cli.common import user_errors
from flexpipe.gear import parse_gear
from flexpipe.gears import GearEstimate, GearPoint, GearTable, export_points, import_points
from flexpipe.store import Store

StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="SQLAlchemy URL (default: $FLEXPIPE_STORE or ~/.flexpipe)."),
]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def points_table(points: list[GearPoint], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("model", "gear", "GPUs", "link", "batch", "decode tok/s", "prefill tok/s"):
        table.add_column(col, justify="right" if "tok" in col or col == "batch" else "left")
    for col in ("TTFT p50/p99 ms", "TPOT p50/p99 ms", "e2e p99 s", "KV peak", "cold s", "source"):
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(
            p.model,
            p.gear_key,
            p.gpu_types,
            p.link,
            str(p.batch_size),
            f"{p.decode_tokens_per_s:,.0f}",
            f"{p.prefill_tokens_per_s:,.0f}",
            f"{_ms(p.ttft_p50_s)}/{_ms(p.ttft_p99_s)}",
            f"{_ms(p.tpot_p50_s)}/{_ms(p.tpot_p99_s)}",
            f"{p.e2e_p99_s:.2f}",
            "-" if p.peak_kv_usage is None else f"{p.peak_kv_usage:.0%}",
            "-" if p.cold_start_s is None else f"{p.cold_start_s:.1f}",
            f"{p.source} ({p.engine})",
        )
    return table


def register(app: typer.Typer) -> None:
    """Add `gears`, `bench` and `discover` to the `flexpipe` app."""
    gears = typer.Typer(no_args_is_help=True, help="The gear table: measured gear curves.")
    app.add_typer(gears, name="gears")

    @gears.command("list")
    def list_gears(
        model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
        store: StoreOpt = None,
    ) -> None:
        """One line per measured curve: model, gear, GPUs, link, batch sizes, provenance."""
        with user_errors(), Store(store) as st:
            curves = st.curves(model)
        table = Table(title=f"gear table ({len(curves)} curves)", title_justify="left")
        for col in ("model", "gear", "GPUs", "link", "batches", "best decode tok/s", "source"):
            table.add_column(col)
        for key, pts in curves.items():
            best = max(pts, key=lambda p: p.decode_tokens_per_s)
            table.add_row(
                key.model,
                key.gear_key,
                key.gpu_types,
                key.link,
                ",".join(str(p.batch_size) for p in pts),
                f"{best.decode_tokens_per_s:,.0f} @ {best.batch_size}",
                f"{pts[-1].source} {pts[-1].engine} {pts[-1].engine_version} "
                f"{pts[-1].measured_at:%Y-%m-%d %H:%M}",
            )
        Console().print(table)

    @gears.command("show")
    def show(
        model: Annotated[str, typer.Argument(help="Model id (llama-2-7b).")],
        gear: Annotated[str, typer.Option(help="Gear, e.g. tp=2,pp=1.")] = "tp=1",
        gpu_type: Annotated[
            str, typer.Option(help="GPU type(s), '+'-joined in placement order.")
        ] = "A100-80G-SXM",
        link: Annotated[str, typer.Option(help="Link class inside the group.")] = "nvlink3",
        batch: Annotated[
            list[int] | None, typer.Option(help="Batch sizes to look up (repeatable).")
        ] = None,
        input_len: Annotated[int, typer.Option()] = 512,
        output_len: Annotated[int, typer.Option()] = 128,
        store: StoreOpt = None,
    ) -> None:
        """A gear's curve: measured points, and lookups (interpolated or predicted)."""
        with user_errors():
            g = parse_gear(gear)
            with Store(store) as st:
                table = GearTable(st.points(model=model))
            types = gpu_type.split("+")
            batches = batch or [1, 2, 4, 8, 16, 32, 64, 128, 256]
            estimates: list[GearEstimate] = [
                table.lookup(model, g, b, types, link, input_len=input_len, output_len=output_len)
                for b in batches
                if b <= g.max_num_seqs
            ]
        console = Console()
        console.print(points_table([e.point for e in estimates], f"{model} {g.key()}"))
        for e in estimates:
            console.print(f"  batch {e.point.batch_size}: {e.basis} — {e.note}", highlight=False)

    @gears.command("export")
    def export(
        path: Annotated[Path, typer.Argument(help="Output file, .csv or .json.")],
        model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
        fmt: Annotated[str | None, typer.Option("--format", help="csv or json.")] = None,
        store: StoreOpt = None,
    ) -> None:
        """Write the gear table (or one model's curves) to CSV or JSON."""
        with user_errors(), Store(store) as st:
            points = st.points(model=model)
            export_points(points, path, fmt)
        Console().print(f"wrote {len(points)} points to {path}")

    @gears.command("import")
    def import_(
        path: Annotated[Path, typer.Argument(help="A .csv or .json gear table.")],
        fmt: Annotated[str | None, typer.Option("--format", help="csv or json.")] = None,
        store: StoreOpt = None,
    ) -> None:
        """Read a gear table file into the store (same key and batch size: replaced)."""
        with user_errors():
            points = import_points(path, fmt)
            with Store(store) as st:
                num = st.put_points(points)
        Console().print(f"imported {num} points from {path}")
