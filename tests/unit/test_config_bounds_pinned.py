"""Configuration at its edges: ``OEA_MAX_EXPERTS`` equal to the model's top_k is accepted (one above is not), and
a per-layer k0 file of a model with 10 or more MoE layers is matched by layer id: layer 12 gets the file's entry
for layer 12, whichever place it is met in, and a module named ``...layers.12...`` is layer 12."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import oea
from oea.config import layer_configs, settings_from_env, write_layer_k0_file
from oea.integrations.vllm.layers import layer_number
from oea.routing import LayerK0Schedule


@pytest.mark.parametrize("top_k", [2, 8])
def test_max_experts_equal_to_top_k_is_accepted(top_k: int) -> None:
    configs = layer_configs(settings_from_env({"OEA_K0": "1", "OEA_MAX_EXPERTS": str(top_k)}))
    configs.check_model(64, top_k)  # no error: top_k experts per token is the most there are
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    ids, _ = oea.route(logits, oea.RouterSpec(64, top_k), oea.OEAConfig(1, max_experts=top_k))
    assert ids.shape == (6, top_k)
    above = layer_configs(settings_from_env({"OEA_K0": "1", "OEA_MAX_EXPERTS": str(top_k + 1)}))
    with pytest.raises(ValueError, match=f"OEA_MAX_EXPERTS must be in 1..{top_k}"):
        above.check_model(64, top_k)


def _file(tmp_path: Path, layer_ids: tuple[int, ...] | None, k0: tuple[int, ...]) -> Path:
    path = tmp_path / "k0.json"
    write_layer_k0_file(LayerK0Schedule(num_experts=64, top_k=8, num_layers=len(k0), k0=k0, layer_ids=layer_ids),
                        path)
    return path


def test_a_layer_file_of_many_layers_is_matched_by_layer_id(tmp_path: Path) -> None:
    """16 MoE layers after 2 dense ones (ids 2..17), each with its own k0: layer 12 is the file's entry for
    layer 12 (the 11th), also when it is the first layer met."""
    k0 = tuple(1 + i % 8 for i in range(16))
    ids = tuple(range(2, 18))
    configs = layer_configs(settings_from_env({"OEA_K0": "3", "OEA_LAYER_K0_FILE": str(_file(tmp_path, ids, k0))}))
    configs.check_model(64, 8, 16)
    for met, layer_id in enumerate((12, 17, 2, 10)):
        index = configs.index(layer_id=layer_id, position=met)
        assert index == ids.index(layer_id) and configs.layer(index).k0 == k0[ids.index(layer_id)], layer_id
    with pytest.raises(ValueError, match="MoE layer 1 is not in the file"):
        configs.index(layer_id=1, position=0)


def test_module_names_give_the_whole_layer_number() -> None:
    assert layer_number("model.layers.12.mlp.experts") == 12
    assert layer_number("model.layers.1.mlp.gate") == 1
    assert layer_number("language_model.model.layers.107.block_sparse_moe") == 107
    assert layer_number("model.layers12.mlp") is None
