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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import orjson
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flexpipe.cli.common import console as make_console
from flexpipe.cli.common import err_console, read_yaml, user_errors
from flexpipe.http.client import ClientPool, Timeouts, UpstreamError
from flexpipe.policies.planner import Slo
from flexpipe.sim.request import SimRequest

INTERRUPTED = "interrupted: stopped by the user before it finished"


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go: `backend` (scheme://host:port) and the API's path prefix (`/v1`)."""

    backend: str
    prefix: str
    headers: dict[str, str]

    @staticmethod
    def parse(url: str, api_key: str | None) -> Target:
        parts = urlsplit(url.rstrip("/"))
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--url: expected http://host:port/v1 (got {url!r})")
        port = parts.port or 80
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        return Target(f"http://{parts.hostname}:{port}", parts.path or "", headers)


@dataclass(slots=True)
class ReplayRun:
    """What happened: the requests issued (their outcome set on them), and the counters the
    summary does not hold."""

    issued: list[SimRequest] = field(default_factory=list)
    sent_s: dict[int, float] = field(default_factory=dict)  # request_id -> when it went out
    num_late: int = 0  # requests that waited for a free slot (`--max-concurrency`)
    num_finished: int = 0
    num_failed: int = 0
    num_good: int = 0
    interrupted: bool = False
    elapsed_s: float = 0.0


def trace_kind(path: Path, kind: str | None) -> str:
    """`--kind`, else from the file name: .csv is Azure, .jsonl/.json Mooncake."""
    if kind is not None:
        return kind
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "azure"
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    raise ValueError(f"{path}: cannot tell the trace kind from the name: give --kind")


def load_requests(
    path: Path,
    kind: str,
    model: str,
    speed_up: float,
    duration_s: float | None,
    max_requests: int | None,
) -> list[SimRequest]:
    """The trace's requests (the simulator's reader), in replay seconds from the start:
    those within `duration_s` of trace time, at most `max_requests`."""
    from flexpipe.sim.trace import TraceReplay

    replay = TraceReplay(kind, path, speedup=speed_up)
    until_s = math.inf if duration_s is None else duration_s / speed_up
    out: list[SimRequest] = []
    for t, prompt, output, ids in replay.arrivals(until_s):
        if max_requests is not None and len(out) >= max_requests:
            break
        out.append(SimRequest(len(out), t, model, prompt, output, ids))
    if not out:
        raise ValueError(f"{path}: no request in the slice (--duration-s / --max-requests)")
    return out


def is_scenario(trace: str) -> bool:
    """A scenario file (.yaml, .yml) or a built-in scenario's name, not a trace file."""
    from flexpipe.sim.scenario import builtin_scenarios

    return Path(trace).suffix.lower() in (".yaml", ".yml") or trace in builtin_scenarios()


def scenario_requests(
    name: str, speed_up: float, duration_s: float | None, max_requests: int | None
) -> tuple[list[SimRequest], dict[str, Slo], float]:
    """A scenario's requests as `flexpipe sim` generates them (every workload, traces and
    synthetic, merged), its models' SLOs, and the window in replay seconds."""
    from dataclasses import replace

    from flexpipe.sim.arrivals import generate_requests, model_demands
    from flexpipe.sim.scenario import load_scenario, resolve, with_duration

    sc = load_scenario(resolve(name))
    if duration_s is not None:
        sc = with_duration(sc, duration_s)
    generated = generate_requests(sc)
    demands, _ = model_demands(sc, generated)
    if max_requests is not None:
        generated = generated[:max_requests]
    if not generated:
        raise ValueError(f"{name}: no request in the slice (--duration-s / --max-requests)")
    reqs = [replace(r, arrival_s=r.arrival_s / speed_up) for r in generated]
    cut = max_requests is not None and len(reqs) == max_requests
    window_s = reqs[-1].arrival_s if cut else sc.duration_s / speed_up
    return reqs, {d.name: d.slo for d in demands}, window_s


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


def _error_text(body: bytes) -> str:
    try:
        doc = orjson.loads(body)
        msg = doc.get("error", {}).get("message") if isinstance(doc, dict) else None
    except (orjson.JSONDecodeError, AttributeError):
        msg = None
    text = str(msg) if msg else body.decode("utf-8", "replace")
    return " ".join(text.split())[:200]


async def served_models(pool: ClientPool, target: Target, timeout_s: float) -> list[str]:
    """The endpoint's models (GET /models): also the check that the URL answers."""
    url = f"{target.backend}{target.prefix}/models"
    try:
        async with asyncio.timeout(timeout_s):
            resp = await pool.request(
                target.backend,
                "GET",
                f"{target.prefix}/models",
                headers=target.headers,
                timeouts=Timeouts(connect_s=timeout_s, ttfb_s=timeout_s, idle_s=timeout_s),
            )
            body = await resp.read()
            resp.release()
    except (UpstreamError, TimeoutError) as exc:
        raise ValueError(f"{url} does not answer: {exc or 'timed out'}") from None
    if resp.status != 200:
        raise ValueError(f"{url} answered {resp.status}: {_error_text(body)}")
    try:
        return [str(m["id"]) for m in orjson.loads(body)["data"]]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{url}: not an OpenAI model list") from None


async def send_one(
    pool: ClientPool,
    target: Target,
    req: SimRequest,
    pool_model: str,
    stream: bool,
    timeout_s: float,
    clock: Callable[[], float],
) -> None:
    """Send one request and set its outcome on it (times in `clock`'s seconds, the replay's
    start at 0): first/last token, finish, tokens generated and cached, or `failed` with its
    reason (`http 503: ...`, `timeout: ...`, `disconnect: ...`, `connect: ...`)."""
    from flexpipe.sim.workload import prompt_text

    body: dict[str, Any] = {
        "model": pool_model,
        "prompt": prompt_text(req),
        "max_tokens": req.num_output_tokens,
        "ignore_eos": True,  # the trace's output length, as the simulator's requests
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    timeouts = Timeouts(connect_s=timeout_s, ttfb_s=timeout_s, idle_s=timeout_s)
    num_events = 0
    try:
        async with asyncio.timeout(timeout_s):
            resp = await pool.request(
                target.backend,
                "POST",
                f"{target.prefix}/completions",
                orjson.dumps(body),
                target.headers,
                timeouts,
            )
            try:
                req.instance = resp.headers.get("x-flexpipe-instance", "")
                if resp.status != 200:
                    req.failed = f"http {resp.status}: {_error_text(await resp.read())}"
                    return
                if not stream:
                    doc = orjson.loads(await resp.read())
                    now = clock()
                    req.first_token_s = req.last_token_s = now
                    _usage(req, doc.get("usage"))
                    req.finish_s = now
                    return
                buf = b""
                done = False
                while not done and (chunk := await resp.next_chunk()) is not None:
                    now = clock()  # when these bytes arrived: the tokens' time
                    buf += chunk
                    *events, buf = buf.split(b"\n\n")
                    for event in events:
                        data = _sse_data(event)
                        if data == b"[DONE]":
                            done = True
                            break
                        if not data:
                            continue
                        doc = orjson.loads(data)
                        if doc.get("choices"):
                            num_events += 1
                            if req.first_token_s < 0:
                                req.first_token_s = now
                            req.last_token_s = now
                        if doc.get("usage"):
                            _usage(req, doc["usage"])
                        if "error" in doc:
                            req.failed = f"error: {_error_text(data)}"
                            return
                if not done:
                    req.failed = "disconnect: the stream ended before [DONE]"
                    return
                if req.num_generated_tokens == 0:  # no usage chunk: count the events
                    req.num_generated_tokens = num_events
                if req.first_token_s < 0:
                    req.first_token_s = req.last_token_s = clock()
                req.finish_s = clock()
            finally:
                resp.release()
    except TimeoutError:
        req.failed = f"timeout: no full answer within {timeout_s:g} s"
    except UpstreamError as exc:
        kind = {"closed": "disconnect", "ttfb": "timeout", "idle": "timeout"}.get(exc.kind)
        req.failed = f"{kind}: {exc}" if kind else str(exc)
    except (orjson.JSONDecodeError, AttributeError) as exc:
        req.failed = f"protocol: unparsable answer: {exc}"
    except asyncio.CancelledError:
        req.failed = INTERRUPTED
        raise


def _sse_data(event: bytes) -> bytes:
    """The data of one SSE event (its `data:` lines; comments and other fields left out)."""
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines)


def _usage(req: SimRequest, usage: Any) -> None:
    if isinstance(usage, dict):
        req.num_generated_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        req.num_cached_tokens = int(details.get("cached_tokens") or 0)


async def replay(
    reqs: list[SimRequest],
    target: Target,
    model_map: dict[str, str],
    slos: dict[str, Slo],
    *,
    max_concurrency: int,
    stream: bool,
    timeout_s: float,
    on_change: Callable[[ReplayRun], None] = lambda run: None,
    stop: asyncio.Event | None = None,
) -> ReplayRun:
    """Send `reqs` at their times, at most `max_concurrency` at once (the rest wait, late);
    on `stop` (Ctrl-C), stop sending and cancel what is in flight (failed: interrupted)."""
    from flexpipe.sim.report import meets_slo

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    start = loop.time()

    def clock() -> float:
        return loop.time() - start

    run = ReplayRun()
    slots = asyncio.Semaphore(max_concurrency)
    # The project's own client, not the `openai` package: no hidden retries (a retried
    # request would hide a failure and restart its TTFT), no connection-pool queue of its
    # own (its default 100 keep-alive slots would add an unreported wait under load; here the
    # only wait is `slots`, counted as late), TCP_NODELAY, and each SSE chunk handed over as it
    # arrives, parsed with orjson in a loop that has no per-chunk object model: the client's
    # CPU stays small, so a token's time is when its bytes arrived, not when Python got to it.
    pool = ClientPool()

    async def one(req: SimRequest) -> None:
        if slots.locked():
            run.num_late += 1
        try:
            async with slots:
                run.sent_s[req.request_id] = clock()
                on_change(run)
                await send_one(
                    pool, target, req, model_map.get(req.model, req.model), stream, timeout_s, clock
                )
        except asyncio.CancelledError:
            req.failed = req.failed or INTERRUPTED
        except Exception as exc:  # counted, never lost (an answer this client cannot read)
            req.failed = f"client: {type(exc).__name__}: {exc}"
        if req.completed:
            run.num_finished += 1
            run.num_good += meets_slo(req, slos[req.model])
        else:
            run.num_failed += 1
        on_change(run)

    tasks: list[asyncio.Task[None]] = []
    stopped = asyncio.ensure_future(stop.wait())
    try:
        for req in reqs:
            delay = start + req.arrival_s - loop.time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(stopped), delay)
            if stop.is_set():
                break
            run.issued.append(req)
            tasks.append(asyncio.create_task(one(req)))
        pending: set[asyncio.Future[Any]] = {*tasks}
        while pending and not stop.is_set():
            _, pending = await asyncio.wait({*pending, stopped}, return_when="FIRST_COMPLETED")
            pending.discard(stopped)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        stopped.cancel()
        await pool.close()
    run.interrupted = stop.is_set()
    run.elapsed_s = clock()
    return run


def build_report(
    run: ReplayRun,
    reqs: list[SimRequest],
    slos: dict[str, Slo],
    model_map: dict[str, str],
    window_s: float,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The simulator's summary of the issued requests (overall and per model), the replay's
    own counters, and one record per request."""
    from flexpipe.sim.report import REQUEST_FIELDS, meets_slo, summary, why_class

    issued = run.issued
    duration_s = window_s if window_s > 0 else max(run.elapsed_s, 1e-9)
    models = {}
    for name in sorted({r.model for r in issued}):
        mine = [r for r in issued if r.model == name]
        entry = summary(mine, duration_s, slos)
        del entry["num_preemptions"]  # not visible over HTTP
        models[name] = {
            "pool_model": model_map.get(name, name),
            "slo": {"ttft_s": slos[name].ttft_p99_s, "tpot_s": slos[name].tpot_p99_s},
            **entry,
        }
    overall = summary(issued, duration_s, slos)
    why = Counter(why_class(r.failed) for r in issued if r.failed)
    del overall["num_preemptions"]

    def record(r: SimRequest) -> dict[str, Any]:
        ok = r.completed
        values = {
            "request_id": r.request_id,
            "model": r.model,
            "arrival_s": round(r.arrival_s, 6),
            "instance": r.instance,
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_output_tokens": r.num_output_tokens,
            "num_generated_tokens": r.num_generated_tokens,
            "num_cached_tokens": r.num_cached_tokens,
            "ttft_s": round(r.ttft_s, 6) if ok else None,
            "tpot_s": round(r.tpot_s, 6) if ok else None,
            "e2e_s": round(r.e2e_s, 6) if ok else None,
            "failed": r.failed,
        }
        rec = {k: values[k] for k in REQUEST_FIELDS}  # the simulator's requests.csv columns
        rec["sent_s"] = round(run.sent_s.get(r.request_id, -1.0), 6)
        rec["slo_met"] = meets_slo(r, slos[r.model])
        return rec

    return {
        **meta,
        "duration_s": round(duration_s, 6),
        "elapsed_s": round(run.elapsed_s, 6),
        "interrupted": run.interrupted,
        "num_in_slice": len(reqs),
        "num_sent": len(issued),
        "num_not_sent": len(reqs) - len(issued),
        "num_late": run.num_late,
        **overall,
        "failed_by_why": dict(why.most_common()),
        "models": models,
        "requests": [record(r) for r in issued],
    }


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
