"""``oea bench serve --summarize FILE``: the A/B summary of an earlier run's rows, without any server."""

from __future__ import annotations

import json
import pathlib

import pytest

from oea.cli import main


def _row(arm: str, concurrency: int, round_index: int, tpot: float) -> dict:
    return {"arm": arm, "max_concurrency": concurrency, "round": round_index, "median_tpot_ms": tpot,
            "median_itl_ms": tpot, "mean_tpot_ms": tpot, "mean_ttft_ms": 20.0, "output_throughput": 1000.0 / tpot,
            "loadavg": [1.0, 1.0, 1.0]}


def _write(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_summarize_reads_rows_and_pairs_ratios_by_round(tmp_path: pathlib.Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    rows = [_row("off", 16, 0, 100.0), _row("k3", 16, 0, 50.0), _row("k3", 16, 1, 100.0), _row("off", 16, 1, 200.0),
            _row("off", 16, 2, 900.0)]  # round 2: the baseline alone (a stopped run), left out of the pairs
    path = _write(tmp_path / "ab.jsonl", rows)
    assert main(["bench", "serve", "--summarize", str(path), "--baseline-arm", "off", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == rows
    k3 = next(e for e in out["ab"] if e["arm"] == "k3")
    assert k3["median_tpot_ms_ratio_pairs"] == 2
    assert k3["median_tpot_ms_ratio"] == pytest.approx(75.0 / 150.0)
    assert k3["median_tpot_ms_ratio_ci"] == pytest.approx([0.5, 0.5])  # every pair has ratio 0.5
    off = next(e for e in out["ab"] if e["arm"] == "off")
    assert off["rounds"] == 3 and off["median_tpot_ms"] == pytest.approx(200.0)
    assert list(tmp_path.iterdir()) == [path], "nothing written without --plot"


def test_summarize_plot_and_table(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "ab.jsonl", [_row(a, c, r, t * c) for r in range(2) for c in (1, 16)
                                          for a, t in (("off", 10.0), ("k3", 7.0))])
    assert main(["bench", "serve", "--summarize", str(path), "--plot", str(tmp_path / "ab.png")]) == 0
    assert "0.700" in capsys.readouterr().out  # k3 / off TPOT ratio in the table
    assert (tmp_path / "ab.png").stat().st_size > 0


@pytest.mark.parametrize(("content", "extra", "message"), [
    (None, [], "no such file"),
    ("not json\n", [], "is not JSON lines"),
    ('{"a": 1}\n', [], "has no oea bench serve rows"),
    ("", [], "has no oea bench serve rows"),
    ('{"arm": "off", "max_concurrency": 1, "round": 0}\n', [], "each needs arm, max_concurrency, round, output"),
    ('{"arm": "off", "max_concurrency": 1, "round": 0}\n', ["--base-url", "http://127.0.0.1:9"], "cannot be combined"),
    ('{"arm": "off", "max_concurrency": 1, "round": 0}\n', ["--output-file", "x.jsonl"], "cannot be combined"),
])
def test_summarize_bad_input(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], content: str | None,
                             extra: list[str], message: str) -> None:
    path = tmp_path / "ab.jsonl"
    if content is not None:
        path.write_text(content)
    before = sorted(tmp_path.iterdir())
    assert main(["bench", "serve", "--summarize", str(path), *extra]) == 2
    out, err = capsys.readouterr()
    assert "--summarize" in err and message in err and "Traceback" not in err and out == ""
    assert sorted(tmp_path.iterdir()) == before


def _restart_mode_rows(missing: tuple[str, int] | None = None) -> list[dict]:
    """Rows as restart mode writes them: per round, one server per arm in the rotated order
    (``restart_order``). The baseline drifts from round to round far more than the effect; k3's TPOT is 0.8
    times the baseline's of the same round, so ratios paired by round are exactly 0.8."""
    from oea.bench.serve.ab import restart_order

    off_tpot = {0: 100.0, 1: 160.0, 2: 70.0, 3: 130.0, 4: 90.0}
    rows = []
    for r, tpot in off_tpot.items():
        for arm in restart_order(["off", "k3"], r):
            if (arm, r) != missing:
                rows.append(_row(arm, 16, r, tpot * (0.8 if arm == "k3" else 1.0)))
    return rows


@pytest.mark.parametrize("layout", ["restart-order", "round-missing", "shuffled"])
def test_summarize_pairs_ratios_by_round_not_by_row_order(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                          layout: str) -> None:
    """Whatever the order of the rows in the file (arm order rotated per round, one arm missing a round,
    shuffled), each ratio pairs the rounds both arms have, and --summarize says how many pairs it used."""
    import random

    rows = _restart_mode_rows(("k3", 2) if layout == "round-missing" else None)
    if layout == "shuffled":
        random.Random(0).shuffle(rows)
        order = {arm: [r["round"] for r in rows if r["arm"] == arm] for arm in ("off", "k3")}
        assert order["off"] != order["k3"], "the shuffle must put the arms' rounds in different orders"
    pairs = 4 if layout == "round-missing" else 5
    path = _write(tmp_path / "ab.jsonl", rows)
    assert main(["bench", "serve", "--summarize", str(path), "--baseline-arm", "off", "--json"]) == 0
    k3 = next(e for e in json.loads(capsys.readouterr().out)["ab"] if e["arm"] == "k3")
    assert k3["median_tpot_ms_ratio_pairs"] == k3["output_throughput_ratio_pairs"] == pairs
    assert k3["median_tpot_ms_ratio"] == pytest.approx(0.8)
    assert k3["median_tpot_ms_ratio_ci"] == pytest.approx([0.8, 0.8]), "every pair of one round has ratio 0.8"
    assert k3["output_throughput_ratio"] == pytest.approx(1 / 0.8)
    assert main(["bench", "serve", "--summarize", str(path), "--baseline-arm", "off"]) == 0
    table = capsys.readouterr().out
    assert "pairs" in table and f"{pairs} rounds" in table, table
