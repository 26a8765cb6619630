"""The SGLang adapter's one object per MoE layer (``router_state.RouterState``): each layer's facts kept on it and
reused by every call, made anew under new settings, a layer whose routing raised keeping SGLang's routing, and
the per-call path running the layer's prepared kernel (no dispatch, no environment read per call)."""

from __future__ import annotations

import ast
import logging
import pathlib
import types
from typing import Any

import pytest
import torch
from sglang_stand_ins import FakeMode, topk_config, topk_module

import oea
import oea.integrations.sglang.routing as plugin_routing
import oea.kernels.dispatch as dispatch
from oea.config import settings_from_env, write_layer_k0_file
from oea.integrations import sglang as plugin
from oea.integrations.sglang.fillers import distinct_fillers
from oea.integrations.sglang.plugin import install
from oea.integrations.sglang.router_state import UNDECIDED, RouterState
from oea.integrations.sglang.state import STATE
from oea.kernels import NumbaRouter, numba_available

PACKAGE = pathlib.Path(plugin.__file__).parent


@pytest.fixture
def fake_topk_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    # each test starts with no layer state and no warning given: another test of the same process may have
    # routed (and failed) layers 0, 1, 7
    monkeypatch.setattr(STATE, "routers", {})
    monkeypatch.setattr(STATE, "warned", set())
    return topk_module(monkeypatch)


def _kwargs(layer_id: int, config: Any, rows: int = 6, experts: int = 64, seed: int = 3) -> dict[str, Any]:
    logits = torch.randn(rows, experts, generator=torch.Generator().manual_seed(seed))
    spec = plugin.router_spec_from_topk_config(config, experts)
    ids, weights = oea.route(logits, spec, oea.OEAConfig(spec.top_k))
    return dict(
        topk_ids=ids.to(torch.int32),
        topk_weights=weights,
        topk_config=config,
        router_logits=logits,
        layer_id=layer_id,
        num_token_non_padded=None,
        expert_location_dispatch_info=None,
    )


def _served(kwargs: dict[str, Any], k0: int) -> torch.Tensor:
    spec = plugin.router_spec_from_topk_config(kwargs["topk_config"], kwargs["router_logits"].shape[1])
    ids, weights = oea.route(kwargs["router_logits"], spec, oea.OEAConfig(k0))
    return distinct_fillers(ids, weights, spec.top_k, spec.num_experts)[0]


def test_each_layer_keeps_its_facts_on_one_state_reused_by_every_call(
    fake_topk_module: types.ModuleType, tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "k0.json"
    write_layer_k0_file(
        oea.routing.LayerK0Schedule(num_experts=64, top_k=8, num_layers=2, k0=(1, 6), layer_ids=(5, 9)), path
    )
    install(settings_from_env({"OEA_K0": "3", "OEA_LAYER_K0_FILE": str(path)}))
    configs = {5: topk_config(), 9: topk_config()}
    seen = []
    with plugin.forward_mode(FakeMode.DECODE):
        for _ in range(2):
            for layer, k0 in ((5, 1), (9, 6)):
                kwargs = _kwargs(layer, configs[layer])
                _, new = plugin_routing.post_process_before(**kwargs)
                assert torch.equal(new["topk_ids"].long(), _served(kwargs, k0))
            seen.append(dict(STATE.routers))
    assert set(STATE.routers) == {5, 9}
    assert all(seen[1][layer] is seen[0][layer] for layer in (5, 9)), "the second calls reuse each layer's state"
    five, nine = STATE.routers[5], STATE.routers[9]
    assert (five.layer_entry, nine.layer_entry) == (0, 1)
    assert five.spec is not None and five.spec.num_experts == 64 and five.topk_config is configs[5]
    assert five.trace_slot == UNDECIDED and not five.failed and five.earlier is not None
    if numba_available():
        assert isinstance(five.kernel, NumbaRouter) and five.kernel_key[0].k0 == 1
    install(settings_from_env({"OEA_K0": "2"}))  # new settings: each layer's state is made anew at its next call
    with plugin.forward_mode(FakeMode.DECODE):
        kwargs = _kwargs(5, configs[5])
        _, new = plugin_routing.post_process_before(**kwargs)
    assert STATE.routers[5] is not five and STATE.routers[5].layer_entry is None
    assert torch.equal(new["topk_ids"].long(), _served(kwargs, 2))


def test_a_layer_whose_routing_raised_keeps_sglangs_routing_from_then_on(
    fake_topk_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    original = plugin_routing.rewrite_topk
    monkeypatch.setattr(plugin_routing, "rewrite_topk", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    configs = [topk_config(), topk_config()]  # one per layer, as each SGLang TopK has its own
    with caplog.at_level(logging.WARNING, logger=plugin.__name__), plugin.forward_mode(FakeMode.DECODE):
        assert plugin_routing.post_process_before(**_kwargs(0, configs[0])) is None
        monkeypatch.setattr(plugin_routing, "rewrite_topk", original)
        assert plugin_routing.post_process_before(**_kwargs(0, configs[0])) is None, "no retry in that layer"
        assert plugin_routing.post_process_before(**_kwargs(1, configs[1])) is not None, "other layers route"
    assert STATE.routers[0].failed and not STATE.routers[1].failed
    assert sum("routing rewrite failed on layer 0" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_a_cpu_call_runs_the_layers_prepared_kernel_without_dispatch(
    fake_topk_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch, id_dtype: torch.dtype
) -> None:
    """After a layer's first call, a CPU decode call neither plans nor reads TRITON_INTERPRET: ``route_fast``'s
    per-call dispatch is not on the path."""
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    config = topk_config()
    with plugin.forward_mode(FakeMode.DECODE):
        plugin_routing.post_process_before(**_kwargs(0, config, seed=1))

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("dispatch ran in a prepared layer's call")

        monkeypatch.setattr(plugin_routing, "route_fast", refused)
        monkeypatch.setattr(dispatch, "_interpreting", refused)
        kwargs = _kwargs(0, config, seed=2)
        kwargs["topk_ids"] = kwargs["topk_ids"].to(id_dtype)
        _, new = plugin_routing.post_process_before(**kwargs)
    assert new["topk_ids"].dtype == id_dtype and torch.equal(new["topk_ids"].long(), _served(kwargs, 2))


def test_a_layer_the_file_does_not_list_keeps_sglangs_routing_with_one_warning(
    fake_topk_module: types.ModuleType, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "k0.json"
    write_layer_k0_file(
        oea.routing.LayerK0Schedule(num_experts=64, top_k=8, num_layers=1, k0=(1,), layer_ids=(5,)), path
    )
    STATE.settings = settings_from_env({"OEA_K0": "3", "OEA_LAYER_K0_FILE": str(path)})
    with caplog.at_level(logging.WARNING, logger=plugin.__name__), plugin.forward_mode(FakeMode.DECODE):
        for _ in range(2):
            assert plugin_routing.post_process_before(**_kwargs(7, topk_config())) is None
    state: RouterState = STATE.routers[7]
    assert state.layer_entry is None and "MoE layer 7 is not in the file" in state.missing
    assert sum("MoE layer 7 is not in the file" in r.getMessage() for r in caplog.records) == 1


def _module_level_empty_containers(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        empty = (
            (isinstance(value, ast.Dict) and not value.keys)
            or (isinstance(value, (ast.List, ast.Set)) and not value.elts)
            or (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and not value.args
                and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict")
            )
        )
        if empty:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.extend(ast.unparse(target) for target in targets)
    return names


# fillers._EARLIER: [k, k] masks by (k, device) for callers without a RouterState, not a per-layer fact
NOT_PER_LAYER = {("fillers.py", "_EARLIER")}


def test_per_layer_facts_live_only_on_the_state() -> None:
    """No process-global map beside ``STATE`` (``state.py``, which holds each layer's ``RouterState``): a
    module-level empty dict, list or set elsewhere in the SGLang adapter would be a per-layer cache."""
    found = {
        (path.name, name)
        for path in PACKAGE.glob("*.py")
        if path.name != "state.py"
        for name in _module_level_empty_containers(ast.parse(path.read_text()))
        # mutmut's tables of a function's mutants (make mutation runs these tests on its mutated copy)
        if not name.endswith("__mutmut")
    }
    assert found - NOT_PER_LAYER == set()
