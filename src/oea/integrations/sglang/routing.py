"""The hot path: what runs in every routing call of an SGLang MoE layer.

``post_process_before`` is a BEFORE hook on ``topk._post_process_topk_ids``. It sees logical expert ids
before the EPLB remap, the padded-row mask, the shared-expert append, routed-experts capture and the
expert-distribution recorder, so all of those see the OEA ids. In DECODE forwards it replaces the routed
columns by ``rewrite_topk``'s; padding rows (``num_token_non_padded``, or OEA's own count of real rows where
SGLang keeps none: ``padding.bound``) keep SGLang's output and do not join the union. ``select_experts_before``
only notes per-token dynamic expert bias (Bailing/Ling), which the rewrite cannot rebuild and therefore passes
through. Unsupported routings pass through unchanged with one warning per reason; nothing here raises inside
a forward pass.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch

import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.recording as recording
import oea.integrations.sglang.targets as targets
from oea.integrations.sglang.placement import ep_config
from oea.integrations.sglang.specs import UnsupportedRouting, router_spec_from_topk_config
from oea.integrations.sglang.state import PHASE, STATE, decode_active, log, warn_once
from oea.kernels import route_fast
from oea.routing import OEAConfig, RouterSpec, route


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
    fast = route if torch.compiler.is_compiling() else route_fast  # numba on CPU, Triton on CUDA
    ids, weights = fast(router_logits, spec, cfg, valid)
    rerouted = torch.ones(m, dtype=torch.bool, device=router_logits.device) if valid is None else valid
    if valid is not None and cfg.min_batch > 1:
        rerouted = rerouted & (valid.sum() >= cfg.min_batch)
    routed_ids = torch.where(rerouted[:, None], ids.to(topk_ids.dtype), topk_ids[:, :k])
    routed_weights = torch.where(rerouted[:, None], weights.to(topk_weights.dtype), topk_weights[:, :k])
    if topk_ids.shape[1] > k:
        routed_ids = torch.cat([routed_ids, topk_ids[:, k:]], dim=1)
        routed_weights = torch.cat([routed_weights, topk_weights[:, k:]], dim=1)
    return routed_ids, routed_weights


def select_experts_before(*args: Any, **kwargs: Any) -> None:
    """BEFORE ``select_experts``: remember whether this call routes with a per-token bias."""
    PHASE.dynamic_bias = kwargs.get("dynamic_expert_bias") is not None
    return None


def post_process_before(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """BEFORE ``_post_process_topk_ids(**kw)``: replace the routed ids/weights in DECODE forwards."""
    if not STATE.rewrite_hook_seen:
        STATE.rewrite_hook_seen = True
        if not STATE.phase_hook_seen and STATE.settings is not None:
            warn_once("no-phase", "no forward-mode hook has run yet; routing calls outside a decode "
                                  "forward keep SGLang's routing")
    if not decode_active():
        return None
    if recording.TRACE.settings is not None and not args:
        _record(kwargs)  # the router's own logits, before any rewrite
    settings = STATE.settings
    if settings is None or settings.oea is None:
        return None
    if args:
        warn_once("positional", f"{targets.POST_PROCESS_TARGET} called positionally (unsupported SGLang "
                                f"version {targets.engine_version()}; supported: {targets.SUPPORTED_VERSIONS}); "
                                "passing through")
        return None
    if PHASE.dynamic_bias:
        warn_once("dynamic-bias", "per-token dynamic_expert_bias routing (Bailing/Ling) passes through")
        return None
    try:
        topk_config = kwargs["topk_config"]
        router_logits = kwargs["router_logits"]
        spec = _spec_for(topk_config, router_logits.shape[1])
        if isinstance(spec, str):
            warn_once(f"unsupported:{spec}", f"layer {kwargs.get('layer_id')}: {spec}; passing through "
                                             "(further layers with this routing: silently)")
            return None
        cfg = ep_config(_layer_config(settings.oea, spec, kwargs.get("layer_id")), spec.num_experts,
                        kwargs.get("layer_id"), router_logits.device)  # OEA_POLICY=ep: SGLang's placement
        result = rewrite_topk(kwargs["topk_ids"], kwargs["topk_weights"], router_logits, spec, cfg,
                              padding.bound(router_logits, kwargs.get("num_token_non_padded")))
    except UnsupportedRouting as why:
        warn_once(f"unsupported:{why}", f"layer {kwargs.get('layer_id')}: {why}; passing through")
        return None
    except Exception as err:  # never take the server down from inside a forward pass
        key = f"error:{type(err).__name__}:{kwargs.get('layer_id')}"
        if key not in STATE.warned:
            STATE.warned.add(key)
            log.exception("oea: routing rewrite failed on layer %s; passing through", kwargs.get("layer_id"))
        return None
    if result is None:
        return None
    if not torch.compiler.is_compiling():  # a Python counter traced by Dynamo would become a recompiling guard
        STATE.rewrites += 1
    return args, {**kwargs, "topk_ids": result[0], "topk_weights": result[1]}


def _layer_config(default: OEAConfig, spec: RouterSpec, layer_id: int | None) -> OEAConfig:
    """The per-layer config from ``OEA_LAYER_K0_FILE`` for ``layer_id``, else ``default`` (OEA_K0)."""
    schedule = STATE.layer_schedule
    if schedule is None:
        return default
    if (schedule.num_experts, schedule.top_k) != (spec.num_experts, spec.top_k):
        warn_once("layer-k0-model", f"OEA_LAYER_K0_FILE was calibrated for another model (num_experts "
                                    f"{schedule.num_experts} vs {spec.num_experts}, top_k {schedule.top_k} vs "
                                    f"{spec.top_k}); using OEA_K0={default.k0} for every layer")
        return default
    index = None if layer_id is None else schedule.index_of_layer_id(int(layer_id))
    if index is None:
        warn_once(f"layer-k0-missing:{layer_id}", f"layer {layer_id} is not in OEA_LAYER_K0_FILE; using "
                                                  f"OEA_K0={default.k0} there")
        return default
    cached = STATE.layer_configs.get(index)
    if cached is None:  # built once per layer, not on every routing call
        cached = dataclasses.replace(default, k0=schedule.k0[index])
        STATE.layer_configs[index] = cached
    return cached


def _record(kwargs: dict[str, Any]) -> None:
    """Stage this call's router logits for ``OEA_TRACE_FILE`` (``recording.stage``); never raises."""
    try:
        router_logits = kwargs["router_logits"]
        spec = _spec_for(kwargs["topk_config"], router_logits.shape[1])
        if PHASE.dynamic_bias:
            spec = "per-token dynamic_expert_bias routing"
        recording.stage(kwargs.get("layer_id"), router_logits, spec)
    except Exception as err:  # never take the server down from inside a forward pass
        warn_once(f"trace-error:{type(err).__name__}", f"recording failed ({type(err).__name__}: {err}); "
                                                       "routing goes on")


def _spec_for(topk_config: Any, num_experts: int) -> RouterSpec | str:
    """Cached per ``TopKConfig`` instance: its ``RouterSpec``, or the reason it passes through."""
    cached = STATE.specs.get(id(topk_config))
    if cached is not None and cached[0] is topk_config and cached[1] == num_experts:
        return cached[2]
    settings = STATE.settings
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
    STATE.specs[id(topk_config)] = (topk_config, num_experts, spec)
    return spec


def _unsupported_setup(topk_config: Any) -> str | None:
    topk = importlib.import_module(targets.TOPK_MODULE)
    if getattr(topk, "_use_aiter", False):
        return "AMD aiter routing (SGLANG_USE_AITER=1)"
    if getattr(topk, "_is_npu", False):
        return "Ascend NPU routing"
    if getattr(topk_config, "allow_routed_experts_capture", True) is False:
        return "speculative draft-model TopK"
    return None


def _scaling_fused(topk_config: Any) -> bool:
    topk = importlib.import_module(targets.TOPK_MODULE)
    fused = getattr(topk, "is_routed_scaling_factor_fused_in_topk", None)
    if fused is not None:
        return bool(fused(topk_config))
    return bool(getattr(topk_config, "apply_routed_scaling_factor_on_output", False))


def select_experts_around_legacy(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``select_experts`` for versions without ``_post_process_topk_ids`` (0.5.9)."""
    output = original(*args, **kwargs)
    if not decode_active() or kwargs.get("expert_location_dispatch_info") is not None:
        return output
    names = ("hidden_states", "router_logits", "topk_config")
    call = dict(zip(names, args, strict=False)) | kwargs
    rewritten = post_process_before(topk_ids=output.topk_ids, topk_weights=output.topk_weights,
                                    topk_config=call["topk_config"], router_logits=call["router_logits"],
                                    layer_id=call.get("layer_id"),
                                    num_token_non_padded=call.get("num_token_non_padded"))
    if rewritten is None:
        return output
    new = rewritten[1]
    return output._replace(topk_ids=new["topk_ids"], topk_weights=new["topk_weights"])
