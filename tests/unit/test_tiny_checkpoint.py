"""``tests/support/tiny_checkpoint.py``: a tiny GLM-4.5-MoE checkpoint directory a server can load (sigmoid router with
a non-zero correction bias, grouped top-k, scaling factor, untied head, the embedded tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_a_tiny_glm4_moe_checkpoint_has_the_reference_router_family(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from tiny_checkpoint import write_tiny_checkpoint  # tests/support (pytest's pythonpath)

    out = write_tiny_checkpoint(tmp_path / "glm", "glm4_moe", num_experts=16, top_k=4, n_group=4, topk_group=2)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["n_routed_experts"], config["num_experts_per_tok"]) == ("glm4_moe", 16, 4)
    assert (config["n_group"], config["topk_group"], config["tie_word_embeddings"]) == (4, 2, False)
    assert config["routed_scaling_factor"] == 2.5 and config["vocab_size"] == 4096
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor("model.layers.0.mlp.gate.e_score_correction_bias")
    assert "lm_head.weight" in keys and "model.layers.1.mlp.experts.15.down_proj.weight" in keys
    assert bool((bias != 0).any()) and bias.dtype == torch.bfloat16
    assert (out / "tokenizer.json").exists()
