"""The engine-free Prometheus exporter (``oea.integrations.prometheus``) through the real metrics writer and
prometheus_client's own multiprocess collector: the series count exactly what the metrics file's lines count."""

from __future__ import annotations

import json
import logging
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from server_harness import free_port

from oea.integrations.metrics import MetricsWriter, StepRecord, step_reason
from oea.integrations.prometheus import PORT_VARIABLE, make_exporter, parse_port, serve_port


def scrape(directory: Path) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample prometheus_client's multiprocess collector reads from ``directory``: (name, labels) -> value."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return {(s.name, frozenset(s.labels.items())): s.value for family in registry.collect() for s in family.samples}


def total(samples: dict[Any, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, have), v in samples.items() if n == name and set(labels.items()) <= have)


def record(
    decode: bool,
    oea: bool,
    active: list[int],
    stock: list[int] | None = None,
    rows: int = 4,
    verify: bool = False,
    passthrough: dict[int, str] | None = None,
    routing_us: list[float] | None = None,
) -> StepRecord:
    """One step's record as an adapter fills it (0-dim tensors for the counts, as the routing calls leave them)."""
    rec = StepRecord(decode=decode, oea=oea, rows=rows, verify=verify, passthrough=dict(passthrough or {}))
    for layer, count in enumerate(active):
        rec.active[layer] = torch.tensor(count)
    for layer, count in enumerate(stock or []):
        rec.active_stock[layer] = torch.tensor(count)
    for layer, us in enumerate(routing_us or []):
        rec.routing_us[layer] = us
    return rec


STEPS = [  # two MoE layers; rewritten, below min_batch, a failed layer, a verify step, prefill
    record(True, True, [3, 4], [6, 7], routing_us=[40.0, 60.0]),
    record(True, True, [2, 5], [6, 8], routing_us=[30.0, 50.0]),
    record(True, False, [2, 2], [2, 2], rows=1, passthrough={0: "below_min_batch", 1: "below_min_batch"}),
    record(True, False, [5, 3], [5, 6], passthrough={0: "layer_failed"}),
    record(False, False, [6, 6], [6, 6], verify=True),
    record(False, False, [8, 8], [8, 8], rows=30),
]


def feed(tmp_path: Path, steps: list[StepRecord], path: str | None = "metrics.jsonl") -> tuple[Path, Path | None]:
    """The steps through a real ``MetricsWriter`` (file and exporter), flushed; (multiprocess dir, file)."""
    directory = tmp_path / "prom"
    exporter = make_exporter("vllm", "m", str(directory), logging.getLogger("test"))
    assert exporter is not None
    file = tmp_path / path if path else None
    writer = MetricsWriter(None if file is None else str(file), 3600.0, export=exporter)
    for step, rec in enumerate(steps, 1):
        writer.add(step, rec)
    writer.flush()
    return directory, file


def test_prometheus_counters_equal_the_metrics_file(tmp_path: Path) -> None:
    directory, file = feed(tmp_path, STEPS)
    rows = [json.loads(line) for line in file.read_text().splitlines()]  # type: ignore[union-attr]
    got = scrape(directory)
    decode = [r for r in rows if r["decode"]]
    assert total(got, "oea_forwards_total", phase="decode") == len(decode) == 4
    assert total(got, "oea_forwards_total", phase="verify") == 1
    assert total(got, "oea_forwards_total", phase="prefill") == 1
    assert total(got, "oea_forwards_total") == len(rows)
    assert total(got, "oea_rewritten_forwards_total") == sum(r["decode"] and r["oea"] for r in rows) == 2
    assert total(got, "oea_passthrough_forwards_total", reason="below_min_batch") == 1
    assert total(got, "oea_passthrough_forwards_total", reason="layer_failed") == 1
    assert total(got, "oea_passthrough_forwards_total", reason="verify_not_applied") == 1
    assert [r.get("reason") for r in rows] == [
        None,
        None,
        "below_min_batch",
        "layer_failed",
        "verify_not_applied",
        None,
    ]
    assert total(got, "oea_layer_passthrough_forwards_total", layer="0", reason="layer_failed") == 1
    assert total(got, "oea_layer_passthrough_forwards_total", layer="1", reason="layer_failed") == 0
    phase = [r for r in rows if r["decode"] or r["verify"]]
    for layer in (0, 1):
        assert total(got, "oea_active_experts_total", layer=str(layer)) == sum(r["active"][layer] for r in phase)
        assert total(got, "oea_stock_active_experts_total", layer=str(layer)) == sum(
            r["active_stock"][layer] for r in phase
        )
    assert total(got, "oea_decode_rows_total") == sum(r["rows"] for r in phase)
    assert total(got, "oea_routing_seconds_total", layer="1") == pytest.approx(110e-6)
    assert total(got, "oea_forward_routing_seconds_count") == 2
    assert total(got, "oea_forward_routing_seconds_sum") == pytest.approx(180e-6)
    assert total(got, "oea_metrics_file_rows_total") == len(rows)
    assert total(got, "oea_metrics_file_stopped") == 0
    labels = {dict(have)["engine"] for (name, have) in got if name == "oea_forwards_total"}
    assert labels == {"vllm"}


def test_prometheus_counts_accumulate_over_flushes_and_processes(tmp_path: Path) -> None:
    directory, _ = feed(tmp_path, STEPS[:2])
    second = make_exporter("vllm", "m", str(directory), logging.getLogger("test"))
    writer = MetricsWriter(None, 3600.0, export=second)
    for step in range(3):
        writer.add(step, record(True, True, [1, 1], [2, 2]))
        writer.flush()  # each flush adds to what the process wrote before
    assert total(scrape(directory), "oea_rewritten_forwards_total") == 5


def test_prometheus_export_without_a_metrics_file(tmp_path: Path) -> None:
    directory, _ = feed(tmp_path, STEPS, path=None)
    got = scrape(directory)
    assert total(got, "oea_forwards_total") == len(STEPS)
    assert not [name for name, _ in got if name.startswith("oea_metrics_file")]


def test_prometheus_export_goes_on_when_the_metrics_file_fails(tmp_path: Path) -> None:
    directory = tmp_path / "prom"
    exporter = make_exporter("vllm", "m", str(directory), logging.getLogger("test"))
    writer = MetricsWriter(str(tmp_path / "gone" / "metrics.jsonl"), 3600.0, export=exporter)
    writer.add(1, STEPS[0])
    writer.flush()
    writer.add(2, STEPS[1])
    writer.flush()
    got = scrape(directory)
    assert writer.failed is not None
    assert total(got, "oea_rewritten_forwards_total") == 2
    assert total(got, "oea_metrics_file_stopped") == 1


def test_prometheus_exporter_that_raises_stops_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def broken(batch: Any, writer: Any) -> None:
        raise RuntimeError("boom")

    writer = MetricsWriter(str(tmp_path / "m.jsonl"), 3600.0, logging.getLogger("test"), export=broken)
    writer.add(1, STEPS[0])
    with caplog.at_level(logging.WARNING):
        writer.flush()
    writer.add(2, STEPS[1])
    writer.flush()
    assert writer.export is None
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2
    assert [r.getMessage() for r in caplog.records if "Prometheus export failed (RuntimeError: boom)" in r.getMessage()]


def test_prometheus_step_reason() -> None:
    assert step_reason(record(True, True, [1])) is None
    assert step_reason(record(False, False, [1])) is None  # prefill: no reason
    assert (
        step_reason(record(True, False, [1], passthrough={3: "layer_failed", 1: "k0_covers_top_k"}))
        == "k0_covers_top_k"
    )
    assert step_reason(record(True, False, [1])) == "unknown"
    rec = record(True, False, [1], passthrough={0: "below_min_batch"})
    rec.reason = "oea_off"
    assert step_reason(rec) == "oea_off"


def test_prometheus_trace_recorder_state(tmp_path: Path) -> None:
    class Recorder:
        steps, dropped, stopped = 0, 0, None

    recorder = Recorder()
    directory = tmp_path / "prom"
    exporter = make_exporter("sglang", "m", str(directory), logging.getLogger("test"), recorder=lambda: recorder)
    writer = MetricsWriter(None, 3600.0, export=exporter)
    recorder.steps, recorder.dropped = 5, 1
    writer.add(1, STEPS[0])
    writer.flush()
    recorder.steps, recorder.dropped, recorder.stopped = 9, 1, "size cap reached"
    writer.add(2, STEPS[0])
    writer.flush()
    got = scrape(directory)
    assert total(got, "oea_trace_steps_written_total") == 9
    assert total(got, "oea_trace_steps_dropped_total") == 1
    assert total(got, "oea_trace_stopped") == 1


@pytest.mark.parametrize("raw", ["abc", "0", "70000", "host:", ""])
def test_prometheus_port_not_a_port(raw: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match=f"{PORT_VARIABLE} must be PORT or HOST:PORT"):
        parse_port(raw)
    with caplog.at_level(logging.WARNING):
        assert serve_port(str(tmp_path), raw, logging.getLogger("test")) is None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and PORT_VARIABLE in warned[0] and "serving without" in warned[0]


def test_prometheus_port_taken_warns_and_a_free_one_serves(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory, _ = feed(tmp_path, STEPS[:1], path=None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING):
            assert serve_port(str(directory), f"127.0.0.1:{port}", logging.getLogger("test")) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"{PORT_VARIABLE}=127.0.0.1:{port}" in warned[0]
    assert parse_port("9400") == ("0.0.0.0", 9400)
    port = free_port()
    served = serve_port(str(directory), f"127.0.0.1:{port}", logging.getLogger("test"))
    assert served is not None
    where, server = served
    try:
        assert where == f"127.0.0.1:{port}"
        url = f"http://{where}/metrics"
        with urllib.request.urlopen(url, timeout=30) as answer:
            text = answer.read().decode()
        assert 'oea_rewritten_forwards_total{engine="vllm",model_name="m",rank="0"} 1.0' in text
    finally:
        server.shutdown()
        server.server_close()


def test_prometheus_series_exist_at_zero_before_any_forward(tmp_path: Path) -> None:
    """A count that never grew still has data (an alert on "no forward rewritten" needs a 0, not nothing), and
    the per-layer series exist before a burst shorter than a scrape interval."""
    directory = tmp_path / "prom"
    exporter = make_exporter("vllm", "m", str(directory), logging.getLogger("test"))
    assert exporter is not None
    exporter.set_enabled(0, 3, 2)
    exporter.set_layers(0, [0, 2])
    got = scrape(directory)
    zero = {name: value for (name, labels), value in got.items() if value == 0}
    assert "oea_rewritten_forwards_total" in zero and "oea_trace_stopped" in zero
    assert {dict(labels)["reason"] for (name, labels) in got if name == "oea_passthrough_forwards_total"} == {
        "below_min_batch",
        "k0_covers_top_k",
        "kernel_routed",
        "layer_failed",
        "verify_not_applied",
        "dp_gathered",
        "oea_off",
        "unknown",
    }
    layers = {dict(labels)["layer"] for (name, labels) in got if name == "oea_active_experts_total"}
    assert layers == {"0", "2"} and total(got, "oea_forward_routing_seconds_count") == 0
    assert total(got, "oea_enabled", k0="3", min_batch="2") == 1
    assert all(value == 0 for (name, _), value in got.items() if name != "oea_enabled")
