"""The per-layer k0 file (``OEA_LAYER_K0_FILE``, ``oea.routing.LayerK0Schedule`` JSON): reading and writing it,
and every layer's routing config from the environment (``layer_configs``: ``oea.routing.LayerConfigs``).
"""

from __future__ import annotations

import os

from oea.config.settings import EnvSettings
from oea.config.variables import ALIASES
from oea.routing.layered import LayerConfigs, k0_error
from oea.routing.schedules import AdaptiveK0Config, LayerK0Schedule
from oea.routing.spec import OEAConfig


def read_layer_k0_file(path: str | os.PathLike[str]) -> LayerK0Schedule:
    """Read an ``OEA_LAYER_K0_FILE`` (``LayerK0Schedule.to_json`` form).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file and the field
    for bad JSON or a bad field.
    """
    import json
    import pathlib

    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"per-layer k0 file {path} is a directory; give the JSON file oea calibrate writes")
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


def k0_variable(settings: EnvSettings) -> str:
    """The variable that set k0: ``OEA_K0``, or its alias when only that was set."""
    return ALIASES["OEA_K0"] if ALIASES["OEA_K0"] in (settings.source or {}) else "OEA_K0"


def layer_configs(settings: EnvSettings) -> LayerConfigs:
    """Every layer's routing config as the environment asks (``OEA_K0``, ``OEA_LAYER_K0_FILE``, ``OEA_MIN_BATCH``,
    ``OEA_MAX_EXPERTS``, ``OEA_GROUP_FILL``): ``oea.routing.LayerConfigs``, the rule every adapter routes by.

    Reads the file; errors name the variable and the file. The file without ``OEA_K0`` is refused: OEA is on
    only with ``OEA_K0`` in every engine, and a file that would silently not be used is a mistake.
    """
    configs = _layer_configs(settings)
    if configs.schedule is not None and settings.oea is None:
        raise ValueError(f"OEA_LAYER_K0_FILE={settings.layer_k0_file!r} is set but OEA_K0 is not: OEA is off without "
                         "OEA_K0; set OEA_K0 to turn it on (the file then sets each layer's k0), or unset the file")
    return configs


def _layer_configs(settings: EnvSettings) -> LayerConfigs:
    return LayerConfigs(settings.oea, layer_k0_schedule(settings), min_batch=settings.min_batch,
                        max_experts=settings.max_experts, group_fill=settings.group_fill,  # type: ignore[arg-type]
                        where=f"OEA_LAYER_K0_FILE={settings.layer_k0_file!r}", k0_variable=k0_variable(settings))


def layer_k0_policies(
    settings: EnvSettings, num_experts: int, top_k: int, num_layers: int
) -> list[OEAConfig | AdaptiveK0Config] | None:
    """One routing config per MoE layer (model order) from ``OEA_LAYER_K0_FILE``; ``None`` when unset.

    Raises ``ValueError`` naming the variable and the file when the file is missing, malformed or
    calibrated for another model, or when ``OEA_MAX_EXPERTS`` is below a layer's k0.
    """
    configs = _layer_configs(settings)  # the file on its own (oea calibrate, the doctor): OEA_K0 not needed
    if configs.schedule is None:
        return None
    configs.check_model(num_experts, top_k, num_layers)
    return configs.layers()


def check_k0_against(cfg: OEAConfig, top_k: int, variable: str = "OEA_K0") -> None:
    """Raise ``ValueError`` naming ``variable`` when k0 does not fit a model's top_k."""
    if cfg.k0 > top_k:
        raise ValueError(k0_error(variable, cfg.k0, top_k))
