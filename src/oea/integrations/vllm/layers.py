"""Per-layer k0 in the vLLM plugin (``OEA_LAYER_K0_FILE``, written by ``oea calibrate``), optionally per
batch-size range: the vLLM side of ``oea.routing.LayerConfigs``.

``load`` (model load) builds the layers' configs for the model's MoE routers (router id = MoE layer position,
in model order; the decoder-layer number is read from the layer's name for files that list ``layer_ids``) and
stops start-up naming the variable when the settings do not fit the model. The hot path asks each router's
``router_state.RouterState.config`` (the router's file entry is kept there); ``layer_config`` gives the same
answer for any base config. M is the call's row count: on CPU the custom op sees it on every call; under
CUDA graphs it is the captured graph's (padded) batch size, a static shape, so the choice is made when the
graph is captured and costs nothing at replay (no host synchronisation).
"""

from __future__ import annotations

import re
from typing import Any

from oea.config import layer_configs
from oea.integrations.vllm.router_state import router_state
from oea.integrations.vllm.state import STATE, log
from oea.routing import RouterSpec

_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def load(specs: list[RouterSpec | None]) -> None:
    """Build the routers' configs (``specs``: one per numbered router, None = stock layer).

    Raises ``ValueError`` naming the variable when k0 / ``OEA_MAX_EXPERTS`` exceed a router's top_k, when the
    file was calibrated for another model or does not fit ``OEA_MAX_EXPERTS``, or when it has no entry for a
    layer; nothing happens when OEA is off.
    """
    settings = STATE.settings
    STATE.layers = None
    for router_id in range(min(len(specs), len(STATE.routers))):
        router_state(router_id).layer_entry = None
    if settings is None or settings.oea is None:
        return
    configs = layer_configs(settings)
    for spec in specs:
        if spec is not None:
            configs.check_model(spec.num_experts, spec.top_k, len(specs) if configs.schedule is not None else None)
    if configs.schedule is not None:
        entries = [configs.index(layer_id=layer_number(name), position=router_id)
                   for router_id, name in enumerate(_names(len(specs)))]
        for router_id, entry in enumerate(entries[:len(STATE.routers)]):
            router_state(router_id).layer_entry = entry
        log.info("oea: per-layer k0 from OEA_LAYER_K0_FILE=%s: %s", settings.layer_k0_file, configs.describe())
    STATE.layers = configs


def _names(count: int) -> list[str]:
    """The module name of each numbered router's layer (``plugin._after_load`` sets ``_oea_layer``)."""
    names = [str(getattr(router, "_oea_layer", "")) for router in STATE.routers[:count]]
    return names + [""] * (count - len(names))


def layer_number(name: str) -> int | None:
    """The decoder-layer number in a module name (``model.layers.3.mlp.experts`` -> 3), or None."""
    found = _LAYER_NUMBER.search(name)
    return None if found is None else int(found.group(1))


def layer_config(router_id: int | None, rows: int, default: Any) -> Any:
    """The config of router ``router_id`` for a call of ``rows`` rows: ``default`` (``OEA_K0``'s, or the EP
    policy's) with the layer's k0 and ``min_batch`` for this batch size; ``default`` itself without the
    file, for unnumbered routers, or when OEA is off."""
    configs = STATE.layers
    if configs is None or default is None or router_id is None:
        return default
    return configs.config(router_state(router_id).layer_entry, rows, default)
