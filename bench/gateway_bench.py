"""Gateway benchmarks (issue 4 §8), all against real sim engines on 127.0.0.1.

    python bench/gateway_bench.py overhead   # flexpipe vs direct: added latency, relay rate
    python bench/gateway_bench.py peers      # flexpipe vs sglang-router vs vllm-router
    python bench/gateway_bench.py quality    # routing quality: shared prefixes, one slow GPU
    python bench/gateway_bench.py all

The load generator is flexpipe's own keep-alive asyncio client (one process, closed loop):
per request it records time to the first body chunk (TTFT), the gaps between chunks and the
end; streamed chunks are counted at SSE event boundaries. Engines run at --time-scale 0 for
the overhead and peer runs (so the engine is not the bottleneck) and at 1 for routing
quality (modelled A100 and L4 timing). Results are printed as JSON lines and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gateway_peers as peers

from flexpipe.http.client import ClientPool, Timeouts, UpstreamError

MODEL = "llama-2-7b"
TIMEOUTS = Timeouts(connect_s=5, ttfb_s=60, idle_s=60)


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


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

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

    def gateway(self, kind: str, backends: list[str], policy: str) -> str:
        port = free_port()
        self.procs.append(peers.start(peers.gateway_command(kind, backends, port, policy)))
        url = f"http://127.0.0.1:{port}"
        wait_up(url, "/v1/models" if kind == "flexpipe" else "/health", 60)
        time.sleep(1.0)  # let health checks / first scrapes settle
        return url

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
    body = body_for("hello there, how are you today?", max_tokens, stream)
    stop_at = time.perf_counter() + duration_s

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            await one_request(pool, url, body, "/v1/completions", stats, stream)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    stats.wall_s = time.perf_counter() - t0
    await pool.close()
    return stats


def run_overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    procs = Procs()
    out = []
    try:
        engines = procs.engines(1, 0.0)
        gw = procs.gateway("flexpipe", engines, "round_robin")
        for stream in (False, True):
            for target, url in (("direct", engines[0]), ("flexpipe", gw)):
                s = asyncio.run(closed_loop(url, 1, args.duration_s, stream)).summary()
                out.append({"bench": "overhead", "conns": 1, "stream": stream,
                            "target": target, **s})  # fmt: skip
        for conns in (64, 256):
            for target, url in (("direct", engines[0]), ("flexpipe", gw)):
                s = asyncio.run(closed_loop(url, conns, args.duration_s, True)).summary()
                out.append({"bench": "overhead", "conns": conns, "stream": True,
                            "target": target, **s})  # fmt: skip
    finally:
        procs.stop()
    return out


def run_peers(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    have = peers.available()
    gateways = [("flexpipe", "round_robin")]
    for kind in ("sglang-router", "vllm-router"):
        if have[kind]:
            gateways.append((kind, "round_robin"))
    procs = Procs()
    try:
        engines = procs.engines(3, 0.0)
        for kind, policy in gateways:
            gw = procs.gateway(kind, engines, policy)
            for conns in (1, 64):
                s = asyncio.run(closed_loop(gw, conns, args.duration_s, True)).summary()
                out.append({"bench": "peers", "gateway": kind, "policy": policy,
                            "conns": conns, **s})  # fmt: skip
            procs.procs[-1].kill()
            procs.procs[-1].wait(10)
            procs.procs.pop()
    finally:
        procs.stop()
    return out


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


async def open_loop(url: str, prompts: list[str], rate_per_s: float, seed: int) -> Stats:
    pool = ClientPool()
    stats = Stats()
    rng = random.Random(seed)
    tasks = []
    t0 = time.perf_counter()
    for p in prompts:
        tasks.append(
            asyncio.create_task(
                one_request(pool, url, body_for(p, 24, True), "/v1/completions", stats, True)
            )
        )
        await asyncio.sleep(rng.expovariate(rate_per_s))
    await asyncio.gather(*tasks)
    stats.wall_s = time.perf_counter() - t0
    await pool.close()
    return stats


QUALITY_RUNS = [
    ("flexpipe", "round_robin"),
    ("flexpipe", "least_load"),
    ("flexpipe", "prefix_affinity"),
    ("flexpipe", "composite"),
    ("sglang-router", "cache_aware"),
    ("vllm-router", "cache_aware"),
]


def run_quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    prompts = make_workload(0, args.num_requests)
    have = peers.available()
    for kind, policy in QUALITY_RUNS:
        if kind != "flexpipe" and not have[kind]:
            continue
        if args.only and f"{kind}:{policy}" not in args.only.split(","):
            continue
        procs = Procs()
        try:
            engines = procs.engines(3, 1.0, ["A100-80G-SXM", "A100-80G-SXM", "L4"])
            gw = procs.gateway(kind, engines, policy)
            h0, q0 = engine_prefix_counts(engines)
            s = asyncio.run(open_loop(gw, prompts, args.rate, 1)).summary()
            h1, q1 = engine_prefix_counts(engines)
            hit = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
            out.append({"bench": "quality", "gateway": kind, "policy": policy,
                        "prefix_hit_rate": round(hit, 3), **s})  # fmt: skip
            print(json.dumps(out[-1]), flush=True)
        finally:
            procs.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["overhead", "peers", "quality", "all"])
    ap.add_argument("--duration-s", type=float, default=8.0)
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=12.0, help="quality: requests/s (Poisson)")
    ap.add_argument("--only", default="", help="quality: kind:policy,... to run")
    args = ap.parse_args()
    results = []
    if args.what in ("overhead", "all"):
        results += run_overhead(args)
    if args.what in ("peers", "all"):
        results += run_peers(args)
    if args.what in ("quality", "all"):
        results += run_quality(args)
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
