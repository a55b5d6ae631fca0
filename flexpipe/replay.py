"""A trace's traffic, live, against any OpenAI-compatible endpoint (`flexpipe replay`;
docs/simulator.md, "The same traffic live"): the simulator's requests (its trace reader, its
prompts: N tokens for the sim engine's tokenizer, shared hash ids as identical text), each sent
at its trace time over the project's HTTP client and timed chunk by chunk, and the report the
simulator's own summary, so SLO attainment is one computation.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

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
