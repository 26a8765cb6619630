"""``attach`` (a config in code) and ``maybe_attach`` (a config from the ``OEA_*`` environment)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from torch import nn

from oea.config import blank_note, blank_variables, k0_note, layer_configs, settings_from_env, warn_unknown_variables
from oea.integrations.transformers.handle import ATTACHED, OEAHandle
from oea.integrations.transformers.routers import find_moe_layers
from oea.routing import RouterSpec


def _check_cfg(cfg: object | None, spec: RouterSpec, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` when a config does not fit a layer (e.g. k0 > top_k)."""
    check = getattr(cfg, "check", None)
    if check is None:
        return
    try:
        check(spec)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def attach(
    model: nn.Module,
    cfg: object | None,
    *,
    decode_only: bool = True,
    layer_configs: Mapping[int, object | None] | None = None,
    decode_tokens: int = 1,
) -> OEAHandle:
    """Hook OEA routing into every MoE block of a transformers model.

    Args:
        model: any ``nn.Module`` holding MoE blocks (``gate``/``router`` + ``experts`` children).
        cfg: a config ``oea.route`` accepts (``OEAConfig``, ``PrunedConfig``, ...) or None (vanilla
            routing passed through, decode steps still counted).
        decode_only: reroute only decode steps (block input ``[B, 1, H]``); False reroutes every
            forward, prefill included.
        layer_configs: ``{layer_index: config}`` overriding ``cfg`` for those MoE layers (see
            ``MoELayer.index``); a value of None leaves that layer vanilla.
        decode_tokens: a forward of at most this many tokens per sequence is a decode step (1: plain decode;
            1 + d: a speculative verify step of d draft tokens, whose B (1 + d) rows OEA routes together).

    Returns:
        An ``OEAHandle``; ``handle.remove()`` restores the model.

    Raises:
        ValueError: no MoE blocks, an unsupported router class, a config that does not fit a
            layer (e.g. k0 > top_k), an unknown layer index, or a model already attached.
    """
    if not isinstance(decode_only, bool):
        raise ValueError(f"decode_only must be a bool, got {decode_only!r}")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens < 1:
        raise ValueError(f"decode_tokens must be an integer >= 1, got {decode_tokens!r}")
    layers = find_moe_layers(model)
    by_index = {layer.index: layer for layer in layers}
    overrides = dict(layer_configs or {})
    unknown = sorted(set(overrides) - set(by_index), key=str)
    if unknown:
        raise ValueError(f"layer_configs has unknown MoE layer indices {unknown}; valid: {sorted(by_index)}")
    configs: dict[int, object | None] = {}
    for layer in layers:
        layer_cfg = overrides.get(layer.index, cfg)
        _check_cfg(layer_cfg, layer.spec, f"MoE layer {layer.index} ({layer.name})")
        configs[layer.index] = layer_cfg
    for layer in layers:
        if layer.router in ATTACHED:
            raise ValueError(
                f"an OEA handle is already attached to {layer.name}; call its remove() before attaching again"
            )
    handle = OEAHandle(layers, configs, decode_only, decode_tokens)
    try:
        handle._install()
    except BaseException:
        handle.remove()  # leave no half-installed hooks behind, then let the error through
        raise
    return handle


def maybe_attach(model: nn.Module, env: Mapping[str, str] | None = None) -> OEAHandle | None:
    """``attach`` configured from the environment; None when ``OEA_K0`` (alias ``SGLANG_OEA_K0``) is unset.

    Reads ``OEA_K0``, ``OEA_MIN_BATCH`` (aliases ``SGLANG_OEA_*``), ``OEA_MAX_EXPERTS``,
    ``OEA_GROUP_FILL`` and ``OEA_LAYER_K0_FILE`` (see ``oea.config``) and routes each layer by
    ``oea.routing.LayerConfigs``, as the engine plugins do: a per-layer k0 file
    (``oea.routing.LayerK0Schedule`` JSON) sets each layer's k0, per batch-size range when it has
    ``batch_k0``; its ``min_batch`` applies unless ``OEA_MIN_BATCH`` is set.

    Raises:
        ValueError: a malformed variable, k0 / max_experts larger than the model's top_k, a per-layer k0
            file that is missing, made for another model, without an entry for a layer, or set without
            ``OEA_K0`` (the message names the variable).
    """
    env = os.environ if env is None else env
    settings = settings_from_env(env)
    configs = layer_configs(settings)
    blank = blank_note(blank_variables(env))
    if blank:  # OEA_K0= is read as unset: said, as the engine plugins and the doctor say it
        warnings.warn(f"oea: {blank}", RuntimeWarning, stacklevel=2)
    warn_unknown_variables(env)  # OEA_K00=3 (a typo) would leave the model alone: said, not silent
    if settings.oea is None:
        return None
    layers = find_moe_layers(model)
    for layer in layers:
        configs.check_model(layer.spec.num_experts, layer.spec.top_k,
                            len(layers) if configs.schedule is not None else None)
    if configs.schedule is None:
        return attach(model, settings.oea)
    per_layer = {layer.index: configs.layer(configs.index(layer_id=layer.index, position=position))  # type: ignore[arg-type]
                 for position, layer in enumerate(layers)}
    return attach(model, settings.oea, layer_configs=per_layer)


def describe_environment(env: Mapping[str, str] | None = None) -> str:
    """What ``maybe_attach`` would do with this environment, checked as far as it can be without a model.

    Raises ``ValueError`` naming the variable where ``maybe_attach`` would raise for any model: a malformed
    variable, an unreadable or malformed ``OEA_LAYER_K0_FILE`` or one set without ``OEA_K0``, ``OEA_K0`` above
    the file's top_k.
    """
    env = os.environ if env is None else env
    settings = settings_from_env(env)
    configs = layer_configs(settings)
    schedule = configs.schedule
    if settings.oea is None:
        empty = " (set but empty)" if {"OEA_K0", "SGLANG_OEA_K0"} & set(blank_variables(env)) else ""
        return f"OEA_K0 unset{empty}: maybe_attach() leaves models alone"
    if schedule is None:
        note = k0_note(settings.oea.k0)
        return f"maybe_attach() attaches {settings.oea} to every MoE layer" + (f"; {note}" if note else "")
    configs.check_model(schedule.num_experts, schedule.top_k, schedule.num_layers)
    return (f"maybe_attach() attaches each layer's config from OEA_LAYER_K0_FILE={settings.layer_k0_file} "
            f"(models with {schedule.num_layers} MoE layers, {schedule.num_experts} experts, top_k {schedule.top_k}): "
            f"{configs.describe()}")
