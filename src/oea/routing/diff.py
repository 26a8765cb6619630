"""Comparing two routings of the same rows: the same experts with the same weights, slot order aside.

Shape legend: M = rows, k = slots per row, N = router columns.
"""

from __future__ import annotations

import torch

_FILLER = torch.iinfo(torch.int64).max  # the id a zero-weight slot compares as: which expert it names is moot


def routing_difference(
    ids_a: torch.Tensor, weights_a: torch.Tensor, ids_b: torch.Tensor, weights_b: torch.Tensor,
    select: torch.Tensor | None = None, rtol: float | None = None, atol: float | None = None,
) -> str | None:
    """The first difference between two routings ``[M, k]``, described, or None when they agree.

    Slot order does not matter, nor which expert a zero-weight filler slot names. With the selection scores
    ``select`` [M, N], rows whose experts differ only among equal scores count as equal (one ``topk`` breaks
    ties its own way, ``oea.route`` by the lower index); such rows compare their weights as sorted values.
    The tolerance defaults to 1e-5 when both weights are float32/64, else 1e-2 (bf16, fp16).
    """
    if ids_a.shape != ids_b.shape or weights_a.shape != weights_b.shape:
        return f"shape {tuple(ids_b.shape)} != {tuple(ids_a.shape)}"
    sorted_a, order_a = _canonical(ids_a, weights_a)
    sorted_b, order_b = _canonical(ids_b, weights_b)
    differ = (sorted_a != sorted_b).any(dim=-1)
    if bool(differ.any()):
        untied = differ
        if select is not None:
            untied = differ & (_scores(select, ids_a, weights_a) != _scores(select, ids_b, weights_b)).any(dim=-1)
        if bool(untied.any()):
            return f"expert ids differ in {int(untied.sum())} of {ids_a.shape[0]} rows"
    w_a = torch.where(differ[:, None], weights_a.sort(dim=-1).values, weights_a.gather(1, order_a)).float()
    w_b = torch.where(differ[:, None], weights_b.sort(dim=-1).values, weights_b.gather(1, order_b)).float()
    exact = {torch.float32, torch.float64}
    default = 1e-5 if weights_a.dtype in exact and weights_b.dtype in exact else 1e-2
    if not torch.allclose(w_a, w_b, rtol=default if rtol is None else rtol, atol=default if atol is None else atol):
        return f"weights differ by up to {(w_a - w_b).abs().max().item():.3g}"
    return None


def same_routing(ids_a: torch.Tensor, weights_a: torch.Tensor, ids_b: torch.Tensor, weights_b: torch.Tensor,
                 select: torch.Tensor | None = None, rtol: float | None = None, atol: float | None = None) -> bool:
    """Whether two routings ``[M, k]`` agree (``routing_difference`` is None)."""
    return routing_difference(ids_a, weights_a, ids_b, weights_b, select, rtol, atol) is None


def _canonical(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, k] ids sorted per row (zero-weight slots last, as one filler id) and the order that sorts them."""
    masked = ids.long().masked_fill(weights == 0, _FILLER)
    order = masked.argsort(dim=1, stable=True)
    return masked.gather(1, order), order


def _scores(select: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[M, k] the selection scores of each row's experts, sorted (zero-weight slots as -inf)."""
    scores = select.gather(1, ids.long()).float().masked_fill(weights == 0, -torch.inf)
    return scores.sort(dim=-1).values
