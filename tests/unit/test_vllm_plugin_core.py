"""Engine-free parts of the vLLM plugin (runs without vLLM installed)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from vllm_stand_ins import swap_state

import oea.integrations.metrics as plugin_metrics
import oea.integrations.vllm as plugin
import oea.integrations.vllm.doctor as plugin_doctor
import oea.integrations.vllm.plugin as plugin_hooks
from oea.config import metrics_flush_interval, write_layer_k0_file
from oea.integrations.vllm.state import STATE, State
from oea.routing import LayerK0Schedule

torch.set_num_threads(1)


def _sched(scheduled: dict[str, int], spec: dict[str, list[int]] | None = None) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           scheduled_spec_decode_tokens=spec or {})


def test_decode_detection_from_scheduler_output() -> None:
    assert plugin.is_decode_step(_sched({"a": 1, "b": 1}))
    assert not plugin.is_decode_step(_sched({"a": 1, "b": 7}))  # one request still in (chunked) prefill
    assert not plugin.is_decode_step(_sched({}))
    verify = _sched({"a": 3, "b": 1}, {"a": [5, 6]})
    assert not plugin.is_decode_step(verify)
    assert plugin.is_decode_step(verify, apply_to_verify=True)
    assert not plugin.is_decode_step(_sched({"a": 2}, {"a": [5, 6]}), apply_to_verify=True)


def _router(name: str, **attrs: object) -> object:
    defaults = {"top_k": 8, "global_num_experts": 64, "renormalize": True, "scoring_func": "softmax"}
    return type(name, (), {**defaults, **attrs})()


def test_router_spec_mirrors_vllm_routers() -> None:
    spec, _ = plugin.router_spec(_router("CPURouter", use_grouped_topk=False, routed_scaling_factor=2.5))
    assert spec is not None and spec.scoring == "softmax" and spec.routed_scaling_factor == 1.0
    bias = torch.zeros(64)
    spec, _ = plugin.router_spec(_router("CPURouter", use_grouped_topk=True, num_expert_group=8, topk_group=4,
                                         scoring_func="sigmoid", e_score_correction_bias=bias,
                                         routed_scaling_factor=2.5))
    assert spec is not None and (spec.n_group, spec.topk_group, spec.routed_scaling_factor) == (8, 4, 2.5)
    spec, reason = plugin.router_spec(_router("CPURouter", use_grouped_topk=True, num_expert_group=8,
                                              topk_group=4))
    assert spec is None and "grouped" in reason
    spec, reason = plugin.router_spec(_router("CPURouter", custom_routing_function=print))
    assert spec is None and "custom" in reason
    spec, reason = plugin.router_spec(_router("CPURouter", scoring_func="sqrtsoftplus"))
    assert spec is None and "sqrtsoftplus" in reason
    spec, _ = plugin.router_spec(_router("GroupedTopKRouter", num_expert_group=1, topk_group=1,
                                         scoring_func="sigmoid", e_score_correction_bias=bias))
    assert spec is not None and spec.n_group is None


def test_register_is_inert_without_oea_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OEA_K0", "SGLANG_OEA_K0", "OEA_METRICS_FILE", "OEA_TIMING"):
        monkeypatch.delenv(var, raising=False)
    swap_state(monkeypatch, State())
    plugin.register()  # vLLM is not importable here: any patching attempt would raise
    assert not STATE.installed and STATE.mode == "off"


def test_register_warns_once_about_an_empty_k0(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OEA_K0", "")
    swap_state(monkeypatch, State())
    with caplog.at_level(logging.WARNING):
        plugin.register()
    assert not STATE.installed and STATE.mode == "off"
    assert [r.getMessage() for r in caplog.records] == [
        "oea: OEA_K0 is set but empty: read as unset (OEA is off without OEA_K0); unset it, or give it a value"]


@pytest.mark.parametrize(("var", "value"), [("OEA_K0", "three"), ("OEA_K0", "0"), ("OEA_MIN_BATCH", "-1"),
                                            ("OEA_TIMING", "maybe"), ("OEA_METRICS_FLUSH_S", "0")])
def test_bad_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv("OEA_K0", "2")
    monkeypatch.setenv(var, value)
    swap_state(monkeypatch, State())
    with pytest.raises(ValueError, match=var):
        plugin.register() if var != "OEA_METRICS_FLUSH_S" else metrics_flush_interval()  # read at model load


class _MoELayer(torch.nn.Module):
    def __init__(self, router: object) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, 64, bias=False)
        self.router = router


@pytest.mark.parametrize("variable", ["OEA_K0", "SGLANG_OEA_K0"])
def test_k0_above_top_k_is_rejected_naming_the_variable(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """``Worker.load_model``'s hook checks k0 against every router of the loaded model (vLLM stand-ins)."""
    from vllm_stand_ins import CPURouter, fresh_state, install_vllm

    install_vllm(monkeypatch)

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(_MoELayer(CPURouter(top_k=8)), _MoELayer(CPURouter(top_k=4)))

    fresh_state(monkeypatch, {variable: "6"})
    with pytest.raises(ValueError, match=rf"^{variable} must be in 1\.\.4 \(the model's top_k\), got 6$"):
        plugin_hooks._after_load(model())
    state = fresh_state(monkeypatch, {variable: "4"})
    plugin_hooks._after_load(model())  # fits every router: numbered, specs kept, decode flag allocated
    assert [r._oea_router_id for r in state.routers] == [0, 1] and all(s is not None for s in state.specs)
    assert state.decode_flag is not None and not bool(state.decode_flag)


def test_grouped_router_without_topk_group_keeps_stock_routing_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """n_group without topk_group (RouterSpec refuses it) must not stop the server: stock routing, one warning."""
    import logging

    from vllm_stand_ins import BaseRouter, fresh_state, install_vllm

    install_vllm(monkeypatch)
    bias = torch.zeros(64)

    def grouped(topk_group: int | None) -> BaseRouter:
        attrs = {"top_k": 8, "global_num_experts": 64, "renormalize": True, "scoring_func": "sigmoid",
                 "e_score_correction_bias": bias, "num_expert_group": 8, "topk_group": topk_group}
        return type("GroupedTopKRouter", (BaseRouter,), attrs)()

    spec, reason = plugin.router_spec(grouped(None))
    assert spec is None and "topk_group" in reason and "n_group=8" in reason
    assert plugin.router_spec(grouped(4))[0] is not None  # the same router with its group limit is rewritable
    state = fresh_state(monkeypatch, {"OEA_K0": "2"})
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        plugin_hooks._after_load(torch.nn.Sequential(*(_MoELayer(grouped(None)) for _ in range(3))))
    assert state.specs == [None, None, None] and state.decode_flag is not None
    warnings = [r.getMessage() for r in caplog.records if "topk_group" in r.getMessage()]
    assert len(warnings) == 1 and "keeps the engine's own routing" in warnings[0]


def test_metrics_rows_written_by_the_flush_thread(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    writer = plugin_metrics.MetricsWriter(str(path), interval=0.05)
    record = plugin_metrics.StepRecord(decode=True, oea=True, rows=4, active={0: torch.tensor(5), 1: 6},
                                active_stock={0: 12, 1: torch.tensor(13)}, routing_us={0: 40.0, 1: 41.5})
    writer.add(7, record)
    writer.add(8, plugin_metrics.StepRecord(decode=False, oea=False, rows=9, active={0: 20, 1: 21}))
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not path.exists() or len(path.read_text().splitlines()) < 2):
        time.sleep(0.02)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["step"] == 7 and rows[0]["active"] == [5, 6] and rows[0]["active_stock"] == [12, 13]
    assert rows[0]["routing_us"] == [40.0, 41.5] and rows[0]["decode"] and rows[0]["layers"] == 2
    assert rows[1]["decode"] is False and "active_stock" not in rows[1] and rows[1]["rows"] == 9
    writer._stop.set()


def test_doctor_without_vllm_reports_instead_of_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin_doctor, "engine_version", lambda: None)
    monkeypatch.setenv("OEA_K0", "x")
    checks = plugin.doctor_checks()
    assert all(set(c) == {"name", "ok", "detail"} for c in checks)
    by_name = {c["name"]: c for c in checks}
    assert not by_name["vllm version"]["ok"] and "not installed" in by_name["vllm version"]["detail"]
    assert not by_name["environment"]["ok"] and "OEA_K0" in by_name["environment"]["detail"]
    assert by_name["entry point registered"]["ok"], by_name["entry point registered"]["detail"]


def test_doctor_says_what_the_plugin_does_with_the_layer_k0_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for name in ("OEA_K0", "SGLANG_OEA_K0", "OEA_METRICS_FILE", "OEA_TIMING", "OEA_LAYER_K0_FILE", "OEA_TRACE_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OEA_K0", "2")
    assert plugin_doctor._check_environment() == "OEA on: k0=2 min_batch=2"
    monkeypatch.setenv("OEA_LAYER_K0_FILE", str(tmp_path / "k0.json"))
    with pytest.raises(RuntimeError, match="per-layer k0 file not found"):  # read as register reads it
        plugin_doctor._check_environment()
    write_layer_k0_file(LayerK0Schedule(16, 4, 2, (1, 3)), tmp_path / "k0.json")
    assert plugin_doctor._check_environment() == f"OEA on: k0=2 min_batch=2, k0 per layer from {tmp_path / 'k0.json'}"
    monkeypatch.delenv("OEA_K0")
    env = {c["name"]: c for c in plugin.doctor_checks()}["environment"]
    assert not env["ok"] and "is set but OEA_K0 is not: OEA is off without OEA_K0" in env["detail"]
    monkeypatch.delenv("OEA_LAYER_K0_FILE")
    monkeypatch.setenv("OEA_TIMING", "1")
    assert plugin_doctor._check_environment() == "observe: stock routing, measured, timing"
    monkeypatch.delenv("OEA_TIMING")
    monkeypatch.setenv("OEA_TRACE_FILE", str(tmp_path / "t.safetensors"))
    assert plugin_doctor._check_environment() == (f"observe: stock routing, measured, recording 100% of decode steps "
                                                  f"to {tmp_path / 't.safetensors'} (at most 1024 MB)")


def test_a_broken_layer_k0_file_stops_start_up_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for name in ("OEA_K0", "SGLANG_OEA_K0", "OEA_METRICS_FILE", "OEA_TIMING", "OEA_TRACE_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OEA_K0", "2")
    monkeypatch.setenv("OEA_LAYER_K0_FILE", str(tmp_path / "k0.json"))
    swap_state(monkeypatch, State())
    with pytest.raises(ValueError, match=r"OEA_LAYER_K0_FILE=.*k0\.json.*not found"):
        plugin.register()
    (tmp_path / "k0.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"OEA_LAYER_K0_FILE=.*not valid JSON"):
        plugin.register()
