"""`flexpipe gears list|show|export|import`, `flexpipe bench` (gear_bench) and
`flexpipe discover` (cluster inventory through NVML)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from flexpipe.cli.common import console as make_console
from flexpipe.cli.common import err_console, user_errors
from flexpipe.gears.gear import parse_gear
from flexpipe.gears.io import export_points, import_points
from flexpipe.gears.point import GearPoint
from flexpipe.launch import ENGINES, EngineHandle, LocalLauncher
from flexpipe.launch.gear_bench import (
    BenchLoad,
    BenchObserver,
    BenchReport,
    BenchTarget,
    bench,
    candidates,
    parse_gears,
    resolve_model,
)
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import PerfModel
from flexpipe.perf.gear_lookup import GearEstimate, GearLookup, GearQuery
from flexpipe.perf.steady_state import Workload
from flexpipe.store import Store

StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="SQLAlchemy URL (default: $FLEXPIPE_STORE or ~/.flexpipe)."),
]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def points_table(points: list[GearPoint], title: str) -> Table:
    """Curve points; model, GPUs and link go in the title when every row shares them."""
    keys = {(p.model, p.gpu_types, p.link) for p in points}
    shared = len(keys) == 1
    if shared:
        model, gpus, link = next(iter(keys))
        title = f"{title} · {model} on {gpus} ({link})"
    table = Table(title=title, title_justify="left")
    cols = ["gear", "batch", "decode tok/s", "prefill tok/s", "TTFT p50/p99 ms"]
    cols += ["TPOT p50/p99 ms", "e2e p99 s", "KV", "cold s", "wake L1/L2 s", "source"]
    if not shared:
        cols = ["model", "GPUs", "link", *cols]
    for col in cols:
        table.add_column(
            col, justify="left" if col in ("model", "GPUs", "link", "gear") else "right"
        )
    for p in points:
        row = [
            p.gear_key,
            str(p.batch_size),
            f"{p.decode_tokens_per_s:,.0f}",
            f"{p.prefill_tokens_per_s:,.0f}",
            f"{_ms(p.ttft_p50_s)}/{_ms(p.ttft_p99_s)}",
            f"{_ms(p.tpot_p50_s)}/{_ms(p.tpot_p99_s)}",
            f"{p.e2e_p99_s:.2f}",
            "-" if p.peak_kv_usage is None else f"{p.peak_kv_usage:.0%}",
            "-" if p.cold_start_s is None else f"{p.cold_start_s:.1f}",
            "/".join("-" if w is None else f"{w:.2f}" for w in (p.wake_level1_s, p.wake_level2_s)),
            f"{p.source} ({p.engine})",
        ]
        if not shared:
            row = [p.model, p.gpu_types, p.link, *row]
        table.add_row(*row)
    return table


def estimates_table(estimates: list[GearEstimate], title: str) -> Table:
    """The lookup's answers: the figures the planner compares with SLOs, and their basis."""
    table = Table(title=title, title_justify="left")
    for col in ("batch", "decode tok/s", "req/s", "TTFT p99 ms", "TPOT p99 ms", "e2e p99 s"):
        table.add_column(col, justify="right")
    table.add_column("basis")
    for e in estimates:
        table.add_row(
            str(e.batch),
            f"{e.output_tokens_per_s:,.0f}",
            f"{e.requests_per_s:.2f}",
            _ms(e.ttft_s),
            _ms(e.tpot_s),
            f"{e.e2e_s:.2f}",
            e.basis,
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
        make_console().print(table)

    @gears.command("show")
    def show(
        model: Annotated[str, typer.Argument(help="Model id (llama-2-7b).")],
        gear: Annotated[str, typer.Option(help="Gear, e.g. tp=2,pp=1.")] = "tp=1",
        gpu_type: Annotated[
            str, typer.Option(help="GPU type(s), '+'-joined in placement order.")
        ] = "A100-80G-SXM",
        link: Annotated[
            str, typer.Option(help="Link class inside the group ('none' for one GPU).")
        ] = "nvlink3",
        batch: Annotated[
            list[int] | None, typer.Option(help="Batch sizes to look up (repeatable).")
        ] = None,
        input_len: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 512,
        output_len: Annotated[int, typer.Option(help="Output tokens per request.")] = 128,
        as_json: Annotated[bool, typer.Option("--json", help="Print the lookups as JSON.")] = False,
        store: StoreOpt = None,
    ) -> None:
        """A gear's measured points, and at each batch size the figures the planner uses
        (measured, interpolated, calibrated or predicted: the one lookup)."""
        with user_errors():
            g = parse_gear(gear)
            spec = load_model_spec(model)
            with Store(store) as st:
                lookup = GearLookup(st.points(model=spec.name), st.efficiency())
            query = GearQuery.on_whole_gpus(spec, g, gpu_type.split("+"), link)
            measured = lookup.table.points(query.key)
            if not measured:
                PerfModel(spec, g, query.placement()).require_feasible()  # does it fit at all
            workload = Workload(input_len, output_len)
            batches = batch or [1, 2, 4, 8, 16, 32, 64, 128, 256]
            estimates = [
                lookup.estimate(query.at_batch(b), workload) for b in batches if b <= g.max_num_seqs
            ]
        if as_json:
            doc = {
                "key": asdict(query.key),
                "input_len": input_len,
                "output_len": output_len,
                "estimates": [asdict(e) for e in estimates],
            }
            typer.echo(json.dumps(doc, indent=2))
            return
        console = make_console()
        if measured:
            console.print(points_table(measured, f"measured {g.family_key()}"))
        where = f"{query.key.gpu_types} ({query.key.link}), {input_len}/{output_len} tokens"
        console.print(estimates_table(estimates, f"{spec.name} {g.family_key()} on {where}"))
        for e in estimates:
            console.print(f"  batch {e.batch}: {e.basis} — {e.detail}", highlight=False)

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
        make_console().print(f"wrote {len(points)} points to {path}")

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
        make_console().print(f"imported {num} points from {path}")

    register_bench(app)
    register_discover(app)


# -- flexpipe bench -----------------------------------------------------------------------------


class _RichObserver(BenchObserver):
    """Progress bars: one per gear (sweep points), one for the running point (requests)."""

    def __init__(self, progress: Progress, console: Console) -> None:
        self.progress = progress
        self.console = console
        self.gear_task: TaskID | None = None
        self.point_task: TaskID | None = None

    def gear_started(self, cand: BenchTarget, sweep: Sequence[int]) -> None:
        self.gear_task = self.progress.add_task(
            f"{cand.gear.key()} starting engine", total=len(sweep)
        )

    def engine_ready(self, cand: BenchTarget, handle: EngineHandle) -> None:
        if self.gear_task is not None:
            self.progress.update(
                self.gear_task,
                description=f"{cand.gear.key()} ready in {handle.cold_start_s:.1f} s",
            )

    def point_started(self, cand: BenchTarget, concurrency: int, num_requests: int) -> None:
        if self.point_task is not None:
            self.progress.remove_task(self.point_task)
        self.point_task = self.progress.add_task(f"  concurrency {concurrency}", total=num_requests)

    def request_done(self) -> None:
        if self.point_task is not None:
            self.progress.advance(self.point_task)

    def point_done(self, cand: BenchTarget, point: GearPoint) -> None:
        if self.gear_task is not None:
            self.progress.advance(self.gear_task)
        self.console.print(
            f"  {cand.gear.key()} @ {point.batch_size}: {point.decode_tokens_per_s:,.0f} tok/s, "
            f"TTFT p99 {_ms(point.ttft_p99_s)} ms, TPOT p99 {_ms(point.tpot_p99_s)} ms"
            + (f", {point.num_failed} failed" if point.num_failed else ""),
            highlight=False,
        )

    def gear_failed(self, cand: BenchTarget, message: str) -> None:
        err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)


def register_bench(app: typer.Typer) -> None:
    @app.command("bench")
    def bench_cmd(
        model: Annotated[str, typer.Argument(help="Model id (llama-2-7b) or config.json path.")],
        gears: Annotated[
            str, typer.Option(help="'auto' (every gear that fits) or gears split by ';'.")
        ] = "auto",
        gpu_type: Annotated[
            str, typer.Option(help="GPU type of every rank (sim: what it stands for).")
        ] = "A100-80G-SXM",
        num_gpus: Annotated[int, typer.Option(help="GPUs available to a gear.")] = 1,
        link: Annotated[str, typer.Option(help="Link between the GPUs.")] = "nvlink3",
        engine: Annotated[str, typer.Option(help="sim or vllm.")] = "sim",
        time_scale: Annotated[
            float, typer.Option(help="sim: wall seconds per modelled second (>0).")
        ] = 1.0,
        input_len: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 512,
        output_len: Annotated[int, typer.Option(help="Output tokens per request.")] = 128,
        num_requests: Annotated[int, typer.Option(help="Requests per sweep point.")] = 200,
        concurrency: Annotated[
            str | None, typer.Option(help="Sweep, e.g. 1,4,16 (default: 1,2,4.. max that fits).")
        ] = None,
        ready_timeout_s: Annotated[float, typer.Option(help="Wait for /health 200.")] = 900.0,
        vllm_command: Annotated[
            str, typer.Option(help="What runs for --engine vllm.")
        ] = "vllm serve",
        store: StoreOpt = None,
    ) -> None:
        """gear_bench: launch each gear, sweep concurrency, store the curves in the gear table."""
        console = make_console()
        with user_errors():
            if engine not in ENGINES:
                raise ValueError(f"unknown engine {engine!r}; use sim or vllm")
            if engine == "sim" and time_scale <= 0:
                raise ValueError("--time-scale must be > 0 to measure (0 means no timing)")
            spec = resolve_model(model)
            workload = BenchLoad(input_len, output_len, num_requests)
            gear_list = parse_gears(gears, spec, num_gpus)
            sweep = [int(c) for c in concurrency.split(",")] if concurrency else None
            cands, rejected = candidates(spec, gear_list, workload, [gpu_type] * num_gpus, link)
            st = Store(store)
        for line in rejected:
            console.print(f"[yellow]skipped:[/] {line}", highlight=False)
        if not cands:
            err_console.print("[bold red]error:[/] no gear to benchmark: none fits these GPUs")
            raise typer.Exit(2)
        launcher = LocalLauncher(
            engine,
            time_scale=time_scale if engine == "sim" else 1.0,
            ready_timeout_s=ready_timeout_s,
            vllm_command=vllm_command.split(),
        )
        report = BenchReport()
        interrupted = False
        with Progress(console=console, transient=True) as progress:
            observer = _RichObserver(progress, console)
            try:
                asyncio.run(
                    bench(
                        cands,
                        launcher,
                        workload,
                        engine=engine,
                        time_scale=time_scale if engine == "sim" else 1.0,
                        concurrencies=sweep,
                        store_point=lambda p: st.put_points([p]),
                        observer=observer,
                        report=report,
                    )
                )
            except KeyboardInterrupt:
                interrupted = True
        st.close()
        console.print(points_table(report.points, f"gear_bench: {spec.name}"))
        for line in report.rejected:
            console.print(f"[yellow]note:[/] {line}", highlight=False)
        if interrupted:
            err_console.print(
                f"interrupted: kept {len(report.points)} measured point(s); engines stopped"
            )
            raise typer.Exit(130)
        if report.failures:
            raise typer.Exit(1)


# -- flexpipe discover --------------------------------------------------------------------------


def _discover_ray(
    address: str, overlay: Path | None, name: str | None, output: Path | None
) -> None:
    from dataclasses import replace

    from flexpipe.cluster import load_cluster
    from flexpipe.cluster.ray_inventory import read_ray_cluster

    with user_errors():
        found = read_ray_cluster(address, load_cluster(overlay) if overlay is not None else None)
    if name:
        found = replace(found, name=name)
    text = found.to_yaml()
    if output is not None:
        output.write_text(text, encoding="utf-8")
        num = f"{len(found.gpus)} GPU(s) on {len(found.nodes)} node(s)"
        err_console.print(f"wrote {output} ({num})")
    else:
        typer.echo(text, nl=False)


def register_discover(app: typer.Typer) -> None:
    @app.command("discover")
    def discover_cmd(
        output: Annotated[
            Path | None, typer.Option("--output", "-o", help="Write the cluster file here.")
        ] = None,
        name: Annotated[str | None, typer.Option(help="Cluster name (default: hostname).")] = None,
        probe: Annotated[
            bool, typer.Option(help="Measure GPU-to-GPU bandwidth (needs PyTorch with CUDA).")
        ] = False,
        ray: Annotated[
            str | None,
            typer.Option(help="Read a Ray cluster's nodes and GPUs instead (auto, HOST:PORT)."),
        ] = None,
        cluster: Annotated[
            Path | None, typer.Option(help="--ray: a cluster file for links and names.")
        ] = None,
    ) -> None:
        """Read this machine's GPUs and their NVLink/PCIe topology (NVML); print a cluster file.
        With --ray, every node of a Ray cluster (docs/ray.md)."""
        if ray is not None:
            _discover_ray(ray, cluster, name, output)
            return
        from flexpipe.cluster.nvml import (
            DiscoverError,
            cluster_doc,
            probe_bandwidth,
            read_inventory,
            to_cluster,
        )

        try:
            inv = read_inventory()
        except DiscoverError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            if probe:
                err_console.print("bandwidth probe skipped: no GPU to measure", highlight=False)
            raise typer.Exit(1) from None
        if probe:
            measured, message = probe_bandwidth(inv)
            inv.measured_gb_per_s.update(measured)
            err_console.print(message, highlight=False)
        doc = cluster_doc(inv, name)
        with user_errors():
            to_cluster(doc)  # what we print must load
        text = yaml.safe_dump(doc, sort_keys=False)
        if output is not None:
            output.write_text(text, encoding="utf-8")
            err_console.print(f"wrote {output} ({len(inv.gpus)} GPU(s))")
        else:
            typer.echo(text, nl=False)
