"""Does the sim engine's own overhead distort time? (docs/sim-engine.md)

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
import itertools
import select
import socket
import struct
import sys
import threading
import time

from bench.engine_loadgen import StreamRecord, completion_request, cpu_load, percentile
from flexpipe.engine.testing import request, scrape, sim_engine
from flexpipe.perf import perf_model_for

MODEL = "llama-3.1-8b"
GPU = "H100-80G-SXM"
LINK = "nvlink4"


# Linux: SO_TIMESTAMPNS (= SCM_TIMESTAMPNS), not exported by Python's socket module
_SO_TIMESTAMPNS = 35
_END = b"\r\n0\r\n\r\n"

_RunResult = tuple[list[StreamRecord], list[list[float]], float, float, str, str]


def _kernel_stamp(anc: list[tuple[int, int, bytes]]) -> float:
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
            sec, nsec = struct.unpack("qq", cdata[:16])
            return float(sec + nsec * 1e-9)
    return float("nan")


def _run(port: int, streams: int, prompt_words: int, max_tokens: int, duration_s: float,
         settle_s: float, poll_s: float) -> _RunResult:  # fmt: skip
    """All streams read by one thread with epoll and the kernel's receive timestamps
    (SO_TIMESTAMPNS): on loopback a read's stamp is when the engine's bytes arrived, however
    late this client gets to them. `poll_s` > 0: sleep that long between polls, so the client
    wakes (and competes with the engine for a CPU) once per interval instead of once per
    arriving chunk. Each StreamRecord gets the client clock, `stamps` the kernel's (wall)."""
    host = "127.0.0.1"
    recs = [StreamRecord(0.0) for _ in range(streams)]
    stamps: list[list[float]] = [[] for _ in range(streams)]
    tails = [b""] * streams
    socks: list[socket.socket] = []
    ep = select.epoll()
    by_fd: dict[int, int] = {}
    try:
        for i in range(streams):
            sock = socket.create_connection((host, port))
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            prompt = " ".join(f"s{i}w{w}" for w in range(prompt_words))
            recs[i].sent_s = time.monotonic()
            sock.sendall(completion_request(host, port, MODEL, prompt, max_tokens))
            sock.setblocking(False)
            ep.register(sock.fileno(), select.EPOLLIN)
            by_fd[sock.fileno()] = i
        url = f"http://{host}:{port}/metrics"
        scrapes: list[str] = []

        def scrape_metrics() -> None:  # in a thread: the reader keeps reading meanwhile
            scrapes.append(request("GET", url).text)

        num_open = streams
        num_decoding = 0
        t_settled = t0 = t1 = 0.0
        scraper: threading.Thread | None = None
        clock = time.monotonic
        while num_open:
            if poll_s > 0:
                time.sleep(poll_s)
                events = ep.poll(0)
            else:
                events = ep.poll(1.0)
            for fd, _ in events:
                i = by_fd[fd]
                try:
                    data, anc, _, _ = socks[i].recvmsg(262144, 256)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data, anc = b"", []
                rec = recs[i]
                n = data.count(b'"text":')
                if n:
                    now = clock()
                    if not rec.token_times_s:
                        num_decoding += 1
                    rec.token_times_s.extend([now] * n)
                    stamps[i].extend([_kernel_stamp(anc)] * n)
                tails[i] = (tails[i] + data)[-16:]
                if not data or tails[i].endswith(_END):
                    rec.done_s = clock()
                    ep.unregister(fd)
                    num_open -= 1
            # the window: from when every stream decodes (plus settling) for duration_s
            now = clock()
            if not t_settled and num_decoding == streams:
                t_settled = now + settle_s
            if t_settled and not t0 and now >= t_settled:
                t0 = now
                scraper = threading.Thread(target=scrape_metrics)
                scraper.start()
            if t0 and not t1 and now >= t0 + duration_s and scraper is not None:
                scraper.join()
                scraper = threading.Thread(target=scrape_metrics)
                scraper.start()
                scraper.join()
                t1 = clock()
        if scraper is not None:
            scraper.join()
        if len(scrapes) != 2:
            raise RuntimeError("the streams ended before the window did: raise max_tokens")
        return recs, stamps, t0, t1, scrapes[0], scrapes[1]
    finally:
        ep.close()
        for sock in socks:
            sock.close()


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
    try:
        buckets, count, total = _hist_delta(m0, m1, name)
    except KeyError:
        return f"{label}: n/a (engine without {name})"
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
    p.add_argument(
        "--poll-ms",
        type=float,
        default=0.0,
        help="client: read every this many ms instead of on every arrival (kernel stamps keep "
        "the measured gaps exact; the client's clock gets this much resolution)",
    )

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
    with sim_engine(engine_args) as eng:
        recs, stamps, t0, t1, m0, m1 = _run(
            eng.port,
            args.streams,
            args.prompt_words,
            max_tokens,
            args.duration,
            settle_s,
            args.poll_ms / 1e3,
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
    try:
        emit_wall_s = scrape(m1, "flexpipe:engine_emit_seconds_sum") - scrape(
            m0, "flexpipe:engine_emit_seconds_sum"
        )
        emit_cpu_s = scrape(m1, "flexpipe:engine_emit_cpu_seconds_total") - scrape(
            m0, "flexpipe:engine_emit_cpu_seconds_total"
        )
        emit_cpu_share = emit_cpu_s / emit_wall_s if emit_wall_s else float("nan")
    except KeyError:  # an engine from before these metrics
        emit_cpu_share = float("nan")

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
