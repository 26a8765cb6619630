"""``attach`` (a config in code) and ``maybe_attach`` (a config from the ``OEA_*`` environment)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch import nn

from oea.config import (
    ALIASES,
    EnvSettings,
    check_k0_against,
    layer_k0_schedule,
    read_layer_k0_file,
    settings_from_env,
)
from oea.integrations.transformers.handle import ATTACHED, OEAHandle
from oea.integrations.transformers.routers import MoELayer, find_moe_layers
from oea.routing import OEAConfig, RouterSpec


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

    Returns:
        An ``OEAHandle``; ``handle.remove()`` restores the model.

    Raises:
        ValueError: no MoE blocks, an unsupported router class, a config that does not fit a
            layer (e.g. k0 > top_k), an unknown layer index, or a model already attached.
    """
    if not isinstance(decode_only, bool):
        raise ValueError(f"decode_only must be a bool, got {decode_only!r}")
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
    handle = OEAHandle(layers, configs, decode_only)
    try:
        handle._install()
    except BaseException:
        handle.remove()  # leave no half-installed hooks behind, then let the error through
        raise
    return handle


def maybe_attach(model: nn.Module, env: Mapping[str, str] | None = None) -> OEAHandle | None:
    """``attach`` configured from the environment; None when neither ``OEA_K0`` (alias ``SGLANG_OEA_K0``)
    nor ``OEA_LAYER_K0_FILE`` is set.

    Reads ``OEA_K0``, ``OEA_MIN_BATCH`` (aliases ``SGLANG_OEA_*``), ``OEA_MAX_EXPERTS``,
    ``OEA_GROUP_FILL`` and ``OEA_LAYER_K0_FILE`` (see ``oea.config``). A per-layer k0 file
    (``oea.routing.LayerK0Schedule`` JSON, one k0 per MoE layer in model order) sets each layer's
    k0; its ``min_batch`` applies unless ``OEA_MIN_BATCH`` is set.

    Raises:
        ValueError: a malformed variable, k0 / max_experts larger than the model's top_k, or a
            per-layer k0 file that is missing or made for another model (the message names the variable).
    """
    env = os.environ if env is None else env
    settings = settings_from_env(env)
    if not _attaches(settings):
        return None
    layers = find_moe_layers(model)
    top_k = min(layer.spec.top_k for layer in layers)
    cfg = settings.oea
    if cfg is not None:
        source = settings.source or {}
        check_k0_against(cfg, top_k, variable="OEA_K0" if "OEA_K0" in source else ALIASES["OEA_K0"])
        if cfg.max_experts is not None and cfg.max_experts > top_k:
            raise ValueError(
                f"OEA_MAX_EXPERTS must be in {cfg.k0}..{top_k} (the model's top_k), got {cfg.max_experts}"
            )
    layer_configs = None
    if settings.layer_k0_file is not None:
        layer_configs = _layer_configs_from_file(settings.layer_k0_file, layers, env, settings.source or {}, cfg)
    return attach(model, cfg, layer_configs=layer_configs)


def _layer_configs_from_file(
    path: str, layers: list[MoELayer], env: Mapping[str, str], source: Mapping[str, str], base: OEAConfig | None
) -> dict[int, object | None]:
    """``OEA_LAYER_K0_FILE`` -> ``{layer_index: OEAConfig}``; errors name the variable and the file."""
    where = f"OEA_LAYER_K0_FILE={path}"
    try:
        schedule = read_layer_k0_file(path)
        spec = layers[0].spec
        schedule.check_model(spec.num_experts, spec.top_k, len(layers))
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{where}: {err}") from err
    min_batch_var = next((v for v in ("OEA_MIN_BATCH", ALIASES["OEA_MIN_BATCH"]) if v in source), None)
    min_batch = schedule.min_batch if min_batch_var is None else int(source[min_batch_var])
    group_fill = env.get("OEA_GROUP_FILL", "").strip() or "in"  # already validated by settings_from_env
    max_experts = None if base is None else base.max_experts
    configs: dict[int, object | None] = {}
    for position, layer in enumerate(layers):
        k0 = schedule.k0[position]
        try:
            configs[layer.index] = OEAConfig(k0, max_experts=max_experts, min_batch=min_batch,
                                             group_fill=group_fill)  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"{where} with OEA_MAX_EXPERTS={max_experts}: layer {layer.index}: {err}") from None
    return configs


def _attaches(settings: EnvSettings) -> bool:
    """Whether ``maybe_attach`` attaches with these settings (it returns None otherwise)."""
    return settings.oea is not None or settings.layer_k0_file is not None


def describe_environment(env: Mapping[str, str] | None = None) -> str:
    """What ``maybe_attach`` would do with this environment, checked as far as it can be without a model.

    Raises ``ValueError`` naming the variable where ``maybe_attach`` would raise for any model: a malformed
    variable, an unreadable or malformed ``OEA_LAYER_K0_FILE``, ``OEA_K0`` above the file's top_k.
    """
    settings = settings_from_env(os.environ if env is None else env)
    if not _attaches(settings):
        return "OEA_K0 and OEA_LAYER_K0_FILE unset: maybe_attach() leaves models alone"
    schedule = layer_k0_schedule(settings)
    if schedule is None:
        return f"maybe_attach() attaches {settings.oea} to every MoE layer"
    if settings.oea is not None:
        source = settings.source or {}
        check_k0_against(settings.oea, schedule.top_k, "OEA_K0" if "OEA_K0" in source else ALIASES["OEA_K0"])
    min_batch = schedule.min_batch if settings.min_batch is None else settings.min_batch
    ignored = "; its batch_k0 ranges are not read (each layer's k0 at every batch size)" if schedule.batch_k0 else ""
    return (f"maybe_attach() attaches each layer's k0 from OEA_LAYER_K0_FILE={settings.layer_k0_file} "
            f"(models with {schedule.num_layers} MoE layers, {schedule.num_experts} experts, top_k {schedule.top_k}; "
            f"min_batch {min_batch}){ignored}")
