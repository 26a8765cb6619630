"""Padding rows of graph-replayed decode batches, kept out of the OEA union.

SGLang replays the decode graph captured for the next larger batch size; the rows past the real batch
("padding rows") hold stale inputs and route to real experts. SGLang counts the real rows on the device
(``num_token_non_padded``) only with EP > 1, DP-attention gathering or a custom all-to-all, so at plain TP
the captured routing cannot tell padding rows from real ones. The plugin keeps its own count:

* ``count`` tensors: one persistent int32 scalar per device, allocated outside any capture;
* ``replay_around`` (AROUND the graph runner's replay preparation, ``REPLAY_TARGETS``) writes the runner's
  own real row count (``raw_num_token``, or the rows of the batch ``CPUGraphRunner.prepare_replay`` was
  given) into it on the host side before the graph runs; ``batch_rows`` (entered by the forward-mode hooks)
  writes the row count of each eager decode forward. A write happens only when the value changes: at most
  one small host-to-device copy per decode step, never one per layer;
* ``bound`` is what the rewrite uses as ``num_token_non_padded``: SGLang's own count when SGLang passes one;
  else, while routing is captured or compiled, the persistent tensor (every replay reads its own batch's
  count); in an eager forward of a padded batch, the same tensor; ``None`` (every row joins the union, the
  behaviour without a replay hook) when the forward's rows are not the routing's rows (gathered or sharded
  MoE input, a nested half-batch) or when no replay hook is installed.

Frames: each forward-mode hook pushes a ``RowsFrame`` (rows of its batch, real rows when known) on the
per-thread stack ``PHASE.rows``; a nested context with the same batch reuses the outer frame.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import oea.integrations.sglang.targets as targets
from oea.integrations.runtime import tracing  # compiled or captured: only device tensors carry per-step values
from oea.integrations.sglang.state import PHASE, STATE, log, mode_rerouted, warn_once

MODEL_EXECUTOR = "sglang.srt.model_executor"
# The CUDA-graph replay hook point, newest first: 0.5.14+ and 0.5.12-0.5.13.
DECODE_REPLAY_TARGET = f"{MODEL_EXECUTOR}.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.load_batch"
LEGACY_REPLAY_TARGET = f"{MODEL_EXECUTOR}.cuda_graph_runner.CudaGraphRunner.replay_prepare"
CPU_REPLAY_TARGET = f"{MODEL_EXECUTOR}.cpu_graph_runner.CPUGraphRunner.prepare_replay"
REPLAY_PARAMETERS = ("self", "forward_batch")
WORKAROUND = ("launch with --disable-cuda-graph-padding, or capture every decode batch size "
              "(--cuda-graph-bs-decode 1 2 ... N; --cuda-graph-bs before 0.5.14)")
MECHANISMS = {"sglang": "SGLang's num_token_non_padded", "oea": "OEA's replay count", "none": "none"}


@dataclass(frozen=True)
class RowsFrame:
    """The batch of one forward context: its rows, and its real rows when known (None: unknown)."""

    batch_id: int
    rows: int
    real: int | None
    own: bool = True  # False: a nested batch (e.g. a two-batch-overlap half) the count does not describe


# --------------------------------------------------------------------------- hook points


def _module_file_exists(module: str) -> bool:
    """Whether SGLang ships ``module`` (a ``sglang.srt.model_executor`` submodule), without importing it."""
    return targets.module_available(module)


def _target_module(target: str) -> str:
    return target.rsplit(".", 2)[0]  # module.Class.method


def replay_targets() -> dict[str, str | None]:
    """``{"cuda": target or None, "cpu": target or None}``: the replay preparation this SGLang has."""
    cuda = next((t for t in (DECODE_REPLAY_TARGET, LEGACY_REPLAY_TARGET) if _module_file_exists(_target_module(t))),
                None)
    cpu = CPU_REPLAY_TARGET if _module_file_exists(_target_module(CPU_REPLAY_TARGET)) else None
    return {"cuda": cuda, "cpu": cpu}


def replay_plan() -> list[tuple[str, Callable[..., Any], str]]:
    """(target, hook, "AROUND") for each replay hook point this SGLang has."""
    return [(target, replay_around, "AROUND") for target in replay_targets().values() if target is not None]


def missing_hook_message(target: str | None) -> str:
    """One line: the replay hook point is missing, what that costs, and the workaround."""
    what = target or f"each of {DECODE_REPLAY_TARGET} and {LEGACY_REPLAY_TARGET}"
    return (f"no CUDA-graph replay hook point ({what} is missing in sglang {targets.engine_version()}): padding "
            "rows of graph-replayed decode batches join the OEA union at plain TP (SGLang's own "
            "num_token_non_padded still bounds them with EP > 1, DP-attention gathering or a custom all-to-all); "
            f"workaround: {WORKAROUND}")


def check_replay_hooks(target_hooked: Callable[[str], bool]) -> dict[str, bool]:
    """Record which replay hook points are installed (read by ``bound``); warn once when the CUDA one is not.

    ``target_hooked`` is ``hooks.target_hooked``. Called at the first forward of the process, outside any capture.
    """
    planned = replay_targets()
    hooked = {kind: target is not None and target_hooked(target) for kind, target in planned.items()}
    STATE.padding_hooked = hooked
    if not hooked["cuda"]:
        warn_once("padding-hook", missing_hook_message(planned["cuda"]))
    return hooked


# --------------------------------------------------------------------------- the count


def _device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def fill(device: torch.device | str, rows: int) -> None:
    """Write ``rows`` into the device's count (allocated here on first use); skipped when unchanged or when
    called inside a capture (a write there would be recorded into the graph)."""
    if tracing():
        return
    key = _device_key(device)
    count = STATE.padding_counts.get(key)
    if count is None:
        count = torch.zeros((), dtype=torch.int32, device=device)
        STATE.padding_counts[key] = count
        STATE.padding_values[key] = 0
    if STATE.padding_values.get(key) == rows:
        return
    count.fill_(rows)
    STATE.padding_values[key] = rows
    STATE.padding_fills += 1


def count_for(device: torch.device | str) -> torch.Tensor | None:
    """The persistent count of ``device`` (0-dim int32), or None before its first fill."""
    return STATE.padding_counts.get(_device_key(device))


def replay_around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND a graph runner's replay preparation: after it, write the runner's real row count.

    ``DecodeCudaGraphRunner.load_batch`` / ``CudaGraphRunner.replay_prepare`` leave it in
    ``self.raw_num_token`` (also on the pre-planned path, where an earlier call set it);
    ``CPUGraphRunner.prepare_replay`` returns the batch the graph runs, whose real rows are those of the
    batch it was given. Never raises into SGLang: a failure is logged once and the count left as it was.
    """
    result = original(*args, **kwargs)
    try:
        _after_replay_prepare(result, args, kwargs)
    except Exception:  # never take the server down from the replay path
        if "error:padding" not in STATE.warned:
            STATE.warned.add("error:padding")
            log.exception("oea: could not record the real rows of a graph replay; padding rows may join the union")
    return result


def _after_replay_prepare(result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    runner = args[0] if args else None
    batch = kwargs.get("forward_batch", args[1] if len(args) > 1 else None)
    if runner is None or not mode_rerouted(getattr(runner, "capture_forward_mode", None)):
        return  # graphs OEA does not reroute (e.g. verify without OEA_APPLY_TO_VERIFY) never read the count
    if _rows_of(result) is not None:  # CPUGraphRunner: the (possibly padded) batch the graph will run
        real = _rows_of(batch)
        STATE.padding_replay = None if real is None else (result, real)
    else:
        real = getattr(runner, "raw_num_token", None)
    device = _device_of(batch) or _device_of(result)
    if real is None or device is None:
        warn_once("padding-rows-unknown", f"{type(runner).__name__}: real row count or device not found after "
                                          f"replay preparation; padding rows may join the union ({WORKAROUND})")
        return
    fill(device, int(real))


# --------------------------------------------------------------------------- frames


def _rows_of(batch: Any) -> int | None:
    ids = getattr(batch, "input_ids", None)
    return int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.dim() >= 1 else None


def _device_of(batch: Any) -> torch.device | None:
    ids = getattr(batch, "input_ids", None)
    return ids.device if isinstance(ids, torch.Tensor) else None


def current_frame() -> RowsFrame | None:
    """The innermost batch frame of this thread, or None outside any forward with a batch."""
    for frame in reversed(PHASE.rows):
        if frame is not None:
            return frame
    return None


def _frame_for(batch_id: int, rows: int | None, device: torch.device | str | None, mode: Any,
               replay_batch: Any = None) -> RowsFrame | None:
    if rows is None:
        return RowsFrame(batch_id, -1, None, own=False)
    replay = STATE.padding_replay
    if replay is not None and replay_batch is not None and replay[0] is replay_batch:
        return RowsFrame(batch_id, rows, replay[1])  # a graph runner's prepared (possibly padded) batch
    outer = current_frame()
    if outer is not None:
        return outer if outer.batch_id == batch_id else RowsFrame(batch_id, rows, None, own=False)
    if mode_rerouted(mode) and not tracing() and device is not None:
        fill(device, rows)  # an eager decode forward: every row is real
        return RowsFrame(batch_id, rows, rows)
    return RowsFrame(batch_id, rows, None)


@contextlib.contextmanager
def _pushed(frame: RowsFrame | None) -> Iterator[None]:
    PHASE.rows.append(frame)
    try:
        yield
    finally:
        PHASE.rows.pop()


def batch_rows(forward_batch: Any, mode: Any) -> contextlib.AbstractContextManager[None]:
    """Push the frame of ``forward_batch`` (``None``: inherit) for the duration of a forward context."""
    if forward_batch is None:
        return _pushed(None)
    return _pushed(_frame_for(id(forward_batch), _rows_of(forward_batch), _device_of(forward_batch), mode,
                              forward_batch))


def capture_rows(runner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """Frame of a graph capture: ``capture_one_batch_size(self, bs, forward)`` (0.5.12-0.5.13, CPU runner) or
    ``DecodeCudaGraphRunner.capture_one_shape(self, size, forward)`` (0.5.14-0.5.22); ``args``/``kwargs`` after
    ``self``: ``bs`` times the runner's tokens per request."""
    bs = kwargs.get("bs", kwargs.get("size", args[0] if args else None))
    width = getattr(runner, "num_tokens_per_bs", None) or getattr(runner, "captured_req_width", None) or 1
    device = getattr(runner, "device", None)
    if not isinstance(bs, int) or device is None:
        return _pushed(None)
    return _pushed(_frame_for(id(runner), bs * int(width), device, getattr(runner, "capture_forward_mode", None)))


# --------------------------------------------------------------------------- the rewrite's bound


def _note(mechanism: str) -> None:
    if mechanism not in STATE.padding_mechanisms and not torch.compiler.is_compiling():
        STATE.padding_mechanisms.add(mechanism)
        log.info("oea: padding rows of decode batches bounded by %s", MECHANISMS[mechanism])


def bound(router_logits: torch.Tensor, sglang_bound: torch.Tensor | int | None) -> torch.Tensor | int | None:
    """The ``num_token_non_padded`` the rewrite uses for this routing call ([M, E] ``router_logits``).

    SGLang's own count when given; else the persistent count (0-dim int32 on the logits' device) when the
    routing is captured/compiled, or runs eagerly on a graph runner's padded batch; else None.
    """
    if sglang_bound is not None:
        _note("sglang")
        return sglang_bound
    frame = current_frame()
    rows = router_logits.shape[0]
    if tracing():
        kind = "cpu" if router_logits.device.type == "cpu" else "cuda"
        count = count_for(router_logits.device)
        hooked = bool(STATE.padding_hooked and STATE.padding_hooked.get(kind))
        if frame is None or not frame.own or frame.rows != rows or count is None or not hooked:
            _note("none")
            return None
        _note("oea")
        return count
    if frame is None or not frame.own or frame.rows != rows or frame.real is None or frame.real >= rows:
        return None  # every row real, or rows the count does not describe
    _note("oea")
    count = count_for(router_logits.device)
    return count if count is not None else frame.real
