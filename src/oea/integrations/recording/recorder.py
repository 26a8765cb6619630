"""Recording decode-step routing from a serving engine (``OEA_TRACE_FILE``), shared by the vLLM and SGLang
plugins; engine-free.

Shape legend: M = rows of one router call, L = recorded MoE layers, N = routed experts, k = top-k.

What runs where:

* in every routing call of a recorded step, ``StepStaging.stage`` copies the call's router logits into a
  persistent [L, capacity, N] float32 buffer on the model's device: one device copy, no host
  synchronisation, so it can run inside a captured CUDA graph (the buffer's address never changes);
* after the step, the adapter calls ``TraceRecorder.submit_step`` with the step id, the number of real
  rows and their request ids and positions: on CUDA the buffer's rows are copied asynchronously to
  pinned host memory and an event marks their arrival, on CPU they are copied at once; the step then goes
  into a queue bounded in steps and bytes (a full queue drops the step, counted and warned once, never
  blocking the engine);
* a background thread wakes every ``BATCH_WAIT_S`` (or once the queue is half full), waits for the queued
  steps' events, appends their rows to the file in one write per tensor (``trace_file``) and,
  when the size cap would be passed or the disk refuses a write, stops recording with one warning and
  finishes the file; ``close`` (at process exit, or by the adapter) finishes it otherwise. At most every
  ``CHECKPOINT_S`` seconds, and once the engine goes idle, the thread checkpoints the file (a loadable trace
  of the steps so far, in place): an engine that kills its workers at shutdown keeps the trace up to there.

Nothing here raises into the engine after start-up: a recording that cannot be written is a warning and
serving goes on. The written trace holds ``logits`` (the router's own logits, in the dtype it produced
them) or, with ``OEA_TRACE_CONTENT=topk``, the router's top-k ``ids`` and their probabilities
(``scores``), plus ``request_ids``, ``positions`` and ``step_ids``; its sidecar says which
(``recorded``) and why recording stopped (``stopped``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pathlib
import queue
import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from oea.config import TraceSettings
from oea.integrations.recording.trace_file import Column, TraceFileWriter
from oea.routing import RouterSpec, route, router_scores

QUEUE_STEPS = 1024  # most steps waiting for the writer before new ones are dropped ...
QUEUE_BYTES = 256 * 2**20  # ... and at most this much host memory of staged logits (a large model's steps)
CLOSE_TIMEOUT_S = 60.0
CHECKPOINT_S = 1.0  # longest time the file goes without describing its written steps
# The writer wakes at most this often (or once half its queue is full) and writes every step queued by then
# in one go: each wake-up and each write contend with the engine for the interpreter lock, so they are few.
BATCH_WAIT_S = 0.5


def trace_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be written (folder missing or read-only, a folder at the path), or None."""
    target = pathlib.Path(path)
    if target.is_dir():
        return f"{path} is a folder"
    if not target.parent.is_dir():
        return f"folder {str(target.parent)!r} does not exist"
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"{path} is not writable"
    return None


def rank_path(path: str, rank: int) -> str:
    """The file of one engine rank: ``path`` itself on rank 0, ``<stem>.rank<r>.safetensors`` on the others."""
    if rank == 0:
        return path
    target = pathlib.Path(path)
    return str(target.with_name(f"{target.stem}.rank{rank}{target.suffix}"))


class StepStaging:
    """The device buffers the routing calls of a recorded step copy their logits into, one per layer.

    Args:
        capacity: most rows kept per call (the engine's largest decode batch); rows beyond are not kept.
        num_experts: N.
        device: the model's device.
        num_layers: layers known up front (one [L, capacity, N] buffer); engines that meet their layers in
            the first forward add them with ``add_layer`` instead (outside graph capture).
    """

    def __init__(self, capacity: int, num_experts: int, device: torch.device | str, num_layers: int = 0) -> None:
        self.capacity, self.num_experts, self.device = capacity, num_experts, torch.device(device)
        self._whole = torch.zeros((num_layers, capacity, num_experts), device=device) if num_layers else None
        self.layers: list[torch.Tensor] = list(self._whole) if self._whole is not None else []
        self.biases: list[torch.Tensor | None] = [None] * num_layers  # per-layer correction bias (sigmoid routers)
        self.source_dtype = torch.float32  # the router's logits dtype, seen by the stage calls

    def add_layer(self, correction_bias: torch.Tensor | None = None) -> int:
        """A new recorded layer (its buffer allocated now, so never inside a graph capture); returns its index."""
        self.layers.append(torch.zeros((self.capacity, self.num_experts), device=self.device))
        self.biases.append(correction_bias)
        self._whole = None
        return len(self.layers) - 1

    def stage(self, layer: int, router_logits: torch.Tensor) -> None:
        """Copy [M, N] logits into layer ``layer``'s buffer (graph-safe: fixed addresses, no host sync)."""
        rows = int(router_logits.shape[0])
        if rows > self.capacity:
            router_logits, rows = router_logits[: self.capacity], self.capacity
        self.layers[layer][:rows].copy_(router_logits)
        self.source_dtype = router_logits.dtype

    def collect(self, rows: int) -> tuple[torch.Tensor, Any]:
        """The first ``rows`` rows of every layer on the host: ([L, rows, N] float32, a CUDA event or None).

        On CUDA the copy is asynchronous into pinned memory; the tensor is valid once the event completed.
        """
        source = self._whole[:, :rows] if self._whole is not None else torch.stack([b[:rows] for b in self.layers])
        if source.device.type != "cuda":
            return source.clone(), None
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        host.copy_(source, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def layer_bias(self) -> torch.Tensor | None:
        """[L, N] correction bias of the recorded layers, or None when they have none."""
        if not self.biases or any(b is None for b in self.biases):
            return None
        return torch.stack([b.detach().float().cpu() for b in self.biases])  # type: ignore[union-attr]


@dataclass
class _Step:
    step_id: int
    logits: torch.Tensor  # [L, M, N] float32 on the host
    requests: list[Any]
    positions: list[int]
    ready: Any  # CUDA event or None


class TraceRecorder:
    """Sampling, the bounded queue and the writer thread of one engine process's recording.

    Args:
        settings: ``OEA_TRACE_*`` (sampling share, size cap, content).
        path: the file this process writes (``rank_path`` of ``settings.path``).
        spec: the recorded layers' router (without correction bias: ``staging`` holds it per layer).
        staging: the device buffers the routing calls fill.
        meta: sidecar fields (``model``, ``source``, ``layer_names``, ``notes``, ...).
        log: where warnings go (the engine's log).

    The file is created by the first recorded step (when the layers are known); creating or writing it
    can only fail inside the writer thread, which then stops recording with one warning.
    """

    def __init__(self, settings: TraceSettings, path: str, spec: RouterSpec, staging: StepStaging,
                 meta: dict[str, Any], log: logging.Logger) -> None:
        self.settings, self.spec, self.staging, self.log = settings, spec, staging, log
        self.meta = dict(meta)
        self._path = path
        self._writer: TraceFileWriter | None = None  # created by the first step (the layers are known then)
        self._layers = 0
        self._dtype = torch.float32
        self._random = random.Random(0)
        self.queue_steps = 0  # the queue's bound, set by the first step (SGLang's layers are known only then)
        self._queue: queue.Queue[_Step | None] = queue.Queue()
        self._wake = threading.Event()  # half the queue is full: write now rather than at BATCH_WAIT_S
        self._request_numbers: dict[Any, int] = {}
        self._lock = threading.Lock()
        self.steps = self.dropped = 0
        self.queue_peak = 0  # most steps ever waiting for the writer (at most ``queue_steps``)
        self.writer_cpu_s = 0.0  # CPU time of the writer thread so far (the recording's cost off the engine)
        self.stopped: str | None = None  # why recording stopped (no step is sampled after it is set)
        self._halted = False  # the writer stopped early (size cap, write error): queued steps are not written
        self._warned: set[str] = set()
        self.finished: pathlib.Path | None = None
        self._finishing = False
        self._thread = threading.Thread(target=self._run, name="oea-trace", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        try:  # multiprocessing children (vLLM / SGLang workers) run these at exit, not atexit's
            from multiprocessing import util

            util.Finalize(self, self.close, exitpriority=10)
        except ImportError:  # pragma: no cover - part of the standard library
            pass

    def _open_writer(self, layers: int) -> TraceFileWriter:
        """The file, once the first step shows the layers and the router's dtype (kept: exact and compact)."""
        n, k = self.spec.num_experts, self.spec.top_k
        source = self.staging.source_dtype
        self._dtype = source if source in (torch.float16, torch.bfloat16) else torch.float32
        if self.settings.content == "topk":
            columns = [Column("scores", (layers, k), torch.float32),
                       Column("ids", (layers, k), torch.uint8 if n <= 256 else torch.int16)]
        else:
            columns = [Column("logits", (layers, n), self._dtype)]
        columns += [Column("request_ids", (), torch.int32), Column("positions", (), torch.int32),
                    Column("step_ids", (), torch.int32)]
        bias = self.staging.layer_bias()
        self._layers = layers
        return TraceFileWriter(self._path, columns, self.settings.max_bytes,
                               {} if bias is None else {"correction_bias": bias})

    # ----------------------------------------------------------------- the engine side (never blocks)

    def sample_step(self) -> bool:
        """Whether the next decode step is recorded (``OEA_TRACE_SAMPLE``; False once recording stopped)."""
        if self.stopped is not None:
            return False
        return self.settings.sample >= 1.0 or self._random.random() < self.settings.sample

    def submit_step(self, step_id: int, rows: int, requests: list[Any], positions: list[int]) -> None:
        """Hand the staged rows of step ``step_id`` to the writer: ``rows`` real rows (the first ones of each
        call), one request id and position each. Drops the step when the queue is full."""
        if self.stopped is not None or rows < 1:
            return
        if rows > self.staging.capacity or len(requests) != rows or len(positions) != rows:
            self._warn_once("rows", f"oea: a decode step of {rows} rows with {len(requests)} request ids does not fit "
                                    f"the recording (at most {self.staging.capacity} rows); such steps are skipped")
            return
        if not self.queue_steps:
            step_bytes = max(1, len(self.staging.layers)) * self.staging.capacity * self.staging.num_experts * 4
            self.queue_steps = max(2, min(QUEUE_STEPS, QUEUE_BYTES // step_bytes))
        waiting = self._queue.qsize()
        if waiting * 2 >= self.queue_steps:
            self._wake.set()
        if waiting < self.queue_steps:
            logits, ready = self.staging.collect(rows)
            self._queue.put_nowait(_Step(step_id, logits, list(requests), list(positions), ready))
            self.queue_peak = max(self.queue_peak, waiting + 1)
        else:
            self.dropped += 1
            self._warn_once("full", "oea: the trace writer falls behind the engine; steps are dropped (counted in "
                                    "the sidecar's steps_dropped) rather than slowing the step")

    def close(self) -> pathlib.Path | None:
        """Stop recording and finish the file (idempotent); returns the trace, or None when none was written."""
        with self._lock:
            if self.stopped is None:
                self.stopped = "the engine stopped"
        if self._thread.is_alive():
            self._queue.put(None)
            self._wake.set()
            self._thread.join(CLOSE_TIMEOUT_S)
        if self._finishing:
            return self.finished
        path, kept = self._finish()
        if path is None:
            self.log.warning("oea: recording to %s: %s", self._path, kept)
        else:
            self.log.info("oea: recording to %s finished: %s", self._path, kept)
        return path

    # ----------------------------------------------------------------- the writer thread

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.writer_cpu_s = time.thread_time()

    def _loop(self) -> None:
        last_checkpoint, checkpoint_every = time.monotonic(), CHECKPOINT_S
        while True:
            try:
                step = self._queue.get(timeout=CHECKPOINT_S)
            except queue.Empty:  # the engine is idle: describe what is written
                step = False
            if step is None:
                return
            if self._halted:
                continue
            steps = [step]
            if step is not False:
                self._wake.wait(BATCH_WAIT_S)
                self._wake.clear()
                steps += self._drain()
            ended = None in steps
            try:
                self._write([queued for queued in steps[: steps.index(None) if ended else len(steps)] if queued])
                if ended:
                    return
                self.writer_cpu_s = time.thread_time()
                if step is False or time.monotonic() - last_checkpoint >= checkpoint_every:
                    started = time.monotonic()
                    self._checkpoint()
                    last_checkpoint = time.monotonic()
                    # a long run's sidecar (every request's name) grows: checkpoint at most 1% of the time
                    checkpoint_every = max(CHECKPOINT_S, 100 * (last_checkpoint - started))
            except Exception as err:  # a full disk, a vanished folder: stop, keep what is written, serve on
                self._stop(f"writing failed ({type(err).__name__}: {err})", write_error=True)

    def _drain(self) -> list[_Step | None]:
        """Every step queued now (a ``None`` among them ends the writer after the steps before it)."""
        queued: list[_Step | None] = []
        with contextlib.suppress(queue.Empty):
            while True:
                queued.append(self._queue.get_nowait())
        return queued

    def _checkpoint(self) -> None:
        """The file as a loadable trace of the steps written so far (nothing to do when none is new)."""
        with self._lock:
            writer = self._writer
            if self._finishing or writer is None or writer.tokens == writer.checkpointed:
                return
            writer.checkpoint(self._sidecar_meta("interrupted: the process ended (or its disk filled up) before "
                                                 "finishing the file; the trace holds the steps up to its last "
                                                 "checkpoint"), self.spec)

    def _write(self, steps: list[_Step]) -> None:
        """Append the rows of ``steps`` (in order) to the file with one write per column; the steps past the
        size cap are not written and recording stops."""
        if not steps or self._halted:
            return
        for step in steps:
            if step.ready is not None:
                step.ready.synchronize()
        if self._writer is None:
            self._writer = self._open_writer(int(steps[0].logits.shape[0]))
        writer = self._writer
        if any(step.logits.shape[0] != self._layers for step in steps):
            self._warn_once("layers", f"oea: a step routed a number of recorded layers other than the trace's "
                                      f"{self._layers}; such steps are skipped")
            steps = [step for step in steps if step.logits.shape[0] == self._layers]
        fitting, rows = 0, 0
        while fitting < len(steps) and writer.fits(rows + len(steps[fitting].requests)):
            rows += len(steps[fitting].requests)
            fitting += 1
        if fitting:
            written = steps[:fitting]
            logits = torch.cat([step.logits for step in written], 1).transpose(0, 1)  # [rows, L, N]
            numbers = [self._request_numbers.setdefault(r, len(self._request_numbers))
                       for step in written for r in step.requests]
            data = {"request_ids": torch.tensor(numbers, dtype=torch.int32),
                    "positions": torch.tensor([p for step in written for p in step.positions], dtype=torch.int32),
                    "step_ids": torch.tensor([step.step_id for step in written for _ in step.requests],
                                             dtype=torch.int32)}
            if self.settings.content == "topk":
                data.update(self._top_k(logits))
            else:
                data["logits"] = logits.to(self._dtype).contiguous()
            writer.append(data)
            self.steps += fitting
        if fitting < len(steps):
            self._stop(f"the size cap OEA_TRACE_MAX_MB={self.settings.max_bytes / 2**20:g} was reached")

    def _top_k(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """[M, L, N] logits -> the router's own top-k ``ids`` and their probabilities ``scores`` ([M, L, k])."""
        ids, scores = [], []
        biases = self.staging.biases
        for layer in range(logits.shape[1]):
            bias = biases[layer] if layer < len(biases) else None
            spec = self.spec if bias is None else replace(self.spec, correction_bias=bias.detach().float().cpu())
            layer_ids, _ = route(logits[:, layer], spec)
            ids.append(layer_ids)
            scores.append(router_scores(logits[:, layer], spec).weight.gather(1, layer_ids))
        id_dtype = torch.uint8 if self.spec.num_experts <= 256 else torch.int16
        return {"ids": torch.stack(ids, 1).to(id_dtype).contiguous(), "scores": torch.stack(scores, 1).contiguous()}

    def _stop(self, why: str, write_error: bool = False) -> None:
        """Stop recording early (the size cap, a write error) and finish the file, with one warning saying
        why and what the file keeps. After a write error the file is finished in place (no space needed)."""
        with self._lock:
            if self._halted:
                return
            self._halted, self.stopped = True, why
        _, kept = self._finish(in_place=write_error)
        self.log.warning("oea: recording to %s stops: %s; %s; serving continues", self._path, why, kept)

    def _finish(self, in_place: bool = False) -> tuple[pathlib.Path | None, str]:
        """Finish the file once: (the trace or None, what became of it). ``in_place``: after a write error, the
        file as it stands (``TraceFileWriter.finish_in_place``), else compacted (``finish``)."""
        with self._lock:
            writer = self._writer
            if self._finishing:
                return self.finished, "the trace was already finished"
            self._finishing = True
            if writer is None or writer.tokens == 0:
                if writer is not None:
                    writer.discard()
                return None, "no decode step was recorded, no trace written"
            meta = self._sidecar_meta(self.stopped or "the engine stopped")
            try:
                self.finished = (writer.finish_in_place if in_place else writer.finish)(meta, self.spec)
            except Exception as err:  # e.g. the disk is full: never leave a file that describes half a write
                if in_place and writer.checkpointed and writer.sidecar.exists():
                    return None, (f"the trace could not be finished ({type(err).__name__}: {err}): it holds the "
                                  f"{writer.checkpointed} tokens of its last checkpoint")
                writer.discard()
                return None, f"the trace could not be finished ({type(err).__name__}: {err}) and was removed"
        return self.finished, f"the trace keeps the {self.steps} decode steps ({writer.tokens} tokens) written"

    def _sidecar_meta(self, stopped: str) -> dict[str, Any]:
        return {**self.meta, "steps_recorded": self.steps, "steps_dropped": self.dropped, "stopped": stopped,
                "writer_cpu_s": round(self.writer_cpu_s, 4),
                "queue_bound_steps": self.queue_steps, "queue_peak_steps": self.queue_peak,
                "sample": self.settings.sample, "request_names": [str(r) for r in self._request_numbers],
                "recorded": self._recorded()}

    def _recorded(self) -> str:
        if self.settings.content == "topk":
            return f"the router's top-{self.spec.top_k} ids and their probabilities (OEA_TRACE_CONTENT=topk)"
        return f"full router logits ({str(self._dtype).removeprefix('torch.')})"

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message)


def open_recorder(settings: TraceSettings, path: str, spec: RouterSpec, staging: StepStaging,
                  meta: dict[str, Any], log: logging.Logger) -> TraceRecorder | None:
    """A running ``TraceRecorder``, or None with one warning when the file cannot be written.

    An old trace's sidecar at ``path`` is removed at once, so it never describes the new file's tensors.
    """
    problem = trace_path_problem(path)
    if problem is None:
        try:
            pathlib.Path(path).with_suffix(".json").unlink(missing_ok=True)
            return TraceRecorder(settings, path, spec, staging, meta, log)
        except OSError as err:
            problem = f"{type(err).__name__}: {err}"
    log.warning("oea: OEA_TRACE_FILE=%s cannot be written (%s); serving without recording", path, problem)
    return None
