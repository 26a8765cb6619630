"""Environment configuration shared by every engine adapter.

Variables (the ``SGLANG_OEA_*`` names are aliases kept from the reference SGLang deployment):

==========================  ==========================  =============================================
variable                    alias                       meaning
==========================  ==========================  =============================================
``OEA_K0``                  ``SGLANG_OEA_K0``           baseline experts per token; unset/empty = off
``OEA_MIN_BATCH``           ``SGLANG_OEA_MIN_BATCH``    vanilla routing below this many rows (2)
``OEA_MAX_EXPERTS``                                     cap per token after piggybacking (top_k)
``OEA_GROUP_FILL``                                      ``in`` or ``cross`` (grouped routers only)
``OEA_POLICY``                                          ``oea`` or ``ep`` (EP-aware OEA, engine placement)
``OEA_APPLY_TO_VERIFY``                                 ``1`` also reroutes speculative verify steps
``OEA_LAYER_K0_FILE``                                   k0 per layer, optionally per batch-size range
                                                        (``LayerK0Schedule`` JSON; ``layer_k0_policies``)
``OEA_METRICS_FILE``                                    where engine plugins write active-expert counts
``OEA_TIMING``                                          ``1`` times each routing call (vLLM plugin)
``OEA_METRICS_FLUSH_S``                                 seconds between metrics flushes (vLLM, 0.5)
``OEA_TRACE_FILE``                                      record decode-step routing to this oea-trace
``OEA_TRACE_SAMPLE``                                    share of decode steps recorded (1.0)
``OEA_TRACE_MAX_MB``                                    size cap of the recording in MB (1024)
``OEA_TRACE_CONTENT``                                   ``logits`` (full router logits) or ``topk``
==========================  ==========================  =============================================

A malformed value raises ``ValueError`` naming the variable, at plugin start-up: serving with a
silently wrong configuration is worse than not starting. A variable and its alias set to different
values (``OEA_K0=2 SGLANG_OEA_K0=5``) is refused the same way, naming both: which one was meant cannot
be known. Set to the same value, they are accepted.

``check_environment()`` checks every ``OEA_*`` variable that can be checked without a model (each value,
alias conflicts, the per-layer k0 file, the metrics and trace files' folders, unknown names with the closest known
one); ``oea doctor`` prints its findings and fails on a broken one. It parses with the same functions as
``settings_from_env``, so the two agree.

Reading ``OEA_LAYER_K0_FILE`` is one call for every engine: ``layer_k0_policies(settings, num_experts,
top_k, num_layers)`` returns one routing config per MoE layer (``OEAConfig``, or ``AdaptiveK0Config``
when the file holds a per-batch-size schedule), built with ``OEA_MIN_BATCH``, ``OEA_MAX_EXPERTS`` and
``OEA_GROUP_FILL``; engines that meet layers one at a time use ``layer_k0_schedule(settings)`` and
``schedule.config_for_layer(schedule.index_of_layer_id(layer_id), **layer_config_options(settings))``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from oea.routing.schedules import AdaptiveK0Config, LayerK0Schedule
from oea.routing.spec import GROUP_FILLS, OEAConfig

POLICIES = ("oea", "ep")  # OEA_POLICY: plain OEA, or EP-aware OEA on the engine's own expert placement
TRACE_CONTENTS = ("logits", "topk")  # full router logits, or the router's top-k ids and probabilities
ALIASES: dict[str, str] = {"OEA_K0": "SGLANG_OEA_K0", "OEA_MIN_BATCH": "SGLANG_OEA_MIN_BATCH"}
# Every variable OEA reads, with what it means (``check_environment`` names the closest one to a typo).
VARIABLES: dict[str, str] = {
    "OEA_K0": "baseline experts per token (integer >= 1); unset = OEA off",
    "SGLANG_OEA_K0": "alias of OEA_K0 (the reference SGLang deployment's name)",
    "OEA_MIN_BATCH": "vanilla routing below this many real rows (integer >= 0, default 2)",
    "SGLANG_OEA_MIN_BATCH": "alias of OEA_MIN_BATCH",
    "OEA_MAX_EXPERTS": "cap on experts per token after piggybacking (integer >= 1, default top_k)",
    "OEA_GROUP_FILL": f"grouped routers: piggyback {' or '.join(GROUP_FILLS)} the token's groups (default in)",
    "OEA_POLICY": f"{' or '.join(POLICIES)}: ep = EP-aware OEA on the engine's expert placement (default oea)",
    "OEA_APPLY_TO_VERIFY": "1: also reroute speculative verify steps",
    "OEA_LAYER_K0_FILE": "per-layer (and per-batch-size) k0 file written by oea calibrate",
    "OEA_METRICS_FILE": "JSONL file the engine plugins append active-expert counts to",
    "OEA_TIMING": "1: time each routing call in the vLLM worker",
    "OEA_METRICS_FLUSH_S": "seconds between metrics-file flushes in the vLLM worker (default 0.5)",
    "OEA_TRACE_FILE": "record decode-step routing from the engine to this .safetensors oea-trace",
    "OEA_TRACE_SAMPLE": "share of decode steps recorded, in (0, 1] (default 1.0)",
    "OEA_TRACE_MAX_MB": "recording stops when the trace reaches this many MB (default 1024)",
    "OEA_TRACE_CONTENT": f"what is recorded per token and layer: {' or '.join(TRACE_CONTENTS)} (default logits)",
}
# Variables of the project's scripts and tests; routing ignores them.
TOOL_VARIABLES: dict[str, str] = {
    "OEA_VLLM_VENV": "scripts/install_vllm_cpu.sh: where to build the vLLM environment",
    "OEA_SGLANG_VENV": "scripts/install_sglang_cpu.sh: where to build the SGLang environment",
    "OEA_TEST_INFLATED_DIR": "tests/engines/test_vllm_inflated.py: an existing inflated checkpoint",
}
FLAG_VALUES = "0/1/true/false/yes/no/on/off"


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
    policy: str = "oea"  # OEA_POLICY


def _parse_int(var: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{var} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{var} must be an integer >= {minimum}, got {value}")
    return value


def _int(env: Mapping[str, str], name: str, minimum: int) -> tuple[str, int] | None:
    """(variable used, value) of ``name`` or its alias; both set to different values is an error."""
    found = [(var, _parse_int(var, env[var].strip(), minimum))
             for var in (name, ALIASES.get(name)) if var and env.get(var, "").strip() != ""]
    if len(found) == 2 and found[0][1] != found[1][1]:
        (var, value), (alias, other) = found
        raise ValueError(f"{var}={value} and {alias}={other} disagree ({alias} is an alias of {var}): "
                         "unset one, or set both to the same value")
    return found[0] if found else None


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be one of {FLAG_VALUES}, got {env[name]!r}")


def _choice(env: Mapping[str, str], name: str) -> str:
    """A variable with fixed values (``OEA_GROUP_FILL``, ``OEA_POLICY``, ``OEA_TRACE_CONTENT``); blank: the first."""
    allowed = {"OEA_GROUP_FILL": GROUP_FILLS, "OEA_POLICY": POLICIES, "OEA_TRACE_CONTENT": TRACE_CONTENTS}[name]
    if (raw := env.get(name, "").strip()) and raw not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {raw!r}")
    return raw or allowed[0]


def _path(env: Mapping[str, str], name: str) -> str | None:
    """A file-path variable, stripped like every other variable; blank means unset."""
    return env.get(name, "").strip() or None


def settings_from_env(env: Mapping[str, str] | None = None) -> EnvSettings:
    """Parse ``OEA_*`` (and the ``SGLANG_OEA_*`` aliases). Raises ``ValueError`` naming a bad variable."""
    env, source = os.environ if env is None else env, {}
    k0 = _int(env, "OEA_K0", 1)
    min_batch = _int(env, "OEA_MIN_BATCH", 0)
    max_experts = _int(env, "OEA_MAX_EXPERTS", 1)
    for found in (k0, min_batch, max_experts):
        if found is not None:
            source[found[0]] = env[found[0]]
    group_fill = _choice(env, "OEA_GROUP_FILL")
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
        policy=_choice(env, "OEA_POLICY"),
    )


def timing_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``OEA_TIMING``: time each routing call (vLLM plugin). Raises ``ValueError`` naming it when malformed."""
    return _flag(os.environ if env is None else env, "OEA_TIMING")


def _positive_number(env: Mapping[str, str], name: str, maximum: float = math.inf, unit: str = "") -> float | None:
    """A finite number in (0, maximum] (``None`` when unset); a ``ValueError`` naming ``name`` otherwise."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= maximum):
        allowed = f"in (0, {maximum:g}]" if math.isfinite(maximum) else "> 0"
        raise ValueError(f"{name} must be a number{unit} {allowed}, got {raw!r}")
    return value


def metrics_flush_interval(env: Mapping[str, str] | None = None) -> float:
    """``OEA_METRICS_FLUSH_S``: seconds between metrics flushes (default 0.5); a finite number > 0."""
    value = _positive_number(os.environ if env is None else env, "OEA_METRICS_FLUSH_S", unit=" of seconds")
    return 0.5 if value is None else value


@dataclass(frozen=True)
class TraceSettings:
    """``OEA_TRACE_*``: where the engine plugins record decode-step routing, and how much of it."""

    path: str
    sample: float = 1.0  # share of decode steps recorded
    max_bytes: int = 1024 * 2**20
    content: str = "logits"  # one of TRACE_CONTENTS


def trace_settings_from_env(env: Mapping[str, str] | None = None) -> TraceSettings | None:
    """``OEA_TRACE_FILE`` and its options (``None`` when unset). Raises ``ValueError`` naming a malformed
    variable; whether the file can be written is the recorder's business (it warns and serving goes on)."""
    env = os.environ if env is None else env
    path = _path(env, "OEA_TRACE_FILE")
    sample = _positive_number(env, "OEA_TRACE_SAMPLE", 1.0)
    max_mb = _positive_number(env, "OEA_TRACE_MAX_MB")
    content = _choice(env, "OEA_TRACE_CONTENT")
    if path is None:
        return None
    if not path.endswith(".safetensors"):
        raise ValueError(f"OEA_TRACE_FILE must name a .safetensors file (its .json sidecar goes next to it), "
                         f"got {path!r}")
    return TraceSettings(path, 1.0 if sample is None else sample,
                         1024 * 2**20 if max_mb is None else max(1, int(max_mb * 2**20)), content)


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


# ---------------------------------------------------------------- checking the environment (oea doctor)


@dataclass(frozen=True)
class EnvCheck:
    """One finding of ``check_environment``: the variable(s) it is about, whether it is fine, and why."""

    name: str
    ok: bool
    detail: str


def check_environment(env: Mapping[str, str] | None = None) -> list[EnvCheck]:
    """Check every ``OEA_*`` / ``SGLANG_OEA_*`` variable that is set, as far as possible without a model.

    Each value is parsed as ``settings_from_env`` parses it (so a variable this accepts is one the engines
    accept), an alias set next to its variable must agree, the per-layer k0 file must be readable and
    well-formed and fit ``OEA_K0`` / ``OEA_MAX_EXPERTS``, the metrics file's folder must exist, and an
    unknown name is reported with the closest known one. Never raises.
    """
    env = os.environ if env is None else env
    names = sorted(var for var in env if var.startswith(("OEA_", "SGLANG_OEA_")))
    if not [var for var in names if env[var].strip()]:
        return [EnvCheck("OEA_*", True, "none set: OEA is off and the engines are left alone")]
    checks = [_check_variable(env, var) for var in names if var in VARIABLES and env[var].strip()]
    checks += [EnvCheck(var, True, f"not read by OEA routing ({TOOL_VARIABLES[var]})")
               for var in names if var in TOOL_VARIABLES]
    checks += [_unknown_variable(var) for var in names if var not in VARIABLES and var not in TOOL_VARIABLES]
    checks += _alias_checks(env, checks)
    try:
        settings = settings_from_env(env)
    except ValueError as err:  # two variables that disagree, or a combination (OEA_MAX_EXPERTS < OEA_K0)
        if all(c.ok for c in checks):
            checks.append(EnvCheck("OEA_* together", False, str(err)))
        return checks
    if settings.oea is None and settings.layer_k0_file is None:
        idle = [c.name for c in checks if c.ok and c.name in ("OEA_MIN_BATCH", "SGLANG_OEA_MIN_BATCH",
                                                              "OEA_MAX_EXPERTS", "OEA_GROUP_FILL",
                                                              "OEA_APPLY_TO_VERIFY", "OEA_POLICY")]
        if idle:
            verb = "has" if len(idle) == 1 else "have"
            checks.append(EnvCheck("OEA_K0", True, f"unset: OEA is off, so {', '.join(idle)} {verb} no effect"))
    return checks


def _check_variable(env: Mapping[str, str], var: str) -> EnvCheck:
    raw = env[var].strip()
    try:
        if var in ("OEA_K0", "SGLANG_OEA_K0"):
            detail = f"k0 = {_parse_int(var, raw, 1)}"
        elif var in ("OEA_MIN_BATCH", "SGLANG_OEA_MIN_BATCH"):
            detail = f"min_batch = {_parse_int(var, raw, 0)}"
        elif var == "OEA_MAX_EXPERTS":
            detail = f"max_experts = {_parse_int(var, raw, 1)}"
        elif var in ("OEA_GROUP_FILL", "OEA_POLICY"):
            detail = f"{var[4:].lower()} = {_choice(env, var)}"
        elif var in ("OEA_APPLY_TO_VERIFY", "OEA_TIMING"):
            detail = f"{'on' if _flag(env, var) else 'off'}"
        elif var == "OEA_METRICS_FLUSH_S":
            detail = f"every {metrics_flush_interval(env):g} s"
        elif var in ("OEA_METRICS_FILE", "OEA_TRACE_FILE"):
            detail = _check_output_file(var, raw)
        elif var.startswith("OEA_TRACE_"):  # the options of OEA_TRACE_FILE
            detail = _trace_option(env, var)
        else:  # OEA_LAYER_K0_FILE
            detail = _check_layer_k0_file(env, raw)
    except (OSError, ValueError) as err:
        return EnvCheck(var, False, str(err))
    if var in ALIASES.values():
        primary = next(name for name, alias in ALIASES.items() if alias == var)
        detail += f" (alias of {primary})"
    return EnvCheck(var, True, detail)


def _alias_checks(env: Mapping[str, str], found: list[EnvCheck]) -> list[EnvCheck]:
    """A variable and its alias both set (each well-formed): the same value is fine, two values are refused."""
    checks = []
    bad = {c.name for c in found if not c.ok}
    for var, alias in ALIASES.items():
        if env.get(var, "").strip() and env.get(alias, "").strip() and not {var, alias} & bad:
            try:
                _, value = _int(env, var, 0)  # type: ignore[misc]
                checks.append(EnvCheck(f"{var} / {alias}", True, f"both {value}: one setting"))
            except ValueError as err:
                checks.append(EnvCheck(f"{var} / {alias}", False, str(err)))
    return checks


def _check_output_file(var: str, path: str) -> str:
    """A file the engine writes (``OEA_METRICS_FILE`` appended to, ``OEA_TRACE_FILE`` replaced): writable."""
    import pathlib

    if var == "OEA_TRACE_FILE":
        trace_settings_from_env({var: path})  # the suffix
    target, folder = pathlib.Path(path), pathlib.Path(path).parent
    if target.is_dir():
        raise ValueError(f"{var}={path!r} is a folder; name a file to write to")
    if not folder.is_dir():
        raise ValueError(f"{var}={path!r}: folder {str(folder)!r} does not exist")
    if not os.access(target if target.exists() else folder, os.W_OK) or not os.access(folder, os.W_OK):
        raise ValueError(f"{var}={path!r} is not writable")
    if var == "OEA_METRICS_FILE":
        return f"{path} ({'exists, lines are appended' if target.exists() else 'created on the first step'})"
    return f"{path} ({'exists, replaced' if target.exists() else 'written'} when the server stops or at the cap)"


def _trace_option(env: Mapping[str, str], var: str) -> str:
    """One option of OEA_TRACE_FILE, parsed alone (each bad value is reported against its own variable)."""
    settings = trace_settings_from_env({var: env[var], "OEA_TRACE_FILE": "x.safetensors"})
    assert settings is not None
    if not env.get("OEA_TRACE_FILE", "").strip():
        return "no effect: OEA_TRACE_FILE is unset"
    if var == "OEA_TRACE_SAMPLE":
        return f"records {settings.sample:.0%} of decode steps"
    if var == "OEA_TRACE_MAX_MB":
        return f"recording stops at {settings.max_bytes / 2**20:g} MB"
    return "full router logits" if settings.content == "logits" else "top-k ids and router probabilities"


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
        if settings.oea is not None:
            source = settings.source or {}
            check_k0_against(settings.oea, schedule.top_k, "OEA_K0" if "OEA_K0" in source else ALIASES["OEA_K0"])
    k0 = sorted(set(schedule.k0))
    detail = (f"{path}: {schedule.num_layers} MoE layers, {schedule.num_experts} experts, top_k {schedule.top_k}, "
              + (f"k0 {k0[0]}..{k0[-1]} per layer" if len(k0) > 1 else f"k0 {k0[0]} in every layer"))
    if schedule.batch_k0 is not None:
        bounds = ", ".join(str(b) for b, _ in schedule.batch_k0)
        detail += f", batch_k0: k0 by batch size in {len(schedule.batch_k0)} ranges (max_batch {bounds})"
    return detail + (f", model {schedule.model!r}" if schedule.model else "")


def _unknown_variable(var: str) -> EnvCheck:
    import difflib

    close = difflib.get_close_matches(var, [*VARIABLES, *TOOL_VARIABLES], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return EnvCheck(var, False, f"unknown variable: {hint}OEA reads {', '.join(VARIABLES)}")
