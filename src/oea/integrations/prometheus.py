"""Prometheus export of what OEA did in each engine step: the ``oea_*`` series, fed by the metrics writer.

Engine-free, below the adapters: an adapter hands its ``MetricsWriter`` an ``Exporter`` (``export=``), and the
writer's thread gives it every flush's ``StepRecord``s with the very lines ``OEA_METRICS_FILE`` gets, so a
metrics-file line and the series count the same forwards by construction, in every engine.

The series are written in prometheus_client's multiprocess format (one ``<type>_<pid>-oea<n>.db`` file per
exporter and type in a directory, never prometheus_client's own ``<type>_<pid>.db`` of the same process; gauges
in ``gauge_max_<pid>-oea<n>.db``: multiprocess mode ``max``) and read back by
prometheus_client's own ``MultiProcessCollector``: the engine's ``/metrics`` aggregates them where its registry
reads the directory (SGLang ``--enable-metrics``: ``PROMETHEUS_MULTIPROC_DIR``; vLLM: ``oea.integrations.vllm.
prometheus``), else a worker serves them on ``OEA_PROMETHEUS_PORT`` (``serve_port``). The files are written
through ``prometheus_client.mmap_dict`` rather than its metric classes: those choose their storage once per
process, when prometheus_client is first imported, which an engine has done before a plugin can say where.
No custom collector: multiprocess mode aggregates files only.

Every series carries ``engine`` (``vllm`` / ``sglang``), ``model_name`` (the served name) and ``rank`` (the
worker's global rank). ``SERIES`` lists them; docs/observability.md says what each means.

prometheus_client is imported only when an exporter is made: it is not a dependency of ``oea``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from oea.config.variables import BY_NAME
from oea.integrations.metrics import PASSTHROUGH_REASONS, StepRecord

PORT_VARIABLE = "OEA_PROMETHEUS_PORT"
EXPORT_VARIABLE = "OEA_PROMETHEUS"  # 0: OEA on without its series
_EXPORTERS = itertools.count()
PHASES = ("decode", "verify", "prefill")
# Per-forward routing time summed over the layers (OEA_TIMING), in seconds.
ROUTING_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, float("inf"))


@dataclass(frozen=True)
class Series:
    """One exported family: ``name`` (without ``_total``), prometheus type, extra label names, help."""

    name: str
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str


SERIES: dict[str, Series] = {
    s.name: s
    for s in (
        Series(
            "oea_forwards",
            "counter",
            ("phase",),
            "Engine forwards (steps) that routed, by phase: decode (OEA may "
            "rewrite), verify (speculative verify OEA may not rewrite), prefill (any prompt chunk)",
        ),
        Series("oea_rewritten_forwards", "counter", (), "Decode forwards OEA rewrote in every MoE layer"),
        Series(
            "oea_passthrough_forwards",
            "counter",
            ("reason",),
            "Decode and verify forwards that kept the engine's routing in some layer, by reason",
        ),
        Series(
            "oea_layer_passthrough_forwards",
            "counter",
            ("layer", "reason"),
            "Decode and verify forwards in which this MoE layer kept the engine's routing, by reason",
        ),
        Series("oea_decode_rows", "counter", (), "Real (non-padding) rows of the decode and verify forwards"),
        Series("oea_padding_rows", "counter", (), "Padding rows of the decode and verify forwards (engine's routing)"),
        Series("oea_outside_rows", "counter", (), "Rows routed outside any engine step (warm-up, DP dummy batches)"),
        Series(
            "oea_active_experts",
            "counter",
            ("layer",),
            "Distinct experts used, summed over decode and verify "
            "forwards, per MoE layer (divide by oea_forwards for the mean per forward)",
        ),
        Series(
            "oea_stock_active_experts",
            "counter",
            ("layer",),
            "The same count for the engine's own routing of the same logits (OEA_K0 set)",
        ),
        Series(
            "oea_routing_seconds",
            "counter",
            ("layer",),
            "Routing time of decode and verify forwards per MoE layer (OEA_TIMING=1)",
        ),
        Series(
            "oea_forward_routing_seconds",
            "histogram",
            (),
            "Routing time of one decode or verify forward summed over its MoE layers (OEA_TIMING=1)",
        ),
        Series(
            "oea_enabled", "gauge", ("k0", "min_batch"), "1 while OEA rewrites routing in this process (OEA_K0 set)"
        ),
        Series("oea_metrics_file_rows", "counter", (), "Lines written to OEA_METRICS_FILE"),
        Series("oea_metrics_file_stopped", "gauge", (), "1 once OEA_METRICS_FILE could not be written"),
        Series("oea_trace_steps_written", "counter", (), "Decode steps the OEA_TRACE_FILE recorder queued for writing"),
        Series(
            "oea_trace_steps_dropped", "counter", (), "Decode steps the OEA_TRACE_FILE recorder dropped (queue full)"
        ),
        Series("oea_trace_stopped", "gauge", (), "1 once the OEA_TRACE_FILE recorder stopped (size cap, write error)"),
    )
}
BASE_LABELS = ("engine", "model_name", "rank")


def phase(record: StepRecord) -> str:
    """A record's ``phase`` label: decode (OEA may rewrite it), verify (a verify step it may not), prefill."""
    return "decode" if record.decode else "verify" if record.verify else "prefill"


class Exporter:
    """Writes the ``oea_*`` series of one process into a multiprocess directory; called by the metrics writer's
    thread (``__call__``) and by the adapter for state (``set_enabled``, ``recorder``)."""

    def __init__(
        self, directory: str, engine: str, model_name: str, log: logging.Logger | None = None, recorder: Any = None
    ) -> None:
        from prometheus_client.mmap_dict import MmapedDict, mmap_key

        self.directory, self.engine, self.model_name = directory, engine, model_name
        self.log = log or logging.getLogger("oea")
        self.recorder = recorder  # a callable returning the trace recorder (None: none yet), read at each flush
        self._key, self._open = mmap_key, MmapedDict
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._keys: dict[tuple[Any, ...], str] = {}  # sample -> its key in the file (JSON, made once)
        self._sums: dict[Any, float] | None = None  # a flush's additions, per sample, while it is counted
        self._per_layer: dict[tuple[str, int, int], float] = {}  # a flush's per-layer sums, while it is counted
        self._trace_seen = (0, 0)
        self._ready: set[int] = set()  # ranks whose fixed series exist (at 0 until counted)
        self._number = next(_EXPORTERS)  # this process's exporters, numbered: each writes files of its own

    def _write(self, prefix: str, family: str, sample: str, labels: dict[str, str], value: float, add: bool) -> None:
        """Add ``value`` to (or set) one sample in this exporter's ``<prefix>_<pid>-oea<n>.db`` file; while a flush's
        records are counted (``__call__``) additions are summed and written once per sample at its end."""
        slot = (prefix, family, sample, tuple(labels.items()))
        if add and self._sums is not None:
            self._sums[slot] = self._sums.get(slot, 0.0) + value
            return
        self._put(slot, value, add)

    def _put(self, slot: tuple[str, str, str, tuple[tuple[str, str], ...]], value: float, add: bool) -> None:
        prefix, family, sample, labels = slot
        handle = self._files.get(prefix)
        if handle is None:
            # a file of this exporter's own: prometheus_client's metrics of the same process (SGLang's scheduler
            # writes its own into the same directory) keep theirs in <prefix>_<pid>.db, and two writers of one
            # mmap file each append at their own end, overwriting the other's keys
            name = f"{prefix}_{os.getpid()}-oea{self._number}.db"
            handle = self._files[prefix] = self._open(os.path.join(self.directory, name))
        key = self._keys.get(slot)
        if key is None:
            names, values = [name for name, _ in labels], [value for _, value in labels]
            key = self._keys[slot] = self._key(family, sample, names, values, SERIES[family].help)
        # a counter adds to the running total its file holds
        handle.write_value(key, handle.read_value(key)[0] + value if add else value, 0.0)

    def _labels(self, rank: int, **extra: Any) -> dict[str, str]:
        return {
            "engine": self.engine,
            "model_name": self.model_name,
            "rank": str(rank),
            **{name: str(value) for name, value in extra.items()},
        }

    def count(self, family: str, amount: float, rank: int, **labels: Any) -> None:
        """Add ``amount`` to the counter ``family`` (its sample ``<family>_total``)."""
        self._write("counter", family, f"{family}_total", self._labels(rank, **labels), amount, True)

    def gauge(self, family: str, value: float, rank: int, **labels: Any) -> None:
        """Set the gauge ``family`` (multiprocess mode ``max``: the largest over the processes)."""
        self._write("gauge_max", family, family, self._labels(rank, **labels), value, False)

    def observe(self, family: str, value: float, rank: int) -> None:
        """One observation of the histogram ``family`` (``ROUTING_BUCKETS``; each bucket file value counts the
        observations of that bucket alone: the collector makes them cumulative)."""
        labels = self._labels(rank)
        bound = next(b for b in ROUTING_BUCKETS if value <= b)
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        self._write("histogram", family, f"{family}_bucket", {**labels, "le": le}, 1.0, True)
        self._write("histogram", family, f"{family}_sum", labels, value, True)

    def set_enabled(self, rank: int, k0: Any, min_batch: Any, on: bool = True) -> None:
        """``oea_enabled``: whether this process rewrites routing, with its k0 and min_batch as labels."""
        with self._lock:
            self.gauge("oea_enabled", 1.0 if on else 0.0, rank, k0=k0, min_batch=min_batch)
            self.initialise(rank)

    def __call__(self, batch: list[tuple[StepRecord, dict[str, Any]]], writer: Any = None) -> None:
        """One flush of the metrics writer (``writer``: its file's state is exported too): each record with its
        metrics-file line."""
        with self._lock:
            rank, self._sums, self._per_layer = 0, {}, {}
            try:
                for record, row in batch:
                    rank = int(row.get("rank", 0))
                    self.initialise(rank)
                    self._step(record, row, rank)
                for (family, at, layer), value in self._per_layer.items():
                    self.count(family, value, at, layer=layer)
                sums = self._sums
            finally:
                self._sums = None
            for slot, value in sums.items():  # one write per sample and flush, not per step and layer
                self._put(slot, value, True)
            if writer is not None:
                self.writer_state(writer, rank)
            self._recorder_state(rank)

    def initialise(self, rank: int) -> None:
        """Every series without a layer label, at 0 until counted, so that a query or alert on a count that never
        grew (no forward rewritten, no layer failed) has data rather than none (Prometheus's advice)."""
        if rank in self._ready:
            return
        self._ready.add(rank)
        for kind in PHASES:
            self.count("oea_forwards", 0, rank, phase=kind)
        for reason in PASSTHROUGH_REASONS:
            self.count("oea_passthrough_forwards", 0, rank, reason=reason)
        for family in (
            "oea_rewritten_forwards",
            "oea_decode_rows",
            "oea_padding_rows",
            "oea_outside_rows",
            "oea_trace_steps_written",
            "oea_trace_steps_dropped",
        ):
            self.count(family, 0, rank)
        self._write("gauge_max", "oea_trace_stopped", "oea_trace_stopped", self._labels(rank), 0.0, True)

    def set_layers(self, rank: int, layers: list[int]) -> None:
        """The per-layer series of the MoE layers OEA routes, at 0 until counted, and the routing-time histogram:
        a series born in the middle of a burst shorter than a scrape interval would show no rate at all."""
        with self._lock:
            self.initialise(rank)
            for layer in layers:
                for family in ("oea_active_experts", "oea_stock_active_experts", "oea_routing_seconds"):
                    self.count(family, 0, rank, layer=layer)
            labels = self._labels(rank)
            family = "oea_forward_routing_seconds"
            for bound in ROUTING_BUCKETS:
                le = "+Inf" if bound == float("inf") else repr(float(bound))
                self._write("histogram", family, f"{family}_bucket", {**labels, "le": le}, 0.0, True)
            self._write("histogram", family, f"{family}_sum", labels, 0.0, True)

    def _step(self, record: StepRecord, row: dict[str, Any], rank: int) -> None:
        kind = phase(record)
        self.count("oea_forwards", 1, rank, phase=kind)
        if row.get("outside_rows"):
            self.count("oea_outside_rows", row["outside_rows"], rank)
        if kind == "prefill":
            return
        self.count("oea_decode_rows", row["rows"], rank)
        if row.get("padding_rows"):
            self.count("oea_padding_rows", row["padding_rows"], rank)
        reason = row.get("reason")
        if reason is None:
            self.count("oea_rewritten_forwards", 1, rank)
        else:
            self.count("oea_passthrough_forwards", 1, rank, reason=reason)
        for layer, why in record.passthrough.items():
            self.count("oea_layer_passthrough_forwards", 1, rank, layer=layer, reason=why)
        layers = sorted(record.active)  # the order of the line's per-layer lists
        per_layer = self._per_layer  # summed over the flush, then counted once per layer (``__call__``)
        for layer, active in zip(layers, row["active"], strict=True):
            per_layer[("oea_active_experts", rank, layer)] = (
                per_layer.get(("oea_active_experts", rank, layer), 0) + active
            )
        stock_layers = [layer for layer in layers if layer in record.active_stock]
        for layer, active in zip(stock_layers, row.get("active_stock", []), strict=True):
            slot = ("oea_stock_active_experts", rank, layer)
            per_layer[slot] = per_layer.get(slot, 0) + active
        timed = [layer for layer in layers if layer in record.routing_us]
        if timed:
            seconds = [us / 1e6 for us in row["routing_us"]]
            for layer, spent in zip(timed, seconds, strict=True):
                per_layer[("oea_routing_seconds", rank, layer)] = (
                    per_layer.get(("oea_routing_seconds", rank, layer), 0) + spent
                )
            self.observe("oea_forward_routing_seconds", sum(seconds), rank)

    def writer_state(self, writer: Any, rank: int) -> None:
        """The metrics file's lines written so far and whether it stopped."""
        if writer.path is None:
            return
        self._write(
            "counter",
            "oea_metrics_file_rows",
            "oea_metrics_file_rows_total",
            self._labels(rank),
            float(writer.rows_written),
            False,
        )
        self.gauge("oea_metrics_file_stopped", 1.0 if writer.failed else 0.0, rank)

    def _recorder_state(self, rank: int) -> None:
        """The trace recorder's steps written and dropped (counters follow its own totals) and whether it
        stopped."""
        recorder = self.recorder() if self.recorder is not None else None
        if recorder is None:
            return
        steps, dropped = int(recorder.steps), int(recorder.dropped)
        seen_steps, seen_dropped = self._trace_seen
        if steps > seen_steps:
            self.count("oea_trace_steps_written", steps - seen_steps, rank)
        if dropped > seen_dropped:
            self.count("oea_trace_steps_dropped", dropped - seen_dropped, rank)
        self._trace_seen = (max(steps, seen_steps), max(dropped, seen_dropped))
        self.gauge("oea_trace_stopped", 1.0 if getattr(recorder, "stopped", None) else 0.0, rank)


def make_exporter(
    engine: str, model_name: str, directory: str, log: logging.Logger, recorder: Any = None
) -> Exporter | None:
    """An ``Exporter`` writing into ``directory``, or None with one warning when prometheus_client is missing or
    the directory cannot be written (serving goes on without the export)."""
    try:
        os.makedirs(directory, exist_ok=True)
        return Exporter(directory, engine, model_name, log, recorder)
    except ImportError as err:
        log.warning(
            "oea: Prometheus export is off: prometheus_client cannot be imported (%s); pip install prometheus_client",
            err,
        )
    except OSError as err:
        log.warning("oea: Prometheus export is off: %s cannot be used (%s: %s)", directory, type(err).__name__, err)
    return None


def doctor_off_line(env: dict[str, str]) -> tuple[bool, str] | None:
    """The ``prometheus export`` doctor line every engine shares when no series can be exported in ``env`` (OEA
    off, ``OEA_PROMETHEUS`` 0 or malformed, prometheus_client missing): (ok, detail); None when the engine's own
    line applies."""
    if not env.get("OEA_K0", env.get("SGLANG_OEA_K0", "")).strip():
        return True, "off (OEA_K0 unset: no oea_* series)"
    try:
        exported = BY_NAME[EXPORT_VARIABLE].value(env, True)
    except ValueError as err:
        return False, f"{err} (the server stops at start-up)"
    if not exported:
        return True, f"off ({EXPORT_VARIABLE}={env[EXPORT_VARIABLE].strip()}: no oea_* series)"
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False, "prometheus_client is not installed in this environment: pip install prometheus_client"
    return None


def parse_port(raw: str) -> tuple[str, int]:
    """``OEA_PROMETHEUS_PORT``'s value, ``PORT`` or ``HOST:PORT`` -> (host, port); host 0.0.0.0 when not given.
    ``ValueError`` naming the variable and the allowed values (the words of ``oea.config.variables``)."""
    return BY_NAME[PORT_VARIABLE].parse(PORT_VARIABLE, raw.strip())


def serve_port(directory: str, raw: str, log: logging.Logger) -> tuple[str, Any] | None:
    """Serve the series of ``directory`` (every process's) over HTTP at ``OEA_PROMETHEUS_PORT`` (``raw``) from
    this process: (``host:port``, the HTTP server), or None with one warning naming the variable when the value
    is not a port or the port cannot be bound (serving goes on without this endpoint)."""
    try:
        host, port = parse_port(raw)
    except ValueError as err:
        log.warning("oea: %s; serving without OEA's Prometheus endpoint", err)
        return None
    try:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=directory)
        server, _ = start_http_server(port, addr=host, registry=registry)
    except (ImportError, OSError, ValueError) as err:
        log.warning(
            "oea: %s=%s: cannot serve there (%s: %s); serving without OEA's Prometheus endpoint",
            PORT_VARIABLE,
            raw,
            type(err).__name__,
            err,
        )
        return None
    log.info("oea: OEA's Prometheus series on http://%s:%d/metrics (%s)", host, port, PORT_VARIABLE)
    return f"{host}:{port}", server
