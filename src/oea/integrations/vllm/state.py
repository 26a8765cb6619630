"""Per-process state of the vLLM plugin: what ``register`` and ``Worker.load_model`` set up, and the
current step. One ``STATE`` per process, never replaced (tests swap its fields)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from oea.config import EnvSettings, TraceSettings
from oea.integrations.recorder import TraceRecorder
from oea.integrations.vllm.metrics import MetricsWriter, StepRecord
from oea.routing import RouterSpec

log = logging.getLogger("vllm.oea")


@dataclass
class State:
    settings: EnvSettings | None = None
    mode: str = "off"  # off | observe | oea
    timing: bool = False
    installed: bool = False
    originals: dict[str, Any] = field(default_factory=dict)  # "Class" -> original _compute_routing
    routers: list[Any] = field(default_factory=list)  # index = router id
    specs: list[RouterSpec | None] = field(default_factory=list)
    decode: bool = False  # Python copy of the flag, for eager code and the CPU op
    decode_flag: torch.Tensor | None = None  # persistent 0-dim bool on the model's device
    step: int = 0
    record: StepRecord | None = None
    metrics: MetricsWriter | None = None
    warned: set[str] = field(default_factory=set)
    layer_policies: list[Any] | None = None  # OEA_LAYER_K0_FILE (layers.py): per router, OEAConfig / AdaptiveK0Config
    # OEA_TRACE_FILE (recording.py): the recorder, router id -> recorded layer, this step recorded or not
    trace_settings: TraceSettings | None = None
    recorder: TraceRecorder | None = None
    trace_slots: dict[int, int] = field(default_factory=dict)
    trace_step: bool = False
    trace_scheduled: Any = None  # the recorded step's SchedulerOutput
    model_runner: Any = None  # the worker's model runner (its persistent batch orders the rows)


STATE = State()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in STATE.warned:
        STATE.warned.add(key)
        log.warning(message)
