"""The conformance table through the vLLM plugin's real entry points (run in .venv-vllm): ``register()`` with
the scenario's environment, ``Worker.load_model``'s ``_after_load`` on a model of vLLM's own ``CPURouter``
routers, then one decode step in which each router's wrapped ``_compute_routing`` runs the ``oea::cpu_route``
op. Padding rows come from vLLM's own ``ForwardContext.is_padding``.

Routed-experts capture (``--enable-return-routed-experts``): vLLM's own ``RoutedExpertsCapturer.capture`` is bound
to each router with ``set_capture_fn``, as ``bind_routed_experts_capturer`` binds it, and each router is called
through ``_select_experts``, which captures the ids its (wrapped) ``_compute_routing`` returned. The capturer's
buffer is set up directly: its ``__init__`` wants a whole ``VllmConfig`` for the buffer's shape.

Stand-ins: the model is a module tree holding the routers (no weights, no attention), and the engine step's
``SchedulerOutput`` is a namespace with the fields the plugin reads (one token per request: a decode step).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import torch
from conformance_child import main, routed
from conformance_scenarios import LAYERS, NUM_EXPERTS, TOP_K, Outcome, bias, logits
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer
from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

import oea.integrations.vllm as plugin
import oea.integrations.vllm.plugin as plugin_hooks
from oea.integrations.vllm.state import STATE, State
from oea.integrations.vllm.steps import begin_step, end_step

ROUTER_ARGS = {
    "softmax-renorm": {"renormalize": True},
    "softmax": {"renormalize": False},
    "sigmoid-grouped": {"use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2, "renormalize": True,
                        "scoring_func": "sigmoid", "routed_scaling_factor": 2.5},
}


def _fresh_state() -> None:
    """A new process's state, keeping what the first ``register`` wrapped (the classes stay wrapped) and the
    step count (steps are numbered once per process; the hot path caches per step)."""
    originals, step = STATE.originals, STATE.step
    for f in dataclasses.fields(State):
        setattr(STATE, f.name, getattr(State(), f.name))
    STATE.originals, STATE.step = originals, step


def _model(family: str) -> torch.nn.Module:
    """``model.layers.<i>.mlp.router``: vLLM's own CPU router of ``family`` in every MoE layer."""
    args = dict(ROUTER_ARGS[family])
    if family == "sigmoid-grouped":
        args["e_score_correction_bias"] = bias()
    layers = torch.nn.ModuleList()
    for _ in range(LAYERS):
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.router = CPURouter(top_k=TOP_K, global_num_experts=NUM_EXPERTS, **args)
        layers.append(block)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = layers
    return model


def _capturer(rows: int) -> RoutedExpertsCapturer:
    """vLLM's capturer with a buffer for ``rows`` tokens of every MoE layer (one rank: no data parallelism)."""
    capturer = RoutedExpertsCapturer.__new__(RoutedExpertsCapturer)
    capturer.shape_per_token = (LAYERS, TOP_K)
    capturer.device_buffer = torch.full((rows, LAYERS, TOP_K), -1, dtype=torch.int32)
    capturer.dp_rank, capturer.tp_size = 0, 1
    return capturer


def run(scenario: dict[str, Any]) -> Outcome:
    _fresh_state()
    try:
        plugin.register()
        model = _model(scenario["family"])
        plugin_hooks._after_load(model)
    except ValueError as err:
        return Outcome("error", str(err))
    rows, padding = scenario["rows"], scenario["padding"]
    step = types.SimpleNamespace(num_scheduled_tokens={f"r{i}": 1 for i in range(rows - padding)},
                                 total_num_scheduled_tokens=rows - padding, scheduled_spec_decode_tokens={})
    is_padding = torch.arange(rows) >= rows - padding
    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}, is_padding=is_padding)
    layers = []
    capturer = _capturer(rows)
    begin_step(step)
    try:
        with override_forward_context(context):
            for position, block in enumerate(model.model.layers):
                router = block.mlp.router
                router.set_capture_fn(functools.partial(capturer.capture, position))
                weights, ids = router._select_experts(torch.zeros(rows, 8), logits(rows, position))
                layers.append(routed(ids, weights, STATE.specs[position], capturer.device_buffer[:, position]))
    finally:
        end_step()
    return Outcome("routed", layers=layers)


if __name__ == "__main__":
    main(run, ("vllm.oea", "vllm"))
