"""SGLang integration: OEA as an ``sglang.srt.plugins`` entry-point plugin.

Enable with ``OEA_K0=<k0>`` (alias ``SGLANG_OEA_K0``) in the environment of the SGLang server;
everything else is automatic: SGLang's ``load_plugins()`` runs :func:`register` in every process
(launcher, schedulers, DP controller, detokenizer) and applies the hooks through its
``HookRegistry``. Without ``OEA_K0`` the plugin installs nothing and SGLang is untouched.

Hooks (SGLang 0.5.12-0.5.23; see ``docs/sglang.md``):

* decode detection: an AROUND hook on ``forward_context`` (0.5.15+) or, on versions without
  it, on ``ModelRunner.forward`` plus ``CudaGraphRunner.capture_one_batch_size``. It pushes the
  batch's ``ForwardMode`` on a per-thread stack, so a decode CUDA graph captured under it bakes
  OEA in and prefill/extend graphs bake it out.
* the rewrite: a BEFORE hook on ``topk._post_process_topk_ids``. It sees logical expert ids
  before the EPLB remap, the padded-row mask, the shared-expert append, routed-experts capture
  and the expert-distribution recorder, so all of those see the OEA ids. Only the routed
  columns are rewritten; padding rows (``num_token_non_padded``) keep SGLang's output and do not
  join the union.
* a BEFORE hook on ``topk.select_experts`` that only notes per-token dynamic expert bias
  (Bailing/Ling), which the rewrite cannot rebuild and therefore passes through.

Unsupported routings pass through unchanged with one warning per reason; the plugin never
raises inside a forward pass. A malformed ``OEA_*`` variable raises ``ValueError`` naming it at
start-up (:func:`register` raises ``SystemExit`` naming it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import pkgutil
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from oea.config import EnvSettings, settings_from_env
from oea.routing import LayerK0Schedule, OEAConfig, RouterSpec, route

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = "0.5.12 to 0.5.23 (plugin); older: python -m oea.launch.sglang"
TESTED_VERSION = "0.5.23"
PLUGIN_VERSION_MIN = (0, 5, 12)
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_VALUE = "oea.integrations.sglang:register"

TOPK_MODULE = "sglang.srt.layers.moe.topk"
POST_PROCESS_TARGET = f"{TOPK_MODULE}._post_process_topk_ids"
SELECT_EXPERTS_TARGET = f"{TOPK_MODULE}.select_experts"
FORWARD_CONTEXT_MODULE = "sglang.srt.model_executor.forward_context"
FORWARD_CONTEXT_TARGET = f"{FORWARD_CONTEXT_MODULE}.forward_context"
MODEL_RUNNER_FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
GRAPH_CAPTURE_TARGET = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner.capture_one_batch_size"

# Parameters each hook relies on (checked by ``oea doctor``; the hooks read them by keyword).
EXPECTED_PARAMETERS: dict[str, tuple[str, ...]] = {
    POST_PROCESS_TARGET: ("topk_ids", "topk_weights", "topk_config", "router_logits", "layer_id",
                          "num_token_non_padded"),
    SELECT_EXPERTS_TARGET: ("hidden_states", "router_logits", "topk_config", "num_token_non_padded"),
    FORWARD_CONTEXT_TARGET: ("ctx", "forward_batch"),
    MODEL_RUNNER_FORWARD_TARGET: ("self", "forward_batch"),
    GRAPH_CAPTURE_TARGET: ("self",),
}
SIMULATION_VARIABLES = ("SGLANG_SIMULATE_UNIFORM_EXPERTS", "SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS")


class UnsupportedRouting(Exception):
    """A router this plugin cannot rebuild; the layer keeps SGLang's own routing."""


# ----------------------------------------------------------------------------- config translation


def shared_topk_slots(topk_config: Any) -> int:
    """Appended shared-expert columns of a ``TopKConfig`` (0.5.23 name, then 0.5.9-0.5.19 name)."""
    slots = getattr(topk_config, "num_shared_topk_slots", None)
    if slots is None:
        slots = getattr(topk_config, "num_fused_shared_experts", 0)
    return int(slots or 0)


def router_spec_from_topk_config(
    topk_config: Any, num_experts: int, *, scaling_fused: bool | None = None
) -> RouterSpec:
    """Translate SGLang's ``TopKConfig`` into the ``RouterSpec`` of its routed columns.

    Args:
        topk_config: SGLang ``TopKConfig`` (read by attribute; any object with its fields works).
        num_experts: E, routed logical experts (``router_logits.shape[1]``).
        scaling_fused: whether SGLang already folded ``routed_scaling_factor`` into the top-k
            weights (``is_routed_scaling_factor_fused_in_topk``); defaults to
            ``apply_routed_scaling_factor_on_output``.

    Raises:
        UnsupportedRouting: for routings OEA does not rebuild here (custom routing functions,
            sqrtsoftplus, non-STANDARD output formats, max-per-group grouping that limits groups).
    """
    output_format = getattr(topk_config, "output_format", None)
    if output_format is not None and getattr(output_format, "name", str(output_format)) != "STANDARD":
        raise UnsupportedRouting(
            f"output_format={getattr(output_format, 'name', output_format)}: routing happens inside "
            "the MoE kernel (use --moe-runner-backend triton)"
        )
    if getattr(topk_config, "custom_routing_function", None) is not None:
        raise UnsupportedRouting("custom_routing_function is set (e.g. Llama4)")
    if getattr(topk_config, "fused_gate_packed_ids", False):
        raise UnsupportedRouting("fused_gate_packed_ids: the router also emits packed ids")
    scoring = getattr(topk_config, "scoring_func", "softmax") or "softmax"
    routed_k = int(topk_config.top_k) - shared_topk_slots(topk_config)
    renormalize = bool(topk_config.renormalize)
    bias = topk_config.correction_bias
    grouped = bool(topk_config.use_grouped_topk)
    n_group = getattr(topk_config, "num_expert_group", None)
    topk_group = getattr(topk_config, "topk_group", None)
    if scaling_fused is None:
        scaling_fused = bool(getattr(topk_config, "apply_routed_scaling_factor_on_output", False))
    factor = getattr(topk_config, "routed_scaling_factor", None)
    scale = float(factor) if scaling_fused and factor is not None else 1.0

    if grouped and bias is not None:
        # SGLang's biased grouped top-k is always sigmoid (scoring_func is ignored on this path);
        # the group score is the sum of the top-2 biased scores, as in oea.
        spec_n_group = int(n_group) if n_group else None
        spec_topk_group = int(topk_group) if (n_group and topk_group) else None
        return RouterSpec(num_experts, routed_k, "sigmoid", renormalize, _bias_vector(bias, num_experts),
                          spec_n_group, spec_topk_group, scale)
    if scoring not in ("softmax", "sigmoid"):
        raise UnsupportedRouting(f"scoring_func={scoring!r}")
    if grouped and n_group and topk_group and int(topk_group) < int(n_group):
        # grouped_topk without bias scores a group by its max expert; oea's grouped rule is the
        # DeepSeek-V3 sum of top-2, so only the no-limit case is the same router.
        raise UnsupportedRouting(
            f"grouped_topk without correction bias and topk_group={topk_group} < n_group={n_group}"
        )
    if bias is not None and scoring != "sigmoid":
        raise UnsupportedRouting(f"correction_bias with scoring_func={scoring!r}")
    return RouterSpec(num_experts, routed_k, scoring, renormalize,
                      None if bias is None else _bias_vector(bias, num_experts), None, None, scale)


def _bias_vector(bias: torch.Tensor, num_experts: int) -> torch.Tensor:
    if bias.dim() != 1 or bias.shape[0] != num_experts:
        raise UnsupportedRouting(f"correction_bias of shape {tuple(bias.shape)} (per-token or EP-sliced bias)")
    return bias


# ----------------------------------------------------------------------------- the rewrite


def rewrite_topk(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    router_logits: torch.Tensor,
    spec: RouterSpec,
    cfg: OEAConfig,
    num_token_non_padded: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """OEA over SGLang's top-k output of one layer call.

    Args:
        topk_ids: [M, k + s] SGLang's logical ids (s appended shared-expert columns, kept as is).
        topk_weights: [M, k + s] SGLang's weights.
        router_logits: [M, E] raw router logits.
        spec: the routed router (``spec.top_k`` = k).
        cfg: the OEA configuration.
        num_token_non_padded: rows >= this count are padding: excluded from the union and
            returned as SGLang produced them. ``None``: every row is real.

    Returns:
        ``(ids, weights)`` in the dtypes and shapes of ``topk_ids`` / ``topk_weights``, or
        ``None`` when the batch is below ``cfg.min_batch`` (nothing to change). Rows that are
        not rerouted (padding; every row when fewer than ``min_batch`` rows are real) keep
        SGLang's values exactly. Graph-safe: no host synchronisation.
    """
    m, k = topk_ids.shape[0], spec.top_k
    if router_logits.shape[0] != m or topk_ids.shape[1] < k:
        raise UnsupportedRouting(
            f"top-k output {tuple(topk_ids.shape)} does not match router_logits {tuple(router_logits.shape)} "
            f"and top_k={k}"
        )
    valid = None
    if num_token_non_padded is not None:
        valid = torch.arange(m, device=router_logits.device) < num_token_non_padded
    elif m < cfg.min_batch:
        return None
    ids, weights = route(router_logits, spec, cfg, valid)
    rerouted = torch.ones(m, dtype=torch.bool, device=router_logits.device) if valid is None else valid
    if valid is not None and cfg.min_batch > 1:
        rerouted = rerouted & (valid.sum() >= cfg.min_batch)
    routed_ids = torch.where(rerouted[:, None], ids.to(topk_ids.dtype), topk_ids[:, :k])
    routed_weights = torch.where(rerouted[:, None], weights.to(topk_weights.dtype), topk_weights[:, :k])
    if topk_ids.shape[1] > k:
        routed_ids = torch.cat([routed_ids, topk_ids[:, k:]], dim=1)
        routed_weights = torch.cat([routed_weights, topk_weights[:, k:]], dim=1)
    return routed_ids, routed_weights


# ----------------------------------------------------------------------------- per-process state


class _PhaseStack(threading.local):
    def __init__(self) -> None:
        self.modes: list[Any] = []  # ForwardMode per entered forward; None = inherit the outer one
        self.dynamic_bias = False


_PHASE = _PhaseStack()


@dataclass
class _State:
    settings: EnvSettings | None = None
    installed_targets: tuple[str, ...] = ()
    phase_hook_seen: bool = False
    rewrite_hook_seen: bool = False
    rewrites: int = 0
    layer_schedule: LayerK0Schedule | None = None
    layer_configs: dict[int, OEAConfig] = dataclasses.field(default_factory=dict)


_STATE = _State()
_SPECS: dict[int, tuple[Any, int, RouterSpec | str]] = {}  # id(topk_config) -> (config, E, spec | reason)
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("oea: %s", message)


def current_forward_mode() -> Any:
    """The innermost known ``ForwardMode`` of this thread, or ``None`` outside any forward."""
    for mode in reversed(_PHASE.modes):
        if mode is not None:
            return mode
    return None


def decode_active() -> bool:
    """True when this thread is inside a DECODE forward (or TARGET_VERIFY with OEA_APPLY_TO_VERIFY=1)."""
    mode = current_forward_mode()
    if mode is None:
        return False
    if _call_predicate(mode, "is_decode"):
        return True
    settings = _STATE.settings
    return bool(settings and settings.apply_to_verify and _call_predicate(mode, "is_target_verify"))


def _call_predicate(mode: Any, name: str) -> bool:
    predicate = getattr(mode, name, None)
    return bool(predicate()) if callable(predicate) else False


@contextlib.contextmanager
def forward_mode(mode: Any) -> Iterator[None]:
    """Push ``mode`` (a ``ForwardMode``; ``None`` inherits) for the duration of the block."""
    _PHASE.modes.append(mode)
    try:
        yield
    finally:
        _PHASE.modes.pop()


# ----------------------------------------------------------------------------- hooks


def _forward_context_around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``forward_context(ctx, *, forward_batch=None)``: returns a context manager."""
    forward_batch = kwargs.get("forward_batch", args[1] if len(args) > 1 else None)
    mode = getattr(forward_batch, "forward_mode", None) if forward_batch is not None else None
    return _phase_context(original(*args, **kwargs), mode)


@contextlib.contextmanager
def _phase_context(inner: Any, mode: Any) -> Iterator[Any]:
    _note_phase_hook()
    with forward_mode(mode), inner as value:
        yield value


def _model_runner_forward_around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ModelRunner.forward(self, forward_batch, ...)`` (versions without forward_context)."""
    forward_batch = kwargs.get("forward_batch", args[1] if len(args) > 1 else None)
    _note_phase_hook()
    with forward_mode(getattr(forward_batch, "forward_mode", None)):
        return original(*args, **kwargs)


def _graph_capture_around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``CudaGraphRunner.capture_one_batch_size`` (versions without forward_context)."""
    runner = args[0] if args else None
    _note_phase_hook()
    with forward_mode(getattr(runner, "capture_forward_mode", None)):
        return original(*args, **kwargs)


def _note_phase_hook() -> None:
    if not _STATE.phase_hook_seen:
        _STATE.phase_hook_seen = True
        missing = [t for t in (POST_PROCESS_TARGET,) if not target_hooked(t)]
        if missing:
            log.error("oea: OEA_K0 is set but the routing hook is not installed on %s; serving WITHOUT OEA "
                      "(supported SGLang versions: %s; run `oea doctor sglang`)", missing, SUPPORTED_VERSIONS)


def _select_experts_before(*args: Any, **kwargs: Any) -> None:
    """BEFORE ``select_experts``: remember whether this call routes with a per-token bias."""
    _PHASE.dynamic_bias = kwargs.get("dynamic_expert_bias") is not None
    return None


def _post_process_before(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """BEFORE ``_post_process_topk_ids(**kw)``: replace the routed ids/weights in DECODE forwards."""
    if not _STATE.rewrite_hook_seen:
        _STATE.rewrite_hook_seen = True
        if not _STATE.phase_hook_seen and _STATE.settings is not None:
            _warn_once("no-phase", "no forward-mode hook has run yet; routing calls outside a decode "
                                   "forward keep SGLang's routing")
    if not decode_active():
        return None
    settings = _STATE.settings
    if settings is None or settings.oea is None:
        return None
    if args:
        _warn_once("positional", f"{POST_PROCESS_TARGET} called positionally (unsupported SGLang version "
                                 f"{engine_version()}; supported: {SUPPORTED_VERSIONS}); passing through")
        return None
    if _PHASE.dynamic_bias:
        _warn_once("dynamic-bias", "per-token dynamic_expert_bias routing (Bailing/Ling) passes through")
        return None
    try:
        topk_config = kwargs["topk_config"]
        router_logits = kwargs["router_logits"]
        spec = _spec_for(topk_config, router_logits.shape[1])
        if isinstance(spec, str):
            _warn_once(f"unsupported:{spec}", f"layer {kwargs.get('layer_id')}: {spec}; passing through "
                                              "(further layers with this routing: silently)")
            return None
        cfg = _layer_config(settings.oea, spec, kwargs.get("layer_id"))
        result = rewrite_topk(kwargs["topk_ids"], kwargs["topk_weights"], router_logits, spec, cfg,
                              kwargs.get("num_token_non_padded"))
    except UnsupportedRouting as why:
        _warn_once(f"unsupported:{why}", f"layer {kwargs.get('layer_id')}: {why}; passing through")
        return None
    except Exception as err:  # never take the server down from inside a forward pass
        key = f"error:{type(err).__name__}:{kwargs.get('layer_id')}"
        if key not in _WARNED:
            _WARNED.add(key)
            log.exception("oea: routing rewrite failed on layer %s; passing through", kwargs.get("layer_id"))
        return None
    if result is None:
        return None
    _STATE.rewrites += 1
    return args, {**kwargs, "topk_ids": result[0], "topk_weights": result[1]}


def _layer_config(default: OEAConfig, spec: RouterSpec, layer_id: int | None) -> OEAConfig:
    """The per-layer config from ``OEA_LAYER_K0_FILE`` for ``layer_id``, else ``default`` (OEA_K0)."""
    schedule = _STATE.layer_schedule
    if schedule is None:
        return default
    if (schedule.num_experts, schedule.top_k) != (spec.num_experts, spec.top_k):
        _warn_once("layer-k0-model", f"OEA_LAYER_K0_FILE was calibrated for another model (num_experts "
                                     f"{schedule.num_experts} vs {spec.num_experts}, top_k {schedule.top_k} vs "
                                     f"{spec.top_k}); using OEA_K0={default.k0} for every layer")
        return default
    index = None if layer_id is None else schedule.index_of_layer_id(int(layer_id))
    if index is None:
        _warn_once(f"layer-k0-missing:{layer_id}", f"layer {layer_id} is not in OEA_LAYER_K0_FILE; using "
                                                   f"OEA_K0={default.k0} there")
        return default
    cached = _STATE.layer_configs.get(index)
    if cached is None:  # built once per layer, not on every routing call
        cached = dataclasses.replace(default, k0=schedule.k0[index])
        _STATE.layer_configs[index] = cached
    return cached


def _spec_for(topk_config: Any, num_experts: int) -> RouterSpec | str:
    """Cached per ``TopKConfig`` instance: its ``RouterSpec``, or the reason it passes through."""
    cached = _SPECS.get(id(topk_config))
    if cached is not None and cached[0] is topk_config and cached[1] == num_experts:
        return cached[2]
    settings = _STATE.settings
    try:
        reason = _unsupported_setup(topk_config)
        if reason:
            raise UnsupportedRouting(reason)
        spec: RouterSpec | str = router_spec_from_topk_config(
            topk_config, num_experts, scaling_fused=_scaling_fused(topk_config))
        if settings is not None and settings.oea is not None:
            settings.oea.check(spec)
    except UnsupportedRouting as why:
        spec = str(why)
    except ValueError as err:  # k0 / max_experts larger than this router's top_k
        spec = f"OEA_K0/OEA_MAX_EXPERTS do not fit this layer ({err})"
    _SPECS[id(topk_config)] = (topk_config, num_experts, spec)
    return spec


def _unsupported_setup(topk_config: Any) -> str | None:
    topk = importlib.import_module(TOPK_MODULE)
    if getattr(topk, "_use_aiter", False):
        return "AMD aiter routing (SGLANG_USE_AITER=1)"
    if getattr(topk, "_is_npu", False):
        return "Ascend NPU routing"
    if getattr(topk_config, "allow_routed_experts_capture", True) is False:
        return "speculative draft-model TopK"
    return None


def _scaling_fused(topk_config: Any) -> bool:
    topk = importlib.import_module(TOPK_MODULE)
    fused = getattr(topk, "is_routed_scaling_factor_fused_in_topk", None)
    if fused is not None:
        return bool(fused(topk_config))
    return bool(getattr(topk_config, "apply_routed_scaling_factor_on_output", False))


# ----------------------------------------------------------------------------- registration


def hook_plan(phase_via_forward_context: bool | None = None) -> list[tuple[str, Callable[..., Any], str]]:
    """(target, hook, HookType name) for this SGLang version, in registration order."""
    if phase_via_forward_context is None:
        phase_via_forward_context = module_exists(FORWARD_CONTEXT_MODULE)
    plan: list[tuple[str, Callable[..., Any], str]] = []
    if phase_via_forward_context:
        plan.append((FORWARD_CONTEXT_TARGET, _forward_context_around, "AROUND"))
    else:
        plan.append((MODEL_RUNNER_FORWARD_TARGET, _model_runner_forward_around, "AROUND"))
        plan.append((GRAPH_CAPTURE_TARGET, _graph_capture_around, "AROUND"))
    plan.append((SELECT_EXPERTS_TARGET, _select_experts_before, "BEFORE"))
    plan.append((POST_PROCESS_TARGET, _post_process_before, "BEFORE"))
    return plan


def module_exists(name: str) -> bool:
    """Whether ``name`` can be imported (False also when a parent package is missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def register() -> None:
    """``sglang.srt.plugins`` entry point: runs in every SGLang process before hooks are applied.

    Reads the environment (``OEA_K0`` off -> nothing is installed). Does not touch CUDA.

    A malformed ``OEA_*`` value stops the process with ``SystemExit`` naming the variable: SGLang's
    loader catches (and only logs) ``Exception`` from plugins, which would leave the server running
    without the requested configuration; ``SystemExit`` makes it a start-up error instead.
    """
    try:
        settings = settings_from_env()
    except ValueError as err:
        log.error("oea: invalid OEA configuration: %s", err)
        raise SystemExit(f"oea: invalid OEA configuration: {err}") from None
    if settings.oea is None:
        log.info("oea: OEA_K0 unset; SGLang routing unchanged")
        return
    install(settings)


def install(settings: EnvSettings) -> list[str]:
    """Register the OEA hooks for ``settings`` with SGLang's ``HookRegistry`` (applied by it later).

    Returns the registered targets. Idempotent per process; a later call only updates the settings.
    """
    simulated = [name for name in SIMULATION_VARIABLES if _env_flag(name)]
    if simulated:
        _warn_once("simulate", f"{', '.join(simulated)} overrides routing; OEA is not installed")
        return []
    _STATE.layer_schedule = None
    _STATE.layer_configs.clear()
    if settings.layer_k0_file:
        try:
            _STATE.layer_schedule = LayerK0Schedule.load(settings.layer_k0_file)
        except (OSError, ValueError) as err:
            raise ValueError(f"OEA_LAYER_K0_FILE={settings.layer_k0_file!r}: {err}") from None
    _STATE.settings = settings
    _SPECS.clear()
    if _STATE.installed_targets:
        return list(_STATE.installed_targets)
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as err:
        _warn_once("no-registry", f"SGLang has no plugin HookRegistry ({err}); supported versions: "
                                  f"{SUPPORTED_VERSIONS}. Serving without OEA.")
        return []
    plan = hook_plan()
    for target, hook, kind in plan:
        HookRegistry.register(target, hook, getattr(HookType, kind))
    _STATE.installed_targets = tuple(target for target, _, _ in plan)
    log.info("oea: OEA k0=%d min_batch=%d registered on %s", settings.oea.k0 if settings.oea else 0,
             settings.oea.min_batch if settings.oea else 0, ", ".join(_STATE.installed_targets))
    return list(_STATE.installed_targets)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def install_without_registry(settings: EnvSettings) -> list[str]:
    """Patch the targets directly (SGLang < 0.5.12, no plugin system); used by ``oea.launch.sglang``.

    Returns the patched targets. Versions without ``_post_process_topk_ids`` get an AROUND
    rewrite of ``select_experts``' output (EPLB remap must be off there; such calls pass through).
    """
    _STATE.settings = settings
    _SPECS.clear()
    patched: list[str] = []
    topk = importlib.import_module(TOPK_MODULE)
    plan = hook_plan()
    if not hasattr(topk, "_post_process_topk_ids"):
        plan = [(t, h, k) for t, h, k in plan if t not in (POST_PROCESS_TARGET, SELECT_EXPERTS_TARGET)]
        plan.append((SELECT_EXPERTS_TARGET, _select_experts_around_legacy, "AROUND"))
    for target, hook, kind in plan:
        try:
            _patch(target, hook, kind)
        except (ImportError, AttributeError) as err:
            _warn_once(f"patch:{target}", f"cannot hook {target} ({err}); supported versions: "
                                          f"{SUPPORTED_VERSIONS}")
            continue
        patched.append(target)
    _STATE.installed_targets = tuple(patched)
    return patched


def _select_experts_around_legacy(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``select_experts`` for versions without ``_post_process_topk_ids`` (0.5.9)."""
    output = original(*args, **kwargs)
    if not decode_active() or kwargs.get("expert_location_dispatch_info") is not None:
        return output
    names = ("hidden_states", "router_logits", "topk_config")
    call = dict(zip(names, args, strict=False)) | kwargs
    rewritten = _post_process_before(topk_ids=output.topk_ids, topk_weights=output.topk_weights,
                                     topk_config=call["topk_config"], router_logits=call["router_logits"],
                                     layer_id=call.get("layer_id"),
                                     num_token_non_padded=call.get("num_token_non_padded"))
    if rewritten is None:
        return output
    new = rewritten[1]
    return output._replace(topk_ids=new["topk_ids"], topk_weights=new["topk_weights"])


def _patch(target: str, hook: Callable[..., Any], kind: str) -> None:
    owner_path, name = target.rsplit(".", 1)
    owner = _resolve(owner_path)
    original = getattr(owner, name)
    if _has_hook(original, hook):
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


def _resolve(dotted: str) -> Any:
    return pkgutil.resolve_name(dotted)


def _has_hook(fn: Any, hook: Callable[..., Any]) -> bool:
    """True when ``hook`` is somewhere in the wrapper chain of ``fn`` (HookRegistry or ``_patch``)."""
    seen = 0
    while fn is not None and seen < 32:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def target_hooked(target: str) -> bool:
    """Whether the OEA hook planned for ``target`` is installed in this process."""
    hooks = {t: h for t, h, _ in hook_plan()} | {SELECT_EXPERTS_TARGET: _select_experts_before}
    hook = hooks.get(target)
    if hook is None:
        return False
    try:
        current = _resolve(target)
    except (ImportError, AttributeError):
        return False
    if target == SELECT_EXPERTS_TARGET and _has_hook(current, _select_experts_around_legacy):
        return True
    return _has_hook(current, hook)


def hooks_status() -> dict[str, bool]:
    """``{target: installed}`` for every target this process registered (or planned)."""
    targets = _STATE.installed_targets or tuple(t for t, _, _ in hook_plan())
    return {target: target_hooked(target) for target in targets}


def rewrite_count() -> int:
    """Layer calls rewritten by OEA in this process so far (eager calls and graph captures)."""
    return _STATE.rewrites


def engine_version() -> str | None:
    """Installed SGLang version, or ``None`` when SGLang is not installed in this interpreter."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def doctor_checks() -> list[dict[str, Any]]:
    """``oea doctor`` checks for SGLang: ``[{"name", "ok", "detail"}]``.

    Version, environment, entry point (registered, loads), plugin system, every hook target with
    its signature, hooks live after SGLang's own ``load_plugins()``, and a self-test through the
    real ``select_experts`` on CPU tensors in a DECODE and an EXTEND forward context.
    """
    from oea.integrations.doctor import check, check_call

    checks = [check_call("version", _check_version), check_call("environment", _check_environment),
              check_call("entry point registered", _check_entry_point),
              check_call("entry point loads", _check_entry_point_loads),
              check_call("plugin system", _check_plugin_system)]
    for target, _, _ in hook_plan():
        checks.append(check_call(f"hook target {target}", lambda target=target: _check_target(target)))
    if all(c["ok"] for c in checks):
        checks.append(check_call("hooks live", _check_hooks_live))
        checks.append(check_call("self-test select_experts", _self_test))
    else:
        checks.append(check("self-test select_experts", False, "skipped: fix the failed checks above first; "
                                                               "until then SGLang serves without OEA"))
    return checks


def _version_tuple(text: str) -> tuple[int, ...]:
    import re

    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _check_version() -> str:
    found = engine_version()
    if found is None:
        raise RuntimeError("sglang is not installed")
    if _version_tuple(found) < PLUGIN_VERSION_MIN:
        raise RuntimeError(f"sglang {found} has no plugin system; supported: {SUPPORTED_VERSIONS}")
    newer = _version_tuple(found) > _version_tuple(TESTED_VERSION)
    return f"sglang {found}" + (f" (newer than tested {TESTED_VERSION})" if newer else "") + \
        f"; supported {SUPPORTED_VERSIONS}"


def _check_environment() -> str:
    settings = settings_from_env()
    if settings.oea is None:
        return "OEA off: OEA_K0 (or SGLANG_OEA_K0) unset; SGLang routing stays unmodified"
    source = ", ".join(f"{k}={v}" for k, v in (settings.source or {}).items())
    return (f"OEA on: k0={settings.oea.k0}, min_batch={settings.oea.min_batch}, "
            f"max_experts={settings.oea.max_experts or 'top_k'}, group_fill={settings.oea.group_fill}, "
            f"apply_to_verify={settings.apply_to_verify} ({source})")


def _entry_point() -> Any:
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.value == ENTRY_POINT_VALUE]
    if not found:
        raise RuntimeError(f"no {ENTRY_POINT_GROUP!r} entry point {ENTRY_POINT_VALUE!r}; reinstall oea "
                           "(pip install -e . or pip install oea) in the interpreter that runs SGLang")
    return found[0]


def _check_entry_point() -> str:
    ep = _entry_point()
    return f"{ENTRY_POINT_GROUP}: {ep.name} = {ep.value}"


def _check_entry_point_loads() -> str:
    loaded = _entry_point().load()
    if loaded is not register:
        raise RuntimeError(f"entry point loads {loaded!r}, not oea.integrations.sglang.register")
    return "oea.integrations.sglang:register imported"


def _check_plugin_system() -> str:
    from sglang.srt.plugins import load_plugins  # noqa: F401
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401

    return "sglang.srt.plugins.load_plugins and HookRegistry available"


def _check_target(target: str) -> str:
    try:
        obj = _import_target(target)
    except (AttributeError, ModuleNotFoundError) as err:
        raise RuntimeError(f"missing target {target} ({err}); supported SGLang versions: {SUPPORTED_VERSIONS}; "
                           "SGLang will serve unmodified (HookRegistry logs the failure)") from None
    except Exception as err:
        raise RuntimeError(f"cannot import the module of {target}: {type(err).__name__}: {' '.join(str(err).split())} "
                           "(an installation problem, not a version mismatch)") from None
    params = inspect.signature(inspect.unwrap(obj)).parameters
    missing = [name for name in EXPECTED_PARAMETERS.get(target, ()) if name not in params]
    if missing:
        raise RuntimeError(f"{target} lacks parameter(s) {missing}; supported SGLang versions: "
                           f"{SUPPORTED_VERSIONS}")
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


def _check_hooks_live() -> str:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # SGLang's own loader: runs every entry point, then HookRegistry.apply_hooks()
    settings = settings_from_env()
    status = hooks_status()
    if settings.oea is None:
        if any(status.values()):
            raise RuntimeError(f"OEA_K0 is unset but hooks are installed: {status}")
        return "OEA off: plugin loaded, no hooks installed (set OEA_K0 to enable)"
    missing = [target for target, ok in status.items() if not ok]
    if missing:
        raise RuntimeError(f"hooks not installed on {missing} (HookRegistry logged why); "
                           f"supported SGLang versions: {SUPPORTED_VERSIONS}")
    return f"installed on {', '.join(status)}"


def _self_test() -> str:
    """Route 16 decode rows through the real ``select_experts`` (torch-native softmax) and compare."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    topk = importlib.import_module(TOPK_MODULE)
    settings = settings_from_env()
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
    if not _same_sets(decode.topk_ids, decode.topk_weights, expected_ids, expected_weights):
        raise RuntimeError("DECODE routing through select_experts does not match oea.route: the rewrite hook "
                           "is not live")
    if not _same_sets(extend.topk_ids, extend.topk_weights, vanilla_ids, vanilla_weights):
        raise RuntimeError("EXTEND routing was changed: OEA must only touch decode steps")
    from oea.routing import active_experts

    t_vanilla = int(active_experts(vanilla_ids, vanilla_weights))
    t_oea = int(active_experts(decode.topk_ids.long(), decode.topk_weights))
    note = " (OEA is off here: self-test forced k0=1)" if forced else ""
    return (f"DECODE {rows} rows, {num_experts} experts, top-{top_k}, k0={cfg.k0}: active experts "
            f"{t_vanilla} -> {t_oea}, equal to oea.route; EXTEND unchanged{note}")


def _same_sets(ids_a: torch.Tensor, w_a: torch.Tensor, ids_b: torch.Tensor, w_b: torch.Tensor) -> bool:
    def canon(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = ids.long().masked_fill(weights == 0, torch.iinfo(torch.int64).max)
        order = ids.argsort(dim=1, stable=True)
        return ids.gather(1, order), weights.float().gather(1, order)

    (ia, wa), (ib, wb) = canon(ids_a, w_a), canon(ids_b, w_b)
    return torch.equal(ia, ib) and torch.allclose(wa, wb, rtol=1e-5, atol=1e-6)


@contextlib.contextmanager
def _doctor_forward(mode_name: str) -> Iterator[None]:
    """SGLang's ``forward_context`` (hooked) with a minimal batch in ``mode_name``; phase stack fallback."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = getattr(ForwardMode, mode_name)
    if not module_exists(FORWARD_CONTEXT_MODULE):
        with forward_mode(mode):
            yield
        return
    fc = importlib.import_module(FORWARD_CONTEXT_MODULE)
    batch = SimpleNamespace(forward_mode=mode, moe_num_token_non_padded=None)
    with fc.forward_context(fc.ForwardContext(attn_backend=None), forward_batch=batch):
        yield
