"""``OEA_METRICS_FILE`` from SGLang through SGLang's real ``forward_context`` and ``select_experts`` (sglang 0.5.23,
CPU, .venv-sglang): one row per forward with the vLLM plugin's fields, each layer's counts equal to those of the
ids SGLang went on with, OEA off and on; a write failure is one warning and routing goes on. The SGLang side is
``sglang_cpu_metrics.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_venv import ROOT, run_script_json

import oea
from oea.integrations.metrics import routed_hash

pytestmark = [pytest.mark.engine, pytest.mark.slow]
SCRIPT = ROOT / "tests" / "engines" / "sglang_cpu_metrics.py"
SPEC = oea.RouterSpec(128, 8, "softmax", True)
# the vLLM plugin's row (oea.integrations.metrics), OEA_TIMING on; ``reason`` besides in the decode rows that
# kept the engine's routing
ROW_FIELDS = {"pid", "rank", "step", "time", "decode", "verify", "tokens_per_request", "oea", "rows", "padding_rows",
              "outside_rows", "layers", "active", "routed", "routing_us"}


def _run(mode: str, path: Path, *extra: str) -> tuple[dict[str, Any], str]:
    """The script's report and stderr (``extra``: ``cut``)."""
    proc, report = run_script_json(SCRIPT, [mode, str(path), *extra])
    assert proc.returncode == 0 and report is not None, proc.stderr[-4000:]
    return report, proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], str]]:
    """Each mode's report and stderr; the ``oea`` run's folder is removed after its rows are written (``cut``)."""
    return {"observe": _run("observe", tmp_path_factory.mktemp("observe") / "m.jsonl"),
            "oea": _run("oea", tmp_path_factory.mktemp("oea") / "m.jsonl", "cut")}


def _counted(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The forwards that must give a row (the routing call outside any forward does not)."""
    return [f for f in report["forwards"] if f["mode"] != "OUTSIDE"]


def _valid(forward: dict[str, Any]) -> torch.Tensor:
    return torch.arange(forward["rows"]) < (forward["real"] or forward["rows"])


def _active(routed: dict[str, Any], valid: torch.Tensor) -> int:
    ids, weights = torch.tensor(routed["ids"]).long()[valid], torch.tensor(routed["weights"])[valid]
    return int(oea.active_experts(ids, weights))


@pytest.mark.parametrize("mode", ["observe", "oea"])
def test_one_row_per_forward_with_the_vllm_fields(runs: dict[str, tuple[dict[str, Any], str]], mode: str) -> None:
    report = runs[mode][0]
    forwards, rows = _counted(report)[:6], report["rows"]
    assert len(rows) == len(forwards) == 6
    fields = ROW_FIELDS | ({"active_stock"} if mode == "oea" else set())
    # ``reason`` only in the DECODE rows that kept SGLang's routing: every one with OEA off, the 1-row batch
    # (below OEA_MIN_BATCH=2) with it on
    kept = [f["mode"] == "DECODE" and (mode == "observe" or (f["real"] or f["rows"]) < 2) for f in forwards]
    assert kept == ([True, True, False, True, True, True] if mode == "observe" else
                    [False, False, False, False, True, False])
    expected = [fields | ({"reason"} if k else set()) for k in kept]
    assert [set(row) for row in rows] == expected, [sorted(set(r) ^ e) for r, e in zip(rows, expected, strict=True)]
    assert [row.get("reason") for row in rows] == \
        [("oea_off" if mode == "observe" else "below_min_batch") if k else None for k in kept]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert all(row["pid"] == report["pid"] and row["rank"] == 0 and row["layers"] == 3 for row in rows)
    assert [row["time"] for row in rows] == sorted(row["time"] for row in rows)
    assert [row["decode"] for row in rows] == [f["mode"] == "DECODE" for f in forwards] == \
        [True, True, False, True, True, True]
    assert not any(row["verify"] for row in rows)
    assert [row["tokens_per_request"] for row in rows] == \
        [f["lengths"] or [1] * f["rows"] for f in forwards]
    assert [(row["rows"], row["padding_rows"]) for row in rows] == [(6, 0), (8, 0), (7, 0), (5, 3), (1, 0), (8, 0)]
    assert [row["outside_rows"] for row in rows] == [0, 0, 0, 0, 0, 4], "the warm-up call's rows, in the next row"
    assert all(len(row["routing_us"]) == 3 and all(t > 0 for t in row["routing_us"]) for row in rows)


@pytest.mark.parametrize("mode", ["observe", "oea"])
def test_each_layers_counts_are_those_of_the_ids_sglang_went_on_with(runs: dict[str, tuple[dict[str, Any], str]],
                                                                     mode: str) -> None:
    report = runs[mode][0]
    for forward, row in zip(_counted(report)[:6], report["rows"], strict=True):
        valid = _valid(forward)
        assert row["active"] == [_active(r, valid) for r in forward["routed"]], row["step"]
        assert row["routed"] == [routed_hash(torch.tensor(r["ids"]), torch.tensor(r["weights"]), valid)
                                 for r in forward["routed"]], row["step"]


Runs = dict[str, tuple[dict[str, Any], str]]


def test_with_oea_on_decode_rows_say_so_and_count_sglangs_own_routing_beside(runs: Runs) -> None:
    report = runs["oea"][0]
    cfg = oea.OEAConfig(3, min_batch=2)
    for forward, row in zip(_counted(report)[:6], report["rows"], strict=True):
        valid = _valid(forward)
        logits = [torch.tensor(x)[valid] for x in forward["logits"]]
        stock = [int(oea.active_experts(*oea.route(x, SPEC))) for x in logits]
        assert row["active_stock"] == stock, row["step"]
        rewritten = forward["mode"] == "DECODE" and int(valid.sum()) >= 2
        assert row["oea"] is rewritten, row["step"]
        if rewritten:
            assert row["active"] == [int(oea.active_experts(*oea.route(x, SPEC, cfg))) for x in logits]
            assert all(a < s for a, s in zip(row["active"], stock, strict=True))
        else:  # EXTEND and a batch below OEA_MIN_BATCH keep SGLang's routing
            assert row["active"] == stock
    observe = runs["observe"][0]["rows"]
    assert not any(row["oea"] for row in observe)


def test_an_unwritable_metrics_file_warns_at_start_and_routing_goes_on(tmp_path: Path) -> None:
    report, stderr = _run("oea", tmp_path / "missing" / "m.jsonl")
    assert not report["writer"] and report["rows"] == []
    assert stderr.count("OEA_METRICS_FILE") == 1 and "serving without metrics" in stderr
    assert not (tmp_path / "missing").exists()
    forward = report["forwards"][1]
    assert _active(forward["routed"][0], _valid(forward)) == \
        int(oea.active_experts(*oea.route(torch.tensor(forward["logits"][0]), SPEC, oea.OEAConfig(3))))


def test_a_write_that_fails_is_one_warning_and_serving_goes_on(runs: dict[str, tuple[dict[str, Any], str]]) -> None:
    report, stderr = runs["oea"]
    assert report["failed"] and "FileNotFoundError" in report["failed"] and report["pending"] == 0
    assert stderr.count("cannot be written") == 1 and "no more metrics are recorded, serving continues" in stderr
    assert len(report["forwards"]) == 3 * 7, "every forward ran after the failure"
    last = report["forwards"][-1]
    assert _active(last["routed"][0], _valid(last)) == \
        int(oea.active_experts(*oea.route(torch.tensor(last["logits"][0]), SPEC, oea.OEAConfig(3))))
    assert "cannot be written" not in runs["observe"][1]
