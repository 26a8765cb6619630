"""Routing statistics of a Qwen3-style MoE model on mixed batches (one token from each of B documents); a helper of
scripts/train_embedded_model.py (via scripts/embedded_export.py), not part of the oea package.

Used for the embedded model's card and its routing targets: mean active experts per layer
(the top-k union over B tokens), its ratio to the uniform-routing expectation, the share of
routing that goes to the busiest 10% of experts, never-used experts, and T under OEA.
"""

from __future__ import annotations

from typing import Any

import torch

import oea


def uniform_union(num_experts: int, k: int, batch_size: int) -> float:
    """Expected number of distinct experts when B tokens each pick k of N uniformly at random."""
    return num_experts * (1.0 - (1.0 - k / num_experts) ** batch_size)


def router_spec_for(config: Any) -> oea.RouterSpec:
    """The softmax top-k router of a Qwen3-MoE / Qwen2-MoE / OLMoE / Mixtral style config."""
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if num_experts is None or top_k is None:
        raise ValueError(
            "model config has no MoE router fields (looked for num_experts / num_local_experts "
            f"and num_experts_per_tok) in {type(config).__name__}"
        )
    renormalize = bool(getattr(config, "norm_topk_prob", True))
    return oea.RouterSpec(int(num_experts), int(top_k), scoring="softmax", renormalize=renormalize)


def document_batches(
    tokenizer: Any, texts: list[str], batch_size: int, positions: int
) -> list[torch.Tensor]:
    """``[batch_size, positions]`` id tensors; each row the start of a different document.

    Every row starts with the BOS token; documents shorter than ``positions`` tokens are skipped,
    and the last incomplete group of documents is dropped.
    """
    rows = []
    for text in texts:
        ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        if len(ids) >= positions:
            rows.append(torch.tensor(ids[:positions], dtype=torch.int64))
    return [torch.stack(rows[i : i + batch_size]) for i in range(0, len(rows) - batch_size + 1, batch_size)]


@torch.no_grad()
def layer_router_logits(model: Any, batch: torch.Tensor) -> list[torch.Tensor]:
    """Router logits of every MoE layer for ``batch`` [B, P] -> list of [B, P, N] float32."""
    out = model(batch, output_router_logits=True, use_cache=False)
    if not out.router_logits:
        raise ValueError("model returned no router logits (output_router_logits=True gave none)")
    return [layer.float().view(batch.shape[0], batch.shape[1], -1) for layer in out.router_logits]


@torch.no_grad()
def routing_statistics(
    model: Any, tokenizer: Any, texts: list[str], *, batch_size: int = 16, positions: int = 128, k0: int = 3
) -> dict[str, Any]:
    """Routing statistics over mixed batches (row b of a batch = document b; position 0 = BOS, skipped).

    Returns a dict: ``mean_active_experts`` (top-k union per layer and position, averaged),
    ``per_layer_active_experts``, ``uniform_active_experts`` and ``active_ratio``;
    ``top10_share`` (share of all routing slots going to the busiest round(N/10) experts of each
    layer, pooled over every token, averaged over layers; 0.10 under uniform routing);
    ``never_used_per_layer`` (experts that got no token at all); ``oea_k0``, ``oea_active_experts``
    (T = |S_base| under OEA k0) and ``uniform_oea_active_experts``; ``oea_router_mass`` (mean over
    tokens of the router probability OEA's experts carry, relative to vanilla's top-k);
    ``tokens`` and ``batches`` counted.
    """
    spec = router_spec_for(model.config)
    batches = document_batches(tokenizer, texts, batch_size, positions)
    if not batches:
        raise ValueError(f"need at least {batch_size} documents of >= {positions} tokens, got fewer")
    num_layers = None
    active: list[list[int]] = []
    oea_active: list[int] = []
    mass_ratio: list[torch.Tensor] = []
    loads: list[torch.Tensor] = []
    cfg = oea.OEAConfig(k0)
    for batch in batches:
        per_layer = layer_router_logits(model, batch)
        if num_layers is None:
            num_layers = len(per_layer)
            active = [[] for _ in per_layer]
            loads = [torch.zeros(spec.num_experts, dtype=torch.int64) for _ in per_layer]
        for layer, logits in enumerate(per_layer):
            for t in range(1, batch.shape[1]):
                step_logits = logits[:, t]  # [B, N]
                ids, weights = oea.route(step_logits, spec)
                active[layer].append(int(oea.active_experts(ids, weights)))
                loads[layer] += oea.expert_load(ids, weights, spec.num_experts)
                oea_ids, oea_weights = oea.route(step_logits, spec, cfg)
                oea_active.append(int(oea.active_experts(oea_ids, oea_weights)))
                probs = step_logits.softmax(dim=-1)
                kept = (probs.gather(1, oea_ids) * (oea_weights != 0)).sum(dim=-1)
                mass_ratio.append(kept / probs.gather(1, ids).sum(dim=-1))
    busiest = max(1, round(spec.num_experts / 10))
    top10 = [float(load.sort(descending=True).values[:busiest].sum() / load.sum()) for load in loads]
    per_layer_active = [sum(a) / len(a) for a in active]
    mean_active = sum(per_layer_active) / len(per_layer_active)
    uniform = uniform_union(spec.num_experts, spec.top_k, batch_size)
    tokens = sum(b.shape[0] * (b.shape[1] - 1) for b in batches)
    return {
        "batch_size": batch_size,
        "batches": len(batches),
        "positions": positions,
        "tokens": tokens,
        "mean_active_experts": mean_active,
        "per_layer_active_experts": per_layer_active,
        "uniform_active_experts": uniform,
        "active_ratio": mean_active / uniform,
        "top10_share": sum(top10) / len(top10),
        "per_layer_top10_share": top10,
        "never_used_per_layer": [int((load == 0).sum()) for load in loads],
        "oea_k0": k0,
        "oea_active_experts": sum(oea_active) / len(oea_active),
        "uniform_oea_active_experts": uniform_union(spec.num_experts, k0, batch_size),
        "oea_router_mass": float(torch.cat(mass_ratio).mean()),
    }


def unigram_cross_entropy(train_ids: list[int], eval_ids: list[int], vocab_size: int) -> float:
    """CE (nats/token) of ``eval_ids`` under the add-one-smoothed unigram distribution of ``train_ids``."""
    counts = torch.bincount(torch.tensor(train_ids), minlength=vocab_size).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[torch.tensor(eval_ids)].mean())

