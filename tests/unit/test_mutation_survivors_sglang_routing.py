"""What the generated mutants of the SGLang adapter's routing files found unguarded (docs/testing.md, "Generated
mutants"): ``oea/integrations/sglang/specs.py``, ``fillers.py``, ``router_state.py`` and ``state.py``.

The translation of SGLang's ``TopKConfig`` (``specs.py``): a config of an SGLang that lacks the optional fields is
the plain router its required fields say, an ``output_format`` given as SGLang's enum or as its name, the scaling
factor folded only where SGLang says so, a non-grouped biased sigmoid router keeping its bias and factor, and the
exact words of each refusal (they are the warning a user reads when a layer keeps SGLang's routing).

The forward-mode stack (``state.py``): a forward in a thread of its own (SGLang's overlap scheduler) starts outside
any forward and is rerouted in decode; a mode object without the predicates is neither decode nor verify.

The fillers (``fillers.py``): the tensors themselves where nothing can repeat, ids past the experts, the order of
the candidates at its tie (the last expert active, expert 0 not), k above N, dtypes and widths kept, the caller's
kept mask read, the module's masks made once per (k, device) on that device and never kept from a compiled or
captured region (stand-ins for Dynamo and CUDA capture), and SGLang's capture: positional calls swapped with their
other arguments kept, the capturer wrapped once over many calls, a capturer module without its getter.

Each layer's state (``router_state.py``): the pass-through reasons' names, why a layer keeps SGLang's routing (aiter,
NPU, a draft model's TopK) and its absence where the flags are missing, the scaling factor folded as SGLang's
``topk`` module or the config says, a layer met before any settings, the layer configs install made (read once),
a k0 by batch size followed per call, the numba kernel planned once per config (not on an empty call, on a one-row
one) and never from another kernel's plan, and the host filler mask viewed once.
"""

from __future__ import annotations

import enum
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from sglang_stand_ins import FakeMode, fresh_state, stand_in_module, topk_config, topk_module

import oea
import oea.integrations.sglang.fillers as fillers_module
import oea.integrations.sglang.router_state as router_state_module
import oea.integrations.sglang.routing as plugin_routing
from oea.config import settings_from_env, write_layer_k0_file
from oea.integrations import sglang as plugin
from oea.integrations.sglang.fillers import (
    capture_replay_ids,
    distinct_fillers,
    distinct_fillers_on_host,
    earlier_mask,
)
from oea.integrations.sglang.plugin import install
from oea.integrations.sglang.router_state import (
    BELOW_MIN_BATCH,
    K0_COVERS_TOP_K,
    LAYER_FAILED,
    OEA_OFF,
    VERIFY_NOT_APPLIED,
    recorded_spec,
    router_state,
)
from oea.integrations.sglang.state import STATE, decode_or_verify
from oea.kernels import NumbaRouter, numba_available

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


def _oea_ids(kwargs: dict[str, Any], k0: int, min_batch: int = 2) -> torch.Tensor:
    """What the rewrite hands SGLang for ``kwargs`` under ``OEA_K0=k0``: OEA's ids with distinct fillers."""
    spec = plugin.router_spec_from_topk_config(kwargs["topk_config"], kwargs["router_logits"].shape[1])
    ids, weights = oea.route(kwargs["router_logits"], spec, oea.OEAConfig(k0, min_batch=min_batch))
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


# -- fillers.py: distinct fillers, the filler mask, the routed-experts capture ---------------------------------------

Fillers = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BOTH = pytest.mark.parametrize("fillers", [distinct_fillers, distinct_fillers_on_host], ids=["torch", "host"])
CPU, CUDA, META = torch.device("cpu"), torch.device("cuda"), torch.device("meta")


def _tril(k: int) -> list[list[bool]]:
    return [[i < j for i in range(k)] for j in range(k)]


@BOTH
def test_a_call_without_rows_or_of_a_top_1_router_returns_its_own_tensors(fillers: Fillers) -> None:
    """Nothing to rename: an idle batch (no rows) or one slot per row hands back the very tensors, nothing copied."""
    for ids, weights, k in ((torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, 4), 4),
                            (torch.zeros(0, 5, dtype=torch.int32), torch.zeros(0, 5), 4),
                            (torch.tensor([[3], [3]], dtype=torch.int32), torch.ones(2, 1), 1)):
        new_ids, new_weights = fillers(ids, weights, k, 8)
        assert new_ids is ids and new_weights is weights


@BOTH
def test_an_id_above_the_experts_is_no_expert_of_the_row(fillers: Fillers) -> None:
    """An id past the last expert (as an id of no expert) is renamed where it repeats and frees no candidate."""
    ids = torch.tensor([[11, 11, 1, 1]], dtype=torch.int32)
    assert fillers(ids, torch.ones(1, 4), 4, 8)[0].tolist() == [[11, 0, 1, 2]]


@BOTH
def test_the_last_expert_run_by_another_row_comes_before_every_expert_nobody_runs(fillers: Fillers) -> None:
    ids = torch.tensor([[16, 16, 10, 11, 15], [15, 15, 15, 15, 15]])
    assert fillers(ids, torch.ones(2, 5), 5, 17)[0].tolist() == [[16, 0, 10, 11, 15], [15, 10, 11, 16, 0]]


@BOTH
def test_more_slots_than_experts_still_name_only_experts(fillers: Fillers) -> None:
    """k above N (no row can hold k distinct experts): the slots left without a free expert still name a real
    expert (the last candidate), never an index past the experts."""
    ids, weights = torch.tensor([[0, 0, 0]], dtype=torch.int32), torch.tensor([[1.0, 0, 0]])
    new_ids, new_weights = fillers(ids, weights, 3, 2)
    assert new_ids.tolist() == [[0, 1, 1]] and new_weights.tolist() == [[1.0, 0, 0]]


def test_the_ids_keep_their_dtype_without_appended_columns() -> None:
    ids = torch.tensor([[2, 2, 2, 2], [1, 2, 3, 4]], dtype=torch.int32)
    new_ids, _ = distinct_fillers(ids, torch.ones(2, 4), 4, 8)
    assert new_ids.dtype == torch.int32 and new_ids.tolist() == [[2, 1, 3, 4], [1, 2, 3, 4]]


@BOTH
def test_ids_and_weights_each_keep_their_own_width(fillers: Fillers) -> None:
    """Appended columns on only one of the two tensors: each comes back as wide as it was given."""
    ids, weights = torch.tensor([[5, 5, 5, 7]]), torch.tensor([[1.0, 0, 0]])
    new_ids, new_weights = fillers(ids, weights, 3, 8)
    assert new_ids.tolist() == [[5, 0, 1, 7]] and new_weights.tolist() == [[1.0, 0, 0]]
    ids, weights = torch.tensor([[5, 5, 5]]), torch.tensor([[1.0, 0, 0, 1.0]])
    new_ids, new_weights = fillers(ids, weights, 3, 8)
    assert new_ids.tolist() == [[5, 0, 1]] and new_weights.tolist() == [[1.0, 0, 0, 1.0]]


def test_the_filler_mask_a_caller_keeps_is_the_one_read() -> None:
    """``earlier`` (the layer's kept mask) decides which slots repeat: it is used, not remade per call, and the
    module's own cache is left alone."""
    ids, weights = torch.tensor([[4, 4, 4]]), torch.tensor([[1.0, 0, 0]])
    only_slot_1 = torch.tensor([[False] * 3, [True, False, False], [False] * 3])  # slot 2 is never a repeat
    assert distinct_fillers(ids, weights, 3, 8, only_slot_1)[0].tolist() == [[4, 0, 4]]
    assert distinct_fillers_on_host(ids, weights, 3, 8, only_slot_1.numpy())[0].tolist() == [[4, 0, 4]]


def test_a_mask_made_for_a_caller_without_one_is_kept_per_k_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fillers_module, "_EARLIER", {})
    mask = fillers_module._earlier(3, CPU)
    assert mask.dtype == torch.bool and mask.device == CPU and mask.tolist() == _tril(3)
    assert fillers_module._earlier(3, CPU) is mask, "made once"
    on_meta = fillers_module._earlier(3, META)  # another device (meta stands in for an accelerator)
    assert on_meta.device == META and on_meta.shape == (3, 3) and fillers_module._earlier(3, CPU) is mask
    assert fillers_module._earlier(4, CPU).tolist() == _tril(4)
    assert sorted(fillers_module._EARLIER) == [(3, "cpu"), (3, "meta"), (4, "cpu")]
    assert distinct_fillers(torch.tensor([[6, 6, 6]]), torch.ones(1, 3), 3, 8)[0].tolist() == [[6, 0, 1]]
    assert earlier_mask(3, CPU).tolist() == _tril(3) and earlier_mask(3, META).device == META


def test_the_fillers_run_on_the_ids_device() -> None:
    ids = torch.tensor([[7, 1, 2, 3], [1, 1, 1, 1]], dtype=torch.int32, device=META)
    new_ids, new_weights = distinct_fillers(ids, torch.ones(2, 4, device=META), 4, 8)
    assert (new_ids.device, new_ids.dtype, new_ids.shape) == (META, torch.int32, (2, 4))
    assert new_weights.device == META


def test_no_mask_is_kept_from_a_compiled_region(monkeypatch: pytest.MonkeyPatch) -> None:
    """While Dynamo traces (a stand-in ``is_compiling``), ``earlier_mask`` gives none to keep and a mask made for
    the call stays out of the cache."""
    monkeypatch.setattr(fillers_module, "_EARLIER", {})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert earlier_mask(3, CPU) is None
    assert fillers_module._earlier(3, CPU).tolist() == _tril(3) and fillers_module._EARLIER == {}


def test_no_mask_is_kept_from_a_cuda_graph_capture_of_that_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a CUDA stream captures (stand-ins for ``torch.cuda``), a CUDA mask is not kept; a CPU mask is no
    graph's and is kept; a CUDA device outside capture may keep one."""
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert earlier_mask(3, CUDA) is None
    assert earlier_mask(3, CPU).tolist() == _tril(3)
    capturing[0] = False
    assert fillers_module._tracing_or_capturing(CUDA) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capturing[0] = True
    assert fillers_module._tracing_or_capturing(CUDA) is False, "no CUDA: nothing captures"


class _Capturer:
    """SGLang's routed-experts capturer: ``capture(layer_id, topk_indices, ...)``, keyword or positional."""

    def __init__(self) -> None:
        self.captured: list[tuple[Any, ...]] = []

    def capture(self, layer_id: int, topk_indices: torch.Tensor, *rest: Any) -> None:
        self.captured.append((layer_id, topk_indices.clone(), *rest))


def _capturer_module(monkeypatch: pytest.MonkeyPatch, **attributes: Any) -> None:
    module = types.ModuleType(fillers_module.CAPTURER_MODULE)
    for name, value in attributes.items():
        setattr(module, name, value)
    monkeypatch.setitem(sys.modules, fillers_module.CAPTURER_MODULE, module)


def test_a_positional_capture_gets_oea_ids_and_keeps_its_other_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    held = _Capturer()
    _capturer_module(monkeypatch, get_global_experts_capturer=lambda: held)
    kernel, replay = torch.tensor([[3, 0, 1]]), torch.tensor([[3, 3, 3]])
    capture_replay_ids(kernel, replay)
    held.capture(7, kernel)
    capture_replay_ids(kernel, replay)
    held.capture(8, kernel, "extra")
    assert [(c[0], c[1].tolist(), *c[2:]) for c in held.captured] == [(7, [[3, 3, 3]]), (8, [[3, 3, 3]], "extra")]


def test_the_capture_is_wrapped_once_however_many_calls_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rewritten call notes its ids; the capturer is wrapped at the first only (a wrapper per call would nest
    past Python's recursion limit within a thousand decode steps)."""
    held = _Capturer()
    _capturer_module(monkeypatch, get_global_experts_capturer=lambda: held)
    kernel, replay = torch.tensor([[3, 0]]), torch.tensor([[3, 3]])
    capture_replay_ids(kernel, replay)
    wrapped = held.capture
    for _ in range(1200):
        capture_replay_ids(kernel, replay)
    assert held.capture is wrapped
    held.capture(layer_id=0, topk_indices=kernel)
    assert held.captured[0][1].tolist() == [[3, 3]]


def test_a_capturer_module_without_its_getter_captures_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _capturer_module(monkeypatch)  # SGLang imported the module, but this version has no global capturer
    kernel = torch.tensor([[1, 2]])
    capture_replay_ids(kernel, torch.tensor([[1, 1]]))
    assert fillers_module.REPLAY.swap(kernel) is kernel


# -- router_state.py: each layer's RouterState ------------------------------------------------------------------------

def _topk_module_without_flags(monkeypatch: pytest.MonkeyPatch, **attributes: Any) -> types.ModuleType:
    """SGLang's ``topk`` module with only ``attributes`` (an older or newer SGLang lacks the others)."""
    module = stand_in_module(monkeypatch, plugin.TOPK_MODULE)
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def test_the_pass_through_reasons_are_the_shared_names() -> None:
    """Each reason a call keeps SGLang's routing is the name the metrics and the ``oea_*`` series use."""
    names = ("below_min_batch", "k0_covers_top_k", "layer_failed", "oea_off", "verify_not_applied")
    assert names == (BELOW_MIN_BATCH, K0_COVERS_TOP_K, LAYER_FAILED, OEA_OFF, VERIFY_NOT_APPLIED)
    assert [router_state_module._reason(name) for name in names] == list(names)
    with pytest.raises(StopIteration):
        router_state_module._reason("not_a_reason")


@pytest.mark.parametrize(("attributes", "overrides", "why"), [
    (dict(_use_aiter=True), {}, "AMD aiter routing (SGLANG_USE_AITER=1)"),
    (dict(_is_npu=True), {}, "Ascend NPU routing"),
    ({}, dict(allow_routed_experts_capture=False), "speculative draft-model TopK"),
])
def test_a_layer_sglang_routes_its_own_way_keeps_it_saying_why(
        monkeypatch: pytest.MonkeyPatch, attributes: dict[str, Any], overrides: dict[str, Any], why: str) -> None:
    fresh_state(monkeypatch)
    _topk_module_without_flags(monkeypatch, **attributes)
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    state = router_state(0, topk_config(**overrides), 64)
    assert state.spec is None and state.why == why and recorded_spec(state) == why
    with plugin.forward_mode(FakeMode.DECODE):
        assert plugin_routing.post_process_before(**_call(0, topk_config(**overrides))) is None


def test_a_topk_module_and_config_without_the_optional_flags_are_rerouted(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``_use_aiter`` / ``_is_npu`` / fused-scaling function in ``topk`` and no ``allow_routed_experts_capture``
    on the config (SGLang versions without them): an ordinary layer, rerouted."""
    fresh_state(monkeypatch)
    _topk_module_without_flags(monkeypatch)
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    cfg = topk_config(routed_scaling_factor=2.5)  # not folded: nothing says it is
    del cfg.allow_routed_experts_capture
    del cfg.apply_routed_scaling_factor_on_output
    kwargs = _call(0, cfg)
    with plugin.forward_mode(FakeMode.DECODE):
        routed = plugin_routing.post_process_before(**kwargs)
    state = STATE.routers[0]
    assert state.why == "" and recorded_spec(state) is state.spec and state.spec.routed_scaling_factor == 1.0
    assert routed is not None and torch.equal(routed[1]["topk_ids"].long(), _oea_ids(kwargs, 2))


@pytest.mark.parametrize(("module_says", "config_says", "scale"), [
    (True, False, 2.5),  # SGLang's is_routed_scaling_factor_fused_in_topk decides over the config's field
    (False, True, 1.0),
    (None, True, 2.5),  # no such function in topk: the config's apply_routed_scaling_factor_on_output
    (None, False, 1.0),
])
def test_the_layers_scaling_factor_is_folded_as_sglang_says(
        monkeypatch: pytest.MonkeyPatch, module_says: bool | None, config_says: bool, scale: float) -> None:
    fresh_state(monkeypatch)
    fused = {} if module_says is None else dict(is_routed_scaling_factor_fused_in_topk=lambda cfg: module_says)
    _topk_module_without_flags(monkeypatch, **fused)
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    cfg = topk_config(routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=config_says)
    assert router_state(0, cfg, 64).spec.routed_scaling_factor == scale


def test_a_layer_met_before_any_settings_gets_its_spec_and_no_layer_file(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_state(monkeypatch)
    topk_module(monkeypatch)
    state = router_state(3, topk_config(), 64)
    assert state.settings is None and state.spec is not None and state.spec.top_k == 8
    assert state.layers.default is None and state.layer_entry is None and state.missing == ""
    assert router_state(3, state.topk_config, 64) is state


def test_every_layer_reads_the_layer_configs_install_made(sglang: None, tmp_path: Path) -> None:
    path = tmp_path / "k0.json"
    write_layer_k0_file(oea.routing.LayerK0Schedule(num_experts=64, top_k=8, num_layers=1, k0=(1,), layer_ids=(0,)),
                        path)
    install(settings_from_env({"OEA_K0": "3", "OEA_LAYER_K0_FILE": str(path)}))
    installed = STATE.layers
    path.unlink()  # read once, at install
    kwargs = _call(0, topk_config())
    with plugin.forward_mode(FakeMode.DECODE):
        routed = plugin_routing.post_process_before(**kwargs)
    assert STATE.layers is installed and STATE.routers[0].layers is installed
    assert routed is not None and torch.equal(routed[1]["topk_ids"].long(), _oea_ids(kwargs, 1))


def test_a_layers_k0_by_batch_size_follows_each_calls_rows(sglang: None, tmp_path: Path) -> None:
    """A layer file with ``batch_k0``: each call takes the k0 of its own number of rows (and, on CPU, a kernel
    prepared for that k0)."""
    path = tmp_path / "k0.json"
    write_layer_k0_file(oea.routing.LayerK0Schedule(num_experts=64, top_k=8, num_layers=1, k0=(3,), layer_ids=(0,),
                                                    batch_k0=((4, (1,)), (64, (3,)))), path)
    install(settings_from_env({"OEA_K0": "3", "OEA_LAYER_K0_FILE": str(path)}))
    cfg = topk_config()  # the layer's one TopKConfig, as SGLang's
    with plugin.forward_mode(FakeMode.DECODE):
        for rows, k0 in ((3, 1), (8, 3), (4, 1), (8, 3)):
            kwargs = _call(0, cfg, rows=rows, seed=rows)
            routed = plugin_routing.post_process_before(**kwargs)
            assert routed is not None and torch.equal(routed[1]["topk_ids"].long(), _oea_ids(kwargs, k0)), (rows, k0)


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
@pytest.mark.parametrize("first_rows", [0, 1, 6])
def test_a_layers_kernel_is_prepared_once_for_its_config(sglang: None, monkeypatch: pytest.MonkeyPatch,
                                                         first_rows: int) -> None:
    """On CPU a layer plans its numba kernel at its first call with rows (an empty call decides nothing; one row
    is a batch), and its later calls with the same config neither plan again nor dispatch."""
    STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_MIN_BATCH": "1"})
    cfg = topk_config()  # the layer's one TopKConfig, as SGLang's
    with plugin.forward_mode(FakeMode.DECODE):
        plugin_routing.post_process_before(**_call(0, cfg, rows=first_rows, seed=1))
        if first_rows == 0:
            monkeypatch.setattr(plugin_routing, "route_fast", _refused)
            plugin_routing.post_process_before(**_call(0, cfg, rows=1, seed=2))
        state = STATE.routers[0]
        assert isinstance(state.kernel, NumbaRouter)
        monkeypatch.setattr(router_state_module, "plan", _refused)
        monkeypatch.setattr(plugin_routing, "route_fast", _refused)
        for rows in (1, 6):
            kwargs = _call(0, cfg, rows=rows, seed=3 + rows)
            routed = plugin_routing.post_process_before(**kwargs)
            assert routed is not None and torch.equal(routed[1]["topk_ids"].long(), _oea_ids(kwargs, 2, 1))
    assert not state.failed and STATE.routers[0] is state


def _refused(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("planned or dispatched again in a prepared layer's call")


def test_a_cpu_layer_planned_onto_another_kernel_gets_no_numba_kernel(sglang: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan`` choosing the Triton interpreter on CPU (``TRITON_INTERPRET=1`` without numba): no numba kernel is
    built from its parameters; the call routes through ``route_fast``."""
    real_plan = router_state_module.plan
    monkeypatch.setattr(router_state_module, "plan", lambda *a, **k: ("triton", real_plan(*a, **k)[1]))
    kwargs = _call(0, topk_config())
    with plugin.forward_mode(FakeMode.DECODE):
        routed = plugin_routing.post_process_before(**kwargs)
    assert STATE.routers[0].kernel is None and STATE.routers[0].kernel_key is not None
    assert routed is not None and torch.equal(routed[1]["topk_ids"].long(), _oea_ids(kwargs, 2))


def test_a_layers_host_filler_mask_is_viewed_once(sglang: None) -> None:
    """The numpy view of the layer's filler mask (the host fillers' input) is made at the first call that needs it
    and kept: it is the CPU mask's own memory."""
    STATE.settings = settings_from_env({"OEA_K0": "1"})
    with plugin.forward_mode(FakeMode.DECODE):
        kwargs = _call(0, topk_config(), rows=2)  # a union of at most 2 < 8: every row repeats
        routed = plugin_routing.post_process_before(**kwargs)
    assert routed is not None and torch.equal(routed[1]["topk_ids"].long(), _oea_ids(kwargs, 1))
    state = STATE.routers[0]
    view = state.earlier_on_host()
    assert isinstance(view, np.ndarray) and np.shares_memory(view, state.earlier.numpy())
    assert view.tolist() == _tril(8) and state.earlier_on_host() is view and state.earlier_host is view
