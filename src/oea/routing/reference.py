"""The literal reference: the paper's Algorithms 1 and 2 as a per-token scan in float64.

Slow on purpose and written to be read beside the paper. It is the test oracle of the vectorised
``route``. Both rank by score with equal scores going to the lower expert index (a stable sort here,
``oea.routing.ranking`` there); scores are float64 here and float32 there, so inputs whose scores tie in
one precision only (softmax logits beyond float64's exp range, sigmoid scores one float32 ulp apart) are
outside what the comparison covers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oea.routing.spec import OEAConfig, PrunedConfig, RouterSpec, require_tensor

if TYPE_CHECKING:
    from oea.routing.comparators import BudgetConfig


def _family_scores(logits: list[float], spec: RouterSpec) -> tuple[list[float], list[float], list[bool]]:
    """One token: (selection score, weight score, allowed-by-group) per expert, in float64."""
    x = torch.tensor(logits, dtype=torch.float64)
    x = torch.where(torch.isnan(x), torch.tensor(float("-inf"), dtype=torch.float64), x)
    x = x.clamp(max=torch.finfo(torch.float32).max)
    n = spec.num_experts
    if spec.scoring == "softmax":
        probs = torch.nan_to_num(torch.softmax(x, dim=0), nan=0.0).tolist()
        return probs, probs, [True] * n
    weight = torch.sigmoid(x).tolist()
    bias = [0.0] * n if spec.correction_bias is None else spec.correction_bias.double().tolist()
    select = [w + b for w, b in zip(weight, bias, strict=True)]
    allowed = [True] * n
    if spec.grouped:
        assert spec.n_group is not None and spec.topk_group is not None
        size = n // spec.n_group
        group_score = []
        for g in range(spec.n_group):
            members = sorted(select[g * size : (g + 1) * size], reverse=True)
            group_score.append(members[0] + members[1])
        kept = sorted(range(spec.n_group), key=lambda g: -group_score[g])[: spec.topk_group]
        allowed = [e // size in kept for e in range(n)]
    return select, weight, allowed


def _weights(chosen: list[int], weight: list[float], renormalize: bool, scaling: float) -> list[float]:
    w = [weight[e] for e in chosen]
    if renormalize:
        total = sum(w) + 1e-20
        w = [v / total for v in w]
    return [v * scaling for v in w]


def reference_route(
    router_logits: torch.Tensor,
    spec: RouterSpec,
    cfg: OEAConfig | PrunedConfig | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Per-token OEA exactly as the paper's pseudo-code, with this project's output rules.

    Args:
        router_logits: [M, N] logits. ``valid``: optional [M] bool (False = padding row).

    Returns:
        For each row, its chosen expert ids in slot order (own baseline first, then piggybacked
        experts in the token's rank order) and their weights, *without* filler slots: a row
        may hold fewer than k experts.
    """
    require_tensor("router_logits", router_logits, "[M, N]")
    if valid is not None:
        require_tensor("valid", valid, "[M] bool (or None)")
    m = router_logits.shape[0]
    rows = router_logits.double().tolist()
    is_valid = [True] * m if valid is None else [bool(v) for v in valid.tolist()]
    group_fill = getattr(cfg, "group_fill", "in")

    rankings: list[list[int]] = []  # e_{i,1..}: the token's experts, best first, within allowed groups
    fill_rankings: list[list[int]] = []
    family: list[tuple[list[float], list[float], list[bool]]] = []
    for logits in rows:
        select, weight, allowed = _family_scores(logits, spec)
        family.append((select, weight, allowed))
        by_score = sorted(range(spec.num_experts), key=lambda e, s=select: -s[e])
        rankings.append([e for e in by_score if allowed[e]])
        fill_rankings.append(by_score if group_fill == "cross" else rankings[-1])

    def vanilla(i: int) -> tuple[list[int], list[float]]:
        chosen = rankings[i][: spec.top_k]
        return chosen, _weights(chosen, family[i][1], spec.renormalize, spec.routed_scaling_factor)

    n_valid = sum(is_valid)
    if cfg is None or (isinstance(cfg, OEAConfig) and n_valid < cfg.min_batch):
        out = [vanilla(i) for i in range(m)]
        return [o[0] for o in out], [o[1] for o in out]

    if isinstance(cfg, PrunedConfig):
        renorm = spec.renormalize if cfg.renormalize is None else cfg.renormalize
        ids_out, w_out = [], []
        for i in range(m):
            if not is_valid[i]:
                chosen, w = vanilla(i)
            else:
                chosen = rankings[i][: cfg.k0]
                w = _weights(chosen, family[i][1], renorm, spec.routed_scaling_factor)
            ids_out.append(chosen)
            w_out.append(w)
        return ids_out, w_out

    k_max = cfg.max_experts or spec.top_k
    max_rank = cfg.max_rank or spec.num_experts

    # Phase 1: baselines and their union over valid tokens.
    baselines: list[list[int]] = []
    for i in range(m):
        weight = family[i][1]
        total = sum(weight) + 1e-20
        t_p, mass = 0, 0.0
        for e in rankings[i]:  # t_i = min { t : top-t mass >= p }
            t_p += 1
            mass += weight[e] / total
            if mass >= cfg.p:
                break
        baselines.append(rankings[i][: min(cfg.k0, t_p)])
    s_base: set[int] = set()
    for i in range(m):
        if is_valid[i]:
            s_base.update(baselines[i])

    # Phase 2: piggyback from S_base in the token's own order, |S_i| <= k_max.
    ids_out, w_out = [], []
    for i in range(m):
        if not is_valid[i]:
            chosen, w = vanilla(i)
            ids_out.append(chosen)
            w_out.append(w)
            continue
        chosen = list(baselines[i])
        for e in fill_rankings[i][:max_rank]:
            if len(chosen) >= k_max:
                break
            if e in s_base and e not in chosen:
                chosen.append(e)
        ids_out.append(chosen)
        w_out.append(_weights(chosen, family[i][1], spec.renormalize, spec.routed_scaling_factor))
    return ids_out, w_out


def reference_budget_route(
    router_logits: torch.Tensor,
    spec: RouterSpec,
    cfg: BudgetConfig,
    valid: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """The XShare-like budget comparator (``BudgetConfig``) with its per-token floor, token by token in float64.

    The oracle of ``oea.routing.comparators.budget_policy``; the rule (and where XShare publishes it) is in
    that module's docstring. Ranking as ``reference_route``: by score, equal scores to the lower expert index.

    Args:
        router_logits: [M, N] logits. ``valid``: optional [M] bool (False = padding row).

    Returns:
        For each row, its chosen expert ids, best first, and their weights, without filler slots (a row
        may hold fewer than k experts).
    """
    require_tensor("router_logits", router_logits, "[M, N]")
    if valid is not None:
        require_tensor("valid", valid, "[M] bool (or None)")
    m, n, k = router_logits.shape[0], spec.num_experts, spec.top_k
    is_valid = [True] * m if valid is None else [bool(v) for v in valid.tolist()]
    family = [_family_scores(logits, spec) for logits in router_logits.double().tolist()]
    rankings = []  # each token's experts, best first, within its allowed groups
    for select, _, allowed in family:
        by_score = sorted(range(n), key=lambda e, s=select: -s[e])
        rankings.append([e for e in by_score if allowed[e]])

    def weights(i: int, chosen: list[int]) -> list[float]:
        return _weights(chosen, family[i][1], spec.renormalize, spec.routed_scaling_factor)

    vanilla = [rankings[i][:k] for i in range(m)]
    if sum(is_valid) < cfg.min_batch:
        return vanilla, [weights(i, vanilla[i]) for i in range(m)]

    # The batch's demand: the weight every real token gives each expert of its own top-k.
    mass = [0.0] * n
    for i in range(m):
        if is_valid[i]:
            for e in vanilla[i]:
                mass[e] += family[i][1][e]
    by_mass = sorted(range(n), key=lambda e: -mass[e])  # stable: equal mass, lower index first
    budget_set = {e for e in by_mass[: cfg.budget] if mass[e] > 0}  # an expert nobody wants is never bought

    ids_out, w_out = [], []
    for i in range(m):
        if not is_valid[i]:  # padding keeps its own top-k and added nothing above
            chosen = vanilla[i]
        else:
            floor = set(rankings[i][: cfg.floor])  # XShare's top_per_token: this token's own best, never cut
            select = family[i][0]
            chosen = [e for e in rankings[i] if (e in budget_set or e in floor) and select[e] > float("-inf")][:k]
        ids_out.append(chosen)
        w_out.append(weights(i, chosen))
    return ids_out, w_out
