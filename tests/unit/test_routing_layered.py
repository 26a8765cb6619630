"""The engine-free rules every adapter calls: ``LayerConfigs`` (the config of a layer and a batch size),
``keeps_every_top_k``, ``splice_routed_columns`` and ``routing_difference`` / ``same_routing``."""

from __future__ import annotations

import pytest
import torch

from oea.routing import (
    AdaptiveK0Config,
    EPOEAConfig,
    ExpertPlacement,
    LayerConfigs,
    LayerK0Schedule,
    OEAConfig,
    PrunedConfig,
    RouterSpec,
    keeps_every_top_k,
    route,
    routing_difference,
    same_routing,
    splice_routed_columns,
)

SCHEDULE = LayerK0Schedule(64, 8, 3, (6, 6, 6), min_batch=4, layer_ids=(2, 3, 5),
                           batch_k0=((4, (8, 8, 8)), (16, (1, 2, 4)), (64, (2, 2, 3))))


def test_without_a_file_every_layer_and_batch_size_gets_oea_k0s_config():
    default = OEAConfig(3, min_batch=2)
    configs = LayerConfigs(default)
    assert configs.index(layer_id=7, position=1) is None
    assert configs.config(None, 5) is default and configs.config(2, 300) is default
    assert LayerConfigs(None).config(0, 8) is None, "OEA off: no config anywhere"


def test_the_file_gives_each_layer_its_k0_by_the_calls_rows():
    configs = LayerConfigs(OEAConfig(3, group_fill="cross"), SCHEDULE)
    index = configs.index(layer_id=3)
    assert index == 1
    for rows, k0 in ((1, 8), (4, 8), (5, 2), (16, 2), (17, 2), (1000, 2)):
        assert configs.config(index, rows) == OEAConfig(k0, min_batch=4, group_fill="cross"), rows
    assert configs.config(configs.index(layer_id=5), 20).k0 == 3
    assert configs.config(index, 9) is configs.config(index, 10), "built once per (layer, k0)"


def test_oea_min_batch_wins_over_the_files_and_max_experts_applies_to_every_layer():
    configs = LayerConfigs(OEAConfig(3, max_experts=8), SCHEDULE, min_batch=0)
    assert configs.config(0, 10) == OEAConfig(1, max_experts=8, min_batch=0)
    with pytest.raises(ValueError, match=r"OEA_MAX_EXPERTS=2: layer 0: max_experts must be >= k0"):
        LayerConfigs(OEAConfig(2, max_experts=2), SCHEDULE).check_model(64, 8, 3)


def test_the_entry_is_found_by_layer_id_when_listed_else_by_position():
    assert LayerConfigs(OEAConfig(3), SCHEDULE).index(layer_id=5, position=0) == 2
    plain = LayerK0Schedule(64, 8, 3, (1, 2, 3))
    assert LayerConfigs(OEAConfig(3), plain).index(layer_id=40, position=2) == 2
    assert LayerConfigs(OEAConfig(3), plain).index(layer_id=1) == 1
    with pytest.raises(ValueError, match=r"^k0\.json: MoE layer 4 is not in the file \(its layer_ids are \[2, 3, 5"):
        LayerConfigs(OEAConfig(3), SCHEDULE, where="k0.json").index(layer_id=4)
    with pytest.raises(ValueError, match=r"MoE layer 3 is not in the file \(it has 3 layers\)"):
        LayerConfigs(OEAConfig(3), plain).index(layer_id=3)


def test_check_model_says_what_does_not_fit_in_one_wording():
    with pytest.raises(ValueError, match=r"^SGLANG_OEA_K0 must be in 1\.\.8 \(the model's top_k\), got 9$"):
        LayerConfigs(OEAConfig(9), k0_variable="SGLANG_OEA_K0").check_model(64, 8)
    with pytest.raises(ValueError, match=r"^OEA_MAX_EXPERTS must be in 2\.\.8 \(the model's top_k\), got 9$"):
        LayerConfigs(OEAConfig(2, max_experts=9)).check_model(64, 8)
    with pytest.raises(ValueError, match=r"^F: per-layer k0 file was calibrated for another model "
                                         r"\(num_experts: file has 64, model has 32; num_layers: file has 3, "
                                         r"model has 4\)$"):
        LayerConfigs(OEAConfig(2), SCHEDULE, where="F").check_model(32, 8, 4)
    LayerConfigs(OEAConfig(2), SCHEDULE).check_router(RouterSpec(64, 8))  # the layer count unknown: not compared


def test_another_policy_with_a_k0_takes_the_layers_k0_and_min_batch():
    placement = ExpertPlacement.contiguous(64, 4)
    base = EPOEAConfig(3, placement, boost_rank=4, group_fill="cross")
    configs = LayerConfigs(OEAConfig(3), SCHEDULE)
    got = [configs.config(i, 10, base) for i in range(3)]
    assert [(c.k0, c.min_batch, c.boost_rank) for c in got] == [(1, 4, 4), (2, 4, 4), (4, 4, 4)]
    assert all(c.placement is placement and c.group_fill == "in" for c in got)
    assert configs.config(2, 10, base) is got[2]


def test_describe_lists_each_layer():
    described = LayerConfigs(OEAConfig(3), SCHEDULE).describe()
    assert described == "k0 per layer 8(<=4)/1(<=16)/2(<=64) 8(<=4)/2(<=64) 8(<=4)/4(<=16)/3(<=64)"
    assert isinstance(LayerConfigs(OEAConfig(3), SCHEDULE).layer(0), AdaptiveK0Config)


@pytest.mark.parametrize(("cfg", "keeps"), [
    (OEAConfig(8), True), (OEAConfig(8, max_experts=8), True), (OEAConfig(7), False),
    (PrunedConfig(8), True), (None, False),
    (AdaptiveK0Config(((4, 8),)), False),
])
def test_keeps_every_top_k(cfg, keeps):
    assert keeps_every_top_k(cfg, RouterSpec(64, 8)) is keeps


def _engine_output(rows: int, k: int, shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(rows * (k + shared), dtype=torch.int32).reshape(rows, k + shared) % 64
    return ids, torch.full((rows, k + shared), 0.5, dtype=torch.bfloat16)


@pytest.mark.parametrize("rerouted", ["all", "rows", "flag-on", "flag-off"])
def test_splice_replaces_the_routed_columns_of_the_rerouted_rows_only(rerouted):
    engine_ids, engine_w = _engine_output(4, 3, 2)
    ids, weights = torch.full((4, 3), 63, dtype=torch.int64), torch.full((4, 3), 0.25)
    select = {"all": None, "rows": torch.tensor([True, False, True, False]),
              "flag-on": torch.tensor(True), "flag-off": torch.tensor(False)}[rerouted]
    new_ids, new_w = splice_routed_columns(engine_ids, engine_w, ids, weights, select)
    assert new_ids.dtype == torch.int32 and new_w.dtype == torch.bfloat16 and new_ids.shape == (4, 5)
    assert torch.equal(new_ids[:, 3:], engine_ids[:, 3:]) and torch.equal(new_w[:, 3:], engine_w[:, 3:])
    take = {"all": [True] * 4, "rows": [True, False, True, False], "flag-on": [True] * 4, "flag-off": [False] * 4}
    for row, oea_row in enumerate(take[rerouted]):
        assert torch.equal(new_ids[row, :3], (ids if oea_row else engine_ids)[row, :3].to(torch.int32)), row
    with pytest.raises(ValueError, match="does not hold OEA's routing"):
        splice_routed_columns(engine_ids[:, :2], engine_w[:, :2], ids, weights)


def test_routing_difference_ignores_slot_order_and_filler_ids_but_not_weights():
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    ids, weights = route(logits, RouterSpec(16, 4), OEAConfig(1, min_batch=0))
    order = torch.tensor([3, 1, 0, 2])
    assert same_routing(ids, weights, ids[:, order], weights[:, order])
    with_filler = weights.clone()
    with_filler[:, 3] = 0  # a zero-weight slot: which expert it names does not matter
    renamed = ids.clone()
    renamed[:, 3] = (ids[:, 3] + 1) % 16
    assert routing_difference(ids, with_filler, renamed, with_filler) is None
    assert routing_difference(ids, weights, renamed, weights) is not None
    other = ids.clone()
    other[0, weights[0].argmax()] = (other[0, weights[0].argmax()] + 1) % 16
    assert routing_difference(ids, weights, other, weights) == "expert ids differ in 1 of 6 rows"
    assert routing_difference(ids, weights, ids, weights * 1.01).startswith("weights differ by up to")
    assert routing_difference(ids, weights, ids[:3], weights[:3]).startswith("shape")
