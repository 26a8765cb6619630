"""Routing policies and the single entry point ``route``.

Shape legend: M = router rows (decode tokens, padding included), N = routed experts,
k = the model's top-k, k0 = baseline experts per token.

Every policy is one function registered for one config class. It receives the family scores
and the vanilla top-k, and returns ``(ids [M, k] int64, keep [M, k] bool)``: ``keep`` False marks
a zero-weight filler slot, whose id must repeat one of the row's own chosen experts. ``route``
then gathers the weights, keeps padding rows vanilla and applies ``min_batch``.

Graph safety: no host synchronisation, no data-dependent shapes, no Python branch on tensor
values; k, k0 and the config are Python values fixed at trace / capture time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from oea.routing.ranking import KEY_MIN, top_indices
from oea.routing.scores import RouterScores, mixture_weights, router_scores
from oea.routing.spec import OEAConfig, PrunedConfig, RouterSpec, as_int, check_expert_ids, require_tensor

PolicyFn = Callable[
    [RouterScores, torch.Tensor, RouterSpec, Any, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]
]
"""(scores, vanilla_ids [M, k], spec, cfg, valid [M] bool or None = all rows valid)
-> (ids [M, k] int64, keep [M, k] bool)."""

_POLICIES: dict[type, PolicyFn] = {}


def register_policy(config_type: type) -> Callable[[PolicyFn], PolicyFn]:
    """Register ``fn`` as the policy for configs of ``config_type`` (one function per rule)."""

    def decorator(fn: PolicyFn) -> PolicyFn:
        _POLICIES[config_type] = fn
        return fn

    return decorator


def config_type_names() -> list[str]:
    """Names of the registered policy config classes."""
    return sorted(t.__name__ for t in _POLICIES)


def _filler(ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Replace unused slots by the row's first id (always one of its own chosen experts)."""
    return torch.where(keep, ids, ids[:, :1])


def expert_union(base: torch.Tensor, contributes: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """S_base: [M, j] ids and optional [M, j] bool -> [N] bool union of the contributing ids.

    Non-contributing entries (padding rows, ids beyond a token's top-p baseline) are sent to a
    dummy column N that is sliced away: fixed shapes, no boolean indexing.
    """
    if contributes is None:
        union = torch.zeros(num_experts, dtype=torch.bool, device=base.device)
        return union.scatter(0, base.reshape(-1), True)
    routed = torch.where(contributes, base, num_experts)
    union = torch.zeros(num_experts + 1, dtype=torch.bool, device=base.device)
    return union.scatter(0, routed.reshape(-1), True)[:num_experts]


@register_policy(PrunedConfig)
def pruned_policy(
    scores: RouterScores, vanilla_ids: torch.Tensor, spec: RouterSpec, cfg: PrunedConfig, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token keeps its own top-k0 only; the other k - k0 slots become fillers."""
    slot = torch.arange(spec.top_k, device=vanilla_ids.device)
    keep = (slot < cfg.k0).expand_as(vanilla_ids)
    return _filler(vanilla_ids, keep), keep


@register_policy(OEAConfig)
def oea_policy(
    scores: RouterScores, vanilla_ids: torch.Tensor, spec: RouterSpec, cfg: OEAConfig, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """OEA, paper Algorithm 2 (Algorithm 1 when p = 1, max_rank = N, max_experts = k).

    Phase 1: each valid token's baseline is its top-min(k0, t_p) by the selection score; the
    union over valid tokens is S_base. Phase 2: each token fills up to ``max_experts`` slots
    in its own ``fill`` order with experts of S_base (within its top ``max_rank``).

    Slot order: the baseline in the token's rank order, then the piggybacked experts in ``fill``
    order (ties: lower index), then fillers.
    """
    num_experts, k, k0 = spec.num_experts, spec.top_k, cfg.k0
    max_experts = cfg.max_experts or k
    base = vanilla_ids[:, :k0]  # [M, k0] own top-k0, best first
    in_baseline = None  # every one of the k0 (p = 1)
    if cfg.p < 1.0:
        mass = scores.weight.gather(1, base) / (scores.weight.sum(dim=-1, keepdim=True) + 1e-20)
        in_baseline = (mass.cumsum(dim=-1) - mass) < cfg.p  # [M, k0] a prefix: rank j kept iff mass before it < p
    contributes = in_baseline
    if valid is not None:
        contributes = valid[:, None] if in_baseline is None else in_baseline & valid[:, None]
        contributes = contributes.expand_as(base)
    union = expert_union(base, contributes, num_experts)  # [N]

    candidate = union & (scores.fill > float("-inf"))  # [M, N] may be piggybacked
    if cfg.max_rank is not None and cfg.max_rank < num_experts:
        top_ranked = top_indices(scores.fill_key, cfg.max_rank)
        candidate = candidate & torch.zeros_like(candidate).scatter(1, top_ranked, True)
    forced = torch.ones_like(base, dtype=torch.bool) if in_baseline is None else in_baseline
    candidate = candidate & ~torch.zeros_like(candidate).scatter(1, base, forced)  # the baseline is placed first
    slot = torch.arange(k, device=base.device)
    if in_baseline is None:  # a fixed-size baseline: [baseline | best k - k0 candidates]
        if k > k0:
            extra = top_indices(torch.where(candidate, scores.fill_key, KEY_MIN), k - k0)
            ids = torch.cat([base, extra], dim=1)
            keep = torch.cat([forced, candidate.gather(1, extra)], dim=1)
        else:
            ids, keep = base, forced
    else:  # t_i = in_baseline.sum() baseline slots, then candidates
        t = in_baseline.sum(dim=-1, keepdim=True)  # [M, 1], >= 1
        from_base = base.gather(1, slot.clamp(max=k0 - 1).expand_as(vanilla_ids))
        if k > 1:
            extra = top_indices(torch.where(candidate, scores.fill_key, KEY_MIN), k - 1)  # t >= 1
            position = (slot - t).clamp(min=0, max=k - 2)
            ids = torch.where(slot < t, from_base, extra.gather(1, position))
            keep = (slot < t) | candidate.gather(1, extra).gather(1, position)
        else:
            ids, keep = from_base, slot < t
    if max_experts < k:
        keep = keep & (slot < max_experts)
    return _filler(ids, keep), keep


def check_route_args(
    router_logits: torch.Tensor, spec: RouterSpec, cfg: object | None, valid: torch.Tensor | None
) -> PolicyFn | None:
    """``route``'s argument checks (``TypeError`` / ``ValueError`` naming the argument); returns the policy
    (None: vanilla)."""
    require_tensor("router_logits", router_logits, "[M, N]")
    if not isinstance(spec, RouterSpec):
        raise TypeError(f"spec must be an oea.RouterSpec, got {type(spec).__name__}")
    if valid is not None:
        require_tensor("valid", valid, "[M] bool (or None)")
    if router_logits.dim() != 2 or router_logits.shape[1] != spec.num_experts:
        raise ValueError(
            f"router_logits must have shape [M, num_experts={spec.num_experts}], "
            f"got {tuple(router_logits.shape)}"
        )
    if not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be a float tensor, got dtype={router_logits.dtype}")
    if valid is not None and (valid.dtype != torch.bool or tuple(valid.shape) != (router_logits.shape[0],)):
        raise ValueError(
            f"valid must be a bool tensor of shape [M]=[{router_logits.shape[0]}], "
            f"got dtype={valid.dtype} shape={tuple(valid.shape)}"
        )
    policy = None
    if cfg is not None:
        policy = _POLICIES.get(type(cfg))
        if policy is None:
            raise ValueError(f"cfg must be None or one of {config_type_names()}, got {type(cfg).__name__}")
        check = getattr(cfg, "check", None)
        if check is not None:
            check(spec)
    return policy


def route(
    router_logits: torch.Tensor,
    spec: RouterSpec,
    cfg: object | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route one MoE layer call.

    Args:
        router_logits: [M, N] raw router logits, any float dtype (non-finite values: see
            ``oea.routing.scores``).
        spec: the model's own router.
        cfg: ``None`` for the model's own routing, or a policy config (``OEAConfig``,
            ``PrunedConfig``, or any config with a registered policy).
        valid: optional [M] bool; False marks padding rows: they never join the expert union
            and get vanilla routing.

    Returns:
        ``ids`` [M, k] int64 and ``weights`` [M, k] float32. Filler slots repeat one of the
        row's own experts with weight exactly 0; no id is out of range.
    """
    policy = check_route_args(router_logits, spec, cfg, valid)
    scores = router_scores(router_logits, spec, getattr(cfg, "group_fill", "in"))
    vanilla_ids = top_indices(scores.select_key, spec.top_k)  # [M, k], best first, ties: lower index
    renormalize = spec.renormalize
    if isinstance(cfg, PrunedConfig) and cfg.renormalize is not None:
        renormalize = cfg.renormalize

    min_batch = getattr(cfg, "min_batch", 0)
    if policy is None or (valid is None and router_logits.shape[0] < min_batch):
        return vanilla_ids, mixture_weights(scores.weight, vanilla_ids, None, spec.renormalize,
                                            spec.routed_scaling_factor)

    ids, keep = policy(scores, vanilla_ids, spec, cfg, valid)
    if valid is not None:  # padding rows (and whole batches below min_batch) keep vanilla routing
        rerouted = valid & (valid.sum() >= min_batch) if min_batch > 1 else valid
        ids = torch.where(rerouted[:, None], ids, vanilla_ids)
        keep = keep | ~rerouted[:, None]
    weights = mixture_weights(scores.weight, ids, keep, renormalize, spec.routed_scaling_factor)
    if renormalize != spec.renormalize and valid is not None:  # PrunedConfig override: vanilla rows keep theirs
        vanilla_weights = mixture_weights(scores.weight, ids, keep, spec.renormalize, spec.routed_scaling_factor)
        weights = torch.where(rerouted[:, None], weights, vanilla_weights)
    return ids, weights


def check_routing(ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None) -> None:
    """``TypeError`` / ``ValueError`` naming the argument unless ``ids`` [M, k] integer, ``weights`` [M, k] and
    ``valid`` [M] bool (or None) fit together: ``route``'s outputs, as every counting function takes them."""
    require_tensor("ids", ids, "[M, k]")
    require_tensor("weights", weights, "[M, k]")
    if ids.dim() != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor of shape [M, k], got dtype={ids.dtype} "
                         f"shape={tuple(ids.shape)}")
    if tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights must have the shape of ids [M, k]={list(ids.shape)}, got {list(weights.shape)}")
    if valid is not None:
        require_tensor("valid", valid, "[M] bool (or None)")
        if valid.dtype != torch.bool or tuple(valid.shape) != (ids.shape[0],):
            raise ValueError(f"valid must be a bool tensor of shape [M]=[{ids.shape[0]}], got dtype={valid.dtype} "
                             f"shape={tuple(valid.shape)}")


def expert_load(
    ids: torch.Tensor, weights: torch.Tensor, num_experts: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens per expert: [M, k] ids and weights -> [N] int64, counting non-zero-weight slots of valid rows."""
    check_routing(ids, weights, valid)
    num_experts = as_int("num_experts", num_experts, 1)
    used = weights != 0
    if valid is not None:
        used = used & valid[:, None]
    check_expert_ids(ids, used, num_experts)
    load = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    routed = torch.where(used, ids, torch.full_like(ids, num_experts))
    return load.scatter_add(0, routed.reshape(-1), torch.ones_like(routed).reshape(-1))[:num_experts]


def active_experts(ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None = None,
                   num_experts: int | None = None) -> torch.Tensor:
    """T: distinct experts with non-zero weight over valid rows; [M, k], [M, k], [M] -> 0-dim int64.

    Graph-safe (sort-based, fixed shape, no host sync): call ``int()`` on the result outside any
    captured region. A used slot's id below 0 (or, given ``num_experts``, at or above it) is a
    ``ValueError``; the check reads values, so it runs for CPU tensors, and for others only when
    ``num_experts`` is given (the engines count every decode step on the accelerator without a host sync).
    """
    check_routing(ids, weights, valid)
    used = weights != 0
    if valid is not None:
        used = used & valid[:, None]
    if ids.device.type == "cpu" or num_experts is not None:
        check_expert_ids(ids, used, None if num_experts is None else as_int("num_experts", num_experts, 1))
    flat = torch.where(used, ids, torch.full_like(ids, -1)).reshape(-1).sort().values
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    return (starts & (flat >= 0)).sum()
