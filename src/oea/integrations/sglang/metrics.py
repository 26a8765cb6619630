"""``OEA_METRICS_FILE`` for SGLang: the SGLang side of ``oea.integrations.metrics`` (rows as vLLM's).

* ``configure`` (``register``): the file and ``OEA_TIMING``. Whether the file can be written is tested at
  the process's first forward (kept, else one warning and no metrics): SGLang loads plugins in its HTTP and
  detokenizer processes too, which never write rows and would each repeat the warning;
* ``forward`` (entered by the phase hooks around each forward): one ``StepRecord`` per outermost forward
  (a forward context entered inside another is the same step). ``decode`` is true for the forwards OEA may
  rewrite (DECODE, and TARGET_VERIFY with ``OEA_APPLY_TO_VERIFY=1``), ``verify`` for TARGET_VERIFY ones;
  EXTEND / MIXED forwards give ``decode: false`` rows. After the forward the record goes to this process's
  ``MetricsWriter`` (started by the first forward, so only processes that run the model write rows);
* ``call_started`` (``routing.select_experts_before``) and ``layer_routed`` (``routing.post_process_before``,
  every routing call): each MoE layer's ``active`` (distinct experts of the ids SGLang goes on with),
  ``active_stock`` (of SGLang's own ids for the same logits, with ``OEA_K0`` set), ``routed`` hash and, with
  ``OEA_TIMING=1``, ``routing_us``: SGLang's own top-k (``select_experts`` up to its post-processing) in the
  calls OEA leaves alone, OEA's rewrite in the calls it replaces.

Counts are over the call's real rows (``padding.bound``); appended shared-expert columns are not counted.
Calls inside a graph capture or a compiled region are not counted (they run once per shape, not per
forward: under CUDA-graph replay SGLang's routing never reaches Python, so such forwards write no row).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.prometheus as prometheus
from oea.config import EnvSettings
from oea.integrations.metrics import MetricsWriter, StepRecord, routed_hash
from oea.integrations.prometheus import Exporter
from oea.integrations.recording.recorder import trace_path_problem
from oea.integrations.runtime import tracing
from oea.integrations.sglang.specs import shared_topk_slots
from oea.integrations.sglang.state import log, mode_rerouted, warn_once
from oea.routing import active_experts


@dataclass
class _Metrics:
    path: str | None = None  # OEA_METRICS_FILE (None once this process found it cannot write it)
    checked: bool = False  # whether this process tested that it can write ``path`` (at its first forward)
    timing: bool = False  # OEA_TIMING
    flush_s: float = 0.5  # OEA_METRICS_FLUSH_S
    oea: bool = False  # OEA_K0 set: active_stock is counted, and a step is "oea" when every layer was rewritten
    writer: MetricsWriter | None = None
    record: StepRecord | None = None  # the open forward's record
    step: int = 0  # forwards seen by this process
    depth: int = 0  # forward contexts entered (only the outermost one is a step)
    started: float = 0.0  # perf_counter at the current routing call's select_experts (OEA_TIMING)
    first_layer: Any = None  # layer_id of the first MoE layer routed in a forward (counts rows outside forwards)
    settings: EnvSettings | None = None  # the process's settings (the Prometheus export's k0 and min_batch)
    export: bool = False  # the oea_* series are exported (OEA_K0 and SGLang's --enable-metrics): a writer even
    # without OEA_METRICS_FILE
    exporter: Exporter | None = None
    layers_set: bool = False  # the exporter's per-layer series were made (at the first forward that routed)


METRICS = _Metrics()  # one per process, never replaced


def configure(settings: EnvSettings, timing: bool | None = None) -> None:
    """Start-up: the metrics file (tested at this process's first forward, ``_writable``), its flush interval and
    ``OEA_TIMING`` (``timing``: default ``settings.timing``), as the process's settings hold them."""
    METRICS.timing, METRICS.oea = settings.timing if timing is None else timing, settings.oea is not None
    METRICS.flush_s = settings.metrics_flush_s
    METRICS.path, METRICS.checked = settings.metrics_file or None, False
    METRICS.settings, METRICS.export = settings, prometheus.export_directory(settings) is not None


def _writable() -> bool:
    """Whether this process can append to the metrics file; the first call that finds it cannot warns once and
    serving goes on without metrics."""
    if not METRICS.checked and METRICS.path is not None:
        METRICS.checked = True
        problem = trace_path_problem(METRICS.path)  # the same test as a trace: a file this process appends to
        if problem is not None:
            log.warning("oea: OEA_METRICS_FILE=%s cannot be written (%s); serving without metrics",
                        METRICS.path, problem)
            METRICS.path = None
    return METRICS.path is not None


def observing() -> bool:
    """Whether the routing calls of this thread's current forward are counted."""
    return METRICS.record is not None


@contextlib.contextmanager
def forward(forward_batch: Any, mode: Any) -> Iterator[None]:
    """Around one forward of ``forward_batch`` in ``mode`` (a ``ForwardMode``): its metrics row."""
    if METRICS.depth or tracing() or not (_writable() or METRICS.export):
        METRICS.depth += 1
        try:
            yield
        finally:
            METRICS.depth -= 1
        return
    if METRICS.writer is None:
        _start_writer()
    assert METRICS.writer is not None
    METRICS.step += 1
    METRICS.record = StepRecord(decode=mode_rerouted(mode), oea=METRICS.oea, verify=_holds(mode, "is_target_verify"),
                                outside_rows=METRICS.writer.outside_rows,
                                tokens_per_request=_tokens_per_request(forward_batch, mode))
    METRICS.writer.outside_rows = 0
    METRICS.depth += 1
    try:
        yield
    finally:
        METRICS.depth -= 1
        record, METRICS.record = METRICS.record, None
        if record is not None and record.active:  # a forward that routed (an idle batch routes nothing)
            METRICS.writer.add(METRICS.step, record)
            if not METRICS.layers_set:
                METRICS.layers_set = True
                _set_layers(list(record.active))


def _start_writer() -> None:
    """This process's writer (at its first forward: only the processes that run the model), feeding
    ``OEA_METRICS_FILE`` and, with export on, the ``oea_*`` series (``prometheus.py``)."""
    exporter = None
    if METRICS.export:
        try:
            exporter = prometheus.start_export(METRICS.settings)
        except Exception as err:  # never into SGLang's forward pass: the file (if any) goes on without export
            warn_once("prometheus-start", f"the Prometheus export cannot start ({type(err).__name__}: {err}); "
                                          "serving continues without oea_* series")
        METRICS.export = exporter is not None
    METRICS.exporter = exporter
    METRICS.writer = MetricsWriter(METRICS.path, METRICS.flush_s, log, export=exporter)


def _set_layers(layers: list[int]) -> None:
    """The exporter's per-layer series for the MoE layers of the first forward that routed."""
    try:
        prometheus.layers_known(METRICS.exporter, layers)
    except Exception as err:  # the series then appear at their first count
        warn_once("prometheus-layers", f"the Prometheus per-layer series cannot be made ({type(err).__name__}: "
                                       f"{err}); they appear at their first count, serving continues")


def call_started() -> None:
    """``select_experts`` begins (``OEA_TIMING``: SGLang's own top-k is timed from here)."""
    if METRICS.timing and METRICS.record is not None:
        METRICS.started = time.perf_counter()


def layer_routed(kwargs: dict[str, Any], result: tuple[torch.Tensor, torch.Tensor] | None, rewrite_us: float,
                 why: str | None = None) -> None:
    """One routing call: ``kwargs`` are ``_post_process_topk_ids``' (SGLang's [M, k + s] ids and weights),
    ``result`` the ids and weights OEA replaced them with (None: SGLang's kept, because of ``why``, a
    ``PASSTHROUGH_REASONS`` key, recorded in decode and verify forwards), ``rewrite_us`` OEA's time.
    Rows past the call's real-row count (``padding.bound``) are padding, never counted. Never raises into
    SGLang."""
    record = METRICS.record
    try:
        if record is None:
            if METRICS.writer is not None and METRICS.depth == 0 and \
                    kwargs.get("layer_id") == METRICS.first_layer:  # once per forward-less pass (warm-up)
                METRICS.writer.outside_rows += int(kwargs["router_logits"].shape[0])
            return
        if tracing():
            return
        stock_us = (time.perf_counter() - METRICS.started) * 1e6 if METRICS.timing else 0.0
        layer = kwargs.get("layer_id")
        if not record.active and METRICS.first_layer is None:
            METRICS.first_layer = layer
        key = len(record.active) if layer is None else int(layer)
        ids, weights = kwargs["topk_ids"], kwargs["topk_weights"]
        routed_k = int(kwargs["topk_config"].top_k) - shared_topk_slots(kwargs["topk_config"])
        rows = ids.shape[0]
        valid_rows = padding.bound(kwargs["router_logits"], kwargs.get("num_token_non_padded"))
        valid = None if valid_rows is None else torch.arange(rows, device=ids.device) < valid_rows
        stock_ids, stock_weights = ids[:, :routed_k], weights[:, :routed_k]
        new_ids, new_weights = (stock_ids, stock_weights) if result is None else \
            (result[0][:, :routed_k], result[1][:, :routed_k])
        record.rows = rows if valid is None else int(valid.sum())
        record.padding_rows = rows - record.rows
        record.oea = record.oea and result is not None
        if result is None and why is not None and (record.decode or record.verify):
            record.passthrough[key] = why
        record.routed[key] = routed_hash(new_ids, new_weights, valid)
        record.active[key] = active_experts(new_ids, new_weights, valid)
        if METRICS.oea:  # counted from SGLang's own output on every call, so a wrongly rewritten forward shows
            record.active_stock[key] = active_experts(stock_ids, stock_weights, valid)
        if METRICS.timing:
            record.routing_us[key] = rewrite_us if result is not None else stock_us
    except Exception as err:  # never into SGLang's forward pass
        warn_once(f"metrics-error:{type(err).__name__}", f"metrics of a routing call failed ({type(err).__name__}: "
                                                         f"{err}); such calls are not counted, serving continues")


def _holds(mode: Any, name: str) -> bool:
    predicate = getattr(mode, name, None)
    return bool(predicate()) if callable(predicate) else False


def _tokens_per_request(forward_batch: Any, mode: Any) -> list[int] | None:
    """The tokens each request runs in this forward, in the batch's order (None when the batch does not say):
    1 in DECODE, its draft tokens in TARGET_VERIFY, its prompt chunk in EXTEND."""
    try:  # a field the batch lacks or leaves None raises: not said (a batch without its size is not 0 requests)
        if _holds(mode, "is_decode"):
            return [1] * int(forward_batch.batch_size)
        if _holds(mode, "is_target_verify"):
            return [int(forward_batch.spec_info.draft_token_num)] * int(forward_batch.batch_size)
        return [int(n) for n in forward_batch.extend_seq_lens_cpu]
    except Exception:  # not said, or a batch shaped unlike SGLang's: the row just lacks the field
        return None
