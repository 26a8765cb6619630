"""Every ``OEA_*`` variable in one table: its name, alias, parser and help. The settings
(``oea.config.settings``), the doctor's check of the environment (``oea.integrations.doctor.env``) and the
table in docs/configuration.md (``markdown_table``, kept equal by a test) are all derived from it.

A parser takes the raw value (stripped, never empty: blank means unset, which the adapters and the doctor
report: ``blank_variables``) and returns the value, or raises ``ValueError`` naming the variable and the allowed
values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from oea.routing.spec import GROUP_FILLS, MAX_MIN_BATCH

POLICIES = ("oea", "ep")  # OEA_POLICY: plain OEA, or EP-aware OEA on the engine's own expert placement
TRACE_CONTENTS = ("logits", "topk")  # full router logits, or the router's top-k ids and probabilities
FLAG_VALUES = "0/1/true/false/yes/no/on/off"
ALL, ENGINES, VLLM = "vLLM, SGLang, transformers", "vLLM, SGLang", "vLLM"  # which adapters read a variable
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str, str], int]:
    """An integer >= ``minimum`` (and <= ``maximum``: the bound of the config field it sets, ``oea.routing.spec``)."""
    allowed = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(var: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{var} must be an integer {allowed}, got {raw!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"{var} must be an integer {allowed}, got {value}")
        return value
    return parse


def choice(allowed: tuple[str, ...]) -> Callable[[str, str], str]:
    """One of ``allowed`` (unset: the first)."""
    def parse(var: str, raw: str) -> str:
        if raw not in allowed:
            raise ValueError(f"{var} must be one of {allowed}, got {raw!r}")
        return raw
    return parse


def flag(var: str, raw: str) -> bool:
    """On or off (``FLAG_VALUES``)."""
    lowered = raw.lower()
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    raise ValueError(f"{var} must be one of {FLAG_VALUES}, got {raw!r}")


def number(maximum: float = math.inf, unit: str = "") -> Callable[[str, str], float]:
    """A finite number in (0, ``maximum``]."""
    def parse(var: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 < value <= maximum):
            allowed = f"in (0, {maximum:g}]" if math.isfinite(maximum) else "> 0"
            raise ValueError(f"{var} must be a number{unit} {allowed}, got {raw!r}")
        return value
    return parse


def path(var: str, raw: str) -> str:
    """A file path (whether it can be read or written is checked where it is used)."""
    return raw


def trace_path(var: str, raw: str) -> str:
    """A ``.safetensors`` path (its ``.json`` sidecar goes next to it)."""
    if not raw.endswith(".safetensors"):
        raise ValueError(f"{var} must name a .safetensors file (its .json sidecar goes next to it), got {raw!r}")
    return raw


def port(var: str, raw: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` -> (host, port), host ``0.0.0.0`` when not given, PORT in 1..65535."""
    host, _, number = raw.rpartition(":")
    try:
        value = int(number)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise ValueError(f"{var} must be PORT or HOST:PORT with PORT in 1..65535, got {raw!r}")
    return host or "0.0.0.0", value


def _same(value: Any) -> str:
    return str(value)


@dataclass(frozen=True)
class Variable:
    """One variable OEA reads: ``parse`` its raw value; ``default``, ``help`` and ``readers`` for the docs,
    ``shows`` for the doctor (a good value in words)."""

    name: str
    parse: Callable[[str, str], Any]
    help: str
    default: str = ""
    alias: str | None = None
    readers: str = ALL
    shows: Callable[[Any], str] = _same

    def read(self, env: Mapping[str, str]) -> tuple[str, Any] | None:
        """(the variable that was set, its value) from ``env``, or None when unset; the name and its alias both
        set to different values is a ``ValueError`` naming both."""
        found = [(var, self.parse(var, env[var].strip())) for var in (self.name, self.alias)
                 if var and env.get(var, "").strip()]
        if len(found) == 2 and found[0][1] != found[1][1]:
            (var, value), (alias, other) = found
            raise ValueError(f"{var}={value} and {alias}={other} disagree ({alias} is an alias of {var}): "
                             "unset one, or set both to the same value")
        return found[0] if found else None

    def value(self, env: Mapping[str, str], default: Any = None) -> Any:
        """The parsed value, or ``default`` when unset."""
        found = self.read(env)
        return default if found is None else found[1]


def _on(value: bool) -> str:
    return "on" if value else "off"


VARIABLES: tuple[Variable, ...] = (
    Variable("OEA_K0", integer(1), "baseline experts per token; unset: OEA off", alias="SGLANG_OEA_K0",
             shows=lambda v: f"k0 = {v}" + (f": {k0_note(v)}" if k0_note(v) else "")),
    Variable("OEA_MIN_BATCH", integer(0, MAX_MIN_BATCH), "vanilla routing below this many real rows", "2",
             alias="SGLANG_OEA_MIN_BATCH", shows=lambda v: f"min_batch = {v}"),
    Variable("OEA_MAX_EXPERTS", integer(1), "cap on experts per token after piggybacking", "top_k",
             shows=lambda v: f"max_experts = {v}" + (f": {max_experts_note(v)}" if max_experts_note(v) else "")),
    Variable("OEA_GROUP_FILL", choice(GROUP_FILLS),
             f"grouped routers: piggyback {' or '.join(GROUP_FILLS)} the token's groups", GROUP_FILLS[0],
             shows=lambda v: f"group_fill = {v}"),
    Variable("OEA_POLICY", choice(POLICIES), "ep: EP-aware OEA on the engine's expert placement", POLICIES[0],
             readers=ENGINES, shows=lambda v: f"policy = {v}"),
    Variable("OEA_APPLY_TO_VERIFY", flag, "also reroute speculative verify steps", "0", readers=ENGINES, shows=_on),
    Variable("OEA_LAYER_K0_FILE", path, "per-layer (and per-batch-size) k0 file written by oea calibrate"),
    Variable("OEA_METRICS_FILE", path, "JSONL file the engine plugin appends active-expert counts to",
             readers=ENGINES),
    Variable("OEA_TIMING", flag, "time each routing call in the worker", "0", readers=ENGINES, shows=_on),
    Variable("OEA_METRICS_FLUSH_S", number(unit=" of seconds"), "seconds between metrics-file flushes", "0.5",
             readers=ENGINES, shows=lambda v: f"every {v:g} s"),
    Variable("OEA_PROMETHEUS", flag, "export the oea_* Prometheus series with OEA on (vLLM: its /metrics; SGLang: "
             "with --enable-metrics); 0: none", "1", readers=ENGINES, shows=_on),
    Variable("OEA_PROMETHEUS_PORT", port, "also serve the oea_* Prometheus series from the rank-0 worker here "
             "(PORT or HOST:PORT); a bad or taken port: one warning", readers=VLLM,
             shows=lambda v: f"http://{v[0]}:{v[1]}/metrics"),
    Variable("OEA_TRACE_FILE", trace_path, "record decode-step routing to this .safetensors oea-trace",
             readers=ENGINES),
    Variable("OEA_TRACE_SAMPLE", number(1.0), "share of decode steps recorded, in (0, 1]", "1.0",
             readers=ENGINES, shows=lambda v: f"records {v:.0%} of decode steps"),
    Variable("OEA_TRACE_MAX_MB", number(), "recording stops when the trace reaches this many MB", "1024",
             readers=ENGINES, shows=lambda v: f"recording stops at {v:g} MB"),
    Variable("OEA_TRACE_CONTENT", choice(TRACE_CONTENTS),
             f"what is recorded per token and layer: {' or '.join(TRACE_CONTENTS)}", TRACE_CONTENTS[0],
             readers=ENGINES,
             shows=lambda v: "full router logits" if v == "logits" else "top-k ids and router probabilities"),
)
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}
ALIASES: dict[str, str] = {v.name: v.alias for v in VARIABLES if v.alias}
# Variables of the project's install scripts (the doctor knows them, routing ignores them).
SCRIPT_VARIABLES: dict[str, str] = {
    "OEA_VLLM_VENV": "scripts/install_vllm_cpu.sh: where to build the vLLM environment",
    "OEA_SGLANG_VENV": "scripts/install_sglang_cpu.sh: where to build the SGLang environment",
}


# The largest top_k of the model presets oea ships (oea.presets; a unit test keeps the two equal): an
# OEA_K0 above it fits none of them, so the doctor says what an engine will do with it.
LARGEST_PRESET_TOP_K = 8


def k0_note(k0: int) -> str:
    """What an engine does with ``k0`` on models with a top_k of ``LARGEST_PRESET_TOP_K`` or less ("" when k0 is
    below that): k0 = top_k routes as the engine does, k0 > top_k is refused when the model loads."""
    if k0 < LARGEST_PRESET_TOP_K:
        return ""
    if k0 == LARGEST_PRESET_TOP_K:
        return (f"on a model with top_k {k0} (the largest of oea's model presets) routing is unchanged (k0 = top_k); "
                "a model with a smaller top_k is refused at load")
    return (f"no model preset has top_k >= {k0} (the largest is {LARGEST_PRESET_TOP_K}): a model whose top_k is "
            f"below {k0} is refused at load (OEA_K0 must be in 1..top_k), and k0 = top_k would route unchanged")


def max_experts_note(max_experts: int) -> str:
    """What an engine does with ``max_experts`` above every model preset's top_k ("" otherwise): a model whose
    top_k is below it is refused at load (max_experts must be <= top_k)."""
    if max_experts <= LARGEST_PRESET_TOP_K:
        return ""
    return (f"no model preset has top_k >= {max_experts} (the largest is {LARGEST_PRESET_TOP_K}): a model whose "
            f"top_k is below {max_experts} is refused at load (OEA_MAX_EXPERTS must be in OEA_K0..top_k)")


def blank_variables(env: Mapping[str, str]) -> list[str]:
    """The variables of the table (or aliases) that are set to an empty value: read as unset, which can hide a
    mistake (``OEA_K0=$K0`` with ``K0`` unset turns OEA off), so the adapters and the doctor say so."""
    names = [name for v in VARIABLES for name in (v.name, v.alias) if name]
    return sorted(name for name in names if name in env and not env[name].strip())


def blank_note(names: list[str]) -> str:
    """One line about ``blank_variables`` ("" when there are none)."""
    if not names:
        return ""
    off = " (OEA is off without OEA_K0)" if {"OEA_K0", ALIASES["OEA_K0"]} & set(names) else ""
    one = len(names) == 1
    return (f"{', '.join(names)} {'is' if one else 'are'} set but empty: read as unset{off}; unset "
            f"{'it' if one else 'them'}, or give {'it' if one else 'each'} a value")


def variable_of(name: str) -> Variable | None:
    """The table's row of ``name`` or of the alias ``name``."""
    return BY_NAME.get(name) or next((v for v in VARIABLES if v.alias == name), None)


def markdown_table() -> str:
    """The variables as the Markdown table of docs/configuration.md."""
    lines = ["| variable | alias | default | read by | meaning |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        lines.append(f"| `{v.name}` | {f'`{v.alias}`' if v.alias else ''} | {v.default or '—'} | {v.readers} | "
                     f"{v.help} |")
    return "\n".join(lines) + "\n"
