"""One object per numbered vLLM router: every fact the hot path needs about it, kept on the router itself.

``_after_load`` numbers the model's routers (``STATE.routers`` / ``STATE.specs``, index = router id); the first
routing call of a router (or model load) gives it a ``RouterState`` (``router_state``), stored as the router's
``_oea_state`` attribute. It holds the router's spec, its entry of ``OEA_LAYER_K0_FILE`` (``layers.py``), its
EP-aware config on vLLM's placement (``placement.py``; None: ``OEA_K0``'s plain config), the numba kernel
prepared for its current config and the output buffers per row count (``routing.py``), its slot in the
``OEA_TRACE_FILE`` recording (``recording.py``) and whether its OEA routing raised (then it keeps vLLM's).

``RouterCall`` holds what one routing call found out, step by step (``routing.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from oea.integrations.vllm.state import STATE
from oea.kernels import NumbaRouter
from oea.routing import EPOEAConfig, RouterSpec

ATTRIBUTE = "_oea_state"  # where a vLLM router carries its RouterState


@dataclass(eq=False)
class RouterState:
    """Everything about one numbered router that outlives a call (see the module docstring)."""

    router_id: int
    spec: RouterSpec | None  # None: the layer keeps vLLM's routing (why: warned at load)
    layer: Any = None  # the MoE layer module (OEA_POLICY=ep reads its expert map)
    layer_entry: int | None = None  # its entry of OEA_LAYER_K0_FILE (None: no file)
    ep: EPOEAConfig | None = None  # OEA_POLICY=ep: EP-aware OEA on vLLM's placement of this layer
    ep_detail: str = ""  # the placement read, or why there is none
    kernel_key: tuple[Any, Any] | None = None  # (config, spec) the kernel was prepared for
    kernel: NumbaRouter | None = None  # None: only oea.route reproduces the config
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # rows -> (w, ids) [M, k]
    trace_slot: int | None = None  # its layer in the OEA_TRACE_FILE recording (None: not recorded)
    failed: bool = False  # its OEA routing raised: vLLM's routing from then on

    @property
    def name(self) -> Any:
        """The layer's module name (for messages), or the router id."""
        router = STATE.routers[self.router_id] if self.router_id < len(STATE.routers) else None
        return getattr(router, "_oea_layer", self.router_id)

    def base_config(self) -> Any:
        """The router's config before the per-layer k0: EP-aware OEA on its placement, else ``OEA_K0``'s (None: off)."""
        if self.ep is not None:
            return self.ep
        return STATE.settings.oea if STATE.settings is not None else None

    def config(self, rows: int) -> Any:
        """The config of one call of ``rows`` rows: ``base_config`` with the layer's k0 and ``min_batch`` for this
        batch size (``oea.routing.LayerConfigs``, the rule every engine follows)."""
        base = self.base_config()
        configs = STATE.layers
        if configs is None or base is None:
            return base
        return configs.config(self.layer_entry, rows, base)


@dataclass
class RouterCall:
    """One routing call's facts, filled step by step. Tensors: [M, N] logits, [M] bool ``valid``."""

    state: RouterState
    rows: int  # M, padding rows included
    cfg: Any = None  # 1. the config for these rows
    rewrite: bool = False  # 2. OEA replaces vLLM's routing in this call
    valid: torch.Tensor | None = None  # 3. real rows (None: every row)
    num_valid: int = 0
    elapsed_us: float = 0.0  # 4. OEA's routing time (OEA_TIMING)


def router_state(router_id: int) -> RouterState:
    """Router ``router_id``'s state, made on first use from what model load numbered (``STATE.specs``)."""
    router = STATE.routers[router_id]
    spec = STATE.specs[router_id]
    state = getattr(router, ATTRIBUTE, None)
    if state is None or state.router_id != router_id or state.spec is not spec:
        state = RouterState(router_id, spec)
        setattr(router, ATTRIBUTE, state)
    return state


def router_states() -> list[RouterState]:
    """Every numbered router's state, in router-id order."""
    return [router_state(i) for i in range(len(STATE.routers))]
