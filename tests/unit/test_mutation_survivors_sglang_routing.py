"""What the generated mutants of the SGLang adapter's routing files found unguarded (docs/testing.md, "Generated
mutants"): ``oea/integrations/sglang/specs.py``, ``fillers.py``, ``router_state.py`` and ``state.py``.

The translation of SGLang's ``TopKConfig`` (``specs.py``): a config of an SGLang that lacks the optional fields is
the plain router its required fields say, an ``output_format`` given as SGLang's enum or as its name, the scaling
factor folded only where SGLang says so, a non-grouped biased sigmoid router keeping its bias and factor, and the
exact words of each refusal (they are the warning a user reads when a layer keeps SGLang's routing).

The forward-mode stack (``state.py``): a forward in a thread of its own (SGLang's overlap scheduler) starts outside
any forward and is rerouted in decode; a mode object without the predicates is neither decode nor verify.
"""

from __future__ import annotations

import enum
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_stand_ins import FakeMode, fresh_state, topk_config, topk_module

import oea
import oea.integrations.sglang.routing as plugin_routing
from oea.config import settings_from_env
from oea.integrations import sglang as plugin
from oea.integrations.sglang.fillers import distinct_fillers
from oea.integrations.sglang.state import STATE, decode_or_verify

torch.set_num_threads(1)


class OutputFormat(enum.Enum):
    """SGLang's ``TopKOutputFormat`` (an ``enum.Enum``: its ``str`` is ``OutputFormat.STANDARD``, not the name)."""

    STANDARD = enum.auto()
    TRITON_KERNEL = enum.auto()
    BYPASSED = enum.auto()


def _spec_fields(spec: Any) -> tuple[Any, ...]:
    return (spec.num_experts, spec.top_k, spec.scoring, spec.renormalize, spec.correction_bias, spec.n_group,
            spec.topk_group, spec.routed_scaling_factor)


# -- specs.py: router_spec_from_topk_config, shared_topk_slots, _bias_vector -----------------------------------------

def _required_only(**fields: Any) -> SimpleNamespace:
    """A ``TopKConfig`` with only the fields every SGLang version has (the others are read with a default)."""
    base = dict(top_k=8, renormalize=True, correction_bias=None, use_grouped_topk=False)
    base.update(fields)
    return SimpleNamespace(**base)


def test_a_topk_config_with_only_the_required_fields_is_the_plain_softmax_router_of_its_top_k() -> None:
    spec = plugin.router_spec_from_topk_config(_required_only(), 64)
    assert _spec_fields(spec) == (64, 8, "softmax", True, None, None, None, 1.0)
    assert plugin.shared_topk_slots(_required_only()) == 0


def test_a_scaling_factor_is_folded_only_where_the_config_says_so() -> None:
    """Without ``apply_routed_scaling_factor_on_output`` (and no ``scaling_fused`` from SGLang), the factor is not
    folded into the weights: scale 1.0. Where it is folded, a non-grouped router carries the factor too."""
    unfolded = plugin.router_spec_from_topk_config(_required_only(routed_scaling_factor=2.5), 64)
    assert unfolded.routed_scaling_factor == 1.0
    folded = plugin.router_spec_from_topk_config(topk_config(routed_scaling_factor=2.5), 64, scaling_fused=True)
    assert _spec_fields(folded) == (64, 8, "softmax", True, None, None, None, 2.5)
    said = plugin.router_spec_from_topk_config(
        topk_config(routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=True), 64)
    assert said.routed_scaling_factor == 2.5


def test_a_scoring_func_of_none_is_softmax() -> None:
    spec = plugin.router_spec_from_topk_config(topk_config(scoring_func=None), 64)
    assert spec.scoring == "softmax"


@pytest.mark.parametrize("output_format", [OutputFormat.STANDARD, "STANDARD", SimpleNamespace(name="STANDARD")])
def test_a_standard_output_format_as_the_enum_or_its_name_is_supported(output_format: Any) -> None:
    spec = plugin.router_spec_from_topk_config(topk_config(output_format=output_format), 64)
    assert _spec_fields(spec) == (64, 8, "softmax", True, None, None, None, 1.0)


@pytest.mark.parametrize("output_format", [OutputFormat.TRITON_KERNEL, "TRITON_KERNEL"])
def test_another_output_format_is_refused_naming_it_and_the_backend_to_use(output_format: Any) -> None:
    with pytest.raises(plugin.UnsupportedRouting) as raised:
        plugin.router_spec_from_topk_config(topk_config(output_format=output_format), 64)
    assert str(raised.value) == ("output_format=TRITON_KERNEL: routing happens inside the MoE kernel "
                                 "(use --moe-runner-backend triton)")


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(custom_routing_function=lambda **kw: None), "custom_routing_function is set (e.g. Llama4)"),
    (dict(fused_gate_packed_ids=True), "fused_gate_packed_ids: the router also emits packed ids"),
    (dict(scoring_func="sigmoid", correction_bias=torch.zeros(32)),
     "correction_bias of shape (32,) (per-token or EP-sliced bias)"),
    (dict(scoring_func="sigmoid", correction_bias=torch.zeros(64, 64)),
     "correction_bias of shape (64, 64) (per-token or EP-sliced bias)"),
    (dict(use_grouped_topk=True, num_expert_group=2, topk_group=None, scoring_func="sigmoid",
          correction_bias=torch.zeros(64)), "num_expert_group=2 without topk_group (got None)"),
])
def test_routers_oea_cannot_rebuild_are_refused_in_these_words(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(plugin.UnsupportedRouting) as raised:
        plugin.router_spec_from_topk_config(topk_config(**overrides), 64)
    assert str(raised.value) == message


def test_a_non_grouped_biased_sigmoid_router_keeps_its_bias_and_folded_factor() -> None:
    bias = torch.linspace(0.0, 0.3, 64)
    cfg = topk_config(scoring_func="sigmoid", correction_bias=bias, routed_scaling_factor=2.5,
                      apply_routed_scaling_factor_on_output=True)
    spec = plugin.router_spec_from_topk_config(cfg, 64)
    assert spec.correction_bias is bias
    assert (spec.scoring, spec.n_group, spec.topk_group, spec.routed_scaling_factor) == ("sigmoid", None, None, 2.5)


# -- state.py: the per-thread forward-mode stack, the mode predicates -------------------------------------------------

def _call(layer_id: int, cfg: Any, rows: int = 6, experts: int = 64, seed: int = 3) -> dict[str, Any]:
    """The keyword arguments SGLang's ``_post_process_topk_ids`` gets: SGLang's own top-k of random logits."""
    logits = torch.randn(rows, experts, generator=torch.Generator().manual_seed(seed))
    ids, weights = oea.route(logits, plugin.router_spec_from_topk_config(cfg, experts))
    return dict(topk_ids=ids.to(torch.int32), topk_weights=weights, topk_config=cfg, router_logits=logits,
                layer_id=layer_id, num_token_non_padded=None, expert_location_dispatch_info=None)


def _oea_ids(kwargs: dict[str, Any], k0: int) -> torch.Tensor:
    """What the rewrite hands SGLang for ``kwargs`` under ``OEA_K0=k0``: OEA's ids with distinct fillers."""
    spec = plugin.router_spec_from_topk_config(kwargs["topk_config"], kwargs["router_logits"].shape[1])
    ids, weights = oea.route(kwargs["router_logits"], spec, oea.OEAConfig(k0))
    return distinct_fillers(ids, weights, spec.top_k, spec.num_experts)[0]


@pytest.fixture
def sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's state fresh, SGLang's ``topk`` module stood in, ``OEA_K0=2`` installed."""
    fresh_state(monkeypatch)
    topk_module(monkeypatch)
    STATE.settings = settings_from_env({"OEA_K0": "2"})


def test_a_decode_forward_in_a_thread_of_its_own_is_rerouted(sglang: None) -> None:
    """SGLang's overlap scheduler runs the forward in a thread of its own: that thread starts outside any forward
    (no mode, no batch frame, no per-token bias) and its decode forward is rerouted like the main thread's."""
    kwargs = _call(0, topk_config())
    seen: dict[str, Any] = {}

    def forward() -> None:
        try:
            seen["outside"] = (plugin.current_forward_mode(), plugin.decode_active())
            with plugin.forward_mode(FakeMode.DECODE):
                seen["inside"] = (plugin.current_forward_mode(), plugin.decode_active())
                seen["routed"] = plugin_routing.post_process_before(**kwargs)
        except BaseException as err:  # handed to the test's thread
            seen["error"] = err

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join()
    assert "error" not in seen, seen.get("error")
    assert seen["outside"] == (None, False) and seen["inside"] == (FakeMode.DECODE, True)
    assert seen["routed"] is not None, "the thread's decode call kept SGLang's routing"
    assert torch.equal(seen["routed"][1]["topk_ids"].long(), _oea_ids(kwargs, 2))
    assert not STATE.routers[0].failed


@pytest.mark.parametrize("apply_to_verify", [False, True])
def test_a_forward_mode_without_the_predicates_is_neither_decode_nor_verify(sglang: None,
                                                                            apply_to_verify: bool) -> None:
    """A mode object that has no ``is_decode`` / ``is_target_verify`` (or not as methods) is another mode: its
    forwards keep SGLang's routing, and asking never raises."""
    for mode in (SimpleNamespace(), SimpleNamespace(is_decode=True, is_target_verify=True), "DECODE"):
        assert decode_or_verify(mode, apply_to_verify) is False
        with plugin.forward_mode(mode):
            assert plugin.decode_active() is False
            assert plugin_routing.post_process_before(**_call(0, topk_config())) is None
    assert decode_or_verify(FakeMode.TARGET_VERIFY, apply_to_verify) is apply_to_verify
