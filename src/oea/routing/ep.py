"""Expert-parallel-aware OEA (beyond the paper).

Under expert parallelism a decode step waits for the device with the most active experts, not for the
global T. Plain OEA already never adds an expert outside S_base, but it leaves the lightly loaded
devices idle while the busiest one sets the pace. EP-aware OEA uses that slack: after Phase 1, every
device d may activate up to ``max_d T_d - T_d`` extra experts without slowing the step. Extra experts
are the ones tokens want most — their own ranks k0+1..``boost_rank`` not yet in S_base, ordered by
the total router weight the batch gives them — and Phase 2 then piggybacks from the enlarged union.
The result never raises the busiest device's count above plain OEA's, and every token can only gain
(its candidates are a superset of plain OEA's).

Shape legend: M rows, N experts, D devices, k top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oea.routing.policies import check_routing, expert_union, register_policy
from oea.routing.ranking import KEY_MIN, top_indices
from oea.routing.scores import RouterScores
from oea.routing.spec import GroupFill, OEAConfig, RouterSpec


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Which device serves each logical expert: ``device_of_expert`` [N] int64 in 0..D-1."""

    device_of_expert: torch.Tensor
    num_devices: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_devices, int) or isinstance(self.num_devices, bool) or self.num_devices < 1:
            raise ValueError(f"num_devices must be an integer >= 1, got {self.num_devices!r}")
        device = self.device_of_expert
        if not isinstance(device, torch.Tensor) or device.dim() != 1 or device.numel() == 0 or (
            device.dtype.is_floating_point or device.dtype == torch.bool
        ):
            raise ValueError(f"device_of_expert must be a non-empty 1-D integer tensor [N], got "
                             f"{getattr(device, 'dtype', type(device).__name__)} {tuple(getattr(device, 'shape', ()))}")
        if int(device.min()) < 0 or int(device.max()) >= self.num_devices:
            raise ValueError(f"device_of_expert must lie in 0..{self.num_devices - 1} (num_devices="
                             f"{self.num_devices}), got values {int(device.min())}..{int(device.max())}")
        served = torch.bincount(device.cpu(), minlength=self.num_devices)
        empty = torch.nonzero(served == 0).flatten().tolist()
        if empty:
            raise ValueError(f"devices {empty} serve no expert; every one of num_devices={self.num_devices} devices "
                             f"needs at least one (drop empty devices from the placement)")

    @staticmethod
    def contiguous(num_experts: int, num_devices: int) -> ExpertPlacement:
        """Experts split in equal contiguous blocks (vLLM / SGLang default EP layout)."""
        if num_devices < 1 or num_experts % num_devices:
            raise ValueError(
                f"ep must divide num_experts, got ep={num_devices} and num_experts={num_experts}"
            )
        return ExpertPlacement(torch.arange(num_experts) // (num_experts // num_devices), num_devices)

    @staticmethod
    def from_devices(
        experts_per_device: list[list[int]], num_experts: int, replica_map: dict[int, int] | None = None
    ) -> ExpertPlacement:
        """An EPLB-style placement: the logical experts each device holds.

        Every expert must be placed; an expert held by several devices (a replica) needs
        ``replica_map[expert] = device`` saying which replica serves it.
        """
        holders: dict[int, list[int]] = {}
        for device, experts in enumerate(experts_per_device):
            for e in experts:
                if not 0 <= e < num_experts:
                    raise ValueError(f"placement names expert {e}, outside 0..{num_experts - 1}")
                holders.setdefault(e, []).append(device)
        missing = [e for e in range(num_experts) if e not in holders]
        if missing:
            raise ValueError(f"placement does not cover every expert: missing experts {missing}")
        replica_map = replica_map or {}
        unresolved = [e for e, devs in sorted(holders.items()) if len(devs) > 1 and e not in replica_map]
        if unresolved:
            raise ValueError(f"experts {unresolved} are replicated on several devices but have no replica_map entry")
        bad = [e for e, d in replica_map.items() if e not in holders or d not in holders[e]]
        if bad:
            raise ValueError(f"replica_map sends experts {sorted(bad)} to devices that do not hold them")
        device = [replica_map.get(e, holders[e][0]) for e in range(num_experts)]
        return ExpertPlacement(torch.tensor(device, dtype=torch.int64), len(experts_per_device))

    def device_counts(self, active: torch.Tensor) -> torch.Tensor:
        """[N] bool (or [..., N]) active experts -> [D] (or [..., D]) active experts per device."""
        device = self.device_of_expert.to(active.device)
        counts = torch.zeros(*active.shape[:-1], self.num_devices, dtype=torch.int64, device=active.device)
        return counts.scatter_add(-1, device.expand_as(active), active.to(torch.int64))


def max_device_active_experts(
    ids: torch.Tensor, weights: torch.Tensor, placement: ExpertPlacement, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The EP step's critical path: max over devices of distinct non-zero-weight experts; 0-dim int64."""
    check_routing(ids, weights, valid)
    num_experts = placement.device_of_expert.numel()
    used = weights != 0
    if valid is not None:
        used = used & valid[:, None]
    routed = torch.where(used, ids, num_experts)
    active = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device)
    active = active.scatter(0, routed.reshape(-1), True)[:num_experts]
    return placement.device_counts(active).max()


@dataclass(frozen=True)
class EPOEAConfig:
    """EP-aware OEA: OEA(k0) plus free experts on devices below the busiest device's count.

    Attributes:
        k0, min_batch, group_fill: as in ``OEAConfig``.
        placement: expert -> device map.
        boost_rank: deepest own rank a token may add as a free expert (default: top_k).
    """

    k0: int
    placement: ExpertPlacement = field(compare=False)
    boost_rank: int | None = None
    min_batch: int = 2
    group_fill: GroupFill = "in"

    def __post_init__(self) -> None:
        OEAConfig(self.k0, min_batch=self.min_batch, group_fill=self.group_fill)  # same field rules
        if self.boost_rank is not None and self.boost_rank < self.k0:
            raise ValueError(f"boost_rank must be >= k0, got boost_rank={self.boost_rank} and k0={self.k0}")

    def check(self, spec: RouterSpec) -> None:
        """Validate against a router (k0, boost_rank and the placement's size)."""
        OEAConfig(self.k0).check(spec)
        n = self.placement.device_of_expert.numel()
        if n != spec.num_experts:
            raise ValueError(f"placement covers {n} experts but the router has num_experts={spec.num_experts}")
        if self.boost_rank is not None and self.boost_rank > spec.num_experts:
            raise ValueError(
                f"boost_rank must be <= num_experts, got boost_rank={self.boost_rank} and "
                f"num_experts={spec.num_experts}"
            )


def _rank_within_device(score: torch.Tensor, device: torch.Tensor, num_devices: int) -> torch.Tensor:
    """[N] scores, [N] device ids -> [N] rank of each expert among its device's experts (0 = best)."""
    n = score.numel()
    # Sort by device, then by score descending (score in [0, 1) after normalising keeps keys distinct).
    normalised = score / (score.max() + 1.0) * 0.5
    order = torch.argsort(device.to(score.dtype) - normalised, stable=True)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=score.device))
    sizes = torch.zeros(num_devices, dtype=torch.int64, device=score.device).scatter_add(
        0, device, torch.ones_like(device)
    )
    first = sizes.cumsum(0) - sizes  # [D] index of each device's first expert in the sorted order
    return position - first[device]


@register_policy(EPOEAConfig)
def ep_oea_policy(
    scores: RouterScores, vanilla_ids: torch.Tensor, spec: RouterSpec, cfg: EPOEAConfig, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 as OEA; free experts fill each device up to the busiest count; Phase 2 from the larger union."""
    n, k = spec.num_experts, spec.top_k
    device = cfg.placement.device_of_expert.to(vanilla_ids.device)
    base = vanilla_ids[:, : cfg.k0]
    rows = None if valid is None else valid[:, None].expand_as(base)
    union = expert_union(base, rows, n)
    counts = cfg.placement.device_counts(union)  # [D]
    spare = counts.max() - counts  # [D] free slots per device

    boost_rank = cfg.boost_rank or k
    wanted_ids = vanilla_ids if boost_rank <= k else top_indices(scores.select_key, boost_rank)
    extra = wanted_ids[:, cfg.k0 : boost_rank]  # [M, boost_rank - k0] own ranks beyond the baseline
    demand_rows = scores.weight.gather(1, extra)  # router mass the batch would gain
    if valid is not None:
        demand_rows = demand_rows * valid[:, None]
    demand = torch.zeros(n, dtype=scores.select.dtype, device=base.device).scatter_add(
        0, extra.reshape(-1), demand_rows.reshape(-1)
    )
    demand = torch.where(union, 0.0, demand)  # only experts not yet loaded
    rank = _rank_within_device(demand, device, cfg.placement.num_devices)
    union = union | ((demand > 0) & (rank < spare[device]))

    candidate = (union & (scores.fill > float("-inf"))).scatter(1, base, False)  # the baseline goes first
    if k == cfg.k0:
        return base, torch.ones_like(base, dtype=torch.bool)
    extra = top_indices(torch.where(candidate, scores.fill_key, KEY_MIN), k - cfg.k0)
    keep = torch.cat([torch.ones_like(base, dtype=torch.bool), candidate.gather(1, extra)], dim=1)
    ids = torch.cat([base, extra], dim=1)
    return torch.where(keep, ids, ids[:, :1]), keep
