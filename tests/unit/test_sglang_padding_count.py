"""CUDA-graph padding rows out of the OEA union (``oea.integrations.sglang.padding``), with stand-ins.

A stand-in graph runner follows SGLang's replay contract (pad the batch to the next captured size, leave
``raw_num_token``; padding rows keep stale inputs); a stand-in "captured graph" holds what the routing
returned at capture and re-runs the rewrite with it at every replay, as a CUDA graph re-runs its kernels on
the same tensors. SGLang's real runners are driven in tests/engines/test_sglang_padding.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_stand_ins import FakeMode, fresh_state

import oea
import oea.integrations.sglang.hooks as plugin_hooks
import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.routing as plugin_routing
from oea.config import settings_from_env
from oea.integrations.sglang.routing import rewrite_topk
from oea.integrations.sglang.state import STATE

torch.set_num_threads(1)
E, TOP_K, K0, LAYERS = 64, 8, 2, 4
SPEC = oea.RouterSpec(E, TOP_K, "softmax", True)
CFG = oea.OEAConfig(K0)


@pytest.fixture(autouse=True)
def oea_on(monkeypatch: pytest.MonkeyPatch):
    # the rewrite's kernel choice does not matter here; oea.route spares each process a JIT compile
    monkeypatch.setattr(plugin_routing, "route_fast", oea.route, raising=False)
    fresh_state(monkeypatch)
    STATE.settings = settings_from_env({"OEA_K0": str(K0)})
    STATE.padding_hooked = {"cuda": True, "cpu": True}  # as found at the first forward with both hooks in place
    STATE.phase_hook_seen = True
    yield


def _batch(rows: int, seed: int = 0) -> SimpleNamespace:
    ids = torch.randint(0, 1000, (rows,), generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(forward_mode=FakeMode.DECODE, input_ids=ids, batch_size=rows)


def _sglang_context(ctx: Any, forward_batch: Any = None) -> contextlib.AbstractContextManager[None]:
    """Stands for SGLang's own ``forward_context`` (the hooked function's original)."""
    return contextlib.nullcontext()


def _forward(batch: Any) -> contextlib.AbstractContextManager[Any]:
    """A forward pass over ``batch`` as SGLang enters it: ``forward_context(ctx, forward_batch=batch)``, hooked."""
    return plugin_hooks._forward_context_around(_sglang_context, None, forward_batch=batch)


def _logits_of(ids: torch.Tensor) -> torch.Tensor:
    """Deterministic router logits of each token id: [M] -> [M, E]."""
    table = torch.randn(1000, E, generator=torch.Generator().manual_seed(1)) * 2.0
    return table[ids]


class StandInGraphRunner:
    """SGLang's decode graph runner contract: ``load_batch`` pads to the next captured size, copies the real
    rows into persistent buffers (padding rows keep stale inputs) and leaves ``raw_num_token``."""

    capture_forward_mode = FakeMode.DECODE

    def __init__(self, capture_bs: tuple[int, ...] = (4, 8, 16)) -> None:
        self.capture_bs = capture_bs
        self.input_ids = torch.zeros(max(capture_bs), dtype=torch.int64)
        self.raw_num_token = 0
        self.bs = 0

    def _load_batch(self, forward_batch: Any) -> None:
        raw = forward_batch.input_ids.shape[0]
        self.bs = next(bs for bs in self.capture_bs if bs >= raw)
        self.input_ids[:raw].copy_(forward_batch.input_ids)
        self.raw_num_token = raw

    def load_batch(self, forward_batch: Any) -> None:  # as installed: AROUND the original
        return padding.replay_around(StandInGraphRunner._load_batch, self, forward_batch)


def _capture(runner: StandInGraphRunner, bs: int, monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], Any]]:
    """Capture ``LAYERS`` routing calls at batch size ``bs``: Python runs once, in the capture's forward
    context; each returned "graph" re-runs the rewrite on the runner's buffers with what was captured."""
    capture_batch = SimpleNamespace(forward_mode=FakeMode.DECODE, input_ids=runner.input_ids[:bs])
    graphs = []
    with _forward(capture_batch), monkeypatch.context() as capturing:
        capturing.setattr(padding, "tracing", lambda: True)
        for _ in range(LAYERS):
            captured_bound = padding.bound(torch.empty(bs, E), None)
            assert isinstance(captured_bound, torch.Tensor), captured_bound

            def replay(bound: torch.Tensor = captured_bound) -> tuple[torch.Tensor, torch.Tensor]:
                logits = _logits_of(runner.input_ids[:bs])
                vanilla = oea.route(logits, SPEC)
                return rewrite_topk(vanilla[0].int(), vanilla[1], logits, SPEC, CFG, bound)

            graphs.append(replay)
    return graphs


def _vanilla_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, weights = oea.route(logits, SPEC)
    return ids.int(), weights


def test_captured_routing_reads_each_replays_count_filled_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = StandInGraphRunner()
    graphs = _capture(runner, 16, monkeypatch)
    runner.load_batch(_batch(16, seed=99))  # stale rows for the padded replays below
    for step, real in enumerate((15, 13, 9, 13, 16)):
        batch = _batch(real, seed=step)
        fills = STATE.padding_fills
        runner.load_batch(batch)  # host side, before the replay
        outputs = [graph() for graph in graphs]
        assert STATE.padding_fills - fills == 1, f"step {step}: one write of the count per step, not per layer"
        logits = _logits_of(runner.input_ids[:16])
        expected = oea.route(logits[:real], SPEC, CFG)
        vanilla = _vanilla_rows(logits)
        for ids, weights in outputs:
            assert torch.equal(ids[:real].long(), expected[0])
            assert torch.allclose(weights[:real], expected[1], rtol=1e-5, atol=1e-6)
            assert torch.equal(ids[real:], vanilla[0][real:]) and torch.equal(weights[real:], vanilla[1][real:])
            union = set(ids[:real].flatten().tolist())
            assert union == set(expected[0].flatten().tolist()), "padding rows joined the union"


def test_same_real_rows_again_writes_nothing_and_the_pre_planned_call_is_free() -> None:
    runner = StandInGraphRunner()
    runner.load_batch(_batch(13))
    fills = STATE.padding_fills
    runner.load_batch(_batch(13, seed=1))  # e.g. the execute-time call after a pre-planned load_batch
    assert STATE.padding_fills == fills and int(padding.count_for("cpu")) == 13


def test_runner_of_a_mode_oea_does_not_reroute_leaves_the_count() -> None:
    runner = StandInGraphRunner()
    runner.capture_forward_mode = FakeMode.EXTEND
    runner.load_batch(_batch(13))
    assert STATE.padding_fills == 0 and padding.count_for("cpu") is None


def test_eager_decode_forward_fills_once_and_every_row_is_real() -> None:
    batch = _batch(6)
    logits = _logits_of(batch.input_ids)
    with _forward(batch), _forward(batch):  # nested, same batch
        bounds = [padding.bound(logits, None) for _ in range(LAYERS)]
    assert STATE.padding_fills == 1 and int(padding.count_for("cpu")) == 6
    assert bounds == [None] * LAYERS


def test_sglang_count_wins_over_the_replay_count() -> None:
    runner = StandInGraphRunner()
    runner.load_batch(_batch(13))
    theirs = torch.tensor(10, dtype=torch.int32)
    with padding.batch_rows(SimpleNamespace(input_ids=runner.input_ids), FakeMode.DECODE):
        assert padding.bound(torch.empty(16, E), theirs) is theirs
    assert "sglang" in STATE.padding_mechanisms


def test_cpu_runner_prepared_batch_is_bounded_in_eager_routing() -> None:
    """``CPUGraphRunner.prepare_replay`` returns the padded captured batch; its forward runs eagerly."""
    captured = SimpleNamespace(forward_mode=FakeMode.DECODE, input_ids=torch.zeros(16, dtype=torch.int64))

    def prepare_replay(self: Any, forward_batch: Any) -> Any:
        captured.input_ids[: forward_batch.input_ids.shape[0]].copy_(forward_batch.input_ids)
        return captured

    runner = SimpleNamespace(capture_forward_mode=FakeMode.DECODE)
    outer = _batch(13)
    with _forward(outer):  # ModelRunner's forward
        prepared = padding.replay_around(prepare_replay, runner, outer)
        with _forward(prepared):  # the runner's replay
            got = padding.bound(torch.empty(16, E), None)
    assert isinstance(got, torch.Tensor) and int(got) == 13 and STATE.padding_fills == 1


@pytest.mark.parametrize("rows", [8, 32], ids=["sharded", "gathered"])
def test_routing_rows_other_than_the_batch_get_no_bound(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    with padding.batch_rows(_batch(16), FakeMode.DECODE):
        monkeypatch.setattr(padding, "tracing", lambda: True)
        assert padding.bound(torch.empty(rows, E), None) is None
    assert STATE.padding_mechanisms == {"none"}


def test_nested_half_batch_gets_no_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    with padding.batch_rows(_batch(16), FakeMode.DECODE), padding.batch_rows(_batch(8, seed=3), FakeMode.DECODE):
        monkeypatch.setattr(padding, "tracing", lambda: True)
        assert padding.bound(torch.empty(8, E), None) is None


def test_nothing_is_written_or_allocated_inside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(padding, "tracing", lambda: True)
    padding.fill("cpu", 13)
    StandInGraphRunner().load_batch(_batch(13))
    assert STATE.padding_fills == 0 and STATE.padding_counts == {}


def test_without_a_replay_hook_captured_routing_keeps_todays_behaviour(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(padding, "replay_targets", lambda: {"cuda": padding.DECODE_REPLAY_TARGET, "cpu": None})
    with caplog.at_level(logging.WARNING, logger="oea.integrations.sglang"):
        hooked = padding.check_replay_hooks(plugin_hooks.target_hooked)
        padding.check_replay_hooks(plugin_hooks.target_hooked)
    assert hooked == {"cuda": False, "cpu": False}
    warnings = [r.getMessage() for r in caplog.records if "replay hook point" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert padding.DECODE_REPLAY_TARGET in warnings[0] and "--disable-cuda-graph-padding" in warnings[0]
    assert "--cuda-graph-bs-decode" in warnings[0]
    padding.fill("cpu", 16)
    with padding.batch_rows(_batch(16), FakeMode.DECODE):
        monkeypatch.setattr(padding, "tracing", lambda: True)
        assert padding.bound(torch.empty(16, E), None) is None  # every row joins the union, as before


def test_replay_hook_never_raises_into_sglang(caplog: pytest.LogCaptureFixture) -> None:
    def load_batch(self: Any, forward_batch: Any) -> str:
        return "loaded"

    runner = SimpleNamespace(capture_forward_mode=FakeMode.DECODE)  # no raw_num_token: an SGLang that renamed it
    with caplog.at_level(logging.WARNING, logger="oea.integrations.sglang"):
        assert padding.replay_around(load_batch, runner, _batch(13)) == "loaded"
        assert padding.replay_around(load_batch, runner, _batch(13)) == "loaded"
    assert len([r for r in caplog.records if "real row count" in r.getMessage()]) == 1
    broken = SimpleNamespace(capture_forward_mode=FakeMode.DECODE, raw_num_token="13 rows")
    assert padding.replay_around(load_batch, broken, _batch(13)) == "loaded"


def test_replay_hooks_are_planned_only_where_sglang_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    present = {padding._target_module(padding.LEGACY_REPLAY_TARGET), padding._target_module(padding.CPU_REPLAY_TARGET)}
    monkeypatch.setattr(padding, "_module_file_exists", lambda module: module in present)
    assert padding.replay_targets() == {"cuda": padding.LEGACY_REPLAY_TARGET, "cpu": padding.CPU_REPLAY_TARGET}
    plan = {target: kind for target, hook, kind in plugin_hooks.hook_plan(True) if hook is padding.replay_around}
    assert plan == {padding.LEGACY_REPLAY_TARGET: "AROUND", padding.CPU_REPLAY_TARGET: "AROUND"}
    assert not set(plugin_hooks.hooks_status()) & set(plan)  # reported by the padding check, not "hooks live"
    present.add(padding._target_module(padding.DECODE_REPLAY_TARGET))
    assert padding.replay_targets()["cuda"] == padding.DECODE_REPLAY_TARGET


# ---------------------------------------------------------------- speculative verify graphs: several tokens per request

WIDTH = 3  # tokens per request of a verify graph (the draft tokens plus one)


class StandInVerifyRunner(StandInGraphRunner):
    """SGLang's graph runner for TARGET_VERIFY with ``captured_req_width`` tokens per request (0.5.14+; older
    runners call it ``num_tokens_per_bs``): ``load_batch`` pads the requests to the next captured batch size
    and leaves ``raw_num_token`` = requests x tokens per request, as SGLang computes it."""

    capture_forward_mode = FakeMode.TARGET_VERIFY
    captured_req_width = WIDTH
    device = "cpu"

    def __init__(self) -> None:
        super().__init__(capture_bs=(2, 4))
        self.input_ids = torch.zeros(4 * WIDTH, dtype=torch.int64)

    def _load_batch(self, forward_batch: Any) -> None:
        self.bs = next(bs for bs in self.capture_bs if bs >= forward_batch.batch_size)
        self.input_ids[: forward_batch.input_ids.shape[0]].copy_(forward_batch.input_ids)
        self.raw_num_token = forward_batch.batch_size * WIDTH

    def load_batch(self, forward_batch: Any) -> None:
        return padding.replay_around(StandInVerifyRunner._load_batch, self, forward_batch)


def _verify_batch(requests: int, seed: int) -> SimpleNamespace:
    batch = _batch(requests * WIDTH, seed)
    batch.forward_mode, batch.batch_size = FakeMode.TARGET_VERIFY, requests
    return batch


def test_verify_graphs_count_requests_times_tokens_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """OEA_APPLY_TO_VERIFY=1 on a version whose capture hook gives the rows (0.5.12-0.5.22): a verify graph
    captured for 4 requests routes 4 x 3 rows; replayed for 3 requests, the real rows are 3 x 3 = 9 and
    the 3 padding rows stay out of the union."""
    STATE.settings = settings_from_env({"OEA_K0": str(K0), "OEA_APPLY_TO_VERIFY": "1"})
    runner = StandInVerifyRunner()
    rows = 4 * WIDTH
    graphs = []

    def capture_one_shape(self: Any, size: int, forward: Any) -> None:  # warm-up runs eagerly, then the capture
        monkeypatch.setattr(padding, "tracing", lambda: True)
        for _ in range(LAYERS):
            captured_bound = padding.bound(torch.empty(rows, E), None)
            assert isinstance(captured_bound, torch.Tensor), "a captured verify graph must read the replay count"

            def replay(bound: torch.Tensor = captured_bound) -> tuple[torch.Tensor, torch.Tensor]:
                logits = _logits_of(runner.input_ids[:rows])
                vanilla = oea.route(logits, SPEC)
                return rewrite_topk(vanilla[0].int(), vanilla[1], logits, SPEC, CFG, bound)

            graphs.append(replay)

    plugin_hooks._graph_capture_around(capture_one_shape, runner, 4, None)
    monkeypatch.setattr(padding, "tracing", lambda: False)
    runner.load_batch(_verify_batch(4, seed=50))  # stale rows for the padded replay
    runner.load_batch(_verify_batch(3, seed=51))
    real = 3 * WIDTH
    assert int(padding.count_for("cpu")) == real
    logits = _logits_of(runner.input_ids[:rows])
    expected = oea.route(logits[:real], SPEC, CFG)
    for ids, weights in (graph() for graph in graphs):
        assert torch.equal(ids[:real].long(), expected[0])
        assert torch.allclose(weights[:real], expected[1], rtol=1e-5, atol=1e-6)
        assert set(ids[:real].flatten().tolist()) == set(expected[0].flatten().tolist()), "padding rows joined"
        assert torch.equal(ids[real:], _vanilla_rows(logits)[0][real:])


def test_cpu_verify_replay_counts_the_token_rows_of_the_batch_it_was_given() -> None:
    """``CPUGraphRunner.prepare_replay`` pads a verify batch of 3 requests x 3 tokens to the captured 4 x 3:
    the real rows are the given batch's 9 token rows, not its 3 requests."""
    STATE.settings = settings_from_env({"OEA_K0": str(K0), "OEA_APPLY_TO_VERIFY": "1"})
    captured = SimpleNamespace(forward_mode=FakeMode.TARGET_VERIFY, input_ids=torch.zeros(4 * WIDTH, dtype=torch.int64),
                               batch_size=4)

    def prepare_replay(self: Any, forward_batch: Any) -> Any:
        captured.input_ids[: forward_batch.input_ids.shape[0]].copy_(forward_batch.input_ids)
        return captured

    runner = SimpleNamespace(capture_forward_mode=FakeMode.TARGET_VERIFY, num_tokens_per_bs=WIDTH)
    outer = _verify_batch(3, seed=52)
    with _forward(outer):
        prepared = padding.replay_around(prepare_replay, runner, outer)
        with _forward(prepared):
            got = padding.bound(torch.empty(4 * WIDTH, E), None)
    assert isinstance(got, torch.Tensor) and int(got) == 3 * WIDTH
