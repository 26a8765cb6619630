"""Simplified OEA for ungrouped softmax routers in a few PyTorch ops (any device; Dynamo traces it)."""

from __future__ import annotations

import torch


def fast_softmax_oea(router_logits: torch.Tensor, top_k: int, k0: int, renormalize: bool,
                     valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Simplified OEA (paper Algorithm 1) for ungrouped softmax routers, in few tensor ops.

    Same expert choice and weights as ``oea.route(logits, RouterSpec(N, top_k, "softmax",
    renormalize), OEAConfig(k0, min_batch=0), valid)``: each valid token's own top-k0 form the union;
    each token takes its top-k experts among the union (rows with ``valid`` False keep stock
    routing); unused slots repeat one of the row's own experts with weight 0. The caller applies
    ``min_batch``.

    Args:
        router_logits: [M, N] float logits.
        valid: optional [M] bool, False on padding rows.

    Returns:
        weights [M, top_k] float32 and ids [M, top_k] int32 (vLLM's CPU MoE layout).
    """
    num_experts = router_logits.shape[1]
    base = router_logits.topk(k0, dim=-1, sorted=False).indices  # [M, k0]
    if valid is None:
        union = torch.zeros(num_experts, dtype=torch.bool, device=router_logits.device)
        union = union.index_fill_(0, base.reshape(-1), True)  # [N]
    else:
        contributing = torch.where(valid[:, None], base, num_experts).reshape(-1)
        union = torch.zeros(num_experts + 1, dtype=torch.bool, device=router_logits.device)
        union = union.index_fill_(0, contributing, True)[:num_experts][None, :] | ~valid[:, None]  # [M, N]
    vals, ids = torch.where(union, router_logits, float("-inf")).topk(top_k, dim=-1, sorted=False)
    if renormalize:
        weights = torch.softmax(vals, dim=-1, dtype=torch.float32)
    else:
        log_z = torch.logsumexp(router_logits.float(), dim=-1, keepdim=True)
        weights = (vals.float() - log_z).exp()
    ids = torch.where(vals.isneginf(), base[:, :1], ids)
    return weights, ids.to(torch.int32)
