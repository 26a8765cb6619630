"""Stand-ins for the few vLLM names the vLLM plugin imports, so its per-step logic runs in the main venv:
the forward context (padding rows) and ``BaseRouter`` (model load)."""

from __future__ import annotations

import dataclasses
import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import oea.integrations.vllm as plugin
import oea.integrations.vllm.state as plugin_state
from oea.config.settings import all_settings_from_env
from oea.routing import RouterSpec, route

BASE_ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router.base_router"


class BaseRouter:
    """Stands in for vLLM's ``BaseRouter`` (the plugin only checks isinstance)."""


class CPURouter(BaseRouter):
    """A softmax top-k router with vLLM's attribute names; ``route_stock`` is its own routing."""

    def __init__(self, top_k: int = 8, num_experts: int = 64, renormalize: bool = True) -> None:
        self.top_k, self.global_num_experts, self.renormalize = top_k, num_experts, renormalize
        self.scoring_func = "softmax"

    def spec(self) -> RouterSpec:
        return RouterSpec(self.global_num_experts, self.top_k, "softmax", self.renormalize)

    def route_stock(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's CPU layout: (weights [M, k] float32, ids [M, k] int32)."""
        ids, weights = route(router_logits, self.spec())
        return weights, ids.to(torch.int32)


@dataclass
class ForwardContext:
    """``get_forward_context()``: ``is_padding`` [M] bool or None; ``available`` False = no context."""

    is_padding: torch.Tensor | None = None
    available: bool = True

def install_vllm(monkeypatch: pytest.MonkeyPatch) -> ForwardContext:
    """Put stand-in ``vllm.forward_context`` and ``BaseRouter`` modules in ``sys.modules``."""
    context = ForwardContext()
    forward_context = types.ModuleType("vllm.forward_context")
    forward_context.is_forward_context_available = lambda: context.available  # type: ignore[attr-defined]
    forward_context.get_forward_context = lambda: context  # type: ignore[attr-defined]
    base_router = types.ModuleType(BASE_ROUTER_MODULE)
    base_router.BaseRouter = BaseRouter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.forward_context", forward_context)
    monkeypatch.setitem(sys.modules, BASE_ROUTER_MODULE, base_router)
    return context


def swap_state(monkeypatch: pytest.MonkeyPatch, state: plugin_state.State) -> plugin_state.State:
    """Give the plugin's one ``STATE`` the fields of ``state`` for this test (restored afterwards)."""
    for name in dataclasses.fields(plugin_state.State):
        monkeypatch.setattr(plugin_state.STATE, name.name, getattr(state, name.name))
    return plugin_state.STATE


def fresh_state(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], router: Any | None = None
                ) -> plugin_state.State:
    """Plugin state as ``register()`` + ``Worker.load_model`` leave it, with ``router`` as router 0."""
    state = plugin_state.State(settings=all_settings_from_env(env), mode="oea")
    state.originals["CPURouter"] = lambda self, hidden_states, router_logits, indices_type, **_: \
        self.route_stock(router_logits)
    state.decode_flag = torch.zeros((), dtype=torch.bool)
    if router is not None:
        router._oea_router_id = 0
        state.routers.append(router)
        state.specs.append(plugin.router_spec(router)[0])
    return swap_state(monkeypatch, state)


def loaded_state(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], layers: int, num_experts: int, top_k: int
                 ) -> plugin_state.State:
    """Plugin state as ``register()`` + ``Worker.load_model`` leave it for a model of ``layers`` stand-in routers
    (router id = MoE layer position), ``OEA_LAYER_K0_FILE`` loaded (``layers.load``)."""
    import oea.integrations.vllm.layers as plugin_layers

    install_vllm(monkeypatch)
    state = fresh_state(monkeypatch, env)
    for i in range(layers):
        router = CPURouter(num_experts=num_experts, top_k=top_k)
        router._oea_router_id = i
        state.routers.append(router)
        state.specs.append(plugin.router_spec(router)[0])
    plugin_layers.load(state.specs)
    return state


def scheduler_output(tokens_per_request: list[int]) -> types.SimpleNamespace:
    """A ``SchedulerOutput`` with one request per entry (1 token each = a decode step)."""
    scheduled = {f"r{i}": n for i, n in enumerate(tokens_per_request)}
    return types.SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(tokens_per_request),
                                 scheduled_spec_decode_tokens={})


def dense(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[M, N] weight per expert (filler slots add 0)."""
    return torch.zeros(ids.shape[0], num_experts).scatter_add(1, ids.long(), weights.float())
