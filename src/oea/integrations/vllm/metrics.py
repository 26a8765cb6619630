"""The metrics file (``OEA_METRICS_FILE``): one JSON line per engine step, appended off the forward path.

Each line::

    {"pid", "rank", "step", "time", "decode", "oea", "rows", "padding_rows", "outside_rows", "layers",
     "active": [T per layer], "active_stock": [T per layer] (mode oea), "routed": [hash per layer],
     "routing_us": [per layer] (OEA_TIMING)}

``oea`` is true when OEA rewrote the routing of every layer in the step; ``active`` counts the distinct
experts with non-zero weight over the step's real (non-padding) rows in each MoE layer; ``active_stock``
is the same count for vLLM's own routing of the same logits (equal to ``active`` in the steps OEA leaves
alone: prefill, batches below ``min_batch``). ``rank`` is the worker's global rank (tensor / expert / data
parallel; 0 without ``torch.distributed``); ``padding_rows`` the step's padding rows (never in a union, never
rerouted); ``outside_rows`` the rows routed outside any engine step since the previous line (DP dummy batches,
warm-up runs), always with vLLM's own routing; ``routed`` a hash of each layer's routed ids and weights over the
real rows, so ranks that route the same rows can be compared bit for bit.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch


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


class MetricsWriter:
    """Buffers step records (device tensors allowed) and appends them as JSON lines from a daemon
    thread every ``interval`` seconds and at exit, so the forward path never waits on a write."""

    def __init__(self, path: str, interval: float) -> None:
        self.path = path
        self.interval = interval
        self._lock = threading.Lock()
        self._pending: list[tuple[int, float, StepRecord]] = []
        self._stop = threading.Event()
        self.outside_rows = 0  # counted by the routing calls outside a step, moved into the next step's record
        self._thread = threading.Thread(target=self._run, name="oea-metrics", daemon=True)
        self._thread.start()
        atexit.register(self.flush)

    def add(self, step: int, record: StepRecord) -> None:
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


def routed_hash(ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None) -> str:
    """16 hex digits of BLAKE2b over the real rows' ids (as int64) and weights (as float32), in row order."""
    ids, weights = ids.detach().to("cpu", torch.int64), weights.detach().to("cpu", torch.float32)
    if valid is not None:
        keep = valid.detach().cpu()
        ids, weights = ids[keep], weights[keep]
    digest = hashlib.blake2b(ids.contiguous().numpy().tobytes(), digest_size=8)
    digest.update(weights.contiguous().numpy().tobytes())
    return digest.hexdigest()


def process_rank() -> int:
    """This process's global rank in vLLM's ``torch.distributed`` world (0 when there is none)."""
    dist = torch.distributed
    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


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
        "oea": rec.oea,
        "rows": rec.rows,
        "padding_rows": rec.padding_rows,
        "outside_rows": rec.outside_rows,
        "layers": len(layers),
        "active": [_as_int(rec.active[i]) for i in layers],
    }
    if rec.active_stock:
        row["active_stock"] = [_as_int(rec.active_stock[i]) for i in layers if i in rec.active_stock]
    if rec.routed:
        row["routed"] = [rec.routed[i] for i in layers if i in rec.routed]
    if rec.routing_us:
        row["routing_us"] = [round(rec.routing_us[i], 3) for i in layers if i in rec.routing_us]
    return row
