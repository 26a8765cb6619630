"""oea: Opportunistic Expert Activation (arXiv:2511.02237), batch-aware decode-time MoE routing.

Public API::

    spec = oea.RouterSpec(num_experts, top_k, scoring="softmax", renormalize=True, ...)
    cfg = oea.OEAConfig(k0, max_experts=None, p=1.0, max_rank=None, min_batch=2)
    ids, weights = oea.route(router_logits, spec, cfg=None, valid=None)
    ids, weights = oea.route_fast(router_logits, spec, cfg=None, valid=None)   # same results, fast kernels

Engines are never imported here; adapters live in ``oea.integrations`` and import lazily.
"""

from oea.kernels import route_fast
from oea.routing import (
    OEAConfig,
    PrunedConfig,
    RouterSpec,
    active_experts,
    expert_load,
    reference_route,
    route,
)

__version__ = "0.1.0"

__all__ = [
    "OEAConfig",
    "PrunedConfig",
    "RouterSpec",
    "__version__",
    "active_experts",
    "expert_load",
    "reference_route",
    "route",
    "route_fast",
]


def __getattr__(name: str):  # lazy: attaching needs transformers only when used
    if name in ("attach", "maybe_attach"):
        from oea.integrations import transformers as _hf

        return getattr(_hf, name)
    raise AttributeError(f"module 'oea' has no attribute {name!r}")
