"""Recording decode forwards from SGLang (``OEA_TRACE_FILE``) through SGLang's real routing code (sglang 0.5.23,
CPU, .venv-sglang): the trace holds exactly the DECODE forwards' router logits, request ids, positions and
step numbers, loads as a validated ``oea-trace``, and replays SGLang's own active-expert counts, with OEA off
and on. The SGLang side is ``sglang_cpu_recording.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_venv import ROOT, run_script_json

import oea
from oea.sim import make_batches, simulate
from oea.traces import load_trace

pytestmark = [pytest.mark.engine, pytest.mark.slow]
SCRIPT = ROOT / "tests" / "engines" / "sglang_cpu_recording.py"
SPEC = oea.RouterSpec(128, 8, "softmax", True)


def _run(mode: str, path: Path) -> tuple[Any, str]:
    proc, report = run_script_json(SCRIPT, [mode, str(path)])
    assert proc.returncode == 0 and report is not None, proc.stderr[-4000:]
    return report, proc.stderr


@pytest.fixture(scope="module")
def observe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("observe") / "trace.safetensors"
    report, _ = _run("observe", path)
    return {"report": report, "trace": load_trace(str(path))}


def _decode(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["forwards"] if f["mode"] == "DECODE"]


def _sglang_active(forward: dict[str, Any]) -> list[int]:
    """Distinct experts SGLang's own routing loaded per layer in this forward."""
    return [int(oea.active_experts(torch.tensor(r["ids"]).long(), torch.tensor(r["weights"])))
            for r in forward["routed"]]


def test_the_trace_holds_exactly_the_decode_forwards(observe: dict[str, Any]) -> None:
    trace, decode = observe["trace"], _decode(observe["report"])
    assert trace.num_tokens == sum(len(f["rids"]) for f in decode) == 35 and trace.num_layers == 3
    expected = torch.cat([torch.tensor(f["logits"]).transpose(0, 1) for f in decode])  # [T, L, N]
    assert torch.equal(trace.logits, expected), "float32 router logits, bit for bit, EXTEND rows left out"
    assert trace.step_ids.tolist() == [s for i, f in enumerate(decode, 1) for s in [i] * len(f["rids"])]
    assert trace.positions.tolist() == [n - 1 for f in decode for n in f["seq_lens"]]
    names = trace.meta["request_names"]
    assert [names[i] for i in trace.request_ids.tolist()] == [r for f in decode for r in f["rids"]]
    assert "SGLang" in trace.meta["source"] and trace.meta["layer_ids"] == [0, 1, 2]


def test_each_recorded_forward_replays_sglangs_own_active_experts(observe: dict[str, Any]) -> None:
    trace, decode = observe["trace"], _decode(observe["report"])
    for step, forward in enumerate(decode, 1):
        rows = trace.step_ids == step
        replayed = [int(oea.active_experts(*oea.route(trace.logits[rows, layer], SPEC))) for layer in range(3)]
        assert replayed == _sglang_active(forward), step
    rows = simulate(trace, policies=["vanilla"], batch_sizes=[8], mode="lockstep", num_batches=30, seed=2)
    batches = make_batches(trace, 8, "lockstep", 30, torch.Generator().manual_seed(2))
    counted = [sum(_sglang_active(decode[int(trace.step_ids[b[0]]) - 1])) / 3 for b in batches]
    assert rows[0]["mean_active_experts"] == pytest.approx(sum(counted) / len(counted), abs=1e-9)


def test_with_oea_on_the_trace_keeps_the_routers_logits(tmp_path: Path) -> None:
    report, _ = _run("oea", tmp_path / "trace.safetensors")
    trace, decode = load_trace(str(tmp_path / "trace.safetensors")), _decode(report)
    assert report["rewrites"] > 0
    assert torch.equal(trace.logits, torch.cat([torch.tensor(f["logits"]).transpose(0, 1) for f in decode]))
    forward = decode[1]
    for layer in range(3):
        x = torch.tensor(forward["logits"][layer])
        ids, weights = oea.route(x, SPEC, oea.OEAConfig(3))
        assert int(oea.active_experts(torch.tensor(forward["routed"][layer]["ids"]).long(),
                                      torch.tensor(forward["routed"][layer]["weights"]))) == \
            int(oea.active_experts(ids, weights)) < int(oea.active_experts(*oea.route(x, SPEC)))
    assert any("OEA_K0=3" in note for note in trace.meta["notes"])


def test_an_unwritable_trace_file_warns_and_routing_goes_on(tmp_path: Path) -> None:
    report, stderr = _run("observe", tmp_path / "missing" / "trace.safetensors")
    assert not report["recorder"] and report["written"] is None
    assert "cannot be written" in stderr and "serving without recording" in stderr
    assert not (tmp_path / "missing").exists()
    for forward in _decode(report):
        for layer, routed in enumerate(forward["routed"]):
            ids, _ = oea.route(torch.tensor(forward["logits"][layer]), SPEC)
            assert sorted(map(sorted, routed["ids"])) == sorted(map(sorted, ids.tolist()))
