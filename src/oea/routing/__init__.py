"""The engine-free routing core: pure torch, no engine imports, no I/O."""

from oea.routing.catalog import make_policy, policy_names
from oea.routing.policies import active_experts, expert_load, expert_union, register_policy, route
from oea.routing.reference import reference_route
from oea.routing.scores import RouterScores, router_scores
from oea.routing.spec import OEAConfig, PrunedConfig, RouterSpec

__all__ = [
    "OEAConfig",
    "PrunedConfig",
    "RouterScores",
    "RouterSpec",
    "active_experts",
    "expert_load",
    "expert_union",
    "make_policy",
    "policy_names",
    "reference_route",
    "register_policy",
    "route",
    "router_scores",
]
