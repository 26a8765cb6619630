"""The conformance table through ``oea.maybe_attach`` on tiny transformers models (run in .venv).

Each family is a tiny model of the matching transformers family whose router weight reproduces the table's
logits: ``weight = [I_N | 0]`` and the router input ``[logits | 0]``. The routing the experts get is read
by a pre-hook on each block's ``experts`` module in a decode forward (block input ``[B, 1, H]``).
"""

from __future__ import annotations

from typing import Any

import torch
from conformance_child import main, routed
from conformance_scenarios import LAYERS, NUM_EXPERTS, TOP_K, Outcome, bias, logits

from oea import maybe_attach
from oea.integrations.transformers.routers import find_moe_layers
from oea.testing import tiny_moe

MODEL_FAMILY = {"softmax-renorm": "qwen3_moe", "softmax": "olmoe", "sigmoid-grouped": "deepseek_v3"}
_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    model = _MODELS.get(family)
    if model is None:
        model = tiny_moe(MODEL_FAMILY[family], num_layers=LAYERS, num_experts=NUM_EXPERTS, top_k=TOP_K)
        for layer in find_moe_layers(model):
            weight = layer.router.weight
            with torch.no_grad():
                weight.copy_(torch.eye(weight.shape[0], weight.shape[1]))
                for owner in (layer.router, layer.block):
                    if hasattr(owner, "e_score_correction_bias"):
                        owner.e_score_correction_bias.copy_(bias())
                        break
        _MODELS[family] = model
    return model


def run(scenario: dict[str, Any]) -> Outcome:
    model = _model(scenario["family"])
    try:
        handle = maybe_attach(model)
    except ValueError as err:
        return Outcome("error", str(err))
    assert handle is not None, "maybe_attach left the model alone"
    try:
        layers = []
        for position, layer in enumerate(handle.layers):
            seen: dict[str, torch.Tensor] = {}

            def capture(module: Any, args: tuple, kwargs: dict, seen: dict = seen) -> None:
                values = [*args, *kwargs.values()]
                seen["ids"], seen["weights"] = values[1], values[2]

            hook = layer.block.experts.register_forward_pre_hook(capture, with_kwargs=True)
            try:
                x = logits(scenario["rows"], position)
                hidden = torch.zeros(x.shape[0], 1, layer.router.weight.shape[1])
                hidden[:, 0, : x.shape[1]] = x
                with torch.no_grad():
                    layer.block(hidden)
            finally:
                hook.remove()
            layers.append(routed(seen["ids"], seen["weights"], layer.spec, seen["ids"]))  # no capture: the ids run
        return Outcome("routed", layers=layers)
    finally:
        handle.remove()


if __name__ == "__main__":
    main(run, ("oea",))
