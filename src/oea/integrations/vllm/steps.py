"""Decode detection: one decision per engine step, from vLLM's ``SchedulerOutput``, made by the
``WorkerWrapperBase.execute_model`` hook before the forward pass and read by every routing call."""

from __future__ import annotations

from typing import Any

import oea.integrations.vllm.recording as recording
from oea.integrations.vllm.metrics import StepRecord
from oea.integrations.vllm.state import STATE


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


def begin_step(scheduler_output: Any) -> None:
    """Before a step: set the decode flag (Python and device copies), count the step, open its metrics record."""
    apply_to_verify = bool(STATE.settings.apply_to_verify) if STATE.settings is not None else False
    decode = is_decode_step(scheduler_output, apply_to_verify)
    STATE.decode = decode
    if STATE.decode_flag is not None:
        STATE.decode_flag.fill_(decode)
    STATE.step += 1
    recording.begin(scheduler_output, decode)  # OEA_TRACE_FILE: record this step or not
    if STATE.metrics is not None:
        STATE.record = StepRecord(decode=decode, oea=STATE.mode == "oea",  # oea: cleared by any stock layer
                                  outside_rows=STATE.metrics.outside_rows)
        STATE.metrics.outside_rows = 0


def end_step() -> None:
    """After a step: hand its metrics record (if any layer routed) to the writer, and clear the decode flag,
    so that forwards outside ``execute_model`` (a DP rank's dummy batches, warm-up) keep vLLM's routing."""
    STATE.decode = False
    if STATE.decode_flag is not None:
        STATE.decode_flag.fill_(False)
    record, STATE.record = STATE.record, None
    if record is not None and STATE.metrics is not None and record.active:
        STATE.metrics.add(STATE.step, record)
    recording.finish()  # a recorded step's rows to the trace writer (off the forward path)
