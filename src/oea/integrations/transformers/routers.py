"""Which transformers modules are MoE blocks and routers, and each router family's ``RouterSpec``.

A MoE block is a module with children ``gate``/``router`` and ``experts``; its router class must be one
whose math ``oea.route`` reproduces (the families below, transformers 5.19-5.24; 5.0-5.10 DeepSeek/GLM
blocks route in the block's ``route_tokens_to_experts`` instead).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from oea.routing import RouterSpec, unsupported_layer_message

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
        ValueError: naming the router class when its routing is not one ``oea.route`` reproduces, or
            when a grouped router has ``n_group`` > 1 without ``topk_group``.
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
    if n_group is not None and int(n_group) > 1 and not topk_group:
        raise ValueError(f"router {cls} has n_group={n_group} but topk_group={topk_group!r}: its config must set "
                         f"topk_group (1..{n_group}; topk_group=n_group for no group limit)")
    if n_group is not None and int(n_group) <= 1 and not topk_group:
        n_group = None  # one group limits nothing
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

    A block whose router OEA cannot reproduce keeps its own routing, with one ``RuntimeWarning`` per reason
    (``oea.routing.unsupported_layer_message``), and is not listed.

    Raises:
        ValueError: when no module has both a ``gate``/``router`` child and an ``experts`` child, or when
            no such block's router is supported (the message names the first block and its class).
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
    layers, unsupported = [], {}
    for index, (name, block, router_name, router) in zip(numbers, found, strict=True):
        try:
            spec = spec_from_router(router, block)
        except ValueError as err:
            unsupported.setdefault(str(err), name)
            continue
        layers.append(MoELayer(int(index), name, block, router, router_name, spec, _is_legacy(block, router)))
    if not layers:
        reason, name = next(iter(unsupported.items()))
        raise ValueError(f"MoE block {name!r}: {reason}")
    for reason, name in unsupported.items():
        warnings.warn(f"oea: {unsupported_layer_message(name, reason)}", RuntimeWarning, stacklevel=3)
    return layers
