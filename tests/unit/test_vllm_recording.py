"""Recording decode steps in the vLLM plugin (``OEA_TRACE_FILE``) with stand-ins for vLLM (no vLLM needed): the
worker hook, the CPU op and the graph wrapper stage each step's router logits, the step's rows go to the trace
with the persistent batch's request ids and positions, and start-up reads and checks the variables."""

from __future__ import annotations

import logging
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm_stand_ins import CPURouter, fresh_state, install_vllm, scheduler_output

import oea
import oea.integrations.vllm.plugin as plugin_module
import oea.integrations.vllm.recording as recording
import oea.integrations.vllm.routing as plugin_routing
import oea.integrations.vllm.steps as plugin_steps
from oea.config import trace_settings_from_env
from oea.traces import load_trace

torch.set_num_threads(1)


N, K = 64, 8


def _model_runner(requests: list[str], computed: list[int], max_num_seqs: int = 8) -> SimpleNamespace:
    """The few model-runner fields the recording reads: the persistent batch, ``max_num_seqs``, the model."""
    batch = SimpleNamespace(req_ids=[*requests, None], num_reqs=len(requests),
                            num_computed_tokens_cpu=np.array([*computed, 0]))
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs), speculative_config=None)
    return SimpleNamespace(input_batch=batch, vllm_config=config, model_config=SimpleNamespace(model="stand-in"))


def _start(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, env: dict[str, str], routers: int = 2):
    install_vllm(monkeypatch)
    path = tmp_path / "trace.safetensors"
    state = fresh_state(monkeypatch, {**env, "OEA_TRACE_FILE": str(path)})
    for i in range(routers):
        router = CPURouter(num_experts=N, top_k=K)
        router._oea_router_id, router._oea_layer = i, f"model.layers.{i}.mlp"
        state.routers.append(router)
        state.specs.append(plugin_module.router_spec(router)[0])
    state.mode = "oea" if "OEA_K0" in env else "observe"
    state.trace_settings = trace_settings_from_env({"OEA_TRACE_FILE": str(path)})
    state.model_runner = _model_runner([], [])
    recording.start_recording(state.trace_settings, state.model_runner, torch.device("cpu"))
    assert state.recorder is not None
    return state, path


def _step(state, requests: list[str], computed: list[int], logits: list[torch.Tensor], tokens: list[int] | None = None,
          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One engine step: the persistent batch holds ``requests``; every router's CPU op runs once."""
    state.model_runner = _model_runner(requests, computed)
    tokens = tokens or [1] * len(requests)
    output = scheduler_output(tokens)
    output.num_scheduled_tokens = dict(zip(requests, tokens, strict=True))
    plugin_steps.begin_step(output)
    try:
        outs = []
        for router_id, x in enumerate(logits):
            stock = state.routers[router_id].route_stock(x)
            outs.append(plugin_routing.cpu_route_body(x, stock[0], stock[1], router_id))
        return outs
    finally:
        plugin_steps.end_step()


def _logits(rows: int, seed: int) -> torch.Tensor:
    return (torch.randn(rows, N, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16)


def test_decode_steps_are_recorded_with_their_rows_requests_and_positions(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: pathlib.Path) -> None:
    state, path = _start(monkeypatch, tmp_path, {})
    steps = [(["b", "a", "c"], [10, 4, 7], 1), (["x"], [30], 5), (["a", "c", "b", "d"], [5, 8, 11, 2], 1)]
    inputs = []
    for n, (requests, computed, tokens) in enumerate(steps):
        logits = [_logits(len(requests) * tokens, 10 * n + r) for r in range(2)]
        _step(state, requests, computed, logits, [tokens] * len(requests))
        inputs.append((state.step, requests, computed, logits, tokens == 1))
    trace = load_trace(str(state.recorder.close()))
    decode = [s for s in inputs if s[4]]  # the 5-token step is a prefill: not recorded
    assert trace.step_ids.tolist() == [s[0] for s in decode for _ in s[1]] == [1, 1, 1, 3, 3, 3, 3]
    expected = torch.cat([torch.stack(s[3], dim=1) for s in decode]).float()  # [T, L, N]
    assert torch.equal(trace.logits, expected) and trace.meta["recorded"] == "full router logits (bfloat16)"
    assert [trace.meta["request_names"][i] for i in trace.request_ids.tolist()] == ["b", "a", "c", "a", "c", "b", "d"]
    assert trace.positions.tolist() == [10, 4, 7, 5, 8, 11, 2]
    assert trace.meta["layer_names"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert any("observe mode" in note for note in trace.meta["notes"]) and path.with_suffix(".json").exists()


def test_with_oea_on_the_trace_holds_the_logits_before_the_rewrite(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: pathlib.Path) -> None:
    state, _ = _start(monkeypatch, tmp_path, {"OEA_K0": "2"})
    logits = [_logits(6, 1), _logits(6, 2)]
    outs = _step(state, list("abcdef"), [3] * 6, logits)
    spec = state.specs[0]
    rewritten = [int(oea.active_experts(ids.long(), w)) for w, ids in outs]
    trace = load_trace(str(state.recorder.close()))
    replayed = [int(oea.active_experts(*oea.route(trace.logits[:, layer], spec))) for layer in range(2)]
    assert trace.logits.equal(torch.stack(logits, 1).float())
    assert all(r < v for r, v in zip(rewritten, replayed, strict=True)), "the step was rewritten, the trace was not"
    with_oea = [int(oea.active_experts(*oea.route(trace.logits[:, layer], spec, oea.OEAConfig(2))))
                for layer in range(2)]
    assert with_oea == rewritten, "replaying OEA from the trace gives what the engine routed"


def test_sampling_records_only_the_chosen_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    state, _ = _start(monkeypatch, tmp_path, {})
    state.recorder.settings = trace_settings_from_env({"OEA_TRACE_FILE": "x.safetensors", "OEA_TRACE_SAMPLE": "0.3"})
    for n in range(40):
        _step(state, ["a", "b"], [n, n], [_logits(2, n), _logits(2, 100 + n)])
    trace = load_trace(str(state.recorder.close()))
    recorded = sorted(set(trace.step_ids.tolist()))
    assert 4 <= len(recorded) <= 24 and len(recorded) == trace.meta["steps_recorded"]
    assert all(trace.positions[trace.step_ids == s].tolist() == [s - 1, s - 1] for s in recorded)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_graph_wrapper_stages_every_call_and_records_sampled_decode_steps(
        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """The GPU-side wrapper traced as for CUDA graphs (observe mode): the staging copy is part of the graph."""
    state, _ = _start(monkeypatch, tmp_path, {}, routers=1)
    router = state.routers[0]

    def stock(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        return self.route_stock(router_logits)

    wrapped = plugin_routing.graph_wrapper(stock)
    compiled = torch.compile(lambda x: wrapped(router, None, x, None), fullgraph=True, dynamic=False)
    inputs = [_logits(4, 50 + n).float() for n in range(3)]
    for n, x in enumerate(inputs):
        state.model_runner = _model_runner(list("wxyz"), [n] * 4)
        output = scheduler_output([1, 1, 1, 1])
        output.num_scheduled_tokens = dict.fromkeys("wxyz", 1)
        plugin_steps.begin_step(output)
        compiled(x)
        plugin_steps.end_step()
    trace = load_trace(str(state.recorder.close()))
    assert torch.equal(trace.logits[:, 0], torch.cat(inputs)) and trace.step_ids.tolist() == [1] * 4 + [2] * 4 + [3] * 4


def test_register_reads_the_trace_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    install_vllm(monkeypatch)
    fresh_state(monkeypatch, {})
    monkeypatch.setattr(plugin_module, "install_hooks", lambda: [])
    monkeypatch.setenv("OEA_TRACE_FILE", str(tmp_path / "t.safetensors"))
    plugin_module.register()
    assert plugin_module.STATE.mode == "observe" and plugin_module.STATE.trace_settings is not None

    fresh_state(monkeypatch, {})
    monkeypatch.setenv("OEA_TRACE_FILE", str(tmp_path / "missing" / "t.safetensors"))
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        plugin_module.register()
    assert not plugin_module.STATE.installed and plugin_module.STATE.trace_settings is None  # nothing else set
    assert any("cannot be written" in r.getMessage() and "serving without recording" in r.getMessage()
               for r in caplog.records)

    fresh_state(monkeypatch, {})
    monkeypatch.setenv("OEA_TRACE_SAMPLE", "2")
    with pytest.raises(ValueError, match=r"OEA_TRACE_SAMPLE must be a number in \(0, 1\]"):
        plugin_module.register()


@pytest.mark.parametrize("tokens, positions", [
    ([1, 1, 1], [10, 4, 7]),  # one token each: read straight from the persistent batch
    ([3, 1, 2], [10, 11, 12, 4, 7, 8]),  # verified draft tokens: one row per token, positions counting up
])
def test_rows_follow_the_persistent_batch_with_one_row_per_scheduled_token(monkeypatch: pytest.MonkeyPatch,
                                                                           tokens: list[int],
                                                                           positions: list[int]) -> None:
    state = fresh_state(monkeypatch, {})
    state.model_runner = _model_runner(["b", "a", "c"], [10, 4, 7])
    output = SimpleNamespace(num_scheduled_tokens=dict(zip(["a", "b", "c"], [tokens[1], tokens[0], tokens[2]],
                                                           strict=True)),
                             total_num_scheduled_tokens=sum(tokens))
    requests, rows = recording._rows_of(output)
    assert requests == [r for r, n in zip(["b", "a", "c"], tokens, strict=True) for _ in range(n)]
    assert rows == positions and all(type(p) is int for p in rows)
