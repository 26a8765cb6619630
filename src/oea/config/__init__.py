"""Configuration from the environment, shared by every engine adapter.

Modules: ``variables`` (the table of every ``OEA_*`` variable: name, alias, parser, help; the settings, the
doctor's checks and docs/configuration.md derive from it), ``settings`` (what the adapters read:
``settings_from_env``, ``trace_settings_from_env``, ...), ``unknown`` (the warning about ``OEA_*`` names OEA
does not read: ``warn_unknown_variables``), ``layer_file`` (the per-layer k0 file, and every layer's routing
config from the environment: ``layer_configs``). The doctor's check of the environment lives beside the doctors
(``oea.integrations.doctor.env``).
"""

from oea.config.layer_file import (
    check_k0_against,
    k0_variable,
    layer_configs,
    layer_k0_policies,
    layer_k0_schedule,
    read_layer_k0_file,
    write_layer_k0_file,
)
from oea.config.settings import (
    EnvSettings,
    TraceSettings,
    metrics_flush_interval,
    settings_from_env,
    timing_from_env,
    trace_settings_from_env,
)
from oea.config.unknown import warn_unknown_variables
from oea.config.variables import (
    ALIASES,
    POLICIES,
    TRACE_CONTENTS,
    VARIABLES,
    Variable,
    blank_note,
    blank_variables,
    k0_note,
)

__all__ = [
    "ALIASES",
    "POLICIES",
    "TRACE_CONTENTS",
    "VARIABLES",
    "EnvSettings",
    "TraceSettings",
    "Variable",
    "blank_note",
    "blank_variables",
    "check_k0_against",
    "k0_note",
    "k0_variable",
    "layer_configs",
    "layer_k0_policies",
    "layer_k0_schedule",
    "metrics_flush_interval",
    "read_layer_k0_file",
    "settings_from_env",
    "timing_from_env",
    "trace_settings_from_env",
    "warn_unknown_variables",
    "write_layer_k0_file",
]
