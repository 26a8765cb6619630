"""Speculative decoding in the vLLM plugin, with stand-ins for vLLM (no vLLM needed): verify steps keep vLLM's
routing unless ``OEA_APPLY_TO_VERIFY=1``, are then routed as ``oea.route`` over all their rows, the metrics
say what each step carried, and speculation settings in a layout the plugin cannot read (a stand-in for a
vLLM that moved them) give one warning and stock routing for every verify step."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from vllm_stand_ins import CPURouter, dense, fresh_state, install_vllm

import oea.integrations.metrics as plugin_metrics
import oea.integrations.vllm.plugin as plugin_hooks
import oea.integrations.vllm.routing as plugin_routing
import oea.integrations.vllm.steps as plugin_steps
from oea.integrations.vllm.speculative import Speculation, read_speculation, step_shape
from oea.routing import OEAConfig, route

torch.set_num_threads(1)
N, K = 64, 8
NGRAM = Speculation("ngram", 3)


def _output(tokens: list[int], drafts: dict[int, list[int]] | None = None, field: object = "dict") -> SimpleNamespace:
    """A ``SchedulerOutput``: request ``r{i}`` runs ``tokens[i]`` tokens, ``drafts[i]`` are its draft token ids.
    ``field="missing"`` leaves out ``scheduled_spec_decode_tokens``; any other non-"dict" value replaces it."""
    scheduled = {f"r{i}": n for i, n in enumerate(tokens)}
    out = SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(tokens))
    if field == "dict":
        out.scheduled_spec_decode_tokens = {f"r{i}": d for i, d in (drafts or {}).items()}
    elif field != "missing":
        out.scheduled_spec_decode_tokens = field
    return out


def _logits(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(N, generator=gen) for _ in range(rows)]).float() / 8


def _run(router: CPURouter, output: SimpleNamespace, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step through the worker hook and the CPU op: (logits, plugin routing as dense [M, N], stock dense)."""
    logits = _logits(output.total_num_scheduled_tokens, seed)
    stock = router.route_stock(logits)
    plugin_steps.begin_step(output)
    try:
        weights, ids = plugin_routing.cpu_route_body(logits, stock[0], stock[1], 0)
    finally:
        plugin_steps.end_step()
    return logits, dense(weights, ids, N), dense(*stock, N)


def _oea(logits: torch.Tensor, k0: int = 2) -> torch.Tensor:
    ids, weights = route(logits, CPURouter().spec(), OEAConfig(k0, min_batch=0))
    return dense(weights, ids, N)


def _state(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], speculation: Speculation | None = NGRAM):
    install_vllm(monkeypatch)
    router = CPURouter()
    state = fresh_state(monkeypatch, env, router)
    state.speculation = speculation
    added: list[plugin_metrics.StepRecord] = []
    state.metrics = type("Sink", (), {"add": lambda self, step, record: added.append(record), "outside_rows": 0})()
    return state, router, added


VERIFY = ([4, 4, 1], {0: [11, 12, 13], 1: [21, -1, -1]})  # r1's drafts padded with vLLM's -1 placeholders


def test_verify_steps_keep_vllms_routing_unless_apply_to_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    state, router, added = _state(monkeypatch, {"OEA_K0": "2"})
    logits, out, stock = _run(router, _output(*VERIFY), seed=1)
    assert torch.equal(out, stock) and not state.decode
    logits, out, _ = _run(router, _output([1, 1, 1], {}), seed=2)  # a decode step without drafts: rewritten
    torch.testing.assert_close(out, _oea(logits))
    verify, decode = added
    assert (verify.decode, verify.verify, verify.oea, verify.tokens_per_request) == (False, True, False, [4, 4, 1])
    assert int(verify.active[0]) == int(verify.active_stock[0]) and verify.rows == 9
    assert (decode.decode, decode.verify, decode.oea, decode.tokens_per_request) == (True, False, True, [1, 1, 1])


@pytest.mark.parametrize("tokens, drafts", [VERIFY, ([4], {0: [5, 6, 7]})])
def test_apply_to_verify_routes_every_row_of_a_verify_step_as_oea_route(
        monkeypatch: pytest.MonkeyPatch, tokens: list[int], drafts: dict[int, list[int]]) -> None:
    """All 1 + d rows of every request join one union; one request's four verify rows reach OEA_MIN_BATCH = 2."""
    _, router, added = _state(monkeypatch, {"OEA_K0": "2", "OEA_APPLY_TO_VERIFY": "1"})
    logits, out, stock = _run(router, _output(tokens, drafts), seed=3)
    torch.testing.assert_close(out, _oea(logits))
    assert not torch.equal(out, stock)
    (record,) = added
    assert (record.decode, record.verify, record.oea, record.rows) == (True, True, True, sum(tokens))
    assert int(record.active[0]) < int(record.active_stock[0])
    _, out, stock = _run(router, _output([4, 1], {0: [5, 6]}), seed=4)  # 4 tokens but 2 drafts: a prefill chunk
    assert torch.equal(out, stock) and not added[-1].decode and not added[-1].verify
    _, out, stock = _run(router, _output([4, 5], {0: [5, 6, 7]}), seed=5)  # a verify request beside a prefill
    assert torch.equal(out, stock) and not added[-1].decode and not added[-1].verify
    assert added[-1].tokens_per_request == [4, 5]


def test_metrics_lines_say_whether_a_step_verified_and_what_each_request_carried(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    writer = plugin_metrics.MetricsWriter(str(path), interval=60.0)
    writer.add(7, plugin_metrics.StepRecord(decode=True, oea=True, rows=9, active={0: 12}, verify=True,
                                            tokens_per_request=[4, 4, 1]))
    writer.add(8, plugin_metrics.StepRecord(decode=False, oea=False, rows=5, active={0: 30}, tokens_per_request=[5]))
    writer.flush()
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert (first["verify"], first["tokens_per_request"], first["decode"]) == (True, [4, 4, 1], True)
    assert (second["verify"], second["tokens_per_request"]) == (False, [5])


@pytest.mark.parametrize("field", ["missing", torch.zeros(3, 2), {"r0": 3}])
def test_unreadable_draft_tokens_warn_once_and_verify_steps_keep_vllms_routing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, field: object) -> None:
    """A stand-in for a vLLM whose SchedulerOutput no longer has ``scheduled_spec_decode_tokens`` as a dict of
    token lists (missing, a tensor, counts): verify steps stay stock with OEA_APPLY_TO_VERIFY=1, decode steps do not."""
    state, router, _ = _state(monkeypatch, {"OEA_K0": "2", "OEA_APPLY_TO_VERIFY": "1"})
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        for seed in range(3):
            _, out, stock = _run(router, _output([4, 4], field=field), seed=10 + seed)
            assert torch.equal(out, stock) and not state.decode
        logits, out, _ = _run(router, _output([1, 1], field=field), seed=20)
    torch.testing.assert_close(out, _oea(logits))
    warnings = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "cannot read vLLM's speculative decoding" in warnings[0] and "scheduled_spec_decode_tokens" in warnings[0]
    assert "verify steps keep vLLM's routing" in warnings[0]
    assert not state.verify_readable


def test_a_missing_draft_field_is_no_problem_while_speculation_is_off(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    state, router, _ = _state(monkeypatch, {"OEA_K0": "2", "OEA_APPLY_TO_VERIFY": "1"}, speculation=None)
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        logits, out, _ = _run(router, _output([1, 1, 1], field="missing"), seed=30)
    torch.testing.assert_close(out, _oea(logits))
    assert state.verify_readable and not caplog.records


class _MoELayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, N, bias=False)
        self.router = CPURouter()


@pytest.mark.parametrize("config, problem", [
    (SimpleNamespace(speculative_config=SimpleNamespace(method="ngram", num_draft_tokens=3)),
     "has no integer num_speculative_tokens >= 1 (got None)"),
    (SimpleNamespace(speculative_config=SimpleNamespace(method="ngram", num_speculative_tokens="3")),
     "(got '3')"),
    (SimpleNamespace(draft_config=None), "has no speculative_config"),
])
def test_speculation_settings_in_another_layout_warn_at_load_and_verify_steps_stay_stock(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, config: SimpleNamespace,
        problem: str) -> None:
    """``Worker.load_model``'s hook reads ``vllm_config.speculative_config``; a stand-in config in another layout:
    one warning naming what is missing, then verify steps keep vLLM's routing though their drafts are readable."""
    install_vllm(monkeypatch)
    state = fresh_state(monkeypatch, {"OEA_K0": "2", "OEA_APPLY_TO_VERIFY": "1"})
    state.model_runner = SimpleNamespace(vllm_config=config)
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        plugin_hooks._after_load(torch.nn.Sequential(_MoELayer(), _MoELayer()))
        router = state.routers[0]
        _, out, stock = _run(router, _output(*VERIFY), seed=40)
        logits, decode_out, _ = _run(router, _output([1, 1]), seed=41)
    assert torch.equal(out, stock)
    torch.testing.assert_close(decode_out, _oea(logits))
    warnings = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert len(warnings) == 1 and problem in warnings[0], warnings
    assert state.speculation is None and not state.verify_readable


def test_readable_settings_are_read_at_load(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    install_vllm(monkeypatch)
    state = fresh_state(monkeypatch, {"OEA_K0": "2", "OEA_APPLY_TO_VERIFY": "1"})
    spec_config = SimpleNamespace(method="ngram", num_speculative_tokens=3)
    state.model_runner = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec_config))
    with caplog.at_level(logging.INFO, logger="vllm.oea"):
        plugin_hooks._after_load(torch.nn.Sequential(_MoELayer()))
    assert state.speculation == NGRAM and state.verify_readable
    assert any("speculative decoding ngram with up to 3 draft tokens: verify steps rewritten (OEA_APPLY_TO_VERIFY=1)"
               in r.getMessage() for r in caplog.records)
    assert read_speculation(SimpleNamespace(speculative_config=None)) == (None, "")
    assert read_speculation(None) == (None, "")


def test_step_shape_counts_placeholder_drafts_as_rows() -> None:
    shape, problem = step_shape(_output(*VERIFY), speculating=True)
    assert problem == "" and shape.tokens == (4, 4, 1) and shape.drafts == (3, 3, 0)
    assert shape.verify and shape.decode_shaped
    assert plugin_steps.is_decode_step(_output(*VERIFY), apply_to_verify=True)
    assert not plugin_steps.is_decode_step(_output(*VERIFY))
    assert not plugin_steps.is_decode_step(_output(*VERIFY, field="missing"), apply_to_verify=True)
