"""Policies and scorers registered by a stable name, built from typed config parameters.

Config refers to them by name (`policy: least_load`, `scorers: {prefix: 3, queue: 2}`);
a duplicate registration is a programming error and raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flexpipe.policies.routing.base import RoutingPolicy, Scorer

PolicyFactory = Callable[..., RoutingPolicy]
ScorerFactory = Callable[..., Scorer]

_POLICIES: dict[str, PolicyFactory] = {}  # name -> factory
_SCORERS: dict[str, ScorerFactory] = {}  # name -> factory


class UnknownPolicyError(ValueError):
    pass


def register_policy(name: str, factory: PolicyFactory) -> None:
    if name in _POLICIES:
        raise ValueError(f"routing policy {name!r} is already registered")
    _POLICIES[name] = factory


def register_scorer(name: str, factory: ScorerFactory) -> None:
    if name in _SCORERS:
        raise ValueError(f"routing scorer {name!r} is already registered")
    _SCORERS[name] = factory


def policy_names() -> list[str]:
    _load_builtins()
    return sorted(_POLICIES)


def scorer_names() -> list[str]:
    _load_builtins()
    return sorted(_SCORERS)


def create_policy(name: str, **params: Any) -> RoutingPolicy:
    """Build a registered policy; unknown names and bad parameters raise ValueError."""
    _load_builtins()
    if name not in _POLICIES:
        raise UnknownPolicyError(
            f"unknown routing policy {name!r}; known: {', '.join(sorted(_POLICIES))}"
        )
    try:
        return _POLICIES[name](**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for routing policy {name!r}: {exc}") from None


def create_scorer(name: str, **params: Any) -> Scorer:
    _load_builtins()
    if name not in _SCORERS:
        raise UnknownPolicyError(
            f"unknown routing scorer {name!r}; known: {', '.join(sorted(_SCORERS))}"
        )
    try:
        return _SCORERS[name](**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for routing scorer {name!r}: {exc}") from None


_loaded = False


def _load_builtins() -> None:
    """Import the built-in policy modules once; each registers itself on import."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from flexpipe.policies.routing import (  # noqa: F401
        composite,
        kv_usage,
        least_load,
        least_request,
        prefix_affinity,
        queue_depth,
        random_pick,
        round_robin,
    )
