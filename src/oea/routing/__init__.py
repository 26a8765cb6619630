"""The engine-free routing core: pure torch, no engine imports, no I/O.

Modules: ``spec`` (router and policy configs), ``scores`` (router scores), ``policies`` (``route`` and the
policy registry), ``reference`` (the literal loops ``route`` is checked against), ``ranking``,
``comparators`` (budget / subtractive baselines), ``ep`` (EP-aware OEA), ``schedules`` (k0 by batch size,
the per-layer k0 file's schema), ``layered`` (the config of each layer and router call, and the messages
every adapter reports), ``splice`` (OEA's columns into an engine's top-k output), ``diff`` (comparing two
routings), ``catalog`` (policies by name).
"""

from oea.routing.catalog import make_policy, needs_k0, policy_names, policy_options
from oea.routing.comparators import BudgetConfig, SubtractiveConfig
from oea.routing.diff import routing_difference, same_routing
from oea.routing.ep import EPOEAConfig, ExpertPlacement, max_device_active_experts
from oea.routing.layered import LayerConfigs, k0_error, unsupported_layer_message, with_layer_k0
from oea.routing.policies import active_experts, expert_load, expert_union, register_policy, route
from oea.routing.reference import reference_route
from oea.routing.schedules import AdaptiveK0Config, LayerK0Schedule
from oea.routing.scores import RouterScores, router_scores
from oea.routing.spec import OEAConfig, PrunedConfig, RouterSpec
from oea.routing.splice import keeps_every_top_k, splice_routed_columns

__all__ = [
    "AdaptiveK0Config",
    "BudgetConfig",
    "EPOEAConfig",
    "ExpertPlacement",
    "LayerConfigs",
    "LayerK0Schedule",
    "OEAConfig",
    "PrunedConfig",
    "RouterScores",
    "RouterSpec",
    "SubtractiveConfig",
    "active_experts",
    "expert_load",
    "expert_union",
    "k0_error",
    "keeps_every_top_k",
    "make_policy",
    "max_device_active_experts",
    "needs_k0",
    "policy_names",
    "policy_options",
    "reference_route",
    "register_policy",
    "route",
    "router_scores",
    "routing_difference",
    "same_routing",
    "splice_routed_columns",
    "unsupported_layer_message",
    "with_layer_k0",
]
