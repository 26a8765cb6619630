"""``oea doctor``'s check of the environment: every ``OEA_*`` variable that can be checked without a model.

Each set variable is parsed by its row of ``oea.config.variables`` (the parser the engines use, so a value
this accepts is one the engines accept) and shown in its words; the files are checked further (the
per-layer k0 file readable, well-formed and fitting the other variables; the metrics and trace files'
folders writable); a variable and its alias must agree; an unknown name is reported with the closest one.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

from oea.config.layer_file import k0_variable, layer_k0_policies, read_layer_k0_file
from oea.config.settings import settings_from_env
from oea.config.variables import (
    ALIASES,
    BY_NAME,
    SCRIPT_VARIABLES,
    VARIABLES,
    blank_note,
    blank_variables,
    variable_of,
)
from oea.routing import k0_error

KNOWN = [name for v in VARIABLES for name in (v.name, v.alias) if name]
# Variables that do nothing without OEA_K0 (the doctor says so when it is unset).
NEED_K0 = ("OEA_MIN_BATCH", "SGLANG_OEA_MIN_BATCH", "OEA_MAX_EXPERTS", "OEA_GROUP_FILL", "OEA_APPLY_TO_VERIFY",
           "OEA_POLICY")


@dataclass(frozen=True)
class EnvCheck:
    """One finding of ``check_environment``: the variable(s) it is about, whether it is fine, and why."""

    name: str
    ok: bool
    detail: str


def check_environment(env: Mapping[str, str] | None = None) -> list[EnvCheck]:
    """Check every ``OEA_*`` / ``SGLANG_OEA_*`` variable that is set, as far as possible without a model.
    Never raises."""
    env = os.environ if env is None else env
    names = sorted(var for var in env if var.startswith(("OEA_", "SGLANG_OEA_")))
    blank = [EnvCheck(var, True, blank_note([var])) for var in blank_variables(env)]
    if not [var for var in names if env[var].strip()]:
        said = "none set to a value" if blank else "none set"
        return [EnvCheck("OEA_*", True, f"{said}: OEA is off and the engines are left alone"), *blank]
    checks = [_check_variable(env, var) for var in names if var in KNOWN and env[var].strip()] + blank
    checks += [EnvCheck(var, True, f"not read by OEA routing ({SCRIPT_VARIABLES[var]})")
               for var in names if var in SCRIPT_VARIABLES]
    checks += [_unknown_variable(var) for var in names if var not in KNOWN and var not in SCRIPT_VARIABLES]
    checks += _alias_checks(env, checks)
    try:
        settings = settings_from_env(env)
    except ValueError as err:  # two variables that disagree, or a combination (OEA_MAX_EXPERTS < OEA_K0)
        if all(c.ok for c in checks):
            checks.append(EnvCheck("OEA_* together", False, str(err)))
        return checks
    if settings.oea is None and settings.layer_k0_file is None:
        idle = [c.name for c in checks if c.ok and c.name in NEED_K0]
        if idle:
            verb = "has" if len(idle) == 1 else "have"
            checks.append(EnvCheck("OEA_K0", True, f"unset: OEA is off, so {', '.join(idle)} {verb} no effect"))
    return checks


def _check_variable(env: Mapping[str, str], var: str) -> EnvCheck:
    raw = env[var].strip()
    row = variable_of(var)
    assert row is not None
    try:
        value = row.parse(var, raw)
        if var in ("OEA_METRICS_FILE", "OEA_TRACE_FILE"):
            detail = _check_output_file(var, value)
        elif var == "OEA_LAYER_K0_FILE":
            detail = _check_layer_k0_file(env, value)
        elif var.startswith("OEA_TRACE_") and not env.get("OEA_TRACE_FILE", "").strip():
            detail = "no effect: OEA_TRACE_FILE is unset"
        else:
            detail = row.shows(value)
    except (OSError, ValueError) as err:
        return EnvCheck(var, False, str(err))
    if var in ALIASES.values():
        detail += f" (alias of {row.name})"
    return EnvCheck(var, True, detail)


def _alias_checks(env: Mapping[str, str], found: list[EnvCheck]) -> list[EnvCheck]:
    """A variable and its alias both set (each well-formed): the same value is fine, two values are refused."""
    checks = []
    bad = {c.name for c in found if not c.ok}
    for var, alias in ALIASES.items():
        if env.get(var, "").strip() and env.get(alias, "").strip() and not {var, alias} & bad:
            try:
                checks.append(EnvCheck(f"{var} / {alias}", True, f"both {BY_NAME[var].value(env)}: one setting"))
            except ValueError as err:
                checks.append(EnvCheck(f"{var} / {alias}", False, str(err)))
    return checks


def _check_output_file(var: str, path: str) -> str:
    """A file the engine writes (``OEA_METRICS_FILE`` appended to, ``OEA_TRACE_FILE`` replaced): writable."""
    target, folder = pathlib.Path(path), pathlib.Path(path).parent
    if target.is_dir():
        raise ValueError(f"{var}={path!r} is a folder; name a file to write to")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{var}={path!r}: {str(folder)!r} is a file, not a folder")
    if not folder.is_dir():
        raise ValueError(f"{var}={path!r}: folder {str(folder)!r} does not exist")
    if not os.access(target if target.exists() else folder, os.W_OK) or not os.access(folder, os.W_OK):
        raise ValueError(f"{var}={path!r} is not writable")
    if var == "OEA_METRICS_FILE":
        return f"{path} ({'exists, lines are appended' if target.exists() else 'created on the first step'})"
    return f"{path} ({'exists, replaced' if target.exists() else 'written'} when the server stops or at the cap)"


def _check_layer_k0_file(env: Mapping[str, str], path: str) -> str:
    """Readable, well-formed, and fitting the other variables (``layer_k0_policies`` on the file's own model)."""
    try:
        schedule = read_layer_k0_file(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"OEA_LAYER_K0_FILE={path!r}: {err}") from None
    try:
        settings = settings_from_env(env)
    except ValueError:
        settings = None  # reported against the variable that is wrong
    if settings is not None:
        layer_k0_policies(settings, schedule.num_experts, schedule.top_k, schedule.num_layers)
        if settings.oea is not None and settings.oea.k0 > schedule.top_k:
            raise ValueError(k0_error(k0_variable(settings), settings.oea.k0, schedule.top_k))
    return f"{path}: {schedule.describe()}"


def _unknown_variable(var: str) -> EnvCheck:
    import difflib

    close = difflib.get_close_matches(var, [*KNOWN, *SCRIPT_VARIABLES], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return EnvCheck(var, False, f"unknown variable: {hint}OEA reads {', '.join(KNOWN)}")
