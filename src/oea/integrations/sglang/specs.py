"""SGLang's ``TopKConfig`` translated into the ``RouterSpec`` of its routed columns (or why it cannot be)."""

from __future__ import annotations

from typing import Any

import torch

from oea.routing import RouterSpec


class UnsupportedRouting(Exception):
    """A router this plugin cannot rebuild; the layer keeps SGLang's own routing."""


def shared_topk_slots(topk_config: Any) -> int:
    """Appended shared-expert columns of a ``TopKConfig`` (0.5.23 name, then 0.5.9-0.5.19 name)."""
    slots = getattr(topk_config, "num_shared_topk_slots", None)
    if slots is None:
        slots = getattr(topk_config, "num_fused_shared_experts", 0)
    return int(slots or 0)


def router_spec_from_topk_config(
    topk_config: Any, num_experts: int, *, scaling_fused: bool | None = None
) -> RouterSpec:
    """Translate SGLang's ``TopKConfig`` into the ``RouterSpec`` of its routed columns.

    Args:
        topk_config: SGLang ``TopKConfig`` (read by attribute; any object with its fields works).
        num_experts: E, routed logical experts (``router_logits.shape[1]``).
        scaling_fused: whether SGLang already folded ``routed_scaling_factor`` into the top-k
            weights (``is_routed_scaling_factor_fused_in_topk``); defaults to
            ``apply_routed_scaling_factor_on_output``.

    Raises:
        UnsupportedRouting: for routings OEA does not rebuild here (custom routing functions,
            sqrtsoftplus, non-STANDARD output formats, max-per-group grouping that limits groups,
            ``num_expert_group`` > 1 without ``topk_group``).
    """
    output_format = getattr(topk_config, "output_format", None)
    if output_format is not None and getattr(output_format, "name", str(output_format)) != "STANDARD":
        raise UnsupportedRouting(
            f"output_format={getattr(output_format, 'name', output_format)}: routing happens inside "
            "the MoE kernel (use --moe-runner-backend triton)"
        )
    if getattr(topk_config, "custom_routing_function", None) is not None:
        raise UnsupportedRouting("custom_routing_function is set (e.g. Llama4)")
    if getattr(topk_config, "fused_gate_packed_ids", False):
        raise UnsupportedRouting("fused_gate_packed_ids: the router also emits packed ids")
    scoring = getattr(topk_config, "scoring_func", "softmax") or "softmax"
    routed_k = int(topk_config.top_k) - shared_topk_slots(topk_config)
    renormalize = bool(topk_config.renormalize)
    bias = topk_config.correction_bias
    grouped = bool(topk_config.use_grouped_topk)
    n_group = getattr(topk_config, "num_expert_group", None)
    topk_group = getattr(topk_config, "topk_group", None)
    if scaling_fused is None:
        scaling_fused = bool(getattr(topk_config, "apply_routed_scaling_factor_on_output", False))
    factor = getattr(topk_config, "routed_scaling_factor", None)
    scale = float(factor) if scaling_fused and factor is not None else 1.0

    if grouped and n_group and int(n_group) > 1 and not topk_group:
        # SGLang asserts both on this path; oea does not guess a group limit (RouterSpec needs both).
        raise UnsupportedRouting(f"num_expert_group={n_group} without topk_group (got {topk_group!r})")
    if grouped and bias is not None:
        # SGLang's biased grouped top-k is always sigmoid (scoring_func is ignored on this path);
        # the group score is the sum of the top-2 biased scores, as in oea. One group is no limit.
        groups = (int(n_group), int(topk_group)) if (n_group and topk_group) else (None, None)
        return RouterSpec(num_experts, routed_k, "sigmoid", renormalize, _bias_vector(bias, num_experts),
                          *groups, scale)
    if scoring not in ("softmax", "sigmoid"):
        raise UnsupportedRouting(f"scoring_func={scoring!r}")
    if grouped and n_group and topk_group and int(topk_group) < int(n_group):
        # grouped_topk without bias scores a group by its max expert; oea's grouped rule is the
        # DeepSeek-V3 sum of top-2, so only the no-limit case is the same router.
        raise UnsupportedRouting(
            f"grouped_topk without correction bias and topk_group={topk_group} < n_group={n_group}"
        )
    if bias is not None and scoring != "sigmoid":
        raise UnsupportedRouting(f"correction_bias with scoring_func={scoring!r}")
    return RouterSpec(num_experts, routed_k, scoring, renormalize,
                      None if bias is None else _bias_vector(bias, num_experts), None, None, scale)


def _bias_vector(bias: torch.Tensor, num_experts: int) -> torch.Tensor:
    if bias.dim() != 1 or bias.shape[0] != num_experts:
        raise UnsupportedRouting(f"correction_bias of shape {tuple(bias.shape)} (per-token or EP-sliced bias)")
    return bias
