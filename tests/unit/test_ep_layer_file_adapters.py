"""``OEA_POLICY=ep`` with ``OEA_LAYER_K0_FILE`` (and ``OEA_MAX_EXPERTS``) in both engine adapters, with stand-ins
for the engines: each layer routes with EP-aware OEA on the engine's placement and the layer's own k0 and
``min_batch``, composed by one rule in the core (``oea.routing.LayerConfigs.config`` / ``with_layer_k0``), so
vLLM and SGLang route the same logits to the same experts; ``OEA_MAX_EXPERTS`` under EP is the same warning
in both."""

from __future__ import annotations

import logging
import pathlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from sglang_stand_ins import FakeMode, topk_config, topk_module
from sglang_stand_ins import fresh_state as fresh_sglang_state
from vllm_stand_ins import CPURouter, fresh_state, install_vllm, loaded_state, scheduler_output

import oea.integrations.sglang.placement as sglang_placement
import oea.integrations.sglang.routing as sglang_routing
import oea.integrations.vllm.placement as vllm_placement
import oea.integrations.vllm.routing as vllm_routing
import oea.integrations.vllm.steps as vllm_steps
from oea.config import settings_from_env, write_layer_k0_file
from oea.integrations import sglang as sglang_plugin
from oea.integrations.sglang.state import STATE as SGLANG_STATE
from oea.integrations.vllm.router_state import router_state
from oea.routing import EPOEAConfig, ExpertPlacement, LayerK0Schedule, OEAConfig, route
from oea.routing.layered import EP_IGNORES_MAX_EXPERTS

torch.set_num_threads(1)
N, K, LAYERS, EP = 64, 8, 3, 4
LAYER_K0, MIN_BATCH, ROWS = (1, 3, 6), 3, 12
INTERLEAVED = ExpertPlacement(torch.arange(N) % EP, EP)  # expert e on device e mod 4: EP-aware OEA differs from plain


def _file(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "k0.json"
    write_layer_k0_file(LayerK0Schedule(N, K, LAYERS, LAYER_K0, min_batch=MIN_BATCH), path)
    return str(path)


def _logits(seed: int) -> torch.Tensor:
    """Tie-free [ROWS, N] logits (a random permutation per row)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(N, generator=gen) for _ in range(ROWS)]).float() / 8


def _expected(layer: int, x: torch.Tensor) -> torch.Tensor:
    """[ROWS, K] ids: EP-aware OEA on the placement with the layer's k0 and the file's min_batch, sorted per row."""
    ids, _ = route(x, CPURouter(num_experts=N, top_k=K).spec(), EPOEAConfig(LAYER_K0[layer], INTERLEAVED,
                                                                              min_batch=MIN_BATCH))
    return ids.sort(dim=1).values


def _vllm_ids(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], x: torch.Tensor, layer: int) -> torch.Tensor:
    """vLLM: routers numbered and the file loaded as at model load, each with its EP-aware config on the
    placement (what ``placement.setup`` reads from vLLM's expert map), one decode step through the CPU op."""
    state = loaded_state(monkeypatch, env, LAYERS, N, K)
    for i in range(LAYERS):
        router_state(i).ep = EPOEAConfig(int(env["OEA_K0"]), INTERLEAVED)
    vllm_steps.begin_step(scheduler_output([1] * ROWS))
    try:
        stock = state.routers[layer].route_stock(x)
        _, ids = vllm_routing.cpu_route_body(x, stock[0], stock[1], layer)
    finally:
        vllm_steps.end_step()
    return ids.long().sort(dim=1).values


def _location_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """SGLang's ``expert_location`` module: EP 4, 16 slots per rank, slot s holding expert (s mod 16) * 4 + s // 16
    (so expert e sits on rank e mod 4), no static dispatch."""
    module = types.ModuleType(sglang_placement.LOCATION_MODULE)
    slots = [(s % 16) * EP + s // 16 for s in range(N)]
    meta = SimpleNamespace(ep_size=EP, num_layers=LAYERS, num_local_physical_experts=N // EP, num_logical_experts=N,
                           physical_to_logical_map_cpu=torch.tensor([slots] * LAYERS),
                           logical_to_rank_dispatch_physical_map=None)
    module.get_global_expert_location_metadata = lambda: meta
    module.ExpertLocationMetadata = type("ExpertLocationMetadata", (), {"update": lambda self: None})
    monkeypatch.setitem(sys.modules, sglang_placement.LOCATION_MODULE, module)
    return module


def _sglang_ids(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], x: torch.Tensor, layer: int) -> torch.Tensor:
    """SGLang: the rewrite of one DECODE routing call of MoE layer ``layer`` (its placement read at this call)."""
    fresh_sglang_state(monkeypatch)
    topk_module(monkeypatch)
    _location_module(monkeypatch)
    SGLANG_STATE.settings = settings_from_env(env)
    cfg = topk_config()
    spec = sglang_plugin.router_spec_from_topk_config(cfg, N)
    stock_ids, stock_w = route(x, spec, OEAConfig(K))
    with sglang_plugin.forward_mode(FakeMode.DECODE):
        changed = sglang_routing.post_process_before(
            topk_ids=stock_ids.to(torch.int32), topk_weights=stock_w, topk_config=cfg, router_logits=x,
            layer_id=layer, num_token_non_padded=None, expert_location_dispatch_info=None)
    assert changed is not None, "the layer was rewritten"
    return changed[1]["topk_ids"].long().sort(dim=1).values


def test_ep_with_a_layer_file_routes_each_layer_alike_in_both_engines(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: pathlib.Path) -> None:
    env = {"OEA_K0": "2", "OEA_POLICY": "ep", "OEA_LAYER_K0_FILE": _file(tmp_path)}
    for layer in range(LAYERS):
        x = _logits(seed=50 + layer)
        want = _expected(layer, x)
        plain, _ = route(x, CPURouter(num_experts=N, top_k=K).spec(), OEAConfig(LAYER_K0[layer], min_batch=MIN_BATCH))
        vllm_ids = _vllm_ids(monkeypatch, env, x, layer)
        sglang_ids = _sglang_ids(monkeypatch, env, x, layer)
        assert torch.equal(vllm_ids, want), f"vLLM layer {layer}"
        assert torch.equal(sglang_ids, want), f"SGLang layer {layer}"
        if layer == 0:  # k0 = 1 on the interleaved placement: EP-aware OEA picks other experts than plain OEA
            assert not torch.equal(want, plain.sort(dim=1).values)


def test_the_layer_k0_raises_a_boost_rank_below_it_in_the_core_rule(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: pathlib.Path) -> None:
    """The EP policy's ``boost_rank`` is raised to the layer's k0 where it is lower (``with_layer_k0``): the rule
    the adapters no longer apply themselves."""
    loaded_state(monkeypatch, {"OEA_K0": "2", "OEA_POLICY": "ep", "OEA_LAYER_K0_FILE": _file(tmp_path)}, LAYERS, N, K)
    got = []
    for i in range(LAYERS):
        router_state(i).ep = EPOEAConfig(2, INTERLEAVED, boost_rank=4)
        got.append(router_state(i).config(ROWS))
    assert [(c.k0, c.min_batch, c.boost_rank) for c in got] == [(1, 3, 4), (3, 3, 4), (6, 3, 6)]
    assert vllm_placement.config_for(1) is router_state(1).ep


def _warnings(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage().removeprefix("oea: ") for r in caplog.records
            if r.name == logger and r.levelno == logging.WARNING]


def test_max_experts_under_ep_is_the_same_warning_in_both_engines(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    env = {"OEA_K0": "2", "OEA_MAX_EXPERTS": "4", "OEA_POLICY": "ep"}
    install_vllm(monkeypatch)
    fresh_state(monkeypatch, env)
    with caplog.at_level(logging.WARNING):
        vllm_placement.setup([])
    vllm_said = [w for w in _warnings(caplog, "vllm.oea") if "OEA_MAX_EXPERTS" in w]
    caplog.clear()
    fresh_sglang_state(monkeypatch)
    _location_module(monkeypatch)
    SGLANG_STATE.settings = settings_from_env(env)
    with caplog.at_level(logging.WARNING):
        sglang_placement.install()
    sglang_said = [w for w in _warnings(caplog, "oea.integrations.sglang") if "OEA_MAX_EXPERTS" in w]
    assert vllm_said == sglang_said == [EP_IGNORES_MAX_EXPERTS]
