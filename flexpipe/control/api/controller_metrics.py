"""The controller's Prometheus metrics, in a registry of its own (two controllers in one
process, as in tests and the simulator, never share counters).

Names follow the Prometheus conventions: the `flexpipe_` prefix, base units in the name
(`_seconds`), `_total` on counters only (prometheus_client adds it to a Counter's name),
no unit or `_total` on the gauge, label values from small closed sets (kinds, triggers,
outcomes, phases, methods, lifecycle states; `model` is the served model name).

    flexpipe_controller_decisions_total{decision}      every policy decision: hold | shift
    flexpipe_shifts_total{kind,trigger,outcome}        changes finished (not holds)
    flexpipe_shift_phase_seconds{phase}                histogram of each phase's duration
    flexpipe_requests_migrated_total{method}           kv_moved | recomputed |
                                                       finished_in_place | rerun
    flexpipe_instances{model,state}                    live instances per lifecycle state
    flexpipe_slo_seconds{model,slo}                    each model's SLO: ttft_p99 | tpot_p99
                                                       (what dashboards draw latencies against)
    flexpipe_gpu_instance{Hostname,gpu,                1 per GPU of a live instance: joins DCGM's
                          flexpipe_instance,model}     per-GPU series to instances (observe/dcgm.py)
    flexpipe_gateway_replica_up{gateway}               1 while a gateway replica answers
    flexpipe_gateway_replica_in_sync{gateway}          1 while its pool is the controller's
    flexpipe_gateway_replica_catch_ups_total{gateway}  times it was brought up to date
                                                       (the three: as the controller's fleet
                                                       client sees them, control/gateway_fleet.py)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from flexpipe.lifecycle import LIVE_STATES, State
from flexpipe.store.shift_entry import METHODS, ShiftEntry

__all__ = ["CONTENT_TYPE", "PHASE_BUCKETS_S", "ControllerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# A switch takes milliseconds; a cold start of a large model minutes; a drain up to its
# deadline (30 s by default).
PHASE_BUCKETS_S = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


class ControllerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter(
            "flexpipe_controller_decisions",
            "Shift policy decisions, taken or not.",
            ["decision"],
            registry=r,
        )
        self.shifts = Counter(
            "flexpipe_shifts",
            "Plan changes finished, by kind, trigger and outcome.",
            ["kind", "trigger", "outcome"],
            registry=r,
        )
        self.phase_seconds = Histogram(
            "flexpipe_shift_phase_seconds",
            "Duration of each phase of a plan change (warm, rehearse, switch, drain, migrate, "
            "release).",
            ["phase"],
            buckets=PHASE_BUCKETS_S,
            registry=r,
        )
        self.migrated = Counter(
            "flexpipe_requests_migrated",
            "In-flight requests of removed instances, by what happened to them.",
            ["method"],
            registry=r,
        )
        self.instances = Gauge(
            "flexpipe_instances",
            "Engine instances by model and lifecycle state.",
            ["model", "state"],
            registry=r,
        )
        self.slo_seconds = Gauge(
            "flexpipe_slo_seconds",
            "Each served model's latency SLO from the models file, in seconds.",
            ["model", "slo"],
            registry=r,
        )
        self.gpu_instance = Gauge(
            "flexpipe_gpu_instance",
            "1 for each GPU of a live instance, labelled as NVIDIA's DCGM exporter labels GPUs "
            "(Hostname, gpu), to join its series to instances.",
            ["Hostname", "gpu", "flexpipe_instance", "model"],
            registry=r,
        )
        for method in METHODS:  # a counter that exists at 0 makes rate() work from the start
            self.migrated.labels(method=method)
        for decision in ("hold", "shift"):
            self.decisions.labels(decision=decision)

    def observe_decision(self, entry: ShiftEntry) -> None:
        """A decision of the policy (call on append of a hold or a change)."""
        self.decisions.labels(decision="hold" if entry.kind == "hold" else "shift").inc()

    def observe_finished(self, entry: ShiftEntry) -> None:
        """A change with its final outcome (call once, when `update_outcome` made it final):
        counts it, its phases and the requests it migrated."""
        if entry.kind == "hold" or entry.outcome == "pending":
            raise ValueError(f"entry {entry.id} is not a finished change ({entry.outcome})")
        self.shifts.labels(kind=entry.kind, trigger=entry.trigger, outcome=entry.outcome).inc()
        for phase, seconds in entry.phases.items():
            self.phase_seconds.labels(phase=phase).observe(seconds)
        if entry.migrated is not None:
            for method in METHODS:
                num = getattr(entry.migrated, method)
                if num:
                    self.migrated.labels(method=method).inc(num)

    def set_slos(self, slos: Iterable[tuple[str, float, float]]) -> None:
        """(model, TTFT p99 SLO s, TPOT p99 SLO s) of every served model."""
        for model, ttft_s, tpot_s in slos:
            self.slo_seconds.labels(model=model, slo="ttft_p99").set(ttft_s)
            self.slo_seconds.labels(model=model, slo="tpot_p99").set(tpot_s)

    def set_instances(self, instances: Iterable[tuple[str, State]]) -> None:
        """Replace the instance gauge with counts of (model, state) pairs. Every live state of
        a model seen is exported, at 0 when empty, so a state emptying shows as 0; gone
        instances only make their model seen (they are history, not a level)."""
        counts: dict[tuple[str, State], int] = {}
        models = set()
        for model, state in instances:
            models.add(model)
            counts[model, state] = counts.get((model, state), 0) + 1
        self.instances.clear()
        for model in sorted(models):
            for state in sorted(LIVE_STATES, key=list(State).index):
                self.instances.labels(model=model, state=state.value).set(
                    counts.get((model, state), 0)
                )

    def set_gpu_instances(self, rows: Iterable[Mapping[str, str]]) -> None:
        """Replace the GPU -> instance series with `rows`
        (flexpipe.observe.dcgm.gpu_instance_labels of the live instances)."""
        self.gpu_instance.clear()
        for labels in rows:
            self.gpu_instance.labels(**labels).set(1)

    def watch_gateways(self, view: Callable[[], list[dict[str, Any]]]) -> None:
        """Export each gateway replica's state as `view` (the fleet's) says it at a scrape."""
        self.registry.register(_GatewayReplicas(view))

    def render(self) -> bytes:
        """The exposition (text format 0.0.4), served with CONTENT_TYPE."""
        return generate_latest(self.registry)


class _GatewayReplicas(Collector):
    """The gateway replicas, read from the fleet at each scrape (not kept twice)."""

    def __init__(self, view: Callable[[], list[dict[str, Any]]]) -> None:
        self.view = view

    def describe(self) -> Iterable[Metric]:
        return []  # known only at a scrape

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "flexpipe_gateway_replica_up",
            "1 while the gateway replica answers.",
            labels=["gateway"],
        )
        in_sync = GaugeMetricFamily(
            "flexpipe_gateway_replica_in_sync",
            "1 while the replica's pool is the controller's.",
            labels=["gateway"],
        )
        catch_ups = CounterMetricFamily(
            "flexpipe_gateway_replica_catch_ups",
            "Times the replica was brought up to date.",
            labels=["gateway"],
        )
        for r in self.view():
            url = str(r["url"])
            up.add_metric([url], 1.0 if r["up"] else 0.0)
            in_sync.add_metric([url], 1.0 if r["pool"] == "in sync" else 0.0)
            catch_ups.add_metric([url], float(r["num_catch_ups"]))
        yield from (up, in_sync, catch_ups)
