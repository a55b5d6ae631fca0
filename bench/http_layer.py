"""flexpipe's own HTTP layer against uvicorn (httptools + uvloop), side by side in one run, on
the gateway's and the sim engine's workloads (docs/http.md).

    python bench/http_layer.py            # or: python -m bench http_layer
    python bench/http_layer.py --duration-s 5 --rounds 3 --events 16

Processes: one fixed upstream (a raw asyncio + httptools server, the same for every target)
that streams `--events` SSE events, each its own write one loop pass apart, or answers a small
JSON body; then one server process per target (`flexpipe` = flexpipe.http, `uvicorn` = an ASGI
app on uvicorn with `loop="uvloop", http="httptools"`), each serving four endpoints:

- `POST /relay`: the gateway's streaming relay: forward the body to the upstream's stream with
  `flexpipe.http.client.ClientPool` and relay the events as they arrive. flexpipe: the
  gateway's push style (`PushResponse`, `UpstreamResponse.pipe`, one write per loop pass);
  uvicorn: the idiomatic ASGI relay (`async for chunk in resp.iter_chunks(): await send(...)`).
- `POST /proxy`: the gateway's non-streaming proxy: forward, read the JSON body, answer it.
- `GET /sse`: the engine's stream: `--events` events, one per loop pass (flexpipe: the
  engine's `PushResponse`; uvicorn: `await send` per event with `await asyncio.sleep(0)`).
- `GET /json`: a small JSON response.

The load generator is `wrk -t 1` (a separate process; Debian: `apt-get install wrk`); without
it the benchmark says so and exits 0. For every (target, workload): req/s and p50/p99 at
`--conns` connections and p50/p99 at one connection, and the server process's CPU time (user +
system, from /proc) divided by the requests served. "Added" latency is the target's latency
minus the upstream's own (relay, proxy) — the engine workloads have no upstream, so their
latency is all the server's. Rounds are interleaved and rotated; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _http_layer_servers import run_flexpipe, run_upstream, run_uvicorn

ROOT = Path(__file__).resolve().parent.parent
REQUEST_BODY = b'{"model":"llama-2-7b","prompt":"Hello there","max_tokens":16,"stream":true}'
WORKLOADS = ("relay", "proxy", "sse", "json")
TARGETS = ("flexpipe", "uvicorn")
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


# --- the driver ------------------------------------------------------------------------------
def _start(
    args: list[str], root: Path = ROOT, max_files: int | None = None
) -> tuple[subprocess.Popen[str], int]:
    env = dict(os.environ, PYTHONPATH=str(root))

    def limit_files() -> None:
        if max_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))

    proc = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=limit_files,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"{args[:2]} did not start: {line!r}")
    return proc, int(line.split()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not m:
        raise ValueError(f"unparsed wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_wrk(url: str, conns: int, duration_s: int, script: Path | None) -> dict[str, float]:
    cmd = ["wrk", "-t", "1", "-c", str(conns), "-d", f"{duration_s}s", "--latency"]
    if script is not None:
        cmd += ["-s", str(script)]
    out = subprocess.run(
        [*cmd, url], capture_output=True, text=True, timeout=duration_s + 30, check=True
    ).stdout
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    total = re.search(r"^\s+(\d+) requests in", out, re.M)
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock_errors = re.search(r"Socket errors: (.*)$", out, re.M)
    if rps is None or total is None or "50" not in pct:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    if errors or sock_errors:
        what = [m.group(0) for m in (errors, sock_errors) if m is not None]
        print(f"  ! {url} -c {conns}: {'; '.join(what)}")
    return {
        "req_per_s": float(rps.group(1)),
        "num_requests": float(total.group(1)),
        "p50_ms": _ms(pct["50"]),
        "p99_ms": _ms(pct["99"]),
    }


def _measure(
    pid: int | None, url: str, conns: int, duration_s: int, script: Path | None
) -> dict[str, float]:
    cpu0 = _cpu_s(pid) if pid else 0.0
    row = run_wrk(url, conns, duration_s, script)
    if pid:
        row["cpu_us_per_req"] = (_cpu_s(pid) - cpu0) / row["num_requests"] * 1e6
    return row


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _body_stall_once(port: int, body_bytes: int) -> tuple[float, float, float]:
    """The longest gap between a /ticks stream's events before and while a `body_bytes` JSON
    body is posted (and parsed) on another connection, and that POST's time."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /ticks HTTP/1.1\r\nhost: x\r\n\r\n")
    loop = asyncio.get_running_loop()
    arrivals: list[float] = []
    post: dict[str, float] = {}

    async def read_ticks() -> None:
        while True:
            data = await reader.read(65536)
            if not data or b"0\r\n\r\n" in data:
                return
            arrivals.append(loop.time())

    async def post_body() -> None:
        await asyncio.sleep(1.0)
        filler = b"x" * (body_bytes - 40)
        body = b'{"model":"m","prompt":"' + filler + b'"}'
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        post["t0"] = loop.time()
        w2.write(b"POST /parse HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body))
        w2.write(body)
        await r2.readuntil(b"}")
        post["t1"] = loop.time()
        w2.close()

    await asyncio.gather(read_ticks(), post_body())
    writer.close()
    t0, t1 = post["t0"], post["t1"] + 0.05
    gaps_before = [b - a for a, b in itertools.pairwise(arrivals) if b < t0]
    gaps_during = [b - a for a, b in itertools.pairwise(arrivals) if b >= t0 and a <= t1]
    return max(gaps_before) * 1e3, max(gaps_during or [0.0]) * 1e3, (t1 - 0.05 - t0) * 1e3


def body_stall(roots: dict[str, Path], body_bytes: int, rounds: int) -> None:
    """A `body_bytes` body's effect on a concurrent stream, for each flexpipe checkout."""
    print(f"\n### A {body_bytes / 1e6:.0f} MB JSON body posted while a stream runs "
          f"(event every 5 ms), medians of {rounds}")  # fmt: skip
    print("| flexpipe | max gap before, ms | max gap while the body is read and parsed, ms | "
          "POST answered in, ms | server RSS after, MB |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, root in roots.items():
        proc, port = _start(["--serve", "flexpipe", "--upstream", "http://127.0.0.1:9"], root)
        try:
            runs = [asyncio.run(_body_stall_once(port, body_bytes)) for _ in range(rounds)]
            rss_mb = _rss_mb(proc.pid)
        finally:
            proc.kill()
            proc.wait()
        med = [statistics.median(r[i] for r in runs) for i in range(3)]
        print(f"| {name} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.0f} | {rss_mb:.0f} |")


def idle_flood(roots: dict[str, Path], num_idle: int) -> None:
    """`num_idle` connections that send nothing against a server at `ulimit -n 1024`, then
    one real request: is it served, and how fast?"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, num_idle + 256)), hard))
    print(f"\n### {num_idle} idle connections, then one GET (server at ulimit -n 1024)")
    print("| flexpipe | the GET | answered in |")
    print("| --- | --- | ---: |")
    for name, root in roots.items():
        proc, port = _start(["--serve", "flexpipe", "--upstream", "http://127.0.0.1:9"], root, 1024)
        idle: list[socket.socket] = []
        try:
            for _ in range(num_idle):
                try:
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    break
            time.sleep(0.5)
            t0 = time.monotonic()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    sock.sendall(b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n")
                    line = sock.recv(4096).split(b"\r\n", 1)[0].decode() or "closed"
            except OSError as exc:
                line = type(exc).__name__
            print(f"| {name} | {line} | {(time.monotonic() - t0) * 1e3:.1f} ms |")
        finally:
            for sock in idle:
                sock.close()
            proc.kill()
            proc.wait()


def _load_1m() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--duration-s", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conns", type=int, default=64)
    parser.add_argument("--events", type=int, default=16)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--body-stall",
        default="",
        help="instead: a 10 MB body's effect on a concurrent stream, for each NAME=ROOT "
        "(a checkout whose flexpipe to run), e.g. before=/work/main,after=.",
    )
    parser.add_argument(
        "--idle-flood",
        default="",
        help="instead: 1,100 idle connections then one GET, for each NAME=ROOT (as above)",
    )
    parser.add_argument("--serve", choices=("upstream", *TARGETS))
    parser.add_argument("--upstream", default="")
    args = parser.parse_args(argv)
    if args.serve == "upstream":
        run_upstream(args.events)
        return 0
    if args.serve == "flexpipe":
        run_flexpipe(args.upstream, args.events)
        return 0
    if args.serve == "uvicorn":
        run_uvicorn(args.upstream, args.events)
        return 0
    if args.body_stall:
        pairs = (item.split("=", 1) for item in args.body_stall.split(","))
        body_stall({n: Path(r).resolve() for n, r in pairs}, 10 << 20, args.rounds)
        return 0
    if args.idle_flood:
        pairs = (item.split("=", 1) for item in args.idle_flood.split(","))
        idle_flood({n: Path(r).resolve() for n, r in pairs}, 1100)
        return 0
    if shutil.which("wrk") is None:
        print("http_layer: wrk is not installed (apt-get install wrk); skipped")
        return 0
    post = Path(tempfile.mkdtemp()) / "post.lua"
    body = REQUEST_BODY.decode()
    post.write_text(
        f"wrk.method = \"POST\"\nwrk.body = '{body}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    workloads = [w for w in WORKLOADS if w in args.workloads.split(",")]
    args.workloads = workloads
    scripts = {"relay": post, "proxy": post, "sse": None, "json": None}
    procs: list[subprocess.Popen[str]] = []
    rows: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    load_before = _load_1m()
    try:
        up, up_port = _start(["--serve", "upstream", "--events", str(args.events)])
        procs.append(up)
        upstream = f"http://127.0.0.1:{up_port}"
        servers: dict[str, tuple[int, int]] = {}
        for name in TARGETS:
            proc, port = _start(
                ["--serve", name, "--upstream", upstream, "--events", str(args.events)]
            )
            procs.append(proc)
            servers[name] = (proc.pid, port)
        time.sleep(0.5)
        for r in range(args.rounds):
            order = list(TARGETS) if r % 2 == 0 else list(reversed(TARGETS))
            for conns in (args.conns, 1):
                for wl, path in (("relay", "/stream"), ("proxy", "/json")):
                    if wl not in workloads:
                        continue
                    rows.setdefault(("upstream", wl, conns), []).append(
                        _measure(up.pid, upstream + path, conns, args.duration_s, scripts[wl])
                    )
                for wl in workloads:
                    for name in order:
                        pid, port = servers[name]
                        url = f"http://127.0.0.1:{port}/{wl}"
                        row = _measure(pid, url, conns, args.duration_s, scripts[wl])
                        rows.setdefault((name, wl, conns), []).append(row)
                        print(
                            f"  round {r} c={conns} {wl:5} {name:8} "
                            f"{row['req_per_s']:8,.0f} req/s {row['cpu_us_per_req']:6.0f} µs "
                            f"p50 {row['p50_ms']:.2f} ms p99 {row['p99_ms']:.2f} ms",
                            flush=True,
                        )
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    _report(rows, args, load_before)
    return 0


def _med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _ratio(
    rows: dict[tuple[str, str, int], list[dict[str, float]]], wl: str, c: int, key: str
) -> float:
    """The median over rounds of each round's flexpipe ÷ uvicorn (req/s) or uvicorn ÷
    flexpipe (CPU): the two targets ran back to back, so a round's ratio shares its noise."""
    fp, uv = rows[("flexpipe", wl, c)], rows[("uvicorn", wl, c)]
    if key == "req_per_s":
        return statistics.median(f[key] / u[key] for f, u in zip(fp, uv, strict=True))
    return statistics.median(u[key] / f[key] for f, u in zip(fp, uv, strict=True))


def _report(
    rows: dict[tuple[str, str, int], list[dict[str, float]]],
    args: argparse.Namespace,
    load_before: str,
) -> None:
    c = args.conns
    print(
        f"\n### flexpipe.http vs uvicorn 0.54 (httptools + uvloop), {args.events} events per "
        f"stream, wrk -t 1 -c {c} and -c 1, {args.duration_s} s per run, medians of "
        f"{args.rounds} (load before {load_before}, after {_load_1m()})"
    )
    print(
        f"| workload | server | req/s (c={c}) | CPU µs/req | p50 / p99 ms (c={c}) | "
        "added p50 / p99 ms (c=1) | flexpipe ÷ uvicorn req/s | uvicorn ÷ flexpipe CPU |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for wl in args.workloads:
        base1 = rows.get(("upstream", wl, 1))
        for name in TARGETS:
            hi, one = rows[(name, wl, c)], rows[(name, wl, 1)]
            p50_1, p99_1 = _med(one, "p50_ms"), _med(one, "p99_ms")
            if base1:
                p50_1 -= _med(base1, "p50_ms")
                p99_1 -= _med(base1, "p99_ms")
            ratios = " | "
            if name == "flexpipe":
                ratios = (
                    f"{_ratio(rows, wl, c, 'req_per_s'):.2f}× | "
                    f"{_ratio(rows, wl, c, 'cpu_us_per_req'):.2f}×"
                )
            print(
                f"| {wl} | {name} | {_med(hi, 'req_per_s'):,.0f} | "
                f"{_med(hi, 'cpu_us_per_req'):.0f} | {_med(hi, 'p50_ms'):.2f} / "
                f"{_med(hi, 'p99_ms'):.2f} | {p50_1:.3f} / {p99_1:.3f} | {ratios} |"
            )
    for wl in ("relay", "proxy"):
        if wl not in args.workloads:
            continue
        up = rows[("upstream", wl, c)]
        print(
            f"| {wl} | (upstream alone) | {_med(up, 'req_per_s'):,.0f} | "
            f"{_med(up, 'cpu_us_per_req'):.0f} | {_med(up, 'p50_ms'):.2f} / "
            f"{_med(up, 'p99_ms'):.2f} | – | | |"
        )


if __name__ == "__main__":
    sys.exit(main())
