"""What the generated mutants of ``oea/integrations/sglang/prometheus.py`` and ``metrics.py`` found unguarded
(docs/testing.md, "Generated mutants"), driven as SGLang drives the plugin (``test_sglang_metrics_rows``'s
``start``: ``register``, then the forward-context and post-process hooks) with the SGLang stand-ins.

The Prometheus export: the ``model_name`` label from each place an SGLang keeps its served name (and "" with one
warning naming both failures when neither says), a ``PROMETHEUS_MULTIPROC_DIR`` that cannot be used, the trace
recorder's series, the start-up line, the doctor's line read from the process's environment, and the per-layer
series at 0 from the first forward that routed."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import test_sglang_metrics_rows as metrics_rows
import torch
from sglang_stand_ins import FakeMode, topk_config
from test_prometheus_export import scrape, total
from test_sglang_metrics_rows import Server

import oea.integrations.sglang.metrics as sglang_metrics
import oea.integrations.sglang.prometheus as sglang_prometheus
import oea.integrations.sglang.recording as sglang_recording

torch.set_num_threads(1)
start = metrics_rows.start  # the plugin registered in a stand-in SGLang process (a fixture, found by this name)
LAYERS = (0, 1)
CONFIGS = {layer: topk_config() for layer in LAYERS}  # one TopKConfig per layer for the server's life, as SGLang's
LOGGER = "oea.integrations.sglang"


@pytest.fixture
def directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """SGLang's ``--enable-metrics`` as a scheduler sees it: ``PROMETHEUS_MULTIPROC_DIR`` set (the served model
    name is left to each test)."""
    path = tmp_path / "prom"
    path.mkdir()
    monkeypatch.setenv(sglang_prometheus.DIRECTORY_VARIABLE, str(path))
    monkeypatch.delenv("OEA_PROMETHEUS", raising=False)
    return path


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **functions: Any) -> None:
    module = types.ModuleType(name)
    for attribute, function in functions.items():
        setattr(module, attribute, function)
    monkeypatch.setitem(sys.modules, name, module)


def _raise(err: Exception) -> Any:
    def fail() -> Any:
        raise err
    return fail


def _forward(server: Server, mode: FakeMode, rows: int, seed: int) -> None:
    with server.forward(mode, rows):
        for layer in LAYERS:
            server.route(layer, rows, cfg=CONFIGS[layer], seed=seed)


def _flush() -> None:
    writer = sglang_metrics.METRICS.writer
    assert writer is not None
    writer.flush()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The export's warnings (the stand-in SGLang lacks what other checks look for: those warn too)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and any(word in r.getMessage() for word in ("Prometheus", "oea_*", "model name"))]


def _model_names(samples: dict[Any, float]) -> set[str]:
    return {dict(labels)["model_name"] for _, labels in samples}


# -- prometheus.py: the model_name label -------------------------------------------------------------------------

@pytest.mark.parametrize(("serving", "server_args", "expected"), [
    ("m", None, "m"),  # SGLang's runtime context
    (None, None, ""),  # a runtime context without a served name: "", never a placeholder
    (RuntimeError("no serving context"), "legacy", "legacy"),  # older SGLang: its global server args
    (RuntimeError("no serving context"), None, ""),
])
def test_the_series_carry_the_served_model_name_sglang_keeps(
        start: Any, directory: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        serving: Any, server_args: Any, expected: str) -> None:
    get_serving = _raise(serving) if isinstance(serving, Exception) else (
        lambda: SimpleNamespace(served_model_name=serving))
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=get_serving)
    _module(monkeypatch, "sglang.srt.server_args",
            get_global_server_args=lambda: SimpleNamespace(served_model_name=server_args))
    server = start(OEA_K0="2")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _forward(server, FakeMode.DECODE, 3, 1)
    _flush()
    got = scrape(directory)
    assert _model_names(got) == {expected}
    assert total(got, "oea_forwards_total", phase="decode", model_name=expected) == 1
    assert _warnings(caplog) == [], "a name SGLang gives (even none) is no warning"


def test_a_model_name_no_sglang_place_gives_is_empty_with_one_warning_naming_both_failures(
        start: Any, directory: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=_raise(RuntimeError("no serving context")))
    _module(monkeypatch, "sglang.srt.server_args", get_global_server_args=_raise(LookupError("server args unset")))
    server = start(OEA_K0="2")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _forward(server, FakeMode.DECODE, 3, 2)
        _forward(server, FakeMode.DECODE, 3, 3)
    _flush()
    got = scrape(directory)
    assert _model_names(got) == {""}, "the export goes on, without a name"
    assert total(got, "oea_forwards_total", phase="decode") == 2
    (said,) = _warnings(caplog)
    assert "SGLang's served model name cannot be read" in said, said
    assert "RuntimeError: no serving context" in said and "LookupError: server args unset" in said, said
    assert said.endswith('the oea_* series carry model_name=""'), said


# -- prometheus.py: start_export ---------------------------------------------------------------------------------

def test_an_export_directory_that_cannot_be_used_is_one_warning_naming_it_and_the_file_goes_on(
        start: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "prom"
    blocked.write_text("a file, not a folder")
    monkeypatch.setenv(sglang_prometheus.DIRECTORY_VARIABLE, str(blocked))
    monkeypatch.delenv("OEA_PROMETHEUS", raising=False)
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=lambda: SimpleNamespace(served_model_name="m"))
    server = start(OEA_K0="2")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _forward(server, FakeMode.DECODE, 3, 4)
        _forward(server, FakeMode.DECODE, 3, 5)
    (said,) = _warnings(caplog)
    assert said.startswith("oea: Prometheus export is off: ") and f"{blocked} cannot be used" in said, said
    assert sglang_metrics.METRICS.writer is not None and sglang_metrics.METRICS.writer.export is None
    assert [(r["decode"], r["oea"]) for r in server.rows()] == [(True, True)] * 2, "the metrics file goes on"


def test_the_start_up_line_names_the_directory_and_sglangs_metrics(
        start: Any, directory: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=lambda: SimpleNamespace(served_model_name="m"))
    server = start(OEA_K0="2")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _forward(server, FakeMode.DECODE, 3, 6)
    _flush()
    said = [r.getMessage() for r in caplog.records if "Prometheus" in r.getMessage()]
    assert said == [f"oea: Prometheus series oea_* written to {directory}, served on SGLang's /metrics "
                    "(--enable-metrics)"], said


def test_the_trace_recorders_steps_and_stop_reach_the_series(
        start: Any, directory: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=lambda: SimpleNamespace(served_model_name="m"))
    server = start(OEA_K0="2", OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    for seed in range(3):
        _forward(server, FakeMode.DECODE, 3, 10 + seed)
    recorder = sglang_recording.TRACE.recorder
    assert recorder is not None
    assert recorder.close() is not None  # the engine stops recording: the 3 decode steps are written
    assert recorder.steps == 3
    _forward(server, FakeMode.EXTEND, 4, 20)  # a later forward's flush exports the recorder's state
    _flush()
    got = scrape(directory)
    assert total(got, "oea_trace_steps_written_total", model_name="m") == 3
    assert total(got, "oea_trace_steps_dropped_total") == 0
    assert total(got, "oea_trace_stopped", model_name="m") == 1


# -- prometheus.py: the doctor's line ----------------------------------------------------------------------------

def test_the_doctor_line_reads_this_processs_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_OEA_K0", raising=False)
    monkeypatch.delenv("OEA_PROMETHEUS", raising=False)
    monkeypatch.setenv("OEA_K0", "2")
    monkeypatch.setenv(sglang_prometheus.DIRECTORY_VARIABLE, "/srv/prom")
    ok, detail = sglang_prometheus.doctor_line()
    assert ok and "PROMETHEUS_MULTIPROC_DIR=/srv/prom" in detail, detail
    monkeypatch.delenv(sglang_prometheus.DIRECTORY_VARIABLE)
    ok, detail = sglang_prometheus.doctor_line()
    assert ok and detail.startswith("on SGLang's /metrics once the server runs with --enable-metrics"), detail
    assert detail.endswith("without it no oea_* series are exported"), detail


# -- prometheus.py: the per-layer series ---------------------------------------------------------------------------

def test_the_first_forward_that_routed_makes_each_layers_series_at_zero(
        start: Any, directory: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Without ``OEA_TIMING`` nothing counts routing time: its per-layer series and histogram exist at 0 from the
    first forward that routed, for this rank."""
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=lambda: SimpleNamespace(served_model_name="m"))
    server = start(OEA_K0="2")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _forward(server, FakeMode.EXTEND, 3, 30)
    _flush()
    got = scrape(directory)
    assert _warnings(caplog) == []
    assert {dict(labels)["rank"] for _, labels in got} == {"0"}
    timed = {dict(labels)["layer"]: value for (name, labels), value in got.items()
             if name == "oea_routing_seconds_total"}
    assert timed == {str(layer): 0.0 for layer in LAYERS}
    for family in ("oea_active_experts_total", "oea_stock_active_experts_total"):
        assert sorted(dict(labels)["layer"] for name, labels in got if name == family) == [str(x) for x in LAYERS]
    buckets = [value for (name, _), value in got.items() if name == "oea_forward_routing_seconds_bucket"]
    assert buckets and set(buckets) == {0.0}


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "m.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
