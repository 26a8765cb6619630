"""OEA for Hugging Face transformers 5.x: ``attach(model, cfg)`` hooks every MoE router in place.

How it works (see ``docs/transformers.md``): every MoE block gets a pre-hook that marks decode steps
(block input ``[B, 1, H]``), and its router a hook that, in those steps, reroutes with ``oea.route`` and
returns the router's output format; prefill is untouched. Each layer is checked once at attach time
(k0 = k must reproduce the router); a layer that fails is left alone with a warning naming it.

One job per file:

* ``routers.py``: finding MoE blocks and routers, each router family's ``RouterSpec``;
* ``routing.py``: the hot path (the block and router hooks, device counters, the attach-time check);
* ``handle.py``: ``OEAHandle`` (installed hooks, ``stats()``, ``remove()``);
* ``attach.py``: ``attach`` and ``maybe_attach`` (configuration from ``OEA_*``);
* ``doctor.py``: ``oea doctor transformers``.

transformers is imported lazily; only ``torch`` is needed to import this package.
"""

from oea.integrations.transformers.attach import attach, maybe_attach
from oea.integrations.transformers.doctor import DOCTOR_FAMILIES, doctor_checks, engine_version
from oea.integrations.transformers.handle import OEAHandle
from oea.integrations.transformers.routers import (
    GROUPED_SIGMOID_ROUTERS,
    SOFTMAX_NORM_TOPK_ROUTERS,
    SOFTMAX_RENORM_ROUTERS,
    SUPPORTED_ROUTERS,
    MoELayer,
    find_moe_layers,
    spec_from_router,
)

__all__ = [
    "DOCTOR_FAMILIES",
    "GROUPED_SIGMOID_ROUTERS",
    "SOFTMAX_NORM_TOPK_ROUTERS",
    "SOFTMAX_RENORM_ROUTERS",
    "SUPPORTED_ROUTERS",
    "MoELayer",
    "OEAHandle",
    "attach",
    "doctor_checks",
    "engine_version",
    "find_moe_layers",
    "maybe_attach",
    "spec_from_router",
]
