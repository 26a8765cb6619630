"""Recording decode forwards to an ``oea-trace`` while SGLang serves (``OEA_TRACE_FILE``): the thin SGLang
side of ``oea.integrations.recording.recorder``.

* ``configure`` (``register``/``install``): the settings, and a warning at start-up (recording off) when
  the file cannot be written;
* ``forward`` (entered by the phase hooks around each forward): a DECODE forward gets a step number and is
  recorded or not (``OEA_TRACE_SAMPLE``); after it, its real rows (``forward_batch.batch_size``) go to the
  recorder with the batch's request ids (``rids``) and positions (``seq_lens_cpu - 1``);
* ``stage`` (``routing.post_process_before``, every routing call of a DECODE forward): the call's router
  logits into the staging buffer, before OEA touches the routing, so the trace holds the router's own
  logits whether OEA is on or off. A layer is added the first time it routes outside a graph capture (the
  recorder and its file start with the first one); while a CUDA graph is captured the copy is captured
  too, so every replay fills the buffer and a sampled step finds its rows there. Each layer's slot in the
  recording is kept on its ``router_state.RouterState`` (``trace_slot``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from oea.config import TraceSettings
from oea.integrations.recording.common import recording_meta, writable_settings
from oea.integrations.recording.recorder import StepStaging, TraceRecorder, open_recorder, rank_path
from oea.integrations.runtime import graph_capturing, process_rank
from oea.integrations.sglang.router_state import UNDECIDED, RouterState
from oea.integrations.sglang.state import STATE, decode_or_verify, log, warn_once
from oea.routing import RouterSpec
from oea.trace_schema import routes_alike

DEFAULT_CAPACITY = 512  # rows per decode step kept when SGLang does not say its largest batch


@dataclass
class _Trace:
    settings: TraceSettings | None = None
    recorder: TraceRecorder | None = None
    spec: RouterSpec | None = None  # the recorded layers' routing (without correction bias)
    step: int = 0  # decode forwards seen
    active: bool = False  # this forward is recorded
    depth: int = 0  # forward contexts entered (only the outermost one is a step)
    verify: bool = False  # OEA_APPLY_TO_VERIFY: verify forwards are recorded too
    checked: bool = False  # whether this process tested that it can write the trace (at its first forward)


TRACE = _Trace()  # one per process, never replaced


def configure(settings: TraceSettings | None, apply_to_verify: bool = False) -> None:
    """Start-up: keep ``settings`` (whether the file can be written is tested at this process's first recorded
    forward: one warning and no recording if not; SGLang's HTTP and detokenizer processes load the plugin too
    and never record); ``apply_to_verify`` (``OEA_APPLY_TO_VERIFY``) records speculative verify forwards too."""
    TRACE.settings, TRACE.verify, TRACE.checked = settings, apply_to_verify, False


def _writable() -> bool:
    """Whether this process can write its trace (tested once, ``writable_settings``: one warning if not)."""
    if not TRACE.checked:
        TRACE.checked = True
        TRACE.settings = writable_settings(TRACE.settings, log)
    return TRACE.settings is not None


@contextlib.contextmanager
def forward(forward_batch: Any, mode: Any) -> Iterator[None]:
    """Around one forward: decide whether it is recorded; afterwards hand its rows to the recorder. A
    forward context entered inside another (SGLang nests them around graph capture) is the same step."""
    if TRACE.settings is None or not _recorded_mode(mode) or TRACE.depth or not _writable():
        TRACE.depth += 1
        try:
            yield
        finally:
            TRACE.depth -= 1
        return
    TRACE.step += 1
    TRACE.active = TRACE.recorder is None or TRACE.recorder.sample_step()
    TRACE.depth += 1
    try:
        yield
    finally:
        TRACE.depth -= 1
        recorded, TRACE.active = TRACE.active, False
        if recorded and TRACE.recorder is not None and not graph_capturing():
            _submit(forward_batch)


def _recorded_mode(mode: Any) -> bool:
    """The forwards the rewrite reroutes (``state.decode_or_verify``, with the verify setting given at start-up)."""
    return decode_or_verify(mode, TRACE.verify)


def stage(state: RouterState, router_logits: torch.Tensor, spec: RouterSpec | str) -> None:
    """One routing call of a DECODE forward in ``state``'s layer (``spec``: the layer's router, or why it passes
    through); the layer's recorded slot is kept on its state."""
    if TRACE.settings is None:
        return
    capturing = graph_capturing()
    slot = state.trace_slot
    if slot == UNDECIDED:
        layer_id = state.layer_id
        if capturing:
            warn_once("trace-capture", f"layer {layer_id} first routed inside a CUDA-graph capture; not recorded")
            return
        slot = state.trace_slot = _add_layer(layer_id, router_logits, spec)
    if slot is not None and (TRACE.active or capturing) and TRACE.recorder is not None:
        TRACE.recorder.staging.stage(slot, router_logits)


def _add_layer(layer_id: Any, router_logits: torch.Tensor, spec: RouterSpec | str) -> int | None:
    """The recorded layer for ``layer_id``, or None (left out: unsupported, or routed unlike the first)."""
    if isinstance(spec, str):
        warn_once(f"trace-skip:{spec}", f"layer {layer_id} is not recorded: {spec}")
        return None
    plain = replace(spec, correction_bias=None)
    if TRACE.recorder is None:
        settings = TRACE.settings
        assert settings is not None
        path = rank_path(settings.path, process_rank())
        staging = StepStaging(_capacity(), spec.num_experts, router_logits.device)
        TRACE.recorder = open_recorder(settings, path, plain, staging, _meta(path, settings), log)
        if TRACE.recorder is None:
            TRACE.settings = None
            return None
        TRACE.spec = plain
        log.info("oea: recording %s of decode forwards to %s", f"{settings.sample:.0%}", path)
    assert TRACE.spec is not None
    if not routes_alike(plain, TRACE.spec):
        warn_once("trace-mixed", f"layer {layer_id} routes unlike the first recorded layer; not recorded")
        return None
    slot = TRACE.recorder.staging.add_layer(spec.correction_bias)
    TRACE.recorder.meta.setdefault("layer_ids", []).append(layer_id)
    return slot


def _submit(forward_batch: Any) -> None:
    """The forward's real rows, request ids and positions to the recorder (never raises into SGLang)."""
    recorder = TRACE.recorder
    assert recorder is not None
    try:
        rids = getattr(forward_batch, "rids", None)
        if not rids:  # a capture or warm-up batch
            return
        rows = int(forward_batch.batch_size)
        seq_lens = forward_batch.seq_lens_cpu
        positions = [int(n) - 1 for n in (seq_lens if seq_lens is not None else forward_batch.seq_lens.cpu())]
        if len(rids) != rows or len(positions) != rows:
            raise ValueError(f"{rows} rows, {len(rids)} request ids, {len(positions)} sequence lengths")
        recorder.submit_step(TRACE.step, rows, list(rids), positions)
    except Exception as err:
        warn_once("trace-rows", f"cannot read a decode batch's requests ({type(err).__name__}: {err}); "
                                "such forwards are not recorded")


def _meta(path: str, settings: TraceSettings) -> dict[str, Any]:
    from oea.integrations.sglang.targets import engine_version

    oea = STATE.settings.oea if STATE.settings is not None else None  # what register read (every OEA_* once)
    return recording_meta(path, f"an SGLang {engine_version()} server", _model_path(), oea,
                          settings, [
        "DECODE forwards only (prefill/extend is never recorded); rows are the batch's real rows",
        "positions: each token's position in its sequence (seq_lens - 1); step_ids: this process's count of "
        "decode forwards; oea simulate --mode lockstep replays each recorded forward as SGLang batched it",
    ])


def _capacity() -> int:
    """SGLang's largest running batch (``max_running_requests``) when it says, else ``DEFAULT_CAPACITY``."""
    try:
        from sglang.srt.runtime_context import get_schedule

        value = getattr(get_schedule(), "max_running_requests", None)
        return int(value) if value else DEFAULT_CAPACITY
    except Exception:  # older SGLang, or no published schedule (tests): the default, steps above it skipped
        return DEFAULT_CAPACITY


def _model_path() -> str:
    try:
        from sglang.srt.runtime_context import get_server_args

        return str(get_server_args().model_path)
    except Exception:
        return "unknown"


