"""Per-process state of the vLLM plugin: what ``register`` and ``Worker.load_model`` set up, and the
current step. One ``STATE`` per process, never replaced (tests swap its fields)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from oea.config import EnvSettings, TraceSettings
from oea.integrations.metrics import MetricsWriter, StepRecord
from oea.integrations.recorder import TraceRecorder
from oea.integrations.runtime import WarnOnce
from oea.routing import LayerConfigs, RouterSpec

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
    layers: LayerConfigs | None = None  # layers.py: every router's config per batch size (OEA_K0, OEA_LAYER_K0_FILE)
    layer_index: dict[int, int | None] = field(default_factory=dict)  # router id -> entry of OEA_LAYER_K0_FILE
    failed_routers: set[int] = field(default_factory=set)  # layers whose OEA routing raised: stock from then on
    # OEA_TRACE_FILE (recording.py): the recorder, router id -> recorded layer, this step recorded or not
    trace_settings: TraceSettings | None = None
    recorder: TraceRecorder | None = None
    trace_slots: dict[int, int] = field(default_factory=dict)
    trace_step: bool = False
    trace_scheduled: Any = None  # the recorded step's SchedulerOutput
    model_runner: Any = None  # the worker's model runner (its persistent batch orders the rows)
    # speculative.py: vLLM's speculative-decoding settings (None: off), and whether its layout could be read
    speculation: Any = None
    verify_readable: bool = True


STATE = State()
warn_once = WarnOnce(log, lambda: STATE.warned)  # a warning the first time its key is seen in this process
