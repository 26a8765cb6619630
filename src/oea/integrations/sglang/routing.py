"""The hot path: what runs in every routing call of an SGLang MoE layer.

``post_process_before`` is a BEFORE hook on ``topk._post_process_topk_ids``. It sees logical expert ids
before the EPLB remap, the padded-row mask, the shared-expert append, routed-experts capture and the
expert-distribution recorder, so all of those see the OEA ids (routed-experts capture sees OEA's fillers, not
their renaming for SGLang's native MoE: ``fillers.capture_replay_ids``). In DECODE forwards it replaces the routed
columns by ``rewrite_topk``'s; padding rows (``num_token_non_padded``, or OEA's own count of real rows where
SGLang keeps none: ``padding.bound``) keep SGLang's output and do not join the union. ``select_experts_before``
only notes per-token dynamic expert bias (Bailing/Ling), which the rewrite cannot rebuild and therefore passes
through. Unsupported routings pass through unchanged with one warning per reason; nothing here raises inside
a forward pass.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import torch

import oea.integrations.sglang.metrics as metrics
import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.recording as recording
import oea.integrations.sglang.targets as targets
from oea.config import layer_configs
from oea.integrations.sglang.fillers import capture_replay_ids, distinct_fillers
from oea.integrations.sglang.placement import ep_config
from oea.integrations.sglang.specs import UnsupportedRouting, router_spec_from_topk_config
from oea.integrations.sglang.state import PHASE, STATE, decode_active, warn_once
from oea.kernels import route_fast
from oea.routing import (
    LayerConfigs,
    OEAConfig,
    RouterSpec,
    keeps_every_top_k,
    route,
    splice_routed_columns,
    unsupported_layer_message,
)


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
    rerouted = valid
    if valid is not None and cfg.min_batch > 1:
        rerouted = valid & (valid.sum() >= cfg.min_batch)
    return splice_routed_columns(topk_ids, topk_weights, ids, weights, rerouted)


def select_experts_before(*args: Any, **kwargs: Any) -> None:
    """BEFORE ``select_experts``: remember whether this call routes with a per-token bias."""
    PHASE.dynamic_bias = kwargs.get("dynamic_expert_bias") is not None
    metrics.call_started()
    return None


def post_process_before(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """BEFORE ``_post_process_topk_ids(**kw)``: replace the routed ids/weights in DECODE forwards; with
    ``OEA_METRICS_FILE``, count every call (``metrics.layer_routed``)."""
    if metrics.METRICS.writer is None or args:
        return _rewrite(args, kwargs)
    start = time.perf_counter()
    changed = _rewrite(args, kwargs)
    elapsed_us = (time.perf_counter() - start) * 1e6
    result = None if changed is None else (changed[1]["topk_ids"], changed[1]["topk_weights"])
    metrics.layer_routed(kwargs, result, elapsed_us)
    return changed


def _rewrite(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``post_process_before``'s rewrite: the new call arguments, or None (SGLang's routing kept)."""
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
        layer_id = kwargs.get("layer_id")
        if isinstance(spec, str):
            warn_once(f"unsupported:{spec}", unsupported_layer_message(layer_id, spec)
                      + " (further layers with this routing: silently)")
            return None
        # 1. the config for these rows: the layer's base (OEA_K0's, or EP-aware on SGLang's placement) with its
        # k0 from OEA_LAYER_K0_FILE, composed by the core as in every engine
        entry = _layer_entry(layer_id)
        if entry is False:
            return None
        base = ep_config(settings.oea, spec.num_experts, layer_id, router_logits.device)
        cfg = _layer_configs().config(entry, router_logits.shape[0], base)
        # 2. keep SGLang's routing where OEA changes nothing
        if keeps_every_top_k(cfg, spec):
            return None
        result = rewrite_topk(kwargs["topk_ids"], kwargs["topk_weights"], router_logits, spec, cfg,
                              padding.bound(router_logits, kwargs.get("num_token_non_padded")))
        if result is not None:  # SGLang's native MoE miscounts a row's repeated ids (fillers.py)
            replay_ids = result[0]  # what routed-experts capture returns: fillers repeat the row's own expert
            result = distinct_fillers(result[0], result[1], spec.top_k, spec.num_experts)
            capture_replay_ids(result[0], replay_ids)
    except UnsupportedRouting as why:
        warn_once(f"unsupported:{why}", unsupported_layer_message(kwargs.get("layer_id"), str(why)))
        return None
    except Exception as err:  # never take the server down from inside a forward pass
        warn_once.exception(f"error:{type(err).__name__}:{kwargs.get('layer_id')}",
                            f"routing rewrite failed on layer {kwargs.get('layer_id')}; passing through")
        return None
    if result is None:
        return None
    if not torch.compiler.is_compiling():  # a Python counter traced by Dynamo would become a recompiling guard
        STATE.rewrites += 1
    return args, {**kwargs, "topk_ids": result[0], "topk_weights": result[1]}


def _layer_entry(layer_id: int | None) -> int | bool | None:
    """Layer ``layer_id``'s entry of ``OEA_LAYER_K0_FILE`` (None without a file); False when the file has no entry
    for the layer: it keeps SGLang's routing, with one warning."""
    configs = _layer_configs()
    if configs.schedule is None:
        return None
    try:
        index = STATE.layer_index[layer_id] if layer_id in STATE.layer_index else \
            STATE.layer_index.setdefault(layer_id, configs.index(layer_id=layer_id))
    except ValueError as err:
        STATE.layer_index[layer_id] = None
        warn_once(f"layer-k0-missing:{layer_id}", unsupported_layer_message(layer_id, str(err)))
        return False
    return False if index is None else index


def _layer_configs() -> LayerConfigs:
    """``STATE.layers``, rebuilt when the settings were replaced (``install`` builds it at start-up, where a bad
    file stops the process)."""
    settings = STATE.settings
    configs = STATE.layers
    if configs is None or settings is None or configs.default is not settings.oea:
        configs = STATE.layers = layer_configs(settings) if settings is not None else LayerConfigs(None)
        STATE.layer_index.clear()
    return configs


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
            _layer_configs().check_router(spec)  # the settings must fit the router, as at vLLM's or transformers' start
    except UnsupportedRouting as why:
        spec = str(why)
    except ValueError as err:  # the settings do not fit this router: the words every adapter uses
        spec = str(err)
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
