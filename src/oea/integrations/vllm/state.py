"""Per-process state of the vLLM plugin: what ``register`` and ``Worker.load_model`` set up, and the
current step. One ``STATE`` per process, never replaced (tests swap its fields). What belongs to one router
(its config, kernel, buffers, trace slot, failed flag) is on the router: ``router_state.RouterState``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from oea.config import EnvSettings, TraceSettings
from oea.integrations.metrics import MetricsWriter, StepRecord
from oea.integrations.recording.recorder import TraceRecorder
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
    cpu_op_defined: bool = False  # oea::cpu_route defined in this process
    gpu_op_defined: bool = False  # oea::gpu_route defined in this process
    # the routers model load numbered (index = router id; each carries its router_state.RouterState) and their
    # specs as load read them (None: the layer keeps vLLM's routing)
    routers: list[Any] = field(default_factory=list)
    specs: list[RouterSpec | None] = field(default_factory=list)
    decode: bool = False  # Python copy of the flag, for eager code and the CPU op
    decode_flag: torch.Tensor | None = None  # persistent 0-dim bool on the model's device
    step: int = 0
    record: StepRecord | None = None
    metrics: MetricsWriter | None = None
    warned: set[str] = field(default_factory=set)
    # routing.step_rows: (step, rows, settings) -> (valid [M] bool or None, real rows), looked up once per step
    step_rows: tuple[tuple[int, int, int], tuple[torch.Tensor | None, int]] | None = None
    # routing.gathered_across_dp: ((step, rows), gathered) of the last call
    dp_gathered: tuple[tuple[int, int], bool] | None = None
    layers: LayerConfigs | None = None  # layers.py: every router's config per batch size (OEA_K0, OEA_LAYER_K0_FILE)
    # OEA_TRACE_FILE (recording.py): the recorder, this step recorded or not
    trace_settings: TraceSettings | None = None
    recorder: TraceRecorder | None = None
    trace_step: bool = False
    trace_scheduled: Any = None  # the recorded step's SchedulerOutput
    model_runner: Any = None  # the worker's model runner (its persistent batch orders the rows)
    # speculative.py: vLLM's speculative-decoding settings (None: off), and whether its layout could be read
    speculation: Any = None
    verify_readable: bool = True


STATE = State()
warn_once = WarnOnce(log, lambda: STATE.warned)  # a warning the first time its key is seen in this process
