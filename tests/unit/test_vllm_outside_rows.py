"""The vLLM plugin's ``outside_rows`` metric (issue 36): rows routed outside any engine step (a DP rank's dummy
batch, a warm-up forward) are counted once per forward, not once per MoE layer, and go into the next step's
``OEA_METRICS_FILE`` row.

Driven as vLLM drives the plugin, with the stand-ins of ``vllm_stand_ins`` (no vLLM needed): a model of several
MoE layers (one stand-in router each, as ``Worker.load_model`` numbers them), the worker hook's ``begin_step`` /
``end_step`` around an engine step, and the CPU op's body (``cpu_route_body``) for each layer's routing call,
in layer order; the rows are read back from a real ``MetricsWriter``'s file. (The SGLang plugin's equivalent is
in ``test_sglang_metrics_rows.py``.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm_stand_ins import loaded_state, scheduler_output

import oea.integrations.vllm.routing as plugin_routing
import oea.integrations.vllm.steps as plugin_steps
from oea.integrations.metrics import MetricsWriter
from oea.integrations.vllm.router_state import router_state
from oea.integrations.vllm.state import State

torch.set_num_threads(1)
N, K, LAYERS = 64, 8, 4


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[MetricsWriter]:
    """A metrics writer that flushes only when the test asks (its thread waits an hour)."""
    metrics = MetricsWriter(str(tmp_path / "metrics.jsonl"), interval=3600.0)
    yield metrics
    metrics._stop.set()


def _state(monkeypatch: pytest.MonkeyPatch, writer: MetricsWriter) -> State:
    state = loaded_state(monkeypatch, {"OEA_K0": "2"}, LAYERS, N, K)
    state.metrics = writer
    return state


def _forward(state: State, rows: int, seed: int) -> None:
    """One forward pass: each supported MoE layer's routing call in layer order (an unsupported layer's router
    never reaches the op: ``cpu_wrapper`` hands vLLM's routing back for it)."""
    gen = torch.Generator().manual_seed(seed)
    for router_id, router in enumerate(state.routers):
        if state.specs[router_id] is None:
            continue
        logits = torch.stack([torch.randperm(N, generator=gen) for _ in range(rows)]).float() / 8
        weights, ids = router.route_stock(logits)
        plugin_routing.cpu_route_body(logits, weights, ids, router_id)


def _step(state: State, rows: int, seed: int) -> None:
    """An engine step (a decode step of ``rows`` requests) through the worker hook."""
    plugin_steps.begin_step(scheduler_output([1] * rows))
    try:
        _forward(state, rows, seed)
    finally:
        plugin_steps.end_step()


def _rows(writer: MetricsWriter) -> list[dict]:
    writer.flush()
    return [json.loads(line) for line in Path(writer.path).read_text().splitlines()]


def test_rows_outside_a_step_are_counted_once_per_forward_not_per_layer(monkeypatch: pytest.MonkeyPatch,
                                                                       writer: MetricsWriter) -> None:
    state = _state(monkeypatch, writer)
    _step(state, 4, seed=0)
    _forward(state, 3, seed=1)  # a DP dummy batch between steps: 3 rows through all 4 MoE layers
    _step(state, 4, seed=2)
    _forward(state, 3, seed=3)  # two forwards before the next step: their rows add up
    _forward(state, 5, seed=4)
    _step(state, 4, seed=5)
    _step(state, 4, seed=6)
    rows = _rows(writer)
    assert [r["layers"] for r in rows] == [LAYERS] * 4, "each step routed every layer"
    assert [r["outside_rows"] for r in rows] == [0, 3, 8, 0], "per forward (3, 3 + 5), not per layer (12, 32)"
    assert [r["rows"] for r in rows] == [4] * 4, "the outside rows are not the step's own"
    assert state.metrics is not None and state.metrics.outside_rows == 0


@pytest.mark.parametrize("first", ["unsupported", "failed"])
def test_the_first_layer_unsupported_or_failed_still_counts_each_forward_once(
        monkeypatch: pytest.MonkeyPatch, writer: MetricsWriter, first: str) -> None:
    """The count is taken at the first MoE layer that reaches the op: a model whose first MoE layer the plugin
    cannot route (it never reaches the op) counts at the next one, neither zero times nor once per layer; a
    first layer whose OEA raised (stock from then on) still reaches the op and counts."""
    state = _state(monkeypatch, writer)
    if first == "unsupported":
        state.specs[0] = None
    else:
        plugin_routing.keep_stock_after_error(0, RuntimeError("stand-in kernel error"))
        assert router_state(0).failed
    _step(state, 4, seed=0)
    _forward(state, 6, seed=1)
    _step(state, 4, seed=2)
    assert [r["outside_rows"] for r in _rows(writer)] == [0, 6]
