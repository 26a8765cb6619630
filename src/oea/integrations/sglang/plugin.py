"""The entry point ``register`` (``sglang.srt.plugins``) and the two ways the hooks get into SGLang.

Enable with ``OEA_K0=<k0>`` (alias ``SGLANG_OEA_K0``) in the environment of the SGLang server: SGLang's
``load_plugins()`` runs ``register`` in every process (launcher, schedulers, DP controller, detokenizer),
which registers ``hooks.hook_plan()`` with SGLang's ``HookRegistry`` (applied by SGLang afterwards).
Without ``OEA_K0`` nothing is installed and SGLang is untouched. SGLang < 0.5.12 has no plugin system:
``install_without_registry`` (run by ``python -m oea.launch.sglang``) patches the same targets directly.

A substituted router (a ``TopK`` subclass whose routing forwards are its own, an out-of-tree forward registered for
it) never reaches ``select_experts``, where the hooks sit: ``topk_bypasses`` finds it (the rule:
``oea.integrations.bypass``), ``register`` warns once per such class, ``oea doctor sglang`` fails.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import oea.integrations.sglang.metrics as metrics
import oea.integrations.sglang.recording as recording
import oea.integrations.sglang.targets as targets
from oea.config import EnvSettings, blank_note, blank_variables, layer_configs, warn_unknown_variables
from oea.config.settings import all_settings_from_env, process_settings
from oea.integrations.bypass import Bypass, class_path, describe, find_bypasses, startup_warning
from oea.integrations.deterministic import keep_engine_routing
from oea.integrations.sglang.hooks import has_hook, hook_plan, resolve
from oea.integrations.sglang.placement import install as install_ep_placements
from oea.integrations.sglang.routing import select_experts_around_legacy
from oea.integrations.sglang.state import STATE, log, warn_once


def register() -> None:
    """``sglang.srt.plugins`` entry point: runs in every SGLang process before hooks are applied.

    Reads the environment (``OEA_K0``, ``OEA_TRACE_FILE``, ``OEA_METRICS_FILE`` and ``OEA_TIMING`` off -> nothing
    is installed; without ``OEA_K0`` the hooks only observe: SGLang's routing, recorded or counted). Does not
    touch CUDA.

    A malformed ``OEA_*`` value stops the process with ``SystemExit`` naming the variable: SGLang's
    loader catches (and only logs) ``Exception`` from plugins, which would leave the server running
    without the requested configuration; ``SystemExit`` makes it a start-up error instead.
    """
    try:
        settings = all_settings_from_env()  # every OEA_* setting, read once for this process
        layer_configs(settings)  # OEA_LAYER_K0_FILE readable, well-formed and with OEA_K0
        deterministic = deterministic_setting()
    except ValueError as err:
        # SystemExit's message is the one line the process prints (a log line beside it would repeat it)
        raise SystemExit(f"oea: invalid OEA configuration: {err}") from None
    # SGLang's deterministic inference: OEA stays off, one warning (the rule: oea.integrations.deterministic)
    settings = keep_engine_routing(settings, deterministic, warn_once)
    blank = blank_note(blank_variables(os.environ))
    if blank:  # OEA_K0= is read as unset: said, not silent
        warn_once("blank", blank)
    warn_unknown_variables(warn=log.warning)  # OEA_K00=3 (a typo) would serve without OEA: said, not silent
    recording.configure(settings.trace, settings.apply_to_verify)  # unwritable OEA_TRACE_FILE: a warning, no recording
    metrics.configure(settings)  # an unwritable OEA_METRICS_FILE: a warning, no metrics
    if settings.oea is None and recording.TRACE.settings is None and metrics.METRICS.path is None:
        log.info("oea: OEA_K0 unset; SGLang routing unchanged")
        return
    install(settings)
    if settings.oea is not None and targets.TOPK_MODULE in sys.modules:  # no TopK subclass before its module
        startup_warning(topk_bypasses, warn_once)


def routing_forwards(topk: type) -> tuple[str, ...]:
    """The methods through which ``TopK`` routes: ``forward`` and every ``forward_<platform or backend>`` (SGLang's
    dispatch picks one per process; each of TopK's own reaches ``select_experts``, where the hooks sit)."""
    return tuple(sorted(name for name in dir(topk) if name == "forward" or name.startswith("forward_")))


def topk_bypasses() -> tuple[list[Bypass], str]:
    """SGLang's ``TopK`` and every subclass of it in this process whose routing forwards are not TopK's own, and
    every out-of-tree forward registered for one of them (``BaseFusedOp.register_oot_forward``, 0.5.23: on its
    platform it runs instead of the class's forwards); with what was looked at."""
    topk = importlib.import_module(targets.TOPK_MODULE).TopK
    methods = routing_forwards(topk)
    found = find_bypasses(topk, methods)
    registry = getattr(topk, "_oot_forward_registry", None)  # platform key -> {op class -> forward}
    for key, table in registry.items() if isinstance(registry, dict) else ():
        for op, forward in table.items() if isinstance(table, dict) else ():
            if isinstance(op, type) and issubclass(op, topk):
                what = f"{getattr(forward, '__qualname__', forward)}, an out-of-tree forward for platform {key!r}"
                found.append(Bypass(class_path(op), "forward", what, f"{class_path(topk)}.forward"))
    return found, f"forward and {len(methods) - 1} forward_* methods of {describe([topk])}"


def install(settings: EnvSettings) -> list[str]:
    """Register the OEA hooks for ``settings`` with SGLang's ``HookRegistry`` (applied by it later).

    Returns the registered targets. Idempotent per process; a later call only updates the settings.
    """
    simulated = [name for name in targets.SIMULATION_VARIABLES if _env_flag(name)]
    if simulated:
        warn_once("simulate", f"{', '.join(simulated)} overrides routing; OEA is not installed")
        return []
    settings = keep_engine_routing(settings, deterministic_setting(), warn_once)  # as register (warned once)
    STATE.layers = None
    STATE.layers = layer_configs(settings)  # errors name OEA_LAYER_K0_FILE and the file
    STATE.settings = settings  # each layer's RouterState is made anew under these settings at its next call
    install_ep_placements()  # OEA_POLICY=ep: an EPLB rebalance rereads the placements
    if STATE.installed_targets:
        return list(STATE.installed_targets)
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as err:
        warn_once("no-registry", f"SGLang has no plugin HookRegistry ({err}); supported versions: "
                                 f"{targets.SUPPORTED_VERSIONS}. Serving without OEA.")
        return []
    plan = hook_plan()
    for target, hook, kind in plan:
        HookRegistry.register(target, hook, getattr(HookType, kind))
    STATE.installed_targets = tuple(target for target, _, _ in plan)
    what = f"OEA k0={settings.oea.k0} min_batch={settings.oea.min_batch}" if settings.oea else \
        "observe (SGLang's routing, recorded or counted)"
    log.info("oea: %s registered on %s", what, ", ".join(STATE.installed_targets))
    return list(STATE.installed_targets)


def deterministic_setting() -> str | None:
    """``"--enable-deterministic-inference"`` when SGLang's deterministic inference is on in this process, else None.

    Read as SGLang reads it: its published server args (``runtime_context.get_exec().deterministic``, 0.5.22+) where
    they are published; else SGLang's own flag ``envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE``, which the launcher
    sets from the server argument before it spawns the schedulers (0.5.12 - 0.5.23) and which is all ``register``
    can read: a scheduler loads the plugins before it publishes its server args; else (no SGLang: the tests) the
    variable as SGLang's ``EnvBool`` parses it. A value SGLang cannot parse raises ``ValueError`` naming it.
    """
    try:
        from sglang.srt.runtime_context import get_exec

        if bool(get_exec().deterministic.enable_deterministic_inference):
            return targets.DETERMINISTIC_FLAG
        return None
    except (ImportError, AttributeError, ValueError):  # older SGLang, or not published yet
        pass
    try:
        from sglang.srt.environ import envs

        on = bool(envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.get())
    except (ImportError, AttributeError):
        raw = os.environ.get(targets.DETERMINISTIC_VARIABLE, "").strip().lower()
        if raw not in ("", "true", "1", "yes", "y", "false", "0", "no", "n"):
            raise ValueError(f"{targets.DETERMINISTIC_VARIABLE} must be a boolean as SGLang reads it "
                             f"(true/1/yes/y or false/0/no/n), got {raw!r}") from None
        on = raw in ("true", "1", "yes", "y")
    return targets.DETERMINISTIC_FLAG if on else None


def _env_flag(name: str) -> bool:
    """An SGLang on/off variable as SGLang reads it (anything but empty/0/false/no/off is on)."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def install_without_registry(settings: EnvSettings) -> list[str]:
    """Patch the targets directly (SGLang < 0.5.12, no plugin system); used by ``oea.launch.sglang``.

    Returns the patched targets. Versions without ``_post_process_topk_ids`` get an AROUND
    rewrite of ``select_experts``' output (EPLB remap must be off there; such calls pass through).
    """
    settings = keep_engine_routing(process_settings(settings), deterministic_setting(), warn_once)  # as register
    STATE.settings = settings  # each layer's RouterState is made anew under these settings at its next call
    install_ep_placements()  # OEA_POLICY=ep: an EPLB rebalance rereads the placements
    recording.configure(settings.trace, settings.apply_to_verify)
    metrics.configure(settings)
    patched: list[str] = []
    topk = importlib.import_module(targets.TOPK_MODULE)
    plan = hook_plan()
    if not hasattr(topk, "_post_process_topk_ids"):
        replaced = (targets.POST_PROCESS_TARGET, targets.SELECT_EXPERTS_TARGET)
        plan = [(t, h, k) for t, h, k in plan if t not in replaced]
        plan.append((targets.SELECT_EXPERTS_TARGET, select_experts_around_legacy, "AROUND"))
    for target, hook, kind in plan:
        try:
            _patch(target, hook, kind)
        except (ImportError, AttributeError) as err:
            warn_once(f"patch:{target}", f"cannot hook {target} ({err}); supported versions: "
                                         f"{targets.SUPPORTED_VERSIONS}")
            continue
        patched.append(target)
    STATE.installed_targets = tuple(patched)
    return patched


def _patch(target: str, hook: Callable[..., Any], kind: str) -> None:
    """Wrap ``target`` with ``hook`` (``kind`` AROUND or BEFORE, as SGLang's ``HookRegistry`` does); idempotent."""
    owner_path, name = target.rsplit(".", 1)
    owner = resolve(owner_path)
    original = getattr(owner, name)
    if has_hook(original, hook):
        return
    if kind == "AROUND":
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return hook(original, *args, **kwargs)
    else:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            changed = hook(*args, **kwargs)
            if changed is not None:
                args, kwargs = changed
            return original(*args, **kwargs)
    wrapped = functools.wraps(original)(wrapper)
    setattr(owner, name, wrapped)
    if not isinstance(owner, type):  # refresh `from module import name` copies, as HookRegistry does
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if module is owner or not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if value is original:
                    setattr(module, attr, wrapped)


def rewrite_count() -> int:
    """Layer calls rewritten by OEA in this process so far (eager calls and graph captures)."""
    return STATE.rewrites
