"""Competing batch-aware methods, re-implemented from their papers' descriptions (not their code).

* ``BudgetConfig`` — XShare-like (batch-wide expert budget): choose a set of ``budget`` experts
  greedily by the total gate mass the batch's tokens give them among their own top-k, then every
  token takes its best k experts inside that set.
* ``SubtractiveConfig`` — Lynx-like: start from the vanilla union and drop the least-used experts
  (fewest tokens; ties by gate mass) until at most ``target`` remain; tokens re-route to their best
  k among the survivors.

Neither keeps a per-token quality floor (a token may lose all of its own top experts), which is the
difference with OEA. Shape legend: M rows, N experts, k top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from oea.routing.policies import register_policy
from oea.routing.ranking import KEY_MIN, top_indices
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
    """XShare-like batch-wide budget of ``budget`` experts (re-implementation)."""

    COUNT: ClassVar[str] = "budget"
    budget: int
    min_batch: int = 2


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
    """Each token's best k experts inside ``allowed`` [N] bool; filler = the row's first pick."""
    candidate = allowed & (scores.fill > float("-inf"))  # [M, N]
    ids = top_indices(torch.where(candidate, scores.fill_key, KEY_MIN), k)
    keep = candidate.gather(1, ids)
    return torch.where(keep, ids, ids[:, :1]), keep


@register_policy(BudgetConfig)
def budget_policy(
    scores: RouterScores, vanilla_ids: torch.Tensor, spec: RouterSpec, cfg: BudgetConfig, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``budget`` experts by batch gate mass (only experts some token wants), then best-k inside."""
    mass = _vanilla_mass(scores, vanilla_ids, valid)
    chosen = mass.topk(cfg.budget).indices
    allowed = torch.zeros_like(mass, dtype=torch.bool).scatter(0, chosen, True) & (mass > 0)
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
