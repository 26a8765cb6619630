"""``oea.integrations.runtime``: what every adapter shares at run time (warn-once, capture detection, the
process rank, method wrapping), and the metrics writer every engine writes its rows with."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from oea.integrations.metrics import MetricsWriter, StepRecord
from oea.integrations.runtime import WRAPPED, WarnOnce, call_after, graph_capturing, process_rank, tracing, wrap_method


def test_warn_once_warns_once_per_key_into_the_given_set(caplog: pytest.LogCaptureFixture) -> None:
    seen: set[str] = set()
    warn = WarnOnce(logging.getLogger("oea.test"), lambda: seen)
    with caplog.at_level(logging.WARNING, logger="oea.test"):
        assert warn("a", "first") and not warn("a", "again") and warn("b", "other")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            assert warn.exception("c", "failed") and not warn.exception("c", "failed")
    assert [r.getMessage() for r in caplog.records] == ["oea: first", "oea: other", "oea: failed"]
    assert caplog.records[-1].exc_info is not None and seen == {"a", "b", "c"}


def test_capture_detection_is_false_on_the_cpu_and_never_initialises_cuda() -> None:
    initialised = torch.cuda.is_initialized()
    assert graph_capturing() is False and tracing() is False
    assert torch.cuda.is_initialized() == initialised
    assert process_rank() == 0


def test_wrap_method_wraps_once_and_keeps_the_original() -> None:
    class Engine:
        def step(self, x: int) -> int:
            return x + 1

    calls: list[int] = []
    original = Engine.step

    def make(inner):
        def step(self, x):
            calls.append(x)
            return inner(self, x) * 10
        return step

    assert wrap_method(Engine, "step", make) and not wrap_method(Engine, "step", make)
    assert Engine().step(1) == 20 and calls == [1]
    assert getattr(Engine.step, WRAPPED) and Engine.step.__wrapped__ is original
    assert not wrap_method(Engine, "missing", make)
    after: list[str] = []
    assert not call_after(Engine, "step", lambda: after.append("refreshed")), "already ours: not wrapped again"

    class Metadata:
        def update(self, value: int) -> int:
            return value

    assert call_after(Metadata, "update", lambda: after.append("refreshed"))
    assert Metadata().update(2) == 2 and after == ["refreshed"]


def test_metrics_writer_appends_one_row_per_step(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path), interval=60.0)
    record = StepRecord(decode=True, oea=True, rows=4, active={0: torch.tensor(5), 1: 6}, active_stock={0: 7, 1: 8})
    writer.add(3, record)
    writer.flush()
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert (row["step"], row["rank"], row["active"], row["active_stock"], row["layers"]) == (3, 0, [5, 6], [7, 8], 2)
