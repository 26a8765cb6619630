"""The hot path: what runs in every routing call of a vLLM MoE layer.

* CPU (``CPURouter``): vLLM's own routing runs in the (compiled) graph, then the custom op
  ``oea::cpu_route`` keeps it or replaces it by OEA's. The op is opaque to Dynamo/Inductor, so its Python
  body (``cpu_route_body``: decode check, padding rows, ``min_batch``, counters, timer) runs on every
  forward of vLLM's fullgraph-compiled model and under ``--enforce-eager`` alike.
* Other devices (``graph_wrapper``): OEA is computed next to the stock routing and
  ``torch.where(decode_flag, oea, stock)`` selects it while compiling or capturing graphs; in eager mode
  the Python flag decides and prefill pays nothing.
* ``oea_route_for``: the routing itself, through ``oea.kernels`` (``route_fast``: numba on CPU, Triton on
  CUDA, else ``oea.route``). Inside a compiled graph the CUDA path is the custom op ``oea::gpu_route``
  (opaque to Dynamo, captured into CUDA graphs); other traced code uses ``oea.route``.

Each call runs the same numbered steps, its facts in one ``RouterCall``: 1. the config for these rows
(resolved once, ``RouterState.config``), 2. keep vLLM's routing?, 3. the real rows, 4. OEA, 5. splice.
Fixed costs are paid once per step or once per router, not per layer call: the padding lookup and the
valid-row count (``step_rows``, cached for the step), the kernel's packed parameters (``NumbaRouter``) and
the output buffers (one pair per row count, reused every step), both on the router's ``RouterState``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import oea.integrations.vllm.recording as recording
from oea.integrations.metrics import routed_hash
from oea.integrations.runtime import tracing
from oea.integrations.vllm.parallel import gathered_across_dp
from oea.integrations.vllm.router_state import RouterCall, RouterState, router_state
from oea.integrations.vllm.state import STATE, warn_once
from oea.kernels import NumbaRouter, plan, route_fast
from oea.routing import RouterSpec, active_experts, keeps_every_top_k, route, splice_routed_columns

OP_NAME = "oea::cpu_route"
GPU_OP_NAME = "oea::gpu_route"


def _valid_rows(num_rows: int) -> torch.Tensor | None:
    """[M] bool, False on padding rows, from the forward context; None when there is no padding
    (or no forward context), so callers take the cheaper all-rows path."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    padding = getattr(get_forward_context(), "is_padding", None)
    if padding is None or padding.dim() != 1 or padding.shape[0] < num_rows:
        return None
    padding = padding[:num_rows]
    if padding.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(padding.any()):
        return None  # (a host read: never inside a traced graph)
    return ~padding


def step_rows(rows: int) -> tuple[torch.Tensor | None, int]:
    """(valid [M] bool or None, number of valid rows) of this step's router calls: the forward context's
    padding is looked up once per step (every MoE layer of a step sees the same rows)."""
    key = (STATE.step, rows, id(STATE.settings))
    cached = STATE.step_rows
    if cached is None or cached[0] != key:
        valid = _valid_rows(rows)
        cached = STATE.step_rows = (key, (valid, rows if valid is None else int(valid.sum())))
    return cached[1]


def _cpu_kernel(state: RouterState, spec: RouterSpec, router_logits: torch.Tensor, cfg: Any) -> NumbaRouter | None:
    """The router's prepared numba kernel for ``cfg`` (None: only ``oea.route`` reproduces it), made once per
    config (a per-batch-size k0 gives a router one config per k0)."""
    key = state.kernel_key
    if key is None or key[0] is not cfg or key[1] is not spec:
        impl, params = plan(router_logits, spec, cfg)
        state.kernel = NumbaRouter(params, spec.correction_bias, spec.num_experts) if (
            impl == "numba" and params is not None) else None
        state.kernel_key = (cfg, spec)
    return state.kernel


def router_config(router_id: int | None, rows: int) -> Any:
    """The routing config of one call of ``rows`` rows: the router's (``RouterState.config``: EP-aware or
    ``OEA_K0``'s, with ``OEA_LAYER_K0_FILE``'s k0 for its layer and batch size); ``OEA_K0``'s for an
    unnumbered router."""
    if router_id is None:
        return STATE.settings.oea if STATE.settings is not None else None
    return router_state(router_id).config(rows)


def oea_route_for(spec: RouterSpec, router_logits: torch.Tensor, valid: torch.Tensor | None,
                  router_id: int | None = None, cfg: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """OEA for one vLLM router call: [M, N] logits -> (weights [M, k] float32, ids [M, k] int32).

    ``cfg``: the call's config when the caller resolved it (default: ``router_config``). CPU routers with an id
    take their prepared numba kernel and write into the router's buffers for this row count (reused every
    step); code that Dynamo traces uses ``oea::gpu_route`` on CUDA and ``oea.route`` elsewhere; everything else
    goes through ``route_fast``.
    """
    rows = router_logits.shape[0]
    if cfg is None:
        cfg = router_config(router_id, rows)
    if router_id is not None and router_logits.device.type == "cpu" and not torch.compiler.is_compiling():
        state = router_state(router_id)
        kernel = _cpu_kernel(state, spec, router_logits, cfg)
        if kernel is not None:
            buffers = state.buffers.get(rows)
            if buffers is None:
                buffers = state.buffers[rows] = (torch.empty(rows, spec.top_k),
                                                 torch.empty(rows, spec.top_k, dtype=torch.int32))
            ids, weights = kernel(router_logits, valid, buffers[1], buffers[0])
            return weights, ids
    if torch.compiler.is_compiling():
        if router_id is not None and router_logits.device.type == "cuda":
            define_gpu_op()
            return torch.ops.oea.gpu_route(router_logits, valid, router_id)
        ids, weights = route(router_logits, spec, cfg, valid)
    else:
        ids, weights = route_fast(router_logits, spec, cfg, valid)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def define_gpu_op() -> None:
    """Define ``oea::gpu_route`` once per process: ``route_fast`` (Triton on CUDA) as an op Dynamo does not
    trace into, so a compiled model runs the kernel and CUDA-graph capture records its launches."""
    if STATE.gpu_op_defined:
        return
    STATE.gpu_op_defined = True

    @torch.library.custom_op(GPU_OP_NAME, mutates_args=())
    def gpu_route(router_logits: torch.Tensor, valid: torch.Tensor | None, router_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        state = router_state(router_id)
        ids, weights = route_fast(router_logits, state.spec, state.config(router_logits.shape[0]), valid)  # type: ignore[arg-type]
        return weights, ids.to(torch.int32)

    @gpu_route.register_fake
    def _(router_logits: torch.Tensor, valid: torch.Tensor | None, router_id: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
        k = STATE.specs[router_id].top_k  # type: ignore[union-attr]
        rows = router_logits.shape[0]
        return (router_logits.new_empty((rows, k), dtype=torch.float32),
                router_logits.new_empty((rows, k), dtype=torch.int32))


def define_cpu_op() -> None:
    """Define ``oea::cpu_route`` once per process (opaque to Dynamo; its body runs every forward)."""
    if STATE.cpu_op_defined:
        return
    STATE.cpu_op_defined = True

    @torch.library.custom_op(OP_NAME, mutates_args=())
    def cpu_route(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
                  router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_route_body(router_logits, stock_weights, stock_ids, router_id)

    @cpu_route.register_fake
    def _(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
          router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(stock_weights), torch.empty_like(stock_ids)


def keep_stock_after_error(router_id: int, err: Exception) -> None:
    """A layer whose OEA routing raised keeps vLLM's routing from now on (one warning per layer): an engine
    hook never takes the server down."""
    layer: Any = router_id
    if router_id < len(STATE.routers):
        state = router_state(router_id)
        state.failed = True
        layer = state.name
    if STATE.record is not None:  # this step's forward: not rewritten in every layer, and why
        STATE.record.oea = False
        STATE.record.passthrough[router_id] = "layer_failed"
    warn_once(f"raised:{router_id}", f"layer {layer}: OEA's routing raised {type(err).__name__}: {err}; the layer "
                                     "keeps vLLM's routing from now on, serving continues")


def cpu_route_body(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
                    router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``oea::cpu_route``'s body (``_cpu_route``) with vLLM's own routing as the answer when anything in it
    raises: the layer then keeps stock routing (``keep_stock_after_error``)."""
    try:
        return _cpu_route(router_logits, stock_weights, stock_ids, router_id)
    except Exception as err:  # never into vLLM's forward pass
        keep_stock_after_error(router_id, err)
        weights, ids = stock_weights.clone(), stock_ids.clone()
        try:  # the step's record still counts this layer (vLLM's routing), so the forward is not lost
            call = RouterCall(router_state(router_id), router_logits.shape[0])
            call.cfg = call.state.config(call.rows)
            _count(call, weights, ids, stock_weights, stock_ids, "layer_failed")
        except Exception as again:
            warn_once(f"count-raised:{router_id}", f"router {router_id}: its failed call cannot be counted "
                                                   f"({type(again).__name__}: {again}); serving continues")
        return weights, ids


def _cpu_route(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
               router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run by ``oea::cpu_route`` on every call: OEA in decode steps, else vLLM's own routing as computed
    in the (compiled) graph, passed through unchanged; then counters and timer.

    Stock routing is computed in the graph, not here, so that a step OEA leaves alone is bit-identical
    to vLLM without the plugin (Inductor's fused softmax differs from eager in the last bits). The timer
    (``OEA_TIMING=1``) covers OEA's routing including its padding lookup and ``min_batch`` test; for
    stock steps it times an eager re-run of vLLM's ``_compute_routing`` on the same logits.
    """
    state = router_state(router_id)
    spec = state.spec
    call = RouterCall(state, router_logits.shape[0])
    if STATE.trace_step:
        recording.stage(state, router_logits)  # the router's own logits, before any rewrite
    # 1. the config for these rows
    call.cfg = state.config(call.rows)
    # 2. keep vLLM's routing? (not a decode step, OEA off or a no-op here, the layer failed before)
    call.rewrite = STATE.decode and call.cfg is not None and spec is not None and \
        not keeps_every_top_k(call.cfg, spec) and not state.failed
    start = time.perf_counter() if STATE.timing else 0.0
    why = None if call.rewrite else _kept_because(state, call.cfg)
    if call.rewrite:
        # 3. the real rows: enough of them for OEA_MIN_BATCH, and this rank's own (not gathered across DP)
        call.valid, call.num_valid = step_rows(call.rows)
        if call.num_valid < call.cfg.min_batch:
            call.rewrite, why = False, "below_min_batch"
        elif gathered_across_dp(call.rows):
            call.rewrite, why = False, "dp_gathered"
    if call.rewrite:
        # 4. OEA; 5. its output replaces vLLM's (the op returns it)
        weights, ids = oea_route_for(spec, router_logits, call.valid, router_id, cfg=call.cfg)  # type: ignore[arg-type]
        call.elapsed_us = (time.perf_counter() - start) * 1e6 if STATE.timing else 0.0
    else:
        weights, ids = stock_weights.clone(), stock_ids.clone()  # a custom op may not return its inputs
        if STATE.timing and STATE.record is not None:
            start = time.perf_counter()
            STATE.originals["CPURouter"](STATE.routers[router_id], None, router_logits, None)
            call.elapsed_us = (time.perf_counter() - start) * 1e6
    _count(call, weights, ids, stock_weights, stock_ids, why)
    return weights, ids


def _kept_because(state: RouterState, cfg: Any) -> str:
    """Why a call keeps vLLM's routing before its rows are looked at (``PASSTHROUGH_REASONS``; only a decode or
    verify step's reason is recorded)."""
    if not STATE.decode:
        return "verify_not_applied"  # recorded only in a verify step: the others are prefill
    if state.failed:
        return "layer_failed"
    if cfg is None:
        return "oea_off"
    return "k0_covers_top_k"


def _count(call: RouterCall, weights: torch.Tensor, ids: torch.Tensor, stock_weights: torch.Tensor,
           stock_ids: torch.Tensor, why: str | None = None) -> None:
    """The call into this step's ``OEA_METRICS_FILE`` record ([M, k] outputs, OEA's and vLLM's; ``why``: the
    reason it kept vLLM's routing), or into the rows routed outside any engine step."""
    record, router_id, rows = STATE.record, call.state.router_id, call.rows
    if record is not None:
        if why is not None and (record.decode or record.verify):
            record.passthrough[router_id] = why
        valid = call.valid
        if valid is None and not call.rewrite:
            valid = step_rows(rows)[0]
        record.rows = rows if valid is None else int(valid.sum())
        record.padding_rows = rows - record.rows
        record.oea = record.oea and call.rewrite
        record.routed[router_id] = routed_hash(ids, weights, valid)
        record.active[router_id] = active_experts(ids, weights, valid)
        if call.cfg is not None:  # counted from vLLM's own output on every step, so a wrongly rewritten step shows
            record.active_stock[router_id] = active_experts(stock_ids, stock_weights, valid)
        if STATE.timing:
            record.routing_us[router_id] = call.elapsed_us
    elif STATE.metrics is not None and router_id == next(i for i, s in enumerate(STATE.specs) if s is not None):
        STATE.metrics.outside_rows += rows  # a forward outside any engine step (DP dummy batch, warm-up): stock


def cpu_wrapper(original: Any) -> Any:
    """``CPURouter._compute_routing`` replacement: vLLM's own routing (traced into the graph as
    before), then ``oea::cpu_route``, which keeps or replaces it. Routers not numbered at load time
    (e.g. built outside a model) and unsupported layers stay stock."""

    def _compute_routing(self: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                         indices_type: torch.dtype | None, *, input_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = original(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
        router_id = getattr(self, "_oea_router_id", None)
        if router_id is None or STATE.specs[router_id] is None:
            return weights, ids
        return torch.ops.oea.cpu_route(router_logits, weights, ids, router_id)

    _compute_routing.__wrapped__ = original  # type: ignore[attr-defined]
    return _compute_routing


def _min_batch_reached(valid: torch.Tensor | None, rows: int, cfg: Any) -> bool | torch.Tensor:
    """Whether the call has at least ``cfg.min_batch`` real rows: a Python bool without padding rows (the row
    count is a static shape), else a 0-dim bool tensor (no host synchronisation)."""
    min_batch = cfg.min_batch if cfg is not None else 0
    if valid is None:
        return rows >= min_batch
    return valid.sum() >= min_batch


def graph_wrapper(original: Any) -> Any:
    """Replacement for GPU-side routers: stock routing, then OEA in decode steps.

    While compiling or capturing a graph the decision must live on the device: OEA is computed and
    ``torch.where(decode_flag, oea, stock)`` selects it at replay. In eager mode the Python flag
    decides and prefill pays nothing. Appended fused-shared-expert columns are kept as they are.
    """

    def _compute_routing(self: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                         indices_type: torch.dtype | None, *, input_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = original(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
        router_id = getattr(self, "_oea_router_id", None)
        if router_id is None:
            return weights, ids
        state = router_state(router_id)
        if STATE.recorder is not None and (STATE.trace_step or tracing()):
            recording.stage(state, router_logits)  # captured into the graph: every replay fills the buffer
        spec = state.spec
        if STATE.mode != "oea" or spec is None or state.failed:
            return weights, ids
        call = RouterCall(state, router_logits.shape[0])
        capturing = tracing()
        if not capturing and not STATE.decode:  # 2. keep vLLM's routing outside decode steps (eager)
            return weights, ids
        call.cfg = state.config(call.rows)  # 1. the config for these rows
        if keeps_every_top_k(call.cfg, spec):  # 2. ... and where OEA would change nothing
            return weights, ids
        call.valid = _valid_rows(call.rows)  # 3. the real rows
        enough = _min_batch_reached(call.valid, call.rows, call.cfg)
        if enough is False:  # a static row count below OEA_MIN_BATCH: nothing to do in this shape
            return weights, ids
        try:  # 4. OEA, with the router's own (layer's) config
            new_w, new_ids = oea_route_for(spec, router_logits, call.valid, router_id, cfg=call.cfg)
        except Exception as err:  # never into vLLM's forward pass (nor into a graph being captured)
            keep_stock_after_error(router_id, err)
            return weights, ids
        # 5. splice: [] bool on the device selects OEA's columns (real rows counted at run time, decode flag at replay)
        select = None if enough is True else enough
        if capturing and STATE.decode_flag is not None:
            select = STATE.decode_flag if select is None else STATE.decode_flag & select
        spliced_ids, spliced_w = splice_routed_columns(ids, weights, new_ids, new_w, select)
        return spliced_w, spliced_ids

    _compute_routing.__wrapped__ = original  # type: ignore[attr-defined]
    return _compute_routing
