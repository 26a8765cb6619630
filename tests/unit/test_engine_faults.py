"""Faults inside a serving engine, with stand-ins (no engine): a metrics file that cannot be written (its folder
removed, a write cut short by a full disk), a layer whose OEA routing raises, a trace whose disk stays full
or whose folder is removed. Each: one warning, serving goes on, and no file is left half-written where ``oea``
would read it. The same faults on a real vLLM server: ``tests/engines/test_vllm_soak.py`` (``chaos``)."""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import shutil
import time

import pytest
import torch
from vllm_stand_ins import CPURouter, fresh_state, install_vllm, scheduler_output

import oea.integrations.metrics as plugin_metrics
import oea.integrations.recording.recorder as recorder_module
import oea.integrations.vllm.routing as plugin_routing
import oea.integrations.vllm.steps as plugin_steps
from oea.config import TraceSettings
from oea.integrations.recording.recorder import StepStaging, open_recorder
from oea.integrations.recording.trace_file import Column, TraceFileWriter
from oea.integrations.vllm.router_state import router_states
from oea.routing import RouterSpec
from oea.traces import load_trace

torch.set_num_threads(1)
N, K, L = 32, 4, 3


def _record(step: int) -> plugin_metrics.StepRecord:
    return plugin_metrics.StepRecord(decode=True, oea=True, rows=2, active={0: 5}, active_stock={0: 7})


def _wait(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_a_metrics_file_whose_folder_vanishes_stops_the_metrics_with_one_warning(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    path = folder / "m.jsonl"
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        writer = plugin_metrics.MetricsWriter(str(path), interval=0.02, log=logging.getLogger("vllm.oea"))
        writer.add(1, _record(1))
        _wait(lambda: path.exists())
        shutil.rmtree(folder)
        for step in range(2, 40):
            writer.add(step, _record(step))
            time.sleep(0.002)
        _wait(lambda: writer.failed is not None)
        writer.add(99, _record(99))
        writer.flush()
    assert writer._pending == [], "nothing is buffered once the file cannot be written (no growth)"
    warnings = _warnings(caplog, "OEA_METRICS_FILE")
    assert len(warnings) == 1 and "serving continues" in warnings[0] and str(path) in warnings[0]


def test_a_metrics_write_cut_short_leaves_only_whole_lines(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.jsonl"
    writer = plugin_metrics.MetricsWriter(str(path), interval=3600, log=logging.getLogger("vllm.oea"))
    writer.add(1, _record(1))
    writer.flush()
    original = os.write

    def half_then_full(fd: int, data) -> int:  # the disk fills in the middle of the next write
        if len(data) > 8:
            return original(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plugin_metrics.os, "write", half_then_full)
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        writer.add(2, _record(2))
        writer.add(3, _record(3))
        writer.flush()
    monkeypatch.setattr(plugin_metrics.os, "write", original)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and path.read_text().endswith("\n")
    assert len(_warnings(caplog, "No space left")) == 1


def _decode_step(router: CPURouter, rows: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple]:
    logits = torch.randn(rows, router.spec().num_experts, generator=torch.Generator().manual_seed(seed))
    stock = router.route_stock(logits)
    plugin_steps.begin_step(scheduler_output([1] * rows))
    try:
        return plugin_routing.cpu_route_body(logits, stock[0], stock[1], 0), stock
    finally:
        plugin_steps.end_step()


def test_a_layer_whose_oea_routing_raises_keeps_stock_routing_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    install_vllm(monkeypatch)
    router = CPURouter(top_k=8, num_experts=64)
    fresh_state(monkeypatch, {"OEA_K0": "2"}, router)
    original = plugin_routing.oea_route_for
    raises = {"on": True}

    def failing(*args, **kwargs):
        if raises["on"]:
            raise RuntimeError("kernel exploded")
        return original(*args, **kwargs)

    monkeypatch.setattr(plugin_routing, "oea_route_for", failing)
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        for seed in range(3):
            out, stock = _decode_step(router, 6, seed)
            assert torch.equal(out[0], stock[0]) and torch.equal(out[1], stock[1]), "vLLM's own routing"
        raises["on"] = False  # the layer stays stock: a failing layer is not retried on every call
        out, stock = _decode_step(router, 6, 9)
        assert torch.equal(out[1], stock[1])
    warnings = _warnings(caplog, "OEA's routing raised")
    assert len(warnings) == 1 and "kernel exploded" in warnings[0] and "serving continues" in warnings[0]
    assert [r.failed for r in router_states()] == [True]


def test_the_graph_wrapper_hands_back_stock_routing_when_oea_raises(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    install_vllm(monkeypatch)
    router = CPURouter(top_k=8, num_experts=64)
    state = fresh_state(monkeypatch, {"OEA_K0": "2"}, router)
    monkeypatch.setattr(plugin_routing, "oea_route_for", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad")))
    wrapped = plugin_routing.graph_wrapper(lambda self, h, logits, t, **_: self.route_stock(logits))
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    state.decode = True
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        weights, ids = wrapped(router, None, logits, None)
    stock = router.route_stock(logits)
    assert torch.equal(weights, stock[0]) and torch.equal(ids, stock[1])
    assert len(_warnings(caplog, "OEA's routing raised")) == 1


# ---------------------------------------------------------------- the trace recorder


def _recorder(tmp_path: pathlib.Path, log: logging.Logger):
    staging = StepStaging(8, N, "cpu", num_layers=L)
    path = tmp_path / "t.safetensors"
    rec = open_recorder(TraceSettings(str(path)), str(path), RouterSpec(N, K), staging, {"model": "unit"}, log)
    assert rec is not None
    return rec


def _submit(rec, step: int) -> None:
    logits = torch.randn(4, L, N, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
    for layer in range(L):
        rec.staging.stage(layer, logits[:, layer])
    rec.submit_step(step, 4, ["a", "b", "c", f"r{step}"], [step] * 4)


def test_a_disk_that_stays_full_keeps_the_whole_steps_in_place(tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Once the disk is full, finishing by compaction would need space too: the trace is finished in place
    (as a checkpoint), so it keeps every whole step written before the failed write."""
    monkeypatch.setattr(recorder_module, "BATCH_WAIT_S", 0.001)
    original = TraceFileWriter.append
    full = {"on": False}

    def append(self, rows):
        if self.tokens >= 8:
            full["on"] = True
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, rows)

    def move(self, *args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TraceFileWriter, "append", append)
    monkeypatch.setattr(TraceFileWriter, "_move", move)
    log = logging.getLogger("test.faults")
    rec = _recorder(tmp_path, log)
    with caplog.at_level(logging.INFO, logger="test.faults"):
        for step in range(4):
            _submit(rec, step)
            _wait(lambda s=step: rec.steps > s or rec.stopped is not None)
        path = rec.close()
    stops = _warnings(caplog, "stops")
    assert len(stops) == 1 and "No space left" in stops[0] and "keeps the 2 decode steps" in stops[0]
    assert len(_warnings(caplog, "oea:")) == 1, "one warning in all"
    trace = load_trace(str(path))
    assert trace.step_ids.tolist() == [0] * 4 + [1] * 4 and "No space left" in trace.meta["stopped"]
    assert not path.with_suffix(".json.tmp").exists()


def test_a_trace_folder_removed_while_recording_stops_with_one_warning_and_leaves_nothing(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(recorder_module, "BATCH_WAIT_S", 0.001)
    monkeypatch.setattr(recorder_module, "CHECKPOINT_S", 0.05)
    folder = tmp_path / "traces"
    folder.mkdir()
    log = logging.getLogger("test.faults")
    rec = _recorder(folder, log)
    with caplog.at_level(logging.INFO, logger="test.faults"):
        _submit(rec, 0)
        _wait(lambda: (folder / "t.json").exists())
        shutil.rmtree(folder)
        for step in range(1, 6):
            _submit(rec, step)
            time.sleep(0.05)
        _wait(lambda: rec.stopped is not None)
        assert rec.close() is None
    stops = _warnings(caplog, "oea:")
    assert len(stops) == 1 and "stops: writing failed" in stops[0] and "serving continues" in stops[0]
    assert not folder.exists(), "the recorder does not recreate a removed folder"


def test_a_sidecar_that_cannot_be_written_leaves_the_last_checkpoint(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Finishing in place writes the header, then the sidecar; when the sidecar fails the header goes back to
    the last checkpoint's tokens, so the file and its old sidecar still agree."""
    columns = [Column("logits", (L, N), torch.bfloat16), Column("request_ids", (), torch.int32),
               Column("positions", (), torch.int32), Column("step_ids", (), torch.int32)]
    writer = TraceFileWriter(tmp_path / "w.safetensors", columns, 1 << 20)
    spec = RouterSpec(N, K)

    def rows(step: int) -> dict[str, torch.Tensor]:
        return {"logits": torch.randn(2, L, N).to(torch.bfloat16),
                "request_ids": torch.tensor([0, 1], dtype=torch.int32),
                "positions": torch.tensor([step, step], dtype=torch.int32),
                "step_ids": torch.tensor([step, step], dtype=torch.int32)}

    writer.append(rows(0))
    writer.checkpoint({"request_names": ["a", "b"]}, spec)
    writer.append(rows(1))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TraceFileWriter, "_write_sidecar", no_space)
    with pytest.raises(OSError):
        writer.finish_in_place({"request_names": ["a", "b"]}, spec)
    monkeypatch.undo()
    trace = load_trace(str(tmp_path / "w.safetensors"))
    assert trace.num_tokens == 2 and trace.step_ids.tolist() == [0, 0]
