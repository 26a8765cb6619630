"""What the generated mutants of ``oea/integrations/sglang/hooks.py`` and ``routing.py`` (its part at the end) found
unguarded (docs/testing.md, "Generated mutants"), driven through the stand-in SGLang layouts of
``test_sglang_decode_detection`` (``fake_sglang``: each version's ``forward_context``, ``ModelRunner.forward`` and
graph runners, routing through ``select_experts`` -> ``_post_process_topk_ids``) and the registered plugin of
``test_sglang_metrics_rows`` (``start``); ``targets.py`` at the very end.

Decode detection: SGLang 0.5.23's ``forward_context`` still gets the batch it was given, and a batch without a
``forward_mode`` keeps SGLang's routing without raising; ``ModelRunner.forward(forward_batch=...)`` by keyword is
rerouted in decode; a graph capture called with keywords gets them, one whose runner has no
``capture_forward_mode`` or is not given positionally keeps SGLang's routing without raising. The first forward's
error when the rewrite hook is missing, word for word. ``has_hook``: the hook found down a ``__wrapped__`` chain
(another wrapper over OEA's), behind an empty closure cell, on the 32nd function and not further (a cycle ends),
and on a builtin (no ``__closure__``). ``target_hooked``: a target that cannot be resolved or is not wrapped is not
hooked; the legacy AROUND rewrite of ``select_experts`` (no ``_post_process_topk_ids``) counts as hooked.
``hooks_status``: every planned target before installation, each one's real state after."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import types
from collections import namedtuple
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import test_sglang_metrics_rows as metrics_rows
import torch
from sglang_stand_ins import FakeMode, fresh_state, stand_in_module, topk_config, topk_module
from test_sglang_decode_detection import ROWS, _expected, _logits, _route_through, fake_sglang

import oea
import oea.integrations.sglang.hooks as plugin_hooks
import oea.integrations.sglang.metrics as sglang_metrics
import oea.integrations.sglang.routing as plugin_routing
import oea.integrations.sglang.targets as sglang_targets
from oea.config import settings_from_env, write_layer_k0_file
from oea.integrations import sglang as plugin
from oea.integrations.sglang.fillers import distinct_fillers
from oea.integrations.sglang.router_state import BELOW_MIN_BATCH
from oea.integrations.sglang.routing import select_experts_around_legacy, select_experts_before
from oea.integrations.sglang.state import PHASE, STATE
from oea.kernels import NumbaRouter, plan
from oea.routing import splice_routed_columns

torch.set_num_threads(1)
start = metrics_rows.start  # the plugin registered in a stand-in SGLang process (a fixture, found by this name)
LOGGER = "oea.integrations.sglang"


@pytest.fixture(autouse=True)
def fresh_plugin_state(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_state(monkeypatch)


def _install(monkeypatch: pytest.MonkeyPatch, layout: str) -> SimpleNamespace:
    sgl = fake_sglang(monkeypatch, layout)
    plugin.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    return sgl


# -- decode detection: the hooks around forwards and captures ----------------------------------------------------

def test_the_0523_forward_context_still_gets_the_batch_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AROUND hook hands SGLang's ``forward_context`` its ``forward_batch`` keyword (SGLang's own context reads
    the batch: attention metadata, DP gathering)."""
    sgl = _install(monkeypatch, "0.5.23")
    logits = _logits()
    decode = SimpleNamespace(forward_mode=FakeMode.DECODE, logits=logits)
    extend = SimpleNamespace(forward_mode=FakeMode.EXTEND, logits=logits)
    assert torch.equal(sgl.ModelRunner().forward(decode), _expected(logits, 2)[0])
    assert torch.equal(sgl.ModelRunner().forward(extend), _expected(logits, 2)[1])
    assert sgl.entered == [decode, extend]


def test_a_0523_batch_without_a_forward_mode_keeps_sglangs_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    sgl = _install(monkeypatch, "0.5.23")
    logits = _logits()
    batch = SimpleNamespace(logits=logits)  # a batch of an unknown shape
    assert torch.equal(sgl.ModelRunner().forward(batch), _expected(logits, 2)[1])
    assert sgl.entered == [batch] and plugin.current_forward_mode() is None


@pytest.mark.parametrize("layout", ["0.5.12", "0.5.14-0.5.22"])
def test_a_model_runner_forward_given_its_batch_by_keyword_is_rerouted_in_decode(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, layout: str) -> None:
    sgl = _install(monkeypatch, layout)
    logits = _logits()
    oea_ids, vanilla_ids = _expected(logits, 2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        decode = sgl.ModelRunner().forward(forward_batch=SimpleNamespace(forward_mode=FakeMode.DECODE, logits=logits))
        extend = sgl.ModelRunner().forward(forward_batch=SimpleNamespace(forward_mode=FakeMode.EXTEND, logits=logits))
    assert torch.equal(decode, oea_ids) and torch.equal(extend, vanilla_ids)
    assert plugin.rewrite_count() == 1
    assert not [r for r in caplog.records if "forward_mode" in r.getMessage()]  # the batch was seen: no warning


def test_a_graph_capture_called_with_keywords_gets_them_and_is_rerouted_in_decode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sgl = _install(monkeypatch, "0.5.14-0.5.22")
    logits = _logits()
    oea_ids, vanilla_ids = _expected(logits, 2)
    runner = sgl.cuda_runner(FakeMode.DECODE)
    got = runner.capture_one_shape(ROWS, forward=lambda: _route_through(sgl.topk, logits), stream_idx=0)
    assert torch.equal(got, oea_ids)
    got = sgl.CPUGraphRunner(FakeMode.EXTEND).capture_one_batch_size(
        bs=ROWS, forward=lambda: _route_through(sgl.topk, logits), skip_cross_attention=True)
    assert torch.equal(got, vanilla_ids)
    assert plugin.current_forward_mode() is None


def test_a_capture_whose_runner_is_not_given_positionally_runs_with_sglangs_routing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``DecodeCudaGraphRunner.capture_one_shape(self=runner, ...)``: the hook cannot see the runner; the capture
    still runs (nothing raises into SGLang), with SGLang's routing."""
    sgl = _install(monkeypatch, "0.5.14-0.5.22")
    logits = _logits()
    got = sgl.cuda_runner.capture_one_shape(self=sgl.cuda_runner(FakeMode.DECODE), size=ROWS,
                                            forward=lambda: _route_through(sgl.topk, logits))
    assert torch.equal(got, _expected(logits, 2)[1])
    assert plugin.current_forward_mode() is None


def test_a_capture_by_a_runner_without_a_capture_mode_keeps_sglangs_routing() -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    STATE.phase_hook_seen = True
    seen: list[Any] = []

    def capture(runner: Any, bs: int, forward: Any) -> str:
        seen.append((runner, bs, forward, plugin.current_forward_mode(), plugin.decode_active()))
        return "graph"

    runner = SimpleNamespace(num_tokens_per_bs=1, device="cpu")  # no capture_forward_mode
    assert plugin_hooks._graph_capture_around(capture, runner, 4, "fwd") == "graph"
    assert seen == [(runner, 4, "fwd", None, False)]
    assert plugin.current_forward_mode() is None


# -- the first forward: the rewrite hook missing -------------------------------------------------------------------

def test_a_missing_rewrite_hook_is_one_error_naming_the_target_and_the_supported_versions(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(plugin_hooks, "target_hooked", lambda target: target != plugin.POST_PROCESS_TARGET)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        for _ in range(2):
            with plugin_hooks._forward_context_around(lambda ctx, forward_batch=None: contextlib.nullcontext(), None):
                pass
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"oea: OEA_K0 is set but the routing hook is not installed on ['{plugin.POST_PROCESS_TARGET}']; "
                      f"serving WITHOUT OEA (supported SGLang versions: {plugin.SUPPORTED_VERSIONS}; "
                      "run `oea doctor sglang`)"]


# -- has_hook ----------------------------------------------------------------------------------------------------

def _hook(*args: Any, **kwargs: Any) -> None:
    return None


def _holding(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper whose closure holds ``hook`` (as SGLang's ``HookRegistry`` and ``plugin._patch`` make them)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(*args, **kwargs)
    return wrapper


def _chain(depth: int) -> Callable[..., Any]:
    """``depth`` plain wrappers (``functools.wraps``: each one's ``__wrapped__`` the next) over ``_holding(_hook)``:
    the hook's wrapper is the ``depth + 1``-th function of the chain."""
    fn = _holding(_hook)
    for _ in range(depth):
        inner = fn

        @functools.wraps(inner)
        def outer(*args: Any, __inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            return __inner(*args, **kwargs)

        fn = outer
    return fn


def test_a_hook_under_another_wrapper_is_found() -> None:
    """Another plugin (or SGLang) wrapping OEA's wrapper with ``functools.wraps``: the hook one ``__wrapped__`` down."""
    assert plugin_hooks.has_hook(_chain(1), _hook)
    assert plugin_hooks.has_hook(_chain(2), _hook)
    assert not plugin_hooks.has_hook(_chain(2), _holding)


def test_a_hook_is_looked_for_down_32_functions_of_a_chain_and_no_further() -> None:
    assert plugin_hooks.has_hook(_chain(31), _hook)  # the 32nd function
    assert not plugin_hooks.has_hook(_chain(32), _hook)  # the 33rd


class _Looping:
    """A wrapper whose ``__wrapped__`` is itself (a cycle), counting the reads (and failing past 100, so a
    ``has_hook`` that would loop for ever fails at once)."""

    __closure__ = None

    def __init__(self) -> None:
        self.reads = 0

    @property
    def __wrapped__(self) -> _Looping:
        self.reads += 1
        assert self.reads <= 100, "has_hook follows a looping chain for ever"
        return self


def test_a_wrapper_chain_that_loops_ends_after_32_functions() -> None:
    looping = _Looping()
    assert not plugin_hooks.has_hook(looping, _hook)
    assert looping.reads == 32


def test_a_hook_behind_an_empty_closure_cell_is_found() -> None:
    def cells() -> Callable[..., Any]:
        a = b = None

        def f() -> Any:
            return a, b
        return f

    code = cells().__code__
    assert code.co_freevars == ("a", "b")
    fn = types.FunctionType(code, {}, "f", None, (types.CellType(), types.CellType(_hook)))
    assert plugin_hooks.has_hook(fn, _hook)
    assert not plugin_hooks.has_hook(types.FunctionType(code, {}, "f", None, (types.CellType(), types.CellType())),
                                     _hook)


def test_a_builtin_or_a_callable_object_has_no_hook_and_does_not_raise() -> None:
    assert not plugin_hooks.has_hook(len, _hook)
    callable_object = SimpleNamespace(__wrapped__=_holding(_hook))  # no __closure__ of its own
    assert plugin_hooks.has_hook(callable_object, _hook)


# -- target_hooked and hooks_status --------------------------------------------------------------------------------

def test_targets_that_cannot_be_resolved_are_not_hooked(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sglang(monkeypatch, "0.5.12")  # no forward_context module
    del sys.modules[plugin.TOPK_MODULE]._post_process_topk_ids  # an SGLang without it
    assert not plugin.target_hooked(plugin.FORWARD_CONTEXT_TARGET)  # ImportError
    assert not plugin.target_hooked(plugin.POST_PROCESS_TARGET)  # AttributeError
    assert not plugin.target_hooked("oea.not.a.target")


def test_select_experts_unwrapped_is_not_hooked_and_wrapped_is(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sglang(monkeypatch, "0.5.14-0.5.22")
    assert not plugin.target_hooked(plugin.SELECT_EXPERTS_TARGET)
    plugin.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    assert plugin.target_hooked(plugin.SELECT_EXPERTS_TARGET)
    assert plugin_hooks.has_hook(sys.modules[plugin.TOPK_MODULE].select_experts, select_experts_before)


def test_the_legacy_select_experts_rewrite_counts_as_hooked(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang without ``_post_process_topk_ids`` (0.5.9, ``python -m oea.launch.sglang``): ``select_experts`` gets
    the AROUND rewrite of its output instead of the BEFORE hook, and is reported hooked."""
    for parent in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe"):
        stand_in_module(monkeypatch, parent)
    topk = topk_module(monkeypatch)
    output = namedtuple("StandardTopKOutput", "topk_weights topk_ids router_logits")

    def select_experts(hidden_states: Any, router_logits: torch.Tensor, topk_config: Any, *, layer_id: Any = None,
                       num_token_non_padded: Any = None, expert_location_dispatch_info: Any = None) -> Any:
        ids, weights = oea.route(router_logits, oea.RouterSpec(router_logits.shape[1], topk_config.top_k))
        return output(weights, ids.int(), router_logits)

    topk.select_experts = select_experts
    assert not plugin.target_hooked(plugin.SELECT_EXPERTS_TARGET)
    assert plugin.SELECT_EXPERTS_TARGET in plugin.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    assert plugin_hooks.has_hook(topk.select_experts, select_experts_around_legacy)
    assert plugin.target_hooked(plugin.SELECT_EXPERTS_TARGET)
    assert not plugin.target_hooked(plugin.POST_PROCESS_TARGET)
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    with plugin.forward_mode(FakeMode.DECODE):  # and it rewrites
        got = topk.select_experts(torch.zeros(6, 4), logits, topk_config(), layer_id=0)
    assert torch.equal(got.topk_ids.long(), oea.route(logits, oea.RouterSpec(64, 8), oea.OEAConfig(2))[0])


def test_hooks_status_lists_every_planned_target_before_install_and_each_ones_state_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sglang(monkeypatch, "0.5.14-0.5.22")
    planned = [plugin.MODEL_RUNNER_FORWARD_TARGET, plugin.DECODE_GRAPH_CAPTURE_TARGET, plugin.CPU_GRAPH_CAPTURE_TARGET,
               plugin.SELECT_EXPERTS_TARGET, plugin.POST_PROCESS_TARGET]
    assert plugin.hooks_status() == dict.fromkeys(planned, False)
    plugin.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    assert plugin.hooks_status() == dict.fromkeys(planned, True)


# == oea/integrations/sglang/routing.py ===========================================================================
# The routing hook: the first call's check that a forward-mode hook ran, the words of each pass-through warning
# and one warning per reason / layer / error type, a call that raises before its layer is known, a call while
# Dynamo compiles (stand-in ``torch.compiler.is_compiling``: ``oea.route`` and the graph-safe fillers, not counted,
# no numba kernel), the eager host check at exactly OEA_MIN_BATCH real rows, a rewrite with the layer's kernel on
# ids of another dtype, the metrics path (its routing time, the call arguments it hands back, a positional call),
# the recording's warnings, and the legacy AROUND rewrite of ``select_experts`` (0.5.9).

@pytest.fixture
def topk(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.setattr(PHASE, "dynamic_bias", False)
    return topk_module(monkeypatch)


def _call(rows: int = 6, layer_id: Any = 0, seed: int = 5, cfg: Any = None, non_padded: Any = None,
          id_dtype: torch.dtype = torch.int32) -> dict[str, Any]:
    """``_post_process_topk_ids``' keyword arguments for one call: SGLang's top-8 of ``rows`` rows of 64 experts."""
    logits = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)) * 2.0
    ids, weights = oea.route(logits, oea.RouterSpec(64, 8))
    return dict(topk_ids=ids.to(id_dtype), topk_weights=weights, topk_config=cfg or topk_config(),
                router_logits=logits, layer_id=layer_id, num_token_non_padded=non_padded,
                expert_location_dispatch_info=None)


def _served(kwargs: dict[str, Any], k0: int, real: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the plugin hands SGLang: OEA over the real rows, SGLang's padding rows, fillers renamed."""
    spec = oea.RouterSpec(64, 8)
    logits = kwargs["router_logits"]
    valid = None if real is None else torch.arange(logits.shape[0]) < real
    ids, weights = oea.route(logits, spec, oea.OEAConfig(k0, min_batch=1), valid)
    ids, weights = splice_routed_columns(kwargs["topk_ids"], kwargs["topk_weights"], ids, weights, valid)
    return distinct_fillers(ids, weights, 8, 64)


def _messages(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


NO_PHASE = "oea: no forward-mode hook has run yet; routing calls outside a decode forward keep SGLang's routing"


def test_a_routing_call_before_any_forward_mode_hook_warns_once(topk: types.ModuleType,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        for _ in range(2):
            plugin_routing.post_process_before(**_call())
    assert _messages(caplog).count(NO_PHASE) == 1


def test_no_phase_warning_after_a_forward_mode_hook_ran(topk: types.ModuleType,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    STATE.phase_hook_seen = True
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        assert plugin_routing.post_process_before(**_call()) is not None
    assert NO_PHASE not in _messages(caplog)


def test_the_forward_mode_check_is_made_at_the_first_routing_call_only(topk: types.ModuleType,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A routing call before the plugin is configured (no settings) is the check: nothing to say then, nor later."""
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        assert plugin_routing.post_process_before(**_call()) is None
        STATE.settings = settings_from_env({"OEA_K0": "2"})
        assert plugin_routing.post_process_before(**_call()) is not None
    assert NO_PHASE not in _messages(caplog)


def test_dynamic_bias_passes_through_with_its_words(topk: types.ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    STATE.phase_hook_seen = True
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        plugin_routing.select_experts_before(dynamic_expert_bias=torch.zeros(6, 64))
        assert plugin_routing.post_process_before(**_call()) is None
    assert _messages(caplog) == ["oea: per-token dynamic_expert_bias routing (Bailing/Ling) passes through"]


def test_calls_that_raise_before_their_layer_is_known_pass_through_each_error_warned(
        topk: types.ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    """No router logits (KeyError), logits that are None (AttributeError), in layer 4 then 5: each passes through,
    each (error type, layer) warned once with its traceback, and nothing raises into SGLang's forward; the
    recording (off) says nothing."""
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    STATE.phase_hook_seen = True
    call = _call(layer_id=4)
    del call["router_logits"]
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        for _ in range(2):
            assert plugin_routing.post_process_before(**call) is None
            assert plugin_routing.post_process_before(**{**call, "router_logits": None}) is None
            assert plugin_routing.post_process_before(**{**call, "layer_id": 5}) is None
    failures = [r for r in caplog.records if "rewrite failed" in r.getMessage()]
    assert [r.getMessage() for r in failures] == ["oea: routing rewrite failed on layer 4; passing through"] * 2 + [
        "oea: routing rewrite failed on layer 5; passing through"]
    assert [r.exc_info[0] for r in failures] == [KeyError, AttributeError, KeyError]
    assert not [m for m in _messages(caplog) if "recording failed" in m]
    with plugin.forward_mode(FakeMode.DECODE):  # the layer is not marked failed: a good call is rewritten
        assert plugin_routing.post_process_before(**_call(layer_id=4)) is not None


def test_each_unsupported_call_shape_is_warned_once_in_its_words(topk: types.ModuleType,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    STATE.phase_hook_seen = True
    narrow = _call(layer_id=3)
    narrow["topk_ids"], narrow["topk_weights"] = narrow["topk_ids"][:, :4], narrow["topk_weights"][:, :4]
    short = _call(layer_id=3)
    short["topk_ids"], short["topk_weights"] = short["topk_ids"][:5], short["topk_weights"][:5]
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        for _ in range(2):
            assert plugin_routing.post_process_before(**narrow) is None
            assert plugin_routing.post_process_before(**short) is None
    assert _messages(caplog) == [
        "oea: layer 3 keeps the engine's own routing: top-k output (6, 4) does not match router_logits (6, 64) and "
        "top_k=8",
        "oea: layer 3 keeps the engine's own routing: top-k output (5, 8) does not match router_logits (6, 64) and "
        "top_k=8"]


def test_layers_oea_cannot_rebuild_are_warned_once_per_routing_in_their_words(
        topk: types.ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    STATE.phase_hook_seen = True
    sqrt = topk_config(scoring_func="sqrtsoftplus")
    biased = topk_config(correction_bias=torch.zeros(64))
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        for layer in (1, 2):
            assert plugin_routing.post_process_before(**_call(layer_id=layer, cfg=sqrt)) is None
            assert plugin_routing.post_process_before(**_call(layer_id=layer + 10, cfg=biased)) is None
    messages = _messages(caplog)
    assert len(messages) == 2
    assert messages[0].startswith("oea: layer 1 keeps the engine's own routing: ") and "sqrtsoftplus" in messages[0]
    assert messages[1].startswith("oea: layer 11 keeps the engine's own routing: ") and \
        "correction_bias with scoring_func='softmax'" in messages[1]
    assert all(m.endswith(" (further layers with this routing: silently)") for m in messages)


def test_each_layer_missing_from_the_layer_file_is_warned_once_naming_it(
        topk: types.ModuleType, caplog: pytest.LogCaptureFixture, tmp_path: Any) -> None:
    path = tmp_path / "k0.json"
    write_layer_k0_file(oea.routing.LayerK0Schedule(num_experts=64, top_k=8, num_layers=1, k0=(1,), layer_ids=(5,)),
                        path)
    STATE.settings = settings_from_env({"OEA_K0": "3", "OEA_LAYER_K0_FILE": str(path)})
    STATE.phase_hook_seen = True
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        for _ in range(2):
            for layer in (7, 8):
                assert plugin_routing.post_process_before(**_call(layer_id=layer)) is None
    assert _messages(caplog) == [f"oea: layer {layer} keeps the engine's own routing: OEA_LAYER_K0_FILE="
                                 f"{str(path)!r}: MoE layer {layer} is not in the file (its layer_ids are [5])"
                                 for layer in (7, 8)]


def test_a_call_while_dynamo_compiles_routes_with_oea_route_and_the_graph_safe_fillers(
        topk: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``torch.compile`` (stand-in): ``oea.route`` over the real rows, the torch fillers, no numba kernel
    prepared, and the rewrite not counted (a counter Dynamo traced would be a recompiling guard)."""
    STATE.settings = settings_from_env({"OEA_K0": "1", "OEA_MIN_BATCH": "1"})
    STATE.phase_hook_seen = True
    call = _call(rows=4, layer_id=2, non_padded=torch.tensor(3))
    expected = _served(call, 1, real=3)
    assert not torch.equal(expected[0], _served(call, 1)[0])  # the padding row would change the union
    assert not torch.equal(expected[0], oea.route(call["router_logits"], oea.RouterSpec(64, 8),
                                                  oea.OEAConfig(1, min_batch=1), torch.arange(4) < 3)[0])  # renamed
    with monkeypatch.context() as compiling, plugin.forward_mode(FakeMode.DECODE):
        compiling.setattr(torch.compiler, "is_compiling", lambda: True)
        _, new = plugin_routing.post_process_before(**call)
    assert torch.equal(new["topk_ids"], expected[0]) and torch.equal(new["topk_weights"], expected[1])
    assert plugin.rewrite_count() == 0
    assert STATE.routers[2].kernel is None


@pytest.mark.parametrize("real", [4, 3])
def test_an_eager_call_with_exactly_min_batch_real_rows_is_rewritten(topk: types.ModuleType, real: int) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_MIN_BATCH": "4"})
    STATE.phase_hook_seen = True
    call = _call(rows=6, non_padded=torch.tensor(real))
    with plugin.forward_mode(FakeMode.DECODE):
        changed, why = plugin_routing._rewrite((), call)
    if real == 4:
        assert why is None and changed is not None
        assert torch.equal(changed[1]["topk_ids"][:4], _served(call, 2, real=4)[0][:4])
    else:
        assert (changed, why) == (None, BELOW_MIN_BATCH)  # the reason the metrics give


def test_two_rewrites_are_counted_two(topk: types.ModuleType) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    STATE.phase_hook_seen = True
    with plugin.forward_mode(FakeMode.DECODE):
        for _ in range(2):
            assert plugin_routing.post_process_before(**_call()) is not None
    assert plugin.rewrite_count() == 2


def test_the_host_fillers_get_the_layers_kept_mask(topk: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager CPU call whose rows repeat fillers (a union under 8 experts, padding given: the general path):
    renamed on the host with the layer's mask, viewed once, not one made per call."""
    STATE.settings = settings_from_env({"OEA_K0": "1", "OEA_MIN_BATCH": "1"})
    STATE.phase_hook_seen = True
    masks: list[Any] = []
    host = plugin_routing.distinct_fillers_on_host

    def spied(*args: Any) -> Any:
        masks.append(args[4] if len(args) > 4 else None)
        return host(*args)

    monkeypatch.setattr(plugin_routing, "distinct_fillers_on_host", spied)
    call = _call(rows=3, layer_id=6, non_padded=torch.tensor(3))
    with plugin.forward_mode(FakeMode.DECODE):
        _, new = plugin_routing.post_process_before(**call)
    assert masks and masks[0] is not None
    assert torch.equal(new["topk_ids"], _served(call, 1, real=3)[0])


def test_rewrite_topk_with_the_layers_kernel_on_ids_of_another_dtype(topk: types.ModuleType) -> None:
    """``rewrite_topk`` given the numba kernel and int16 ids (not SGLang's int32 / int64): the kernel's own call
    over the real rows, spliced and cast back; the same as without the kernel."""
    spec = oea.RouterSpec(64, 8)
    cfg = oea.OEAConfig(2, min_batch=1)
    call = _call(rows=6, id_dtype=torch.int16)
    impl, params = plan(call["router_logits"], spec, cfg)
    assert impl == "numba" and params is not None
    kernel = NumbaRouter(params, spec.correction_bias, spec.num_experts)
    got = plugin.rewrite_topk(call["topk_ids"], call["topk_weights"], call["router_logits"], spec, cfg,
                              torch.tensor(4), kernel=kernel)
    want = plugin.rewrite_topk(call["topk_ids"], call["topk_weights"], call["router_logits"], spec, cfg,
                               torch.tensor(4))
    assert got is not None and want is not None
    assert got[0].dtype == torch.int16 and torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], atol=1e-6)
    assert torch.equal(got[0][4:], call["topk_ids"][4:])
    everything = plugin.rewrite_topk(call["topk_ids"], call["topk_weights"], call["router_logits"], spec, cfg)
    assert not torch.equal(everything[0][:4], got[0][:4])  # the padding rows would change the union


# -- the metrics path ----------------------------------------------------------------------------------------------

def test_with_metrics_a_rewritten_call_hands_sglang_its_own_arguments_and_its_routing_time(
        start: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server = start(OEA_K0="2")
    times = iter([10.0, 10.25])
    monkeypatch.setattr(plugin_routing, "time", SimpleNamespace(perf_counter=lambda: next(times)))
    seen: list[float] = []
    monkeypatch.setattr(sglang_metrics, "layer_routed", lambda kwargs, result, us, why=None: seen.append(us))
    call = _call(rows=4)
    with server.forward(FakeMode.DECODE, 4):
        args, new = server.hooks[plugin.POST_PROCESS_TARGET](**call)
    assert args == () and torch.equal(new["topk_ids"], _served(call, 2)[0])
    assert seen == [250000.0]


def test_with_metrics_a_positional_call_passes_through_with_its_one_warning(
        start: Any, caplog: pytest.LogCaptureFixture) -> None:
    server = start(OEA_K0="2")
    call = _call(rows=4)
    positional = (call["topk_ids"], call["topk_weights"], call["topk_config"], call["router_logits"], 0, None)
    with caplog.at_level(logging.WARNING, logger=LOGGER), server.forward(FakeMode.DECODE, 4):
        for _ in range(2):
            assert server.hooks[plugin.POST_PROCESS_TARGET](*positional) is None
    messages = _messages(caplog)
    assert [m for m in messages if "positionally" in m] == [
        f"oea: {plugin.POST_PROCESS_TARGET} called positionally (unsupported SGLang version {plugin.engine_version()}; "
        f"supported: {plugin.SUPPORTED_VERSIONS}); passing through"]
    assert not [m for m in messages if "metrics" in m]


# -- the recording --------------------------------------------------------------------------------------------------

def test_recording_failures_warn_once_per_error_type_in_their_words(
        start: Any, caplog: pytest.LogCaptureFixture, tmp_path: Any) -> None:
    server = start(OEA_TRACE_FILE=str(tmp_path / "trace.safetensors"))
    call = _call(rows=4)
    no_config = {k: v for k, v in call.items() if k != "topk_config"}
    with caplog.at_level(logging.WARNING, logger=LOGGER), server.forward(FakeMode.DECODE, 4):
        for _ in range(2):
            server.hooks[plugin.POST_PROCESS_TARGET](**no_config)
            server.hooks[plugin.POST_PROCESS_TARGET](**{**call, "router_logits": None})
    assert [m for m in _messages(caplog) if "recording failed" in m] == [
        "oea: recording failed (KeyError: 'topk_config'); routing goes on",
        "oea: recording failed (AttributeError: 'NoneType' object has no attribute 'shape'); routing goes on"]


def test_a_layer_routed_with_a_dynamic_bias_is_not_recorded_saying_why(
        start: Any, caplog: pytest.LogCaptureFixture, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PHASE, "dynamic_bias", False)
    server = start(OEA_TRACE_FILE=str(tmp_path / "trace.safetensors"))
    with caplog.at_level(logging.WARNING, logger=LOGGER), server.forward(FakeMode.DECODE, 4):
        server.hooks[plugin.SELECT_EXPERTS_TARGET](dynamic_expert_bias=torch.zeros(4, 64))
        server.route(0, 4)
    assert "oea: layer 0 is not recorded: per-token dynamic_expert_bias routing" in _messages(caplog)


# -- the legacy AROUND rewrite of select_experts (0.5.9) ----------------------------------------------------------

def test_the_legacy_rewrite_passes_sglang_every_argument_and_uses_the_layers_k0(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for parent in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe"):
        stand_in_module(monkeypatch, parent)
    topk = topk_module(monkeypatch)
    output = namedtuple("StandardTopKOutput", "topk_weights topk_ids router_logits")
    received: list[dict[str, Any]] = []

    def select_experts(hidden_states: Any, router_logits: torch.Tensor, topk_config: Any, *, layer_id: Any = None,
                       num_token_non_padded: Any = None, expert_location_dispatch_info: Any = None) -> Any:
        received.append(dict(topk_config=topk_config, layer_id=layer_id, num_token_non_padded=num_token_non_padded))
        ids, weights = oea.route(router_logits, oea.RouterSpec(router_logits.shape[1], topk_config.top_k))
        return output(weights, ids.int(), router_logits)

    topk.select_experts = select_experts
    path = tmp_path / "k0.json"
    write_layer_k0_file(oea.routing.LayerK0Schedule(num_experts=64, top_k=8, num_layers=1, k0=(1,), layer_ids=(5,)),
                        path)
    plugin.install_without_registry(settings_from_env({"OEA_K0": "3", "OEA_LAYER_K0_FILE": str(path)}))
    STATE.phase_hook_seen = True
    call = _call(rows=6)
    cfg = call["topk_config"]
    with plugin.forward_mode(FakeMode.DECODE):  # the config by keyword: two positional arguments
        got = topk.select_experts(torch.zeros(6, 4), call["router_logits"], topk_config=cfg, layer_id=5)
    assert received == [dict(topk_config=cfg, layer_id=5, num_token_non_padded=None)]
    want_ids, want_weights = distinct_fillers(*oea.route(call["router_logits"], oea.RouterSpec(64, 8),
                                                         oea.OEAConfig(1)), 8, 64)
    assert torch.equal(got.topk_ids.long(), want_ids)
    assert torch.allclose(got.topk_weights, want_weights, atol=1e-6)


# == oea/integrations/sglang/targets.py ===========================================================================
# What of SGLang is there: the version read under SGLang's own distribution name, a module that can or cannot be
# imported, a model-executor module found on disk (a file, a package, nested) without importing it or its parent,
# a forward_context that cannot be read, and one CUDA capture point (the newest) plus the CPU runner's only where
# SGLang ships it.

def test_the_engine_version_is_sglangs_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_targets, "installed_version", {"sglang": "0.5.23"}.get)
    assert plugin.engine_version() == "0.5.23"


def test_module_exists_says_whether_a_module_can_be_imported() -> None:
    assert sglang_targets.module_exists("json")
    assert not sglang_targets.module_exists("oea_no_such_module")
    assert not sglang_targets.module_exists("oea_no_such_module.child")  # its parent is missing


@pytest.fixture
def sglang_on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """An SGLang source tree on ``sys.path`` (not imported): ``model_executor`` with a module file, a nested module
    file and a package; every ``sglang`` module imported meanwhile is dropped after."""
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    executor = tmp_path / "sglang" / "srt" / "model_executor"
    for folder in (tmp_path / "sglang", tmp_path / "sglang" / "srt", executor, executor / "runner",
                   executor / "package_module"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
    (executor / "cpu_graph_runner.py").write_text("")
    (executor / "runner" / "decode_cuda_graph_runner.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield executor
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]


def test_model_executor_modules_are_found_on_disk_without_importing_them(sglang_on_disk: Any) -> None:
    executor = sglang_targets.MODEL_EXECUTOR
    assert sglang_targets.module_available(f"{executor}.cpu_graph_runner")
    assert sglang_targets.module_available(f"{executor}.runner.decode_cuda_graph_runner")
    assert sglang_targets.module_available(f"{executor}.package_module")
    assert not sglang_targets.module_available(f"{executor}.cuda_graph_runner")
    assert not sglang_targets.module_available(f"{executor}.runner.missing")
    assert executor not in sys.modules  # found, not imported: SGLang's model executor is heavy
    assert sglang_targets.module_available("json") and not sglang_targets.module_available("oea_no_such_module")
    assert sglang_targets.graph_capture_targets() == [plugin.DECODE_GRAPH_CAPTURE_TARGET,
                                                      plugin.CPU_GRAPH_CAPTURE_TARGET]


def test_a_forward_context_that_cannot_be_read_is_not_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("sglang", "sglang.srt", sglang_targets.MODEL_EXECUTOR):
        stand_in_module(monkeypatch, name)
    stand_in_module(monkeypatch, sglang_targets.FORWARD_CONTEXT_MODULE)  # without forward_context
    assert not sglang_targets.forward_context_takes_batch()


@pytest.mark.parametrize("legacy", [False, True])
def test_one_cuda_capture_point_the_newest_and_the_cpu_one_only_where_sglang_ships_it(
        monkeypatch: pytest.MonkeyPatch, legacy: bool) -> None:
    for name in ("sglang", "sglang.srt", sglang_targets.MODEL_EXECUTOR, f"{sglang_targets.MODEL_EXECUTOR}.runner"):
        stand_in_module(monkeypatch, name)
    stand_in_module(monkeypatch, sglang_targets.target_module(plugin.GRAPH_CAPTURE_TARGET))
    if not legacy:
        stand_in_module(monkeypatch, sglang_targets.target_module(plugin.DECODE_GRAPH_CAPTURE_TARGET))
    want = plugin.GRAPH_CAPTURE_TARGET if legacy else plugin.DECODE_GRAPH_CAPTURE_TARGET
    assert sglang_targets.graph_capture_targets() == [want]  # no CPU graph runner module
