"""Bad input to the library that would otherwise route silently wrong: each is refused with the field named."""

from __future__ import annotations

import pytest
import torch

import oea
from oea.presets import get_model_preset
from oea.routing import ExpertPlacement, make_policy, policy_options
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
                                         r"'min_batch', 'floor'\]"):
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


def test_a_correction_bias_with_nan_or_inf_is_refused_naming_the_experts() -> None:
    bias = torch.zeros(16)
    with pytest.raises(ValueError, match=r"correction_bias must hold finite values .* got nan at 16 of 16 experts"):
        oea.RouterSpec(16, 2, "sigmoid", correction_bias=torch.full((16,), float("nan")))
    bias[[3, 9]] = float("inf")
    with pytest.raises(ValueError, match=r"got inf at 2 of 16 experts \(3, 9\)"):
        oea.RouterSpec(16, 2, "sigmoid", correction_bias=bias)
    spec = oea.RouterSpec(16, 2, "sigmoid", correction_bias=torch.linspace(-0.1, 0.1, 16))
    assert torch.isfinite(spec.correction_bias).all()


def test_a_spec_built_while_compiling_reads_no_bias_value() -> None:
    bias = torch.zeros(16)

    def build(logits: torch.Tensor) -> torch.Tensor:
        spec = oea.RouterSpec(16, 2, "sigmoid", correction_bias=bias)
        return oea.route(logits, spec, oea.OEAConfig(1, min_batch=0))[0]

    logits = torch.randn(4, 16)
    compiled = torch.compile(build, fullgraph=True, backend="eager")
    assert torch.equal(compiled(logits), build(logits))


def test_a_rank_limit_below_k0_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_rank must be >= k0 .* got max_rank=2 and k0=3"):
        oea.OEAConfig(3, max_rank=2)
    assert oea.OEAConfig(3, max_rank=3).max_rank == 3


@pytest.mark.parametrize("convert", [lambda t: t.numpy(), lambda t: t.tolist()], ids=["numpy", "list"])
def test_route_given_a_numpy_array_or_a_list_is_a_type_error_naming_the_argument(convert) -> None:
    spec = oea.RouterSpec(16, 4)
    logits = torch.randn(8, 16)
    for fn in (oea.route, oea.route_fast, oea.reference_route):
        with pytest.raises(TypeError, match=r"router_logits must be a torch\.Tensor \[M, N\], got (numpy|builtins)"):
            fn(convert(logits), spec, oea.OEAConfig(3))
        with pytest.raises(TypeError, match=r"valid must be a torch\.Tensor \[M\] bool"):
            fn(logits, spec, oea.OEAConfig(3), convert(torch.ones(8, dtype=torch.bool)))
    with pytest.raises(TypeError, match=r"spec must be an oea\.RouterSpec, got tuple"):
        oea.route(logits, (16, 4), oea.OEAConfig(3))


def test_counting_functions_name_mismatched_arguments() -> None:
    spec = oea.RouterSpec(16, 4)
    ids, weights = oea.route(torch.randn(8, 16), spec, oea.OEAConfig(3))
    placement = ExpertPlacement.contiguous(16, 4)
    counters = [lambda i, w, v=None: oea.active_experts(i, w, v),
                lambda i, w, v=None: oea.expert_load(i, w, 16, v),
                lambda i, w, v=None: oea.routing.max_device_active_experts(i, w, placement, v)]
    for count in counters:
        with pytest.raises(ValueError, match=r"weights must have the shape of ids \[M, k\]=\[8, 4\], got \[4, 4\]"):
            count(ids, weights[:4])
        with pytest.raises(ValueError, match=r"valid must be a bool tensor of shape \[M\]=\[8\], got .* shape=\(3,\)"):
            count(ids, weights, torch.ones(3, dtype=torch.bool))
        with pytest.raises(ValueError, match="ids must be an integer tensor"):
            count(weights, weights)
        with pytest.raises(TypeError, match=r"ids must be a torch\.Tensor"):
            count(ids.numpy(), weights.numpy())
        assert int(count(ids, weights).max() if count is counters[1] else count(ids, weights)) > 0
