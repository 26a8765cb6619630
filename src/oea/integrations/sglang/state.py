"""Per-process state of the SGLang plugin, and the forward mode of the running forward pass.

The phase hooks (``hooks.py``) push each forward's ``ForwardMode`` on a per-thread stack; the rewrite
(``routing.py``) reads it through ``decode_active``. A decode CUDA graph captured under the stack bakes
OEA in, prefill/extend graphs bake it out. Beside each mode they push the batch's row frame
(``padding.py``), and ``State`` holds the per-device count of real rows that captured routing reads, and
each MoE layer's ``router_state.RouterState`` (``routers``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from oea.config import EnvSettings
from oea.integrations.runtime import WarnOnce
from oea.routing import LayerConfigs

log = logging.getLogger("oea.integrations.sglang")


class _PhaseStack(threading.local):
    def __init__(self) -> None:
        self.modes: list[Any] = []  # ForwardMode per entered forward; None = inherit the outer one
        self.rows: list[Any] = []  # padding.RowsFrame per entered forward; None = inherit the outer one
        self.dynamic_bias = False


PHASE = _PhaseStack()


@dataclass
class State:
    settings: EnvSettings | None = None
    installed_targets: tuple[str, ...] = ()
    phase_hook_seen: bool = False
    rewrite_hook_seen: bool = False
    rewrites: int = 0
    layers: LayerConfigs | None = None  # every layer's config per batch size (OEA_K0, OEA_LAYER_K0_FILE)
    # layer_id -> the layer's router_state.RouterState: the one place per-layer facts live
    routers: dict[Any, Any] = dataclasses.field(default_factory=dict)
    warned: set[str] = dataclasses.field(default_factory=set)
    # padding.py: device -> persistent 0-dim int32 count of real rows (and its last written value)
    padding_counts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    padding_values: dict[str, int] = dataclasses.field(default_factory=dict)
    padding_fills: int = 0  # writes of a count (host-to-device copies), all devices
    padding_replay: tuple[Any, int] | None = None  # (batch a CPU graph runner prepared, its real rows)
    padding_hooked: dict[str, bool] | None = None  # {"cuda", "cpu"}: replay hook installed (first forward)
    padding_mechanisms: set[str] = dataclasses.field(default_factory=set)  # "sglang" / "oea" / "none" seen


STATE = State()  # one per process, never replaced (tests swap its fields)
warn_once = WarnOnce(log, lambda: STATE.warned)  # a warning the first time its key is seen in this process


def current_forward_mode() -> Any:
    """The innermost known ``ForwardMode`` of this thread, or ``None`` outside any forward."""
    for mode in reversed(PHASE.modes):
        if mode is not None:
            return mode
    return None


def decode_active() -> bool:
    """True when this thread is inside a DECODE forward (or TARGET_VERIFY with OEA_APPLY_TO_VERIFY=1)."""
    return mode_rerouted(current_forward_mode())


def mode_rerouted(mode: Any) -> bool:
    """Whether OEA reroutes forwards in ``mode`` under this process's settings (``decode_or_verify``)."""
    settings = STATE.settings
    return decode_or_verify(mode, bool(settings and settings.apply_to_verify))


def decode_or_verify(mode: Any, apply_to_verify: bool) -> bool:
    """Whether ``mode`` (a ``ForwardMode``, None outside a forward) is DECODE, or TARGET_VERIFY with
    ``apply_to_verify`` (OEA_APPLY_TO_VERIFY=1): the forwards OEA rewrites and the recorder records."""
    if mode is None:
        return False
    return _call_predicate(mode, "is_decode") or (apply_to_verify and _call_predicate(mode, "is_target_verify"))


def _call_predicate(mode: Any, name: str) -> bool:
    predicate = getattr(mode, name, None)
    return bool(predicate()) if callable(predicate) else False


@contextlib.contextmanager
def forward_mode(mode: Any) -> Iterator[None]:
    """Push ``mode`` (a ``ForwardMode``; ``None`` inherits) for the duration of the block."""
    PHASE.modes.append(mode)
    try:
        yield
    finally:
        PHASE.modes.pop()
