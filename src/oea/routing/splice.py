"""Putting OEA's routing into an engine's top-k output: when to leave it as it is, and the splice.

Shape legend: M = rows of the router call, k = routed top-k, s = columns the engine appends after the
routed ones (fused shared experts), so the engine's output is [M, k + s].
"""

from __future__ import annotations

import torch

from oea.routing.spec import RouterSpec


def keeps_every_top_k(cfg: object | None, spec: RouterSpec) -> bool:
    """k0 >= top_k (and no lower cap): every token keeps its own top-k, so the engine's output is kept as it
    is (its slot order and its weights' precision included: k0 = top_k gives exactly the model's tokens).

    False for configs without a single k0 (a per-batch-size schedule) and for None.
    """
    k0, cap = getattr(cfg, "k0", None), getattr(cfg, "max_experts", None)
    return isinstance(k0, int) and k0 >= spec.top_k and (cap is None or cap >= spec.top_k)


def splice_routed_columns(
    engine_ids: torch.Tensor, engine_weights: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    rerouted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's output with its routed columns replaced by OEA's.

    Args:
        engine_ids, engine_weights: [M, k + s] the engine's top-k output.
        ids, weights: [M, k] OEA's routing of the same rows.
        rerouted: which rows take OEA's routing: [M] bool, or a 0-dim bool deciding for every row (a
            device flag read at graph replay); None: every row.

    Returns:
        ``(ids, weights)`` [M, k + s] in the engine's dtypes; rows not rerouted and the s appended columns
        are the engine's, bit for bit. Graph-safe: no host synchronisation.
    """
    k = ids.shape[1]
    if engine_ids.shape[0] != ids.shape[0] or engine_ids.shape[1] < k:
        raise ValueError(f"engine output {tuple(engine_ids.shape)} does not hold OEA's routing {tuple(ids.shape)}")
    new_ids, new_weights = ids.to(engine_ids.dtype), weights.to(engine_weights.dtype)
    if rerouted is not None:
        select = rerouted[:, None] if rerouted.dim() == 1 else rerouted
        new_ids = torch.where(select, new_ids, engine_ids[:, :k])
        new_weights = torch.where(select, new_weights, engine_weights[:, :k])
    if engine_ids.shape[1] > k:
        new_ids = torch.cat([new_ids, engine_ids[:, k:]], dim=1)
        new_weights = torch.cat([new_weights, engine_weights[:, k:]], dim=1)
    return new_ids, new_weights
