"""The gateway's metrics: its fast histogram path exposes what the library's own does."""

from __future__ import annotations

import math

from flexpipe.gateway.metrics import _LATENCY_BUCKETS_S, _TPOT_BUCKETS_S, GatewayMetrics


def _exposed(m: GatewayMetrics) -> list[str]:
    """The exposition without its `_created` timestamps (two objects differ in those)."""
    return [ln for ln in m.exposition().decode().splitlines() if "_created" not in ln]


def test_observe_exposes_what_histogram_observe_does() -> None:
    values = [-1.0, 0.0, 1e-9, math.inf, -math.inf, 1e9, math.nan, 0.3333]
    for bound in _LATENCY_BUCKETS_S + _TPOT_BUCKETS_S:  # each bound, and just either side
        values += [bound, math.nextafter(bound, 0.0), math.nextafter(bound, math.inf)]
    fast, stock = GatewayMetrics(), GatewayMetrics()
    for kind in ("ttft", "tpot", "e2e"):
        for model in ("a", "b"):
            metric = {"ttft": stock.ttft, "tpot": stock.tpot, "e2e": stock.e2e}[kind]
            for v in values if model == "a" else values[::-1]:
                fast.observe(kind, model, v)
                metric.labels(model).observe(v)
    exposed = _exposed(fast)
    assert exposed == _exposed(stock)
    # every value in a bucket but NaN; and the comparison tells them apart
    count = f'flexpipe_time_to_first_token_seconds_count{{model="a"}} {len(values) - 1}.0'
    assert count in exposed
    fast.observe("ttft", "a", 0.4)
    assert _exposed(fast) != _exposed(stock)
