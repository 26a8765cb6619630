"""Competing batch-aware methods, re-implemented from their published descriptions (not their code).

* ``BudgetConfig`` — XShare-like (batch-wide expert budget): choose a set of ``budget`` experts
  greedily by the total gate mass the batch's tokens give them among their own top-k; with
  ``floor`` = f > 0 every token may also use its own top-f experts (XShare's ``top_per_token``); then
  every token takes its best k experts inside its allowed set.
* ``SubtractiveConfig`` — Lynx-like: start from the vanilla union and drop the least-used experts
  (fewest tokens; ties by gate mass) until at most ``target`` remain; tokens re-route to their best
  k among the survivors.

XShare's floor, as its vLLM pull request publishes it (vllm-project/vllm#35551, open; read at the PR
commit 1e4517a7e171034551805bfbc7c3041fa6447e98: ``_prune_experts`` in
``vllm/model_executor/layers/fused_moe/gpt_oss_triton_kernels_moe.py``, lines 233-299, applied at line 362
before the model's own top-k at lines 364-366; the option ``MoEPruningConfig.top_per_token`` in
``vllm/config/moe.py``, line 21, default 0 = off), in our words: XShare masks the router logits
before the model's own top-k. A row stays unmasked on the union of two sets: the batch-wide set
(the ``expert_budget`` experts with the largest logit summed over the M rows) and, when
``top_per_token`` = f > 0, the row's own f best experts. The floor is per row (a token cannot use
another token's floor experts), is never cut, and does not count against the budget: the two sets
are chosen independently, so a batch may activate up to ``budget`` + M f experts. The model then
routes on the masked logits as usual: each row's top-k inside its unmasked set, weighted by its own
rule. With a budget below the model's k, XShare also unmasks every row's own top-k (lines 294-298).

What this re-implementation keeps and changes: the floor exactly as above (``floor``, 0..k); the
batch-wide set ranked by gate mass among each valid token's own top-k, not by summed logits; padding
rows (``valid`` False) add no demand and no floor, as for every policy here; a budget below k leaves a
row fewer than k experts (no comparison here reaches that case); weights are the router's own (for a
router that softmaxes before its top-k, XShare's softmax runs over the masked logits). Without a floor neither
comparator keeps a per-token quality floor (a token may lose all of its own top experts), which is
the difference with OEA. Shape legend: M rows, N experts, k top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from oea.routing.policies import register_policy
from oea.routing.ranking import KEY_MIN, rank_keys, top_indices
from oea.routing.scores import RouterScores
from oea.routing.spec import RouterSpec


class _ExpertCountConfig:
    """What both methods' configs share: one batch-wide count of experts, in the field ``COUNT`` names; an
    integer >= 1 when built, and at most the router's N when checked against one."""

    COUNT: ClassVar[str]

    @property
    def expert_count(self) -> int:
        """The batch-wide count of experts: ``budget`` or ``target``."""
        return getattr(self, self.COUNT)

    def __post_init__(self) -> None:
        value = self.expert_count
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{self.COUNT} must be an integer >= 1, got {value!r}")

    def check(self, spec: RouterSpec) -> None:
        """The count must fit the router."""
        if self.expert_count > spec.num_experts:
            raise ValueError(f"{self.COUNT} must be <= num_experts, got {self.COUNT}={self.expert_count} and "
                             f"num_experts={spec.num_experts}")


@dataclass(frozen=True)
class BudgetConfig(_ExpertCountConfig):
    """XShare-like batch-wide budget of ``budget`` experts (re-implementation), with XShare's per-token floor.

    ``floor``: each token may also use its own top-``floor`` experts, on top of the budget (XShare's
    ``top_per_token``; 0..top_k, checked against the router). 0, XShare's published default, is the
    budget alone. The floor does not count against the budget (as in XShare), so any budget >= 1 goes
    with any floor.
    """

    COUNT: ClassVar[str] = "budget"
    budget: int
    min_batch: int = 2
    floor: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.floor, int) or isinstance(self.floor, bool) or self.floor < 0:
            raise ValueError(f"floor must be an integer in 0..top_k, got {self.floor!r}")

    def check(self, spec: RouterSpec) -> None:
        """The budget must fit the router's N, the floor its top_k."""
        super().check(spec)
        if self.floor > spec.top_k:
            raise ValueError(f"floor must be in 0..top_k={spec.top_k} (the router's top_k), got floor={self.floor}")


@dataclass(frozen=True)
class SubtractiveConfig(_ExpertCountConfig):
    """Lynx-like: drop the least-used experts of the vanilla union down to ``target`` (re-implementation)."""

    COUNT: ClassVar[str] = "target"
    target: int
    min_batch: int = 2


def _vanilla_mass(scores: RouterScores, vanilla_ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """[N] total weight the valid tokens give each expert among their own top-k."""
    mass = scores.weight.gather(1, vanilla_ids)
    if valid is not None:
        mass = mass * valid[:, None]
    total = torch.zeros(scores.weight.shape[1], dtype=mass.dtype, device=mass.device)
    return total.scatter_add(0, vanilla_ids.reshape(-1), mass.reshape(-1))


def _best_k_inside(scores: RouterScores, allowed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's best k experts inside ``allowed`` ([N] bool, one set for the batch, or [M, N], one per
    token); filler = the row's first pick."""
    candidate = allowed & (scores.fill > float("-inf"))  # [M, N]
    ids = top_indices(torch.where(candidate, scores.fill_key, KEY_MIN), k)
    keep = candidate.gather(1, ids)
    return torch.where(keep, ids, ids[:, :1]), keep


@register_policy(BudgetConfig)
def budget_policy(
    scores: RouterScores, vanilla_ids: torch.Tensor, spec: RouterSpec, cfg: BudgetConfig, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``budget`` experts by batch gate mass (only experts some token wants), plus each token's own
    top-``floor`` (its row only), then best-k inside.

    The literal loop is ``oea.routing.reference.reference_budget_route``.
    """
    mass = _vanilla_mass(scores, vanilla_ids, valid)  # [N]
    chosen = top_indices(rank_keys(mass[None, :]), cfg.budget)[0]  # equal mass: the lower index, as everywhere
    allowed = torch.zeros_like(mass, dtype=torch.bool).scatter(0, chosen, True) & (mass > 0)  # [N]
    if cfg.floor > 0:  # XShare's top_per_token: per row, on top of the budget, never cut by it
        own = torch.zeros_like(scores.weight, dtype=torch.bool).scatter(1, vanilla_ids[:, : cfg.floor], True)
        allowed = allowed | own  # [M, N]; a padding row's floor is harmless: route() keeps that row vanilla
    return _best_k_inside(scores, allowed, spec.top_k)


@register_policy(SubtractiveConfig)
def subtractive_policy(
    scores: RouterScores,
    vanilla_ids: torch.Tensor,
    spec: RouterSpec,
    cfg: SubtractiveConfig,
    valid: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``target`` most-used experts of the vanilla union (usage = tokens, ties by mass)."""
    used = torch.ones_like(vanilla_ids, dtype=torch.float32)
    if valid is not None:
        used = used * valid[:, None]
    usage = torch.zeros(spec.num_experts, device=vanilla_ids.device).scatter_add(
        0, vanilla_ids.reshape(-1), used.reshape(-1)
    )
    mass = _vanilla_mass(scores, vanilla_ids, valid)
    key = usage + mass / (mass.max() + 1.0)  # mass < 1 per token count: breaks ties only
    survivors = key.topk(min(cfg.target, spec.num_experts)).indices
    allowed = torch.zeros_like(mass, dtype=torch.bool).scatter(0, survivors, True) & (usage > 0)
    return _best_k_inside(scores, allowed, spec.top_k)
