"""Decode detection: one decision per engine step, from vLLM's ``SchedulerOutput``, made by the
``WorkerWrapperBase.execute_model`` hook before the forward pass and read by every routing call.

A speculative verify step (each request runs 1 + d tokens, ``speculative.py``) counts as a decode step only
with ``OEA_APPLY_TO_VERIFY=1`` and only while the plugin can read vLLM's draft tokens."""

from __future__ import annotations

from typing import Any

import oea.integrations.vllm.recording as recording
from oea.integrations.metrics import StepRecord
from oea.integrations.vllm.speculative import UNREADABLE, StepShape, step_shape
from oea.integrations.vllm.state import STATE, warn_once


def reroutable(shape: StepShape, apply_to_verify: bool) -> bool:
    """Whether OEA may rewrite a step of this shape: a decode-shaped step (every request runs one new token
    plus its drafts) without drafts, or with drafts when ``apply_to_verify``."""
    return shape.decode_shaped and (apply_to_verify or not shape.carries_drafts)


def is_decode_step(scheduler_output: Any, apply_to_verify: bool = False) -> bool:
    """True iff every scheduled request runs exactly one new token (plus its speculative tokens,
    counted only when ``apply_to_verify``): vLLM's own uniform-decode test on ``SchedulerOutput``.
    Draft tokens the plugin cannot read count as none (such a verify step is not a decode step)."""
    if getattr(scheduler_output, "total_num_scheduled_tokens", 0) <= 0:
        return False
    shape, problem = step_shape(scheduler_output)
    return reroutable(shape, apply_to_verify and not problem)


def unreadable_speculation(problem: str) -> None:
    """vLLM's speculative decoding is not in the layout the plugin reads: one warning; from then on every
    step with draft tokens keeps vLLM's routing."""
    STATE.verify_readable = False
    warn_once("speculation-layout", f"cannot read vLLM's speculative decoding ({problem}); {UNREADABLE}")


def begin_step(scheduler_output: Any) -> None:
    """Before a step: set the decode flag (Python and device copies), count the step, open its metrics record."""
    shape, problem = step_shape(scheduler_output, speculating=STATE.speculation is not None)
    if problem:
        unreadable_speculation(problem)
    apply_to_verify = STATE.verify_readable and STATE.settings is not None and STATE.settings.apply_to_verify
    decode = getattr(scheduler_output, "total_num_scheduled_tokens", 0) > 0 and reroutable(shape, apply_to_verify)
    STATE.decode = decode
    if STATE.decode_flag is not None:
        STATE.decode_flag.fill_(decode)
    STATE.step += 1
    recording.begin(scheduler_output, decode)  # OEA_TRACE_FILE: record this step or not
    if STATE.metrics is not None:
        STATE.record = StepRecord(decode=decode, oea=STATE.mode == "oea",  # oea: cleared by any stock layer
                                  outside_rows=STATE.metrics.outside_rows, verify=shape.verify,
                                  tokens_per_request=list(shape.tokens))
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
