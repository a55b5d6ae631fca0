"""`flexpipe plan --cluster FILE --models FILE [--json] [--store URL]`: what the planner would
run on the free GPUs now, with expected throughput and latency per instance and the alternatives
it beat.

Speed comes from the gear table in the store through the one lookup, as for `flexpipe up` and
`flexpipe gears show` (`GearLookup` over `Store(url).points()`): measured, interpolated,
calibrated or predicted, each instance's `basis` says which. `load_models_file` is shared with
`flexpipe up`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flexpipe.cli.common import user_errors
from flexpipe.cluster import load_cluster
from flexpipe.examples import DEFAULT_CLUSTER, DEFAULT_MODELS
from flexpipe.hardware import GB
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import ModelDemand, Plan, PlannerConfig, parse_models, plan
from flexpipe.policies.planner.checkpoint import unplanned_notes
from flexpipe.store import Store


def load_models_file(path: str | Path) -> tuple[ModelDemand, ...]:
    """Read and validate a models file (docs/planner.md); errors are ModelsFileError."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{source}: cannot read the file: {exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: YAML syntax error: {exc}".replace("\n", " ")) from None
    return parse_models(doc, source)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def render(p: Plan, console: Console) -> None:
    models = Table(title="Demand", title_justify="left")
    for col in ("model", "demand tok/s", "served tok/s", "capacity tok/s", "instances", "GPUs"):
        models.add_column(col, justify="left" if col == "model" else "right")
    for m in p.models:
        served = f"{m.served_tokens_per_s:.0f}" + ("" if m.covered else " [red](short)[/]")
        models.add_row(
            escape(m.name),
            f"{m.demand_tokens_per_s:.0f}",
            served,
            f"{m.capacity_tokens_per_s:.0f}",
            str(m.num_instances),
            str(m.num_gpus),
        )
    console.print(models)

    table = Table(title="Instances", title_justify="left")
    for col in (
        "instance",
        "gear",
        "GPUs (stages | , TP +)",
        "layers",
        "batch",
        "tok/s",
        "req/s (assigned)",
        "TTFT p99 ms",
        "TPOT p99 ms",
        "KV tokens",
        "basis",
    ):
        table.add_column(col, justify="right" if col[0].islower() and col[:3] != "ins" else "left")
    for i in p.instances:
        table.add_row(
            escape(i.name),
            escape(i.gear.key()),
            escape(" | ".join("+".join(s) for s in i.stages))
            + (f" (shared, {i.gpu_memory_fraction:.2f})" if i.gpu_memory_fraction else ""),
            "/".join(str(n) for n in i.layers_per_stage),
            str(i.estimate.batch),
            f"{i.capacity_tokens_per_s:.0f}",
            f"{i.capacity_requests_per_s:.2f} ({i.assigned_requests_per_s:.2f})",
            _ms(i.estimate.ttft_s),
            _ms(i.estimate.tpot_s),
            f"{i.kv_capacity_tokens:,}",
            i.estimate.basis,
        )
    console.print(table)

    why = Table(title="Why, and the alternatives each choice beat", title_justify="left")
    why.add_column("instance")
    why.add_column("chosen / rejected")
    why.add_column("tok/s per GPU", justify="right")
    why.add_column("reason")
    for i in p.instances:
        per_gpu = i.capacity_tokens_per_s / i.num_gpus
        why.add_row(escape(i.name), "[green]chosen[/]", f"{per_gpu:.0f}", escape(i.why))
        for a in i.alternatives:
            value = "-" if a.tokens_per_s_per_gpu is None else f"{a.tokens_per_s_per_gpu:.0f}"
            why.add_row("", escape(a.description), value, escape(a.reason))
    console.print(why)

    if p.baselines:
        base = Table(title="Against fixed deployments", title_justify="left")
        base.add_column("baseline")
        base.add_column("goodput tok/s", justify="right")
        base.add_column("plan is", justify="right")
        base.add_column("detail")
        for b in p.baselines:
            ratio = (
                "∞ (it serves nothing now)"
                if b.goodput_tokens_per_s == 0
                else f"{p.goodput_tokens_per_s / b.goodput_tokens_per_s:.2f}x"
            )
            base.add_row(
                escape(b.description),
                f"{b.goodput_tokens_per_s:.0f}",
                ratio,
                escape(b.detail),
            )
        console.print(base)
    if p.unused:
        unused = Table(title="GPUs not used", title_justify="left")
        unused.add_column("GPU")
        unused.add_column("why")
        for u in p.unused:
            unused.add_row(escape(u.gpu_id), escape(u.reason))
        console.print(unused)
    for note in p.notes:  # the searches compared (greedy, LP relaxation), with their numbers
        console.print(f"[dim]{escape(note)}[/]")
    console.print(
        f"[bold]goodput[/] {p.goodput_tokens_per_s:.0f} SLO-meeting output tok/s on "
        f"{p.num_gpus} GPUs in {len(p.instances)} instances"
    )


def plan_command(
    cluster: Annotated[
        Path, typer.Option("--cluster", help="Cluster file (docs/cluster-file.md).")
    ] = DEFAULT_CLUSTER,
    models: Annotated[
        Path, typer.Option("--models", help="Models, demand and SLOs (docs/planner.md).")
    ] = DEFAULT_MODELS,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    now_s: Annotated[
        float, typer.Option("--now", help="Seconds on the cluster file's clock (free_until_s).")
    ] = 0.0,
    fast_link_gb_per_s: Annotated[
        float | None,
        typer.Option("--fast-link-gbps", help="TP only over links at least this fast (GB/s)."),
    ] = None,
    max_pp: Annotated[int, typer.Option("--max-pp", help="Most pipeline stages.")] = 4,
    sizing: Annotated[
        str,
        typer.Option(help="An instance's capacity: throughput or slo (docs/planner.md)."),
    ] = "throughput",
    share_gpus: Annotated[
        bool,
        typer.Option(help="Pack small models onto shared GPUs (docs/gpu-sharing.md)."),
    ] = False,
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            help="Gear table: SQLAlchemy URL (default: $FLEXPIPE_STORE or ~/.flexpipe).",
        ),
    ] = None,
) -> None:
    """Plan instances (model, gear, GPUs) for the free GPUs now, and say why."""
    with user_errors():
        cl = load_cluster(cluster)
        demands = load_models_file(models)
        if sizing not in ("throughput", "slo"):
            raise ValueError(f"--sizing: use throughput or slo (got {sizing!r})")
        chosen: Literal["throughput", "slo"] = "slo" if sizing == "slo" else "throughput"
        config = PlannerConfig(max_pp=max_pp, sizing=chosen, share_gpus=share_gpus)
        if fast_link_gb_per_s is not None:
            if fast_link_gb_per_s <= 0:
                raise ValueError("--fast-link-gbps must be positive")
            config = replace(config, fast_link_bytes_per_s=fast_link_gb_per_s * GB)
        with Store(store) as st:
            efficiency = st.efficiency()  # built-in calibration plus `flexpipe calibrate`'s
            performance = GearLookup(st.points(), efficiency)
        result = plan(cl, demands, performance, config=config, now_s=now_s, efficiency=efficiency)
    notes = unplanned_notes(demands)
    if as_json:
        doc = result.to_dict()
        doc["precisions_without_checkpoint"] = {
            d.name: list(d.dtypes_without_checkpoint)
            for d in demands
            if d.dtypes_without_checkpoint
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    console = Console(width=200)
    for note in notes:
        console.print(f"[yellow]{escape(note)}[/]")
    render(result, console)


def register(app: typer.Typer) -> None:
    """Add `flexpipe plan` to the `flexpipe` app."""
    app.command("plan")(plan_command)
