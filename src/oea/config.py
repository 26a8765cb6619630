"""Environment configuration shared by every engine adapter.

Variables (the ``SGLANG_OEA_*`` names are aliases kept from the reference SGLang deployment):

==========================  ==========================  =============================================
variable                    alias                       meaning
==========================  ==========================  =============================================
``OEA_K0``                  ``SGLANG_OEA_K0``           baseline experts per token; unset/empty = off
``OEA_MIN_BATCH``           ``SGLANG_OEA_MIN_BATCH``    vanilla routing below this many rows (2)
``OEA_MAX_EXPERTS``                                     cap per token after piggybacking (top_k)
``OEA_GROUP_FILL``                                      ``in`` or ``cross`` (grouped routers only)
``OEA_APPLY_TO_VERIFY``                                 ``1`` also reroutes speculative verify steps
``OEA_LAYER_K0_FILE``                                   k0 per layer, optionally per batch-size range
                                                        (``LayerK0Schedule`` JSON; ``layer_k0_policies``)
``OEA_METRICS_FILE``                                    where engine plugins write active-expert counts
==========================  ==========================  =============================================

A malformed value raises ``ValueError`` naming the variable, at plugin start-up: serving with a
silently wrong configuration is worse than not starting.

Reading ``OEA_LAYER_K0_FILE`` is one call for every engine: ``layer_k0_policies(settings, num_experts,
top_k, num_layers)`` returns one routing config per MoE layer (``OEAConfig``, or ``AdaptiveK0Config``
when the file holds a per-batch-size schedule), built with ``OEA_MIN_BATCH``, ``OEA_MAX_EXPERTS`` and
``OEA_GROUP_FILL``; engines that meet layers one at a time use ``layer_k0_schedule(settings)`` and
``schedule.config_for_layer(schedule.index_of_layer_id(layer_id), **layer_config_options(settings))``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from oea.routing.schedules import AdaptiveK0Config, LayerK0Schedule
from oea.routing.spec import GROUP_FILLS, OEAConfig

ALIASES: dict[str, str] = {"OEA_K0": "SGLANG_OEA_K0", "OEA_MIN_BATCH": "SGLANG_OEA_MIN_BATCH"}


@dataclass(frozen=True)
class EnvSettings:
    """What the environment asks for. ``oea`` is None when OEA is off."""

    oea: OEAConfig | None
    apply_to_verify: bool = False
    layer_k0_file: str | None = None
    metrics_file: str | None = None
    source: dict[str, str] | None = None  # variable -> raw value actually read
    min_batch: int | None = None  # OEA_MIN_BATCH when set (also without OEA_K0)
    max_experts: int | None = None  # OEA_MAX_EXPERTS when set
    group_fill: str = "in"  # OEA_GROUP_FILL


def _lookup(env: Mapping[str, str], name: str) -> tuple[str, str] | None:
    """(variable actually used, value); the primary name wins over its alias."""
    for var in (name, ALIASES.get(name)):
        if var and env.get(var, "").strip() != "":
            return var, env[var].strip()
    return None


def _int(env: Mapping[str, str], name: str, minimum: int) -> tuple[str, int] | None:
    found = _lookup(env, name)
    if found is None:
        return None
    var, raw = found
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{var} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{var} must be an integer >= {minimum}, got {value}")
    return var, value


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be one of 0/1/true/false/yes/no/on/off, got {env[name]!r}")


def _path(env: Mapping[str, str], name: str) -> str | None:
    """A file-path variable, stripped like every other variable; blank means unset."""
    return env.get(name, "").strip() or None


def settings_from_env(env: Mapping[str, str] | None = None) -> EnvSettings:
    """Parse ``OEA_*`` (and the ``SGLANG_OEA_*`` aliases). Raises ``ValueError`` naming a bad variable."""
    env = os.environ if env is None else env
    source: dict[str, str] = {}
    k0 = _int(env, "OEA_K0", 1)
    min_batch = _int(env, "OEA_MIN_BATCH", 0)
    max_experts = _int(env, "OEA_MAX_EXPERTS", 1)
    for found in (k0, min_batch, max_experts):
        if found is not None:
            source[found[0]] = env[found[0]]
    group_fill = env.get("OEA_GROUP_FILL", "").strip() or "in"
    if group_fill not in GROUP_FILLS:
        raise ValueError(f"OEA_GROUP_FILL must be one of {GROUP_FILLS}, got {group_fill!r}")
    cfg = None
    if k0 is not None:
        try:
            cfg = OEAConfig(
                k0=k0[1],
                max_experts=None if max_experts is None else max_experts[1],
                min_batch=2 if min_batch is None else min_batch[1],
                group_fill=group_fill,  # type: ignore[arg-type]
            )
        except ValueError as err:
            raise ValueError(f"invalid OEA environment ({', '.join(source)}): {err}") from None
    return EnvSettings(
        oea=cfg,
        apply_to_verify=_flag(env, "OEA_APPLY_TO_VERIFY"),
        layer_k0_file=_path(env, "OEA_LAYER_K0_FILE"),
        metrics_file=_path(env, "OEA_METRICS_FILE"),
        source=source,
        min_batch=None if min_batch is None else min_batch[1],
        max_experts=None if max_experts is None else max_experts[1],
        group_fill=group_fill,
    )


def read_layer_k0_file(path: str | os.PathLike[str]) -> LayerK0Schedule:
    """Read an ``OEA_LAYER_K0_FILE`` (``LayerK0Schedule.to_json`` form).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file and the field
    for bad JSON or a bad field.
    """
    import json
    import pathlib

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"per-layer k0 file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"per-layer k0 file {path}: not valid JSON ({err})") from None
    return LayerK0Schedule.from_json(data, str(path))


def write_layer_k0_file(schedule: LayerK0Schedule, path: str | os.PathLike[str]) -> None:
    """Write ``schedule`` as an ``OEA_LAYER_K0_FILE`` (JSON)."""
    import json
    import pathlib

    pathlib.Path(path).write_text(json.dumps(schedule.to_json(), indent=2) + "\n")


def layer_k0_schedule(settings: EnvSettings) -> LayerK0Schedule | None:
    """The schedule in ``OEA_LAYER_K0_FILE`` (``None`` when unset); errors name the variable and the file."""
    if not settings.layer_k0_file:
        return None
    try:
        return read_layer_k0_file(settings.layer_k0_file)
    except (OSError, ValueError) as err:
        raise ValueError(f"OEA_LAYER_K0_FILE={settings.layer_k0_file!r}: {err}") from None


def layer_config_options(settings: EnvSettings) -> dict[str, object]:
    """``LayerK0Schedule.config_for_layer`` keywords from the environment (min_batch, max_experts, group_fill)."""
    return {"min_batch": settings.min_batch, "max_experts": settings.max_experts, "group_fill": settings.group_fill}


def layer_k0_policies(
    settings: EnvSettings, num_experts: int, top_k: int, num_layers: int
) -> list[OEAConfig | AdaptiveK0Config] | None:
    """One routing config per MoE layer (model order) from ``OEA_LAYER_K0_FILE``; ``None`` when unset.

    Raises ``ValueError`` naming the variable and the file when the file is missing, malformed or
    calibrated for another model, or when ``OEA_MAX_EXPERTS`` is below a layer's k0.
    """
    schedule = layer_k0_schedule(settings)
    if schedule is None:
        return None
    where = f"OEA_LAYER_K0_FILE={settings.layer_k0_file!r}"
    try:
        schedule.check_model(num_experts, top_k, num_layers)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    options = layer_config_options(settings)
    policies: list[OEAConfig | AdaptiveK0Config] = []
    for layer in range(num_layers):
        try:
            policies.append(schedule.config_for_layer(layer, **options))  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"{where} with OEA_MAX_EXPERTS={settings.max_experts}: layer {layer}: {err}") from None
    return policies


def check_k0_against(cfg: OEAConfig, top_k: int, variable: str = "OEA_K0") -> None:
    """Raise ``ValueError`` naming ``variable`` when k0 does not fit a model's top_k."""
    if cfg.k0 > top_k:
        raise ValueError(f"{variable} must be in 1..{top_k} (the model's top_k), got {cfg.k0}")
