"""Tiny random MoE models of the supported transformers families, for tests, docs and the doctor.

Built from a config (no download, a few MB, seconds on a CPU); transformers is imported lazily, so
importing this module needs only torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TINY_FAMILIES: tuple[str, ...] = ("qwen3_moe", "olmoe", "mixtral", "deepseek_v3", "glm4_moe", "glm_moe_dsa")


def tiny_moe_config(
    family: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 16,
    top_k: int = 4,
    vocab: int = 256,
) -> Any:
    """The transformers config of a tiny ``family`` model (one of ``TINY_FAMILIES``); every layer is MoE."""
    import transformers

    hidden, layers, experts = hidden_size, num_layers, num_experts

    common = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "num_experts_per_tok": top_k,
        "bos_token_id": 1, "eos_token_id": None, "pad_token_id": 0,  # ids inside the tiny vocab; no early stop
    }
    mla = {
        "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
        "v_head_dim": 32,
    }
    grouped = {
        "n_routed_experts": experts, "moe_intermediate_size": hidden, "n_shared_experts": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 0,
    }
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, head_dim=hidden // 4, num_experts=experts, moe_intermediate_size=hidden,
            norm_topk_prob=True,
        )
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, num_experts=experts, norm_topk_prob=False)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, head_dim=hidden // 4, num_local_experts=experts)
    if family == "deepseek_v3":
        mla_common = {**common, "num_key_value_heads": 4}  # MLA: one KV head per attention head
        return transformers.DeepseekV3Config(**mla_common, **mla, **grouped, n_group=4, topk_group=2)
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(**common, **grouped, head_dim=hidden // 4, n_group=1, topk_group=1)
    if family == "glm_moe_dsa":
        config_cls = getattr(transformers, "GlmMoeDsaConfig", None)
        if config_cls is None:
            raise ValueError(f"transformers {transformers.__version__} has no GlmMoeDsaConfig (GLM-5)")
        return config_cls(
            **{**common, "num_key_value_heads": 4}, **mla, **grouped, n_group=1, topk_group=1,
            mlp_layer_types=["sparse"] * layers,
            index_topk=16, index_head_dim=32, index_n_heads=2, head_dim=hidden // 4,
        )
    raise ValueError(f"family must be one of {TINY_FAMILIES}, got {family!r}")


def tiny_moe(
    family: str = "qwen3_moe",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 16,
    top_k: int = 4,
    vocab: int = 256,
    seed: int = 0,
    experts_implementation: str | None = None,
) -> nn.Module:
    """A tiny random MoE causal LM of ``family`` (one of ``TINY_FAMILIES``) built from a config, in eval mode.

    No download. Grouped families (DeepSeek-V3: ``n_group=4, topk_group=2``; GLM: 1/1) get a
    non-zero random ``e_score_correction_bias`` so the bias path is exercised.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(
        family, hidden_size=hidden_size, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
        vocab=vocab,
    )
    torch.manual_seed(seed)
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_config(config, **kwargs).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(0.05 * torch.randn(bias.shape, generator=generator))
    return model


def tiny_qwen3_moe(**kwargs: Any) -> nn.Module:
    """``tiny_moe("qwen3_moe", **kwargs)``."""
    return tiny_moe("qwen3_moe", **kwargs)


__all__ = ["TINY_FAMILIES", "tiny_moe", "tiny_moe_config", "tiny_qwen3_moe"]
