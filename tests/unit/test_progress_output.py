"""Long commands report progress on stderr (a bar on a terminal, a line every few seconds elsewhere) and stay
silent with ``--json``; stdout carries only the result, and an argument error stays the single stderr line."""

from __future__ import annotations

import json
import pathlib

import pytest

import oea.console
from oea.cli import main
from oea.console import progress_bar


def test_plain_progress_prints_at_the_first_call_then_at_most_every_interval(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = [100.0]
    monkeypatch.setattr(oea.console.time, "monotonic", lambda: clock[0])
    with progress_bar("oea thing: working", True) as update:
        assert update is not None
        assert capsys.readouterr().err == ""  # nothing before the work reports: an early error stays alone
        update(1, 50)
        clock[0] += 3.0
        update(2, 50)  # within the interval: no line
        clock[0] += oea.console.PLAIN_PROGRESS_EVERY_S
        update(30, 50)
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["oea thing: working: 1/50 (0 s)", "oea thing: working: 30/50 (13 s)"]
    with progress_bar("quiet", False) as update:
        assert update is None
    assert capsys.readouterr() == ("", "")


def _progress_lines(err: str, command: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"oea {command}:")]


@pytest.mark.parametrize(("argv", "command"), [
    (["simulate", "--batch-sizes", "4", "--k0", "3", "--num-batches", "2"], "simulate"),
    (["bench", "routing", "--num-experts", "16", "--top-k", "4", "--k0", "2", "--batch-sizes", "1", "4",
      "--repeats", "5"], "bench routing"),
])
def test_a_long_command_reports_progress_on_stderr_and_none_with_json(
    argv: list[str], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert _progress_lines(err, command), err
    assert out.strip() and not _progress_lines(out, command)
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)


def test_inflate_reports_each_shard_and_is_silent_with_json(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from oea.models.inflate import write_inflated

    calls: list[tuple[int, int]] = []
    write_inflated(tmp_path / "a", moe_intermediate_size=64, progress=lambda done, total: calls.append((done, total)))
    total = calls[-1][1]
    assert calls == [(i, total) for i in range(1, total)] + [(total, total)] and total >= 2
    assert main(["inflate", "--moe-intermediate-size", "64", "--out", str(tmp_path / "b")]) == 0
    out, err = capsys.readouterr()
    assert _progress_lines(err, "inflate") and out.startswith("wrote ")
    assert main(["inflate", "--moe-intermediate-size", "64", "--out", str(tmp_path / "c"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["out_dir"] == str(tmp_path / "c")
