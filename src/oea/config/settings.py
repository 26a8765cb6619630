"""The settings the engine adapters read from the environment, parsed by the table of ``oea.config.variables``.

A malformed value raises ``ValueError`` naming the variable, at plugin start-up: serving with a silently
wrong configuration is worse than not starting. A variable and its alias set to different values
(``OEA_K0=2 SGLANG_OEA_K0=5``) is refused the same way, naming both: which one was meant cannot be known.
Set to the same value, they are accepted. The variables, their aliases and defaults: docs/configuration.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from oea.config.variables import BY_NAME
from oea.routing.spec import OEAConfig


@dataclass(frozen=True)
class TraceSettings:
    """``OEA_TRACE_*``: where the engine plugins record decode-step routing, and how much of it."""

    path: str
    sample: float = 1.0  # share of decode steps recorded
    max_bytes: int = 1024 * 2**20
    content: str = "logits"  # one of TRACE_CONTENTS


@dataclass(frozen=True)
class EnvSettings:
    """What the environment asks for. ``oea`` is None when OEA is off.

    ``settings_from_env`` reads the routing settings; ``all_settings_from_env`` every ``OEA_*`` setting of an
    engine process (``timing``, ``metrics_flush_s``, ``trace``, ``prometheus``, ``prometheus_port`` too:
    ``process`` True), once, for the plugins, their recorders and their doctors; ``process_settings`` completes
    routing settings a caller read.
    """

    oea: OEAConfig | None
    apply_to_verify: bool = False
    layer_k0_file: str | None = None
    metrics_file: str | None = None
    source: dict[str, str] | None = None  # variable -> raw value actually read
    min_batch: int | None = None  # OEA_MIN_BATCH when set (also without OEA_K0)
    max_experts: int | None = None  # OEA_MAX_EXPERTS when set
    group_fill: str = "in"  # OEA_GROUP_FILL
    policy: str = "oea"  # OEA_POLICY
    timing: bool = False  # OEA_TIMING (all_settings_from_env)
    metrics_flush_s: float = 0.5  # OEA_METRICS_FLUSH_S (all_settings_from_env)
    trace: TraceSettings | None = None  # OEA_TRACE_FILE and its options (all_settings_from_env; None: not recording)
    prometheus: bool = True  # OEA_PROMETHEUS (all_settings_from_env): export the oea_* series with OEA on
    # OEA_PROMETHEUS_PORT as written (all_settings_from_env): parsed where it is served, since a bad or taken port is
    # one warning and serving goes on, never a stopped start-up
    prometheus_port: str | None = None
    process: bool = False  # timing, metrics_flush_s, trace and prometheus* were read (all_settings_from_env)


def settings_from_env(env: Mapping[str, str] | None = None) -> EnvSettings:
    """Parse ``OEA_*`` (and the ``SGLANG_OEA_*`` aliases). Raises ``ValueError`` naming a bad variable."""
    env = os.environ if env is None else env
    k0, min_batch, max_experts = (BY_NAME[name].read(env) for name in ("OEA_K0", "OEA_MIN_BATCH", "OEA_MAX_EXPERTS"))
    source = {found[0]: env[found[0]] for found in (k0, min_batch, max_experts) if found is not None}
    group_fill = BY_NAME["OEA_GROUP_FILL"].value(env, "in")
    cfg = None
    if k0 is not None:
        try:
            cfg = OEAConfig(k0=k0[1], max_experts=None if max_experts is None else max_experts[1],
                            min_batch=2 if min_batch is None else min_batch[1], group_fill=group_fill)
        except ValueError as err:
            raise ValueError(f"invalid OEA environment ({', '.join(source)}): {err}") from None
    return EnvSettings(
        oea=cfg,
        apply_to_verify=BY_NAME["OEA_APPLY_TO_VERIFY"].value(env, False),
        layer_k0_file=BY_NAME["OEA_LAYER_K0_FILE"].value(env),
        metrics_file=BY_NAME["OEA_METRICS_FILE"].value(env),
        source=source,
        min_batch=None if min_batch is None else min_batch[1],
        max_experts=None if max_experts is None else max_experts[1],
        group_fill=group_fill,
        policy=BY_NAME["OEA_POLICY"].value(env, "oea"),
    )


def all_settings_from_env(env: Mapping[str, str] | None = None) -> EnvSettings:
    """Every ``OEA_*`` setting of an engine process, read once: ``settings_from_env`` with ``OEA_TIMING``,
    ``OEA_METRICS_FLUSH_S``, ``OEA_TRACE_*`` and ``OEA_PROMETHEUS``, in that order (``OEA_PROMETHEUS_PORT`` as
    written). Raises ``ValueError`` naming the first
    malformed variable."""
    env = os.environ if env is None else env
    return process_settings(settings_from_env(env), env)


def process_settings(settings: EnvSettings, env: Mapping[str, str] | None = None) -> EnvSettings:
    """``settings`` with the rest of an engine process's settings (``OEA_TIMING``, ``OEA_METRICS_FLUSH_S``,
    ``OEA_TRACE_*``, ``OEA_PROMETHEUS``, ``OEA_PROMETHEUS_PORT``) read from ``env``, unless they already hold them
    (``process``): what an adapter entered with routing settings alone (``settings_from_env``) runs on, each
    variable read once."""
    if settings.process:
        return settings
    env = os.environ if env is None else env
    return replace(settings, timing=timing_from_env(env), metrics_flush_s=metrics_flush_interval(env),
                   trace=trace_settings_from_env(env), prometheus=BY_NAME["OEA_PROMETHEUS"].value(env, True),
                   prometheus_port=env.get("OEA_PROMETHEUS_PORT", "").strip() or None, process=True)


def timing_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``OEA_TIMING``: time each routing call (vLLM plugin). Raises ``ValueError`` naming it when malformed."""
    return BY_NAME["OEA_TIMING"].value(os.environ if env is None else env, False)


def metrics_flush_interval(env: Mapping[str, str] | None = None) -> float:
    """``OEA_METRICS_FLUSH_S``: seconds between metrics flushes (default 0.5); a finite number > 0."""
    return BY_NAME["OEA_METRICS_FLUSH_S"].value(os.environ if env is None else env, 0.5)


def trace_settings_from_env(env: Mapping[str, str] | None = None) -> TraceSettings | None:
    """``OEA_TRACE_FILE`` and its options (``None`` when unset). Raises ``ValueError`` naming a malformed
    variable; whether the file can be written is the recorder's business (it warns and serving goes on)."""
    env = os.environ if env is None else env
    path = BY_NAME["OEA_TRACE_FILE"].value(env)
    sample = BY_NAME["OEA_TRACE_SAMPLE"].value(env, 1.0)
    max_mb = BY_NAME["OEA_TRACE_MAX_MB"].value(env)
    content = BY_NAME["OEA_TRACE_CONTENT"].value(env, "logits")
    if path is None:
        return None
    return TraceSettings(path, sample, 1024 * 2**20 if max_mb is None else max(1, int(max_mb * 2**20)), content)
