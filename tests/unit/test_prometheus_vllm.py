"""The vLLM plugin's Prometheus export with stand-ins for vLLM (no vLLM needed): each step's reason as the
routing calls record it, the series equal to the metrics file's lines, no series with OEA off, the API server's
collector, and the doctor's ``prometheus export`` line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_prometheus_export import scrape, total
from vllm_stand_ins import CPURouter, fresh_state, install_vllm, scheduler_output

import oea.integrations.vllm.plugin as plugin
import oea.integrations.vllm.prometheus as vllm_prometheus
import oea.integrations.vllm.routing as plugin_routing
import oea.integrations.vllm.steps as plugin_steps
from oea.config.settings import all_settings_from_env
from oea.integrations.vllm.speculative import Speculation

torch.set_num_threads(1)
N, K = 64, 8


def _logits(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(N, generator=gen) for _ in range(rows)]).float() / 8


def _step(router: CPURouter, output: SimpleNamespace, seed: int) -> None:
    """One engine step through the worker hook and the CPU op."""
    logits = _logits(output.total_num_scheduled_tokens, seed)
    stock = router.route_stock(logits)
    plugin_steps.begin_step(output)
    try:
        plugin_routing.cpu_route_body(logits, stock[0], stock[1], 0)
    finally:
        plugin_steps.end_step()


def _verify(requests: int, drafts: int) -> SimpleNamespace:
    out = scheduler_output([1 + drafts] * requests)
    out.scheduled_spec_decode_tokens = {f"r{i}": list(range(drafts)) for i in range(requests)}
    return out


def _loaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str]) -> tuple[CPURouter, Path]:
    """Plugin state after model load with ``env``, its metrics writer started the plugin's way (``_start_metrics``)
    into ``tmp_path`` (the file, and the series under ``PROMETHEUS_MULTIPROC_DIR``)."""
    install_vllm(monkeypatch)
    router = CPURouter()
    directory = tmp_path / "prom"
    directory.mkdir(parents=True)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    monkeypatch.delenv("OEA_PROMETHEUS_PORT", raising=False)
    env = {"OEA_METRICS_FILE": str(tmp_path / "metrics.jsonl"), "OEA_METRICS_FLUSH_S": "3600", **env}
    state = fresh_state(monkeypatch, env, router)
    if "OEA_K0" not in env:
        state.mode = "observe"
    state.model_runner = SimpleNamespace(model_config=SimpleNamespace(served_model_name="m", model="/x"))
    plugin._start_metrics()
    return router, directory


def test_prometheus_vllm_reasons_and_series_equal_the_metrics_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    router, directory = _loaded(monkeypatch, tmp_path, {"OEA_K0": "2"})
    plugin_routing.STATE.speculation = Speculation("ngram", 3)
    _step(router, scheduler_output([5]), 1)  # prefill
    _step(router, scheduler_output([1, 1, 1]), 2)  # rewritten
    _step(router, scheduler_output([1]), 3)  # below min_batch (2)
    _step(router, _verify(2, 2), 4)  # a verify step, OEA_APPLY_TO_VERIFY unset
    _step(router, scheduler_output([1] * 4), 5)  # rewritten
    plugin_routing.STATE.metrics.flush()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("reason") for r in rows] == [None, None, "below_min_batch", "verify_not_applied", None]
    got = scrape(directory)
    assert total(got, "oea_forwards_total", phase="decode") == sum(r["decode"] for r in rows) == 3
    assert total(got, "oea_forwards_total", phase="verify") == 1
    assert total(got, "oea_rewritten_forwards_total") == sum(r["decode"] and r["oea"] for r in rows) == 2
    assert total(got, "oea_passthrough_forwards_total", reason="below_min_batch") == 1
    assert total(got, "oea_passthrough_forwards_total", reason="verify_not_applied") == 1
    assert total(got, "oea_layer_passthrough_forwards_total", layer="0", reason="below_min_batch") == 1
    decode_phase = [r for r in rows if r["decode"] or r["verify"]]
    assert total(got, "oea_active_experts_total", layer="0") == sum(r["active"][0] for r in decode_phase)
    assert total(got, "oea_stock_active_experts_total", layer="0") == sum(r["active_stock"][0] for r in decode_phase)
    assert total(got, "oea_enabled", k0="2", min_batch="2", model_name="m", engine="vllm") == 1


def test_prometheus_vllm_k0_covering_top_k_and_a_failed_layer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    router, directory = _loaded(monkeypatch, tmp_path, {"OEA_K0": str(K)})
    _step(router, scheduler_output([1, 1, 1]), 6)
    plugin_routing.STATE.metrics.flush()
    assert total(scrape(directory), "oea_passthrough_forwards_total", reason="k0_covers_top_k") == 1

    router, directory = _loaded(monkeypatch, tmp_path / "failed", {"OEA_K0": "2"})

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kernel broke")

    monkeypatch.setattr(plugin_routing, "oea_route_for", broken)
    _step(router, scheduler_output([1, 1, 1]), 7)  # raises inside: the layer fails in this step
    _step(router, scheduler_output([1, 1, 1]), 8)  # and keeps vLLM's routing afterwards
    plugin_routing.STATE.metrics.flush()
    got = scrape(directory)
    assert total(got, "oea_passthrough_forwards_total", reason="layer_failed") == 2
    assert total(got, "oea_rewritten_forwards_total") == 0


def test_prometheus_vllm_oea_off_exports_no_series(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    router, directory = _loaded(monkeypatch, tmp_path, {})  # metrics file only: OEA off
    _step(router, scheduler_output([1, 1, 1]), 9)
    plugin_routing.STATE.metrics.flush()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1  # the file still gets its line
    assert plugin_routing.STATE.metrics.export is None
    assert not list(directory.iterdir())
    assert not scrape(directory)


def test_prometheus_vllm_export_off_keeps_oea_and_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``OEA_PROMETHEUS=0``: OEA rewrites and the metrics file gets its lines, but no series is written and the API
    server adds no collector."""
    from prometheus_client import REGISTRY

    router, directory = _loaded(monkeypatch, tmp_path, {"OEA_K0": "2", "OEA_PROMETHEUS": "0"})
    _step(router, scheduler_output([1, 1, 1]), 10)
    plugin_routing.STATE.metrics.flush()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["decode"], r["oea"]) for r in rows] == [(True, True)]
    assert plugin_routing.STATE.metrics.export is None
    assert not list(directory.iterdir())
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv(vllm_prometheus.DIRECTORY_VARIABLE, raising=False)
    before = set(REGISTRY._collector_to_names)
    vllm_prometheus.prepare_api_server(plugin_routing.STATE.settings)
    assert set(REGISTRY._collector_to_names) == before
    assert vllm_prometheus.DIRECTORY_VARIABLE not in vllm_prometheus.os.environ


def test_prometheus_vllm_api_server_collects_oea_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import REGISTRY

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv(vllm_prometheus.DIRECTORY_VARIABLE, raising=False)
    before = set(REGISTRY._collector_to_names)
    settings = all_settings_from_env({"OEA_K0": "2"})
    vllm_prometheus.prepare_api_server(settings)
    added = set(REGISTRY._collector_to_names) - before
    try:
        directory = vllm_prometheus.os.environ[vllm_prometheus.DIRECTORY_VARIABLE]
        assert Path(directory).is_dir() and len(added) == 1
        assert vllm_prometheus.export_directory() == (
            directory,
            "vLLM's /metrics (the API server reads OEA's directory)",
        )
        vllm_prometheus.prepare_api_server(settings)  # a second call (a child process) adds nothing
        assert set(REGISTRY._collector_to_names) - before == added
    finally:
        for collector in added:
            REGISTRY.unregister(collector)
        made = vllm_prometheus.os.environ.get(vllm_prometheus.DIRECTORY_VARIABLE)
        if made:  # atexit removes it in a server; a pytest-xdist worker may end without running atexit
            shutil.rmtree(made, ignore_errors=True)
        monkeypatch.delenv(vllm_prometheus.DIRECTORY_VARIABLE, raising=False)


def test_prometheus_vllm_doctor_says_which_endpoint_is_live() -> None:
    assert vllm_prometheus.doctor_line({}) == (True, "off (OEA_K0 unset: no oea_* series)")
    ok, detail = vllm_prometheus.doctor_line({"OEA_K0": "3"})
    assert ok and "on vLLM's /metrics" in detail and "OEA_PROMETHEUS_PORT" in detail
    ok, detail = vllm_prometheus.doctor_line({"OEA_K0": "3", "PROMETHEUS_MULTIPROC_DIR": "/d"})
    assert ok and "PROMETHEUS_MULTIPROC_DIR=/d" in detail
    ok, detail = vllm_prometheus.doctor_line({"OEA_K0": "3", "OEA_PROMETHEUS_PORT": "127.0.0.1:9400"})
    assert ok and "rank-0 worker on http://127.0.0.1:9400/metrics" in detail
    assert vllm_prometheus.doctor_line({"OEA_K0": "3", "OEA_PROMETHEUS": " 0 "}) == (
        True, "off (OEA_PROMETHEUS=0: no oea_* series)"
    )
    ok, detail = vllm_prometheus.doctor_line({"OEA_K0": "3", "OEA_PROMETHEUS": "maybe"})
    assert not ok and "OEA_PROMETHEUS must be one of 0/1/true/false/yes/no/on/off, got 'maybe'" in detail
    ok, detail = vllm_prometheus.doctor_line({"OEA_K0": "3", "OEA_PROMETHEUS_PORT": "nine"})
    assert not ok and "OEA_PROMETHEUS_PORT must be PORT or HOST:PORT with PORT in 1..65535, got 'nine'" in detail


def test_prometheus_vllm_bad_port_warns_once_and_serving_goes_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    install_vllm(monkeypatch)
    router = CPURouter()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    fresh_state(monkeypatch, {"OEA_K0": "2", "OEA_PROMETHEUS_PORT": "99999"}, router)
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        exporter = vllm_prometheus.start_worker_export(None)
    assert exporter is not None  # the series still reach vLLM's /metrics
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert "OEA_PROMETHEUS_PORT must be PORT or HOST:PORT with PORT in 1..65535, got '99999'" in warned[0]
