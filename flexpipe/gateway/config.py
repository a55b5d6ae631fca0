"""Gateway configuration: dataclasses with defaults, loaded from YAML and/or CLI flags.

host: 127.0.0.1
port: 8000
admin_token: change-me            # or env FLEXPIPE_ADMIN_TOKEN; admin API off without it
backends:
  - url: http://127.0.0.1:8001    # model discovered from /v1/models when omitted
  - {url: http://127.0.0.1:8002, model: llama-2-7b, weight: 0.5, max_concurrency: 64}
routing:
  policy: prefix_affinity         # the default; any registered policy (docs/routing.md)
  params: {imbalance_ratio: 3.0, imbalance_abs_s: 2.0}
tenants:                          # optional; without it no API key is required
  - {key: sk-team-a, name: team-a, requests_per_min: 600, tokens_per_min: 200000,
     max_concurrency: 32}
tenants_file: keys.yaml           # optional: the same list in its own file
dcgm_urls: [http://gpu-node-1:9400]   # optional: GPU utilisation from dcgm-exporter
dcgm_hostnames: {node1: gpu-node-1}   # optional: cluster node -> the Hostname DCGM reports
shared_state:                     # optional: replicas on several hosts (docs/gateway.md)
  url: redis://10.0.0.5:6379/0
  budgets_when_down: closed       # closed (503) | local (each replica its own budget)
admission:                        # optional, off by default (docs/gateway.md)
  order: slack                    # fcfs (default) | slack: least slack first in a model's line
  shed_late: true                 # 429 + Retry-After for a request that cannot meet its TTFT SLO
  shed_margin_s: 0.5
  ttft_slo_s: {llama-2-7b: 2.0}   # model -> TTFT SLO (the models file's ttft_p99_ms)
  priority: {llama-2-7b: 2}       # model -> priority (the models file's): lines looked at first
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from flexpipe.http.limits import HttpLimits


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one readable line."""


@dataclass(slots=True)
class BackendConfig:
    url: str
    model: str | None = None  # None: ask the backend's /v1/models
    weight: float = 1.0
    max_concurrency: int = 0  # > 0: the cap; 0: from max_num_seqs or the engine's report
    max_num_seqs: int = 0  # what the engine was launched with (0: ask the engine)
    api_key: str | None = None  # sent upstream as a bearer token (e.g. vLLM --api-key)


@dataclass(slots=True)
class TenantConfig:
    key: str
    name: str = ""
    requests_per_min: float = 0.0  # 0 = unlimited
    tokens_per_min: float = 0.0
    max_concurrency: int = 0

    def __repr__(self) -> str:  # never show the key
        return f"TenantConfig(name={self.name!r})"


# --- deadline-aware admission (docs/gateway.md, "Deadline-aware admission") ---------------
ADMISSION_ORDERS = ("fcfs", "slack")


@dataclass(slots=True)
class AdmissionConfig:
    """How the wait queue orders a model's line and whether it sheds late requests
    (gateway/core/deadline.py). The default is first come, first served, nothing shed."""

    order: str = "fcfs"  # fcfs | slack (least slack first, then tenant fair share)
    shed_late: bool = False  # 429 a request whose slack is below -shed_margin_s
    shed_margin_s: float = 0.0
    ttft_slo_s: dict[str, float] = field(default_factory=dict)  # model -> TTFT SLO
    priority: dict[str, float] = field(default_factory=dict)  # model -> priority (default 1)

    @property
    def enabled(self) -> bool:
        return self.order != "fcfs" or self.shed_late


def _admission(data: Any) -> AdmissionConfig:
    adm: AdmissionConfig = _build(AdmissionConfig, data, "admission")
    if adm.order not in ADMISSION_ORDERS:
        raise ConfigError(f"admission.order: expected one of fcfs, slack, got {adm.order!r}")
    if not isinstance(adm.shed_late, bool):
        raise ConfigError("admission.shed_late: expected true or false")
    if not isinstance(adm.shed_margin_s, (int, float)) or adm.shed_margin_s < 0:
        raise ConfigError("admission.shed_margin_s: expected a number >= 0")
    for key in ("ttft_slo_s", "priority"):
        value = getattr(adm, key)
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
            for k, v in value.items()
        ):
            raise ConfigError(f"admission.{key}: expected a mapping of model -> number > 0")
    return adm


# --- workers and replicas (docs/gateway.md, "Workers and replicas") ----------------------
BUDGETS_WHEN_DOWN = ("closed", "local")


@dataclass(slots=True)
class SharedStateConfig:
    """Where gateway replicas share budgets, prefix affinity and the control log. Without a
    URL the workers of one host share through their supervisor (embedded) and a replica
    shares nothing with another."""

    url: str | None = None  # redis://HOST:PORT/DB
    prefix: str = "flexpipe"  # of every key and channel: several deployments on one Redis
    # while Redis cannot be reached: closed, a tenant's request is refused (503); local,
    # each replica keeps its own budget meanwhile (a tenant may get a budget per replica)
    budgets_when_down: str = "closed"
    member_ttl_s: float = 3.0  # a replica silent this long is dead: its slots come back


def _shared_state(data: Any) -> SharedStateConfig:
    sh: SharedStateConfig = _build(SharedStateConfig, data, "shared_state")
    if sh.url is not None and not (isinstance(sh.url, str) and sh.url.startswith("redis://")):
        raise ConfigError(f"shared_state.url: expected redis://HOST:PORT/DB, got {sh.url!r}")
    if sh.budgets_when_down not in BUDGETS_WHEN_DOWN:
        raise ConfigError("shared_state.budgets_when_down: expected closed or local")
    if not isinstance(sh.member_ttl_s, (int, float)) or not sh.member_ttl_s > 0:
        raise ConfigError("shared_state.member_ttl_s: expected a number > 0")
    return sh


# ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    backends: list[BackendConfig] = field(default_factory=list)
    policy: str = "prefix_affinity"  # the routing-quality sweep's winner (docs/routing.md)
    policy_params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    max_concurrency_per_instance: int = 256
    max_queue: int = 1024  # requests waiting for a free instance; beyond: 429
    max_queue_wait_s: float = 15.0
    connect_timeout_s: float = 3.0
    ttfb_timeout_s: float = 300.0
    idle_timeout_s: float = 60.0
    # a stream that has sent tokens and then goes silent this long (or STREAM_SILENCE_TPOTS
    # times its instance's measured time per token, if longer) is continued on another
    # instance, as one whose engine died (docs/gateway.md, "Nothing accepted is lost")
    stream_silence_s: float = 5.0
    retry_jitter_s: float = 0.05
    max_retries: int = 1  # 429 / 503 answers, before the first byte
    max_failovers: int = 3  # instances failing before a response head, tried in turn
    max_migrations: int = 1  # re-runs / continuations after an instance dies mid-request
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    scrape_interval_s: float = 1.0
    max_metrics_age_s: float = 5.0
    health_interval_s: float = 2.0
    eject_after_failures: int = 2
    eject_base_backoff_s: float = 1.0
    eject_max_backoff_s: float = 30.0
    block_chars: int = 64
    max_prefix_blocks_per_instance: int = 50_000
    default_expected_output_tokens: int = 256
    max_body_bytes: int = 4 * 1024 * 1024  # /v1/completions and /v1/chat/completions [413]
    http: HttpLimits = field(default_factory=HttpLimits)  # the server's limits (docs/http.md)
    admin_token: str | None = None
    tenants: list[TenantConfig] = field(default_factory=list)
    # the dashboard (docs/dashboard.md): its controller's admin API for the GPU map and the
    # shift log (None: the dashboard shows the gateway's own view only)
    controller_url: str | None = None
    controller_token: str | None = None  # or env FLEXPIPE_CONTROLLER_TOKEN
    ui_interval_s: float = 2.0  # one dashboard reading (and SSE push) per interval
    # GPU utilisation measured on the GPUs (docs/observability.md): NVIDIA's dcgm-exporter on
    # each GPU node (http://HOST:9400, /metrics unless the URL names a path), scraped with the
    # dashboard's readings and joined to instances through the controller's GPU map;
    # `dcgm_hostnames`: cluster node name -> the Hostname its exporter reports (default: same)
    dcgm_urls: list[str] = field(default_factory=list)
    dcgm_hostnames: dict[str, str] = field(default_factory=dict)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    shared_state: SharedStateConfig = field(default_factory=SharedStateConfig)


def _build(cls: type[Any], data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for key, value in data.items():  # `.inf` / `.nan` in YAML: no limit or timeout means that
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}.{key}: expected a finite number, got {value}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _tenants(data: Any, where: str) -> list[TenantConfig]:
    if not isinstance(data, list):
        raise ConfigError(f"{where}: expected a list of tenants")
    return [_build(TenantConfig, t, f"{where}[{i}]") for i, t in enumerate(data)]


def config_from_dict(data: dict[str, Any], base_dir: Path | None = None) -> GatewayConfig:
    data = dict(data)
    backends = [
        _build(BackendConfig, {"url": b} if isinstance(b, str) else b, f"backends[{i}]")
        for i, b in enumerate(data.pop("backends", []) or [])
    ]
    tenants = _tenants(data.pop("tenants", []) or [], "tenants")
    tenants_file = data.pop("tenants_file", None)
    if tenants_file:
        path = Path(tenants_file)
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        tenants += _tenants(_read_yaml(path), str(path))
    http = _build(HttpLimits, data.pop("http", None) or {}, "http")
    admission = _admission(data.pop("admission", None) or {})
    shared_state = _shared_state(data.pop("shared_state", None) or {})
    routing = data.pop("routing", None) or {}
    if not isinstance(routing, dict):
        raise ConfigError("routing: expected a mapping with `policy` and `params`")
    cfg: GatewayConfig = _build(GatewayConfig, data, "gateway config")
    cfg.backends = backends
    cfg.tenants = tenants
    cfg.http = http
    cfg.admission = admission
    cfg.shared_state = shared_state
    cfg.policy = str(routing.get("policy", cfg.policy))
    cfg.policy_params = dict(routing.get("params") or {})
    for key, value in cfg.policy_params.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"routing.params.{key}: expected a finite number, got {value}")
    if cfg.admin_token is None:
        cfg.admin_token = os.environ.get("FLEXPIPE_ADMIN_TOKEN") or None
    if cfg.controller_token is None:
        cfg.controller_token = os.environ.get("FLEXPIPE_CONTROLLER_TOKEN") or None
    validate(cfg)
    return cfg


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return config_from_dict(data, path.parent)


def validate(cfg: GatewayConfig) -> None:
    from flexpipe.policies.routing import create_policy

    for b in cfg.backends:
        if not b.url.startswith("http://"):
            raise ConfigError(f"backend {b.url!r}: only http:// URLs are supported")
        if b.weight <= 0:
            raise ConfigError(f"backend {b.url!r}: weight must be > 0")
    if len({t.key for t in cfg.tenants}) != len(cfg.tenants):
        raise ConfigError("tenants: duplicate API key")
    if cfg.controller_url is not None and not cfg.controller_url.startswith("http://"):
        raise ConfigError(f"controller_url {cfg.controller_url!r}: expected http://HOST:PORT")
    if not cfg.ui_interval_s > 0:
        raise ConfigError("ui_interval_s must be > 0")
    if not cfg.stream_silence_s > 0:
        raise ConfigError("stream_silence_s must be > 0")
    _validate_dcgm(cfg)
    if cfg.max_queue < 0 or cfg.max_concurrency_per_instance < 1:
        raise ConfigError("max_queue must be >= 0 and max_concurrency_per_instance >= 1")
    try:
        create_policy(cfg.policy, **cfg.policy_params)
    except ValueError as exc:
        raise ConfigError(f"routing: {exc}") from None


def _validate_dcgm(cfg: GatewayConfig) -> None:
    """The DCGM exporters' settings: http:// URLs, and a node -> hostname map of strings."""
    if not isinstance(cfg.dcgm_urls, list):
        raise ConfigError("dcgm_urls: expected a list of http://HOST:PORT URLs")
    for url in cfg.dcgm_urls:
        if not isinstance(url, str) or not url.startswith("http://"):
            raise ConfigError(f"dcgm_urls: {url!r}: expected http://HOST:PORT")
    if cfg.dcgm_urls and cfg.controller_url is None:
        raise ConfigError(
            "dcgm_urls need controller_url: which GPUs each instance runs on comes from the "
            "controller's GPU map"
        )
    hostnames = cfg.dcgm_hostnames
    if not isinstance(hostnames, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in hostnames.items()
    ):
        raise ConfigError("dcgm_hostnames: expected a mapping of node name -> hostname")
