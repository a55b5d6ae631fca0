"""The controller's readings of the gateway (pure): the queue per model (a model with no
instance has its queued requests as demand), and only serving instances (active or draining,
healthy) carry a model's slots and load."""

from __future__ import annotations

from flexpipe.control.core.samples import GatewayTotals, Sampler, gateway_totals
from flexpipe.gateway.gateway_metrics import GatewayMetrics


def inst(model: str, state: str = "active", healthy: bool = True, **load: int) -> dict[str, object]:
    return {"model": model, "state": state, "healthy": healthy, "max_concurrency": 10,
            "num_running": 0, "num_in_flight": 0, "num_waiting": 0, **load}  # fmt: skip


def test_queue_by_model_and_only_serving_instances_count() -> None:
    instances = [
        inst("a", num_running=5, num_in_flight=6, num_waiting=1),
        inst("a", "draining", num_running=2, num_in_flight=2),
        inst("a", "starting", num_running=9, num_in_flight=9),  # serves no one yet
        inst("a", healthy=False, num_running=9, num_in_flight=9),  # ejected
        inst("b", "rehearsing"),
    ]
    got = Sampler().sample(10.0, ["a", "b"], instances, "", 7, {"a": 3, "b": 4})
    a, b = got["a"], got["b"]
    assert (a.queue_depth, a.queue_capacity, a.utilization) == (1 + 3, 20, 7 / 20)
    # b has no serving instance: its 4 queued requests against one slot (the wake trigger)
    assert (b.queue_depth, b.queue_capacity, b.utilization) == (4, 1, 0.0)
    # without the per-model reading, the whole queue counts for a lone model only
    lone = Sampler().sample(10.0, ["a"], instances, "", 7)
    assert lone["a"].queue_depth == 1 + 7
    both = Sampler().sample(10.0, ["a", "b"], instances, "", 7)
    assert (both["a"].queue_depth, both["b"].queue_depth) == (1, 0)


def test_gateway_totals_read_the_gateways_own_metrics() -> None:
    m = GatewayMetrics()
    for model, instance, status in (("a", "i1", "200"), ("a", "i2", "error"), ("b", "i3", "200")):
        m.request_done(model, instance, status)
    m.request_done("a", "i1", "200")
    m.queued.set(5)
    m.queued_by_model.labels("a").set(2)
    m.queued_by_model.labels("b").set(3)
    got = gateway_totals(m.exposition().decode())
    assert got == GatewayTotals(5, {"a": 2, "b": 3}, {"a": 3.0, "b": 1.0})
    # a gateway that does not give the queue by model: None, not {}
    assert gateway_totals("") == GatewayTotals(0, None, {})
