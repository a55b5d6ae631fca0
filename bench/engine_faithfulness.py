"""Does the sim engine's own overhead distort time? (issue 3, section 6)

One engine process, 256 concurrent streams of one long completion each, a modelled decode
step near 20 ms (llama-3.1-8b on one H100-80G-SXM at batch 256 and ~500-1100 tokens of
context). Over a steady-state window (every stream decoding):

- token rate seen by the clients vs the performance model's prediction for the batches the
  engine ran (generation tokens / modelled busy seconds, read from the engine's /metrics), and
  vs an independent prediction: 256 / mean pm.decode_step_s(256, context) over the window;
  target: within 5%.
- per-token gaps seen by the clients vs the modelled step time at each token's context
  (pm.decode_step_s(256, prompt + k) for a stream's k-th token); target: p99 within 10%.

Where the remaining per-token jitter comes from is printed too, over the same window: how late
the engine loop woke up after each step's deadline (timer resolution plus CPU contention:
flexpipe:engine_wakeup_late_seconds), its own work per step (bookkeeping and one write per
stream: flexpipe:engine_emit_seconds), its garbage-collection pauses (flexpipe:gc_pause_seconds),
and the gap/model ratio percentiles the clients saw.

    python -m bench engine_faithfulness [--duration 8] [--streams 256]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import socket
import struct
import sys
import time

from bench.engine_loadgen import StreamRecord, completion_request, cpu_load, percentile
from flexpipe.engine.testing import request, scrape, sim_engine
from flexpipe.http.server import install_uvloop
from flexpipe.perf import perf_model_for

MODEL = "llama-3.1-8b"
GPU = "H100-80G-SXM"
LINK = "nvlink4"


# Linux: SO_TIMESTAMPNS (= SCM_TIMESTAMPNS), not exported by Python's socket module
_SO_TIMESTAMPNS = 35


async def _stream_stamped(
    host: str, port: int, payload: bytes, rec: StreamRecord, stamps_s: list[float]
) -> None:
    """One stream read with the kernel's receive timestamps (SO_TIMESTAMPNS): on loopback a
    read's stamp is when the engine's bytes arrived, however late this client gets to them,
    so the gaps between stamps are the engine's timing without the client's scheduling.
    `rec.token_times_s` gets the client's own clock, `stamps_s` the kernel's (wall clock)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tail = b""

    def on_readable() -> None:
        nonlocal tail
        try:
            data, anc, _, _ = sock.recvmsg(262144, 256)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, anc = b"", []
        if not data:
            if not done.done():
                done.set_result(None)
            return
        n = data.count(b'"text":')
        if n:
            now = time.monotonic()
            stamp = float("nan")
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", cdata[:16])
                    stamp = sec + nsec * 1e-9
            rec.token_times_s.extend([now] * n)
            stamps_s.extend([stamp] * n)
        tail = (tail + data)[-16:]
        if tail.endswith(b"\r\n0\r\n\r\n"):
            rec.done_s = time.monotonic()
            if not done.done():
                done.set_result(None)

    try:
        await loop.sock_connect(sock, (host, port))
        rec.sent_s = time.monotonic()
        await loop.sock_sendall(sock, payload)
        loop.add_reader(sock.fileno(), on_readable)
        try:
            await done
        finally:
            loop.remove_reader(sock.fileno())
    finally:
        sock.close()


_RunResult = tuple[list[StreamRecord], list[list[float]], float, float, str, str]


async def _run(port: int, streams: int, prompt_words: int, max_tokens: int, duration_s: float,
               settle_s: float) -> _RunResult:  # fmt: skip
    host = "127.0.0.1"
    recs = [StreamRecord(0.0) for _ in range(streams)]
    stamps: list[list[float]] = [[] for _ in range(streams)]
    tasks = [
        asyncio.ensure_future(
            _stream_stamped(
                host,
                port,
                completion_request(
                    host,
                    port,
                    MODEL,
                    " ".join(f"s{i}w{w}" for w in range(prompt_words)),
                    max_tokens,
                ),
                recs[i],
                stamps[i],
            )
        )
        for i in range(streams)
    ]
    # wait until every stream decodes, then let it settle
    while any(not r.token_times_s for r in recs):
        await asyncio.sleep(0.05)
    await asyncio.sleep(settle_s)
    url = f"http://{host}:{port}/metrics"
    t0 = time.monotonic()
    m0 = (await asyncio.to_thread(request, "GET", url)).text
    await asyncio.sleep(duration_s)
    m1 = (await asyncio.to_thread(request, "GET", url)).text
    t1 = time.monotonic()
    await asyncio.gather(*tasks)
    return recs, stamps, t0, t1, m0, m1


def _hist_delta(m0: str, m1: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """A histogram's (upper bound, cumulative count) buckets, count and sum between scrapes."""
    bounds: list[str] = []
    for line in m1.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bounds.append(le)
    buckets = [
        (float(le), scrape(m1, name + "_bucket", le=le) - scrape(m0, name + "_bucket", le=le))
        for le in bounds
    ]
    count = scrape(m1, name + "_count") - scrape(m0, name + "_count")
    total = scrape(m1, name + "_sum") - scrape(m0, name + "_sum")
    return buckets, count, total


def _hist_quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    """The upper bound of the bucket holding quantile q (so: "at most this")."""
    for le, cum in buckets:
        if count and cum >= q * count:
            return le
    return float("inf")


def _overhead_line(m0: str, m1: str, name: str, label: str) -> str:
    buckets, count, total = _hist_delta(m0, m1, name)
    if not count:
        return f"{label}: none"
    p50 = _hist_quantile(buckets, count, 0.5) * 1e3
    p99 = _hist_quantile(buckets, count, 0.99) * 1e3
    return (
        f"{label}: {count:.0f}, mean {total / count * 1e3:.2f} ms, p50 <= {p50:g} ms, "
        f"p99 <= {p99:g} ms"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench engine_faithfulness")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--prompt-words", type=int, default=500)
    p.add_argument("--verbose", action="store_true")

    args = p.parse_args(argv or [])
    settle_s = 1.0
    prompt_tokens = args.prompt_words + 1  # BOS
    pm = perf_model_for(MODEL, f"tp=1,max_num_seqs={args.streams}", GPU, LINK, max_model_len=2048)
    # enough tokens to outlast the window (admission + settle + window) at the fastest step
    fastest = pm.decode_step_s(args.streams, prompt_tokens)
    max_tokens = min(2048 - prompt_tokens, int((args.duration + settle_s + 3) / fastest) + 50)
    engine_args = [
        MODEL, "--gpu-type", GPU, "--link", LINK, "--max-model-len", "2048",
        "--max-num-seqs", str(args.streams), "--time-scale", "1", "--load-time-s", "0",
    ]  # fmt: skip
    load_before = cpu_load()
    install_uvloop()
    with sim_engine(engine_args) as eng:
        recs, stamps, t0, t1, m0, m1 = asyncio.run(
            _run(eng.port, args.streams, args.prompt_words, max_tokens, args.duration, settle_s)
        )
    window = t1 - t0
    # client-side tokens and gaps inside the window
    n_tokens = 0
    gaps: list[float] = []
    kernel_gaps: list[float] = []  # between the kernel's receive stamps
    predicted_gaps: list[float] = []
    contexts: list[int] = []
    for r, st in zip(recs, stamps, strict=True):
        times = r.token_times_s
        for k in range(1, len(times)):
            if t0 <= times[k] < t1:
                n_tokens += 1
                gaps.append(times[k] - times[k - 1])
                kernel_gaps.append(st[k] - st[k - 1])
                ctx = prompt_tokens + k
                contexts.append(ctx)
                predicted_gaps.append(pm.decode_step_s(args.streams, ctx))
    measured_rate = n_tokens / window
    d_tokens = scrape(m1, "vllm:generation_tokens_total") - scrape(
        m0, "vllm:generation_tokens_total"
    )
    d_busy = scrape(m1, "flexpipe:modelled_busy_seconds_total") - scrape(
        m0, "flexpipe:modelled_busy_seconds_total"
    )
    engine_model_rate = d_tokens / d_busy
    mean_ctx = sum(contexts) / max(1, len(contexts))
    physics_rate = args.streams / pm.decode_step_s(args.streams, round(mean_ctx))
    rate_err = measured_rate / engine_model_rate - 1
    p99_gap = percentile(gaps, 99)
    p99_pred = percentile(predicted_gaps, 99)
    p50_gap = percentile(gaps, 50)
    p50_pred = percentile(predicted_gaps, 50)
    gap_err = p99_gap / p99_pred - 1
    p99_kernel = percentile(kernel_gaps, 99)
    kernel_err = p99_kernel / p99_pred - 1
    lag = scrape(m1, "flexpipe:engine_lag_seconds")
    qs = (1, 5, 50, 90, 95, 98, 99, 99.9)
    emit_wall_s = scrape(m1, "flexpipe:engine_emit_seconds_sum") - scrape(
        m0, "flexpipe:engine_emit_seconds_sum"
    )
    emit_cpu_s = scrape(m1, "flexpipe:engine_emit_cpu_seconds_total") - scrape(
        m0, "flexpipe:engine_emit_cpu_seconds_total"
    )
    emit_cpu_share = emit_cpu_s / emit_wall_s if emit_wall_s else float("nan")

    def ratio_line(values: list[float]) -> str:
        ratios = [g / q for g, q in zip(values, predicted_gaps, strict=True)]
        return ", ".join(f"p{q:g} {percentile(ratios, q):.3f}" for q in qs)

    if args.verbose:
        first = recs[0].token_times_s
        steps = [round((b - a) * 1e3, 1) for a, b in itertools.pairwise(first)]
        print("  stream 0 gaps (ms):", steps[:200])
    print(
        f"engine_faithfulness: {MODEL} on 1 x {GPU}, {args.streams} streams, window {window:.1f} s"
        f", mean context {mean_ctx:.0f}, modelled step {pm.decode_step_s(args.streams, round(mean_ctx)) * 1e3:.1f} ms\n"  # noqa: E501
        f"  token rate: measured {measured_rate:,.0f}/s; model (engine's batches) "
        f"{engine_model_rate:,.0f}/s -> error {rate_err:+.1%} (target within 5%); "
        f"model (256 / decode_step_s) {physics_rate:,.0f}/s; engine-side wall rate "
        f"{d_tokens / window:,.0f}/s\n"
        f"  per-token gap, client clock: p50 {p50_gap * 1e3:.2f} ms (model "
        f"{p50_pred * 1e3:.2f}); p99 {p99_gap * 1e3:.2f} ms (model {p99_pred * 1e3:.2f}) -> "
        f"error {gap_err:+.1%} (target within 10%); engine lag at end {lag * 1e3:.1f} ms\n"
        f"  per-token gap, kernel receive stamps: p50 {percentile(kernel_gaps, 50) * 1e3:.2f} ms; "
        f"p99 {p99_kernel * 1e3:.2f} ms -> error {kernel_err:+.1%} (target within 10%)\n"
        f"  gap / modelled step, client clock: {ratio_line(gaps)}\n"
        f"  gap / modelled step, kernel stamps: {ratio_line(kernel_gaps)}\n"
        f"  engine, per step: "
        + _overhead_line(m0, m1, "flexpipe:engine_wakeup_late_seconds", "wake-ups late")
        + "; "
        + _overhead_line(m0, m1, "flexpipe:engine_emit_seconds", "emits")
        + f" (on a CPU {emit_cpu_share:.0%} of that wall time)"
        + "\n  engine GC: "
        + _overhead_line(m0, m1, "flexpipe:gc_pause_seconds", "collections")
        + "\n"
        f"  load average before: {load_before}; after: {cpu_load()}"
    )
    return 0 if abs(rate_err) <= 0.05 and abs(gap_err) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
