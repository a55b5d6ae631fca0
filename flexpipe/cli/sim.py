"""`flexpipe sim SCENARIO` (a file or a built-in name) and `flexpipe sim list`.

flexpipe sim list
flexpipe sim seed-fragmented
flexpipe sim seed-fragmented --compare flexpipe,wait-for-ideal,round_robin
flexpipe sim my.yaml --policy peak --out runs/peak --duration-s 600 --seed 3
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
import yaml
from rich.progress import Progress, TaskID
from rich.table import Table

from flexpipe.cli.common import console as make_console
from flexpipe.cli.common import err_console, user_errors


def _list_table() -> Table:
    from flexpipe.sim.scenario import builtin_scenarios

    table = Table(title="built-in scenarios (flexpipe sim NAME)", title_justify="left")
    for col in ("name", "duration", "policy", "description"):
        table.add_column(col)
    for name, path in builtin_scenarios().items():
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        table.add_row(
            name,
            f"{doc.get('duration_s', '?')} s",
            str(doc.get("policy", "flexpipe")),
            str(doc.get("description", "")),
        )
    return table


_ROWS: tuple[tuple[str, str], ...] = (
    ("requests", "num_requests"),
    ("completed", "num_completed"),
    ("failed", "num_failed"),
    ("goodput req/s", "goodput_requests_per_s"),
    ("SLO attainment", "slo_attainment"),
    ("first served (s)", "first_served_s"),
    ("GPU-h reserved", "gpu_hours_reserved"),
    ("GPU-h used", "gpu_hours_used"),
    ("utilisation", "utilisation"),
)


def compare_table(reports: list[dict[str, Any]]) -> Table:
    """One column per policy; overall rows, then per model latency and throughput."""
    from flexpipe.sim.report import cell_text as _cell  # the HTML page formats with it too

    table = Table(title=f"scenario {reports[0]['scenario']}", title_justify="left")
    table.add_column("")
    for rep in reports:
        table.add_column(f"{rep['policy']} ({rep['routing']})", justify="right")
    for label, key in _ROWS:
        table.add_row(label, *(_cell(r[key]) for r in reports))
    table.add_row(
        "reservation / peak", *(_cell(r["reservation"]["share_of_peak"]) for r in reports)
    )
    table.add_row("shifts by kind", *(_cell(r["shifts_by_kind"]) for r in reports))
    table.add_row("moved requests", *(_cell(r["requests_migrated_by_method"]) for r in reports))
    for model in reports[0]["models"]:
        add_model_rows(table, model, [r["models"][model] for r in reports])
    return table


def add_model_rows(table: Table, model: str, per: list[dict[str, Any]]) -> None:
    """A model's throughput and latency rows, one column per report's entry for it (the
    simulator's and `flexpipe replay`'s, which measures no preemptions)."""
    from flexpipe.sim.report import cell_text as _cell

    table.add_row(f"[bold]{model}[/]", *("" for _ in per))
    table.add_row("  tokens/s", *(_cell(p["throughput_tokens_per_s"]) for p in per))
    table.add_row(
        "  tokens/s over the span",
        *(_cell(p["span_throughput_tokens_per_s"]) for p in per),
    )
    for metric in ("ttft_s", "tpot_s", "e2e_s"):
        for q in ("p50", "p90", "p99"):
            table.add_row(f"  {metric[:-2]} {q} (s)", *(_cell(p[metric][q], "-") for p in per))
    table.add_row("  first served (s)", *(_cell(p["first_served_s"]) for p in per))
    table.add_row("  prefix-cache hits (tok)", *(_cell(p["prefix_cache_hit_tokens"]) for p in per))
    if all("num_preemptions" in p for p in per):
        table.add_row("  preemptions", *(_cell(p["num_preemptions"]) for p in per))
    table.add_row("  failed by reason", *(_cell(p["failed_by_reason"]) for p in per))


def policy_names(compare: str | None, policy: str | None, default: str) -> list[str]:
    """The policies to run: `--compare A,B`, else `--policy`, else the scenario's."""
    option = "--compare" if compare is not None else "--policy"
    given = compare if compare is not None else policy
    names = [p.strip() for p in (default if given is None else given).split(",")]
    names = [p for p in names if p]
    if not names:
        raise ValueError(f"{option}: give at least one policy name (got {given!r})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{option}: {', '.join(twice)} given more than once")
    return names


def register(app: typer.Typer) -> None:
    """Add `flexpipe sim` to the app."""

    @app.command("sim")
    def sim(
        scenario: Annotated[
            str, typer.Argument(help="A scenario file, a built-in name, or `list`.")
        ],
        policy: Annotated[
            str | None,
            typer.Option(
                help="flexpipe, round_robin, static, peak, peak-slo, autoscaler, wait-for-ideal "
                "or a scenario plan."
            ),
        ] = None,
        compare: Annotated[
            str | None, typer.Option(help="Several policies, comma-separated, side by side.")
        ] = None,
        out: Annotated[
            Path | None,
            typer.Option(help="Write report.json/.html, requests/timeline/shifts.csv here."),
        ] = None,
        seed: Annotated[int | None, typer.Option(help="Override the scenario's seed.")] = None,
        duration_s: Annotated[
            float | None, typer.Option(help="Override the scenario's duration.")
        ] = None,
        sizing: Annotated[
            str | None,
            typer.Option(help="The planner's sizing: throughput or slo (docs/planner.md)."),
        ] = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
        every_step: Annotated[
            bool, typer.Option(help="One event per engine step (no closed-form stretches).")
        ] = False,
        quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    ) -> None:
        """Simulate a scenario on a virtual clock (see docs/simulator.md)."""
        console = make_console()
        if scenario == "list":
            console.print(_list_table())
            return
        from flexpipe.sim.policy import create_policy
        from flexpipe.sim.report import report, report_json, write_reports
        from flexpipe.sim.scenario import ScenarioError, load_scenario, resolve, with_duration
        from flexpipe.sim.simulator import simulate

        with user_errors():
            sc = load_scenario(resolve(scenario))
            if seed is not None:
                sc = replace(sc, seed=seed)
            if duration_s is not None:
                sc = with_duration(sc, duration_s)
            if sizing is not None:
                if sizing not in ("throughput", "slo"):
                    raise ScenarioError(f"--sizing: use throughput or slo (got {sizing!r})")
                chosen: Literal["throughput", "slo"] = "slo" if sizing == "slo" else "throughput"
                sc = replace(sc, planner=replace(sc.planner, sizing=chosen))
            names = policy_names(compare, policy, sc.policy)
            for name in names:
                create_policy(name, sc)  # an unknown name is an error before anything runs
        reports = []
        for name in names:
            with Progress(
                console=err_console,
                transient=True,
                disable=quiet or not err_console.is_terminal,
            ) as bar:
                task = bar.add_task(f"{sc.name} / {name}", total=sc.duration_s)

                def advance(t: float, task: TaskID = task, bar: Progress = bar) -> None:
                    bar.update(task, completed=t)

                with user_errors():
                    result = simulate(
                        sc,
                        name,
                        stretches=not every_step,
                        progress=advance,
                    )
            rep = report(result)
            reports.append(rep)
            if out is not None:
                target = out / name if len(names) > 1 else out
                for path in write_reports(result, target):
                    err_console.print(f"wrote {path}", highlight=False)
            if json_out and len(names) == 1:
                typer.echo(report_json(result), nl=False)
        if json_out and len(names) > 1:  # one JSON document: policy -> report
            typer.echo(json.dumps(dict(zip(names, reports, strict=True)), indent=2))
        if not json_out:
            console.print(compare_table(reports))
            for rep in reports:
                for note in rep["notes"]:
                    console.print(f"note ({rep['policy']}): {note}", highlight=False)
