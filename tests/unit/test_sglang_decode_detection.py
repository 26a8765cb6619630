"""Decode detection of the SGLang plugin on each SGLang layout, with stand-ins for SGLang's modules.

The stand-ins mimic the signatures read from SGLang's released source:

* 0.5.12: no ``forward_context``; ``ModelRunner.forward(self, forward_batch, ...)``;
  ``cuda_graph_runner.CudaGraphRunner.capture_one_batch_size(self, bs, forward, stream_idx=None)``;
* 0.5.13: ``forward_context(ctx)`` (no batch), otherwise as 0.5.12;
* 0.5.14-0.5.22: ``forward_context(ctx)``; ``runner.decode_cuda_graph_runner.DecodeCudaGraphRunner
  .capture_one_shape(self, size, forward, ...)``;
* 0.5.23: ``forward_context(ctx, *, forward_batch=None)``, entered with the batch by every forward and capture.

Every layout has ``cpu_graph_runner.CPUGraphRunner.capture_one_batch_size(self, bs, forward, ...)``. Each
stand-in forward runs the routing through ``topk.select_experts`` -> ``_post_process_topk_ids`` as SGLang does,
so a test sees whether OEA rewrote a decode forward, left an extend forward alone, and baked OEA into a
graph captured for decode.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from collections import namedtuple
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_stand_ins import FakeMode, fresh_state, stand_in_module, topk_config, topk_module

import oea
import oea.integrations.sglang.hooks as plugin_hooks
from oea.config import settings_from_env
from oea.integrations import sglang as plugin
from oea.integrations.sglang import doctor as plugin_doctor
from oea.integrations.sglang import targets as plugin_targets
from oea.integrations.sglang.state import STATE

LAYOUTS = ("0.5.12", "0.5.13", "0.5.14-0.5.22", "0.5.23")
EXECUTOR = "sglang.srt.model_executor"
ROWS, EXPERTS, TOP_K = 8, 64, 8


def _logits(seed: int = 11) -> torch.Tensor:
    return torch.randn(ROWS, EXPERTS, generator=torch.Generator().manual_seed(seed)) * 2.0


def _install_topk(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    topk = topk_module(monkeypatch, fused=lambda cfg: False)
    output = namedtuple("StandardTopKOutput", "topk_weights topk_ids router_logits")

    def _post_process_topk_ids(*, topk_ids, topk_weights, topk_config, router_logits, layer_id,
                               num_token_non_padded, expert_location_dispatch_info=None):
        return topk_ids, topk_weights

    def select_experts(hidden_states, router_logits, topk_config, *, layer_id=None, num_token_non_padded=None):
        ids, weights = oea.route(router_logits, oea.RouterSpec(router_logits.shape[1], topk_config.top_k))
        ids, weights = topk._post_process_topk_ids(  # looked up at call time, as SGLang does
            topk_ids=ids.to(torch.int32), topk_weights=weights, topk_config=topk_config, router_logits=router_logits,
            layer_id=layer_id, num_token_non_padded=num_token_non_padded)
        return output(weights, ids, router_logits)

    topk._post_process_topk_ids = _post_process_topk_ids
    topk.select_experts = select_experts
    return topk


def _route_through(topk: types.ModuleType, logits: torch.Tensor) -> torch.Tensor:
    """One MoE layer's routing as the model runs it: ``select_experts`` with a layer's TopKConfig."""
    config = topk_config(top_k=TOP_K)
    return topk.select_experts(torch.zeros(logits.shape[0], 4), logits, config, layer_id=0).topk_ids.long()


def fake_sglang(monkeypatch: pytest.MonkeyPatch, layout: str) -> SimpleNamespace:
    """Stand-in SGLang modules for ``layout`` (one of ``LAYOUTS``) in ``sys.modules``."""
    for name in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe", EXECUTOR,
                 f"{EXECUTOR}.runner"):
        stand_in_module(monkeypatch, name)
    topk = _install_topk(monkeypatch)
    with_batch = layout == "0.5.23"
    entered: list[Any] = []  # what each forward_context saw (the stand-ins' own view)

    if layout != "0.5.12":
        fc_module = stand_in_module(monkeypatch, plugin_targets.FORWARD_CONTEXT_MODULE)
        if with_batch:
            @contextlib.contextmanager
            def forward_context(ctx: Any, *, forward_batch: Any = None) -> Iterator[None]:
                entered.append(forward_batch)
                yield
        else:
            @contextlib.contextmanager
            def forward_context(ctx: Any) -> Iterator[None]:
                entered.append(None)
                yield
        fc_module.forward_context = forward_context

    def context(batch: Any) -> contextlib.AbstractContextManager[None]:
        fc = sys.modules.get(plugin_targets.FORWARD_CONTEXT_MODULE)
        if fc is None:
            return contextlib.nullcontext()
        return fc.forward_context("ctx", forward_batch=batch) if with_batch else fc.forward_context("ctx")

    class ModelRunner:
        def forward(self, forward_batch: Any, skip_attn_backend_init: bool | None = None,
                    pp_proxy_tensors: Any = None, reinit_attn_backend: bool = False,
                    split_forward_count: int = 1) -> torch.Tensor:
            with context(forward_batch):
                return _route_through(topk, forward_batch.logits)

    stand_in_module(monkeypatch, f"{EXECUTOR}.model_runner").ModelRunner = ModelRunner

    def _capture(runner: Any, rows: int, forward: Any) -> torch.Tensor:
        batch = SimpleNamespace(forward_mode=runner.capture_forward_mode, input_ids=torch.zeros(rows, dtype=torch.long))
        with context(batch):
            return forward()

    class CudaGraphRunner:  # 0.5.12-0.5.13
        def __init__(self, mode: FakeMode) -> None:
            self.capture_forward_mode, self.num_tokens_per_bs, self.device = mode, 1, "cpu"

        def capture_one_batch_size(self, bs: int, forward: Any, stream_idx: int | None = None) -> torch.Tensor:
            return _capture(self, bs, forward)

        def replay_prepare(self, forward_batch: Any, pp_proxy_tensors: Any = None) -> None:
            self.raw_num_token = forward_batch.input_ids.shape[0]

    class DecodeCudaGraphRunner:  # 0.5.14+
        def __init__(self, mode: FakeMode) -> None:
            self.capture_forward_mode, self.captured_req_width, self.device = mode, 1, "cpu"

        def capture_one_shape(self, size: int, forward: Any, stream_idx: int | None = None,
                              variant_label: str | None = None) -> torch.Tensor:
            return _capture(self, size, forward)

        def load_batch(self, forward_batch: Any, **kwargs: Any) -> Any:
            self.raw_num_token = forward_batch.input_ids.shape[0]
            return forward_batch

    class CPUGraphRunner:
        def __init__(self, mode: FakeMode) -> None:
            self.capture_forward_mode, self.num_tokens_per_bs, self.device = mode, 1, "cpu"

        def capture_one_batch_size(self, bs: int, forward: Any, skip_cross_attention: bool = False) -> torch.Tensor:
            return _capture(self, bs, forward)

        def prepare_replay(self, forward_batch: Any) -> Any:
            return forward_batch

    if layout in ("0.5.12", "0.5.13"):
        stand_in_module(monkeypatch, f"{EXECUTOR}.cuda_graph_runner").CudaGraphRunner = CudaGraphRunner
        cuda_runner, capture = CudaGraphRunner, "capture_one_batch_size"
    else:
        stand_in_module(monkeypatch, f"{EXECUTOR}.runner.decode_cuda_graph_runner").DecodeCudaGraphRunner = \
            DecodeCudaGraphRunner
        cuda_runner, capture = DecodeCudaGraphRunner, "capture_one_shape"
    stand_in_module(monkeypatch, f"{EXECUTOR}.cpu_graph_runner").CPUGraphRunner = CPUGraphRunner
    return SimpleNamespace(topk=topk, ModelRunner=ModelRunner, cuda_runner=cuda_runner, capture=capture,
                           CPUGraphRunner=CPUGraphRunner, entered=entered)


@pytest.fixture(autouse=True)
def fresh_plugin_state(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_state(monkeypatch)


def _expected(logits: torch.Tensor, k0: int) -> tuple[torch.Tensor, torch.Tensor]:
    spec = oea.RouterSpec(EXPERTS, TOP_K)
    return oea.route(logits, spec, oea.OEAConfig(k0))[0], oea.route(logits, spec)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_forwards_and_decode_graph_captures_are_rerouted(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """On every layout: an eager DECODE forward and a graph captured for DECODE (CUDA and CPU runner) carry
    OEA's routing; an EXTEND forward and a graph captured for EXTEND keep SGLang's."""
    sgl = fake_sglang(monkeypatch, layout)
    plugin.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    logits = _logits()
    oea_ids, vanilla_ids = _expected(logits, 2)
    assert not torch.equal(oea_ids, vanilla_ids)  # the case tells the two apart

    runner = sgl.ModelRunner()
    assert torch.equal(runner.forward(SimpleNamespace(forward_mode=FakeMode.DECODE, logits=logits)), oea_ids)
    assert torch.equal(runner.forward(forward_batch=SimpleNamespace(forward_mode=FakeMode.EXTEND, logits=logits)),
                       vanilla_ids)
    for runner_class, name in ((sgl.cuda_runner, sgl.capture), (sgl.CPUGraphRunner, "capture_one_batch_size")):
        capture = getattr(runner_class, name)
        assert torch.equal(capture(runner_class(FakeMode.DECODE), ROWS, lambda: _route_through(sgl.topk, logits)),
                           oea_ids), runner_class.__name__
        assert torch.equal(capture(runner_class(FakeMode.EXTEND), ROWS, lambda: _route_through(sgl.topk, logits)),
                           vanilla_ids), runner_class.__name__
    assert torch.equal(_route_through(sgl.topk, logits), vanilla_ids)  # outside any forward: SGLang's routing
    assert plugin.current_forward_mode() is None


@pytest.mark.parametrize(("layout", "expected"), [
    ("0.5.12", [plugin.MODEL_RUNNER_FORWARD_TARGET, plugin.GRAPH_CAPTURE_TARGET, plugin.CPU_GRAPH_CAPTURE_TARGET]),
    ("0.5.13", [plugin.MODEL_RUNNER_FORWARD_TARGET, plugin.GRAPH_CAPTURE_TARGET, plugin.CPU_GRAPH_CAPTURE_TARGET]),
    ("0.5.14-0.5.22", [plugin.MODEL_RUNNER_FORWARD_TARGET, plugin.DECODE_GRAPH_CAPTURE_TARGET,
                       plugin.CPU_GRAPH_CAPTURE_TARGET]),
    ("0.5.23", [plugin.FORWARD_CONTEXT_TARGET]),
])
def test_decode_detection_path_follows_forward_context_signature(monkeypatch: pytest.MonkeyPatch, layout: str,
                                                                 expected: list[str]) -> None:
    fake_sglang(monkeypatch, layout)
    assert [target for target, _ in plugin_hooks.decode_detection()] == expected
    plan = [target for target, _, _ in plugin.hook_plan()]
    assert plan[:len(expected)] == expected
    assert plan[len(expected):len(expected) + 2] == [plugin.SELECT_EXPERTS_TARGET, plugin.POST_PROCESS_TARGET]


def test_batchless_forward_context_is_never_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.5.13-0.5.22: a hook on forward_context(ctx) would never see a batch, so OEA would never engage."""
    sgl = fake_sglang(monkeypatch, "0.5.14-0.5.22")
    plugin.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    assert plugin.FORWARD_CONTEXT_TARGET not in STATE.installed_targets
    assert plugin.target_hooked(plugin.MODEL_RUNNER_FORWARD_TARGET)
    assert plugin.target_hooked(plugin.DECODE_GRAPH_CAPTURE_TARGET)
    sgl.ModelRunner().forward(SimpleNamespace(forward_mode=FakeMode.DECODE, logits=_logits()))
    assert sgl.entered == [None] and plugin.rewrite_count() == 1  # the context saw no batch; OEA still engaged


def test_forward_without_a_mode_passes_through_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    sgl = fake_sglang(monkeypatch, "0.5.14-0.5.22")
    plugin.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    logits = _logits()
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        for _ in range(2):
            ids = sgl.ModelRunner().forward(SimpleNamespace(logits=logits))  # a batch of an unknown shape
    assert torch.equal(ids, _expected(logits, 2)[1])
    warnings = [r.getMessage() for r in caplog.records if "forward_mode" in r.getMessage()]
    assert len(warnings) == 1 and plugin.MODEL_RUNNER_FORWARD_TARGET in warnings[0]


@pytest.mark.parametrize(("layout", "words"), [
    ("0.5.14-0.5.22", ["ModelRunner.forward", "DecodeCudaGraphRunner.capture_one_shape", "without the batch"]),
    ("0.5.12", ["ModelRunner.forward", "CudaGraphRunner.capture_one_batch_size", "no forward_context"]),
    ("0.5.23", ["forward_context", "forward_batch"]),
])
def test_doctor_names_the_live_decode_detection_path(monkeypatch: pytest.MonkeyPatch, layout: str,
                                                     words: list[str]) -> None:
    fake_sglang(monkeypatch, layout)
    monkeypatch.setenv("OEA_K0", "2")
    before = plugin_doctor.check_decode_detection()
    assert "not installed" in before["detail"] and not before["ok"]
    plugin.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    after = plugin_doctor.check_decode_detection()
    assert after["ok"] and "live" in after["detail"], after
    for word in words:
        assert word in after["detail"], (word, after["detail"])
