"""The SGLang plugin's Prometheus export with stand-ins for SGLang (no SGLang needed), driven as SGLang drives the
plugin (``test_sglang_metrics_rows``'s ``start``: ``register``, then the forward-context and post-process hooks):
each pass-through reason as the routing calls record it, the series equal to the metrics file's lines (per forward,
not per layer), export without a metrics file, no series with OEA off or without ``--enable-metrics``, and the
doctor's ``prometheus export`` line."""

from __future__ import annotations

import json
import logging
import os
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
import oea.integrations.sglang.routing as sglang_routing
from oea.integrations.metrics import PASSTHROUGH_REASONS

torch.set_num_threads(1)
start = metrics_rows.start  # the plugin registered in a stand-in SGLang process (a fixture, found by this name)
LAYERS = (0, 1)


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """SGLang's ``--enable-metrics`` as a scheduler sees it: ``PROMETHEUS_MULTIPROC_DIR`` set, and its served
    model name ("m") where SGLang keeps it."""
    directory = tmp_path / "prom"
    directory.mkdir()
    monkeypatch.setenv(sglang_prometheus.DIRECTORY_VARIABLE, str(directory))
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_serving = lambda: SimpleNamespace(served_model_name="m")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    return directory


CONFIGS = {layer: topk_config() for layer in LAYERS}  # one TopKConfig per layer for the server's life, as SGLang's


def _forward(server: Server, mode: FakeMode, rows: int, seed: int) -> None:
    with server.forward(mode, rows):
        for layer in LAYERS:
            server.route(layer, rows, cfg=CONFIGS[layer], seed=seed)


def _flushed(tmp_path: Path) -> list[dict[str, Any]]:
    writer = sglang_metrics.METRICS.writer
    assert writer is not None
    writer.flush()
    path = tmp_path / "m.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_prometheus_sglang_reasons_and_series_equal_the_metrics_file(start: Any, exported: Path,
                                                                    tmp_path: Path) -> None:
    server = start(OEA_K0="2")
    _forward(server, FakeMode.EXTEND, 5, 1)  # prefill
    _forward(server, FakeMode.DECODE, 3, 2)  # rewritten
    _forward(server, FakeMode.DECODE, 1, 3)  # below OEA_MIN_BATCH (2)
    _forward(server, FakeMode.TARGET_VERIFY, 2, 4)  # a verify forward, OEA_APPLY_TO_VERIFY unset
    _forward(server, FakeMode.DECODE, 4, 5)  # rewritten
    rows = _flushed(tmp_path)
    assert [r.get("reason") for r in rows] == [None, None, "below_min_batch", "verify_not_applied", None]
    got = scrape(exported)
    assert total(got, "oea_forwards_total", phase="prefill") == 1
    assert total(got, "oea_forwards_total", phase="decode") == sum(r["decode"] for r in rows) == 3
    assert total(got, "oea_forwards_total", phase="verify") == sum(r["verify"] for r in rows) == 1
    assert total(got, "oea_rewritten_forwards_total") == sum(r["decode"] and r["oea"] for r in rows) == 2
    assert total(got, "oea_passthrough_forwards_total", reason="below_min_batch") == 1
    assert total(got, "oea_passthrough_forwards_total", reason="verify_not_applied") == 1
    for layer in LAYERS:
        assert total(got, "oea_layer_passthrough_forwards_total", layer=str(layer), reason="below_min_batch") == 1
        decode_phase = [r for r in rows if r["decode"] or r["verify"]]
        assert total(got, "oea_active_experts_total", layer=str(layer)) == \
            sum(r["active"][layer] for r in decode_phase)
        assert total(got, "oea_stock_active_experts_total", layer=str(layer)) == \
            sum(r["active_stock"][layer] for r in decode_phase)
    assert total(got, "oea_enabled", k0="2", min_batch="2", model_name="m", engine="sglang", rank="0") == 1


def test_prometheus_sglang_k0_covering_top_k(start: Any, exported: Path, tmp_path: Path) -> None:
    server = start(OEA_K0="8")  # the stand-in router's top_k
    _forward(server, FakeMode.DECODE, 3, 6)
    assert [r.get("reason") for r in _flushed(tmp_path)] == ["k0_covers_top_k"]
    assert total(scrape(exported), "oea_passthrough_forwards_total", reason="k0_covers_top_k") == 1


def test_prometheus_sglang_a_failed_layer(start: Any, exported: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    server = start(OEA_K0="2")

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kernel broke")

    monkeypatch.setattr(sglang_routing, "rewrite_topk", broken)
    _forward(server, FakeMode.DECODE, 3, 7)  # raises inside: the layers fail in this forward
    _forward(server, FakeMode.DECODE, 3, 8)  # and keep SGLang's routing afterwards
    assert [r.get("reason") for r in _flushed(tmp_path)] == ["layer_failed", "layer_failed"]
    got = scrape(exported)
    assert total(got, "oea_passthrough_forwards_total", reason="layer_failed") == 2
    assert total(got, "oea_rewritten_forwards_total") == 0


def test_prometheus_sglang_export_without_a_metrics_file(start: Any, exported: Path, tmp_path: Path) -> None:
    server = start(OEA_K0="2", OEA_METRICS_FILE="")
    _forward(server, FakeMode.DECODE, 3, 9)
    _forward(server, FakeMode.DECODE, 1, 10)
    assert _flushed(tmp_path) == [] and sglang_metrics.METRICS.writer.path is None  # type: ignore[union-attr]
    got = scrape(exported)
    assert total(got, "oea_forwards_total", phase="decode") == 2
    assert total(got, "oea_rewritten_forwards_total") == 1
    assert total(got, "oea_passthrough_forwards_total", reason="below_min_batch") == 1


def test_prometheus_sglang_oea_off_exports_no_series(start: Any, exported: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    server = start()  # metrics file only: OEA off
    with caplog.at_level(logging.INFO, logger="oea"):
        _forward(server, FakeMode.DECODE, 3, 11)
    assert [r.get("reason") for r in _flushed(tmp_path)] == ["oea_off"]  # the file still gets its line
    assert sglang_metrics.METRICS.writer.export is None  # type: ignore[union-attr]
    assert not list(exported.iterdir())
    assert "Prometheus" not in caplog.text, "export is not even tried with OEA off"


def test_prometheus_sglang_without_enable_metrics_exports_nothing(start: Any, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sglang_prometheus.DIRECTORY_VARIABLE, raising=False)
    server = start(OEA_K0="2")
    _forward(server, FakeMode.DECODE, 3, 12)
    assert len(_flushed(tmp_path)) == 1
    assert sglang_metrics.METRICS.writer.export is None  # type: ignore[union-attr]


def test_prometheus_sglang_export_off_with_enable_metrics(start: Any, exported: Path, tmp_path: Path) -> None:
    """``OEA_PROMETHEUS=0`` with ``--enable-metrics``: OEA rewrites and the file gets its line, no series."""
    server = start(OEA_K0="2", OEA_PROMETHEUS="0")
    _forward(server, FakeMode.DECODE, 3, 13)
    assert [(r["decode"], r["oea"], r.get("reason")) for r in _flushed(tmp_path)] == [(True, True, None)]
    assert sglang_metrics.METRICS.writer.export is None  # type: ignore[union-attr]
    assert not list(exported.iterdir())


def test_prometheus_sglang_reasons_are_the_shared_ones() -> None:
    import oea.integrations.sglang.router_state as router_state

    used = {router_state.BELOW_MIN_BATCH, router_state.K0_COVERS_TOP_K, router_state.LAYER_FAILED,
            router_state.OEA_OFF, router_state.VERIFY_NOT_APPLIED}
    assert used <= set(PASSTHROUGH_REASONS) and len(used) == 5


@pytest.mark.parametrize(("env", "ok", "says"), [
    ({}, True, "off (OEA_K0 unset"),
    ({"OEA_K0": "2"}, True, "once the server runs with --enable-metrics"),
    ({"OEA_K0": "2", "PROMETHEUS_MULTIPROC_DIR": "/tmp/p"}, True, "PROMETHEUS_MULTIPROC_DIR=/tmp/p"),
    ({"OEA_K0": "2", "OEA_PROMETHEUS": "no", "PROMETHEUS_MULTIPROC_DIR": "/tmp/p"}, True,
     "off (OEA_PROMETHEUS=no: no oea_* series)"),
])
def test_prometheus_sglang_doctor_line(env: dict[str, str], ok: bool, says: str) -> None:
    got_ok, detail = sglang_prometheus.doctor_line(env)
    assert got_ok is ok and says in detail, detail


def test_prometheus_sglang_files_beside_sglangs_own_in_the_same_process(tmp_path: Path) -> None:
    """SGLang's scheduler writes its own prometheus_client metrics into the same directory from the same process:
    each keeps its own files, and the collector reads both (one shared mmap file: each writer appends at its own
    end and overwrites the other's keys, and /metrics answers 500)."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from oea.integrations.metrics import MetricsWriter, StepRecord
    from oea.integrations.prometheus import make_exporter

    directory = tmp_path / "prom"
    directory.mkdir()
    own = MmapedDict(str(directory / f"counter_{os.getpid()}.db"))  # prometheus_client's file in multiprocess mode
    own.write_value(mmap_key("sglang:requests", "sglang:requests_total", [], [], "h"), 1.0, 0.0)
    exporter = make_exporter("sglang", "m", str(directory), logging.getLogger("test"))
    writer = MetricsWriter(None, 3600.0, export=exporter)
    record = StepRecord(decode=True, oea=True, rows=3)
    record.active[0] = torch.tensor(3)
    writer.add(1, record)
    writer.flush()
    own.write_value(mmap_key("sglang:tokens", "sglang:tokens_total", [], [], "h"), 7.0, 0.0)
    got = scrape(directory)
    assert total(got, "sglang:requests_total") == 1 and total(got, "sglang:tokens_total") == 7
    assert total(got, "oea_forwards_total", phase="decode") == 1
