"""The simulator's controller reads the gateway's latency histograms from `LatencyBuckets`
instead of rendering and parsing a `GatewayMetrics`' Prometheus text every tick: both must
give the `Sampler` the very same buckets."""

from __future__ import annotations

import math
import random

from flexpipe.control.core.samples import (
    TPOT_HISTOGRAM,
    TTFT_HISTOGRAM,
    Sampler,
    parse_histograms,
)
from flexpipe.gateway.gateway_metrics import _LATENCY_BUCKETS_S, _TPOT_BUCKETS_S, GatewayMetrics
from flexpipe.sim.controller import LatencyBuckets


def _values(rng: random.Random) -> list[float]:
    edges = [*_LATENCY_BUCKETS_S, *_TPOT_BUCKETS_S]
    out = [rng.lognormvariate(-3.0, 2.0) for _ in range(400)]
    out += edges  # exactly on a bound: that bucket
    out += [math.nextafter(b, math.inf) for b in edges]  # just past it: the next one
    out += [0.0, -1.0, 1e9, math.inf, math.nan]
    rng.shuffle(out)
    return out


def test_latency_buckets_read_as_the_gateways_text_parses() -> None:
    rng = random.Random(7)
    metrics = GatewayMetrics()
    ttft = LatencyBuckets(TTFT_HISTOGRAM, _LATENCY_BUCKETS_S)
    tpot = LatencyBuckets(TPOT_HISTOGRAM, _TPOT_BUCKETS_S)
    names = (TTFT_HISTOGRAM, TPOT_HISTOGRAM)
    for rnd in range(3):  # cumulative across readings, as the gateway's counters are
        for i, value in enumerate(_values(rng)):
            model = ("llama", "qwen", "mixtral")[(i // 3) % (rnd + 1)]
            if i % 3:
                metrics.observe("ttft", model, value)
                ttft.observe(model, value)
            else:
                metrics.observe("tpot", model, value)
                tpot.observe(model, value)
        parsed = parse_histograms(metrics.exposition().decode(), names)
        assert {**ttft.read(), **tpot.read()} == parsed
        assert len(parsed) == 2 * (rnd + 1)


def test_a_sample_from_buckets_equals_one_from_the_text() -> None:
    metrics = GatewayMetrics()
    for i in range(50):
        metrics.observe("ttft", "llama", 0.01 * i)
        metrics.observe("tpot", "llama", 0.001 * i)
    text = metrics.exposition().decode()
    pool = [{"model": "llama", "state": "active", "max_concurrency": 8, "num_running": 3,
             "num_in_flight": 5, "num_waiting": 1}]  # fmt: skip
    hist = parse_histograms(text, (TTFT_HISTOGRAM, TPOT_HISTOGRAM))
    by_text = Sampler().sample(10.0, ["llama"], pool, text, 2)
    by_buckets = Sampler().sample_histograms(10.0, ["llama"], pool, hist, 2)
    assert by_text == by_buckets
    assert by_text["llama"].ttft_p99_s is not None and by_text["llama"].ttft_p99_s > 0.4
