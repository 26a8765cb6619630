"""The engine-free routing core: pure torch, no engine imports, no I/O."""

from oea.routing.catalog import make_policy, needs_k0, policy_names, policy_options
from oea.routing.comparators import BudgetConfig, SubtractiveConfig
from oea.routing.ep import EPOEAConfig, ExpertPlacement, max_device_active_experts
from oea.routing.policies import active_experts, expert_load, expert_union, register_policy, route
from oea.routing.reference import reference_route
from oea.routing.schedules import AdaptiveK0Config, LayerK0Schedule
from oea.routing.scores import RouterScores, router_scores
from oea.routing.spec import OEAConfig, PrunedConfig, RouterSpec

__all__ = [
    "AdaptiveK0Config",
    "BudgetConfig",
    "EPOEAConfig",
    "ExpertPlacement",
    "LayerK0Schedule",
    "OEAConfig",
    "PrunedConfig",
    "RouterScores",
    "RouterSpec",
    "SubtractiveConfig",
    "active_experts",
    "expert_load",
    "expert_union",
    "make_policy",
    "max_device_active_experts",
    "needs_k0",
    "policy_names",
    "policy_options",
    "reference_route",
    "register_policy",
    "route",
    "router_scores",
]
