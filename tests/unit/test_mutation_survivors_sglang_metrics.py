"""What the generated mutants of ``oea/integrations/sglang/prometheus.py`` and ``metrics.py`` found unguarded
(docs/testing.md, "Generated mutants"), driven as SGLang drives the plugin (``test_sglang_metrics_rows``'s
``start``: ``register``, then the forward-context and post-process hooks) with the SGLang stand-ins.

The Prometheus export: the ``model_name`` label from each place an SGLang keeps its served name (and "" with one
warning naming both failures when neither says), a ``PROMETHEUS_MULTIPROC_DIR`` that cannot be used, the trace
recorder's series, the start-up line, the doctor's line read from the process's environment, and the per-layer
series at 0 from the first forward that routed.

The metrics rows: ``tokens_per_request`` of each kind of forward (absent where the batch does not say), the real
rows of a padded call (``num_token_non_padded``: the same row as without the padding), what a rewritten call
hands SGLang counted as ``active``, the layers' own ids, calls without a layer id, rows outside forwards summed over
passes (a one-layer model too), each layer's routing time (SGLang's top-k in the calls OEA leaves, OEA's rewrite
in the others; a stand-in clock), why a step kept SGLang's routing when one layer did, a forward with no batch,
the flush interval, and the warnings when the file, the export or a routing call's metrics fail."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
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

import oea
import oea.integrations.sglang.metrics as sglang_metrics
import oea.integrations.sglang.prometheus as sglang_prometheus
import oea.integrations.sglang.recording as sglang_recording
import oea.integrations.sglang.routing as sglang_routing
from oea.integrations import sglang as plugin
from oea.integrations.prometheus import Exporter

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


# -- metrics.py: the rows ----------------------------------------------------------------------------------------

EXPERTS = metrics_rows.EXPERTS


def _logits(rows: int, seed: int, favour: range | None = None) -> torch.Tensor:
    """[rows, EXPERTS] router logits; ``favour``: experts every row ranks first (in that order)."""
    logits = torch.randn(rows, EXPERTS, generator=torch.Generator().manual_seed(seed))
    if favour is not None:
        logits[:, list(favour)] += 100.0 - 10.0 * torch.arange(len(favour), dtype=torch.float32)
    return logits


def _call(server: Server, layer: Any, logits: torch.Tensor, non_padded: Any = None,
          cfg: SimpleNamespace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer's routing call as SGLang makes it (its softmax top-8 of ``logits``) through the plugin's
    post-process hook; the ids and weights SGLang goes on with."""
    ids, weights = oea.route(logits, oea.RouterSpec(EXPERTS, 8), oea.OEAConfig(8))
    kwargs = dict(topk_ids=ids.int(), topk_weights=weights, topk_config=cfg or CONFIGS[0], router_logits=logits,
                  layer_id=layer, num_token_non_padded=non_padded, expert_location_dispatch_info=None)
    changed = server.hooks[plugin.POST_PROCESS_TARGET](**kwargs)
    kept = kwargs if changed is None else changed[1]
    return kept["topk_ids"], kept["topk_weights"]


def _distinct(ids: torch.Tensor, weights: torch.Tensor) -> int:
    """Distinct experts with non-zero weight: what ``active`` counts."""
    return len(set(ids[weights != 0].tolist()))


def _forward_of(server: Server, mode: FakeMode, **batch: Any) -> Any:
    """The forward-context hook around a stand-in ``ForwardBatch`` with ``batch``'s fields."""
    forward_batch = SimpleNamespace(forward_mode=mode, **batch)

    def sglang_forward_context(_ctx: Any, *, forward_batch: Any = None) -> Any:
        return contextlib.nullcontext()

    return server.hooks[plugin.FORWARD_CONTEXT_TARGET](sglang_forward_context, None, forward_batch=forward_batch)


@pytest.mark.parametrize(("mode", "batch", "expected"), [
    (FakeMode.DECODE, {"batch_size": 3}, [1, 1, 1]),
    (FakeMode.TARGET_VERIFY, {"batch_size": 2, "spec_info": SimpleNamespace(draft_token_num=4)}, [4, 4]),
    (FakeMode.TARGET_VERIFY, {"batch_size": 2}, None),  # no draft count: not said
    (FakeMode.TARGET_VERIFY, {"spec_info": SimpleNamespace(draft_token_num=4)}, None),  # no batch size
    (FakeMode.EXTEND, {"batch_size": 3, "extend_seq_lens_cpu": [5, 2, 7]}, [5, 2, 7]),
    (FakeMode.EXTEND, {"batch_size": 3}, None),
    (FakeMode.EXTEND, {"extend_seq_lens_cpu": [5, 2]}, [5, 2]),  # a prompt chunk's lengths need no batch size
    (FakeMode.DECODE, {}, None),  # a batch that does not say its size: not an empty step
    (FakeMode.DECODE, {"batch_size": None}, None),
])
def test_tokens_per_request_of_each_kind_of_forward(start: Any, mode: FakeMode, batch: dict[str, Any],
                                                    expected: list[int] | None) -> None:
    server = start(OEA_K0="2", OEA_APPLY_TO_VERIFY="1")
    with _forward_of(server, mode, **batch):
        for layer in LAYERS:
            _call(server, layer, _logits(4, layer))
    (row,) = server.rows()
    assert row.get("tokens_per_request") == expected, row


def test_a_forward_without_a_batch_is_counted_outside_the_decode_phase(start: Any) -> None:
    """SGLang entering ``forward_context`` without a batch (no forward mode): its calls are a row of neither phase,
    and the metrics never raise into the forward."""
    server = start(OEA_K0="2")
    with server.hooks[plugin.FORWARD_CONTEXT_TARGET](lambda _ctx, *, forward_batch=None: contextlib.nullcontext(),
                                                     None, forward_batch=None):
        for layer in LAYERS:
            _call(server, layer, _logits(3, layer))
    (row,) = server.rows()
    assert (row["decode"], row["verify"], row["oea"], row["rows"]) == (False, False, False, 3), row
    assert "tokens_per_request" not in row and "reason" not in row


@pytest.mark.parametrize("mode", [FakeMode.EXTEND, FakeMode.DECODE])
def test_a_padded_call_counts_only_its_real_rows(start: Any, mode: FakeMode) -> None:
    """5 rows of which SGLang says 3 are real (``num_token_non_padded``), the 2 padding rows routed to experts no
    real row uses: the row is the one of the 3 real rows alone, plus ``padding_rows``."""
    server = start(OEA_K0="2")
    real = _logits(3, 1, favour=range(8))
    padded = torch.cat([real, _logits(2, 2, favour=range(56, 64))])
    with server.forward(mode, 3):
        kept = [_call(server, layer, padded, non_padded=torch.tensor(3)) for layer in LAYERS]
    with server.forward(mode, 3):
        alone = [_call(server, layer, real.clone()) for layer in LAYERS]
    with_padding, without = server.rows()
    assert (with_padding["rows"], with_padding["padding_rows"]) == (3, 2)
    assert (without["rows"], without["padding_rows"]) == (3, 0)
    for field in ("active", "active_stock", "oea", "decode", "layers"):
        assert with_padding[field] == without[field], field
    if mode == FakeMode.EXTEND:  # SGLang's ids (a rewrite's zero-weight fillers come from the call's experts)
        assert with_padding["routed"] == without["routed"]
    assert with_padding["active"] == [_distinct(ids, weights) for ids, weights in alone]
    for ids, _ in kept:
        assert set(ids[3:].flatten().tolist()) <= set(range(56, 64)), "the padding rows kept SGLang's routing"


def test_a_rewritten_call_counts_the_ids_sglang_goes_on_with(start: Any) -> None:
    server = start(OEA_K0="2")
    logits = {layer: _logits(6, 10 + layer) for layer in LAYERS}
    with server.forward(FakeMode.DECODE, 6):
        kept = {layer: _call(server, layer, logits[layer]) for layer in LAYERS}
    (row,) = server.rows()
    assert row["oea"] and "reason" not in row
    stock = {layer: oea.route(logits[layer], oea.RouterSpec(EXPERTS, 8), oea.OEAConfig(8)) for layer in LAYERS}
    assert row["active"] == [_distinct(*kept[layer]) for layer in LAYERS]
    assert row["active_stock"] == [_distinct(*stock[layer]) for layer in LAYERS]
    assert all(a < s for a, s in zip(row["active"], row["active_stock"], strict=True)), row


def test_layers_are_known_by_their_own_ids(start: Any, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose first layers are dense (MoE layers 3 and 5): the series and the per-layer reasons name
    layers 3 and 5."""
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=lambda: SimpleNamespace(served_model_name="m"))
    server = start(OEA_K0="2")
    unsupported = topk_config(custom_routing_function=lambda *a: None)  # a routing OEA leaves to SGLang
    with server.forward(FakeMode.DECODE, 4):
        _call(server, 3, _logits(4, 3))
        _call(server, 5, _logits(4, 5), cfg=unsupported)
    (row,) = server.rows()
    got = scrape(directory)
    layers = {dict(labels)["layer"] for name, labels in got if name == "oea_active_experts_total"}
    assert layers == {"3", "5"}
    assert [total(got, "oea_active_experts_total", layer=str(x)) for x in (3, 5)] == row["active"]
    assert total(got, "oea_stock_active_experts_total", layer="5") == row["active_stock"][1]


def test_calls_without_a_layer_id_are_counted_in_call_order(start: Any) -> None:
    server = start(OEA_K0="2")
    with server.forward(FakeMode.EXTEND, 3):
        first = _call(server, None, _logits(3, 1, favour=range(8)))
        second = _call(server, None, _logits(3, 2, favour=range(8, 16)))
    with server.forward(FakeMode.EXTEND, 3):
        _call(server, None, _logits(3, 1, favour=range(8)))
    first_row, again = server.rows()
    assert first_row["layers"] == 2 and first_row["active"] == [_distinct(*first), _distinct(*second)] == [8, 8]
    assert all(re.fullmatch("[0-9a-f]{16}", h) for h in first_row["routed"]), first_row["routed"]
    assert first_row["routed"][0] != first_row["routed"][1], "other ids, another hash"
    assert again["routed"] == first_row["routed"][:1], "the same routing, the same hash"


def test_rows_outside_forwards_are_summed_over_passes_in_a_one_layer_model(start: Any) -> None:
    server = start(OEA_K0="2")
    with server.forward(FakeMode.DECODE, 4):
        _call(server, 0, _logits(4, 1))
    _call(server, 0, _logits(3, 2))  # two passes outside any forward (warm-up, DP dummy batches)
    _call(server, 0, _logits(2, 3))
    with server.forward(FakeMode.DECODE, 4):
        _call(server, 0, _logits(4, 4))
    assert [r["outside_rows"] for r in server.rows()] == [0, 5]


def test_why_a_step_kept_sglangs_routing_in_one_layer(start: Any, directory: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0 rewritten in every forward; layer 1 failed (its rewrite raised), then a routing OEA cannot rebuild
    (no listed reason: ``unknown``). Only the layer that kept SGLang's routing is counted, under its reason."""
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=lambda: SimpleNamespace(served_model_name="m"))
    server = start(OEA_K0="2")
    real = sglang_routing.rewrite_topk

    def failing_in_layer_1(*args: Any, **kwargs: Any) -> Any:
        if kwargs["call"].state.layer_id == 1:
            raise RuntimeError("kernel broke")
        return real(*args, **kwargs)

    monkeypatch.setattr(sglang_routing, "rewrite_topk", failing_in_layer_1)
    with server.forward(FakeMode.DECODE, 4):
        _call(server, 0, _logits(4, 1))
        _call(server, 1, _logits(4, 2))
    with server.forward(FakeMode.DECODE, 4):
        _call(server, 0, _logits(4, 3))
        _call(server, 2, _logits(4, 4), cfg=topk_config(custom_routing_function=lambda *a: None))
    failed, unknown = server.rows()
    assert (failed["oea"], failed.get("reason")) == (False, "layer_failed")
    assert (unknown["oea"], unknown.get("reason")) == (False, "unknown")
    got = scrape(directory)
    assert total(got, "oea_passthrough_forwards_total", reason="layer_failed") == 1
    assert total(got, "oea_passthrough_forwards_total", reason="unknown") == 1
    layer_reasons = {(dict(labels)["layer"], dict(labels)["reason"]): value for (name, labels), value in got.items()
                     if name == "oea_layer_passthrough_forwards_total" and value}
    assert layer_reasons == {("1", "layer_failed"): 1}


class _Clock:
    """``time.perf_counter`` as the test sets it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _timed_call(server: Server, clock: _Clock, layer: int, logits: torch.Tensor, top_k_s: float) -> None:
    """``select_experts`` entered, SGLang's top-k taking ``top_k_s``, then its post-processing."""
    server.hooks[plugin.SELECT_EXPERTS_TARGET](hidden_states=None, router_logits=logits, topk_config=CONFIGS[layer],
                                               num_token_non_padded=None)
    clock.now += top_k_s
    _call(server, layer, logits)


def test_each_layers_routing_time_is_sglangs_top_k_or_oeas_rewrite(start: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    server = start(OEA_K0="2", OEA_TIMING="1")
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    real = sglang_routing.rewrite_topk

    def rewrite_taking_4_ms(*args: Any, **kwargs: Any) -> Any:
        clock.now += 0.004
        return real(*args, **kwargs)

    monkeypatch.setattr(sglang_routing, "rewrite_topk", rewrite_taking_4_ms)
    with server.forward(FakeMode.EXTEND, 4):  # left to SGLang: its own top-k's time
        for layer in LAYERS:
            _timed_call(server, clock, layer, _logits(4, layer), 0.025)
    with server.forward(FakeMode.DECODE, 4):  # rewritten: OEA's time
        for layer in LAYERS:
            _timed_call(server, clock, layer, _logits(4, layer), 0.025)
    prefill, decode = server.rows()
    assert prefill["routing_us"] == [pytest.approx(25000.0, abs=0.01)] * 2, prefill
    assert decode["oea"] and decode["routing_us"] == [pytest.approx(4000.0, abs=0.01)] * 2, decode


@pytest.mark.parametrize(("variable", "timing", "timed"), [("1", None, True), ("1", False, False),
                                                           ("", True, True), ("", None, False)])
def test_configure_times_routing_as_told_else_as_oea_timing_says(start: Any, variable: str, timing: bool | None,
                                                                 timed: bool) -> None:
    server = start(OEA_K0="2", **({"OEA_TIMING": variable} if variable else {}))
    settings = sglang_metrics.METRICS.settings
    assert settings is not None
    sglang_metrics.configure(settings, timing=timing)
    _forward(server, FakeMode.DECODE, 3, 1)
    (row,) = server.rows()
    assert ("routing_us" in row) is timed, row


def test_rows_reach_the_file_every_flush_interval(start: Any, tmp_path: Path) -> None:
    server = start(OEA_K0="2", OEA_METRICS_FLUSH_S="0.05")
    _forward(server, FakeMode.DECODE, 3, 1)
    path = tmp_path / "m.jsonl"
    deadline = time.monotonic() + 10.0
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.exists() and len(path.read_text().splitlines()) == 1, "the writer thread flushed on its own"


# -- metrics.py: warnings ----------------------------------------------------------------------------------------

def _all_warnings(caplog: pytest.LogCaptureFixture, *words: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and all(w in r.getMessage() for w in words)]


def test_an_unwritable_metrics_file_is_named_with_why(start: Any, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "missing" / "m.jsonl"
    server = start(OEA_K0="2", OEA_METRICS_FILE=str(missing))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _forward(server, FakeMode.DECODE, 3, 1)
    (said,) = [r.getMessage() for r in _all_warnings(caplog, "OEA_METRICS_FILE")]
    assert said == (f"oea: OEA_METRICS_FILE={missing} cannot be written (folder {str(missing.parent)!r} does not "
                    "exist); serving without metrics"), said


def test_a_metrics_file_that_becomes_unwritable_is_one_warning_from_the_plugins_logger(
        start: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The file is tested once, at the first forward; a folder removed later stops the file at its next write:
    one warning, from the SGLang plugin's logger like its others."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    path = folder / "m.jsonl"
    server = start(OEA_K0="2", OEA_METRICS_FILE=str(path))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _forward(server, FakeMode.DECODE, 3, 1)
        _flush()
        path.unlink()
        folder.rmdir()
        for seed in range(2, 5):
            _forward(server, FakeMode.DECODE, 3, seed)
        _flush()
    said = _all_warnings(caplog, "OEA_METRICS_FILE")
    assert [r.name for r in said] == [LOGGER], [r.getMessage() for r in said]
    assert "no more metrics are recorded" in said[0].getMessage()


def test_an_export_that_cannot_start_is_one_warning_and_the_file_goes_on(
        start: Any, directory: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=lambda: SimpleNamespace(served_model_name="m"))
    monkeypatch.setattr(sglang_prometheus, "process_rank", _raise(RuntimeError("rank unknown")))
    server = start(OEA_K0="2")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _forward(server, FakeMode.DECODE, 3, 1)
        _forward(server, FakeMode.DECODE, 3, 2)
    (said,) = [r.getMessage() for r in _all_warnings(caplog, "Prometheus")]
    assert said == ("oea: the Prometheus export cannot start (RuntimeError: rank unknown); serving continues "
                    "without oea_* series"), said
    assert [(r["decode"], r["oea"]) for r in server.rows()] == [(True, True)] * 2


def test_per_layer_series_that_cannot_be_made_are_one_warning_and_counted_later(
        start: Any, directory: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _module(monkeypatch, "sglang.srt.runtime_context", get_serving=lambda: SimpleNamespace(served_model_name="m"))
    monkeypatch.setattr(Exporter, "set_layers", _raise_any(OSError("disk full")))
    server = start(OEA_K0="2")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _forward(server, FakeMode.DECODE, 3, 1)
        _forward(server, FakeMode.DECODE, 3, 2)
    _flush()
    (said,) = [r.getMessage() for r in _all_warnings(caplog, "Prometheus")]
    assert said == ("oea: the Prometheus per-layer series cannot be made (OSError: disk full); they appear at "
                    "their first count, serving continues"), said
    got = scrape(directory)
    assert total(got, "oea_rewritten_forwards_total") == 2
    assert {dict(labels)["layer"] for name, labels in got if name == "oea_active_experts_total"} == {"0", "1"}


def _raise_any(err: Exception) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise err
    return fail


def test_a_routing_call_whose_metrics_fail_is_one_warning_per_kind_of_failure(
        start: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An SGLang whose post-processing gets other arguments: the call is not counted, one warning per kind of
    failure, and nothing raises into the forward."""
    server = start(OEA_K0="2")
    logits = _logits(3, 1)
    ids, weights = oea.route(logits, oea.RouterSpec(EXPERTS, 8), oea.OEAConfig(8))
    good = dict(topk_ids=ids.int(), topk_weights=weights, topk_config=CONFIGS[0], router_logits=logits, layer_id=0,
                num_token_non_padded=None, expert_location_dispatch_info=None)
    hook = server.hooks[plugin.POST_PROCESS_TARGET]
    with caplog.at_level(logging.INFO, logger=LOGGER), server.forward(FakeMode.EXTEND, 3):
        hook(**{k: v for k, v in good.items() if k != "topk_weights"})  # KeyError
        hook(**{**good, "layer_id": 1, "topk_config": SimpleNamespace()})  # AttributeError
        hook(**{k: v for k, v in good.items() if k != "topk_weights"} | {"layer_id": 2})  # KeyError again
        hook(**{**good, "layer_id": 3})
    said = [r.getMessage() for r in _all_warnings(caplog, "metrics of a routing call failed")]
    assert len(said) == 2, said
    assert said[0].startswith("oea: metrics of a routing call failed (KeyError: 'topk_weights')"), said
    assert said[1].startswith("oea: metrics of a routing call failed (AttributeError: "), said
    assert all(s.endswith("such calls are not counted, serving continues") for s in said), said
    (row,) = server.rows()
    assert row["layers"] == 1, "only the call whose metrics worked"
