"""The engine-free trace recorder (``OEA_TRACE_FILE``): what it writes loads as a validated ``oea-trace`` and
replays in ``oea simulate --mode lockstep``; sampling, the size cap, a full disk, an unwritable path and a
writer that falls behind each stop or skip recording with one warning and never raise into the engine."""

from __future__ import annotations

import errno
import json
import logging
import pathlib
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hang_guard import CHILD_TIMEOUT_S

import oea
import oea.integrations.recording.recorder as recorder_module
from oea.config import TraceSettings
from oea.integrations.recording.recorder import StepStaging, TraceRecorder, open_recorder, rank_path
from oea.integrations.recording.trace_file import Column, TraceFileWriter
from oea.routing import RouterSpec
from oea.sim import make_batches, simulate
from oea.traces import load_trace

torch.set_num_threads(1)
N, K, L = 32, 4, 3
LOG = logging.getLogger("test.recorder")


def _settings(path: pathlib.Path, **kw: object) -> TraceSettings:
    return TraceSettings(str(path), **kw)  # type: ignore[arg-type]


def _recorder(tmp_path: pathlib.Path, capacity: int = 8, spec: RouterSpec | None = None, bias=None,
              **kw: object) -> TraceRecorder:
    """A recorder of L layers: known up front, or (with a per-layer ``bias``) added one by one as SGLang does."""
    if bias is None:
        staging = StepStaging(capacity, N, "cpu", num_layers=L)
    else:
        staging = StepStaging(capacity, N, "cpu")
        for layer in range(L):
            assert staging.add_layer(bias[layer]) == layer
    rec = open_recorder(_settings(tmp_path / "t.safetensors", **kw), str(tmp_path / "t.safetensors"),
                        spec or RouterSpec(N, K), staging, {"model": "unit", "kind": "unit test"}, LOG)
    assert rec is not None
    return rec


def _step(rec: TraceRecorder, step_id: int, logits: torch.Tensor, requests: list, positions: list,
          padding: int = 0) -> None:
    """One engine step: every layer's routing call stages [M + padding, N] logits, then the step is submitted."""
    for layer in range(L):
        padded = torch.cat([logits[:, layer], torch.full((padding, N), 99.0, dtype=logits.dtype)])
        rec.staging.stage(layer, padded)
    rec.submit_step(step_id, logits.shape[0], requests, positions)


def _logits(rows: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(rows, L, N, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def test_recorded_steps_load_as_a_validated_trace_with_every_row(tmp_path: pathlib.Path) -> None:
    """Three steps of 5, 8 and 3 real rows (the last with padding rows after them): the trace holds exactly
    the real rows, the router's bfloat16 logits bit for bit, request numbers by first appearance,
    positions and step ids."""
    rec = _recorder(tmp_path)
    steps = [(10, _logits(5, 1), ["a", "b", "c", "d", "e"], [7, 3, 9, 4, 12], 0),
             (11, _logits(8, 2), ["a", "b", "c", "d", "e", "f", "g", "h"], [8, 4, 10, 5, 13, 2, 2, 6], 0),
             (13, _logits(3, 3), ["h", "z", "a"], [7, 0, 9], 5)]
    for step_id, logits, requests, positions, padding in steps:
        _step(rec, step_id, logits, requests, positions, padding)
    path = rec.close()
    assert path == tmp_path / "t.safetensors"
    trace = load_trace(str(path))
    assert trace.num_tokens == 16 and trace.num_layers == L
    assert (trace.spec.num_experts, trace.spec.top_k, trace.spec.scoring) == (N, K, "softmax")
    torch.testing.assert_close(trace.logits, torch.cat([s[1] for s in steps]).float(), rtol=0, atol=0)
    assert trace.step_ids.tolist() == [10] * 5 + [11] * 8 + [13] * 3
    assert trace.positions.tolist() == [p for s in steps for p in s[3]]
    names = trace.meta["request_names"]
    assert [names[i] for i in trace.request_ids.tolist()] == [r for s in steps for r in s[2]]
    assert names[:3] == ["a", "b", "c"]
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["recorded"] == "full router logits (bfloat16)" and sidecar["steps_recorded"] == 3
    assert sidecar["stopped"] == "the engine stopped" and sidecar["steps_dropped"] == 0
    assert sidecar["model"] == "unit"
    # the on-disk size: header + 16 tokens x (L x N bf16 + 3 int32)
    assert path.stat().st_size == 4096 + 16 * (L * N * 2 + 12)


def test_the_recording_replays_in_lockstep_with_each_step_as_the_engine_batched_it(tmp_path: pathlib.Path) -> None:
    rec = _recorder(tmp_path)
    logits = {s: _logits(8, s) for s in range(6)}
    for s, x in logits.items():
        _step(rec, s, x, [f"r{i}" for i in range(8)], [s] * 8)
    trace = load_trace(str(rec.close()))
    rows = simulate(trace, policies=["vanilla"], batch_sizes=[8], mode="lockstep", num_batches=40, seed=0)
    spec = RouterSpec(N, K)
    per_step = {s: [int(oea.active_experts(*oea.route(x[:, layer].float(), spec))) for layer in range(L)]
                for s, x in logits.items()}
    mean_over_steps = sum(sum(v) for v in per_step.values()) / (len(per_step) * L)
    # each recorded step of 8 rows is the one distinct batch of 8 it holds: replayed once each
    assert rows[0]["num_batches"] == rows[0]["distinct_batches"] == 6
    assert rows[0]["mean_active_experts"] == pytest.approx(mean_over_steps, abs=1e-9)
    batches = make_batches(trace, 8, "lockstep", 40, torch.Generator().manual_seed(0))
    assert sorted(int(trace.step_ids[b[0]]) for b in batches) == sorted(logits)


def test_top_k_content_records_the_router_ids_and_probabilities(tmp_path: pathlib.Path) -> None:
    bias = torch.rand(L, N, generator=torch.Generator().manual_seed(5))
    spec = RouterSpec(N, K, scoring="sigmoid")
    rec = _recorder(tmp_path, spec=spec, bias=bias, content="topk")
    x = _logits(6, 4, torch.float32)
    _step(rec, 1, x, list(range(6)), list(range(6)))
    trace = load_trace(str(rec.close()))
    assert trace.logits is None and trace.ids.shape == (6, L, K)
    torch.testing.assert_close(trace.correction_bias, bias)
    for layer in range(L):
        layer_spec = RouterSpec(N, K, scoring="sigmoid", correction_bias=bias[layer])
        ids, _ = oea.route(x[:, layer], layer_spec)
        assert torch.equal(trace.ids[:, layer], ids)
        torch.testing.assert_close(trace.scores[:, layer], torch.sigmoid(x[:, layer]).gather(1, ids))
    assert "top-4 ids" in trace.meta["recorded"]


def test_sampling_records_the_requested_share_of_steps(tmp_path: pathlib.Path) -> None:
    rec = _recorder(tmp_path, sample=0.25)
    chosen = sum(rec.sample_step() for _ in range(4000))
    assert 900 < chosen < 1100
    rec.close()
    always = _recorder(tmp_path, sample=1.0)
    assert all(always.sample_step() for _ in range(100))
    always.close()


def test_the_size_cap_stops_recording_once_with_a_valid_trace(tmp_path: pathlib.Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    token_bytes = L * N * 2 + 12
    rec = _recorder(tmp_path, max_bytes=4096 + 20 * token_bytes)  # 20 tokens: 2 steps of 8, not 3
    with caplog.at_level(logging.WARNING, logger="test.recorder"):
        for s in range(6):
            _step(rec, s, _logits(8, s), [f"r{i}" for i in range(8)], [s] * 8)
        deadline = time.monotonic() + 60
        while rec.stopped is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not rec.sample_step(), "no step is sampled after the cap"
        _step(rec, 99, _logits(8, 9), [f"r{i}" for i in range(8)], [0] * 8)  # still harmless
        path = rec.close()
    cap_warnings = [r for r in caplog.records if "size cap" in r.getMessage()]
    assert len(cap_warnings) == 1 and "serving continues" in cap_warnings[0].getMessage()
    trace = load_trace(str(path))
    assert trace.num_tokens == 16 and trace.step_ids.tolist() == [0] * 8 + [1] * 8
    assert path.stat().st_size <= 4096 + 20 * token_bytes
    assert "OEA_TRACE_MAX_MB" in trace.meta["stopped"]


def _written(rec: TraceRecorder, steps: int) -> None:
    """Wait until the writer has written ``steps`` steps or stopped."""
    deadline = time.monotonic() + 60
    while rec.steps < steps and rec.stopped is None:
        assert time.monotonic() < deadline, f"the writer wrote {rec.steps} of {steps} steps in 60 s"
        time.sleep(0.005)


def test_a_full_disk_stops_recording_once_and_keeps_the_whole_steps(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    original = TraceFileWriter.append
    calls = {"n": 0}

    def append(self, rows):  # the third write finds the disk full
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, rows)

    monkeypatch.setattr(TraceFileWriter, "append", append)
    monkeypatch.setattr(recorder_module, "BATCH_WAIT_S", 0.001)
    rec = _recorder(tmp_path)
    with caplog.at_level(logging.WARNING, logger="test.recorder"):
        for s in range(5):  # one step per write: each is written before the next is submitted
            _step(rec, s, _logits(4, s), ["a", "b", "c", "d"], [s] * 4)
            _written(rec, s + 1)
        path = rec.close()
    warnings = [r.getMessage() for r in caplog.records if "stops" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]
    trace = load_trace(str(path))
    assert trace.step_ids.tolist() == [0] * 4 + [1] * 4
    assert "No space left" in trace.meta["stopped"]


def test_steps_queued_together_are_written_in_one_go_in_order(tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer wakes rarely and appends every queued step with one write per tensor (each wake-up and
    write competes with the engine for the interpreter lock)."""
    appended: list[int] = []
    original = TraceFileWriter.append

    def counting_append(self, rows):
        appended.append(int(rows["step_ids"].shape[0]))
        return original(self, rows)

    monkeypatch.setattr(TraceFileWriter, "append", counting_append)
    monkeypatch.setattr(recorder_module, "BATCH_WAIT_S", 60.0)
    rec = _recorder(tmp_path)
    logits = {s: _logits(3, s) for s in range(10)}
    for s, x in logits.items():
        _step(rec, s, x, [f"r{s}", "a", "b"], [s, 1, 2])
    path = rec.close()  # wakes the writer at once
    assert appended == [30]
    trace = load_trace(str(path))
    assert trace.step_ids.tolist() == [s for s in range(10) for _ in range(3)]
    torch.testing.assert_close(trace.logits, torch.cat(list(logits.values())).float(), rtol=0, atol=0)
    names = trace.meta["request_names"]
    assert [names[i] for i in trace.request_ids.tolist()] == [r for s in range(10) for r in (f"r{s}", "a", "b")]


def test_a_half_full_queue_wakes_the_writer_before_its_wait_is_over(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "BATCH_WAIT_S", 60.0)
    monkeypatch.setattr(recorder_module, "QUEUE_STEPS", 8)
    rec = _recorder(tmp_path)
    for s in range(6):
        _step(rec, s, _logits(2, s), ["a", "b"], [s, s])
    _written(rec, 4)  # within 10 s, not 60
    assert rec.dropped == 0
    rec.close()


def test_the_queue_is_bounded_by_the_staged_bytes_of_a_large_model(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "QUEUE_BYTES", 5 * L * 8 * N * 4)  # five steps of 8 rows
    rec = _recorder(tmp_path)
    _step(rec, 0, _logits(1, 0), ["a"], [0])
    assert rec.queue_steps == 5
    rec.close()
    monkeypatch.setattr(recorder_module, "QUEUE_BYTES", 1)
    tiny = _recorder(tmp_path)
    _step(tiny, 0, _logits(1, 0), ["a"], [0])
    assert tiny.queue_steps == 2, "at least two steps, however large"
    tiny.close()


class _IdleWatchingQueue(queue.Queue):
    """The writer's queue, remembering whether its last waiting ``get`` ended idle (no step within its timeout);
    the writer's non-waiting drain of the queue leaves that as it was."""

    idle = False

    def get(self, block: bool = True, timeout: float | None = None):
        try:
            item = super().get(block, timeout)
        except queue.Empty:
            self.idle = self.idle or block
            raise
        if block:
            self.idle = False
        return item


def test_a_slow_checkpoint_is_repeated_less_often(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long run's sidecar (every request's name) grows; checkpoints then take at most about 1% of the time.

    An idle engine (no step for ``CHECKPOINT_S``) is checkpointed whatever the rate: on a loaded machine this
    test's own steps can pause that long, so only the checkpoints of a running engine are counted."""
    monkeypatch.setattr(recorder_module, "BATCH_WAIT_S", 0.001)
    monkeypatch.setattr(recorder_module, "CHECKPOINT_S", 0.1)  # 10 in 1.5 s if they took no time
    monkeypatch.setattr(recorder_module, "queue", SimpleNamespace(Queue=_IdleWatchingQueue, Empty=queue.Empty))
    checkpoints: list[bool] = []  # whether each came from an idle wake
    original = TraceRecorder._checkpoint

    def slow_checkpoint(self):
        if self._writer is not None and self._writer.tokens > self._writer.checkpointed:
            checkpoints.append(self._queue.idle)
            time.sleep(0.05)  # the next one no sooner than 5 s later
        return original(self)

    monkeypatch.setattr(TraceRecorder, "_checkpoint", slow_checkpoint)
    rec = _recorder(tmp_path)
    started = time.monotonic()
    s = 0
    while time.monotonic() - started < 1.5:
        _step(rec, s, _logits(1, s), ["a"], [s])
        s += 1
        time.sleep(0.002)
    rec.close()
    assert checkpoints, "no checkpoint in 1.5 s"
    running = checkpoints[1:].count(False)
    assert running == 0, f"{running} checkpoints of a running engine after a slow one, all within 1.5 s"


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_an_unwritable_path_is_a_warning_and_no_recorder(tmp_path: pathlib.Path, where: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "missing" / "t.safetensors" if where == "missing-folder" else tmp_path / "d.safetensors"
    if where == "a-folder":
        path.mkdir()
    with caplog.at_level(logging.WARNING, logger="test.recorder"):
        rec = open_recorder(_settings(path), str(path), RouterSpec(N, K), StepStaging(4, N, "cpu", L), {}, LOG)
    assert rec is None
    assert [r.getMessage() for r in caplog.records if "serving without recording" in r.getMessage()]


def test_a_writer_that_falls_behind_drops_steps_without_blocking(tmp_path: pathlib.Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    writing, release = threading.Event(), threading.Event()
    original = TraceFileWriter.append

    def slow_append(self, rows):
        writing.set()
        release.wait(120)
        return original(self, rows)

    monkeypatch.setattr(TraceFileWriter, "append", slow_append)
    monkeypatch.setattr(recorder_module, "BATCH_WAIT_S", 0.001)
    monkeypatch.setattr(recorder_module, "QUEUE_STEPS", 50)
    rec = _recorder(tmp_path)
    _step(rec, 0, _logits(2, 0), ["a", "b"], [0, 0])
    assert writing.wait(60), "the writer took the first step"
    started = time.monotonic()
    for s in range(1, 50 + 11):
        _step(rec, s, _logits(2, s), ["a", "b"], [s, s])
    assert time.monotonic() - started < 60, "submitting steps must not wait for the writer (held up to 120 s)"
    assert rec.dropped == 10
    release.set()
    trace = load_trace(str(rec.close()))
    assert trace.meta["steps_dropped"] == 10 and trace.meta["steps_recorded"] == 51
    assert trace.step_ids.unique().tolist() == list(range(51))


def test_no_recorded_step_writes_no_file(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    rec = _recorder(tmp_path)
    with caplog.at_level(logging.WARNING, logger="test.recorder"):
        assert rec.close() is None
    assert not (tmp_path / "t.safetensors").exists() and not (tmp_path / "t.json").exists()
    assert any("no decode step was recorded" in r.getMessage() for r in caplog.records)


def test_steps_larger_than_the_staging_capacity_are_skipped_with_a_warning(tmp_path: pathlib.Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    rec = _recorder(tmp_path, capacity=4)
    with caplog.at_level(logging.WARNING, logger="test.recorder"):
        _step(rec, 0, _logits(2, 0), ["a", "b"], [0, 0])
        rec.submit_step(1, 6, list("abcdef"), [0] * 6)
        rec.submit_step(2, 6, list("abcdef"), [0] * 6)
    trace = load_trace(str(rec.close()))
    assert trace.step_ids.tolist() == [0, 0]
    assert len([r for r in caplog.records if "does not fit the recording" in r.getMessage()]) == 1


def test_collected_rows_are_a_copy_taken_at_submit_time() -> None:
    staging = StepStaging(4, N, "cpu", num_layers=2)
    staging.stage(0, torch.ones(3, N))
    host, event = staging.collect(3)
    staging.stage(0, torch.zeros(3, N))
    assert event is None and bool((host[0] == 1).all())


def test_rank_paths() -> None:
    assert rank_path("/x/t.safetensors", 0) == "/x/t.safetensors"
    assert rank_path("/x/t.safetensors", 3) == "/x/t.rank3.safetensors"


def test_layers_added_one_by_one_are_collected_in_order() -> None:
    staging = StepStaging(4, N, "cpu")
    for value in (1.0, 2.0, 3.0):
        staging.stage(staging.add_layer(), torch.full((2, N), value))
    host, _ = staging.collect(2)
    assert host.shape == (3, 2, N) and host[:, :, 0].tolist() == [[1, 1], [2, 2], [3, 3]]


KILLED_WORKER = """
import logging, os, signal, sys, time
import torch
from oea.config import TraceSettings
from oea.integrations.recording.recorder import StepStaging, open_recorder
from oea.routing import RouterSpec

path, n, k, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rec = open_recorder(TraceSettings(path), path, RouterSpec(n, k), StepStaging(8, n, "cpu", num_layers=layers), {},
                    logging.getLogger("killed"))
g = torch.Generator().manual_seed(0)

def step(step_id, rows):
    for layer in range(layers):
        rec.staging.stage(layer, torch.randn(rows, n, generator=g).to(torch.bfloat16))
    rec.submit_step(step_id, rows, [f"r{i}" for i in range(rows)], [step_id] * rows)

for step_id in (1, 2, 3):
    step(step_id, 4)
deadline = time.monotonic() + 30
while rec._writer is None or rec._writer.checkpointed < 12:  # the idle checkpoint
    assert time.monotonic() < deadline, "no checkpoint within 30 s"
    time.sleep(0.05)
step(4, 4)  # written after the checkpoint, not described by it
os.kill(os.getpid(), signal.SIGKILL)  # as vLLM stops its workers: no atexit, no finalizer
"""


def test_a_worker_killed_after_a_checkpoint_leaves_the_trace_of_the_checkpointed_steps(tmp_path: pathlib.Path) -> None:
    """vLLM's default shutdown SIGKILLs its workers: the file is made loadable in place at each checkpoint (here
    when the writer goes idle), so the killed process leaves a validated trace of the steps before it."""
    import subprocess
    import sys

    path = tmp_path / "killed.safetensors"
    proc = subprocess.run([sys.executable, "-c", KILLED_WORKER, str(path), str(N), str(K), str(L)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == -9, proc.stderr[-2000:]
    trace = load_trace(str(path))
    assert trace.step_ids.tolist() == [1] * 4 + [2] * 4 + [3] * 4
    assert trace.num_layers == L and trace.logits.shape == (12, L, N) and trace.meta["steps_recorded"] == 3
    assert trace.meta["stopped"].startswith("interrupted")
    g = torch.Generator().manual_seed(0)
    expected = torch.stack([torch.stack([torch.randn(4, N, generator=g).to(torch.bfloat16) for _ in range(L)], 1)
                            for _ in range(3)]).reshape(12, L, N)
    torch.testing.assert_close(trace.logits, expected.float(), rtol=0, atol=0)


def test_a_checkpoint_is_replaced_by_the_finished_file(tmp_path: pathlib.Path) -> None:
    """A checkpoint describes the rows so far (padding tensors skipped by the loader); rows appended after it
    are not described until ``finish``, which compacts the file to its exact size."""
    columns = [Column("logits", (L, N), torch.bfloat16),
               *(Column(name, (), torch.int32) for name in ("request_ids", "positions", "step_ids"))]
    writer = TraceFileWriter(tmp_path / "c.safetensors", columns, 2**20)
    logits = _logits(6, 7)

    def rows(lo: int, hi: int) -> dict[str, torch.Tensor]:
        ints = torch.arange(lo, hi, dtype=torch.int32)
        return {"logits": logits[lo:hi], "request_ids": ints, "positions": ints, "step_ids": ints}

    writer.append(rows(0, 4))
    writer.checkpoint({"name": "c"}, RouterSpec(N, K))
    writer.append(rows(4, 6))
    checkpointed = load_trace(str(tmp_path / "c.safetensors"))
    assert checkpointed.num_tokens == 4 and checkpointed.step_ids.tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(checkpointed.logits, logits[:4].float(), rtol=0, atol=0)
    assert (tmp_path / "c.safetensors").stat().st_size > 2**19, "sized up front while it grows"
    writer.finish({"name": "c"}, RouterSpec(N, K))
    finished = load_trace(str(tmp_path / "c.safetensors"))
    assert finished.step_ids.tolist() == list(range(6))
    assert (tmp_path / "c.safetensors").stat().st_size == 4096 + 6 * (L * N * 2 + 12)


def _wait_stopped(rec: TraceRecorder) -> None:
    deadline = time.monotonic() + 60
    while rec.stopped is None:
        assert time.monotonic() < deadline, "recording did not stop at the size cap within 60 s"
        time.sleep(0.005)


def test_a_step_that_exactly_fills_the_size_cap_is_kept(tmp_path: pathlib.Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cap of exactly two steps of 8 rows (header included): both are written, the third stops recording,
    and the finished file is the cap to the byte."""
    monkeypatch.setattr(recorder_module, "BATCH_WAIT_S", 0.001)
    token_bytes = L * N * 2 + 12
    cap = 4096 + 16 * token_bytes
    rec = _recorder(tmp_path, max_bytes=cap)
    for s in range(2):
        _step(rec, s, _logits(8, s), [f"r{i}" for i in range(8)], [s] * 8)
        _written(rec, s + 1)
    assert rec.stopped is None, f"a step that fits the cap exactly stopped recording: {rec.stopped}"
    _step(rec, 2, _logits(8, 2), [f"r{i}" for i in range(8)], [2] * 8)
    _wait_stopped(rec)
    path = rec.close()
    trace = load_trace(str(path))
    assert trace.step_ids.tolist() == [0] * 8 + [1] * 8
    assert path.stat().st_size == cap


def test_a_recording_with_a_correction_bias_ends_within_the_size_cap(tmp_path: pathlib.Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Sigmoid routers record their [L, N] float32 correction bias too: it counts against the cap. A cap of
    24 tokens' rows leaves room for 22 tokens beside the bias (2 steps of 8); the file on disk never
    exceeds the cap, while it grows or once finished."""
    monkeypatch.setattr(recorder_module, "BATCH_WAIT_S", 0.001)
    bias = torch.rand(L, N, generator=torch.Generator().manual_seed(8))
    token_bytes = L * N * 2 + 12
    cap = 4096 + 24 * token_bytes  # the bias takes L * N * 4 = 384 bytes of it, about 1.9 tokens
    rec = _recorder(tmp_path, spec=RouterSpec(N, K, scoring="sigmoid"), bias=bias, max_bytes=cap)
    path = tmp_path / "t.safetensors"
    for s in range(4):
        _step(rec, s, _logits(8, s), [f"r{i}" for i in range(8)], [s] * 8)
        _written(rec, s + 1)
        assert path.stat().st_size <= cap, f"after step {s}: {path.stat().st_size} bytes on disk, cap {cap}"
        if rec.stopped is not None:
            break
    assert rec.stopped is not None and "OEA_TRACE_MAX_MB" in rec.stopped
    rec.close()
    assert path.stat().st_size <= cap
    trace = load_trace(str(path))
    assert trace.num_tokens == 16 and trace.step_ids.tolist() == [0] * 8 + [1] * 8
    torch.testing.assert_close(trace.correction_bias, bias)
