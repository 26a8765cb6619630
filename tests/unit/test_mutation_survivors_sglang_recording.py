"""What the generated mutants of ``oea/integrations/sglang/recording.py`` and ``padding.py`` found unguarded
(docs/testing.md, "Generated mutants"), driven as SGLang drives the plugin (``test_sglang_metrics_rows``'s
``start``: ``register``, then the forward-context and post-process hooks) with the SGLang stand-ins, and read back
from the trace file with oea's own loader (``load_trace``).

The recording (``OEA_TRACE_FILE``): the file at exactly the path given on rank 0 and at ``<stem>.rank<r>`` on the
others; the sidecar's provenance (SGLang's version, the served model or "unknown", whether OEA was on, the notes, the
MoE layers' own ids); each layer's correction bias and a recorder spec without the first layer's bias; the start-up
line; one warning per layer left out (each reason, the mixed router, a layer first met inside a CUDA-graph capture)
and no other; a graph capture's copy of the logits read by the replayed step; SGLang's host ``seq_lens_cpu`` read
rather than the device ``seq_lens``; a batch without request ids skipped silently, one whose request ids or lengths
do not match its rows skipped with one warning saying which; SGLang's ``max_running_requests`` as the most rows a
step keeps; the file tested once per process; a file that cannot be opened at the first routing call turning
recording off; verify forwards not recorded by default; the notes of a process without routing settings."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import test_sglang_metrics_rows as metrics_rows
import torch
from sglang_stand_ins import FakeMode, fresh_state, topk_config
from test_sglang_metrics_rows import Server

import oea
import oea.integrations.recording.common as recording_common
import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.recording as sglang_recording
import oea.integrations.sglang.targets as sglang_targets
from oea.config import TraceSettings, settings_from_env
from oea.integrations import sglang as plugin
from oea.integrations.sglang.router_state import RouterState
from oea.integrations.sglang.state import STATE
from oea.routing import LayerConfigs, RouterSpec
from oea.traces import load_trace

torch.set_num_threads(1)
start = metrics_rows.start  # the plugin registered in a stand-in SGLang process (a fixture, found by this name)
EXPERTS = 64
LOGGER = "oea.integrations.sglang"
VERSION = "0.5.14"


# -- helpers -----------------------------------------------------------------------------------------------------

def _batch(mode: FakeMode, rids: list[str], seq_lens: list[int], /, **fields: Any) -> SimpleNamespace:
    """SGLang's ``ForwardBatch`` as the plugin reads it (``fields`` override or add attributes)."""
    lens = torch.tensor(seq_lens)
    values: dict[str, Any] = dict(forward_mode=mode, batch_size=len(seq_lens), rids=rids, seq_lens=lens,
                                  seq_lens_cpu=lens, input_ids=torch.zeros(len(seq_lens)))
    values.update(fields)
    return SimpleNamespace(**values)


@contextlib.contextmanager
def _forward(server: Server, batch: Any) -> Iterator[None]:
    """One forward of ``batch``, as SGLang's ``forward_context(ctx, forward_batch=...)``."""
    @contextlib.contextmanager
    def sglang_forward_context(_ctx: Any, *, forward_batch: Any = None) -> Iterator[None]:
        yield

    with server.hooks[plugin.FORWARD_CONTEXT_TARGET](sglang_forward_context, None, forward_batch=batch):
        yield


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, EXPERTS, generator=torch.Generator().manual_seed(seed))


def _route(server: Server, layer: Any, logits: torch.Tensor, cfg: SimpleNamespace) -> None:
    """One MoE layer's routing call through the post-process BEFORE hook (SGLang's own top-k handed in)."""
    ids, weights = oea.route(logits, RouterSpec(EXPERTS, 8), oea.OEAConfig(8))
    server.hooks[plugin.POST_PROCESS_TARGET](topk_ids=ids.int(), topk_weights=weights, topk_config=cfg,
                                             router_logits=logits, layer_id=layer, num_token_non_padded=None,
                                             expert_location_dispatch_info=None)


def _close() -> Any:
    """Stop recording as the engine does; the trace loaded by oea's own loader."""
    recorder = sglang_recording.TRACE.recorder
    assert recorder is not None
    path = recorder.close()
    assert path is not None
    return load_trace(str(path))


def _runtime_context(monkeypatch: pytest.MonkeyPatch, **functions: Any) -> None:
    """SGLang's ``sglang.srt.runtime_context`` with only ``functions``."""
    module = types.ModuleType("sglang.srt.runtime_context")
    for name, function in functions.items():
        setattr(module, name, function)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", module)


def _warnings(caplog: pytest.LogCaptureFixture, *words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and any(w in r.getMessage() for w in words)]


TRACE_WORDS = ("record", "OEA_TRACE_FILE", "decode batch's requests", "decode step")  # not the padding hook's


# -- the file and its sidecar ------------------------------------------------------------------------------------

def test_the_sidecar_says_where_what_and_how_it_was_recorded(start: Any, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setattr(sglang_targets, "engine_version", lambda: VERSION)
    _runtime_context(monkeypatch, get_server_args=lambda: SimpleNamespace(model_path="org/moe-model"))
    path = str(tmp_path / "served.safetensors")
    server = start(OEA_K0="2", OEA_TRACE_FILE=path)
    configs = {3: topk_config(), 7: topk_config()}  # the model's own MoE layer ids, not 0, 1
    for seed, rows in enumerate((3, 2)):
        with _forward(server, _batch(FakeMode.DECODE, [f"r{i}" for i in range(rows)], [5] * rows)):
            for layer, cfg in configs.items():
                _route(server, layer, _logits(rows, 10 * seed + layer), cfg)
    recorder = sglang_recording.TRACE.recorder
    assert recorder is not None
    assert recorder.close() == Path(path), "rank 0 writes exactly OEA_TRACE_FILE"
    meta = load_trace(path).meta
    assert meta["layer_ids"] == [3, 7]
    assert meta["model"] == "org/moe-model"
    assert meta["source"] == f"recorded from an SGLang {VERSION} server by the oea plugin (OEA_TRACE_FILE)"
    assert meta["notes"] == [
        "DECODE forwards only (prefill/extend is never recorded); rows are the batch's real rows",
        "OEA was on (OEA_K0=2) while recording; the router's logits are recorded before any rewrite, so every "
        "policy replays from them",
        "positions: each token's position in its sequence (seq_lens - 1); step_ids: this process's count of "
        "decode forwards; oea simulate --mode lockstep replays each recorded forward as SGLang batched it",
        "OEA_TRACE_SAMPLE=1: that share of decode steps, drawn at random",
    ]


def test_a_model_sglang_does_not_name_is_unknown(start: Any, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    _runtime_context(monkeypatch)  # no get_server_args (older SGLang, or none published)
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    with _forward(server, _batch(FakeMode.DECODE, ["a", "b"], [4, 9])):
        _route(server, 0, _logits(2, 1), topk_config())
    meta = _close().meta
    assert meta["model"] == "unknown"
    assert "OEA was off (observe mode) while recording" in meta["notes"][1]


def test_another_rank_writes_its_own_file(start: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sglang_recording, "process_rank", lambda: 1)
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    with _forward(server, _batch(FakeMode.DECODE, ["a", "b"], [4, 9])):
        _route(server, 0, _logits(2, 2), topk_config())
    recorder = sglang_recording.TRACE.recorder
    assert recorder is not None
    assert recorder.close() == tmp_path / "t.rank1.safetensors"
    assert load_trace(str(tmp_path / "t.rank1.safetensors")).positions.tolist() == [3, 8]


def test_each_layers_correction_bias_is_in_the_trace(start: Any, tmp_path: Path) -> None:
    biases = {0: torch.linspace(0.0, 0.3, EXPERTS), 1: torch.linspace(0.2, -0.1, EXPERTS)}
    configs = {layer: topk_config(use_grouped_topk=True, num_expert_group=1, topk_group=1, correction_bias=bias,
                                  scoring_func="sigmoid", torch_native=False) for layer, bias in biases.items()}
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    recorded = {0: [], 1: []}
    for seed in range(2):
        with _forward(server, _batch(FakeMode.DECODE, ["a", "b", "c"], [5, 6, 7])):
            for layer, cfg in configs.items():
                logits = _logits(3, 20 + 2 * seed + layer)
                recorded[layer].append(logits)
                _route(server, layer, logits, cfg)
    trace = _close()
    assert trace.correction_bias is not None
    assert torch.equal(trace.correction_bias, torch.stack([biases[0], biases[1]]))
    for layer in (0, 1):
        assert torch.equal(trace.logits[:, layer], torch.cat(recorded[layer]))


def test_a_layer_without_a_bias_is_recorded_with_its_own_routing_not_the_first_layers_bias(
        start: Any, tmp_path: Path) -> None:
    """OEA_TRACE_CONTENT=topk: the recorder routes each layer with its own bias (none for the second layer), never
    the first recorded layer's."""
    bias = torch.zeros(EXPERTS)
    bias[:8] = 10.0  # the first layer always picks experts 0..7 (in their unbiased order)
    configs = {0: topk_config(scoring_func="sigmoid", correction_bias=bias), 1: topk_config(scoring_func="sigmoid")}
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"), OEA_TRACE_CONTENT="topk")
    logits = {layer: _logits(4, 30 + layer) for layer in configs}
    with _forward(server, _batch(FakeMode.DECODE, ["a", "b", "c", "d"], [5, 6, 7, 8])):
        for layer, cfg in configs.items():
            _route(server, layer, logits[layer], cfg)
    trace = _close()
    assert trace.ids is not None
    assert set(trace.ids[:, 0].flatten().tolist()) == set(range(8))
    own, _ = oea.route(logits[1], RouterSpec(EXPERTS, 8, "sigmoid"), oea.OEAConfig(8))
    assert torch.equal(trace.ids[:, 1].long(), own.long())


def test_the_start_up_line_names_the_share_and_the_file(start: Any, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "t.safetensors")
    server = start(OEA_TRACE_FILE=path, OEA_TRACE_SAMPLE="0.5")
    with caplog.at_level(logging.INFO, logger=LOGGER), _forward(server, _batch(FakeMode.DECODE, ["a"], [5])):
        _route(server, 0, _logits(1, 3), topk_config())
    said = [r.getMessage() for r in caplog.records if "recording" in r.getMessage()]
    assert said == [f"oea: recording 50% of decode forwards to {path}"], said


# -- layers left out ---------------------------------------------------------------------------------------------

def test_each_layer_left_out_is_one_warning_naming_the_layer_and_why(start: Any, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    configs = {0: topk_config(),
               1: topk_config(custom_routing_function=lambda *a: None),  # Llama4
               2: topk_config(allow_routed_experts_capture=False),  # a speculative draft model's TopK
               3: topk_config(scoring_func="sigmoid")}  # routes unlike layer 0
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    recorded = []
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for seed in range(2):
            with _forward(server, _batch(FakeMode.DECODE, ["a", "b"], [5, 6])):
                for layer, cfg in configs.items():
                    logits = _logits(2, 40 + 4 * seed + layer)
                    if layer == 0:
                        recorded.append(logits)
                    _route(server, layer, logits, cfg)
    assert _warnings(caplog, *TRACE_WORDS) == [
        "oea: layer 1 is not recorded: custom_routing_function is set (e.g. Llama4)",
        "oea: layer 2 is not recorded: speculative draft-model TopK",
        "oea: layer 3 routes unlike the first recorded layer; not recorded",
    ]
    trace = _close()
    assert trace.meta["layer_ids"] == [0]
    assert torch.equal(trace.logits[:, 0], torch.cat(recorded))


@contextlib.contextmanager
def _capturing(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    flag = [False]
    monkeypatch.setattr(sglang_recording, "graph_capturing", lambda: flag[0])
    yield flag


def test_a_capture_stages_the_logits_the_replayed_step_records_and_a_layer_first_met_there_is_left_out(
        start: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A CUDA-graph capture (stand-in: ``graph_capturing`` True) copies each recorded layer's logits into the
    staging buffer, so a replayed decode step (no Python routing call) finds its rows there; a layer whose first
    routing call is inside the capture is not added (no buffer allocated inside a capture) and says so once."""
    configs = {layer: topk_config() for layer in (0, 1, 2)}
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    eager = {layer: _logits(3, 50 + layer) for layer in (0, 1)}
    captured = {layer: _logits(4, 60 + layer) for layer in (0, 1, 2)}
    with caplog.at_level(logging.INFO, logger=LOGGER), _capturing(monkeypatch) as capturing:
        with _forward(server, _batch(FakeMode.DECODE, ["a", "b", "c"], [5, 6, 7])):
            for layer in (0, 1):
                _route(server, layer, eager[layer], configs[layer])
        capturing[0] = True
        with _forward(server, _batch(FakeMode.DECODE, [], [1] * 4, rids=None)):  # the capture's dummy batch
            for layer in (0, 1, 2):
                _route(server, layer, captured[layer], configs[layer])
        capturing[0] = False
        with _forward(server, _batch(FakeMode.DECODE, ["a", "b", "c", "d"], [6, 7, 8, 3])):
            pass  # the graph replays: the captured copies fill the buffer, no routing call reaches Python
    assert _warnings(caplog, *TRACE_WORDS) == [
        "oea: layer 2 first routed inside a CUDA-graph capture; not recorded"]
    trace = _close()
    assert trace.meta["layer_ids"] == [0, 1]
    assert trace.positions.tolist() == [4, 5, 6, 5, 6, 7, 2]
    for layer in (0, 1):
        assert torch.equal(trace.logits[:, layer], torch.cat([eager[layer], captured[layer]]))


# -- a step's rows -----------------------------------------------------------------------------------------------

class _DeviceLens:
    """``forward_batch.seq_lens`` on the device: reading it on the host would sync with the GPU every step."""

    def cpu(self) -> torch.Tensor:
        raise AssertionError("the device seq_lens were read although SGLang gave seq_lens_cpu")


def test_the_host_copy_of_the_lengths_is_read_never_the_device_one(start: Any, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for rows in (2, 3):
            batch = _batch(FakeMode.DECODE, [f"r{i}" for i in range(rows)], [10 + i for i in range(rows)],
                           seq_lens=_DeviceLens())
            with _forward(server, batch):
                _route(server, 0, _logits(rows, 70 + rows), topk_config())
    assert _warnings(caplog, *TRACE_WORDS) == []
    assert _close().positions.tolist() == [9, 10, 9, 10, 11]


def test_a_batch_without_request_ids_is_skipped_silently(start: Any, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        warm_up = _batch(FakeMode.DECODE, [], [3, 3])
        del warm_up.rids  # a warm-up batch SGLang makes without requests
        with _forward(server, warm_up):
            _route(server, 0, _logits(2, 80), topk_config())
        with _forward(server, _batch(FakeMode.DECODE, ["a"], [8])):
            _route(server, 0, _logits(1, 81), topk_config())
    assert _warnings(caplog, *TRACE_WORDS) == []
    trace = _close()
    assert trace.positions.tolist() == [7] and trace.step_ids.tolist() == [2]


@pytest.mark.parametrize(("rids", "seq_lens", "said"), [
    (["a", "b"], [5, 6, 7], "3 rows, 2 request ids, 3 sequence lengths"),
    (["a", "b", "c"], [5, 6], "3 rows, 3 request ids, 2 sequence lengths"),
])
def test_a_batch_whose_requests_do_not_match_its_rows_is_one_warning_saying_which(
        start: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, rids: list[str], seq_lens: list[int],
        said: str) -> None:
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(2):
            with _forward(server, _batch(FakeMode.DECODE, rids, seq_lens, batch_size=3, input_ids=torch.zeros(3))):
                _route(server, 0, _logits(3, 90), topk_config())
        with _forward(server, _batch(FakeMode.DECODE, ["z"], [4])):
            _route(server, 0, _logits(1, 91), topk_config())
    assert _warnings(caplog, *TRACE_WORDS) == [
        f"oea: cannot read a decode batch's requests (ValueError: {said}); such forwards are not recorded"]
    trace = _close()
    assert trace.positions.tolist() == [3] and trace.step_ids.tolist() == [3]


@pytest.mark.parametrize(("largest", "kept"), [(4, [4]), (0, [4, 5]), (None, [4, 5])])
def test_sglangs_largest_running_batch_is_the_most_rows_a_step_keeps(
        start: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        largest: int | None, kept: list[int]) -> None:
    """``max_running_requests`` when SGLang says (0 or None: it does not; the default, 512)."""
    _runtime_context(monkeypatch, get_schedule=lambda: SimpleNamespace(max_running_requests=largest))
    server = start(OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for rows in (4, 5):
            with _forward(server, _batch(FakeMode.DECODE, [f"r{i}" for i in range(rows)], [9] * rows)):
                _route(server, 0, _logits(rows, 100 + rows), topk_config())
    trace = _close()
    assert [trace.step_ids.tolist().count(step) for step in sorted(set(trace.step_ids.tolist()))] == kept
    skipped = _warnings(caplog, "does not fit the recording")
    assert skipped == ([] if largest is None or largest == 0 else
                       [f"oea: a decode step of 5 rows with 5 request ids does not fit the recording (at most "
                        f"{largest} rows); such steps are skipped"])


# -- whether this process records --------------------------------------------------------------------------------

def test_the_file_is_tested_once_per_process_not_at_every_forward(start: Any, monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    tested: list[str] = []
    problem = recording_common.trace_path_problem

    def counted(path: str) -> str | None:
        tested.append(path)
        return problem(path)

    monkeypatch.setattr(recording_common, "trace_path_problem", counted)
    path = str(tmp_path / "t.safetensors")
    server = start(OEA_TRACE_FILE=path)
    for seed in range(3):
        with _forward(server, _batch(FakeMode.DECODE, ["a"], [5 + seed])):
            _route(server, 0, _logits(1, 110 + seed), topk_config())
    assert tested == [path], "a filesystem check at every decode step"
    assert _close().positions.tolist() == [4, 5, 6]


def test_a_file_that_cannot_be_opened_at_the_first_routing_call_turns_recording_off_with_one_warning(
        start: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "t.safetensors"
    server = start(OEA_TRACE_FILE=str(path))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with _forward(server, _batch(FakeMode.DECODE, ["a", "b"], [5, 6])):
            path.mkdir()  # between the first forward's check and its first routing call: a folder at the path
            for layer in (0, 1):
                _route(server, layer, _logits(2, 120 + layer), topk_config())
        with _forward(server, _batch(FakeMode.DECODE, ["a", "b"], [6, 7])):
            for layer in (0, 1):
                _route(server, layer, _logits(2, 122 + layer), topk_config())
    assert _warnings(caplog, *TRACE_WORDS) == [
        f"oea: OEA_TRACE_FILE={path} cannot be written ({path} is a folder); serving without recording"]
    assert sglang_recording.TRACE.settings is None and sglang_recording.TRACE.recorder is None
    assert server.steps == []


# -- the module as a caller drives it (configure, forward, stage) --------------------------------------------------

@pytest.fixture
def fresh_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_state(monkeypatch)  # STATE.settings None: no routing settings read in this process
    for field in dataclasses.fields(sglang_recording._Trace):
        monkeypatch.setattr(sglang_recording.TRACE, field.name, getattr(sglang_recording._Trace(), field.name))


def _state(layer: int) -> RouterState:
    return RouterState(layer, topk_config(), EXPERTS, None, LayerConfigs(None), spec=RouterSpec(EXPERTS, 8))


def test_verify_forwards_are_not_recorded_unless_asked(fresh_trace: None, tmp_path: Path) -> None:
    """``configure(settings)`` alone: OEA_APPLY_TO_VERIFY off; and a process without routing settings records
    with OEA off in the notes."""
    sglang_recording.configure(TraceSettings(str(tmp_path / "t.safetensors")))
    states = [_state(layer) for layer in (0, 1)]
    recorded = []
    for index, mode in enumerate((FakeMode.DECODE, FakeMode.TARGET_VERIFY, FakeMode.DECODE)):
        rows = 2 + index
        with sglang_recording.forward(_batch(mode, [f"r{i}" for i in range(rows)], [5] * rows), mode):
            logits = [_logits(rows, 130 + 2 * index + layer) for layer in (0, 1)]
            for state, layer_logits in zip(states, logits, strict=True):
                sglang_recording.stage(state, layer_logits, state.spec)
        if mode is FakeMode.DECODE:
            recorded.append(logits)
    trace = _close()
    assert trace.step_ids.tolist() == [1, 1, 2, 2, 2, 2]
    for layer in (0, 1):
        assert torch.equal(trace.logits[:, layer], torch.cat([step[layer] for step in recorded]))
    assert "OEA was off (observe mode) while recording" in trace.meta["notes"][1]


# == padding.py ===================================================================================================
# The real rows of graph-replayed decode batches (``padding``), driven as the hooks drive it: the replay
# preparation's AROUND hook, the forward-context and capture frames, and ``bound`` as the rewrite asks it (under a
# stand-in ``tracing`` where the routing is captured or compiled). The "meta" device stands in for a second device.

DECODE_MODULE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
LEGACY_MODULE = "sglang.srt.model_executor.cuda_graph_runner"
CPU_MODULE = "sglang.srt.model_executor.cpu_graph_runner"
WORKAROUND = ("launch with --disable-cuda-graph-padding, or capture every decode batch size "
              "(--cuda-graph-bs-decode 1 2 ... N; --cuda-graph-bs before 0.5.14)")


@pytest.fixture
def padding_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """OEA on (OEA_K0=2), both replay hooks installed, the first forward's checks done; a fresh state."""
    fresh_state(monkeypatch)
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    STATE.padding_hooked = {"cuda": True, "cpu": True}
    STATE.phase_hook_seen = True


def _tokens(rows: int) -> SimpleNamespace:
    """A decode ``ForwardBatch`` of ``rows`` token rows."""
    return SimpleNamespace(forward_mode=FakeMode.DECODE, input_ids=torch.zeros(rows, dtype=torch.int64),
                           batch_size=rows)


def _traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on the routing is captured or compiled (``padding.tracing``)."""
    monkeypatch.setattr(padding, "tracing", lambda: True)


class RenamedRunner:
    """A graph runner of a decode graph that does not leave ``raw_num_token``."""

    capture_forward_mode = FakeMode.DECODE


def _runner(rows: int) -> SimpleNamespace:
    """A decode graph runner whose ``load_batch`` left ``raw_num_token`` = ``rows``."""
    return SimpleNamespace(capture_forward_mode=FakeMode.DECODE, raw_num_token=rows)


def _loaded(self: Any, forward_batch: Any) -> None:
    """``DecodeCudaGraphRunner.load_batch`` (returns nothing; leaves ``raw_num_token``)."""


@pytest.mark.parametrize(("shipped", "expected"), [
    ({DECODE_MODULE, LEGACY_MODULE, CPU_MODULE}, ("DECODE", "CPU")),
    ({LEGACY_MODULE}, ("LEGACY", None)),
    ({CPU_MODULE}, (None, "CPU")),
    (set(), (None, None)),
])
def test_the_replay_hook_points_are_those_of_the_modules_sglang_ships(
        monkeypatch: pytest.MonkeyPatch, shipped: set[str], expected: tuple[str | None, str | None]) -> None:
    monkeypatch.setattr(padding.targets, "module_available", lambda module: module in shipped)
    names = {"DECODE": padding.DECODE_REPLAY_TARGET, "LEGACY": padding.LEGACY_REPLAY_TARGET,
             "CPU": padding.CPU_REPLAY_TARGET, None: None}
    assert padding.replay_targets() == {"cuda": names[expected[0]], "cpu": names[expected[1]]}
    assert padding.replay_plan() == [(names[t], padding.replay_around, "AROUND") for t in expected if t]


@pytest.mark.parametrize(("shipped", "hooked", "found", "missing"), [
    ({"cuda": padding.DECODE_REPLAY_TARGET, "cpu": padding.CPU_REPLAY_TARGET}, {padding.CPU_REPLAY_TARGET},
     {"cuda": False, "cpu": True}, padding.DECODE_REPLAY_TARGET),
    ({"cuda": None, "cpu": None}, set(), {"cuda": False, "cpu": False},
     f"each of {padding.DECODE_REPLAY_TARGET} and {padding.LEGACY_REPLAY_TARGET}"),
])
def test_a_missing_cuda_replay_hook_is_one_warning_naming_what_is_missing(
        padding_on: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        shipped: dict[str, str | None], hooked: set[str], found: dict[str, bool], missing: str) -> None:
    monkeypatch.setattr(padding, "replay_targets", lambda: shipped)
    monkeypatch.setattr(padding.targets, "engine_version", lambda: VERSION)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert padding.check_replay_hooks(lambda target: target in hooked) == found
        padding.check_replay_hooks(lambda target: target in hooked)
    assert STATE.padding_hooked == found, "what bound reads"
    assert [r.getMessage() for r in caplog.records] == [
        f"oea: no CUDA-graph replay hook point ({missing} is missing in sglang {VERSION}): padding rows of "
        "graph-replayed decode batches join the OEA union at plain TP (SGLang's own num_token_non_padded still "
        "bounds them with EP > 1, DP-attention gathering or a custom all-to-all); "
        f"workaround: {WORKAROUND}"]


def test_an_installed_cuda_replay_hook_says_nothing(padding_on: None, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(padding, "replay_targets", lambda: {"cuda": padding.LEGACY_REPLAY_TARGET, "cpu": None})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert padding.check_replay_hooks(lambda target: True) == {"cuda": True, "cpu": False}
    assert caplog.records == []


# -- the count ---------------------------------------------------------------------------------------------------

def test_each_device_keeps_its_own_int32_count_written_only_when_it_changes(padding_on: None) -> None:
    padding.fill("cpu", 0)  # a new count already holds 0: nothing to write
    assert STATE.padding_fills == 0
    padding.fill("cpu", 1)
    padding.fill("meta", 3)
    cpu, meta = padding.count_for("cpu"), padding.count_for(torch.device("meta"))
    assert cpu is not None and meta is not None and cpu is not meta
    assert int(cpu) == 1 and STATE.padding_fills == 2, "a count of 1 real row is written"
    assert (cpu.dtype, cpu.shape, cpu.device.type) == (torch.int32, torch.Size([]), "cpu")
    assert (meta.dtype, meta.shape, meta.device.type) == (torch.int32, torch.Size([]), "meta")


def test_a_cuda_device_named_without_an_index_is_keyed_as_the_current_device(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    """SGLang's capture runner says ``"cuda"``, the logits the rewrite bounds live on ``cuda:<current>``: both must
    find one count. On a machine without CUDA, the current device is a stand-in (``torch.cuda.current_device``
    would initialise CUDA); no tensor is made, only the keys (the GPU test below makes the count itself)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert padding._device_key("cuda") == padding._device_key(torch.device("cuda")) == "cuda:2"
    assert padding._device_key("cuda:1") == "cuda:1", "an explicit index is kept"
    assert padding._device_key("cpu") == "cpu" and padding._device_key("meta") == "meta", "only CUDA gets an index"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a device without an index)")
def test_a_cuda_count_is_found_with_or_without_the_device_index(padding_on: None) -> None:
    """SGLang's capture runner says ``"cuda"``; the logits the rewrite bounds are on ``cuda:<current>``."""
    padding.fill("cuda", 7)
    indexed = torch.device("cuda", torch.cuda.current_device())
    count = padding.count_for(indexed)
    assert count is not None and count is padding.count_for("cuda") and int(count) == 7
    assert count.device == indexed and count.dtype == torch.int32
    padding.fill(indexed, 7)
    assert STATE.padding_fills == 1


# -- the replay hook ---------------------------------------------------------------------------------------------

def test_the_batch_given_by_keyword_is_counted(padding_on: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert padding.replay_around(_loaded, _runner(5), forward_batch=_tokens(5)) is None
    count = padding.count_for("cpu")
    assert count is not None and int(count) == 5
    assert caplog.records == []


def test_a_call_without_a_runner_or_its_mode_is_left_alone(padding_on: None, caplog: pytest.LogCaptureFixture) -> None:
    without_mode = SimpleNamespace(raw_num_token=5)  # a runner older than capture_forward_mode
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert padding.replay_around(lambda **kwargs: "prepared", forward_batch=_tokens(5)) == "prepared"
        assert padding.replay_around(_loaded, without_mode, _tokens(5)) is None
    assert caplog.records == [] and padding.count_for("cpu") is None


def test_a_failed_count_is_logged_once_with_its_traceback(padding_on: None, caplog: pytest.LogCaptureFixture) -> None:
    broken = _runner(5)
    broken.raw_num_token = "5 rows"
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(2):
            assert padding.replay_around(_loaded, broken, _tokens(5)) is None
    (said,) = caplog.records
    assert said.getMessage() == ("oea: could not record the real rows of a graph replay; padding rows may join "
                                 "the union")
    assert said.levelno == logging.ERROR and said.exc_info is not None


def test_a_runner_without_the_real_rows_is_one_warning_naming_it(padding_on: None,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        padding.replay_around(_loaded, RenamedRunner(), _tokens(5))
        padding.replay_around(_loaded, RenamedRunner(), _tokens(5))
    assert [r.getMessage() for r in caplog.records] == [
        "oea: RenamedRunner: real row count or device not found after replay preparation; padding rows may join "
        f"the union ({WORKAROUND})"]


def test_the_device_is_read_from_the_prepared_batch_when_the_given_one_does_not_say(padding_on: None) -> None:
    prepared = SimpleNamespace(input_ids=torch.tensor(0, device="meta"))  # no row count: not a CPU runner's batch
    assert padding.replay_around(lambda self, forward_batch: prepared, _runner(6), SimpleNamespace()) is prepared
    count = padding.count_for("meta")
    assert count is not None and count.device.type == "meta" and padding.count_for("cpu") is None


def test_a_cpu_replay_of_a_batch_without_its_rows_leaves_no_stale_count(padding_on: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``CPUGraphRunner.prepare_replay`` given a batch whose rows are unknown: its prepared batch is not bounded
    by the count an earlier replay left (13 of 16 rows), in the compiled routing either."""
    prepared = _tokens(16)
    runner = SimpleNamespace(capture_forward_mode=FakeMode.DECODE)
    padding.replay_around(lambda self, forward_batch: prepared, runner, _tokens(13))
    count = padding.count_for("cpu")
    assert count is not None and int(count) == 13
    unknown = SimpleNamespace(forward_mode=FakeMode.DECODE)  # no input_ids
    with padding.batch_rows(unknown, FakeMode.DECODE):
        padding.replay_around(lambda self, forward_batch: prepared, runner, unknown)
        with padding.batch_rows(prepared, FakeMode.DECODE):
            _traced(monkeypatch)
            assert padding.bound(torch.empty(16, EXPERTS), None) is None


# -- frames ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("entered", ["eagerly", "while captured"])
def test_a_nested_context_of_the_same_batch_is_the_same_frame(padding_on: None, monkeypatch: pytest.MonkeyPatch,
                                                              entered: str) -> None:
    batch = _tokens(8)
    padding.fill("cpu", 8)
    if entered != "eagerly":
        _traced(monkeypatch)
    with padding.batch_rows(batch, FakeMode.DECODE), padding.batch_rows(batch, FakeMode.DECODE):
        _traced(monkeypatch)
        bound = padding.bound(torch.empty(8, EXPERTS), None)
    assert bound is padding.count_for("cpu")


def test_a_nested_batch_or_runner_of_the_same_rows_is_not_bounded_by_the_outer_count(
        padding_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A nested batch (e.g. a two-batch-overlap half) the count does not describe gets no bound, even with the
    outer batch's row count."""
    outer, inner = _tokens(8), _tokens(8)  # alive through the forward, as SGLang's batches are (distinct ids)
    with padding.batch_rows(outer, FakeMode.DECODE), padding.batch_rows(inner, FakeMode.DECODE):
        _traced(monkeypatch)
        assert padding.bound(torch.empty(8, EXPERTS), None) is None
    one, other = (SimpleNamespace(capture_forward_mode=FakeMode.DECODE, device="cpu") for _ in range(2))
    with padding.capture_rows(one, (8, None), {}), padding.capture_rows(other, (8, None), {}):
        assert padding.bound(torch.empty(8, EXPERTS), None) is None


def test_an_extend_forward_writes_no_count(padding_on: None) -> None:
    with padding.batch_rows(_tokens(9), FakeMode.EXTEND):
        assert padding.bound(torch.empty(9, EXPERTS), None) is None
    assert STATE.padding_fills == 0 and padding.count_for("cpu") is None


@pytest.mark.parametrize(("runner", "args", "kwargs", "rows"), [
    ({}, (), {"bs": 4}, 4),  # capture_one_batch_size(self, bs=..., forward=...)
    ({}, (), {"size": 4}, 4),  # DecodeCudaGraphRunner.capture_one_shape(self, size=..., forward=...)
    ({}, (4, None), {}, 4),
    ({"num_tokens_per_bs": 2}, (4, None), {}, 8),  # a verify graph: requests x tokens per request
    ({"captured_req_width": 3}, (4, None), {}, 12),
    ({"capture_forward_mode": None}, (4, None), {}, 4),  # a runner without the attribute
], ids=["bs", "size", "positional", "num_tokens_per_bs", "captured_req_width", "no-mode"])
def test_a_captured_graphs_routing_reads_the_count_of_its_rows(
        padding_on: None, monkeypatch: pytest.MonkeyPatch, runner: dict[str, Any], args: tuple[Any, ...],
        kwargs: dict[str, Any], rows: int) -> None:
    fields: dict[str, Any] = {"capture_forward_mode": FakeMode.DECODE, "device": "cpu", **runner}
    if fields["capture_forward_mode"] is None:
        del fields["capture_forward_mode"]
    padding.fill("cpu", rows)
    with padding.capture_rows(SimpleNamespace(**fields), args, kwargs):
        _traced(monkeypatch)
        assert padding.bound(torch.empty(rows, EXPERTS), None) is padding.count_for("cpu")
        assert padding.bound(torch.empty(rows + 1, EXPERTS), None) is None


def test_a_capture_without_a_batch_size_has_no_frame(padding_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    padding.fill("cpu", 4)
    with padding.capture_rows(SimpleNamespace(capture_forward_mode=FakeMode.DECODE, device="cpu"), (), {}):
        _traced(monkeypatch)
        assert padding.bound(torch.empty(4, EXPERTS), None) is None


# -- the bound ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("device", "hooked", "bounded"), [
    ("cpu", {"cuda": False, "cpu": True}, True), ("cpu", {"cuda": True, "cpu": False}, False),
    ("meta", {"cuda": True, "cpu": False}, True), ("meta", {"cuda": False, "cpu": True}, False),
])
def test_captured_routing_is_bounded_only_where_its_devices_replay_hook_is_installed(
        padding_on: None, monkeypatch: pytest.MonkeyPatch, device: str, hooked: dict[str, bool],
        bounded: bool) -> None:
    """CPU logits are counted by the CPU graph runner's hook, any other device's by the CUDA one."""
    STATE.padding_hooked = hooked
    padding.fill(device, 8)
    with padding.batch_rows(_tokens(8), FakeMode.DECODE):
        _traced(monkeypatch)
        got = padding.bound(torch.empty(8, EXPERTS, device=device), None)
    assert got is (padding.count_for(device) if bounded else None)


def test_routing_compiled_outside_any_forward_gets_no_bound(padding_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    padding.fill("cpu", 8)
    _traced(monkeypatch)
    assert padding.bound(torch.empty(8, EXPERTS), None) is None


def test_eager_routing_of_a_padded_batch(padding_on: None) -> None:
    """A CPU runner's prepared batch of 16 rows, 13 real: routing of other rows (gathered) gets no bound; logits on
    a device without a count get the real rows as a number."""
    prepared = _tokens(16)
    runner = SimpleNamespace(capture_forward_mode=FakeMode.DECODE)
    padding.replay_around(lambda self, forward_batch: prepared, runner, _tokens(13))
    with padding.batch_rows(prepared, FakeMode.DECODE):
        assert padding.bound(torch.empty(32, EXPERTS), None) is None
        assert padding.bound(torch.empty(16, EXPERTS, device="meta"), None) == 13
        assert padding.bound(torch.empty(16, EXPERTS), None) is padding.count_for("cpu")


def test_each_bounding_mechanism_is_said_once(padding_on: None, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    padding.fill("cpu", 8)
    with caplog.at_level(logging.INFO, logger=LOGGER), padding.batch_rows(_tokens(8), FakeMode.DECODE):
        theirs = torch.tensor(6, dtype=torch.int32)
        for _ in range(2):
            assert padding.bound(torch.empty(8, EXPERTS), theirs) is theirs
        _traced(monkeypatch)
        for rows in (8, 8, 5, 5):
            padding.bound(torch.empty(rows, EXPERTS), None)
    assert [r.getMessage() for r in caplog.records] == [
        "oea: padding rows of decode batches bounded by SGLang's num_token_non_padded",
        "oea: padding rows of decode batches bounded by OEA's replay count",
        "oea: padding rows of decode batches bounded by none"]
