"""Per-family router scores: what ranks experts, and what weighs them.

Shape legend: M = router rows (tokens, padding included), N = routed experts.

Ranking (a documented, tested contract): softmax routers rank experts by their float32 logit (the same
order as the probabilities, without the ties that rounding and underflow add to them); sigmoid routers by
the float32 ``sigmoid(logit) + correction_bias``; equal scores go to the lower expert index
(``oea.routing.ranking``).

Non-finite logits (a documented, tested contract):
    * NaN is treated as -inf: the expert ranks below every finite one and gets weight 0.
    * +inf is clamped to the largest finite float32: the expert wins selection and, under
      softmax, takes all the weight (shared equally with other +inf experts).
    * A row with no finite logit gets all-zero weights (its MoE output is 0), never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oea.routing.ranking import rank_keys, top_indices
from oea.routing.spec import GroupFill, RouterSpec

_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class RouterScores:
    """The three score tensors every policy works from, all float32 [M, N].

    Attributes:
        select: Phase-1 ranking: softmax logits (sanitised), or sigmoid + correction bias with
            experts outside the token's allowed groups at -inf. Vanilla top-k is its top-k.
        fill: Phase-2 ranking for piggybacking (``select`` itself, or the biased score without
            the group mask for ``group_fill="cross"``).
        weight: weight source: softmax probabilities, or the *unbiased* sigmoid.
        select_key / fill_key: [M, N] int64 ``rank_keys`` of ``select`` / ``fill`` (the same tensor
            when the scores are): rank with these, never with ``topk`` on the scores.
    """

    select: torch.Tensor
    fill: torch.Tensor
    weight: torch.Tensor
    select_key: torch.Tensor
    fill_key: torch.Tensor


def sanitize_logits(router_logits: torch.Tensor) -> torch.Tensor:
    """[M, N] any float dtype -> [M, N] float32 with NaN -> -inf and +inf -> float32 max."""
    return torch.nan_to_num(router_logits.float(), nan=float("-inf"), posinf=_FLOAT32_MAX, neginf=float("-inf"))


def group_mask(biased: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """[M, N] biased scores -> [M, N] bool, True for experts in the token's best ``topk_group`` groups.

    A group's score is the sum of its two best biased scores (DeepSeek-V3 / GLM routers).
    """
    m, n = biased.shape
    group_scores = biased.view(m, n_group, n // n_group).topk(2, dim=-1).values.sum(dim=-1)  # [M, G]
    best_groups = top_indices(rank_keys(group_scores), topk_group)  # [M, topk_group], ties: lower group
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best_groups, True)  # [M, G]
    return keep.unsqueeze(-1).expand(m, n_group, n // n_group).reshape(m, n)


def router_scores(router_logits: torch.Tensor, spec: RouterSpec, group_fill: GroupFill = "in") -> RouterScores:
    """Family scores of one router call: [M, N] logits -> ``RouterScores`` ([M, N] float32 each)."""
    x = sanitize_logits(router_logits)
    if spec.scoring == "softmax":
        probs = torch.nan_to_num(torch.softmax(x, dim=-1), nan=0.0)
        key = rank_keys(x)
        return RouterScores(select=x, fill=x, weight=probs, select_key=key, fill_key=key)

    unbiased = torch.sigmoid(x)
    biased = unbiased
    if spec.correction_bias is not None:
        biased = unbiased + spec.correction_bias.to(device=x.device, dtype=torch.float32)
    if not spec.grouped:
        key = rank_keys(biased)
        return RouterScores(select=biased, fill=biased, weight=unbiased, select_key=key, fill_key=key)
    assert spec.n_group is not None and spec.topk_group is not None
    allowed = group_mask(biased, spec.n_group, spec.topk_group)
    select = biased.masked_fill(~allowed, float("-inf"))
    select_key = rank_keys(select)
    if group_fill == "in":
        return RouterScores(select=select, fill=select, weight=unbiased, select_key=select_key, fill_key=select_key)
    return RouterScores(select=select, fill=biased, weight=unbiased, select_key=select_key,
                        fill_key=rank_keys(biased))


def mixture_weights(
    weight_src: torch.Tensor,
    ids: torch.Tensor,
    keep: torch.Tensor | None,
    renormalize: bool,
    scaling: float,
) -> torch.Tensor:
    """Gather the family's weights at the chosen experts: [M, N], [M, k] ids, [M, k] bool -> [M, k] fp32.

    Slots with ``keep`` False are fillers and get weight exactly 0 (before and after renormalising);
    ``keep=None`` keeps every slot.
    """
    w = weight_src.gather(1, ids)
    if keep is not None:
        w = w * keep
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling != 1.0:
        w = w * scaling
    return w
