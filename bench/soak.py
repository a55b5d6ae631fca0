"""Soak: does the gateway stay flat under hours-like abuse? (docs/gateway.md)

    python -m bench soak                          # 10 minutes
    python -m bench soak -- --duration-s 120      # shorter

The gateway (its own `flexpipe gateway` process, per-instance caps so that it is overloaded)
sits in front of 3 sim engines at time scale 1. Closed-loop clients send a mix of streamed
and plain chat and completion requests on raw sockets, and a share of them hang up at a
random point (before the head, while queued, mid-stream; FIN or RST). One engine is killed
with SIGKILL a third of the way in and a fresh one added through the admin API 10 s later
(the dead one removed), as a controller would.

Every few seconds it samples the gateway's RSS and open descriptors (/proc), the sum of
`num_in_flight` over /admin/instances, its queue length (/metrics) and the live engines'
vllm:num_requests_running + waiting, with the request outcomes so far. At the end the load
stops and, after a quiet period, everything must be back to zero.

Verdict: the medians of the first and the last minute (a sixth of the run when shorter)
of RSS, descriptors, in-flight and orphaned slots (in-flight at the gateway that no
engine runs or queues) are compared: "flat" when the last is within 10 % (plus a
small absolute slack) of the first, else "GROWING"; then the idle check. Exit status 1 when
something grows or does not return to zero. The table prints to stdout; a CSV goes to
bench/results/soak-<UTC time>.csv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import orjson  # noqa: E402
from faultkit import (  # noqa: E402
    MODEL,
    GatewayProc,
    engine_args,
    engine_load,
    gateway_process,
    http_request_bytes,
    proc_num_fds,
    proc_rss_bytes,
    raw_call,
)

from flexpipe.engine.testing import EngineProc, sim_engine  # noqa: E402

RESULTS = ROOT / "bench" / "results"


@dataclass
class Sample:
    t_s: float
    rss_mb: float
    num_fds: int
    num_in_flight: int
    num_queued: float
    num_engine_running: float
    num_engine_waiting: float
    num_ok: int
    num_429: int
    num_other_status: int
    num_hung_up: int
    num_client_errors: int
    ok_per_s: float = 0.0  # completed responses per second since the previous sample

    @property
    def num_orphaned(self) -> float:
        """Slots the gateway counts that no engine works on (leaked ones, and the few in
        transit): in-flight minus the engines' running + waiting, not below 0."""
        return max(0.0, self.num_in_flight - self.num_engine_running - self.num_engine_waiting)


def _request(rng: random.Random, i: int) -> bytes:
    stream = rng.random() < 0.5
    max_tokens = rng.randint(16, 200)
    prompt = f"soak request {i}: " + " ".join(rng.choice(("river", "stone", "light")) * 3
                                              for _ in range(rng.randint(2, 40)))  # fmt: skip
    if rng.random() < 0.5:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}  # fmt: skip
        return http_request_bytes("/v1/chat/completions", orjson.dumps(body))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True}  # fmt: skip
    return http_request_bytes("/v1/completions", orjson.dumps(body))


def drain_stderr(engine: EngineProc, sink: Counter[str]) -> None:
    """Read an engine's stderr in a thread (a full pipe would stall it mid-soak); count lines."""

    def run() -> None:
        stream = engine.proc.stderr
        with contextlib.suppress(ValueError, OSError):
            for _ in iter(stream.readline, b"") if stream else ():
                sink["engine_stderr_lines"] += 1

    threading.Thread(target=run, daemon=True).start()


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.outcomes: Counter[str] = Counter()
        self.logs: Counter[str] = Counter()
        self.stop = asyncio.Event()
        self.samples: list[Sample] = []
        self.events: list[str] = []
        self.t0 = 0.0

    async def client(self, gw: GatewayProc, cid: int) -> None:
        rng = random.Random(self.args.seed * 1000 + cid)
        i = 0
        while not self.stop.is_set():
            i += 1
            data = _request(rng, cid * 1_000_000 + i)
            leave = rng.random() < self.args.disconnect_share
            try:
                out = await raw_call(
                    gw.port, data, hang_up_after_s=rng.uniform(0, 2.0) if leave else None,
                    rst=leave and rng.random() < 0.5, timeout_s=60,
                )  # fmt: skip
            except OSError:
                self.outcomes["client_error"] += 1
                await asyncio.sleep(0.1)
                continue
            if leave and not out.complete:
                self.outcomes["hung_up"] += 1
            elif out.status == 200 and out.complete:
                self.outcomes["ok"] += 1
            elif out.status == 429:
                self.outcomes["429"] += 1
                await asyncio.sleep(rng.uniform(0.05, 0.3))  # a polite client backs off
            elif out.status:
                self.outcomes["other_status"] += 1
            else:
                self.outcomes["client_error"] += 1

    def sample(self, gw: GatewayProc, engines: Sequence[EngineProc]) -> Sample:
        insts = gw.instances()
        running = waiting = 0.0
        for e in engines:
            if e.proc.poll() is None:
                r, w = engine_load(e.url)
                running, waiting = running + r, waiting + w
        o = self.outcomes
        return Sample(
            round(time.monotonic() - self.t0, 1), round(proc_rss_bytes(gw.pid) / 2**20, 1),
            proc_num_fds(gw.pid), sum(int(i["num_in_flight"]) for i in insts), gw.num_queued(),
            running, waiting, o["ok"], o["429"], o["other_status"], o["hung_up"],
            o["client_error"],
        )  # fmt: skip

    async def sampler(self, gw: GatewayProc, engines: list[EngineProc]) -> None:
        with contextlib.suppress(TimeoutError):  # the first sample once the load is on
            await asyncio.wait_for(self.stop.wait(), self.args.sample_s)
        while not self.stop.is_set():
            s = await asyncio.to_thread(self.sample, gw, engines)
            prev_ok, prev_t_s = (
                (self.samples[-1].num_ok, self.samples[-1].t_s) if self.samples else (0, 0.0)
            )
            s.ok_per_s = round((s.num_ok - prev_ok) / max(0.1, s.t_s - prev_t_s), 1)
            self.samples.append(s)
            print(_row(s), flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.args.sample_s)

    async def chaos(
        self, gw: GatewayProc, engines: list[EngineProc], stack: contextlib.ExitStack
    ) -> None:
        """Kill engine 0 a third of the way in; 10 s later add a fresh one, drop the dead."""
        await asyncio.sleep(self.args.duration_s / 3)
        victim = engines[0]
        victim.proc.send_signal(signal.SIGKILL)
        self.events.append(f"t={time.monotonic() - self.t0:.0f}s kill -9 {victim.url}")
        await asyncio.sleep(self.args.restart_after_s)
        fresh = await asyncio.to_thread(
            stack.enter_context, sim_engine(engine_args(self.args.time_scale))
        )
        drain_stderr(fresh, self.logs)
        engines.append(fresh)
        add = await asyncio.to_thread(gw.admin_post, "/admin/instances",
                                      {"url": fresh.url, "model": MODEL})  # fmt: skip
        rm = await asyncio.to_thread(gw.admin_post, "/admin/instances/remove", {"url": victim.url})
        self.events.append(f"t={time.monotonic() - self.t0:.0f}s added {fresh.url} "
                           f"({add.status}), removed the dead one ({rm.status})")  # fmt: skip

    async def run(
        self, gw: GatewayProc, engines: list[EngineProc], stack: contextlib.ExitStack
    ) -> None:
        self.t0 = time.monotonic()
        tasks = [asyncio.create_task(self.client(gw, c)) for c in range(self.args.clients)]
        tasks.append(asyncio.create_task(self.sampler(gw, engines)))
        chaos = asyncio.create_task(self.chaos(gw, engines, stack))
        await asyncio.sleep(self.args.duration_s)
        self.stop.set()
        chaos.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, chaos, return_exceptions=True)


HEADER = (f"{'t_s':>6} {'rss_mb':>7} {'fds':>5} {'in_flight':>9} {'queued':>6} "
          f"{'eng_run':>7} {'eng_wait':>8} {'ok':>6} {'429':>6} {'other':>5} {'hung_up':>7} "
          f"{'cl_err':>6} {'ok/s':>5} {'orphan':>6}")  # fmt: skip


def _row(s: Sample) -> str:
    return (f"{s.t_s:>6.0f} {s.rss_mb:>7.1f} {s.num_fds:>5} {s.num_in_flight:>9} "
            f"{s.num_queued:>6.0f} {s.num_engine_running:>7.0f} {s.num_engine_waiting:>8.0f} "
            f"{s.num_ok:>6} {s.num_429:>6} {s.num_other_status:>5} {s.num_hung_up:>7} "
            f"{s.num_client_errors:>6} {s.ok_per_s:>5.1f} {s.num_orphaned:>6.0f}")  # fmt: skip


def _window(samples: Sequence[Sample], window_s: float) -> tuple[list[Sample], list[Sample]]:
    """The samples of the first and of the last `window_s` seconds."""
    end = samples[-1].t_s
    first = [s for s in samples if s.t_s <= samples[0].t_s + window_s]
    return first, [s for s in samples if s.t_s >= end - window_s]


def verdict(samples: Sequence[Sample], window_s: float) -> list[tuple[str, float, float, bool]]:
    """(figure, first-window median, last-window median, flat?) for the figures that leak."""
    first, last = _window(samples, window_s)
    out = []
    figures = (("rss_mb", 8.0), ("num_fds", 8.0), ("num_in_flight", 2.0), ("num_orphaned", 3.0))
    for name, slack in figures:
        a = statistics.median(getattr(s, name) for s in first)
        b = statistics.median(getattr(s, name) for s in last)
        out.append((name, a, b, b <= a * 1.10 + slack))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=64, help="closed-loop clients")
    p.add_argument("--max-concurrency", type=int, default=8, help="per instance, at the gateway")
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--disconnect-share", type=float, default=0.3)
    p.add_argument("--restart-after-s", type=float, default=10.0)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--idle-s", type=float, default=10.0, help="quiet time before the idle check")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    soak = Soak(args)
    config = {"health_interval_s": 0.5, "max_queue": args.max_queue, "max_queue_wait_s": 5.0}
    with contextlib.ExitStack() as stack:
        engines = [stack.enter_context(sim_engine(engine_args(args.time_scale)))
                   for _ in range(args.engines)]  # fmt: skip
        gw = stack.enter_context(gateway_process(
            [e.url for e in engines], config, ("--max-concurrency", str(args.max_concurrency))
        ))  # fmt: skip
        for e in engines:
            drain_stderr(e, soak.logs)
        print(f"soak: {args.duration_s:g} s, {args.clients} clients, {args.engines} engines "
              f"x {args.max_concurrency} slots, queue {args.max_queue}, "
              f"{args.disconnect_share:.0%} hang up; gateway pid {gw.pid}; "
              f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        print(HEADER)
        asyncio.run(soak.run(gw, engines, stack))
        time.sleep(args.idle_s)
        idle = soak.sample(gw, engines)
    print(f"idle after the load (load average {os.getloadavg()[0]:.1f}):")
    print(_row(idle))
    for event in soak.events:
        print("event:", event)
    print(f"engines wrote {soak.logs['engine_stderr_lines']} stderr lines")

    path = write_csv(soak.samples, idle)
    ok = report(soak, idle, min(60.0, args.duration_s / 6), args.idle_s)
    print(f"csv: {path.relative_to(ROOT)}")
    return 0 if ok else 1


def write_csv(samples: Sequence[Sample], idle: Sample) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / time.strftime("soak-%Y%m%dT%H%M%SZ.csv", time.gmtime())
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*asdict(samples[0]), "num_orphaned", "phase"])
        w.writeheader()
        for s in samples:
            w.writerow({**asdict(s), "num_orphaned": s.num_orphaned, "phase": "load"})
        w.writerow({**asdict(idle), "num_orphaned": idle.num_orphaned, "phase": "idle"})
    return path


def report(soak: Soak, idle: Sample, window_s: float, idle_s: float) -> bool:
    """Print the verdict; True when flat and back to zero."""
    ok = True
    print(f"verdict (medians, first vs last {window_s:.0f} s):")
    for name, a, b, flat in verdict(soak.samples, window_s):
        ok &= flat
        print(f"  {name:<14} {a:>8.1f} -> {b:>8.1f}  {'flat' if flat else 'GROWING'}")
    first, last = _window(soak.samples, window_s)
    a, b = (statistics.median(s.ok_per_s for s in w) for w in (first, last))
    print(f"  {'ok_per_s':<14} {a:>8.1f} -> {b:>8.1f}  (useful responses; for information)")
    base_fds = soak.samples[0].num_fds
    stuck = {
        "in_flight": idle.num_in_flight,
        "queued": idle.num_queued,
        "engine running+waiting": idle.num_engine_running + idle.num_engine_waiting,
    }
    left = ", ".join(f"{k} {v:g}" for k, v in stuck.items() if v)
    fds_ok = idle.num_fds <= base_fds + 8
    ok &= not left and fds_ok
    print(
        f"  idle after {idle_s:g} s: {'STUCK ' + left if left else 'all zero'}; "
        f"fds {idle.num_fds} (first sample {base_fds}){'' if fds_ok else ' NOT BACK'}"
    )
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(soak.outcomes.items()))
    print(f"  outcomes: {sum(soak.outcomes.values())} requests: {outcomes}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
