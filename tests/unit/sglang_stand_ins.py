"""Stand-ins for the SGLang names the SGLang plugin reads, so its logic runs in the main venv: the forward
modes, a ``TopKConfig``, the ``topk`` module, and the plugin's per-process state made fresh for a test."""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest

from oea.integrations import sglang as plugin
from oea.integrations.sglang.state import STATE, State

CLEARED_ENV = ("OEA_K0", "SGLANG_OEA_K0", "OEA_MIN_BATCH", "SGLANG_OEA_MIN_BATCH", "OEA_TRACE_FILE")


class FakeMode(enum.IntEnum):
    """SGLang's ``ForwardMode`` as the plugin reads it."""

    EXTEND = 1
    DECODE = 2
    TARGET_VERIFY = 3

    def is_decode(self) -> bool:
        return self == FakeMode.DECODE

    def is_target_verify(self) -> bool:
        return self == FakeMode.TARGET_VERIFY


def topk_config(**overrides: Any) -> SimpleNamespace:
    """SGLang's ``TopKConfig`` fields (a softmax top-8 router on the torch-native path), with ``overrides``."""
    fields = dict(top_k=8, use_grouped_topk=False, topk_group=None, num_expert_group=None, renormalize=True,
                  custom_routing_function=None, correction_bias=None, torch_native=True,
                  routed_scaling_factor=None, apply_routed_scaling_factor_on_output=False, output_format=None,
                  scoring_func="softmax", num_shared_topk_slots=0, allow_routed_experts_capture=True)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's one ``STATE`` fresh for this test (restored after), and no ``CLEARED_ENV`` variable set."""
    for field in dataclasses.fields(State):
        monkeypatch.setattr(STATE, field.name, getattr(State(), field.name))
    for name in CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)


def stand_in_module(monkeypatch: pytest.MonkeyPatch, name: str) -> types.ModuleType:
    """An empty module ``name`` in ``sys.modules`` for this test."""
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def topk_module(monkeypatch: pytest.MonkeyPatch, fused: Any = None) -> types.ModuleType:
    """SGLang's ``topk`` module with what the plugin reads at import: no aiter, and whether a config folds the
    routed scaling factor into the weights (``fused(cfg)``; default: its ``apply_routed_scaling_factor_on_output``).
    """
    module = stand_in_module(monkeypatch, plugin.TOPK_MODULE)
    module._use_aiter = False
    module.is_routed_scaling_factor_fused_in_topk = fused or (
        lambda cfg: bool(cfg.apply_routed_scaling_factor_on_output))
    return module
