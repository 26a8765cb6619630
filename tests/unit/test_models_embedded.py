"""The shipped embedded model: files, config, tokenizer, checkpoint layout, held-out list."""

from __future__ import annotations

import json

import pytest

from oea.models import embedded_model_dir, heldout_changed, heldout_documents
from oea.models.data import split_files, stdlib_files

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
torch.set_num_threads(1)

MODEL_DIR = embedded_model_dir()


def test_shipped_files_fit_the_budget() -> None:
    names = {p.name for p in MODEL_DIR.iterdir()}
    for required in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                     "heldout_files.json", "MODEL_CARD.md"):
        assert required in names
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file()) <= 30 * 1024 * 1024


def test_config_is_a_stock_qwen3_moe_with_qwen3_routing() -> None:
    config = transformers.AutoConfig.from_pretrained(MODEL_DIR)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (128, 8, True)
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1
    assert config.router_aux_loss_coef > 0


def test_checkpoint_has_per_expert_bf16_keys() -> None:
    from safetensors import safe_open

    with safe_open(MODEL_DIR / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        dtype = f.get_tensor("model.layers.0.mlp.experts.127.down_proj.weight").dtype
    config = json.loads((MODEL_DIR / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        for expert in (0, 127):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight" in keys
        assert f"model.layers.{layer}.mlp.gate.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    assert dtype == torch.bfloat16


def test_tokenizer_round_trips_python_source() -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    assert len(tokenizer) == 4096
    assert tokenizer.bos_token == tokenizer.eos_token == "<|endoftext|>"
    odd = "def f(x):\n    return {'a': x ** 2}  # ünïcode ☃\n"
    assert tokenizer.decode(tokenizer(odd, add_special_tokens=False)["input_ids"]) == odd  # byte-level
    source = "class Parser:\n    def __init__(self, name):\n        self.name = name\n        return None\n"
    ids = tokenizer(source, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == source
    assert len(ids) < len(source) / 3  # BPE merges learned on Python


def test_heldout_list_matches_this_pythons_split() -> None:
    listed = [name for name, _ in heldout_documents()]
    assert listed == [f.name for f in split_files(stdlib_files())[1]]
    assert heldout_changed() == []


def test_checkpoint_stores_its_output_head_untied() -> None:
    """Engines that never tie qwen3_moe (SGLang) load the head only when it is stored; it equals the embeddings
    it was trained tied to, so every engine computes the same logits."""
    from safetensors import safe_open

    assert json.loads((MODEL_DIR / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(MODEL_DIR / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
