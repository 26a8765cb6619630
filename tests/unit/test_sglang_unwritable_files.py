"""An ``OEA_METRICS_FILE`` / ``OEA_TRACE_FILE`` the SGLang plugin cannot write is one warning per server, not one
per process: SGLang loads plugins (``register``, which configures both) in its HTTP, scheduler and detokenizer
processes, and only the processes that run forwards write rows, so the file is tested at a process's first
forward. Stand-ins: ``FakeMode`` for SGLang's ``ForwardMode``, a namespace for its ``ForwardBatch``."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang_stand_ins import FakeMode

import oea.integrations.sglang.metrics as metrics
import oea.integrations.sglang.recording as recording
from oea.config import TraceSettings, settings_from_env


def _batch() -> SimpleNamespace:
    lens = torch.tensor([5, 7])
    return SimpleNamespace(forward_mode=FakeMode.DECODE, batch_size=2, rids=["a", "b"], seq_lens=lens,
                           seq_lens_cpu=lens, input_ids=torch.zeros(2))


def _fresh(monkeypatch: pytest.MonkeyPatch, state: object) -> None:
    """This process's plugin ``state`` (``METRICS`` or ``TRACE``) as new for this test, restored after."""
    for field in dataclasses.fields(state):  # type: ignore[arg-type]
        monkeypatch.setattr(state, field.name, getattr(type(state)(), field.name))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_unwritable_metrics_file_is_one_warning_at_the_first_forward(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _fresh(monkeypatch, metrics.METRICS)
    missing = str(tmp_path / "missing" / "m.jsonl")
    caplog.set_level(logging.INFO, logger="oea.integrations.sglang")
    metrics.configure(settings_from_env({"OEA_METRICS_FILE": missing}), timing=False)
    assert _warnings(caplog) == [], "a process that never runs a forward (HTTP, detokenizer) says nothing"
    for _ in range(3):
        with metrics.forward(_batch(), FakeMode.DECODE):
            pass
    said = _warnings(caplog)
    assert len(said) == 1 and "OEA_METRICS_FILE" in said[0] and "serving without metrics" in said[0], said
    assert metrics.METRICS.path is None and metrics.METRICS.writer is None


def test_a_writable_metrics_file_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    _fresh(monkeypatch, metrics.METRICS)
    path = str(tmp_path / "m.jsonl")
    metrics.configure(settings_from_env({"OEA_METRICS_FILE": path}), timing=False)
    with metrics.forward(_batch(), FakeMode.DECODE):
        pass
    assert metrics.METRICS.path == path and _warnings(caplog) == []
    assert metrics.METRICS.writer is not None


def test_an_unwritable_trace_is_one_warning_at_the_first_recorded_forward(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _fresh(monkeypatch, recording.TRACE)
    recording.configure(TraceSettings(str(tmp_path / "missing" / "t.safetensors")))
    assert _warnings(caplog) == [] and recording.TRACE.settings is not None
    with recording.forward(_batch(), FakeMode.EXTEND):  # not recorded: the file is not needed yet
        pass
    assert _warnings(caplog) == []
    for _ in range(3):
        with recording.forward(_batch(), FakeMode.DECODE):
            pass
    said = _warnings(caplog)
    assert len(said) == 1 and "OEA_TRACE_FILE" in said[0] and "serving without recording" in said[0], said
    assert recording.TRACE.settings is None
