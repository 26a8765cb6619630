"""``oea doctor sglang``: version, environment, entry point, imports (a missing dependency named as one),
plugin system, every hook target with the parameters the hooks read, hooks live after SGLang's own
``load_plugins()``, a self-test through the real ``select_experts`` on CPU tensors in a DECODE and an
EXTEND forward context, what keeps CUDA-graph padding rows out of the union, and the router classes a platform
may substitute (``router bypass``)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch

import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.targets as targets
from oea.config import EnvSettings, layer_configs
from oea.config.settings import all_settings_from_env
from oea.integrations import bypass
from oea.integrations.deterministic import doctor_check
from oea.integrations.doctor.common import check, check_call, entry_point_checks, version_tuple
from oea.integrations.sglang.hooks import (
    decode_detection,
    hook_plan,
    hooks_status,
    model_runner_phase,
    padding_targets,
    target_hooked,
)
from oea.integrations.sglang.placement import doctor_placement
from oea.integrations.sglang.plugin import deterministic_setting, install, register, topk_bypasses
from oea.integrations.sglang.prometheus import doctor_line as prometheus_doctor_line
from oea.integrations.sglang.targets import engine_version
from oea.routing import OEAConfig, RouterSpec, active_experts, route, same_routing

# where the doctor reads SGLang's deterministic inference (a server argument the doctor does not see)
DETERMINISTIC_HOW = (f"{targets.DETERMINISTIC_VARIABLE}, which SGLang's launcher sets from "
                     f"{targets.DETERMINISTIC_FLAG} for its schedulers")


def doctor_checks() -> list[dict[str, Any]]:
    """``oea doctor`` checks for SGLang: ``[{"name", "ok", "detail"}]``.

    Version, environment, entry point (registered, loads), imports (SGLang's MoE module with its
    dependencies: a missing one is named as such), plugin system, every hook target with its
    signature, hooks live after SGLang's own ``load_plugins()``, a self-test through the real
    ``select_experts`` on CPU tensors in a DECODE and an EXTEND forward context, the mechanism that
    bounds CUDA-graph padding rows ("cuda-graph padding"), and whether the ``oea_*`` series reach SGLang's
    ``/metrics`` ("prometheus export").
    """
    try:  # every OEA_* setting, read once as register reads them; malformed: each check that needs them says why
        settings: EnvSettings | ValueError = all_settings_from_env()
    except ValueError as err:
        settings = err
    checks = [check_call("version", _check_version),
              check_call("environment", lambda: _check_environment(_readable(settings))),
              doctor_check(deterministic_setting, DETERMINISTIC_HOW),
              *entry_point_checks(targets.ENTRY_POINT_GROUP, targets.ENTRY_POINT_VALUE, register, "SGLang"),
              check_call("imports", _check_imports)]
    if checks[-1]["ok"]:  # an SGLang that cannot be imported has no hook targets to look at
        checks.append(check_call("plugin system", _check_plugin_system))
        for target, _, _ in hook_plan():
            if target not in padding_targets():  # reported by the "cuda-graph padding" check
                checks.append(check_call(f"hook target {target}", lambda target=target: _check_target(target)))
    imports_ok = all(c["ok"] for c in checks if c["name"] == "imports")
    if all(c["ok"] for c in checks):
        checks.append(check_call("hooks live", lambda: _check_hooks_live(_readable(settings))))
        checks.append(check_decode_detection(settings))
        checks.append(check_call("self-test select_experts", lambda: _self_test(_readable(settings))))
    else:
        checks.append(check("self-test select_experts", False, "skipped: fix the failed checks above first; "
                                                               "until then SGLang serves without OEA"))
    if imports_ok:
        checks.append(check_call("cuda-graph padding", lambda: _check_padding(_readable(settings))))
        checks.append(check_call("ep placement", doctor_placement))
        checks.append(check("prometheus export", *prometheus_doctor_line()))
        checks.append(bypass.doctor_check(_bypasses_as_served))
    return checks


def _bypasses_as_served() -> tuple[list[bypass.Bypass], str]:
    """``topk_bypasses`` once this process holds the router classes an SGLang process would: SGLang's plugins
    loaded (one may substitute a router class or register an out-of-tree forward; idempotent)."""
    from sglang.srt.plugins import load_plugins

    try:
        load_plugins()
    except SystemExit as err:  # our register refuses a malformed OEA_* value (the environment check names it)
        raise RuntimeError(f"SGLang's plugins did not load: {err}") from None
    found, looked_at = topk_bypasses()
    return found, f"{looked_at}, after SGLang's load_plugins()"


def _readable(settings: EnvSettings | ValueError | None) -> EnvSettings:
    """The settings a check works with (None: read here); the reason they could not be read (the variable
    named) otherwise."""
    if settings is None:
        try:
            return all_settings_from_env()
        except ValueError as err:
            raise RuntimeError(str(err)) from None
    if isinstance(settings, ValueError):
        raise RuntimeError(str(settings)) from None  # the message names the variable
    return settings


def _check_version() -> str:
    found = engine_version()
    if found is None:
        raise RuntimeError("sglang is not installed")
    if version_tuple(found) < targets.PLUGIN_VERSION_MIN:
        raise RuntimeError(f"sglang {found} has no plugin system; supported: {targets.SUPPORTED_VERSIONS}")
    newer = version_tuple(found) > version_tuple(targets.TESTED_VERSION)
    return f"sglang {found}" + (f" (newer than tested {targets.TESTED_VERSION})" if newer else "") + \
        f"; supported {targets.SUPPORTED_VERSIONS}"


def _check_environment(settings: EnvSettings | None = None) -> str:
    """What ``register`` does with this environment (it reads it with the same functions); ``settings``: the
    doctor's reading of it (None: read here)."""
    settings = _readable(settings)
    try:
        configs = layer_configs(settings)
    except ValueError as err:  # the message names the variable
        raise RuntimeError(str(err)) from None
    if settings.oea is None:
        return "OEA off: OEA_K0 (or SGLANG_OEA_K0) unset; SGLang routing stays unmodified"
    source = ", ".join(f"{k}={v}" for k, v in (settings.source or {}).items())
    schedule = configs.schedule
    layers = "" if schedule is None else (
        f"; k0 per layer from {settings.layer_k0_file} ({schedule.num_layers} MoE layers, {schedule.num_experts} "
        f"experts, top_k {schedule.top_k}: {configs.describe()})")
    return (f"OEA on: k0={settings.oea.k0}, min_batch={settings.oea.min_batch}, "
            f"max_experts={settings.oea.max_experts or 'top_k'}, group_fill={settings.oea.group_fill}, "
            f"apply_to_verify={settings.apply_to_verify}{', policy=ep' if settings.policy == 'ep' else ''} "
            f"({source}){layers}")


def missing_dependency(err: BaseException) -> str | None:
    """The module a ``ModuleNotFoundError`` names when it lies outside SGLang (a dependency), else None."""
    if isinstance(err, ModuleNotFoundError) and err.name and err.name.split(".")[0] != "sglang":
        return err.name
    return None


def import_failure(err: BaseException, module: str) -> str:
    """One line telling the user what ``err``, raised by importing ``module`` (SGLang's), means.

    A module outside SGLang not found is a missing dependency; an SGLang module not found is a version
    that lacks it; anything else is a broken installation. Only the second is a version problem.
    """
    dependency = missing_dependency(err)
    if dependency is not None:
        return (f"SGLang could not import: No module named {dependency!r} (a dependency of sglang, missing "
                f"from this interpreter {sys.executable}: install it there; not an SGLang version problem); "
                f"needed by {module}")
    if isinstance(err, ModuleNotFoundError):
        return f"{module}: {err}; supported SGLang versions: {targets.SUPPORTED_VERSIONS}"
    return (f"SGLang could not import {module}: {type(err).__name__}: {' '.join(str(err).split())} (a broken "
            "installation of sglang or of one of its dependencies in this interpreter, not an SGLang version "
            "problem)")


def _check_imports() -> str:
    try:
        importlib.import_module(targets.TOPK_MODULE)
    except Exception as err:
        raise RuntimeError(import_failure(err, targets.TOPK_MODULE)) from None
    return f"{targets.TOPK_MODULE} and the dependencies it imports"


def _check_plugin_system() -> str:
    try:
        from sglang.srt.plugins import load_plugins  # noqa: F401
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401
    except ImportError as err:
        raise RuntimeError(import_failure(err, "sglang.srt.plugins.hook_registry")) from None
    return "sglang.srt.plugins.load_plugins and HookRegistry available"


def _check_target(target: str) -> str:
    try:
        obj = _import_target(target)
    except (AttributeError, ModuleNotFoundError) as err:
        if missing_dependency(err) is not None:
            raise RuntimeError(import_failure(err, target)) from None
        raise RuntimeError(f"missing target {target} ({err}); supported SGLang versions: "
                           f"{targets.SUPPORTED_VERSIONS}; "
                           "SGLang will serve unmodified (HookRegistry logs the failure)") from None
    except Exception as err:
        raise RuntimeError(f"cannot import the module of {target}: {type(err).__name__}: {' '.join(str(err).split())} "
                           "(an installation problem, not a version mismatch)") from None
    params = inspect.signature(inspect.unwrap(obj)).parameters
    missing = [name for name in targets.EXPECTED_PARAMETERS.get(target, ()) if name not in params]
    if missing:
        raise RuntimeError(f"{target} lacks parameter(s) {missing}; supported SGLang versions: "
                           f"{targets.SUPPORTED_VERSIONS}")
    return f"{target}({', '.join(params)})"


def _import_target(target: str) -> Any:
    """Resolve a dotted target, letting a module's own import error through (unlike pkgutil)."""
    parts = target.split(".")
    obj: Any = importlib.import_module(parts[0])
    for index in range(1, len(parts)):
        name = ".".join(parts[: index + 1])
        if hasattr(obj, "__path__"):  # a package: the next part may be a submodule
            try:
                obj = importlib.import_module(name)
                continue
            except ModuleNotFoundError as err:
                if err.name != name:
                    raise
        obj = getattr(obj, parts[index])
    return obj


def _check_hooks_live(settings: EnvSettings) -> str:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # SGLang's own loader: runs every entry point, then HookRegistry.apply_hooks()
    status = hooks_status()
    if settings.oea is None:
        if any(status.values()):
            raise RuntimeError(f"OEA_K0 is unset but hooks are installed: {status}")
        return "OEA off: plugin loaded, no hooks installed (set OEA_K0 to enable)"
    missing = [target for target, ok in status.items() if not ok]
    if missing:
        raise RuntimeError(f"hooks not installed on {missing} (HookRegistry logged why); "
                           f"supported SGLang versions: {targets.SUPPORTED_VERSIONS}")
    return f"installed on {', '.join(status)}"


def check_decode_detection(settings: EnvSettings | ValueError | None = None) -> dict[str, Any]:
    """Which decode-detection path this SGLang gets (chosen by ``forward_context``'s signature) and whether it
    is live in this process (its hooks installed; ``oea doctor`` installs them through ``load_plugins``).
    ``settings``: the doctor's reading of the environment (default: read here)."""
    return check_call("decode detection", lambda: _check_decode_detection(_readable(settings)))


def _short(target: str) -> str:
    return ".".join(target.rsplit(".", 2)[-2:])


def _check_decode_detection(settings: EnvSettings) -> str:
    path = [target for target, _ in decode_detection()]
    if path[0] == targets.FORWARD_CONTEXT_TARGET:
        how = (f"AROUND {targets.FORWARD_CONTEXT_TARGET}(ctx, *, forward_batch): every forward and graph capture "
               "carries its batch's forward_mode")
    else:
        why = ("its forward_context(ctx) is entered without the batch"
               if targets.module_available(targets.FORWARD_CONTEXT_MODULE) else "this SGLang has no forward_context")
        captures = ", ".join(_short(t) for t in path[1:]) or "no graph runner found"
        how = (f"AROUND ModelRunner.forward(self, forward_batch) (eager forwards and graph replays) and the "
               f"runners' capture_forward_mode while graphs are captured ({captures}); {why}")
    if settings.oea is None:
        return f"OEA off; with OEA_K0 set: {how}"
    missing = [target for target in path if not target_hooked(target)]
    if missing:
        raise RuntimeError(f"not installed on {', '.join(missing)}: decode forwards there keep SGLang's routing "
                           f"(HookRegistry logged why); planned: {how}")
    return f"live: {how}"


def _self_test(settings: EnvSettings) -> str:
    """Route 16 decode rows through the real ``select_experts`` (torch-native softmax) and compare."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    topk = importlib.import_module(targets.TOPK_MODULE)
    forced = settings.oea is None
    if forced:  # prove the path anyway, with a throw-away config in this doctor process only
        settings = EnvSettings(oea=OEAConfig(k0=1), source={})
        install(settings)
        HookRegistry.apply_hooks()
    assert settings.oea is not None
    cfg = settings.oea
    top_k = max(8, cfg.k0, cfg.max_experts or 0)
    num_experts, rows = 8 * top_k, 16
    logits = torch.randn(rows, num_experts, generator=torch.Generator().manual_seed(0)) * 2.0
    spec = RouterSpec(num_experts, top_k, "softmax", True)
    config = topk.TopKConfig(top_k=top_k, renormalize=True, torch_native=True)
    hidden = torch.zeros(rows, 1)
    with torch._dynamo.config.patch(disable=True):
        with _doctor_forward("DECODE"):
            decode = topk.select_experts(hidden_states=hidden, router_logits=logits, topk_config=config, layer_id=0)
        with _doctor_forward("EXTEND"):
            extend = topk.select_experts(hidden_states=hidden, router_logits=logits, topk_config=config, layer_id=0)
    expected_ids, expected_weights = route(logits, spec, cfg)
    vanilla_ids, vanilla_weights = route(logits, spec)
    if not same_routing(decode.topk_ids, decode.topk_weights, expected_ids, expected_weights):
        raise RuntimeError("DECODE routing through select_experts does not match oea.route: the rewrite hook "
                           "is not live")
    if not same_routing(extend.topk_ids, extend.topk_weights, vanilla_ids, vanilla_weights):
        raise RuntimeError("EXTEND routing was changed: OEA must only touch decode steps")
    t_vanilla = int(active_experts(vanilla_ids, vanilla_weights))
    t_oea = int(active_experts(decode.topk_ids.long(), decode.topk_weights))
    note = " (OEA is off here: self-test forced k0=1)" if forced else ""
    return (f"DECODE {rows} rows, {num_experts} experts, top-{top_k}, k0={cfg.k0}: active experts "
            f"{t_vanilla} -> {t_oea}, equal to oea.route; EXTEND unchanged{note}")


def _check_padding(settings: EnvSettings) -> str:
    """Which mechanism bounds the padding rows of graph-replayed decode batches in this environment."""
    planned = padding.replay_targets()
    cuda, cpu = planned["cuda"], planned["cpu"]
    if cuda is None:
        raise RuntimeError(f"none: {padding.missing_hook_message(None)}")
    try:
        params = inspect.signature(inspect.unwrap(_import_target(cuda))).parameters
    except (AttributeError, ModuleNotFoundError) as err:
        if missing_dependency(err) is not None:
            raise RuntimeError(import_failure(err, cuda)) from None
        raise RuntimeError(f"none: {padding.missing_hook_message(cuda)}") from None
    except Exception as err:
        raise RuntimeError(import_failure(err, cuda)) from None
    lacking = [name for name in padding.REPLAY_PARAMETERS if name not in params]
    if lacking:
        raise RuntimeError(f"none: {cuda} lacks parameter(s) {lacking}; {padding.missing_hook_message(cuda)}")
    sglang_own = ("SGLang's own num_token_non_padded is used instead where SGLang keeps one (EP > 1, "
                  "DP-attention gathering, a custom all-to-all)")
    hook_points = ", ".join(t.rsplit(".", 2)[-2] + "." + t.rsplit(".", 1)[-1] for t in (cuda, cpu) if t)
    if settings.oea is None:
        return (f"OEA off; with OEA_K0 set, OEA's replay count ({hook_points}) keeps the padding rows of "
                f"graph-replayed decode batches out of the union at plain TP; {sglang_own}")
    if not target_hooked(cuda):
        raise RuntimeError(f"none: {padding.missing_hook_message(cuda)} (not installed: HookRegistry logged why)")
    cpu_note = "" if cpu is None or target_hooked(cpu) else f" (CPU graph runner: {cpu} not hooked)"
    return (f"OEA's replay count ({hook_points} hooked{cpu_note}): padding rows of graph-replayed decode batches "
            f"stay out of the union at plain TP; {sglang_own}")


@contextlib.contextmanager
def _doctor_forward(mode_name: str) -> Iterator[None]:
    """SGLang's ``forward_context`` (hooked) with a minimal batch in ``mode_name``, or on versions whose
    forward_context lacks the batch, the ``ModelRunner.forward`` hook's phase."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = getattr(ForwardMode, mode_name)
    batch = SimpleNamespace(forward_mode=mode, moe_num_token_non_padded=None)
    if decode_detection()[0][0] != targets.FORWARD_CONTEXT_TARGET:
        with model_runner_phase(batch):  # what the ModelRunner.forward hook holds (no ModelRunner built here)
            yield
        return
    fc = importlib.import_module(targets.FORWARD_CONTEXT_MODULE)
    with fc.forward_context(fc.ForwardContext(attn_backend=None), forward_batch=batch):
        yield
