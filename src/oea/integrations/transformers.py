"""OEA for Hugging Face transformers 5.x: ``attach(model, cfg)`` hooks every MoE router in place.

How it works (see ``docs/transformers.md``):

* Every MoE block (a module with children ``gate``/``router`` and ``experts``) gets a forward pre-hook
  that marks a **decode step**: block input ``[B, S, H]`` with ``S == 1``. A forward hook clears it.
* The router gets a forward hook that, in decode steps, recomputes the router logits from the
  router's own input (``F.linear``, fp32 for the grouped sigmoid routers, as they do), reroutes with
  ``oea.route`` and returns ``(router_logits, weights, ids, *rest)`` in the router's own dtypes.
  Prefill is untouched (``decode_only=True``).
* transformers 5.0-5.10 DeepSeek/GLM blocks, whose gate returns only logits, are hooked through the
  block's ``route_tokens_to_experts(router_logits) -> (ids, weights)`` instead.
* Each layer is checked once at attach time: with k0 = k the hook must reproduce the router's own
  ids (as sets) and weights. A layer that fails is left alone, with a warning naming it.
* Statistics accumulate in device tensors inside the hooks (no Python state changes per step, so
  ``torch.compile(fullgraph=True)`` decode stays one graph); ``OEAHandle.stats()`` reads them.

transformers is imported lazily; only ``torch`` is needed to import this module.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oea.config import ALIASES, check_k0_against, settings_from_env
from oea.routing import LayerK0Schedule, OEAConfig, RouterSpec, route

# Router classes whose math ``oea.route`` reproduces, grouped by family (transformers 5.19-5.24).
# Softmax over all experts, top-k, renormalise when ``norm_topk_prob`` is set.
SOFTMAX_NORM_TOPK_ROUTERS: frozenset[str] = frozenset({
    "Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "Qwen3NextTopKRouter", "OlmoeTopKRouter",
    "FlexOlmoTopKRouter", "MellumTopKRouter", "Qwen3OmniMoeThinkerTextTopKRouter",
    "Qwen3OmniMoeTalkerTextTopKRouter", "Qwen4ExpTextTopKRouter",
})
# Softmax over all experts, top-k, always renormalised (no ``norm_topk_prob`` attribute).
SOFTMAX_RENORM_ROUTERS: frozenset[str] = frozenset({
    "MixtralTopKRouter", "MiniMaxTopKRouter", "Qwen3_5MoeTopKRouter", "Qwen3OmniMoeTextTopKRouter",
    "Qwen3VLMoeTextTopKRouter",
})
# fp32 logits -> sigmoid -> + e_score_correction_bias -> group limit -> top-k -> unbiased weights,
# renormalised when ``norm_topk_prob`` -> x routed_scaling_factor (DeepSeek-V3 and GLM routers).
GROUPED_SIGMOID_ROUTERS: frozenset[str] = frozenset({
    "DeepseekV3TopkRouter", "DeepseekV32TopkRouter", "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter",
    "Glm4vMoeTextTopkRouter", "GlmMoeDsaTopkRouter", "Glm5NextTextTopkRouter", "AXK1TopkRouter",
    "BailingHybridTopkRouter", "Dots1TopkRouter", "Dots3NoteTextTopkRouter", "ExaoneMoeTopkRouter",
    "HYV4TopkRouter", "HYV4VLTopkRouter", "KimiLinearTopkRouter", "MiMoV2FlashTopkRouter",
    "NemotronHTopkRouter", "SolarOpenTopkRouter",
})
SUPPORTED_ROUTERS: frozenset[str] = (
    SOFTMAX_NORM_TOPK_ROUTERS | SOFTMAX_RENORM_ROUTERS | GROUPED_SIGMOID_ROUTERS
)
ROUTER_CHILD_NAMES: tuple[str, ...] = ("gate", "router")
LEGACY_ROUTE_METHOD = "route_tokens_to_experts"  # transformers 5.0-5.10 DeepSeek/GLM blocks

# Families the doctor and the docs name: (model_type, module, router class).
DOCTOR_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"),
    ("olmoe", "transformers.models.olmoe.modeling_olmoe", "OlmoeTopKRouter"),
    ("mixtral", "transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter"),
    ("deepseek_v3", "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter"),
    ("glm4_moe", "transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeTopkRouter"),
    ("glm_moe_dsa", "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaTopkRouter"),
)

OPTIONAL_FAMILIES: frozenset[str] = frozenset({"glm_moe_dsa"})

# A layer's device counters, in this order: decode steps, rows, active experts (OEA), active experts
# (the router's own picks), non-zero-weight slots.
_NUM_COUNTERS = 5

# Routers currently hooked (one OEA handle per model at a time) -> that handle's flags. The value must
# not reference the router, or the weak key would never die and a dropped model would leak.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, _HandleState] = weakref.WeakKeyDictionary()


def engine_version() -> str | None:
    """The installed transformers version, or None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


def _first_attr(modules: tuple[nn.Module, ...], names: tuple[str, ...]) -> Any:
    for module in modules:
        for name in names:
            if hasattr(module, name):
                return getattr(module, name)
    return None


def _num_experts(router: nn.Module, owners: tuple[nn.Module, ...]) -> int:
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    found = _first_attr(owners, ("num_experts", "n_routed_experts"))
    if found is None:
        raise ValueError(f"cannot tell the number of experts of router {type(router).__name__}")
    return int(found)


def spec_from_router(router: nn.Module, block: nn.Module | None = None) -> RouterSpec:
    """The ``RouterSpec`` of a transformers router module (its family's routing math).

    Args:
        router: the MoE block's ``gate`` / ``router`` child, e.g. ``Qwen3MoeTopKRouter``.
        block: the MoE block; only read as a fallback holder of routing attributes (5.0-5.10
            DeepSeek/GLM blocks keep ``top_k``, ``n_group``... on the block, not the gate).

    Raises:
        ValueError: naming the router class when its routing is not one ``oea.route`` reproduces.
    """
    cls = type(router).__name__
    if cls not in SUPPORTED_ROUTERS:
        raise ValueError(
            f"unsupported router class {cls}: OEA reproduces softmax top-k routers "
            f"({', '.join(sorted(SOFTMAX_NORM_TOPK_ROUTERS | SOFTMAX_RENORM_ROUTERS))}) and grouped "
            f"sigmoid routers ({', '.join(sorted(GROUPED_SIGMOID_ROUTERS))})"
        )
    owners = (router,) if block is None else (router, block)
    num_experts = _num_experts(router, owners)
    top_k = _first_attr(owners, ("top_k", "num_experts_per_tok"))
    if top_k is None:
        raise ValueError(f"router {cls} has no top_k attribute")
    if cls in SOFTMAX_RENORM_ROUTERS:
        return RouterSpec(num_experts, int(top_k), scoring="softmax", renormalize=True)
    if cls in SOFTMAX_NORM_TOPK_ROUTERS:
        renormalize = bool(_first_attr(owners, ("norm_topk_prob",)))
        return RouterSpec(num_experts, int(top_k), scoring="softmax", renormalize=renormalize)
    bias = _first_attr(owners, ("e_score_correction_bias",))
    n_group = _first_attr(owners, ("num_group", "n_group"))
    topk_group = _first_attr(owners, ("topk_group",))
    norm = _first_attr(owners, ("norm_topk_prob",))
    scale = _first_attr(owners, ("routed_scaling_factor",))
    return RouterSpec(
        num_experts,
        int(top_k),
        scoring="sigmoid",
        renormalize=bool(norm) if norm is not None else True,
        correction_bias=bias,
        n_group=None if n_group is None else int(n_group),
        topk_group=None if (topk_group is None or n_group is None) else int(topk_group),
        routed_scaling_factor=1.0 if scale is None else float(scale),
    )


@dataclass(frozen=True, eq=False)
class MoELayer:
    """One MoE block of a model.

    Attributes:
        index: the decoder-layer number from the module path (``model.layers.3.mlp`` -> 3); the
            position among MoE blocks when the paths do not give unique numbers.
        name: the block's qualified module name.
        block: the MoE block module (children ``gate``/``router`` and ``experts``).
        router: the router module.
        router_name: ``"gate"`` or ``"router"``.
        spec: the router's family spec.
        legacy: True for 5.0-5.10 DeepSeek/GLM blocks hooked through ``route_tokens_to_experts``.
    """

    index: int
    name: str
    block: nn.Module
    router: nn.Module
    router_name: str
    spec: RouterSpec
    legacy: bool = False

    @property
    def logits_in_fp32(self) -> bool:
        """Grouped sigmoid routers compute their logits in fp32; softmax routers in the weight dtype."""
        return self.spec.scoring == "sigmoid"


def _router_child(block: nn.Module) -> tuple[str, nn.Module] | None:
    children = dict(block.named_children())
    if "experts" not in children:
        return None
    for name in ROUTER_CHILD_NAMES:
        if isinstance(children.get(name), nn.Module):
            return name, children[name]
    return None


def _layer_number(name: str) -> int | None:
    numbers = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", name)
    return int(numbers[-1]) if numbers else None


def _is_legacy(block: nn.Module, router: nn.Module) -> bool:
    """5.0-5.10 grouped routers return only logits; the block routes in ``route_tokens_to_experts``."""
    grouped = type(router).__name__ in GROUPED_SIGMOID_ROUTERS
    return grouped and callable(getattr(block, LEGACY_ROUTE_METHOD, None))


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every MoE block of ``model``, in module order.

    Raises:
        ValueError: when no module has both a ``gate``/``router`` child and an ``experts`` child,
            or when such a block's router class is not supported (the message names the class).
    """
    found: list[tuple[str, nn.Module, str, nn.Module]] = []
    for name, module in model.named_modules():
        child = _router_child(module)
        if child is not None:
            found.append((name, module, child[0], child[1]))
    if not found:
        raise ValueError(
            f"no MoE blocks found in {type(model).__name__}: looked for modules with a "
            f"{' or '.join(repr(n) for n in ROUTER_CHILD_NAMES)} child module and an 'experts' child module"
        )
    numbers = [_layer_number(name) for name, *_ in found]
    if None in numbers or len(set(numbers)) != len(numbers):
        numbers = list(range(len(found)))
    layers = []
    for index, (name, block, router_name, router) in zip(numbers, found, strict=True):
        try:
            spec = spec_from_router(router, block)
        except ValueError as err:
            raise ValueError(f"MoE block {name!r}: {err}") from None
        layers.append(MoELayer(int(index), name, block, router, router_name, spec, _is_legacy(block, router)))
    return layers


def _check_cfg(cfg: object | None, spec: RouterSpec, where: str) -> None:
    check = getattr(cfg, "check", None)
    if check is None:
        return
    try:
        check(spec)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


class _HandleState:
    """Flags every hook of one handle reads."""

    def __init__(self, decode_only: bool) -> None:
        self.enabled = True
        self.decode_only = decode_only


class _LayerHook:
    """Decode flag, configuration, counters and the routing rewrite of one MoE layer."""

    def __init__(self, layer: MoELayer, cfg: object | None, state: _HandleState) -> None:
        self.layer = layer
        self.cfg = cfg
        self.state = state
        self.spec = layer.spec
        self.decode = False
        self.validated = False
        device = layer.router.weight.device if hasattr(layer.router, "weight") else torch.device("cpu")
        self.counts = torch.zeros(_NUM_COUNTERS, dtype=torch.int64, device=device)
        self.last_active = torch.zeros((), dtype=torch.int64, device=device)

    # -- routing -----------------------------------------------------------------------------
    def current_spec(self) -> RouterSpec:
        """The spec, following a correction-bias buffer that ``model.to(...)`` moved or cast."""
        bias = self.spec.correction_bias
        if bias is not None:
            router = self.layer.router
            owner = router if hasattr(router, "e_score_correction_bias") else self.layer.block
            live = owner.e_score_correction_bias
            if live.device != bias.device or live.dtype != bias.dtype:
                self.spec = dataclasses.replace(self.spec, correction_bias=live)
        return self.spec

    def logits_from_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Router input ``[..., H]`` -> ``[M, N]`` logits, computed as the router computes them."""
        weight = self.layer.router.weight
        x = hidden_states.reshape(-1, weight.shape[-1])
        if self.layer.logits_in_fp32:
            return F.linear(x.float(), weight.float())
        return F.linear(x, weight)

    def reroute(self, logits: torch.Tensor, cfg: object | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``[M, N]`` logits -> ids ``[M, k]`` int64, weights ``[M, k]`` float32."""
        return route(logits, self.current_spec(), cfg)

    def rewrite(
        self, logits: Callable[[], torch.Tensor], own_weights: torch.Tensor, own_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The hook body: ``(weights, ids)`` to use instead of the router's own, or None to keep them.

        ``logits()`` gives the ``[M, N]`` router logits (computed only when rerouting);
        ``own_weights`` / ``own_ids`` are the router's output ``[M, k]``. Returned weights keep
        ``own_weights.dtype``, ids are int64. Counts decode steps into the device counters.
        """
        decode = self.decode
        active = self.state.enabled and self.validated and self.cfg is not None
        rerouting = active and (decode or not self.state.decode_only)
        if not rerouting and not decode:
            return None
        if rerouting:
            ids, weights = self.reroute(logits(), self.cfg)
            weights = weights.to(own_weights.dtype)
        else:
            ids, weights = own_ids, own_weights
        if decode:
            self.count(ids, weights, own_ids)
        return (weights, ids) if rerouting else None

    def count(self, ids: torch.Tensor, weights: torch.Tensor, own_ids: torch.Tensor) -> None:
        """Accumulate one decode step into the device counters (no host sync, no Python state).

        ``ids`` / ``weights`` ``[M, k]``: the routing the experts get; ``own_ids`` ``[M, k]``: the router's.
        """
        if self.counts.device != ids.device:  # the model moved after attach (eager only)
            self.counts = self.counts.to(ids.device)
            self.last_active = self.last_active.to(ids.device)
        n = self.spec.num_experts
        used = weights != 0
        routed = torch.where(used, ids, n)  # zero-weight fillers go to the dummy column n
        # one scatter marks both routings' experts: row 0 = what the experts get, row 1 = the router's picks
        marks = torch.zeros(2, n + 1, dtype=torch.int64, device=ids.device)
        marks.scatter_(1, torch.stack([routed.reshape(-1), own_ids.reshape(-1)]), 1)
        distinct = marks[:, :n].sum(dim=1)  # [2]
        fixed = torch.tensor([1, ids.shape[0]], dtype=torch.int64, device=ids.device)
        self.counts.add_(torch.cat([fixed, distinct, used.sum().reshape(1)]))
        self.last_active.copy_(distinct[0])

    # -- hooks -------------------------------------------------------------------------------
    def block_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        self.decode = isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == 1

    def block_post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.decode = False

    def router_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not isinstance(output, tuple) or len(output) < 3:
            raise TypeError(
                f"{self.layer.name}.{self.layer.router_name}: expected the router to return "
                f"(router_logits, topk_weights, topk_ids, ...), got {type(output).__name__}"
            )
        if not self.decode and self.state.decode_only:
            return None
        x = args[0] if args else kwargs["hidden_states"]
        new = self.rewrite(lambda: self.logits_from_input(x), output[1], output[2])
        if new is None:
            return None
        return (output[0], new[0], new[1], *output[3:])

    def legacy_route(self, original: Callable[[torch.Tensor], tuple]) -> Callable[[torch.Tensor], tuple]:
        """Wrap a 5.0-5.10 ``route_tokens_to_experts(router_logits) -> (ids, weights)``."""

        def route_tokens_to_experts(router_logits: torch.Tensor) -> tuple:
            ids, weights = original(router_logits)
            if not self.decode and self.state.decode_only:
                return ids, weights
            new = self.rewrite(lambda: router_logits.reshape(-1, router_logits.shape[-1]), weights, ids)
            return (ids, weights) if new is None else (new[1], new[0])

        route_tokens_to_experts.__oea_wrapper__ = True  # type: ignore[attr-defined]
        return route_tokens_to_experts

    # -- attach-time check -------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, rows: int = 16, seed: int = 0) -> str | None:
        """k0 = k must reproduce the router's own routing on random inputs; returns a reason or None."""
        router = self.layer.router
        weight = router.weight
        generator = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(rows, weight.shape[-1], generator=generator)
        x = x.to(device=weight.device, dtype=weight.dtype)
        if self.layer.legacy:
            logits = router.forward(x)
            unhooked = getattr(type(self.layer.block), LEGACY_ROUTE_METHOD)  # the class's own method
            own_ids, own_weights = unhooked(self.layer.block, logits)
            logits = logits.reshape(-1, logits.shape[-1])
        else:
            output = router.forward(x)  # .forward: bypasses this handle's hooks
            own_weights, own_ids = output[1], output[2]
            logits = self.logits_from_input(x)
        self.reroute(logits, self.cfg)  # a config route() rejects fails here, at attach, not mid-generate
        ids, weights = self.reroute(logits, OEAConfig(k0=self.spec.top_k, min_batch=0))
        weights = weights.to(own_weights.dtype)
        return _routing_mismatch(own_ids, own_weights, ids, weights)


def _routing_mismatch(
    own_ids: torch.Tensor, own_weights: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> str | None:
    """Compare two routings ``[M, k]`` ignoring slot order; a description of the first difference or None."""
    if own_ids.shape != ids.shape:
        return f"shape {tuple(ids.shape)} != router's {tuple(own_ids.shape)}"
    own_sorted, own_order = own_ids.sort(dim=-1)
    new_sorted, new_order = ids.to(own_ids.dtype).sort(dim=-1)
    if not torch.equal(own_sorted, new_sorted):
        rows = (own_sorted != new_sorted).any(dim=-1).sum().item()
        return f"expert ids differ in {rows} of {ids.shape[0]} rows"
    own_w = own_weights.gather(1, own_order).float()
    new_w = weights.gather(1, new_order).float()
    tol = 1e-5 if own_weights.dtype in (torch.float32, torch.float64) else 1e-2
    if not torch.allclose(own_w, new_w, rtol=tol, atol=tol):
        return f"weights differ by up to {(own_w - new_w).abs().max().item():.3g}"
    return None


class OEAHandle:
    """Hooks installed by ``attach``; ``remove()`` restores the model.

    Attributes:
        layers: the hooked ``MoELayer`` list (index, name, router, spec).
        configs: the routing config per layer index (None = vanilla pass-through, still counted).
        decode_only: reroute only decode steps (block input ``[B, 1, H]``).
    """

    def __init__(self, layers: list[MoELayer], configs: dict[int, object | None], decode_only: bool) -> None:
        self.layers = layers
        self.configs = configs
        self.decode_only = decode_only
        self._state = _HandleState(decode_only)
        self._hooks = {layer.index: _LayerHook(layer, configs[layer.index], self._state) for layer in layers}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._legacy: list[nn.Module] = []
        self._removed = False

    @property
    def enabled(self) -> bool:
        """When False, every layer passes the router's own routing through (decode steps still counted)."""
        return self._state.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"enabled must be a bool, got {value!r}")
        self._state.enabled = value

    @property
    def rerouted_layers(self) -> list[int]:
        """Indices of the layers whose routing OEA rewrites (validated, with a config)."""
        return [i for i, hook in self._hooks.items() if hook.validated and hook.cfg is not None]

    def _install(self) -> None:
        """Check each rerouted layer (k0 = k identity), then register its hooks."""
        for layer in self.layers:
            hook = self._hooks[layer.index]
            if hook.cfg is not None:
                reason = hook.validate()
                if reason is not None:
                    warnings.warn(
                        f"oea: layer {layer.index} ({layer.name}, {type(layer.router).__name__}) left on "
                        f"its own routing: the k0=k recomputation does not reproduce the router ({reason})",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                else:
                    hook.validated = True
            self._handles.append(layer.block.register_forward_pre_hook(hook.block_pre_hook, with_kwargs=True))
            self._handles.append(layer.block.register_forward_hook(hook.block_post_hook, always_call=True))
            if layer.legacy:
                original = getattr(layer.block, LEGACY_ROUTE_METHOD)
                setattr(layer.block, LEGACY_ROUTE_METHOD, hook.legacy_route(original))
                self._legacy.append(layer.block)
            else:
                self._handles.append(layer.router.register_forward_hook(hook.router_hook, with_kwargs=True))
            _ATTACHED[layer.router] = self._state

    def remove(self) -> None:
        """Remove every hook; the model is exactly as before ``attach``. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block in self._legacy:
            if getattr(block.__dict__.get(LEGACY_ROUTE_METHOD), "__oea_wrapper__", False):
                del block.__dict__[LEGACY_ROUTE_METHOD]
        self._legacy.clear()
        for layer in self.layers:
            if _ATTACHED.get(layer.router) is self._state:
                del _ATTACHED[layer.router]
        self._removed = True

    def __enter__(self) -> OEAHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def reset_stats(self) -> None:
        """Zero every layer's counters."""
        for hook in self._hooks.values():
            hook.counts.zero_()
            hook.last_active.zero_()

    def stats(self) -> dict[int, dict[str, Any]]:
        """Per-layer statistics over the decode steps seen since attach / ``reset_stats()``.

        Returns ``{layer_index: {...}}`` with
            ``name`` (block module name), ``router`` (router class), ``rerouted`` (OEA rewrites
            this layer), ``policy`` (config class name, None when not rerouted), ``k``, ``k0``
            (None when not rerouted or the policy has no single k0), ``num_experts``, ``steps`` (decode
            calls), ``tokens`` (rows over those calls), ``mean_active_experts`` (distinct experts with
            non-zero weight per step), ``mean_active_experts_vanilla`` (distinct experts the model's
            own router picked per step), ``mean_experts_per_token`` (non-zero-weight slots per row).
        Means are 0.0 when no decode step was seen.
        """
        out: dict[int, dict[str, Any]] = {}
        for index, hook in self._hooks.items():
            steps, tokens, active, vanilla, slots = (int(v) for v in hook.counts.tolist())
            rerouted = hook.validated and hook.cfg is not None
            out[index] = {
                "name": hook.layer.name,
                "router": type(hook.layer.router).__name__,
                "rerouted": rerouted,
                "k": hook.layer.spec.top_k,
                "policy": type(hook.cfg).__name__ if rerouted else None,
                "k0": getattr(hook.cfg, "k0", None) if rerouted else None,
                "num_experts": hook.layer.spec.num_experts,
                "steps": steps,
                "tokens": tokens,
                "mean_active_experts": active / steps if steps else 0.0,
                "mean_active_experts_vanilla": vanilla / steps if steps else 0.0,
                "mean_experts_per_token": slots / tokens if tokens else 0.0,
            }
        return out

    def last_active_experts(self) -> dict[int, int]:
        """Distinct active experts per layer in the most recent decode step (0 before any)."""
        return {index: int(hook.last_active) for index, hook in self._hooks.items()}

    def __repr__(self) -> str:
        state = "removed" if self._removed else ("enabled" if self.enabled else "disabled")
        return f"OEAHandle({len(self.layers)} MoE layers, rerouted={self.rerouted_layers}, {state})"


def attach(
    model: nn.Module,
    cfg: object | None,
    *,
    decode_only: bool = True,
    layer_configs: Mapping[int, object | None] | None = None,
) -> OEAHandle:
    """Hook OEA routing into every MoE block of a transformers model.

    Args:
        model: any ``nn.Module`` holding MoE blocks (``gate``/``router`` + ``experts`` children).
        cfg: a config ``oea.route`` accepts (``OEAConfig``, ``PrunedConfig``, ...) or None (vanilla
            routing passed through, decode steps still counted).
        decode_only: reroute only decode steps (block input ``[B, 1, H]``); False reroutes every
            forward, prefill included.
        layer_configs: ``{layer_index: config}`` overriding ``cfg`` for those MoE layers (see
            ``MoELayer.index``); a value of None leaves that layer vanilla.

    Returns:
        An ``OEAHandle``; ``handle.remove()`` restores the model.

    Raises:
        ValueError: no MoE blocks, an unsupported router class, a config that does not fit a
            layer (e.g. k0 > top_k), an unknown layer index, or a model already attached.
    """
    if not isinstance(decode_only, bool):
        raise ValueError(f"decode_only must be a bool, got {decode_only!r}")
    layers = find_moe_layers(model)
    by_index = {layer.index: layer for layer in layers}
    overrides = dict(layer_configs or {})
    unknown = sorted(set(overrides) - set(by_index), key=str)
    if unknown:
        raise ValueError(f"layer_configs has unknown MoE layer indices {unknown}; valid: {sorted(by_index)}")
    configs: dict[int, object | None] = {}
    for layer in layers:
        layer_cfg = overrides.get(layer.index, cfg)
        _check_cfg(layer_cfg, layer.spec, f"MoE layer {layer.index} ({layer.name})")
        configs[layer.index] = layer_cfg
    for layer in layers:
        if layer.router in _ATTACHED:
            raise ValueError(
                f"an OEA handle is already attached to {layer.name}; call its remove() before attaching again"
            )
    handle = OEAHandle(layers, configs, decode_only)
    try:
        handle._install()
    except BaseException:
        handle.remove()  # leave no half-installed hooks behind, then let the error through
        raise
    return handle


def maybe_attach(model: nn.Module, env: Mapping[str, str] | None = None) -> OEAHandle | None:
    """``attach`` configured from the environment; None when neither ``OEA_K0`` (alias ``SGLANG_OEA_K0``)
    nor ``OEA_LAYER_K0_FILE`` is set.

    Reads ``OEA_K0``, ``OEA_MIN_BATCH`` (aliases ``SGLANG_OEA_*``), ``OEA_MAX_EXPERTS``,
    ``OEA_GROUP_FILL`` and ``OEA_LAYER_K0_FILE`` (see ``oea.config``). A per-layer k0 file
    (``oea.routing.LayerK0Schedule`` JSON, one k0 per MoE layer in model order) sets each layer's
    k0; its ``min_batch`` applies unless ``OEA_MIN_BATCH`` is set.

    Raises:
        ValueError: a malformed variable, k0 / max_experts larger than the model's top_k, or a
            per-layer k0 file that is missing or made for another model (the message names the variable).
    """
    env = os.environ if env is None else env
    settings = settings_from_env(env)
    if settings.oea is None and settings.layer_k0_file is None:
        return None
    layers = find_moe_layers(model)
    top_k = min(layer.spec.top_k for layer in layers)
    cfg = settings.oea
    if cfg is not None:
        source = settings.source or {}
        check_k0_against(cfg, top_k, variable="OEA_K0" if "OEA_K0" in source else ALIASES["OEA_K0"])
        if cfg.max_experts is not None and cfg.max_experts > top_k:
            raise ValueError(
                f"OEA_MAX_EXPERTS must be in {cfg.k0}..{top_k} (the model's top_k), got {cfg.max_experts}"
            )
    layer_configs = None
    if settings.layer_k0_file is not None:
        layer_configs = _layer_configs_from_file(settings.layer_k0_file, layers, env, settings.source or {}, cfg)
    return attach(model, cfg, layer_configs=layer_configs)


def _layer_configs_from_file(
    path: str, layers: list[MoELayer], env: Mapping[str, str], source: Mapping[str, str], base: OEAConfig | None
) -> dict[int, object | None]:
    """``OEA_LAYER_K0_FILE`` -> ``{layer_index: OEAConfig}``; errors name the variable and the file."""
    where = f"OEA_LAYER_K0_FILE={path}"
    try:
        schedule = LayerK0Schedule.load(path)
        spec = layers[0].spec
        schedule.check_model(spec.num_experts, spec.top_k, len(layers))
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{where}: {err}") from err
    min_batch_var = next((v for v in ("OEA_MIN_BATCH", ALIASES["OEA_MIN_BATCH"]) if v in source), None)
    min_batch = schedule.min_batch if min_batch_var is None else int(source[min_batch_var])
    group_fill = env.get("OEA_GROUP_FILL", "").strip() or "in"  # already validated by settings_from_env
    max_experts = None if base is None else base.max_experts
    configs: dict[int, object | None] = {}
    for position, layer in enumerate(layers):
        k0 = schedule.k0[position]
        try:
            configs[layer.index] = OEAConfig(k0, max_experts=max_experts, min_batch=min_batch,
                                             group_fill=group_fill)  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"{where} with OEA_MAX_EXPERTS={max_experts}: layer {layer.index}: {err}") from None
    return configs


def _check(name: str, fn: Callable[[], str]) -> dict[str, Any]:
    try:
        return {"name": name, "ok": True, "detail": fn()}
    except Exception as err:  # a doctor reports every failure instead of stopping at the first
        return {"name": name, "ok": False, "detail": f"{type(err).__name__}: {err}"}


def _self_test() -> str:
    import torch as _torch

    from oea.models.testing import tiny_qwen3_moe

    model = tiny_qwen3_moe()
    ids = _torch.randint(0, 256, (8, 1), generator=_torch.Generator().manual_seed(0))
    with _torch.no_grad():
        baseline = model(ids).logits
        with attach(model, OEAConfig(k0=4)) as handle:
            same = model(ids).logits
        drift = (baseline - same).abs().max().item()
        if drift > 1e-5:  # not bit-exact: the experts sum slots in a different order
            raise AssertionError(f"k0=k changed the logits by {drift:.3g}")
        if handle.rerouted_layers != [0, 1]:
            raise AssertionError(f"expected layers [0, 1] rerouted, got {handle.rerouted_layers}")
        with attach(model, OEAConfig(k0=1)) as handle:
            model(ids)
        stats = handle.stats()
    fewer = {i: (s["mean_active_experts"], s["mean_active_experts_vanilla"]) for i, s in stats.items()}
    if not all(oea < vanilla for oea, vanilla in fewer.values()):
        raise AssertionError(f"k0=1 did not reduce active experts (oea, vanilla) per layer: {fewer}")
    shown = ", ".join(f"layer {i}: {o:.0f} vs {v:.0f}" for i, (o, v) in fewer.items())
    return (
        f"tiny Qwen3-MoE (16 experts, k=4, batch 8): k0=k logits within {drift:.1g} of the model's; "
        f"k0=1 active experts (oea vs vanilla) {shown}"
    )


def _env_detail() -> str:
    settings = settings_from_env()
    if settings.oea is None:
        return "OEA_K0 unset: maybe_attach() leaves models alone"
    return f"maybe_attach() would use {settings.oea} (from {settings.source})"


def _router_class_check(model_type: str, module_name: str, cls: str) -> dict[str, Any]:
    """Whether this transformers has the family's router class (GLM-5 is optional: added in 5.x)."""
    import importlib

    optional = model_type in OPTIONAL_FAMILIES
    name = f"router class {model_type}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        detail = f"{module_name} not importable ({err})"
        return {"name": name, "ok": optional, "detail": detail + (" (optional family)" if optional else "")}
    if not hasattr(module, cls):
        detail = f"{cls} not in {module_name}" + (" (optional family)" if optional else "")
        return {"name": name, "ok": optional, "detail": detail}
    return {"name": name, "ok": True, "detail": f"{module_name}.{cls}"}


def doctor_checks() -> list[dict[str, Any]]:
    """Checks for ``oea doctor transformers``: each ``{"name": str, "ok": bool, "detail": str}``."""
    version = engine_version()
    if version is None:
        return [{"name": "transformers version", "ok": False, "detail": "transformers is not installed "
                 "(pip install 'oea[transformers]')"}]
    major_minor = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    checks = [{
        "name": "transformers version",
        "ok": major_minor >= (5, 0) and major_minor[0] < 6,
        "detail": f"transformers {version} (supported: 5.x; unified router contract from 5.19)",
    }]
    checks.extend(_router_class_check(*family) for family in DOCTOR_FAMILIES)
    checks.append(_check("self-test", _self_test))
    checks.append(_check("environment", _env_detail))
    return checks


__all__ = [
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

