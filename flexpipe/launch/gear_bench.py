"""gear_bench: measure gears, not guess them (seed 000 §2.2).

For each candidate gear: launch an engine through the launcher (the same one the controller
uses), wait for /health 200 (cold start), time a wake-up from each sleep level (vLLM's sleep
mode: level 1 from host RAM, level 2 from the weight source), drive a fixed-shape closed-loop
load — by default 200 requests of 512 prompt tokens and 128 output tokens — at a sweep of
concurrencies from 1 to the largest whose KV fits, stop the engine, and store one gear-table
point per concurrency. Every point is stored as soon as it is measured, so an interrupted run keeps
what it has.

The load generator streams /v1/completions with `ignore_eos` and `stream_options.
include_usage` and times each response client-side: TTFT (first token), TPOT ((e2e - TTFT) /
(tokens - 1)), e2e. A sim engine's wall time is `time_scale` x modelled time, so times are
divided by the time scale and stored as modelled (GPU) seconds. Peak KV use is the maximum of
the engine's `vllm:kv_cache_usage_perc` scraped during the point.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import orjson

from flexpipe import __version__
from flexpipe.control.engines.launching import with_sleep_mode
from flexpipe.gears.gear import Gear, GearError, parse_gear, whole_gpu_placement
from flexpipe.gears.point import MEASURED, GearPoint
from flexpipe.http.client import ClientPool, Timeouts, UpstreamError
from flexpipe.launch import EngineHandle, EngineSpec, Launcher, LaunchError
from flexpipe.model_spec import ModelSpec, load_model_spec
from flexpipe.perf import InfeasibleGear, PerfModel
from flexpipe.perf.gear_lookup import GearQuery

DEFAULT_NUM_REQUESTS = 200


class BenchError(ValueError):
    """A gear_bench run that cannot go on; the message is for the user."""


class EngineDied(BenchError):
    """The engine under test went away in the middle of a sweep point."""


@dataclass(frozen=True, slots=True)
class BenchLoad:
    """The fixed-shape closed-loop load driven at each sweep point."""

    input_len: int = 512
    output_len: int = 128
    num_requests: int = DEFAULT_NUM_REQUESTS
    request_timeout_s: float = 600.0  # modelled seconds a request may take (ttfb / idle)

    def __post_init__(self) -> None:
        if self.input_len < 2 or self.output_len < 2 or self.num_requests < 1:
            raise ValueError("input_len and output_len must be >= 2, num_requests >= 1")


@dataclass(frozen=True, slots=True)
class BenchTarget:
    """A gear and the hardware it runs on, checked against the performance model."""

    gear: Gear
    spec: EngineSpec
    pm: PerfModel
    max_concurrency: int


@dataclass(slots=True)
class LoadResult:
    concurrency: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    peak_kv_usage: float | None = None


def default_sweep(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... and the largest that fits."""
    out = [1]
    while out[-1] * 2 < max_concurrency:
        out.append(out[-1] * 2)
    if out[-1] != max_concurrency:
        out.append(max_concurrency)
    return out


def auto_gears(model: ModelSpec, num_gpus: int, base: Gear | None = None) -> list[Gear]:
    """Every tp x pp that uses at most `num_gpus` GPUs and divides the model's heads."""
    base = base or Gear()
    out = []
    for tp in (1, 2, 4, 8):
        if tp > num_gpus or model.num_heads % tp:
            continue
        for pp in range(1, num_gpus // tp + 1):
            if pp <= model.num_layers:
                out.append(replace(base, tp=tp, pp=pp))
    return out


def max_batch_that_fits(pm: PerfModel, input_len: int, output_len: int) -> int:
    """Largest concurrency whose KV fits with every sequence at full length, capped by the
    gear's max_num_seqs (the top of the default sweep)."""
    return min(pm.gear.max_num_seqs, pm.memory.max_batch(input_len + output_len))


def candidates(
    model: ModelSpec,
    gears: Sequence[Gear],
    workload: BenchLoad,
    gpu_types: Sequence[str] = ("A100-80G-SXM",),
    link: str = "nvlink3",
    sleep_mode: bool = True,
) -> tuple[list[BenchTarget], list[str]]:
    """Gears with their hardware; the second list says, one line each, which gears cannot
    run and why (not enough GPUs, memory). `sleep_mode`: engines start able to sleep, so
    that their wake-ups are measured next to their cold start."""
    out: list[BenchTarget] = []
    rejected: list[str] = []
    for g in gears:
        types = list(gpu_types)
        if len(types) == 1:
            types = types * g.num_gpus
        if len(types) < g.num_gpus:
            rejected.append(f"{g.key()}: needs {g.num_gpus} GPUs, {len(types)} given")
            continue
        types = types[: g.num_gpus]
        try:
            placement = whole_gpu_placement(g, types, link, model.num_layers)
            pm = PerfModel(model, g, placement)
            pm.require_feasible()
            fits = max_batch_that_fits(pm, workload.input_len, workload.output_len)
            if fits < 1:
                raise InfeasibleGear(
                    f"not one {workload.input_len + workload.output_len}-token sequence fits "
                    f"in the KV cache ({pm.memory.kv_capacity_tokens} tokens)"
                )
        except (InfeasibleGear, GearError) as exc:
            rejected.append(f"{g.key()} on {'+'.join(types)}: does not fit: {exc}")
            continue
        uniform = len(set(types)) == 1
        spec = EngineSpec(
            model=model.name,
            gear=g,
            name=f"bench-{g.key()}",
            gpu_type=types[0],
            link=link,
            gpu_indices=tuple(range(g.num_gpus)),
        )
        if sleep_mode:
            spec = with_sleep_mode(spec)
        if not uniform:
            rejected.append(f"{g.key()}: mixed GPU types need a cluster file (flexpipe up)")
            continue
        out.append(BenchTarget(g, spec, pm, fits))
    return out, rejected


def make_prompt(rng: random.Random, num_tokens: int, request_index: int, point: int = 0) -> str:
    """A prompt of about `num_tokens` tokens (exact for the sim's word tokenizer: one word
    each, plus BOS). Each request of each sweep point starts with its own word, so prefix
    caching (within a point or from an earlier point on the same engine) does not hide
    prefill."""
    from flexpipe.engine.tokenizer import WORDS

    words = [w for w in WORDS if w.isalpha()]
    head = [f"p{point}r{request_index}"]
    body = [rng.choice(words) for _ in range(max(0, num_tokens - 2))]
    return " ".join(head + body)


async def _one_request(
    pool: ClientPool,
    endpoint: str,
    body: bytes,
    timeouts: Timeouts,
    result: LoadResult,
    time_scale: float,
    first_token: asyncio.Event | None = None,
) -> None:
    start = time.perf_counter()
    first: float | None = None
    num_chunks = 0
    usage: dict[str, int] = {}
    try:
        resp = await pool.request(
            endpoint,
            "POST",
            "/v1/completions",
            body,
            {"content-type": "application/json"},
            timeouts,
        )
        try:
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                result.errors.append(f"HTTP {resp.status}: {text}")
                return
            buf = b""
            async for chunk in resp.iter_chunks():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = orjson.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    choices = event.get("choices") or []
                    if choices and choices[0].get("text") is not None:
                        if first is None:
                            first = time.perf_counter()
                            if first_token is not None:
                                first_token.set()
                        num_chunks += 1
        finally:
            resp.release()
    except UpstreamError as exc:
        result.errors.append(str(exc))
        return
    end = time.perf_counter()
    if first is None:
        result.errors.append("stream ended without a token")
        return
    num_out = int(usage.get("completion_tokens", num_chunks))
    scale = time_scale or 1.0
    ttft, e2e = (first - start) / scale, (end - start) / scale
    result.ttft_s.append(ttft)
    result.e2e_s.append(e2e)
    if num_out > 1:
        result.tpot_s.append((e2e - ttft) / (num_out - 1))
    result.output_tokens.append(num_out)
    result.prompt_tokens.append(int(usage.get("prompt_tokens", 0)))


async def _scrape_kv(
    pool: ClientPool, endpoint: str, result: LoadResult, stop: asyncio.Event
) -> None:
    """Max of vllm:kv_cache_usage_perc while the point runs."""
    timeouts = Timeouts(connect_s=1.0, ttfb_s=2.0, idle_s=2.0)
    while not stop.is_set():
        with contextlib.suppress(UpstreamError, OSError, ValueError):
            resp = await pool.request(endpoint, "GET", "/metrics", timeouts=timeouts)
            text = (await resp.read()).decode(errors="replace")
            resp.release()
            for line in text.splitlines():
                if line.startswith(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")):
                    value = float(line.rsplit(" ", 1)[1])
                    result.peak_kv_usage = max(result.peak_kv_usage or 0.0, value)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.05):
                await stop.wait()


async def run_load(
    endpoint: str,
    model: str,
    workload: BenchLoad,
    concurrency: int,
    time_scale: float = 1.0,
    seed: int = 0,
    on_done: Callable[[int], None] | None = None,
    engine: EngineHandle | None = None,
) -> LoadResult:
    """A closed loop: `concurrency` clients send the workload's requests back to back
    (staggered start, see below).

    Raises EngineDied when `engine` exits during the point."""
    rng = random.Random(seed * 1_000_003 + concurrency)
    prompts = [
        make_prompt(rng, workload.input_len, i, concurrency) for i in range(workload.num_requests)
    ]
    timeout_s = max(5.0, workload.request_timeout_s * (time_scale or 1.0))
    timeouts = Timeouts(connect_s=5.0, ttfb_s=timeout_s, idle_s=timeout_s)
    result = LoadResult(concurrency, 0.0)
    pool = ClientPool()
    queue = list(range(workload.num_requests))
    queue.reverse()

    # Clients start one after another, each when the previous one's first request has its
    # first token: started together, equal-length requests would stay in lock-step waves
    # (every prompt prefilled in the same step) instead of the steady state a server sees.
    started = [asyncio.Event() for _ in range(concurrency)]

    async def client(k: int) -> None:
        if k > 0:
            await started[k - 1].wait()
        first_request = True
        while queue:
            i = queue.pop()
            body = orjson.dumps(
                {
                    "model": model,
                    "prompt": prompts[i],
                    "max_tokens": workload.output_len,
                    "min_tokens": workload.output_len,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
            await _one_request(
                pool,
                endpoint,
                body,
                timeouts,
                result,
                time_scale,
                started[k] if first_request else None,
            )
            if first_request:
                started[k].set()  # also when the request failed: never block the others
                first_request = False
            if on_done is not None:
                on_done(i)
            if engine is not None and engine.returncode is not None:
                return

    stop = asyncio.Event()
    scraper = asyncio.create_task(_scrape_kv(pool, endpoint, result, stop))
    start = time.perf_counter()
    try:
        await asyncio.gather(*(client(k) for k in range(concurrency)))
    finally:
        stop.set()
        await scraper
        await pool.close()
    result.wall_s = (time.perf_counter() - start) / (time_scale or 1.0)
    if engine is not None and result.errors:
        # Errors may mean the engine died; its exit is noticed a moment after the sockets close.
        for _ in range(40):
            if engine.returncode is not None:
                break
            await asyncio.sleep(0.05)
    if engine is not None and engine.returncode is not None:
        raise EngineDied(f"the engine went away at concurrency {concurrency}")
    return result


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def to_point(
    cand: BenchTarget,
    res: LoadResult,
    workload: BenchLoad,
    engine: str,
    cold_start_s: float | None,
    engine_version: str,
    wakes_s: tuple[float | None, float | None] = (None, None),
) -> GearPoint:
    key = GearQuery.of(cand.pm.model, cand.gear, cand.pm.placement).key
    prefill = [p / t for p, t in zip(res.prompt_tokens, res.ttft_s, strict=True) if t > 0 and p > 0]
    return GearPoint(
        model=key.model,
        gear_key=key.gear_key,
        gear=str(cand.gear),
        gpu_types=key.gpu_types,
        link=key.link,
        batch_size=res.concurrency,
        prefill_tokens_per_s=statistics.fmean(prefill) if prefill else 0.0,
        decode_tokens_per_s=sum(res.output_tokens) / res.wall_s if res.wall_s else 0.0,
        requests_per_s=len(res.e2e_s) / res.wall_s if res.wall_s else 0.0,
        ttft_p50_s=_pct(res.ttft_s, 50),
        ttft_p90_s=_pct(res.ttft_s, 90),
        ttft_p99_s=_pct(res.ttft_s, 99),
        tpot_p50_s=_pct(res.tpot_s, 50),
        tpot_p90_s=_pct(res.tpot_s, 90),
        tpot_p99_s=_pct(res.tpot_s, 99),
        e2e_p50_s=_pct(res.e2e_s, 50),
        e2e_p90_s=_pct(res.e2e_s, 90),
        e2e_p99_s=_pct(res.e2e_s, 99),
        peak_kv_usage=res.peak_kv_usage,
        cold_start_s=cold_start_s,
        source=MEASURED,
        engine=engine,
        engine_version=engine_version,
        input_len=workload.input_len,
        output_len=workload.output_len,
        num_requests=len(res.e2e_s) + len(res.errors),
        num_failed=len(res.errors),
        measured_at=datetime.now(UTC),
        note=f"{res.errors[0]} (+{len(res.errors) - 1} more)" if res.errors else None,
        wake_level1_s=wakes_s[0],
        wake_level2_s=wakes_s[1],
    )


async def measure_wakes(
    url: str, time_scale: float, pool: ClientPool | None = None
) -> tuple[float | None, float | None]:
    """(level-1 wake, level-2 wake) of an idle engine started able to sleep, in modelled
    seconds: each level slept (`POST /sleep?level=N`), then `POST /wake_up` timed and divided
    by the time scale. None for a level the engine refused (it cannot sleep)."""
    own = pool is None
    pool = pool or ClientPool(max_idle_per_backend=1)
    timeouts = Timeouts(3.0, 600.0, 600.0)

    async def post(path: str) -> bool:
        try:
            resp = await pool.request(url, "POST", path, b"", {}, timeouts)
            await resp.read()
            resp.release()
        except UpstreamError:
            return False
        return resp.status == 200

    out: list[float | None] = []
    try:
        for level in (1, 2):
            if not await post(f"/sleep?level={level}"):
                out.append(None)
                continue
            t0 = time.monotonic()
            woke = await post("/wake_up")
            out.append((time.monotonic() - t0) / (time_scale or 1.0) if woke else None)
    finally:
        if own:
            await pool.close()
    return out[0], out[1]


class BenchObserver:
    """Progress hooks (no-op defaults); the CLI draws rich progress bars with them."""

    def gear_started(self, cand: BenchTarget, sweep: Sequence[int]) -> None: ...
    def engine_ready(self, cand: BenchTarget, handle: EngineHandle) -> None: ...
    def point_started(self, cand: BenchTarget, concurrency: int, num_requests: int) -> None: ...
    def request_done(self) -> None: ...
    def point_done(self, cand: BenchTarget, point: GearPoint) -> None: ...
    def gear_failed(self, cand: BenchTarget, message: str) -> None: ...


@dataclass(slots=True)
class BenchReport:
    points: list[GearPoint] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # one line per gear that failed
    rejected: list[str] = field(default_factory=list)  # gears that cannot run here


async def bench(
    cands: Sequence[BenchTarget],
    launcher: Launcher,
    workload: BenchLoad,
    *,
    engine: str = "sim",
    time_scale: float = 1.0,
    concurrencies: Sequence[int] | None = None,
    store_point: Callable[[GearPoint], object] | None = None,
    observer: BenchObserver | None = None,
    report: BenchReport | None = None,
) -> BenchReport:
    """Benchmark each candidate in turn; a failing gear is recorded and the next one runs.
    Cancellation (Ctrl-C) stops the running engine; points already measured are kept (they
    were passed to `store_point` as they came)."""
    obs = observer or BenchObserver()
    out = report if report is not None else BenchReport()
    version = f"flexpipe-sim {__version__}" if engine == "sim" else "vllm"
    for cand in cands:
        sweep = [c for c in (concurrencies or default_sweep(cand.max_concurrency)) if c >= 1]
        too_big = [c for c in sweep if c > cand.max_concurrency]
        sweep = [c for c in sweep if c <= cand.max_concurrency]
        if too_big:
            out.rejected.append(
                f"{cand.gear.key()}: concurrency {','.join(map(str, too_big))} skipped: at most "
                f"{cand.max_concurrency} sequences of "
                f"{workload.input_len + workload.output_len} tokens fit"
            )
        if not sweep:
            continue
        obs.gear_started(cand, sweep)
        try:
            handle = await launcher.start(cand.spec)
        except LaunchError as exc:
            msg = f"{cand.gear.key()}: {exc}"
            out.failures.append(msg)
            obs.gear_failed(cand, msg)
            continue
        try:
            cold = handle.cold_start_s / (time_scale or 1.0)
            obs.engine_ready(cand, handle)
            wakes: tuple[float | None, float | None] = (None, None)
            if cand.spec.enable_sleep_mode:
                wakes = await measure_wakes(handle.endpoint, time_scale)
            for i, conc in enumerate(sweep):
                obs.point_started(cand, conc, workload.num_requests)
                try:
                    res = await run_load(
                        handle.endpoint,
                        cand.spec.served_model_name or cand.spec.model,
                        workload,
                        conc,
                        time_scale,
                        on_done=lambda _i: obs.request_done(),
                        engine=handle,
                    )
                except EngineDied:
                    msg = (
                        f"{cand.gear.key()}: the engine died during the sweep at concurrency "
                        f"{conc} (exit {handle.returncode}); kept {i} measured point(s)"
                    )
                    tail = getattr(handle, "log_tail", None)
                    if callable(tail) and tail():
                        msg += f"; last log lines:\n{tail()}"
                    out.failures.append(msg)
                    obs.gear_failed(cand, msg)
                    break
                if not res.e2e_s:
                    msg = f"{cand.gear.key()}: every request failed at concurrency {conc}: " + (
                        res.errors[0] if res.errors else "no response"
                    )
                    out.failures.append(msg)
                    obs.gear_failed(cand, msg)
                    break
                point = to_point(cand, res, workload, engine, cold, version, wakes)
                out.points.append(point)
                if store_point is not None:
                    store_point(point)
                obs.point_done(cand, point)
        finally:
            await asyncio.shield(handle.stop())
    return out


def parse_gears(text: str, model: ModelSpec, num_gpus: int, base: Gear | None = None) -> list[Gear]:
    """`auto` or gears separated by `;` (`tp=1;tp=2;tp=1,pp=2`)."""
    if text.strip().lower() == "auto":
        return auto_gears(model, num_gpus, base)
    return [parse_gear(part, base) for part in text.split(";") if part.strip()]


def resolve_model(name: str) -> ModelSpec:
    """The model spec, or a BenchError that says what models exist."""
    try:
        return load_model_spec(name)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
