"""The OpenAI-compatible gateway: routing, backpressure, retries, migration, tenants,
metrics and an admin API in front of any OpenAI-compatible engines (docs/gateway.md)."""

from flexpipe.gateway.app import Gateway
from flexpipe.gateway.config import (
    BackendConfig,
    ConfigError,
    GatewayConfig,
    TenantConfig,
    config_from_dict,
    load_config,
)
from flexpipe.gateway.pool import Instance, Pool, PoolError
from flexpipe.lifecycle import State

__all__ = [
    "BackendConfig",
    "ConfigError",
    "Gateway",
    "GatewayConfig",
    "Instance",
    "Pool",
    "PoolError",
    "State",
    "TenantConfig",
    "config_from_dict",
    "load_config",
]
