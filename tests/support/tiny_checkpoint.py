"""A tiny random checkpoint directory an engine's server can load: config, bf16 weights and the embedded tokenizer.

For live-server tests of router families the embedded model does not have. ``glm4_moe`` (GLM-4.5-MoE, the
reference deployment's router family): sigmoid scores, a random non-zero ``e_score_correction_bias``, grouped
top-k (``n_group`` / ``topk_group``), ``routed_scaling_factor`` and one shared expert. Random weights: the
tokens mean nothing; the routing is real. The model is built by ``oea.testing.tiny_moe`` (the project's
test models) with the embedded model's vocabulary, so the embedded tokenizer serves it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_tiny_checkpoint(
    out_dir: str | Path,
    family: str = "glm4_moe",
    *,
    num_experts: int = 16,
    top_k: int = 4,
    n_group: int = 4,
    topk_group: int = 2,
    num_layers: int = 2,
    seed: int = 0,
) -> Path:
    """Write a tiny random ``family`` model (``oea.testing.TINY_FAMILIES``) to ``out_dir`` and return it.

    ``n_group`` / ``topk_group`` apply to the grouped families (GLM, DeepSeek-V3). The output head is stored
    (``tie_word_embeddings`` false: SGLang never ties these architectures), weights in bf16, and the embedded
    model's tokenizer is copied beside them (vocab 4096). Raises ``ValueError`` for an unknown family.
    """
    from oea.models import embedded_model_dir
    from oea.testing import tiny_moe

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_moe(family, num_layers=num_layers, num_experts=num_experts, top_k=top_k, vocab=4096, seed=seed)
    config: Any = model.config
    if hasattr(config, "n_group"):
        config.n_group, config.topk_group = n_group, topk_group
    config.tie_word_embeddings = False
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0  # the embedded tokenizer's <|endoftext|>
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.to(torch.bfloat16).save_pretrained(out)
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["tie_word_embeddings"] = False
    config_path.write_text(json.dumps(saved, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(embedded_model_dir() / name, out / name)
    return out
