"""The gateway's Prometheus metrics (`flexpipe_` namespace) in a per-server registry, so two
gateways in one process (tests, the simulator) never share counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "flexpipe_requests",
            "Requests finished, by model, instance and HTTP status (or error kind).",
            ["model", "instance", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "flexpipe_time_to_first_token_seconds",
            "Time from request arrival to the first streamed token.",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "flexpipe_time_per_output_token_seconds",
            "Mean time between streamed tokens of a request after the first.",
            ["model"],
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "flexpipe_e2e_request_latency_seconds",
            "Time from request arrival to the last byte.",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge(
            "flexpipe_in_flight_requests", "Requests open per instance.", ["instance"], registry=r
        )
        self.queued = Gauge(
            "flexpipe_queued_requests", "Requests waiting for a free instance.", registry=r
        )
        self.queued_by_model = Gauge(
            "flexpipe_model_queued_requests",
            "Requests waiting for a free instance, by model (a held model with no instance: "
            "its demand).",
            ["model"],
            registry=r,
        )
        self.rejected = Counter(
            "flexpipe_rejected_requests",
            "Requests refused before routing, by reason.",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            "flexpipe_retries", "Retries before the first byte, by cause.", ["reason"], registry=r
        )
        self.migrations = Counter(
            "flexpipe_migrations",
            "Streams continued on another instance after theirs failed, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.warm_ups = Counter(
            "flexpipe_move_warm_ups",
            "Pre-copies of recompute moves (relay.warm_up), by outcome: warmed (done in time), "
            "skipped (no free slot on the destination, or not asked for), timed_out (cut over "
            "unwarmed at its bound), failed (the destination refused or broke it).",
            ["outcome"],
            registry=r,
        )
        self.ejections = Counter(
            "flexpipe_ejections", "Instances ejected as unhealthy.", ["instance"], registry=r
        )
        self.decisions = Counter(
            "flexpipe_routing_decisions",
            "Routing decisions by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.prefix_blocks = Counter(
            "flexpipe_prefix_blocks",
            "Prompt blocks routed (all) and estimated cached on the chosen instance (matched).",
            ["kind"],
            registry=r,
        )
        self.instance_up = Gauge(
            "flexpipe_instance_up",
            "1 when the instance is routable (active), else 0.",
            ["instance", "state"],
            registry=r,
        )
        self.member = Gauge(
            "flexpipe_gateway_member",
            "1 per gateway worker or replica answering (its name and pid); summed: how many.",
            ["member", "pid"],
            registry=r,
        )
        self.shared_up = Gauge(
            "flexpipe_shared_state_up",
            "1 while this member reaches the shared state (Redis, or its workers' supervisor).",
            ["member"],
            registry=r,
        )
        self.shared_outages = Gauge(
            "flexpipe_shared_state_outages_total",
            "Times this member lost the shared state (tenant budgets fail closed meanwhile "
            "unless configured local).",
            ["member"],
            registry=r,
        )
        self.prefix_all = self.prefix_blocks.labels("all")
        self.prefix_matched = self.prefix_blocks.labels("matched")
        # Labelled children of the per-request metrics, memoised: `labels()` validates and
        # locks on every call, a dict lookup does not. Label sets are few (models x
        # instances x statuses), so the memo stays small.
        self._requests: dict[tuple[str, str, str], Counter] = {}
        self._decisions: dict[tuple[str, str], Counter] = {}
        self._latency: dict[tuple[str, str], Histogram] = {}  # (kind, model) -> child

    def request_done(self, model: str, instance: str, status: str) -> None:
        key = (model, instance, status)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(model, instance, status)
        child.inc()

    def decision(self, policy: str, reason: str) -> None:
        key = (policy, reason)
        child = self._decisions.get(key)
        if child is None:
            child = self._decisions[key] = self.decisions.labels(policy, reason)
        child.inc()

    def observe(self, kind: str, model: str, value_s: float) -> None:
        """`kind`: "ttft", "tpot" or "e2e"."""
        key = (kind, model)
        child = self._latency.get(key)
        if child is None:
            metric = {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}[kind]
            child = self._latency[key] = metric.labels(model)
        child.observe(value_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
