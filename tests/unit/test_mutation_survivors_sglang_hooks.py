"""What the generated mutants of ``oea/integrations/sglang/hooks.py`` found unguarded (docs/testing.md, "Generated
mutants"), driven through the stand-in SGLang layouts of ``test_sglang_decode_detection`` (``fake_sglang``: each
version's ``forward_context``, ``ModelRunner.forward`` and graph runners, routing through ``select_experts`` ->
``_post_process_topk_ids``).

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
import logging
import sys
import types
from collections import namedtuple
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_stand_ins import FakeMode, fresh_state, stand_in_module, topk_config, topk_module
from test_sglang_decode_detection import ROWS, _expected, _logits, _route_through, fake_sglang

import oea
import oea.integrations.sglang.hooks as plugin_hooks
from oea.config import settings_from_env
from oea.integrations import sglang as plugin
from oea.integrations.sglang.routing import select_experts_around_legacy, select_experts_before
from oea.integrations.sglang.state import STATE

torch.set_num_threads(1)
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
