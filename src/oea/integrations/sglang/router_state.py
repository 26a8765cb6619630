"""One object per SGLang MoE layer: every fact the hot path needs about it, made at the layer's first routing call.

SGLang's routing call names its layer (``layer_id``) and hands its ``TopKConfig``; ``router_state`` returns that
layer's ``RouterState`` from ``STATE.routers`` (the plugin's one per-process map, layer id -> state), made anew when
the layer comes with another config object, another number of experts or under replaced settings (``install``).
It holds the layer's spec (or why the layer keeps SGLang's routing), its entry of ``OEA_LAYER_K0_FILE``, its base
config (``OEA_K0``'s, or EP-aware OEA on SGLang's placement: ``placement.py``), the numba kernel prepared for its
current config, its filler mask (``fillers.py``), its slot in the ``OEA_TRACE_FILE`` recording (``recording.py``)
and whether its OEA routing raised (then it keeps SGLang's routing). Unlike vLLM's, it keeps no output buffers:
the ids and weights a call returns are SGLang's ``topk_ids`` / ``topk_weights`` from then on, which SGLang may keep
past the layer. ``RouterCall`` holds what one routing call found out, step by step (``routing.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

import oea.integrations.sglang.targets as targets
from oea.config import EnvSettings, layer_configs
from oea.integrations.metrics import PASSTHROUGH_REASONS
from oea.integrations.sglang.specs import UnsupportedRouting, router_spec_from_topk_config
from oea.integrations.sglang.state import STATE
from oea.kernels import NumbaRouter, plan
from oea.routing import EPOEAConfig, LayerConfigs, OEAConfig, RouterSpec

UNDECIDED = -1  # trace_slot before the layer's first recorded call decides it


def _reason(name: str) -> str:
    """A pass-through reason, looked up in the one list every engine shares (a name not there fails at import)."""
    return next(key for key in PASSTHROUGH_REASONS if key == name)


# why a call keeps SGLang's routing (the metrics line's ``reason``, the ``oea_*`` series' ``reason`` label)
BELOW_MIN_BATCH, K0_COVERS_TOP_K, LAYER_FAILED, OEA_OFF, VERIFY_NOT_APPLIED = map(
    _reason, ("below_min_batch", "k0_covers_top_k", "layer_failed", "oea_off", "verify_not_applied"))


@dataclass(eq=False)
class RouterState:
    """Everything about one SGLang MoE layer that outlives a call (see the module docstring)."""

    layer_id: Any
    topk_config: Any  # the TopKConfig the spec was read from
    num_experts: int
    settings: EnvSettings | None  # the settings it was made under
    layers: LayerConfigs  # every layer's config per batch size under those settings
    spec: RouterSpec | None = None  # None: the layer keeps SGLang's routing (``why``)
    why: str = ""  # why there is no spec: the layer's routing, or settings that do not fit it
    missing: str = ""  # why OEA_LAYER_K0_FILE has no entry for the layer ("": it has one, or there is no file)
    layer_entry: int | None = None  # its entry of OEA_LAYER_K0_FILE (None: no file)
    ep: EPOEAConfig | None = None  # OEA_POLICY=ep: EP-aware OEA on SGLang's placement of this layer
    ep_detail: str = ""  # the placement read, or why there is none ("": not read yet)
    ep_metadata: Any = None  # SGLang's ExpertLocationMetadata the placement was read from
    kernel_key: tuple[Any, Any] | None = None  # (config, spec) the kernel was prepared for
    kernel: NumbaRouter | None = None  # None: only route_fast reproduces the config
    earlier: torch.Tensor | None = None  # [k, k] bool, [j, i]: i < j (fillers.distinct_fillers)
    earlier_host: Any = None  # ``earlier`` as a numpy view (fillers.distinct_fillers_on_host)
    trace_slot: int | None = UNDECIDED  # its layer in the OEA_TRACE_FILE recording (None: not recorded)
    failed: bool = False  # its OEA routing raised: SGLang's routing from then on

    def config(self, base: OEAConfig | EPOEAConfig, rows: int) -> Any:
        """The config of one call of ``rows`` rows: ``base`` with the layer's k0 and ``min_batch`` for this batch
        size (``oea.routing.LayerConfigs``, the rule every engine follows)."""
        if self.layer_entry is None:
            return base
        return self.layers.config(self.layer_entry, rows, base)

    def prepared_kernel(self, router_logits: torch.Tensor, cfg: Any) -> NumbaRouter | None:
        """The layer's numba kernel for ``cfg`` on CPU logits (None: only ``route_fast`` reproduces it), prepared
        once per config (a per-batch-size k0 gives a layer one config per k0)."""
        assert self.spec is not None
        key = self.kernel_key
        if key is None or key[0] is not cfg or key[1] is not self.spec:
            if router_logits.shape[0] == 0:  # plan keeps an empty batch on oea.route: decide on a real one
                return None
            impl, params = plan(router_logits, self.spec, cfg)
            self.kernel = (
                NumbaRouter(params, self.spec.correction_bias, self.spec.num_experts)
                if (impl == "numba" and params is not None)
                else None
            )
            self.kernel_key = (cfg, self.spec)
        return self.kernel

    def earlier_on_host(self) -> Any:
        """``earlier`` (a CPU mask) as numpy, viewed once."""
        if self.earlier_host is None and self.earlier is not None:
            self.earlier_host = self.earlier.numpy()
        return self.earlier_host


@dataclass
class RouterCall:
    """One routing call's facts, filled step by step (``routing.py``). Tensors: [M, N] logits."""

    state: RouterState
    rows: int  # M, padding rows included
    cfg: Any = None  # 1. the config for these rows
    keep: bool = True  # 2. SGLang's routing is kept in this call
    non_padded: torch.Tensor | int | None = None  # 3. rows >= this count are padding (None: every row real)
    eager_cpu: bool = False  # 4. CPU logits outside tracing: the prepared kernel and the host fillers run
    rerouted: bool = False  # 4-5. OEA's routing was spliced into SGLang's output
    repeats: bool | None = None  # 4-5. some row of OEA's ids holds an id twice (None: not known, fillers.py checks)
    why: str | None = None  # 2-4. why SGLang's routing was kept (K0_COVERS_TOP_K, BELOW_MIN_BATCH)


def router_state(layer_id: Any, topk_config: Any, num_experts: int) -> RouterState:
    """Layer ``layer_id``'s state for a call with ``topk_config`` over ``num_experts`` experts, made on first use."""
    state = STATE.routers.get(layer_id)
    if (
        state is not None
        and state.topk_config is topk_config
        and state.num_experts == num_experts
        and state.settings is STATE.settings
    ):
        return state
    fresh = _new_state(layer_id, topk_config, num_experts)
    if state is not None:  # the recorder keeps one slot per layer id, whatever the layer's settings
        fresh.trace_slot = state.trace_slot
    STATE.routers[layer_id] = fresh
    return fresh


def _new_state(layer_id: Any, topk_config: Any, num_experts: int) -> RouterState:
    """A layer's state: its spec (or why none), and its entry of the layer file (or why none)."""
    settings = STATE.settings
    layers = STATE.layers
    if layers is None or settings is None or layers.default is not settings.oea:  # settings set without install
        layers = STATE.layers = layer_configs(settings) if settings is not None else LayerConfigs(None)
    state = RouterState(layer_id, topk_config, num_experts, settings, layers)
    try:
        reason = _unsupported_setup(topk_config)
        if reason:
            raise UnsupportedRouting(reason)
        state.spec = router_spec_from_topk_config(topk_config, num_experts, scaling_fused=_scaling_fused(topk_config))
        if settings is not None and settings.oea is not None:
            layers.check_router(state.spec)  # the settings must fit the router, as at vLLM's or transformers' start
    except (UnsupportedRouting, ValueError) as why:  # ValueError: the settings do not fit, in every adapter's words
        state.spec, state.why = None, str(why)
        return state
    try:
        state.layer_entry = layers.index(layer_id=layer_id)
    except ValueError as err:
        state.missing = str(err)
    return state


def recorded_spec(state: RouterState) -> RouterSpec | str:
    """The layer's spec for the recorder, or why it is not recorded."""
    return state.spec if state.spec is not None else state.why


def _unsupported_setup(topk_config: Any) -> str | None:
    topk = importlib.import_module(targets.TOPK_MODULE)
    if getattr(topk, "_use_aiter", False):
        return "AMD aiter routing (SGLANG_USE_AITER=1)"
    if getattr(topk, "_is_npu", False):
        return "Ascend NPU routing"
    if getattr(topk_config, "allow_routed_experts_capture", True) is False:
        return "speculative draft-model TopK"
    return None


def _scaling_fused(topk_config: Any) -> bool:
    topk = importlib.import_module(targets.TOPK_MODULE)
    fused = getattr(topk, "is_routed_scaling_factor_fused_in_topk", None)
    if fused is not None:
        return bool(fused(topk_config))
    return bool(getattr(topk_config, "apply_routed_scaling_factor_on_output", False))
