"""The entry point ``register`` and the hooks it installs in vLLM's classes; model load.

``register`` (every vLLM process) reads the environment and, unless OEA and its metrics are off, wraps:

* each router class's own ``_compute_routing`` (``ROUTER_CLASSES``) with ``routing.cpu_wrapper`` (CPU) or
  ``routing.graph_wrapper`` (other devices), so OEA runs before routed-experts capture and the EPLB
  logical->physical mapping;
* ``WorkerWrapperBase.execute_model``: ``steps.begin_step`` / ``steps.end_step`` around each engine step;
* ``Worker.load_model``: ``_after_load`` numbers the model's routers, checks the settings against each
  top_k, reads ``OEA_LAYER_K0_FILE`` (``layers.py``), warns once about layers it cannot rewrite, allocates
  the decode flag on the model's device, compiles the numba kernels and starts ``OEA_TRACE_FILE``'s recording;
* ``FusedMoERouter.supports_monolithic_kernels`` (vLLM >= 0.33) reports False, so no monolithic kernel
  routes inside itself and bypasses OEA.

A router class substituted by a platform that overrides ``_compute_routing`` never calls the wrapper
(``router_bypasses``, the rule: ``oea.integrations.bypass``): ``register`` warns once per such class, and at model
load a layer routed by one keeps its own routing, counted as not rewritable.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

import torch

from oea.config import (
    TraceSettings,
    blank_note,
    blank_variables,
    layer_configs,
    warn_unknown_variables,
)
from oea.config.settings import all_settings_from_env
from oea.integrations.bypass import Bypass, class_path, describe, find_bypasses, find_safely, startup_warning
from oea.integrations.deterministic import keep_engine_routing
from oea.integrations.metrics import MetricsWriter
from oea.integrations.recording.common import writable_settings
from oea.integrations.recording.recorder import trace_path_problem
from oea.integrations.runtime import WRAPPED, wrap_method
from oea.integrations.vllm.layers import load as load_layer_k0
from oea.integrations.vllm.placement import setup as setup_ep_placements
from oea.integrations.vllm.prometheus import prepare_api_server, start_worker_export
from oea.integrations.vllm.recording import start_recording
from oea.integrations.vllm.routing import cpu_wrapper, define_cpu_op, graph_wrapper, oea_route_for
from oea.integrations.vllm.speculative import read_speculation
from oea.integrations.vllm.state import STATE, log, warn_once
from oea.integrations.vllm.steps import begin_step, end_step, unreadable_speculation
from oea.integrations.vllm.targets import BATCH_INVARIANT_VARIABLE, ROUTER_CLASSES, ROUTER_MODULE
from oea.kernels import choose_impl, route_fast
from oea.routing import RouterSpec, unsupported_layer_message

ROUTING_METHOD = "_compute_routing"  # the method of ROUTER_CLASSES the plugin wraps


def register() -> None:
    """vLLM plugin entry point: install the hooks when the environment asks for OEA or its metrics.

    Raises ``ValueError`` naming the variable when an ``OEA_*`` value is malformed, which stops vLLM
    at start-up (better than serving with a silently wrong configuration).
    """
    settings = all_settings_from_env()  # every OEA_* setting, read once for this process
    layer_configs(settings)  # OEA_LAYER_K0_FILE readable, well-formed and with OEA_K0, else start-up stops naming it
    # vLLM's batch-invariant mode: OEA stays off, one warning (the rule: oea.integrations.deterministic)
    settings = keep_engine_routing(settings, batch_invariant_setting(), warn_once)
    timing = settings.timing
    trace = _trace_settings(settings.trace)
    observed = settings.metrics_file or timing or trace is not None
    mode = "oea" if settings.oea is not None else ("observe" if observed else "off")
    blank = blank_note(blank_variables(os.environ))
    if blank and not STATE.installed:  # OEA_K0= is read as unset: said, not silent
        log.warning("oea: %s", blank)
    warn_unknown_variables(warn=log.warning)  # OEA_K00=3 (a typo) would serve without OEA: said, not silent
    if mode == "off" or STATE.installed:
        return
    STATE.settings, STATE.mode, STATE.timing, STATE.trace_settings = settings, mode, timing, trace
    wrapped = install_hooks()
    STATE.installed = True
    if mode == "oea":  # a substituted router class defined by now: said at start-up (model load checks the rest)
        startup_warning(router_bypasses, warn_once)
        prepare_api_server(settings)  # the oea_* series' way to vLLM's /metrics (prometheus.py)
    cfg = settings.oea
    what = f"k0={cfg.k0} min_batch={cfg.min_batch}" if cfg is not None else "stock routing"
    log.info("oea: mode=%s (%s) pid=%d process=%s; wrapped %s", mode, what, os.getpid(), _process_title(),
             ", ".join(wrapped))


def batch_invariant_setting() -> str | None:
    """``"VLLM_BATCH_INVARIANT=1"`` when vLLM's batch-invariant mode is on in this process, else None.

    Read the way vLLM reads it: ``vllm.envs.VLLM_BATCH_INVARIANT`` (0.32 and 0.33 have no accessor function; their
    ``init_batch_invariance`` and every kernel read that attribute: ``bool(int(os.getenv("VLLM_BATCH_INVARIANT",
    "0")))``), or that same parse of the variable where ``vllm.envs`` is not importable (the doctor without vLLM).
    A value vLLM cannot parse raises ``ValueError`` naming the variable (vLLM itself would fail on it).
    """
    raw = os.environ.get(BATCH_INVARIANT_VARIABLE, "0")
    try:
        try:
            import vllm.envs as envs
        except ImportError:
            on = bool(int(raw))
        else:
            on = bool(envs.VLLM_BATCH_INVARIANT)
    except ValueError:  # int() of a word
        raise ValueError(f"{BATCH_INVARIANT_VARIABLE} must be an integer as vLLM reads it (0 or 1), got {raw!r}") \
            from None
    return f"{BATCH_INVARIANT_VARIABLE}=1" if on else None


def _trace_settings(trace: TraceSettings | None) -> TraceSettings | None:
    """``OEA_TRACE_*`` as read (a malformed value stopped start-up); an unwritable file is a warning: no recording."""
    return writable_settings(trace, log)


def _process_title() -> str:
    """This process's title (vLLM names its API server, engine core and workers), for the log."""
    try:
        import setproctitle

        return str(setproctitle.getproctitle())
    except ImportError:
        return "?"


def install_hooks() -> list[str]:
    """Apply every patch (idempotent per class); returns the names of what was wrapped."""
    wrapped = []
    define_cpu_op()
    for name, module in ROUTER_CLASSES.items():
        try:
            cls = getattr(importlib.import_module(f"{ROUTER_MODULE}.{module}"), name)
        except (ImportError, AttributeError) as err:
            warn_once(f"class:{name}", f"router class {name} not found ({err}); it is left stock")
            continue
        if name in STATE.originals or "_compute_routing" not in cls.__dict__:
            continue
        STATE.originals[name] = cls.__dict__["_compute_routing"]
        wrapper = cpu_wrapper(STATE.originals[name]) if name == "CPURouter" else graph_wrapper(STATE.originals[name])
        setattr(wrapper, WRAPPED, True)  # what the bypass check recognises as OEA's hook
        cls._compute_routing = wrapper
        wrapped.append(f"{name}._compute_routing")
    if STATE.mode == "oea":
        wrapped += _disable_monolithic()
    wrapped += _wrap_worker()
    return wrapped


def hooked_router_classes() -> list[type]:
    """vLLM's router classes whose ``_compute_routing`` the plugin wraps (``ROUTER_CLASSES``), those importable."""
    found = []
    for name, module in ROUTER_CLASSES.items():
        try:
            found.append(getattr(importlib.import_module(f"{ROUTER_MODULE}.{module}"), name))
        except (ImportError, AttributeError):  # install_hooks warns about a missing class; the doctor fails it
            continue
    return found


def router_bypasses() -> tuple[list[Bypass], str]:
    """Every router class of this process (each wrapped class and all its subclasses: a platform's substituted
    router is one) whose ``_compute_routing`` is not OEA's wrapper's, and what was looked at."""
    hooked = hooked_router_classes()
    found = [bypass for cls in hooked
             for bypass in find_bypasses(cls, (ROUTING_METHOD,), wrapped=cls.__name__ in STATE.originals)]
    return found, f"{ROUTING_METHOD} of {describe(hooked)}" if hooked else "no vLLM router class importable"


def _disable_monolithic() -> list[str]:
    """vLLM >= 0.33: make every router report no monolithic-kernel support (modular kernels call the
    router; monolithic ones route inside the kernel and would bypass OEA). Absent in 0.32, where
    ``Worker.load_model`` checks each layer instead."""
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    if "supports_monolithic_kernels" not in dir(FusedMoERouter):
        return []
    FusedMoERouter.supports_monolithic_kernels = property(lambda self: False)  # type: ignore[assignment]
    return ["FusedMoERouter.supports_monolithic_kernels=False"]


def _wrap_worker() -> list[str]:
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    def around_step(original: Any) -> Any:
        def execute_model(self: Any, scheduler_output: Any) -> Any:
            begin_step(scheduler_output)
            try:
                return original(self, scheduler_output)
            finally:
                end_step()

        return execute_model

    def after_load(original: Any) -> Any:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            STATE.model_runner = self.model_runner
            _after_load(self.model_runner.get_model())
            return out

        return load_model

    done = []
    if wrap_method(WorkerWrapperBase, "execute_model", around_step):
        done.append("WorkerWrapperBase.execute_model")
    if wrap_method(Worker, "load_model", after_load):
        done.append("Worker.load_model")
    return done


# ---------------------------------------------------------------- model load: routers and flag


def router_spec(router: Any) -> tuple[RouterSpec | None, str]:
    """The ``RouterSpec`` matching a vLLM router's own routing, or (None, reason) when OEA cannot
    reproduce it (the layer then keeps stock routing)."""
    name = type(router).__name__
    scoring = getattr(router, "scoring_func", "softmax")
    if getattr(router, "custom_routing_function", None) is not None:
        return None, "custom_routing_function"
    if getattr(router, "_hash_indices_table", None) is not None:
        return None, "hash-routed layer"
    if scoring not in ("softmax", "sigmoid"):
        return None, f"scoring_func={scoring!r}"
    bias = getattr(router, "e_score_correction_bias", None)
    grouped = bool(getattr(router, "use_grouped_topk", name == "GroupedTopKRouter"))
    n_group = getattr(router, "num_expert_group", None) if grouped else None
    topk_group = getattr(router, "topk_group", None) if grouped else None
    if n_group is not None and n_group > 1 and bias is None:
        return None, "grouped routing without a correction bias (group score differs)"
    if n_group is not None and n_group <= 1:
        n_group = topk_group = None
    if scoring == "sigmoid" and bias is None and name != "FusedTopKRouter":
        return None, "sigmoid routing without a correction bias"
    # CPURouter's plain softmax path ignores routed_scaling_factor; its grouped path folds it in.
    folds_scale = grouped or name in ("FusedTopKBiasRouter",)
    try:
        spec = RouterSpec(
            num_experts=int(router.global_num_experts),
            top_k=int(router.top_k),
            scoring=scoring,
            renormalize=bool(getattr(router, "renormalize", True)),
            correction_bias=None if bias is None else getattr(bias, "data", bias),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(getattr(router, "routed_scaling_factor", 1.0)) if folds_scale else 1.0,
        )
    except ValueError as err:
        return None, str(err)
    return spec, ""


def _after_load(model: torch.nn.Module) -> None:
    """Number the model's routers, validate OEA_K0 against each top_k, allocate the decode flag."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    device = None
    found = 0
    rewritable = []  # (router id, layer, router): OEA_POLICY=ep reads each layer's expert placement
    bypassed = _bypassed_classes()
    for name, module in model.named_modules():
        if device is None:
            param = next(module.parameters(recurse=False), None)
            device = None if param is None else param.device
        router = getattr(module, "router", None)
        if not isinstance(router, BaseRouter) or hasattr(router, "_oea_router_id"):
            continue
        found += 1
        spec, reason = router_spec(router)
        if spec is not None and getattr(module, "is_monolithic", False):
            spec, reason = None, "monolithic MoE kernel (routes inside the kernel)"
        bypass = bypassed.get(class_path(type(router)))
        if bypass is not None:  # never calls the wrapper: one warning per class, the bypass check's words
            spec, reason = None, ""
            warn_once(bypass.key, bypass.message)
        elif spec is not None and type(router).__name__ not in STATE.originals:
            spec, reason = None, f"router class {type(router).__name__} is not wrapped"
        if spec is None and reason:
            warn_once(f"unsupported:{reason}", unsupported_layer_message(name, reason))
        router._oea_router_id = len(STATE.routers)
        router._oea_layer = name
        STATE.routers.append(router)
        STATE.specs.append(spec)
        if spec is not None:
            rewritable.append((router._oea_router_id, module, router))
    load_layer_k0(STATE.specs)  # OEA_K0, OEA_LAYER_K0_FILE: every router's config; fits the model or stops
    setup_ep_placements(rewritable)
    STATE.speculation, problem = read_speculation(getattr(STATE.model_runner, "vllm_config", None))
    if problem:
        unreadable_speculation(problem)
    STATE.decode_flag = torch.zeros((), dtype=torch.bool, device=device or "cpu")
    _warm_up_kernels(device)
    if STATE.settings is not None and STATE.metrics is None:
        _start_metrics()
    if STATE.trace_settings is not None and STATE.recorder is None:
        start_recording(STATE.trace_settings, STATE.model_runner, device)
    supported = sum(s is not None for s in STATE.specs)
    log.info("oea: %d MoE routers in the model, %d rewritable (mode=%s, pid=%d)%s", found, supported,
             STATE.mode, os.getpid(), _speculation_note())
    if found == 0:
        warn_once("no-routers", "the model has no vLLM MoE router; nothing to rewrite")


def _start_metrics() -> None:
    """``OEA_METRICS_FILE``'s writer, fed with each step's record; with OEA on it also feeds the ``oea_*``
    Prometheus series (``prometheus.py``), which need a writer even without a file."""
    path = STATE.settings.metrics_file if STATE.settings is not None else None
    problem = trace_path_problem(path) if path else None  # the same test: a file this process writes
    if problem is not None:
        warn_once("metrics-path", f"OEA_METRICS_FILE={path} cannot be written ({problem}); serving without metrics")
        path = None
    exporter = start_worker_export(getattr(STATE.model_runner, "model_config", None))
    if path or exporter is not None:
        STATE.metrics = MetricsWriter(path, STATE.settings.metrics_flush_s if STATE.settings else 0.5, log,
                                      export=exporter)


def _bypassed_classes() -> dict[str, Bypass]:
    """The router classes that bypass OEA's wrapper (by ``module.QualName``); a check that cannot run warns once
    and finds none, so model load goes on."""
    return {bypass.router: bypass for bypass in find_safely(router_bypasses, warn_once)}


def _speculation_note() -> str:
    """What the load log says about speculative decoding (nothing when it is off)."""
    spec = STATE.speculation
    if spec is None:
        return ""
    verify = STATE.settings is not None and STATE.settings.apply_to_verify and STATE.verify_readable
    return (f"; speculative decoding {spec.method} with up to {spec.num_speculative_tokens} draft tokens: verify "
            f"steps {'rewritten (OEA_APPLY_TO_VERIFY=1)' if verify else 'keep vLLM routing'}")


def _warm_up_kernels(device: torch.device | None) -> None:
    """Compile the numba kernels now rather than in the first decode step (a few seconds once)."""
    cfg = STATE.settings.oea if STATE.settings is not None else None
    if cfg is None or (device is not None and device.type != "cpu"):
        return
    probe = [(i, spec) for i, spec in enumerate(STATE.specs)
             if spec is not None and choose_impl(torch.zeros(2, spec.num_experts), spec, cfg) == "numba"]
    if not probe:
        return
    started = time.perf_counter()
    router_id, spec = probe[0]
    for dtype in (torch.bfloat16, torch.float32):  # the op's own path: its int32 buffers, fp32 and bf16 logits
        oea_route_for(spec, torch.zeros(2, spec.num_experts, dtype=dtype), None, router_id)
        route_fast(torch.zeros(2, spec.num_experts, dtype=dtype), spec, cfg)  # and the int64 one (GPU-less tools)
    log.info("oea: numba routing kernels ready in %.1f s", time.perf_counter() - started)
