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

    python -m bench engine_faithfulness [--duration 8] [--streams 256]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time

from bench.engine_loadgen import StreamRecord, completion_request, cpu_load, percentile
from flexpipe.engine.testing import request, scrape, sim_engine
from flexpipe.http.server import install_uvloop
from flexpipe.perf import perf_model_for

MODEL = "llama-3.1-8b"
GPU = "H100-80G-SXM"
LINK = "nvlink4"


class _StreamProtocol(asyncio.Protocol):
    """One stream, read in data_received callbacks (far cheaper than a coroutine per read,
    so the client's own scheduling adds little jitter to the gaps it measures)."""

    def __init__(self, payload: bytes, rec: StreamRecord, done: asyncio.Future[None]) -> None:
        self.payload = payload
        self.rec = rec
        self.done = done
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.rec.sent_s = time.monotonic()
        transport.write(self.payload)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        n = data.count(b'"text":')
        if n:
            now = time.monotonic()
            self.rec.token_times_s.extend([now] * n)
        self.tail = (self.tail + data)[-16:]
        if self.tail.endswith(b"\r\n0\r\n\r\n"):
            self.rec.done_s = time.monotonic()
            self.transport.close()
            if not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _stream(host: str, port: int, payload: bytes, rec: StreamRecord) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    await loop.create_connection(lambda: _StreamProtocol(payload, rec, done), host, port)
    await done


async def _run(port: int, streams: int, prompt_words: int, max_tokens: int, duration_s: float,
               settle_s: float) -> tuple[list[StreamRecord], float, float, str, str]:  # fmt: skip
    host = "127.0.0.1"
    recs = [StreamRecord(0.0) for _ in range(streams)]
    tasks = [
        asyncio.ensure_future(
            _stream(
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
    return recs, t0, t1, m0, m1


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
        recs, t0, t1, m0, m1 = asyncio.run(
            _run(eng.port, args.streams, args.prompt_words, max_tokens, args.duration, settle_s)
        )
    window = t1 - t0
    # client-side tokens and gaps inside the window
    n_tokens = 0
    gaps: list[float] = []
    predicted_gaps: list[float] = []
    contexts: list[int] = []
    for r in recs:
        times = r.token_times_s
        for k in range(1, len(times)):
            if t0 <= times[k] < t1:
                n_tokens += 1
                gaps.append(times[k] - times[k - 1])
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
    lag = scrape(m1, "flexpipe:engine_lag_seconds")
    if args.verbose:
        ratios = [g / q for g, q in zip(gaps, predicted_gaps, strict=True)]
        qs = (1, 5, 50, 90, 95, 98, 99, 99.9)
        print("  gap/model percentiles:", {q: round(percentile(ratios, q), 3) for q in qs})
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
        f"  per-token gap: p50 {p50_gap * 1e3:.2f} ms (model {p50_pred * 1e3:.2f}); "
        f"p99 {p99_gap * 1e3:.2f} ms (model {p99_pred * 1e3:.2f}) -> error {gap_err:+.1%} "
        f"(target within 10%); engine lag at end {lag * 1e3:.1f} ms\n"
        f"  load average before: {load_before}; after: {cpu_load()}"
    )
    return 0 if abs(rate_err) <= 0.05 and abs(gap_err) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
