"""The hot path: what runs in every routing call of an SGLang MoE layer.

``post_process_before`` is a BEFORE hook on ``topk._post_process_topk_ids``. It sees logical expert ids
before the EPLB remap, the padded-row mask, the shared-expert append, routed-experts capture and the
expert-distribution recorder, so all of those see the OEA ids (routed-experts capture sees OEA's fillers, not
their renaming for SGLang's native MoE: ``fillers.capture_replay_ids``). In DECODE forwards it replaces the routed
columns by ``rewrite_topk``'s; padding rows (``num_token_non_padded``, or OEA's own count of real rows where
SGLang keeps none: ``padding.bound``) keep SGLang's output and do not join the union. ``select_experts_before``
only notes per-token dynamic expert bias (Bailing/Ling), which the rewrite cannot rebuild and therefore passes
through. An eager CPU call runs the layer's prepared kernel into new tensors (``NumbaRouter.route_new``); where
every row is real and SGLang's output has OEA's shape and dtypes it skips the splice (which would return the
kernel's tensors) and runs the host fillers only when the kernel found a row holding an id twice. Unsupported
routings pass through unchanged with one warning per reason; nothing here raises inside a forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

import oea.integrations.sglang.metrics as metrics
import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.recording as recording
import oea.integrations.sglang.targets as targets
from oea.integrations.sglang.fillers import (
    capture_replay_ids,
    distinct_fillers,
    distinct_fillers_on_host,
    earlier_mask,
)
from oea.integrations.sglang.placement import ep_config
from oea.integrations.sglang.router_state import (
    BELOW_MIN_BATCH,
    K0_COVERS_TOP_K,
    LAYER_FAILED,
    OEA_OFF,
    VERIFY_NOT_APPLIED,
    RouterCall,
    RouterState,
    recorded_spec,
    router_state,
)
from oea.integrations.sglang.specs import UnsupportedRouting
from oea.integrations.sglang.state import PHASE, STATE, decode_active, warn_once
from oea.kernels import NumbaRouter, route_fast
from oea.routing import (
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
    kernel: NumbaRouter | None = None,
    call: RouterCall | None = None,
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
        kernel: the layer's numba kernel prepared for ``spec`` and ``cfg``, given only for CPU logits outside
            tracing; without it ``route_fast`` (numba on CPU, Triton on CUDA), or ``oea.route`` while Dynamo traces.
        call: the routing call's facts; with ``kernel``, every row real and SGLang's output exactly OEA's shape and
            dtypes (the splice would return OEA's tensors themselves), ``call.repeats`` says whether some row of
            the returned ids holds an id twice (left None otherwise).

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
    if kernel is not None and topk_ids.dtype in (torch.int32, torch.int64):  # SGLang's id dtype, written by the kernel
        ids, weights, repeats = kernel.route_new(router_logits, valid, topk_ids.dtype)
        if valid is None and topk_ids.shape[1] == k and topk_weights.shape[1] == k and \
                topk_weights.dtype == torch.float32:  # the splice would return these very tensors
            if call is not None:
                call.repeats = repeats
            return ids, weights
    elif kernel is not None:
        ids, weights = kernel(router_logits, valid)
    elif torch.compiler.is_compiling():
        ids, weights = route(router_logits, spec, cfg, valid)
    else:
        ids, weights = route_fast(router_logits, spec, cfg, valid)
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
    ``OEA_METRICS_FILE`` or the Prometheus export, count every call and why it kept SGLang's routing
    (``metrics.layer_routed``)."""
    if metrics.METRICS.writer is None or args:
        return _rewrite(args, kwargs)[0]
    start = time.perf_counter()
    changed, why = _rewrite(args, kwargs)
    elapsed_us = (time.perf_counter() - start) * 1e6
    result = None if changed is None else (changed[1]["topk_ids"], changed[1]["topk_weights"])
    metrics.layer_routed(kwargs, result, elapsed_us, why)
    return changed


Rewrite = tuple[tuple[tuple[Any, ...], dict[str, Any]] | None, str | None]


def _rewrite(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Rewrite:
    """``post_process_before``'s rewrite: (the new call arguments, or None when SGLang's routing is kept; why it is
    kept, a ``PASSTHROUGH_REASONS`` key, None when rewritten or when no listed reason fits: "unknown")."""
    if not STATE.rewrite_hook_seen:
        STATE.rewrite_hook_seen = True
        if not STATE.phase_hook_seen and STATE.settings is not None:
            warn_once("no-phase", "no forward-mode hook has run yet; routing calls outside a decode "
                                  "forward keep SGLang's routing")
    if not decode_active():
        return None, VERIFY_NOT_APPLIED  # recorded only in a verify forward: the others are prefill
    if recording.TRACE.settings is not None and not args:
        _record(kwargs)  # the router's own logits, before any rewrite
    settings = STATE.settings
    if settings is None or settings.oea is None:
        return None, OEA_OFF
    if args:
        warn_once("positional", f"{targets.POST_PROCESS_TARGET} called positionally (unsupported SGLang "
                                f"version {targets.engine_version()}; supported: {targets.SUPPORTED_VERSIONS}); "
                                "passing through")
        return None, None
    if PHASE.dynamic_bias:
        warn_once("dynamic-bias", "per-token dynamic_expert_bias routing (Bailing/Ling) passes through")
        return None, None
    layer_id = kwargs.get("layer_id")
    state = None
    try:
        router_logits = kwargs["router_logits"]
        state = router_state(layer_id, kwargs["topk_config"], router_logits.shape[1])
        if _keeps_layer(state):
            return None, LAYER_FAILED if state.failed else None
        call = RouterCall(state, router_logits.shape[0])
        result = _route(call, kwargs, router_logits, layer_id)
    except UnsupportedRouting as why:
        warn_once(f"unsupported:{why}", unsupported_layer_message(layer_id, str(why)))
        return None, None
    except Exception as err:  # never take the server down from inside a forward pass
        if state is not None and not torch.compiler.is_compiling():
            state.failed = True  # SGLang's routing in this layer from now on: one warning, no retry every call
        warn_once.exception(f"error:{type(err).__name__}:{layer_id}",
                            f"routing rewrite failed on layer {layer_id}; passing through")
        return None, LAYER_FAILED
    if result is None:
        return None, call.why
    if call.eager_cpu or not torch.compiler.is_compiling():  # a counter traced by Dynamo: a recompiling guard
        STATE.rewrites += 1
    return (args, {**kwargs, "topk_ids": result[0], "topk_weights": result[1]}), None


def _keeps_layer(state: RouterState) -> bool:
    """Whether the layer keeps SGLang's routing whatever the call: its routing raised before, OEA cannot rebuild
    it, or the layer file has no entry for it (the last two said once)."""
    if state.failed:
        return True
    if state.spec is None:
        warn_once(f"unsupported:{state.why}", unsupported_layer_message(state.layer_id, state.why)
                  + " (further layers with this routing: silently)")
        return True
    if state.missing:
        warn_once(f"layer-k0-missing:{state.layer_id}", unsupported_layer_message(state.layer_id, state.missing))
        return True
    return False


def _route(call: RouterCall, kwargs: dict[str, Any], router_logits: torch.Tensor, layer_id: Any
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One routing call of layer ``layer_id`` in numbered steps; the new (ids, weights), or None (SGLang's kept)."""
    state = call.state
    spec = state.spec
    assert spec is not None and state.settings is not None and state.settings.oea is not None
    # 1. the config for these rows: the layer's base (OEA_K0's, or EP-aware on SGLang's placement) with its k0 from
    # OEA_LAYER_K0_FILE, composed by the core as in every engine
    base = state.settings.oea
    if state.settings.policy == "ep":
        base = ep_config(state, base, router_logits.device)
    call.cfg = cfg = state.config(base, call.rows)
    # 2. keep SGLang's routing where OEA changes nothing
    call.keep = keeps_every_top_k(cfg, spec)
    if call.keep:
        call.why = K0_COVERS_TOP_K
        return None
    # 3. the real rows: SGLang's count of them, or OEA's own where SGLang keeps none
    call.non_padded = padding.bound(router_logits, kwargs.get("num_token_non_padded"))
    # 4-5. OEA over the real rows, spliced into SGLang's output (layer_id: the chaos tests' switch reads it here)
    call.eager_cpu = eager_cpu = router_logits.is_cpu and not torch.compiler.is_compiling()
    if eager_cpu and call.non_padded is not None and int(call.non_padded) < cfg.min_batch:
        call.why = BELOW_MIN_BATCH  # on the host for free: the splice would keep every row anyway
        return None
    kernel = state.prepared_kernel(router_logits, cfg) if eager_cpu else None
    result = rewrite_topk(kwargs["topk_ids"], kwargs["topk_weights"], router_logits, spec, cfg, call.non_padded,
                          kernel=kernel, call=call)
    if result is None:
        call.why = BELOW_MIN_BATCH
        return None
    call.rerouted = True
    # 6. fillers SGLang's native MoE can run (it miscounts a row's repeated ids: fillers.py); routed-experts capture
    # still returns OEA's ids, whose fillers repeat the row's own expert
    if state.earlier is None:
        state.earlier = earlier_mask(spec.top_k, router_logits.device)
    if call.repeats is False:  # the kernel found no row holding an id twice: nothing to rename
        ids, weights = result
    elif eager_cpu:
        ids, weights = distinct_fillers_on_host(result[0], result[1], spec.top_k, spec.num_experts,
                                                state.earlier_on_host())
    else:
        ids, weights = distinct_fillers(result[0], result[1], spec.top_k, spec.num_experts, state.earlier)
    if ids is not result[0]:
        capture_replay_ids(ids, result[0])
    return ids, weights


def _record(kwargs: dict[str, Any]) -> None:
    """Stage this call's router logits for ``OEA_TRACE_FILE`` (``recording.stage``); never raises."""
    try:
        router_logits = kwargs["router_logits"]
        state = router_state(kwargs.get("layer_id"), kwargs["topk_config"], router_logits.shape[1])
        spec = "per-token dynamic_expert_bias routing" if PHASE.dynamic_bias else recorded_spec(state)
        recording.stage(state, router_logits, spec)
    except Exception as err:  # never take the server down from inside a forward pass
        warn_once(f"trace-error:{type(err).__name__}", f"recording failed ({type(err).__name__}: {err}); "
                                                       "routing goes on")


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
