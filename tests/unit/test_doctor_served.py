"""``oea doctor --metrics-file``: what a server's OEA_METRICS_FILE says about OEA while it served. The rows
are written here in the plugins' format (docs/vllm.md): a server on which OEA never rewrote a decode step
(the reference deployment's symptom) fails with "OEA engaged in 0 of N"; an engaged one gives N of M and
the active experts against the engine's own routing; padded decode forwards are counted."""

from __future__ import annotations

import json
import pathlib

import pytest

from oea.cli import main
from oea.integrations.served import engagement, read_metrics, served_checks


def _row(step: int, rows: int, oea: bool, active: list[int], stock: list[int] | None = None, decode: bool = True,
         padding: int = 0) -> dict:
    row = {"pid": 7, "rank": 0, "step": step, "time": 1.0 + step, "decode": decode, "oea": oea, "rows": rows,
           "padding_rows": padding, "layers": len(active), "active": active}
    if stock is not None:
        row["active_stock"] = stock
    return row


def _write(path: pathlib.Path, rows: list[dict], tail: str = "") -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def _by_name(checks: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in checks}


def test_a_server_where_oea_never_rewrote_a_decode_step_fails_with_0_of_n(tmp_path: pathlib.Path) -> None:
    rows = [_row(0, 40, False, [60, 62], decode=False)]  # the prefill forward
    rows += [_row(s, 16, False, [64 + s % 3, 66]) for s in range(1, 9)]  # decode, never rewritten
    checks = _by_name(served_checks(_write(tmp_path / "m.jsonl", rows), 2))
    assert checks["metrics file"]["ok"] and "9 forwards, 8 decode" in checks["metrics file"]["detail"]
    engaged = checks["OEA engaged"]
    assert not engaged["ok"] and "OEA engaged in 0 of 8 decode forwards with >= 2 real rows" in engaged["detail"]
    assert "(not rewritten)" in checks["active experts"]["detail"]


def test_an_engaged_server_reports_n_of_m_and_the_drop_against_stock_routing(tmp_path: pathlib.Path) -> None:
    rows = [_row(s, 16, True, [30 + s % 2, 32], [64, 66]) for s in range(6)]
    rows += [_row(6, 1, False, [8, 8], [8, 8]), _row(7, 16, False, [64, 65], [64, 65], padding=3)]
    found = engagement(read_metrics(_write(tmp_path / "m.jsonl", rows)), 2)
    assert (found["decode_forwards"], found["eligible"], found["engaged"], found["padded"]) == (8, 7, 6, 1)
    assert found["active"] == [30, 32, 31, 32, 30, 32, 31, 32, 30, 32, 31, 32]  # engaged forwards only
    checks = _by_name(served_checks(tmp_path / "m.jsonl", 2))
    assert checks["OEA engaged"]["ok"]
    assert "OEA engaged in 6 of 7 decode forwards with >= 2 real rows (86%); the other 1 kept" in \
        checks["OEA engaged"]["detail"]
    assert "31.2 [" in checks["active experts"]["detail"] and "65.0 [" in checks["active experts"]["detail"]
    assert "= 0.48x" in checks["active experts"]["detail"]
    assert "1 of 8 decode forwards carried CUDA-graph padding rows" in checks["padding rows"]["detail"]
    # below min_batch nothing is expected: with min_batch 17 no forward is eligible, which proves nothing
    assert not _by_name(served_checks(tmp_path / "m.jsonl", 17))["OEA engaged"]["ok"]


def test_bad_metrics_files_are_named_with_the_line(tmp_path: pathlib.Path) -> None:
    good = [_row(0, 4, True, [9], [12])]
    assert len(read_metrics(_write(tmp_path / "cut.jsonl", good, tail='{"decode": tr'))) == 1  # still writing
    with pytest.raises(ValueError, match=r"bad.jsonl: line 1 is not JSON"):
        read_metrics(_write(tmp_path / "bad.jsonl", [], tail="nope\n" + json.dumps(good[0]) + "\n"))
    with pytest.raises(ValueError, match=r"line 1 lacks \['oea'\]"):
        read_metrics(_write(tmp_path / "x.jsonl", [{"decode": True, "rows": 3, "active": [1]}]))
    [failed] = served_checks(tmp_path / "none.jsonl", 2)
    assert not failed["ok"] and "--metrics-file" in failed["detail"] and "no such file" in failed["detail"]


def test_oea_doctor_metrics_file_adds_the_served_block_and_its_exit_status(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OEA_K0", "SGLANG_OEA_K0", "OEA_MIN_BATCH", "SGLANG_OEA_MIN_BATCH"):
        monkeypatch.delenv(name, raising=False)
    never = _write(tmp_path / "never.jsonl", [_row(s, 16, False, [64]) for s in range(3)])
    assert main(["doctor", "vllm", "--metrics-file", str(never), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["served"]["path"] == str(never) and not report["served"]["ok"] and not report["ok"]
    assert main(["doctor", "vllm", "--metrics-file", str(never)]) == 1
    text = capsys.readouterr().out
    assert f"served (--metrics-file {never}): FAILED" in text
    assert "oea doctor: served: OEA engaged: OEA engaged in 0 of 3 decode forwards" in text
    monkeypatch.setenv("OEA_MIN_BATCH", "4")  # the environment's min_batch is the default
    small = _write(tmp_path / "small.jsonl", [_row(s, 3, False, [20]) for s in range(3)])
    main(["doctor", "vllm", "--metrics-file", str(small), "--json"])
    assert "no decode forward had >= 4 real rows" in capsys.readouterr().out
    assert main(["doctor", "--min-batch", "-1"]) == 2
