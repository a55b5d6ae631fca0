"""Gateway benchmarks (docs/gateway.md), all against real sim engines on 127.0.0.1.

    python bench/gateway_bench.py overhead  # saturated throughput: flexpipe vs direct
    python bench/gateway_bench.py latency   # added latency when NOT saturated
    python bench/gateway_bench.py peers     # flexpipe vs sglang-router vs vllm-router
    python bench/gateway_bench.py quality   # routing quality: policy/weight sweep, seeds,
                                            # then the example's unequal pool (capacity)
    python bench/gateway_bench.py capacity  # only the unequal pool: concurrency sweep
    python bench/gateway_bench.py shared_state  # a tenant request's cost with workers/replicas
    python bench/gateway_bench.py all

Every comparison runs its targets side by side in one run, interleaved round by round
(`--rounds`, default 3, the order rotated each round), and reports medians over the rounds:
the machine is shared, so one run of one target against a later run of another measures the
neighbours. Each row also records the 1-minute load average and, for flexpipe, the gateway
process's CPU time per request and per streamed chunk (from /proc): a cost that contention
does not inflate the way it inflates throughput and tail latency.

- overhead: one engine at time scale 0 (no modelled GPU time), closed loop (each client
  sends its next request as soon as the last ends): 1 connection (streaming and not), 64 and
  256 streams. At 64+ streams the machine is saturated, so these rows are throughput; their
  latency is mostly queueing for the CPU.
- latency: the added latency the issue's target means, on an unsaturated system:
  (a) 64 concurrent streams against an engine at time scale 1 (a modelled A100 decode, tens
  of ms per token step), (b) an open-loop Poisson rate well below saturation at time scale 0.
  Added = flexpipe minus direct, per round, then the median over rounds.
- quality: shared prefixes (4 long system prompts, 48 multi-turn sessions), a heterogeneous
  pool (2 x A100 + 1 x L4 at time scale 1), Poisson arrivals; each policy / weight variant
  and peer runs once per seed on fresh engines; medians over seeds of TTFT p99 and the
  engines' prefix-cache hit rate.
- capacity (part of quality; alone: `capacity`): the pool `flexpipe up` / `make run` starts
  for the built-in example (the same planner and launcher: TP2 on two A100s with 48 slots,
  an L40S with 16, an L4 with 2; sim engines at time scale 1), one gateway with only the
  engines' URLs (`--baseline` adds the same from another checkout, alternating on the same
  engines), closed loops of streamed chats (512-token prompts, new each run; 128 tokens out)
  at `--concurrencies` up to past the pool's 66 slots: TTFT p50/p99, output tokens/s counted
  inside the window, 429s, and each instance's share of requests.

The load generator is flexpipe's own keep-alive asyncio client in this process: per request
it records time to the first body chunk (TTFT), the gaps between chunks and the end;
streamed chunks are counted at SSE event boundaries. Results print as JSON lines, then a
markdown table of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gateway_peers as peers

from flexpipe.http.client import ClientPool, Timeouts, UpstreamError

MODEL = "llama-2-7b"
TIMEOUTS = Timeouts(connect_s=5, ttfb_s=60, idle_s=60)
SHORT_PROMPT = "hello there, how are you today?"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(url: str, path: str = "/health", timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + path, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url}{path} did not come up")


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process and its live descendants (a gateway's workers)
    have used (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    return total + sum(cpu_s(c) for c in children)


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pids: dict[str, int] = {}  # gateway url -> pid

    def engines(self, n: int, time_scale: float, gpu_types: list[str] | None = None) -> list[str]:
        urls = []
        for i in range(n):
            port = free_port()
            cmd = [sys.executable, "-m", "flexpipe.engine.sim", "--model", MODEL, "--port",
                   str(port), "--time-scale", str(time_scale), "--load-time-s", "0",
                   "--seed", str(i)]  # fmt: skip
            if gpu_types:
                cmd += ["--gpu-type", gpu_types[i]]
            self.procs.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_up(u)
        return urls

    def gateway(
        self,
        kind: str,
        backends: list[str],
        policy: str,
        config: Path | None = None,
        tree: Path | None = None,
        workers: int | None = 1,
    ) -> str:
        """`workers`: flexpipe's (1 unless asked: today's single process); a baseline
        checkout gets no `--workers` flag."""
        port = free_port()
        workers = None if tree is not None or kind != "flexpipe" else workers
        cmd = peers.gateway_command(kind, backends, port, policy, config, workers)
        proc = peers.start(cmd, tree)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        self.pids[url] = proc.pid
        wait_up(url, "/v1/models" if kind == "flexpipe" else "/health", 60)
        time.sleep(1.0)  # let health checks / first scrapes settle
        return url

    def stop_last(self) -> None:
        p = self.procs.pop()
        p.kill()
        p.wait(10)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(10)
        self.procs = []


@dataclass
class Stats:
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    num_errors: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, float]:
        def pct(xs: list[float], q: float) -> float:
            if not xs:
                return float("nan")
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

        n = len(self.latencies_s)
        return {
            "requests": n,
            "errors": self.num_errors,
            "req_per_s": round(n / self.wall_s, 1),
            "chunks_per_s": round(self.num_chunks / self.wall_s, 1),
            "lat_p50_ms": round(pct(self.latencies_s, 0.5), 3),
            "lat_p99_ms": round(pct(self.latencies_s, 0.99), 3),
            "ttft_p50_ms": round(pct(self.ttfts_s, 0.5), 3),
            "ttft_p99_ms": round(pct(self.ttfts_s, 0.99), 3),
            "itl_p99_ms": round(pct(self.itls_s, 0.99), 3),
        }


async def one_request(
    pool: ClientPool, url: str, body: bytes, path: str, stats: Stats, stream: bool
) -> None:
    t0 = time.perf_counter()
    try:
        resp = await pool.request(
            url, "POST", path, body, {"content-type": "application/json"}, TIMEOUTS
        )
        t_prev = 0.0
        first = True
        while (chunk := await resp.next_chunk()) is not None:
            now = time.perf_counter()
            if stream:
                stats.num_chunks += chunk.count(b"\n\n")
            if first:
                stats.ttfts_s.append(now - t0)
                first = False
            else:
                stats.itls_s.append(now - t_prev)
            t_prev = now
        resp.release()
        if resp.status != 200:
            stats.num_errors += 1
            return
        stats.latencies_s.append(time.perf_counter() - t0)
    except UpstreamError:
        stats.num_errors += 1


def body_for(prompt: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
         "ignore_eos": True}
    ).encode()  # fmt: skip


async def closed_loop(
    url: str, concurrency: int, duration_s: float, stream: bool, max_tokens: int = 16
) -> Stats:
    pool = ClientPool()
    stats = Stats()
    body = body_for(SHORT_PROMPT, max_tokens, stream)
    stop_at = time.perf_counter() + duration_s

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            await one_request(pool, url, body, "/v1/completions", stats, stream)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    stats.wall_s = time.perf_counter() - t0
    await pool.close()
    return stats


async def open_loop(url: str, bodies: Sequence[bytes], rate_per_s: float, seed: int) -> Stats:
    """Send `bodies` (streaming) at Poisson arrivals of `rate_per_s`, not waiting for answers."""
    pool = ClientPool()
    stats = Stats()
    rng = random.Random(seed)
    tasks = []
    t0 = time.perf_counter()
    next_s = t0
    for body in bodies:
        tasks.append(
            asyncio.create_task(one_request(pool, url, body, "/v1/completions", stats, True))
        )
        next_s += rng.expovariate(rate_per_s)
        await asyncio.sleep(max(0.0, next_s - time.perf_counter()))
    await asyncio.gather(*tasks)
    stats.wall_s = time.perf_counter() - t0
    await pool.close()
    return stats


def measured(procs: Procs, url: str, load: Coroutine[Any, Any, Stats]) -> dict[str, Any]:
    """Run one load against `url`; add the load average and, for a gateway we started, its
    CPU time per request and per chunk."""
    pid = procs.pids.get(url)
    c0 = cpu_s(pid) if pid else 0.0
    load0 = load_1m()
    stats = asyncio.run(load)
    out: dict[str, Any] = {**stats.summary(), "load_1m": [load0, load_1m()]}
    if pid:
        used_s = cpu_s(pid) - c0
        out["gw_cpu_us_per_req"] = round(used_s / max(1, len(stats.latencies_s)) * 1e6, 1)
        if stats.num_chunks:
            out["gw_cpu_us_per_chunk"] = round(used_s / stats.num_chunks * 1e6, 2)
    return out


def rotated(items: list[Any], k: int) -> list[Any]:
    k %= len(items)
    return items[k:] + items[:k]


def median_rows(rows: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """Group rows by `keys` and take the median of every numeric column."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for key, rs in groups.items():
        m: dict[str, Any] = dict(zip(keys, key, strict=True))
        m["runs"] = len(rs)
        for col, v in rs[0].items():
            if col in keys or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            vals = [r[col] for r in rs if isinstance(r.get(col), int | float)]
            m[col] = round(statistics.median(vals), 3)
        loads = [x for r in rs for x in r.get("load_1m", [])]
        if loads:
            m["load_1m"] = f"{min(loads):.1f}-{max(loads):.1f}"
        out.append(m)
    return out


def print_table(title: str, rows: list[dict[str, Any]], cols: list[str]) -> None:
    print(f"\n### {title} (medians; {os.cpu_count()} CPUs)")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


def emit(row: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(row), flush=True)
    return row


# ----------------------------------------------------------------------- overhead (saturated)
OVERHEAD_CASES = [(1, False), (1, True), (64, True), (256, True)]  # (connections, stream)


def run_overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    procs = Procs()
    rows = []
    try:
        engines = procs.engines(1, 0.0)
        gw = procs.gateway("flexpipe", engines, "round_robin")
        targets = [("direct", engines[0]), ("flexpipe", gw)]
        if args.baseline:
            base = procs.gateway("flexpipe", engines, "round_robin", tree=args.baseline)
            targets.append(("flexpipe-baseline", base))
        conns_asked = {int(c) for c in args.conns.split(",")} if args.conns else None
        cases = [c for c in OVERHEAD_CASES if conns_asked is None or c[0] in conns_asked]
        for r in range(args.rounds):
            for conns, stream in cases:
                for target, url in rotated(targets, r):
                    s = measured(procs, url, closed_loop(url, conns, args.duration_s, stream))
                    rows.append(emit({"bench": "overhead", "conns": conns, "stream": stream,
                                      "target": target, "round": r, **s}))  # fmt: skip
    finally:
        procs.stop()
    med = median_rows(rows, ["conns", "stream", "target"])
    print_table("overhead: closed loop, 1 engine at time scale 0", med,
                ["conns", "stream", "target", "req_per_s", "chunks_per_s", "lat_p50_ms",
                 "lat_p99_ms", "gw_cpu_us_per_req", "gw_cpu_us_per_chunk", "load_1m"])  # fmt: skip
    return rows


# ----------------------------------------------------------------------- latency (unsaturated)
def _added(rows: list[dict[str, Any]], case: str, target: str) -> dict[str, Any]:
    """Per round: `target` minus direct; median over rounds."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["case"] == case:
            by_round.setdefault(r["round"], {})[r["target"]] = r
    out: dict[str, Any] = {"case": case, "target": target}
    for col in ("lat_p50_ms", "lat_p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
        diffs = [
            pair[target][col] - pair["direct"][col]
            for pair in by_round.values()
            if target in pair and "direct" in pair
        ]
        out[f"added_{col}"] = round(statistics.median(diffs), 3) if diffs else None
    return out


def run_latency(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    # (a) 64 streams at time scale 1: the engine's modelled decode paces every stream.
    procs = Procs()
    try:
        engines = procs.engines(1, 1.0, ["A100-80G-SXM"])
        gw = procs.gateway("flexpipe", engines, "round_robin")
        targets = [("direct", engines[0]), ("flexpipe", gw)]
        if args.baseline:
            base = procs.gateway("flexpipe", engines, "round_robin", tree=args.baseline)
            targets.append(("flexpipe-baseline", base))
        case = f"64 streams, time scale 1, {args.latency_tokens} tokens"
        for r in range(args.rounds):
            for target, url in rotated(targets, r):
                load = closed_loop(url, 64, args.duration_s, True, args.latency_tokens)
                s = measured(procs, url, load)
                rows.append(emit({"bench": "latency", "case": case, "target": target,
                                  "round": r, **s}))  # fmt: skip
    finally:
        procs.stop()
    # (b) open loop below saturation at time scale 0: the gateway's own cost plus queueing.
    procs = Procs()
    try:
        engines = procs.engines(1, 0.0)
        gw = procs.gateway("flexpipe", engines, "round_robin")
        targets = [("direct", engines[0]), ("flexpipe", gw)]
        if args.baseline:
            base = procs.gateway("flexpipe", engines, "round_robin", tree=args.baseline)
            targets.append(("flexpipe-baseline", base))
        case_b = f"open loop {args.open_rate:g} req/s, time scale 0, 16 tokens"
        bodies = [body_for(SHORT_PROMPT, 16, True)] * int(args.open_rate * args.duration_s)
        for r in range(args.rounds):
            for target, url in rotated(targets, r):
                s = measured(procs, url, open_loop(url, bodies, args.open_rate, r))
                rows.append(emit({"bench": "latency", "case": case_b, "target": target,
                                  "round": r, **s}))  # fmt: skip
    finally:
        procs.stop()
    med = median_rows(rows, ["case", "target"])
    print_table("latency: unsaturated", med,
                ["case", "target", "req_per_s", "lat_p50_ms", "lat_p99_ms", "ttft_p50_ms",
                 "ttft_p99_ms", "gw_cpu_us_per_req", "load_1m"])  # fmt: skip
    gateways = [t for t in dict.fromkeys(r["target"] for r in rows) if t != "direct"]
    added = [_added(rows, c, t) for c in dict.fromkeys(r["case"] for r in rows) for t in gateways]
    print_table("latency: added by the gateway (gateway - direct per round)", added,
                ["case", "target", "added_lat_p50_ms", "added_lat_p99_ms", "added_ttft_p50_ms",
                 "added_ttft_p99_ms"])  # fmt: skip
    return rows


# ----------------------------------------------------------------------- peers
def run_peers(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    have = peers.available()
    kinds = ["flexpipe"] + [k for k in ("sglang-router", "vllm-router") if have[k]]
    procs = Procs()
    try:
        engines = procs.engines(3, 0.0)
        gws = [(k, procs.gateway(k, engines, "round_robin")) for k in kinds]
        if args.workers > 1:  # every core: N workers on one port
            multi = procs.gateway("flexpipe", engines, "round_robin", workers=args.workers)
            gws.insert(1, (f"flexpipe-w{args.workers}", multi))
        if args.baseline:
            base = procs.gateway("flexpipe", engines, "round_robin", tree=args.baseline)
            gws.append(("flexpipe-baseline", base))
        for r in range(args.rounds):
            for conns in (1, 64):
                for kind, url in rotated(gws, r):
                    s = measured(procs, url, closed_loop(url, conns, args.duration_s, True))
                    rows.append(emit({"bench": "peers", "gateway": kind, "policy": "round_robin",
                                      "conns": conns, "round": r, **s}))  # fmt: skip
    finally:
        procs.stop()
    med = median_rows(rows, ["conns", "gateway"])
    base = {m["conns"]: m["req_per_s"] for m in med if m["gateway"] == "flexpipe"}
    for m in med:
        m["flexpipe_ratio"] = round(base[m["conns"]] / m["req_per_s"], 2) if m["req_per_s"] else ""
    vllm = {m["conns"]: m["req_per_s"] for m in med if m["gateway"] == "vllm-router"}
    for m in med:  # each gateway's req/s over vllm-router's (the target: >= 1.0 at 2 workers)
        v = vllm.get(m["conns"])
        m["vs_vllm_router"] = round(m["req_per_s"] / v, 2) if v else ""
    print_table("peers: 3 engines at time scale 0, round_robin, closed loop", med,
                ["conns", "gateway", "req_per_s", "chunks_per_s", "lat_p50_ms", "lat_p99_ms",
                 "flexpipe_ratio", "vs_vllm_router", "gw_cpu_us_per_req",
                 "load_1m"])  # fmt: skip
    return rows


# ----------------------------------------------------------------------- shared state
async def _tenant_round_trips(state: Any, n: int, concurrency: int) -> tuple[float, float]:
    """(wall µs, CPU µs of this process) per tenant admit + end through `state`."""

    async def loop(k: int) -> None:
        for _ in range(k):
            await state.tenant_admit("0:a", 300.0)
            state.tenant_end("0:a", 300.0, 250.0)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(loop(n // concurrency) for _ in range(concurrency)))
    await asyncio.sleep(0.05)  # the last ends
    return (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6


def run_shared_state(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What a request of a tenant with a budget pays with workers (the embedded state
    service; its CPU on both sides, in this one process) or replicas (Redis, when
    `redis-server` is on PATH: this process's CPU, Redis's apart)."""
    import shutil

    from flexpipe.gateway.config import SharedStateConfig, TenantConfig
    from flexpipe.gateway.redis_state import RedisState
    from flexpipe.gateway.state_service import EmbeddedState, StateService

    tenants = [TenantConfig("k", "a", requests_per_min=1e12, tokens_per_min=1e15)]
    rows = []

    async def noop_ask(kind: str, body: dict[str, Any]) -> None:
        del kind, body

    async def embedded(conc: int) -> tuple[float, float]:
        with tempfile.TemporaryDirectory() as tmp:
            svc = StateService(f"{tmp}/s.sock", tenants)
            await svc.start()
            st = EmbeddedState(f"{tmp}/s.sock", "0")
            await st.start(lambda op: None, lambda u, h: None, noop_ask)
            out = await _tenant_round_trips(st, args.round_trips, conc)
            await st.close()
            await svc.close()
            return out

    async def redis(url: str, conc: int) -> tuple[float, float]:
        st = RedisState(SharedStateConfig(url=url), tenants, "bench")
        await st.start(lambda op: None, lambda u, h: None, noop_ask)
        out = await _tenant_round_trips(st, args.round_trips, conc)
        await st.close()
        return out

    redis_proc = None
    backends: list[tuple[str, Any]] = [("embedded", embedded)]
    if shutil.which("redis-server"):
        port = free_port()
        redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        time.sleep(0.5)
        url = f"redis://127.0.0.1:{port}/0"
        backends.append(("redis", lambda conc: redis(url, conc)))
    try:
        for r in range(args.rounds):
            for name, fn in backends:
                for conc in (1, 64):
                    wall_us, cpu_us = asyncio.run(fn(conc))
                    rows.append(emit({"bench": "shared_state", "backend": name, "conc": conc,
                                      "round": r, "wall_us_per_req": round(wall_us, 1),
                                      "cpu_us_per_req": round(cpu_us, 1)}))  # fmt: skip
    finally:
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait(5)
    med = median_rows(rows, ["backend", "conc"])
    print_table("shared state: a tenant's admit + end per request", med,
                ["backend", "conc", "wall_us_per_req", "cpu_us_per_req"])  # fmt: skip
    return rows


# ----------------------------------------------------------------------- routing quality
def engine_prefix_counts(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        with urllib.request.urlopen(u + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def make_workload(seed: int, num_requests: int) -> list[str]:
    """A few long system prompts shared by many users, multi-turn sessions."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(500)]
    systems = [" ".join(rng.choice(words) for _ in range(400)) for _ in range(4)]
    sessions: list[list[str]] = []
    for u in range(48):
        sessions.append([f"System: {systems[u % len(systems)]}\nUser {u}: hello"])
    prompts = []
    for _ in range(num_requests):
        s = rng.choice(sessions)
        turn = " ".join(rng.choice(words) for _ in range(30))
        s.append(s[-1] + f"\nAssistant: ok\nUser: {turn}")
        prompts.append(s[-1])
    return prompts


# name -> (gateway kind, policy, flexpipe routing params or None = that policy's defaults)
QUALITY_VARIANTS: dict[str, tuple[str, str, dict[str, Any] | None]] = {
    "round_robin": ("flexpipe", "round_robin", None),
    "least_load": ("flexpipe", "least_load", None),
    "prefix_affinity": ("flexpipe", "prefix_affinity", None),  # the default: imbalance 3 / 2 s
    "prefix_affinity imb2 abs1": ("flexpipe", "prefix_affinity",
                                  {"imbalance_ratio": 2.0, "imbalance_abs_s": 1.0}),
    "prefix_affinity imb1.5": ("flexpipe", "prefix_affinity",
                               {"imbalance_ratio": 1.5, "imbalance_abs_s": 1.0}),
    "prefix_affinity bound2": ("flexpipe", "prefix_affinity",
                               {"imbalance_ratio": 2.0, "imbalance_abs_s": 1.0, "load_bound": 2.0}),
    "composite": ("flexpipe", "composite", None),  # its defaults: p3 q1 kv1 l3
    "composite p3 q2 kv2 l2": ("flexpipe", "composite",
                               {"weights": {"prefix": 3, "queue": 2, "kv": 2, "load": 2}}),
    "composite p3 q2 kv2 (llm-d)": ("flexpipe", "composite",
                                    {"weights": {"prefix": 3, "queue": 2, "kv": 2}}),
    "composite p3 q1 l3": ("flexpipe", "composite",
                           {"weights": {"prefix": 3, "queue": 1, "load": 3}}),
    "composite p4 q1 l3": ("flexpipe", "composite",
                           {"weights": {"prefix": 4, "queue": 1, "load": 3}}),
    "composite p2 l2": ("flexpipe", "composite", {"weights": {"prefix": 2, "load": 2}}),
    "composite p3 l2": ("flexpipe", "composite", {"weights": {"prefix": 3, "load": 2}}),
    "composite p3 l1": ("flexpipe", "composite", {"weights": {"prefix": 3, "load": 1}}),
    "sglang cache_aware": ("sglang-router", "cache_aware", None),
    "vllm-router cache_aware": ("vllm-router", "cache_aware", None),
}  # fmt: skip


def run_quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    have = peers.available()
    names = [n.strip() for n in args.only.split(",")] if args.only else list(QUALITY_VARIANTS)
    seeds = [int(x) for x in args.seeds.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="flexpipe-bench-"))
    for seed in seeds:
        prompts = make_workload(seed, args.num_requests)
        bodies = [body_for(p, 24, True) for p in prompts]
        runs = [(n, None) for n in names]
        if args.baseline:  # the same flexpipe variants from another checkout, side by side
            runs += [(n, args.baseline) for n in names if QUALITY_VARIANTS[n][0] == "flexpipe"]
        for name, tree in rotated(runs, seed * len(runs) // max(1, len(seeds))):
            kind, policy, params = QUALITY_VARIANTS[name]
            if kind != "flexpipe" and not have[kind]:
                continue
            config = None
            if params is not None:
                config = tmp / f"{abs(hash(name))}.json"  # JSON is YAML
                config.write_text(json.dumps({"routing": {"policy": policy, "params": params}}))
            procs = Procs()
            try:
                engines = procs.engines(3, 1.0, ["A100-80G-SXM", "A100-80G-SXM", "L4"])
                gw = procs.gateway(kind, engines, policy, config, tree)
                h0, q0 = engine_prefix_counts(engines)
                s = measured(procs, gw, open_loop(gw, bodies, args.rate, seed))
                h1, q1 = engine_prefix_counts(engines)
                hit = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
                variant = name if tree is None else f"{name} (baseline)"
                row = {"bench": "quality", "variant": variant, "seed": seed, "rate": args.rate,
                       "prefix_hit_rate": round(hit, 3), **s}  # fmt: skip
                rows.append(emit(row))
            finally:
                procs.stop()
    med = median_rows(rows, ["variant"])
    med.sort(key=lambda m: m["ttft_p99_ms"])
    print_table(f"quality: {args.num_requests} requests at {args.rate:g} req/s, seeds {args.seeds}",
                med, ["variant", "prefix_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "lat_p99_ms",
                      "errors", "load_1m"])  # fmt: skip
    return rows


# ----------------------------------------------------------------------- the example's pool
EXAMPLE_MODEL = "llama-7b"  # the served name in examples/models/llama-7b.yaml
JSON_HEADERS = {"content-type": "application/json"}


@dataclass
class ExampleEngine:
    name: str
    url: str
    max_num_seqs: int
    gpus: str


def start_example_engines(procs: Procs, time_scale: float = 1.0) -> list[ExampleEngine]:
    """The engines `flexpipe up` starts for the built-in example: its planner, its launcher."""
    from flexpipe.cluster import load_cluster
    from flexpipe.control.engines.launching import engine_spec, load_models
    from flexpipe.examples import DEFAULT_CLUSTER, DEFAULT_MODELS
    from flexpipe.launch import LocalLauncher
    from flexpipe.perf.gear_lookup import GearLookup
    from flexpipe.policies.planner import plan

    cluster = load_cluster(DEFAULT_CLUSTER)
    demands = load_models(DEFAULT_MODELS)
    the_plan = plan(cluster, demands, GearLookup(()))
    launcher = LocalLauncher("sim", time_scale=time_scale, sim_load_time_s=0.0)
    out = []
    for inst in the_plan.instances:
        spec = engine_spec(inst, cluster, str(DEFAULT_CLUSTER), demands)
        port = free_port()
        argv, env = launcher.command(spec, port)
        procs.procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        url = f"http://127.0.0.1:{port}"
        out.append(ExampleEngine(inst.name, url, inst.gear.max_num_seqs, "+".join(spec.gpu_ids)))
    for e in out:
        wait_up(e.url)
    return out


def chat_bodies(seed: int, n: int, num_prompt_words: int, max_tokens: int) -> list[bytes]:
    """Distinct prompts (no prefix shared across requests or runs), streamed, fixed output."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(2000)]
    out = []
    for i in range(n):
        text = f"{seed}-{i} " + " ".join(rng.choice(words) for _ in range(num_prompt_words))
        body = {"model": EXAMPLE_MODEL, "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
        out.append(json.dumps(body).encode())
    return out


async def window_loop(
    url: str, bodies: Sequence[bytes], concurrency: int, duration_s: float
) -> dict[str, Any]:
    """Closed loop: `concurrency` clients send the next body as soon as the last ends, for
    `duration_s`. Output tokens are counted inside the window only (the tail, while the last
    requests finish, does not dilute throughput); TTFT of every request started in it."""
    pool = ClientPool()
    ttfts: list[float] = []
    per_instance: dict[str, int] = {}
    num_errors = num_tokens_in_window = 0
    next_body = 0
    t0 = time.perf_counter()
    stop_at = t0 + duration_s

    async def worker() -> None:
        nonlocal next_body, num_errors, num_tokens_in_window
        while time.perf_counter() < stop_at:
            body = bodies[next_body % len(bodies)]
            next_body += 1
            t_start = time.perf_counter()
            try:
                resp = await pool.request(
                    url, "POST", "/v1/chat/completions", body, JSON_HEADERS, TIMEOUTS
                )
                first = True
                while (chunk := await resp.next_chunk()) is not None:
                    now = time.perf_counter()
                    # token events only (vLLM's first chat event carries the role, no token)
                    num_tokens = chunk.count(b'"delta":{"content":')
                    if first and num_tokens and resp.status == 200:
                        ttfts.append(now - t_start)
                        first = False
                    if now < stop_at:
                        num_tokens_in_window += num_tokens
                resp.release()
                if resp.status != 200:
                    num_errors += 1
                    await asyncio.sleep(0.1)  # a 429: back off a little, as a client would
                    continue
                inst = resp.headers.get("x-flexpipe-instance", "?")
                per_instance[inst] = per_instance.get(inst, 0) + 1
            except UpstreamError:
                num_errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await pool.close()

    def pct(q: float) -> float:
        xs = sorted(ttfts)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else float("nan")

    return {
        "requests": sum(per_instance.values()),
        "errors": num_errors,
        "ttft_p50_ms": pct(0.5),
        "ttft_p99_ms": pct(0.99),
        "tok_per_s": round(num_tokens_in_window / duration_s, 1),
        "per_instance": per_instance,
    }


def run_capacity(args: argparse.Namespace) -> list[dict[str, Any]]:
    procs = Procs()
    rows: list[dict[str, Any]] = []
    concurrencies = [int(x) for x in args.concurrencies.split(",")]
    try:
        engines = start_example_engines(procs)
        urls = [e.url for e in engines]
        gws = [("flexpipe", procs.gateway("flexpipe", urls, "prefix_affinity"))]
        if args.baseline:
            base = procs.gateway("flexpipe", urls, "prefix_affinity", tree=args.baseline)
            gws.append(("flexpipe-baseline", base))
        print(json.dumps({"pool": [e.__dict__ for e in engines]}), flush=True)
        run = 0
        for r in range(args.rounds):
            for c in concurrencies:
                for target, url in rotated(gws, r):
                    run += 1
                    bodies = chat_bodies(run, 4 * c + 64, 500, 128)  # ~512 tokens
                    load0 = load_1m()
                    res = asyncio.run(window_loop(url, bodies, c, args.capacity_duration_s))
                    per = res.pop("per_instance")
                    n = max(1, res["requests"])
                    shares = "/".join(f"{100 * per.get(e.url, 0) / n:.0f}" for e in engines)
                    rows.append(emit({"bench": "capacity", "gateway": target, "conc": c,
                                      "round": r, **res, "share_pct": shares,
                                      "load_1m": [load0, load_1m()]}))  # fmt: skip
    finally:
        procs.stop()
    med = median_rows(rows, ["conc", "gateway"])
    for m in med:  # shares are strings: keep the last round's
        m["share_pct"] = next(
            x["share_pct"] for x in reversed(rows)
            if (x["conc"], x["gateway"]) == (m["conc"], m["gateway"])
        )  # fmt: skip
    med.sort(key=lambda m: (m["conc"], m["gateway"]))
    title = (f"capacity: the example's pool (48/16/2 slots), closed loop, 128 tokens out, "
             f"{args.capacity_duration_s:g} s windows")  # fmt: skip
    print_table(title, med, ["conc", "gateway", "requests", "errors", "ttft_p50_ms",
                             "ttft_p99_ms", "tok_per_s", "share_pct", "load_1m"])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", nargs="?", default="overhead",
                    choices=["overhead", "latency", "peers", "quality", "capacity",
                             "shared_state", "all"])  # fmt: skip
    ap.add_argument("--duration-s", type=float, default=4.0, help="per run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--latency-tokens", type=int, default=32, help="latency (a): max_tokens")
    ap.add_argument("--open-rate", type=float, default=400.0, help="latency (b): req/s")
    ap.add_argument("--num-requests", type=int, default=240, help="quality: per run")
    ap.add_argument("--rate", type=float, default=24.0, help="quality: requests/s (Poisson)")
    ap.add_argument("--seeds", default="0,1,2", help="quality: workload and arrival seeds")
    ap.add_argument("--only", default="", help="quality: variant names, comma-separated")
    ap.add_argument("--conns", default="", help="overhead: only these connection counts (1,64)")
    ap.add_argument("--concurrencies", default="8,32,64,96", help="capacity: closed loops")
    ap.add_argument("--capacity-duration-s", type=float, default=20.0, help="capacity: window")
    ap.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="peers: flexpipe also with this many workers (1: not) [the cores]",
    )
    ap.add_argument("--round-trips", type=int, default=20000, help="shared_state: per run")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="overhead, latency, peers, capacity: also run the gateway from this\n"
                         "checkout "
                         "(e.g. `git worktree add /tmp/base <commit>`), side by side")  # fmt: skip
    args = ap.parse_args(argv)
    print(json.dumps({"machine": {"cpus": os.cpu_count(), "load_1m": load_1m()}}), flush=True)
    if args.what in ("overhead", "all"):
        run_overhead(args)
    if args.what in ("latency", "all"):
        run_latency(args)
    if args.what in ("peers", "all"):
        run_peers(args)
    if args.what in ("shared_state", "all"):
        run_shared_state(args)
    if args.what in ("quality", "all"):
        run_quality(args)
    if args.what in ("quality", "capacity", "all"):
        run_capacity(args)


if __name__ == "__main__":
    main()
