"""Routing policies: rank the instances of a pool for one request.

Every policy is pure: `choose(snapshot, now, rng) -> Decision`. Build one by name with
`create_policy("least_load", **params)`; see docs/routing.md for each policy.
"""

from flexpipe.policies.routing.base import PolicyHooks, RoutingPolicy, Scorer
from flexpipe.policies.routing.prefix_index import PrefixIndex, prompt_block_hashes
from flexpipe.policies.routing.registry import (
    create_policy,
    create_scorer,
    policy_names,
    register_policy,
    register_scorer,
    scorer_names,
)
from flexpipe.policies.routing.views import (
    Decision,
    InstanceView,
    RoutingRequest,
    RoutingSnapshot,
)

__all__ = [
    "Decision",
    "InstanceView",
    "PolicyHooks",
    "PrefixIndex",
    "RoutingPolicy",
    "RoutingRequest",
    "RoutingSnapshot",
    "Scorer",
    "create_policy",
    "create_scorer",
    "policy_names",
    "prompt_block_hashes",
    "register_policy",
    "register_scorer",
    "scorer_names",
]
