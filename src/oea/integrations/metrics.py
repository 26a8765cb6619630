"""The metrics file (``OEA_METRICS_FILE``): one JSON line per engine step, appended off the forward path.

Engine-free: an adapter fills a ``StepRecord`` per engine step from its routing calls and hands it to its
process's ``MetricsWriter``.

Each line::

    {"pid", "rank", "step", "time", "decode", "verify", "tokens_per_request", "oea", "rows", "padding_rows",
     "outside_rows", "layers", "active": [T per layer], "active_stock": [T per layer] (mode oea),
     "routed": [hash per layer], "routing_us": [per layer] (OEA_TIMING), "reason" (see below)}

``decode`` is true for the steps OEA may rewrite (every request runs one new token; with
``OEA_APPLY_TO_VERIFY=1`` plus its draft tokens); ``verify`` for speculative verify steps (every request runs
its last sampled token plus its drafts, and some request has drafts), rewritten or not; a step that also runs
a prefill chunk is neither. ``tokens_per_request``: the tokens each scheduled request ran in the step (1 + its
drafts in decode and verify steps, a prompt chunk in prefill), in the scheduler's order.

``oea`` is true when OEA rewrote the routing of every layer in the step; ``active`` counts the distinct
experts with non-zero weight over the step's real (non-padding) rows in each MoE layer; ``active_stock``
is the same count for the engine's own routing of the same logits (equal to ``active`` in the steps OEA
leaves alone: prefill, batches below ``min_batch``). ``rank`` is the worker's global rank (tensor / expert /
data parallel; 0 without ``torch.distributed``); ``padding_rows`` the step's padding rows (never in a union,
never rerouted); ``outside_rows`` the rows routed outside any engine step since the previous line (DP dummy
batches, warm-up runs), always with the engine's own routing; ``routed`` a hash of each layer's routed ids and
weights over the real rows, so ranks that route the same rows can be compared bit for bit. ``reason`` (only
in decode-phase rows that OEA did not rewrite in every layer, ``PASSTHROUGH_REASONS``): why the engine's routing
was kept (``step_reason``).

The same records feed ``OEA_METRICS_FILE``'s lines and, when the adapter passes an ``export`` callable (the
Prometheus exporter, ``oea.integrations.prometheus``), that callable with each record and its line, in the
writer's thread: a line and the exported series count the same forwards by construction.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from oea.integrations.runtime import process_rank


@dataclass
class StepRecord:
    """What one engine step routed, filled by the routing calls (values may be 0-dim device tensors)."""

    decode: bool
    oea: bool
    rows: int = 0
    padding_rows: int = 0
    outside_rows: int = 0  # rows routed outside any engine step since the previous step (always stock)
    active: dict[int, Any] = field(default_factory=dict)
    routed: dict[int, str] = field(default_factory=dict)
    active_stock: dict[int, Any] = field(default_factory=dict)
    routing_us: dict[int, float] = field(default_factory=dict)
    verify: bool = False  # a speculative verify step: some request carries draft tokens
    tokens_per_request: list[int] | None = None  # tokens each scheduled request ran in the step
    reason: str | None = None  # why a decode-phase step kept the engine's routing (PASSTHROUGH_REASONS)
    passthrough: dict[int, str] = field(default_factory=dict)  # layer -> why it kept the engine's routing


# Why a decode-phase forward kept the engine's routing (the metrics line's ``reason``, the exported series'
# ``reason`` label). An adapter that does not say gets "unknown" (or "verify_not_applied" for a verify step).
PASSTHROUGH_REASONS: dict[str, str] = {
    "below_min_batch": "fewer real rows than OEA_MIN_BATCH",
    "k0_covers_top_k": "the layer's k0 is >= its top_k: OEA would change nothing",
    "kernel_routed": "the backend routes inside its MoE kernel",
    "layer_failed": "the layer's OEA routing raised earlier; it keeps the engine's routing",
    "verify_not_applied": "a speculative verify step without OEA_APPLY_TO_VERIFY=1",
    "dp_gathered": "rows gathered across data-parallel ranks",
    "oea_off": "OEA_K0 is unset (metrics only)",
    "unknown": "the adapter did not say",
}
# what an exporter gets at each flush: the records with their lines, and the writer (its file's state)
Export = Callable[[list[tuple["StepRecord", dict[str, Any]]], "MetricsWriter"], None]


def step_reason(record: StepRecord) -> str | None:
    """Why a decode-phase step (``decode`` or ``verify``) kept the engine's routing in some layer: the record's
    ``reason``, else its first layer's ``passthrough``, else ``verify_not_applied`` for a verify step OEA may
    not rewrite, else ``unknown``; None for a rewritten step or one outside the decode phase."""
    if (record.oea and record.decode) or not (record.decode or record.verify):
        return None
    if record.reason is not None:
        return record.reason
    if record.passthrough:
        return record.passthrough[min(record.passthrough)]
    return "verify_not_applied" if not record.decode else "unknown"


class MetricsWriter:
    """Buffers step records (device tensors allowed) and appends them as JSON lines from a daemon
    thread every ``interval`` seconds and at exit, so the forward path never waits on a write.

    A write that fails (the folder removed, a full disk, no permission) stops the file with one warning:
    the file is cut back to its last whole line, no more lines are written, and serving goes on.
    ``path`` None: no file, the records go to ``export`` only. ``export`` (when given) gets each flush's records
    with their lines, after the file write, whether or not the file could be written.
    """

    def __init__(self, path: str | None, interval: float, log: logging.Logger | None = None,
                 export: Export | None = None) -> None:
        self.path = path
        self.export = export
        self.rows_written = 0  # lines appended to the file so far
        self.interval = interval
        self.log = log or logging.getLogger("oea")
        self._lock = threading.Lock()
        self._pending: list[tuple[int, float, StepRecord]] = []
        self._stop = threading.Event()
        self.failed: str | None = None  # why the file can no longer be written (then nothing is kept)
        self.outside_rows = 0  # counted by the routing calls outside a step, moved into the next step's record
        self._thread = threading.Thread(target=self._run, name="oea-metrics", daemon=True)
        self._thread.start()
        atexit.register(self.flush)

    def add(self, step: int, record: StepRecord) -> None:
        if (self.failed is not None or self.path is None) and self.export is None:
            return
        with self._lock:
            self._pending.append((step, time.time(), record))

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and (self.failed is None or self.export is not None):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        rows = [_record_row(step, stamp, rec) for step, stamp, rec in pending]
        if self.path is not None and self.failed is None:
            try:
                _append_whole(self.path, ("\n".join(json.dumps(row) for row in rows) + "\n").encode())
                self.rows_written += len(rows)
            except OSError as err:
                self.failed = f"{type(err).__name__}: {err}"
                self.log.warning("oea: OEA_METRICS_FILE=%s cannot be written (%s); no more metrics are recorded, "
                                 "serving continues", self.path, self.failed)
        if self.export is not None:
            try:
                self.export([(rec, row) for (_, _, rec), row in zip(pending, rows, strict=True)], self)
            except Exception as err:  # never into the writer thread's loop: the file goes on without the export
                self.export = None
                self.log.warning("oea: the Prometheus export failed (%s: %s) and stops; the metrics file goes on, "
                                 "serving continues", type(err).__name__, err)


def _append_whole(path: str, data: bytes) -> None:
    """Append ``data`` to ``path``; when the write fails part-way the file is cut back to where it ended, so it
    never holds half a line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def routed_hash(ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None) -> str:
    """16 hex digits of BLAKE2b over the real rows' ids (as int64) and weights (as float32), in row order."""
    ids, weights = ids.detach().to("cpu", torch.int64), weights.detach().to("cpu", torch.float32)
    if valid is not None:
        keep = valid.detach().cpu()
        ids, weights = ids[keep], weights[keep]
    digest = hashlib.blake2b(ids.contiguous().numpy().tobytes(), digest_size=8)
    digest.update(weights.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _as_int(value: Any) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _record_row(step: int, stamp: float, rec: StepRecord) -> dict[str, Any]:
    layers = sorted(rec.active)
    row: dict[str, Any] = {
        "pid": os.getpid(),
        "rank": process_rank(),
        "step": step,
        "time": stamp,
        "decode": rec.decode,
        "verify": rec.verify,
        "oea": rec.oea,
        "rows": rec.rows,
        "padding_rows": rec.padding_rows,
        "outside_rows": rec.outside_rows,
        "layers": len(layers),
        "active": [_as_int(rec.active[i]) for i in layers],
    }
    if rec.tokens_per_request is not None:
        row["tokens_per_request"] = rec.tokens_per_request
    if rec.active_stock:
        row["active_stock"] = [_as_int(rec.active_stock[i]) for i in layers if i in rec.active_stock]
    if rec.routed:
        row["routed"] = [rec.routed[i] for i in layers if i in rec.routed]
    if rec.routing_us:
        row["routing_us"] = [round(rec.routing_us[i], 3) for i in layers if i in rec.routing_us]
    reason = step_reason(rec)
    if reason is not None:
        row["reason"] = reason
    return row
