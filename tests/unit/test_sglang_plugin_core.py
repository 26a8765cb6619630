"""The SGLang plugin's engine-free parts: config translation, the rewrite, decode detection, hooks.

SGLang itself is not needed here (its real code is exercised in tests/engines/test_sglang_*.py);
configs are duck-typed namespaces with TopKConfig's field names.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from property_cases import examples
from sglang_stand_ins import FakeMode, fresh_state, topk_config, topk_module

import oea
import oea.integrations.sglang.hooks as plugin_hooks
import oea.integrations.sglang.plugin as plugin_entry
import oea.integrations.sglang.routing as plugin_routing
from oea.config import settings_from_env, write_layer_k0_file
from oea.integrations import sglang as plugin
from oea.integrations.sglang.fillers import distinct_fillers
from oea.integrations.sglang.state import STATE

torch.set_num_threads(1)
REAL_HOOK_PLAN = plugin.hook_plan


def _close(weights: torch.Tensor, want: torch.Tensor) -> bool:
    """``oea.route_fast``'s promise on weights (the rewrite runs it): within its tolerance, zero where ``want`` is."""
    from oea.kernels import WEIGHT_ATOL, WEIGHT_RTOL

    return bool(torch.equal(weights == 0, want == 0)
                and ((weights - want).abs() <= WEIGHT_RTOL * want.abs() + WEIGHT_ATOL).all())


def glm_config(**overrides: Any) -> SimpleNamespace:
    bias = torch.linspace(0.0, 0.3, 64)
    base = dict(use_grouped_topk=True, num_expert_group=1, topk_group=1, correction_bias=bias,
                scoring_func="sigmoid", routed_scaling_factor=2.5, torch_native=False)
    base.update(overrides)
    return topk_config(**base)


@pytest.fixture(autouse=True)
def fresh_plugin_state(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_state(monkeypatch)


@pytest.fixture
def fake_topk_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    return topk_module(monkeypatch)


# --------------------------------------------------------------------------- translation


def test_softmax_config_translates_to_softmax_spec() -> None:
    spec = plugin.router_spec_from_topk_config(topk_config(renormalize=False), 128)
    assert (spec.num_experts, spec.top_k, spec.scoring, spec.renormalize) == (128, 8, "softmax", False)
    assert spec.correction_bias is None and spec.n_group is None and spec.routed_scaling_factor == 1.0


@pytest.mark.parametrize(("fused", "expected_scale"), [(False, 1.0), (True, 2.5)])
def test_biased_grouped_is_sigmoid_and_scales_only_when_folded(fused: bool, expected_scale: float) -> None:
    cfg = glm_config(scoring_func="softmax", apply_routed_scaling_factor_on_output=fused)  # GLM-4.x quirk
    spec = plugin.router_spec_from_topk_config(cfg, 64)
    assert spec.scoring == "sigmoid" and spec.correction_bias is cfg.correction_bias
    assert (spec.n_group, spec.topk_group) == (1, 1)
    assert spec.routed_scaling_factor == expected_scale


def test_grouped_variant_keeps_groups() -> None:
    spec = plugin.router_spec_from_topk_config(glm_config(num_expert_group=8, topk_group=4), 64)
    assert (spec.n_group, spec.topk_group) == (8, 4) and spec.grouped


@pytest.mark.parametrize("slots_field", ["num_shared_topk_slots", "num_fused_shared_experts"])
def test_shared_slots_are_not_routed(slots_field: str) -> None:
    cfg = glm_config(top_k=9)
    delattr(cfg, "num_shared_topk_slots")
    setattr(cfg, slots_field, 1)
    assert plugin.router_spec_from_topk_config(cfg, 64).top_k == 8


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(custom_routing_function=lambda **kw: None), "custom_routing_function"),
        (dict(scoring_func="sqrtsoftplus"), "sqrtsoftplus"),
        (dict(output_format=SimpleNamespace(name="BYPASSED")), "BYPASSED"),
        (dict(use_grouped_topk=True, num_expert_group=8, topk_group=2), "topk_group=2 < n_group=8"),
        (dict(correction_bias=torch.zeros(64)), "correction_bias with scoring_func='softmax'"),
    ],
)
def test_unsupported_routings_raise(overrides: dict[str, Any], reason: str) -> None:
    with pytest.raises(plugin.UnsupportedRouting, match=reason.replace("(", r"\(").replace(")", r"\)")):
        plugin.router_spec_from_topk_config(topk_config(**overrides), 64)


@pytest.mark.parametrize("missing", [None, 0])
def test_groups_without_topk_group_are_unsupported_naming_the_field(missing: int | None) -> None:
    """A config with num_expert_group but no topk_group (SGLang asserts both) is no RouterSpec error."""
    for cfg in (glm_config(num_expert_group=8, topk_group=missing),
                topk_config(use_grouped_topk=True, num_expert_group=8, topk_group=missing)):
        with pytest.raises(plugin.UnsupportedRouting, match="num_expert_group=8 without topk_group"):
            plugin.router_spec_from_topk_config(cfg, 64)
    one_group = plugin.router_spec_from_topk_config(glm_config(num_expert_group=1, topk_group=missing), 64)
    assert one_group.n_group is None and not one_group.grouped  # one group limits nothing


def test_groups_without_topk_group_pass_through_with_one_warning(
    fake_topk_module: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    kwargs = _hook_kwargs(topk_config(), experts=64)
    kwargs["topk_config"] = glm_config(num_expert_group=8, topk_group=None)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__), plugin.forward_mode(FakeMode.DECODE):
        for _ in range(3):
            assert plugin_routing.post_process_before(**kwargs) is None  # SGLang's own routing, untouched
    warnings = [r.getMessage() for r in caplog.records if "topk_group" in r.getMessage()]
    assert len(warnings) == 1 and "num_expert_group=8" in warnings[0]
    assert "keeps the engine's own routing" in warnings[0]


def test_grouped_without_group_limit_is_plain_softmax() -> None:
    spec = plugin.router_spec_from_topk_config(topk_config(use_grouped_topk=True, num_expert_group=4,
                                                           topk_group=4), 64)
    assert spec.scoring == "softmax" and spec.n_group is None


# --------------------------------------------------------------------------- the rewrite


def _vanilla(logits: torch.Tensor, spec: oea.RouterSpec, id_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ids, weights = oea.route(logits, spec)
    return ids.to(id_dtype), weights


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_rewrite_equals_route_and_keeps_engine_dtypes(id_dtype: torch.dtype) -> None:
    logits = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    spec = oea.RouterSpec(64, 8)
    cfg = oea.OEAConfig(2)
    ids, weights = plugin.rewrite_topk(*_vanilla(logits, spec, id_dtype), logits, spec, cfg)
    expected_ids, expected_weights = oea.route(logits, spec, cfg)
    assert ids.dtype == id_dtype and weights.dtype == torch.float32
    assert torch.equal(ids.long(), expected_ids) and _close(weights, expected_weights)
    assert oea.active_experts(ids.long(), weights) < oea.active_experts(*oea.route(logits, spec))


def test_rewrite_below_min_batch_is_a_no_op() -> None:
    logits = torch.randn(1, 64)
    spec = oea.RouterSpec(64, 8)
    assert plugin.rewrite_topk(*_vanilla(logits, spec, torch.int32), logits, spec, oea.OEAConfig(2)) is None


@pytest.mark.parametrize("min_batch", [1, 2, 3, 5])
def test_exactly_min_batch_rows_are_rewritten(min_batch: int) -> None:
    logits = torch.randn(min_batch + 2, 64, generator=torch.Generator().manual_seed(min_batch))
    spec, cfg = oea.RouterSpec(64, 8), oea.OEAConfig(1, min_batch=min_batch)
    exact = logits[:min_batch]
    result = plugin.rewrite_topk(*_vanilla(exact, spec, torch.int32), exact, spec, cfg)  # no padding count
    assert result is not None, f"{min_batch} rows with min_batch={min_batch} must be rewritten"
    expected_ids, expected_weights = oea.route(exact, spec, cfg)
    assert torch.equal(result[0].long(), expected_ids) and _close(result[1], expected_weights)
    if min_batch > 1:
        fewer = logits[: min_batch - 1]
        assert plugin.rewrite_topk(*_vanilla(fewer, spec, torch.int32), fewer, spec, cfg) is None
    # the same with two padding rows: the count of real rows decides
    engine = _vanilla(logits, spec, torch.int32)
    ids, weights = plugin.rewrite_topk(*engine, logits, spec, cfg, torch.tensor(min_batch))
    assert torch.equal(ids[:min_batch].long(), expected_ids) and _close(weights[:min_batch], expected_weights)
    assert torch.equal(ids[min_batch:], engine[0][min_batch:]) and torch.equal(weights[min_batch:],
                                                                               engine[1][min_batch:])
    if min_batch > 1:
        ids, weights = plugin.rewrite_topk(*engine, logits, spec, cfg, min_batch - 1)
        assert torch.equal(ids, engine[0]) and torch.equal(weights, engine[1])


@settings(max_examples=examples(40))
@given(st.integers(1, 12), st.integers(0, 4), st.integers(0, 12), st.booleans(), st.integers(0, 2**31 - 1))
@example(rows=8, min_batch=3, real=2, padded=True, seed=1)  # min_batch - 1 real rows next to padding rows
@example(rows=8, min_batch=3, real=3, padded=True, seed=1)  # exactly min_batch
@example(rows=8, min_batch=3, real=4, padded=True, seed=1)  # min_batch + 1
@example(rows=2, min_batch=3, real=0, padded=False, seed=2)  # unpadded: min_batch - 1, exactly, + 1 rows
@example(rows=3, min_batch=3, real=0, padded=False, seed=2)
@example(rows=4, min_batch=3, real=0, padded=False, seed=2)
@example(rows=6, min_batch=0, real=0, padded=True, seed=3)  # every row padding
def test_rewrite_equals_route_of_the_real_rows(rows: int, min_batch: int, real: int, padded: bool, seed: int) -> None:
    """Property: the rewrite of a batch equals ``oea.route`` of its real rows alone (or is absent / an
    identity when they are fewer than min_batch); padding rows keep SGLang's output exactly."""
    real = min(real, rows) if padded else rows
    logits = torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed)) * 3
    spec, cfg = oea.RouterSpec(32, 4), oea.OEAConfig(2, min_batch=min_batch)
    engine = _vanilla(logits, spec, torch.int64)
    result = plugin.rewrite_topk(*engine, logits, spec, cfg, torch.tensor(real) if padded else None)
    if real < min_batch:
        assert result is None or (torch.equal(result[0], engine[0]) and torch.equal(result[1], engine[1]))
        return
    assert result is not None
    if real:
        want_ids, want_weights = oea.route(logits[:real], spec, cfg)
        assert torch.equal(result[0][:real], want_ids) and _close(result[1][:real], want_weights)
    assert torch.equal(result[0][real:], engine[0][real:]) and torch.equal(result[1][real:], engine[1][real:])


def test_padding_rows_keep_engine_output_and_leave_the_union() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 64, generator=gen)
    spec = oea.RouterSpec(64, 8)
    cfg = oea.OEAConfig(2)
    engine_ids, engine_weights = _vanilla(logits, spec, torch.int32)
    engine_ids[6:] = -1  # what SGLang's padded-row mask would leave
    ids, weights = plugin.rewrite_topk(engine_ids, engine_weights, logits, spec, cfg, torch.tensor(6))
    alone_ids, alone_weights = oea.route(logits[:6], spec, cfg)
    assert torch.equal(ids[:6].long(), alone_ids) and _close(weights[:6], alone_weights)
    assert torch.equal(ids[6:], engine_ids[6:]) and torch.equal(weights[6:], engine_weights[6:])


def test_padding_leaving_too_few_real_rows_keeps_everything() -> None:
    logits = torch.randn(8, 64)
    spec = oea.RouterSpec(64, 8)
    engine = _vanilla(logits, spec, torch.int32)
    ids, weights = plugin.rewrite_topk(*engine, logits, spec, oea.OEAConfig(2, min_batch=4), torch.tensor(3))
    assert torch.equal(ids, engine[0]) and torch.equal(weights, engine[1])


def test_shared_columns_are_kept() -> None:
    logits = torch.randn(6, 64)
    spec = oea.RouterSpec(64, 8)
    ids, weights = _vanilla(logits, spec, torch.int32)
    engine_ids = torch.cat([ids, torch.full((6, 1), 64, dtype=torch.int32)], dim=1)
    engine_weights = torch.cat([weights, torch.full((6, 1), 0.4)], dim=1)
    new_ids, new_weights = plugin.rewrite_topk(engine_ids, engine_weights, logits, spec, oea.OEAConfig(1))
    assert new_ids.shape == (6, 9)
    assert torch.equal(new_ids[:, 8], engine_ids[:, 8]) and torch.equal(new_weights[:, 8], engine_weights[:, 8])


def test_rewrite_rejects_mismatched_shapes() -> None:
    spec = oea.RouterSpec(64, 8)
    with pytest.raises(plugin.UnsupportedRouting, match="does not match"):
        plugin.rewrite_topk(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 8), torch.randn(5, 64), spec,
                            oea.OEAConfig(2))


# --------------------------------------------------------------------------- decode detection and hooks


def test_decode_detection_nests_and_inherits() -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    assert not plugin.decode_active()
    with plugin.forward_mode(FakeMode.DECODE):
        assert plugin.decode_active()
        with plugin.forward_mode(None):  # forward_context(ctx) without a batch inherits
            assert plugin.decode_active()
        with plugin.forward_mode(FakeMode.EXTEND):
            assert not plugin.decode_active()
    with plugin.forward_mode(FakeMode.TARGET_VERIFY):
        assert not plugin.decode_active()
        STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_APPLY_TO_VERIFY": "1"})
        assert plugin.decode_active()


def _hook_kwargs(cfg: SimpleNamespace, rows: int = 6, experts: int = 64) -> dict[str, Any]:
    logits = torch.randn(rows, experts, generator=torch.Generator().manual_seed(3))
    spec = plugin.router_spec_from_topk_config(cfg, experts)
    ids, weights = _vanilla(logits, spec, torch.int32)
    return dict(topk_ids=ids, topk_weights=weights, topk_config=cfg, router_logits=logits, layer_id=5,
                num_token_non_padded=None, expert_location_dispatch_info=None)


def test_post_process_hook_rewrites_only_in_decode(fake_topk_module: types.ModuleType) -> None:
    STATE.settings = settings_from_env({"SGLANG_OEA_K0": "2"})
    kwargs = _hook_kwargs(glm_config())
    assert plugin_routing.post_process_before(**kwargs) is None  # no forward context: prefill / unknown
    with plugin.forward_mode(FakeMode.EXTEND):
        assert plugin_routing.post_process_before(**kwargs) is None
    with plugin.forward_mode(FakeMode.DECODE):
        args, new = plugin_routing.post_process_before(**kwargs)
    spec = plugin.router_spec_from_topk_config(kwargs["topk_config"], 64)
    expected_ids, expected_weights = oea.route(kwargs["router_logits"], spec, oea.OEAConfig(2))
    assert args == () and torch.equal(new["topk_ids"].long(), expected_ids)
    assert _close(new["topk_weights"], expected_weights)
    assert new["layer_id"] == 5 and new["topk_ids"].dtype == torch.int32
    assert plugin.rewrite_count() == 1


def test_one_topk_config_with_two_expert_counts_gets_two_specs(fake_topk_module: types.ModuleType) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    cfg = topk_config()
    with plugin.forward_mode(FakeMode.DECODE):
        for experts in (64, 32, 64):
            kwargs = _hook_kwargs(cfg, experts=experts)
            _, new = plugin_routing.post_process_before(**kwargs)
            spec = oea.RouterSpec(experts, 8)
            assert torch.equal(new["topk_ids"].long(), oea.route(kwargs["router_logits"], spec, oea.OEAConfig(2))[0])
            assert STATE.routers[5].spec.num_experts == experts  # the layer's state follows the expert count


def test_unsupported_layer_passes_through_with_one_warning(
    fake_topk_module: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    kwargs = _hook_kwargs(topk_config(), experts=64)
    kwargs["topk_config"] = topk_config(scoring_func="sqrtsoftplus")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__), plugin.forward_mode(FakeMode.DECODE):
        assert plugin_routing.post_process_before(**kwargs) is None
        assert plugin_routing.post_process_before(**kwargs) is None
    warnings = [r for r in caplog.records if "sqrtsoftplus" in r.getMessage()]
    assert len(warnings) == 1


def test_k0_larger_than_top_k_passes_through(fake_topk_module: types.ModuleType,
                                             caplog: pytest.LogCaptureFixture) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "9"})
    with caplog.at_level(logging.WARNING, logger=plugin.__name__), plugin.forward_mode(FakeMode.DECODE):
        assert plugin_routing.post_process_before(**_hook_kwargs(topk_config())) is None
    assert any("OEA_K0 must be in 1..8 (the model's top_k), got 9" in r.getMessage() for r in caplog.records)


def test_aiter_and_draft_topks_pass_through(fake_topk_module: types.ModuleType) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    with plugin.forward_mode(FakeMode.DECODE):
        draft = topk_config(allow_routed_experts_capture=False)
        assert plugin_routing.post_process_before(**_hook_kwargs(draft)) is None
        fake_topk_module._use_aiter = True
        assert plugin_routing.post_process_before(**_hook_kwargs(topk_config())) is None


def test_dynamic_expert_bias_call_passes_through(fake_topk_module: types.ModuleType) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    with plugin.forward_mode(FakeMode.DECODE):
        plugin_routing.select_experts_before(dynamic_expert_bias=torch.zeros(6, 64))
        assert plugin_routing.post_process_before(**_hook_kwargs(topk_config())) is None
        plugin_routing.select_experts_before(dynamic_expert_bias=None)
        assert plugin_routing.post_process_before(**_hook_kwargs(topk_config())) is not None


def test_forward_context_hook_pushes_the_batch_mode() -> None:
    import contextlib

    seen: list[Any] = []

    @contextlib.contextmanager
    def original(ctx: Any, *, forward_batch: Any = None):
        seen.append(plugin.current_forward_mode())
        yield "inner"

    batch = SimpleNamespace(forward_mode=FakeMode.DECODE)
    with plugin_hooks._forward_context_around(original, "ctx", forward_batch=batch) as value:
        assert value == "inner" and plugin.current_forward_mode() is FakeMode.DECODE
    assert seen == [FakeMode.DECODE] and plugin.current_forward_mode() is None


def test_forward_context_hook_reads_a_positional_batch() -> None:
    import contextlib

    @contextlib.contextmanager
    def original(ctx: Any, forward_batch: Any = None):
        yield plugin.decode_active()

    STATE.settings = settings_from_env({"OEA_K0": "2"})
    with plugin_hooks._forward_context_around(original, "ctx", SimpleNamespace(forward_mode=FakeMode.DECODE)) as seen:
        assert seen is True
    with plugin_hooks._forward_context_around(original, "ctx", SimpleNamespace(forward_mode=FakeMode.EXTEND)) as seen:
        assert seen is False


def test_hooks_of_versions_without_forward_context_push_the_mode() -> None:
    """SGLang 0.5.12-0.5.14: the mode comes from ``ModelRunner.forward(self, forward_batch)`` and from the
    graph runner's ``capture_forward_mode`` while a CUDA graph is captured."""
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    runner = SimpleNamespace(capture_forward_mode=FakeMode.DECODE)
    decode_batch = SimpleNamespace(forward_mode=FakeMode.DECODE)
    extend_batch = SimpleNamespace(forward_mode=FakeMode.EXTEND)

    def seen(*args: Any, **kwargs: Any) -> bool:
        return plugin.decode_active()

    assert plugin_hooks._model_runner_forward_around(seen, runner, decode_batch) is True
    assert plugin_hooks._model_runner_forward_around(seen, runner, forward_batch=extend_batch) is False
    assert plugin_hooks._graph_capture_around(seen, runner) is True
    assert plugin_hooks._graph_capture_around(seen, SimpleNamespace(capture_forward_mode=FakeMode.EXTEND)) is False
    assert not plugin.decode_active()  # popped again


def test_missing_rewrite_hook_is_reported_on_the_first_forward(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import contextlib

    monkeypatch.setattr(plugin_hooks, "target_hooked", lambda target: target != plugin.POST_PROCESS_TARGET)
    with caplog.at_level(logging.ERROR, logger=plugin.__name__):
        for _ in range(2):
            with plugin_hooks._forward_context_around(lambda ctx, forward_batch=None: contextlib.nullcontext(), None):
                pass
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "serving WITHOUT OEA" in errors[0] and plugin.POST_PROCESS_TARGET in errors[0]


def _fake_topk_functions(module: types.ModuleType, with_post_process: bool) -> None:
    """SGLang's ``select_experts`` (vanilla routing) calling ``_post_process_topk_ids`` when it exists."""
    output = __import__("collections").namedtuple("StandardTopKOutput", "topk_weights topk_ids router_logits")

    def _post_process_topk_ids(*, topk_ids, topk_weights, topk_config, router_logits, layer_id,
                               num_token_non_padded, expert_location_dispatch_info=None):
        return topk_ids, topk_weights

    def select_experts(hidden_states, router_logits, topk_config, *, layer_id=None, num_token_non_padded=None,
                       expert_location_dispatch_info=None):
        spec = plugin.router_spec_from_topk_config(topk_config, router_logits.shape[1])
        ids, weights = _vanilla(router_logits, spec, torch.int32)
        if with_post_process:
            ids, weights = module._post_process_topk_ids(
                topk_ids=ids, topk_weights=weights, topk_config=topk_config, router_logits=router_logits,
                layer_id=layer_id, num_token_non_padded=num_token_non_padded,
                expert_location_dispatch_info=expert_location_dispatch_info)
        return output(weights, ids, router_logits)

    module.select_experts = select_experts
    if with_post_process:
        module._post_process_topk_ids = _post_process_topk_ids


@pytest.mark.parametrize("with_post_process", [True, False], ids=["0.5.12+", "0.5.9-legacy"])
def test_direct_patching_rewrites_decode_only(fake_topk_module: types.ModuleType, with_post_process: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``install_without_registry`` (python -m oea.launch.sglang): BEFORE hooks where SGLang has
    ``_post_process_topk_ids``, else an AROUND rewrite of ``select_experts``' output."""
    for parent in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    _fake_topk_functions(fake_topk_module, with_post_process)
    patched = plugin.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    assert (plugin.POST_PROCESS_TARGET in patched) is with_post_process and plugin.SELECT_EXPERTS_TARGET in patched
    cfg = topk_config()
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    spec = plugin.router_spec_from_topk_config(cfg, 64)
    vanilla_ids = _vanilla(logits, spec, torch.int32)[0]
    with plugin.forward_mode(FakeMode.DECODE):
        decode = fake_topk_module.select_experts(torch.zeros(6, 4), logits, cfg, layer_id=0)
        eplb = fake_topk_module.select_experts(torch.zeros(6, 4), logits, cfg, layer_id=0,
                                               expert_location_dispatch_info=object())
        padded = fake_topk_module.select_experts(torch.zeros(6, 4), logits, cfg, layer_id=0,
                                                 num_token_non_padded=torch.tensor(4))
    with plugin.forward_mode(FakeMode.EXTEND):
        extend = fake_topk_module.select_experts(torch.zeros(6, 4), logits, cfg, layer_id=0)
    assert torch.equal(decode.topk_ids.long(), oea.route(logits, spec, oea.OEAConfig(2))[0])
    assert torch.equal(padded.topk_ids[:4].long(), oea.route(logits[:4], spec, oea.OEAConfig(2))[0])
    assert torch.equal(padded.topk_ids[4:], vanilla_ids[4:])
    assert torch.equal(extend.topk_ids, vanilla_ids)
    if not with_post_process:  # the legacy rewrite runs after the EPLB remap, so it must stay away from it
        assert torch.equal(eplb.topk_ids, vanilla_ids)


# --------------------------------------------------------------------------- registration


def test_register_without_oea_k0_installs_nothing() -> None:
    plugin.register()
    assert STATE.installed_targets == () and STATE.settings is None


def test_register_warns_about_an_empty_k0(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SGLANG_OEA_K0", " ")
    with caplog.at_level(logging.WARNING):
        plugin.register()
    assert STATE.installed_targets == () and STATE.settings is None
    assert [r.getMessage() for r in caplog.records] == ["oea: SGLANG_OEA_K0 is set but empty: read as unset (OEA is "
                                                        "off without OEA_K0); unset it, or give it a value"]


def test_register_with_malformed_k0_stops_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_OEA_K0", "three")
    with pytest.raises(SystemExit, match="SGLANG_OEA_K0 must be an integer"):
        plugin.register()


def test_install_registers_every_planned_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[tuple[str, Any, Any]] = []
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    registry.HookType = enum.Enum("HookType", "BEFORE AFTER AROUND REPLACE")
    registry.HookRegistry = SimpleNamespace(register=lambda target, hook, kind: registered.append((target, hook,
                                                                                                    kind)))
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", registry)
    monkeypatch.setattr(plugin_entry, "hook_plan", lambda phase_via_forward_context=None: REAL_HOOK_PLAN(True))
    targets = plugin.install(settings_from_env({"OEA_K0": "2"}))
    assert targets == [plugin.FORWARD_CONTEXT_TARGET, plugin.SELECT_EXPERTS_TARGET, plugin.POST_PROCESS_TARGET]
    kinds = {target: kind.name for target, _, kind in registered}
    assert kinds == {plugin.FORWARD_CONTEXT_TARGET: "AROUND", plugin.SELECT_EXPERTS_TARGET: "BEFORE",
                     plugin.POST_PROCESS_TARGET: "BEFORE"}
    assert plugin.install(settings_from_env({"OEA_K0": "3"})) == targets  # idempotent
    assert len(registered) == 3 and STATE.settings.oea.k0 == 3


def test_hook_plan_falls_back_without_forward_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per SGLang layout in tests/unit/test_sglang_decode_detection.py; here: the plan's order."""
    monkeypatch.setattr(plugin_hooks.targets, "graph_capture_targets", lambda: [plugin.GRAPH_CAPTURE_TARGET])
    targets = [target for target, _, _ in plugin.hook_plan(False)]
    assert targets == [plugin.MODEL_RUNNER_FORWARD_TARGET, plugin.GRAPH_CAPTURE_TARGET,
                       plugin.SELECT_EXPERTS_TARGET, plugin.POST_PROCESS_TARGET]


def test_direct_patch_updates_by_name_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    source = types.ModuleType("oea_test_fake_source")
    source.compute = lambda x: x + 1
    importer = types.ModuleType("oea_test_fake_importer")
    importer.compute = source.compute  # `from oea_test_fake_source import compute`
    monkeypatch.setitem(sys.modules, source.__name__, source)
    monkeypatch.setitem(sys.modules, importer.__name__, importer)

    def doubling_before(x: int) -> tuple[tuple[int], dict[str, Any]]:
        return (2 * x,), {}

    plugin_entry._patch(f"{source.__name__}.compute", doubling_before, "BEFORE")
    plugin_entry._patch(f"{source.__name__}.compute", doubling_before, "BEFORE")  # no double wrap
    assert source.compute(3) == 7 and importer.compute(3) == 7
    assert plugin_hooks.has_hook(importer.compute, doubling_before)


def test_per_layer_k0_file_sets_each_layers_k0(fake_topk_module: types.ModuleType, tmp_path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "k0.json"
    write_layer_k0_file(oea.routing.LayerK0Schedule(num_experts=64, top_k=8, num_layers=2, k0=(1, 6),
                                                    layer_ids=(5, 9)), path)
    STATE.settings = settings_from_env({"OEA_K0": "3", "OEA_LAYER_K0_FILE": str(path)})
    kwargs = _hook_kwargs(glm_config())
    spec = plugin.router_spec_from_topk_config(kwargs["topk_config"], 64)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__), plugin.forward_mode(FakeMode.DECODE):
        _, layer5 = plugin_routing.post_process_before(**kwargs)
        layer7 = plugin_routing.post_process_before(**{**kwargs, "layer_id": 7})  # not in the file
        _, layer9 = plugin_routing.post_process_before(**{**kwargs, "layer_id": 9})
        _, layer5_again = plugin_routing.post_process_before(**kwargs)
    assert torch.equal(layer5["topk_ids"].long(), _served(kwargs, spec, 1))
    assert layer7 is None, "a layer the file does not list keeps SGLang's routing"
    assert any("MoE layer 7 is not in the file (its layer_ids are [5, 9])" in r.getMessage() for r in caplog.records)
    assert torch.equal(layer9["topk_ids"].long(), _served(kwargs, spec, 6))
    assert torch.equal(layer5_again["topk_ids"], layer5["topk_ids"])  # each layer's config is cached apart


def _served(kwargs: dict[str, Any], spec: oea.RouterSpec, k0: int) -> torch.Tensor:
    """The ids the plugin hands SGLang for ``oea.route``'s routing at ``k0``: its repeated filler ids renamed
    (``distinct_fillers``, as SGLang's native MoE needs)."""
    ids, weights = oea.route(kwargs["router_logits"], spec, oea.OEAConfig(k0))
    return distinct_fillers(ids, weights, spec.top_k, spec.num_experts)[0]


def test_the_layer_files_own_min_batch_decides_when_the_environment_sets_none(fake_topk_module: types.ModuleType,
                                                                            tmp_path) -> None:
    """OEA_K0 and OEA_LAYER_K0_FILE set, OEA_MIN_BATCH not: the file's min_batch (4) decides, as in the vLLM
    and transformers adapters. A decode call of 3 rows keeps SGLang's routing, one of 4 rows is rerouted;
    with OEA_MIN_BATCH=2 set, 3 rows are rerouted."""
    path = tmp_path / "k0.json"
    write_layer_k0_file(oea.routing.LayerK0Schedule(num_experts=64, top_k=8, num_layers=1, k0=(1,), layer_ids=(5,),
                                                    min_batch=4), path)
    plugin_entry.install(settings_from_env({"OEA_K0": "3", "OEA_LAYER_K0_FILE": str(path)}))
    with plugin.forward_mode(FakeMode.DECODE):
        assert plugin_routing.post_process_before(**_hook_kwargs(glm_config(), rows=3)) is None, "3 rows < 4"
        kwargs = _hook_kwargs(glm_config(), rows=4)
        _, new = plugin_routing.post_process_before(**kwargs)
        spec = plugin.router_spec_from_topk_config(kwargs["topk_config"], 64)
        assert torch.equal(new["topk_ids"].long(), _served(kwargs, spec, 1))
        plugin_entry.install(settings_from_env({"OEA_K0": "3", "OEA_MIN_BATCH": "2", "OEA_LAYER_K0_FILE": str(path)}))
        assert plugin_routing.post_process_before(**_hook_kwargs(glm_config(), rows=3)) is not None


def test_per_layer_k0_file_for_another_model_keeps_sglangs_routing_visibly(
    fake_topk_module: types.ModuleType, caplog: pytest.LogCaptureFixture, tmp_path
) -> None:
    path = tmp_path / "k0.json"
    write_layer_k0_file(oea.routing.LayerK0Schedule(num_experts=128, top_k=8, num_layers=1, k0=(1,)), path)
    STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_LAYER_K0_FILE": str(path)})
    with caplog.at_level(logging.WARNING, logger=plugin.__name__), plugin.forward_mode(FakeMode.DECODE):
        assert plugin_routing.post_process_before(**_hook_kwargs(glm_config())) is None
    assert any("calibrated for another model (num_experts: file has 128, model has 64)" in r.getMessage()
               for r in caplog.records)


def test_recorded_decode_forwards_carry_each_real_rows_position(fake_topk_module: types.ModuleType, tmp_path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """OEA_TRACE_FILE through the plugin's hooks (stand-ins for SGLang's forward_context and topk): two DECODE
    forwards of 4 and 3 requests whose routing calls hold 2 padding rows after the real ones (a padded graph
    batch). The trace holds each real row's position ``seq_lens - 1`` (SGLang's host copy ``seq_lens_cpu``,
    or ``seq_lens`` when there is none), its request and its router logits; the EXTEND forward between
    them, and the padding rows, are not recorded."""
    import contextlib

    import oea.integrations.sglang.recording as recording
    from oea.config import TraceSettings
    from oea.traces import load_trace

    for field in dataclasses.fields(recording._Trace):
        monkeypatch.setattr(recording.TRACE, field.name, getattr(recording._Trace(), field.name))
    recording.configure(TraceSettings(str(tmp_path / "trace.safetensors")))
    STATE.settings = settings_from_env({"OEA_K0": "2"})

    @contextlib.contextmanager
    def sglang_forward_context(ctx: Any, *, forward_batch: Any = None):
        yield

    forwards = [(FakeMode.DECODE, ["a", "b", "c", "d"], [7, 3, 12, 5], True),
                (FakeMode.EXTEND, ["e"], [30], True),
                (FakeMode.DECODE, ["b", "e", "a"], [4, 31, 13], False)]
    recorded = []
    for seed, (mode, rids, seq_lens, host_copy) in enumerate(forwards):
        lens = torch.tensor(seq_lens)
        batch = SimpleNamespace(forward_mode=mode, batch_size=len(rids), rids=rids, seq_lens=lens,
                                seq_lens_cpu=lens if host_copy else None, input_ids=torch.zeros(len(rids)))
        logits = torch.randn(len(rids) + 2, 64, generator=torch.Generator().manual_seed(seed))
        kwargs = {**_hook_kwargs(topk_config(), rows=len(rids) + 2), "router_logits": logits}
        with plugin_hooks._forward_context_around(sglang_forward_context, None, forward_batch=batch):
            for layer in (0, 1):
                plugin_routing.post_process_before(**{**kwargs, "layer_id": layer})
        if mode is FakeMode.DECODE:
            recorded.append((rids, seq_lens, logits[: len(rids)]))
    trace = load_trace(str(recording.TRACE.recorder.close()))
    assert trace.positions.tolist() == [n - 1 for _, lens, _ in recorded for n in lens]
    names = trace.meta["request_names"]
    assert [names[i] for i in trace.request_ids.tolist()] == [r for rids, _, _ in recorded for r in rids]
    for layer in (0, 1):
        assert torch.equal(trace.logits[:, layer], torch.cat([x for _, _, x in recorded]))
