"""Bad input to the library that used to pass silently: each is refused with the field named."""

from __future__ import annotations

import pytest
import torch

import oea
from oea.routing import ExpertPlacement, make_policy, policy_options
from oea.sim.presets import get_model_preset
from oea.sim.roofline import check_roofline_arguments


def test_n_group_without_topk_group_names_both_fields() -> None:
    with pytest.raises(ValueError, match=r"n_group needs topk_group .* got topk_group=None"):
        oea.RouterSpec(16, 2, "sigmoid", n_group=4)
    spec = oea.RouterSpec(16, 2, "sigmoid", n_group=4, topk_group=4)  # explicit: no group limit
    assert spec.topk_group == 4


def test_an_expert_placement_with_an_empty_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"devices \[1\] serve no expert"):
        ExpertPlacement.from_devices([[0, 1, 2, 3], []], 4)
    with pytest.raises(ValueError, match=r"devices \[1\] serve no expert"):
        ExpertPlacement(torch.tensor([0, 0, 2, 2]), 3)
    with pytest.raises(ValueError, match=r"must lie in 0\.\.1"):
        ExpertPlacement(torch.tensor([0, 2]), 2)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        ExpertPlacement(torch.tensor([0.0, 1.0]), 2)
    with pytest.raises(ValueError, match="num_devices must be an integer >= 1"):
        ExpertPlacement(torch.tensor([0, 0]), 0)
    assert ExpertPlacement.contiguous(8, 4).device_counts(torch.ones(8, dtype=torch.bool)).tolist() == [2] * 4


def test_an_unknown_policy_option_is_named_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"policy 'budget' has no option 'nosuch'; its options are \['budget', "
                                         r"'min_batch'\]"):
        make_policy("budget", budget=40, nosuch=1)
    assert policy_options("ep-oea") == ("placement", "boost_rank", "min_batch", "group_fill", "ep", "num_experts")
    assert make_policy("ep-oea", 3, ep=4, num_experts=16).placement.num_devices == 4
    with pytest.raises(ValueError, match="policy must be one of"):
        policy_options("nope")


def test_roofline_arguments_name_the_flag() -> None:
    preset = get_model_preset("qwen3-30b-a3b")
    check_roofline_arguments(preset, 1, 1, [1, 16], [3, 8])
    for args, fragment in [((1, 1, [0], [3]), "--batch-sizes must be integers >= 1, got [0]"),
                           ((1, 1, [-4], [3]), "--batch-sizes"),
                           ((1, 1, [16], [0]), "--k0 must be integers in 1..8"),
                           ((1, 1, [16], [99]), "got [99]"),
                           ((0, 1, [16], [3]), "--tp must be an integer >= 1"),
                           ((1, 0, [16], [3]), "--ep must be an integer >= 1")]:
        with pytest.raises(ValueError) as err:
            check_roofline_arguments(preset, *args)
        assert fragment in str(err.value)
