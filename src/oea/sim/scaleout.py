"""Data parallelism in the simulator: per-rank batches, and a local or a global expert union.

Shape legend: nb batches, dp data-parallel ranks, B rows per rank, k top-k, N experts.

With ``dp`` data-parallel ranks each simulated step holds ``dp`` batches of B trace tokens, one per rank
(``make_batches`` draws ``dp·B`` tokens; rank r owns columns ``r·B .. (r+1)·B - 1``). Two ways to route them:

* ``local``: every rank routes its own B rows (``oea.route`` per rank) — what an engine does when each DP
  rank routes before dispatching tokens to the expert-parallel devices (vLLM's modular kernels, SGLang's
  DP attention). Each token fills its slots from its own rank's union.
* ``global``: one union over all ``dp·B`` rows (``oea.route`` on the whole step) — what an engine does when
  it gathers every rank's router logits before routing, or what one all-reduce of each rank's baseline
  expert mask per layer would give. Each token fills its slots from every rank's union.

Under expert parallelism the EP devices serve every DP rank's tokens, so what they load is the union of
all ranks' routed experts either way; for plain OEA that is the union of every token's baseline top-k0
in both modes (every filled expert is some token's baseline), so T and the busiest device's T are the
same and the global union only adds fill candidates (quality). Without EP every rank holds every expert
and loads its own routed experts (``per_rank_active_experts``): there a global union would make a rank
load experts only other ranks need, which is why it is only worth asking for under EP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from oea.routing import RouterSpec

UNIONS: tuple[str, ...] = ("local", "global")

RouteBatches = Callable[[torch.Tensor, RouterSpec, Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rank_view(batches: torch.Tensor, dp: int) -> torch.Tensor:
    """[nb, dp·B] token indices of whole steps -> [nb·dp, B]: one batch per (step, rank)."""
    nb, total = batches.shape
    if dp < 1 or total % dp:
        raise ValueError(f"dp must be a positive divisor of the step's {total} rows, got dp={dp}")
    return batches.reshape(nb * dp, total // dp)


def route_step(
    route_batches: RouteBatches, logits: torch.Tensor, spec: RouterSpec, cfg: Any, batches: torch.Tensor,
    dp: int, union: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``nb`` steps of ``dp`` ranks: [nb, dp·B] indices -> ids, weights [nb, dp·B, k].

    ``union="global"`` routes each step as one batch of ``dp·B`` rows; ``"local"`` routes each rank's B rows
    on their own (``route_batches`` on the rank view) and puts the ranks back side by side.
    """
    if union not in UNIONS:
        raise ValueError(f"union must be one of {list(UNIONS)}, got {union!r}")
    if union == "global" or dp == 1:
        return route_batches(logits, spec, cfg, batches)
    nb, total = batches.shape
    ids, weights = route_batches(logits, spec, cfg, rank_view(batches, dp))
    return ids.reshape(nb, total, -1), weights.reshape(nb, total, -1)


def per_rank_active(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, dp: int) -> torch.Tensor:
    """Mean over ranks of each rank's own distinct non-zero-weight experts: [nb, dp·B, k] -> [nb] float64."""
    nb, total, k = ids.shape
    ids_r = ids.reshape(nb * dp, total // dp, k)
    weights_r = weights.reshape(nb * dp, total // dp, k)
    routed = torch.where(weights_r != 0, ids_r, num_experts).reshape(nb * dp, -1)
    active = torch.zeros(nb * dp, num_experts + 1, dtype=torch.bool).scatter_(1, routed, True)[:, :num_experts]
    return active.sum(-1).double().reshape(nb, dp).mean(-1)


def per_rank_metric(dp: int) -> Callable[[Any], dict[str, torch.Tensor]]:
    """Simulator ``Metric`` ``per_rank_active_experts`` (what a DP rank holding every expert loads)."""

    def metric(batches: Any) -> dict[str, torch.Tensor]:
        return {"per_rank_active_experts": per_rank_active(batches.ids, batches.weights, batches.num_experts, dp)}

    return metric


def union_comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a global union buys over a local one, per (policy, k0, B): paired rows of a ``dp > 1`` simulation.

    Returns one dict per pair with both unions' T, busiest-device T (when simulated) and quality proxy
    (``kept_mass`` when the trace has scores, else ``kept_topk_share``), and the differences global - local.
    """
    proxy = "kept_mass" if any(r.get("kept_mass") is not None for r in rows) else "kept_topk_share"
    pairs: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row.get("union") in UNIONS:
            pairs.setdefault((row["policy"], row["k0"], row["batch_size"]), {})[row["union"]] = row
    out = []
    for (policy, k0, b), pair in pairs.items():
        if set(pair) != set(UNIONS):
            continue
        local, glob = pair["local"], pair["global"]
        item: dict[str, Any] = {"policy": policy, "k0": k0, "batch_size": b, "dp": local.get("dp"), "proxy": proxy}
        for key in ("mean_active_experts", "max_device_active_experts", proxy):
            if local.get(key) is None:
                continue
            item[f"local_{key}"], item[f"global_{key}"] = local[key], glob[key]
            item[f"delta_{key}"] = glob[key] - local[key]
        out.append(item)
    return out


def step_batches(
    make_batches: Callable[..., torch.Tensor], trace: Any, batch_size: int, dp: int, mode: str, num_batches: int,
    generator: torch.Generator, exclude: torch.Tensor | None = None,
) -> torch.Tensor:
    """[nb, dp·B] token indices of ``nb`` steps of ``dp`` ranks with B rows each (``make_batches`` of dp·B rows;
    ``exclude``: steps drawn before, which lockstep draws do not repeat)."""
    if dp == 1:
        return make_batches(trace, batch_size, mode, num_batches, generator, exclude=exclude)
    try:
        return make_batches(trace, batch_size * dp, mode, num_batches, generator, exclude=exclude)
    except ValueError as err:
        raise ValueError(f"dp={dp} ranks of B={batch_size} rows need {dp * batch_size} rows per step: {err}") from None
