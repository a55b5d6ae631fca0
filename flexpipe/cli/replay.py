"""`flexpipe replay TRACE --url URL`: a trace's traffic, live, against any OpenAI-compatible
endpoint, reported as the simulator reports it (docs/simulator.md, "The same traffic live").

flexpipe replay data/azure-conv.csv --url http://127.0.0.1:8000/v1 --speed-up 10
flexpipe replay conv.jsonl --url http://gw:8000/v1 --models models.yaml --max-requests 200 --json

The requests are the simulator's: the trace reader (`flexpipe.sim.trace.TraceReplay`), its
prompts (`flexpipe.sim.workload.prompt_text`: N tokens for the sim engine's tokenizer, shared
hash ids as identical text) and its outcome fields (`SimRequest`), so the report is the
simulator's own summary (`flexpipe.sim.report.summary`) and SLO attainment one computation.
Each request is sent at its trace time (divided by `--speed-up`); TTFT counts from that time,
so a request that waited for a free slot (`--max-concurrency`) is late, and its wait shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flexpipe.cli.common import console as make_console
from flexpipe.cli.common import err_console, read_yaml, user_errors
from flexpipe.http.client import ClientPool
from flexpipe.policies.planner import Slo
from flexpipe.replay import (
    ReplayRun,
    Target,
    build_report,
    is_scenario,
    load_requests,
    replay,
    scenario_requests,
    served_models,
    trace_kind,
)
from flexpipe.sim.request import SimRequest


def parse_model_map(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        src, sep, dst = item.partition("=")
        if not sep or not src.strip() or not dst.strip():
            raise ValueError(f"--model-map {item!r}: expected TRACE_MODEL=POOL_MODEL")
        out[src.strip()] = dst.strip()
    return out


def model_slos(
    models: Path | None,
    names: set[str],
    ttft_ms: float | None,
    tpot_ms: float | None,
    scenario_slos: dict[str, Slo] | None = None,
) -> dict[str, Slo]:
    """Each model's SLO: the scenario's, the models file's entry (when given) over it, the
    flags over both."""
    from flexpipe.policies.planner.demand import parse_models

    base: dict[str, Slo] = dict(scenario_slos or {})
    if models is not None:
        base.update({d.name: d.slo for d in parse_models(read_yaml(models), str(models))})
    out: dict[str, Slo] = {}
    for name in sorted(names):
        known = base.get(name)
        if known is None and (ttft_ms is None or tpot_ms is None):
            where = f"{models} has no model {name!r}: " if models is not None else ""
            raise ValueError(f"{where}give --slo-ttft-ms and --slo-tpot-ms (or --models FILE)")
        ttft_s = ttft_ms / 1000 if ttft_ms is not None else known.ttft_p99_s  # type: ignore[union-attr]
        tpot_s = tpot_ms / 1000 if tpot_ms is not None else known.tpot_p99_s  # type: ignore[union-attr]
        if not (ttft_s > 0 and tpot_s > 0):
            raise ValueError("--slo-ttft-ms and --slo-tpot-ms must be > 0")
        out[name] = Slo(ttft_s, tpot_s)
    return out


_ROWS: tuple[tuple[str, str], ...] = (
    ("requests in the slice", "num_in_slice"),
    ("sent", "num_sent"),
    ("late (waited for a slot)", "num_late"),
    ("completed", "num_completed"),
    ("failed", "num_failed"),
    ("goodput req/s", "goodput_requests_per_s"),
    ("SLO attainment", "slo_attainment"),
    ("first served (s)", "first_served_s"),
    ("elapsed (s)", "elapsed_s"),
)


def report_table(rep: dict[str, Any]) -> Table:
    """The report as `flexpipe sim` prints one: overall rows, then each model's."""
    from flexpipe.cli.sim import add_model_rows
    from flexpipe.sim.report import cell_text

    title = f"replay {Path(rep['trace']).name} x{rep['speed_up']:g} -> {rep['url']}"
    if rep["interrupted"]:
        title += " [interrupted]"
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("replay", justify="right")
    for label, key in _ROWS:
        table.add_row(label, cell_text(rep[key]))
    whys: Counter[str] = Counter()
    for why, n in rep["failed_by_why"].items():
        whys[why if len(why) <= 60 else why[:59] + "…"] += n
    table.add_row("failed by why", cell_text(dict(whys)))  # (--json: in full)
    for name, entry in rep["models"].items():
        label = name if entry["pool_model"] == name else f"{name} -> {entry['pool_model']}"
        add_model_rows(table, label, [entry])
    return table


def _status(run: ReplayRun) -> str:
    done = run.num_finished + run.num_failed
    rate = f"{run.num_good / done:.3f}" if done else "-"
    return (
        f"sent {len(run.sent_s)}  finished {run.num_finished}  failed {run.num_failed}  "
        f"attainment {rate}"
    )


def register(app: typer.Typer) -> None:
    """Add `flexpipe replay` to the app."""

    @app.command("replay")
    def replay_cmd(
        trace: Annotated[
            str,
            typer.Argument(help="Azure trace CSV, Mooncake JSONL, or a `flexpipe sim` scenario."),
        ],
        url: Annotated[
            str, typer.Option(help="The OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1.")
        ],
        kind: Annotated[
            str | None, typer.Option(help="azure or mooncake (default: from the file name).")
        ] = None,
        speed_up: Annotated[
            float, typer.Option("--speed-up", help="Time compression (10: ten times the rate).")
        ] = 1.0,
        duration_s: Annotated[
            float | None, typer.Option(help="Only the trace's first seconds (trace time).")
        ] = None,
        max_requests: Annotated[int | None, typer.Option(help="At most this many.")] = None,
        model: Annotated[
            str | None,
            typer.Option(help="The trace's model name (default: the endpoint's only model)."),
        ] = None,
        model_map: Annotated[
            list[str] | None,
            typer.Option(help="TRACE_MODEL=POOL_MODEL: the name sent for a model (repeatable)."),
        ] = None,
        models: Annotated[
            Path | None, typer.Option(help="A models file: each model's SLO.")
        ] = None,
        slo_ttft_ms: Annotated[
            float | None, typer.Option(help="TTFT SLO (default: --models', else 2000).")
        ] = None,
        slo_tpot_ms: Annotated[
            float | None, typer.Option(help="TPOT SLO (default: --models', else 100).")
        ] = None,
        stream: Annotated[
            bool, typer.Option(help="Stream (TTFT needs it; without, TTFT is the whole answer).")
        ] = True,
        max_concurrency: Annotated[
            int, typer.Option(help="Requests in flight at most; the rest wait (counted late).")
        ] = 256,
        timeout_s: Annotated[float, typer.Option(help="Per request, whole answer.")] = 300.0,
        api_key: Annotated[
            str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer token.")
        ] = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
        quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    ) -> None:
        """Replay a trace against a live endpoint; report as `flexpipe sim` does."""
        from flexpipe.sim.workload import WorkloadError

        with user_errors():
            if not (math.isfinite(speed_up) and speed_up > 0):
                raise ValueError(f"--speed-up: must be > 0 (got {speed_up:g})")
            if max_concurrency < 1 or timeout_s <= 0:
                raise ValueError("--max-concurrency must be >= 1 and --timeout-s > 0")
            if max_requests is not None and max_requests < 1:
                raise ValueError("--max-requests must be >= 1")
            target = Target.parse(url, api_key)
            mapping = parse_model_map(model_map or [])
            scenario = is_scenario(trace)
            if scenario and model is not None:
                raise ValueError("--model: a scenario names its models (--model-map A=B)")
            if not scenario and not Path(trace).is_file():
                raise ValueError(f"trace file {trace} does not exist")
            the_kind = "scenario" if scenario else trace_kind(Path(trace), kind)
            served = asyncio.run(_served(target))
            scenario_slos: dict[str, Slo] = {}
            try:
                if scenario:
                    reqs, scenario_slos, window_s = scenario_requests(
                        trace, speed_up, duration_s, max_requests
                    )
                else:
                    name = model or (served[0] if len(served) == 1 else None)
                    if name is None:
                        raise ValueError(
                            f"{url} serves {', '.join(served) or 'no model'}: give --model"
                        )
                    reqs = load_requests(
                        Path(trace), the_kind, name, speed_up, duration_s, max_requests
                    )
                    window_s = reqs[-1].arrival_s if duration_s is None else duration_s / speed_up
            except WorkloadError as exc:
                raise ValueError(str(exc)) from None
            names = {r.model for r in reqs}
            missing = sorted(n for n in names if mapping.get(n, n) not in served)
            if missing:
                raise ValueError(
                    f"{url} serves {', '.join(served) or 'no model'}, not "
                    f"{', '.join(mapping.get(n, n) for n in missing)}: give --model-map or --model"
                )
            if models is None and not scenario:  # the flags, or their defaults
                slo_ttft_ms = 2000.0 if slo_ttft_ms is None else slo_ttft_ms
                slo_tpot_ms = 100.0 if slo_tpot_ms is None else slo_tpot_ms
            slos = model_slos(models, names, slo_ttft_ms, slo_tpot_ms, scenario_slos)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
            console=err_console,
            transient=True,
            disable=quiet or not err_console.is_terminal,
        ) as bar:
            task = bar.add_task(f"replay {Path(trace).name}", total=len(reqs), stats="")

            def on_change(run: ReplayRun) -> None:
                done = run.num_finished + run.num_failed
                bar.update(task, completed=done, stats=_status(run))

            run = asyncio.run(
                _main(reqs, target, mapping, slos, max_concurrency, stream, timeout_s, on_change)
            )
        meta = {
            "trace": trace,
            "kind": the_kind,
            "url": url,
            "speed_up": speed_up,
            "stream": stream,
            "max_concurrency": max_concurrency,
        }
        rep = build_report(run, reqs, slos, mapping, window_s, meta)
        if json_out:
            typer.echo(json.dumps(rep, indent=2))
        else:
            make_console().print(report_table(rep))
        if run.interrupted:
            raise typer.Exit(130)


async def _served(target: Target) -> list[str]:
    pool = ClientPool()
    try:
        return await served_models(pool, target, 10.0)
    finally:
        await pool.close()


async def _main(
    reqs: list[SimRequest],
    target: Target,
    mapping: dict[str, str],
    slos: dict[str, Slo],
    max_concurrency: int,
    stream: bool,
    timeout_s: float,
    on_change: Callable[[ReplayRun], None],
) -> ReplayRun:
    """`replay` with Ctrl-C (SIGINT) and SIGTERM as a clean stop: what finished is reported."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    err_console.print(
        f"replaying {len(reqs)} requests to {target.backend}{target.prefix} (Ctrl-C: stop and "
        "report what was sent)",
        highlight=False,
    )
    try:
        return await replay(
            reqs,
            target,
            mapping,
            slos,
            max_concurrency=max_concurrency,
            stream=stream,
            timeout_s=timeout_s,
            on_change=on_change,
            stop=stop,
        )
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
