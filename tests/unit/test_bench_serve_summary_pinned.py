"""``oea bench serve --summarize`` (issue 36): the engine figures are the documented statistic, and a ratio
resting on fewer than two common rounds has no interval and says so.

* Engine fields (``engine_active_experts``, ``engine_step_ms_median``, ...) are **means over an arm's rounds**,
  as docs/benchmarks-serving.md says (and the published tables there are); step counts are sums. The rows
  below make mean and median differ, so either swap shows.
* A ratio to the baseline arm with 0 or 1 rounds in common gets no interval (``M_ratio_ci`` null,
  ``M_ratio_pairs`` 0, ``M_ratio_note`` saying why), and the table says ``(no CI)``: an unpaired bootstrap
  over rounds run at different times would present the machine's drift as an interval of the effect.
"""

from __future__ import annotations

import json
import pathlib
import statistics

import pytest

from oea.bench.serve.summary import COUNT_FIELDS, ENGINE_FIELDS, ENGINE_STATISTIC, ab_summary, plot_ab
from oea.cli import main

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "benchmarks-serving.md"
ENGINE_ROUNDS = (10.0, 20.0, 60.0)  # mean 30, median 20


def _row(arm: str, round_index: int, tpot: float, **extra: float) -> dict:
    return {"arm": arm, "max_concurrency": 16, "round": round_index, "median_tpot_ms": tpot, "median_itl_ms": tpot,
            "mean_tpot_ms": tpot, "mean_ttft_ms": 20.0, "output_throughput": 1000.0 / tpot, **extra}


def _engine_rows() -> list[dict]:
    rows = []
    for r, value in enumerate(ENGINE_ROUNDS):
        engine = {field: value for field in ENGINE_FIELDS} | {field: 10 * (r + 1) for field in COUNT_FIELDS}
        rows += [_row("off", r, 100.0, **engine), _row("k3", r, 70.0, **engine)]
    return rows


def _summarize(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], rows: list[dict],
               *extra: str) -> str:
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["bench", "serve", "--summarize", str(path), "--baseline-arm", "off", *extra]) == 0
    return capsys.readouterr().out


def test_engine_figures_are_means_over_rounds_and_step_counts_sums(tmp_path: pathlib.Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    mean, median = statistics.mean(ENGINE_ROUNDS), statistics.median(ENGINE_ROUNDS)
    assert mean != median
    for source in ("ab_summary", "--json"):
        summary = (ab_summary(_engine_rows(), baseline="off") if source == "ab_summary" else
                   json.loads(_summarize(tmp_path, capsys, _engine_rows(), "--json"))["ab"])
        for entry in summary:
            for field in ENGINE_FIELDS:
                assert entry[field] == pytest.approx(mean), f"{source} {entry['arm']} {field}: the mean over rounds"
            for field in COUNT_FIELDS:
                assert entry[field] == 10 + 20 + 30, f"{source} {field}: summed over rounds"
    table = _summarize(tmp_path, capsys, _engine_rows())
    assert "engine columns: means over rounds" in table
    assert f"{mean:.1f} ({mean:.1f})" in table, "active experts (stock): the means"
    assert f"{median:.1f} ({median:.1f})" not in table


def test_the_docs_name_the_statistic_the_code_uses() -> None:
    text = " ".join(DOCS.read_text().split())  # line breaks as spaces
    assert ENGINE_STATISTIC == "mean"
    assert f"reports each engine figure as its **{ENGINE_STATISTIC} over rounds**" in text
    assert "step counts (`engine_decode_steps`" in text and "are summed over rounds" in text


@pytest.mark.parametrize("common", [0, 1])
def test_a_ratio_with_fewer_than_two_common_rounds_has_no_interval_and_says_so(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], common: int) -> None:
    off = [_row("off", r, tpot) for r, tpot in enumerate((100.0, 120.0, 200.0))]
    k3 = [_row("k3", r, tpot) for r, tpot in zip((2 - common + 1, 7, 8), (60.0, 70.0, 80.0), strict=True)]
    rows = off + k3
    assert len({r["round"] for r in off} & {r["round"] for r in k3}) == common
    entry = next(e for e in ab_summary(rows, baseline="off") if e["arm"] == "k3")
    for metric in ("median_tpot_ms", "output_throughput"):
        assert entry[f"{metric}_ratio_ci"] is None, f"{metric}: no interval from {common} common rounds"
        assert entry[f"{metric}_ratio_pairs"] == 0
        shared = "1 round" if common == 1 else "0 rounds"
        assert entry[f"{metric}_ratio_note"] == (f"no interval: {shared} in common with 'off' (2 needed); "
                                                 "the ratio is of all rounds' medians, unpaired")
    assert entry["median_tpot_ms_ratio"] == pytest.approx(70.0 / 120.0), "the point estimate: unpaired medians"
    out = json.loads(_summarize(tmp_path, capsys, rows, "--json"))
    listed = next(e for e in out["ab"] if e["arm"] == "k3")
    assert listed["median_tpot_ms_ratio_ci"] is None and "no interval" in listed["median_tpot_ms_ratio_note"]
    table = _summarize(tmp_path, capsys, rows)
    assert f"{70.0 / 120.0:.3f} (no CI)" in table and "0 (unpaired)" in table, table
    assert "(no CI): fewer than 2 rounds in common with the baseline arm" in table, table
    assert plot_ab(ab_summary(rows, baseline="off"), tmp_path / "ab.png").stat().st_size > 0, "a point, no bar"


def test_two_common_rounds_give_a_paired_interval_and_no_note() -> None:
    rows = [_row("off", r, tpot) for r, tpot in enumerate((100.0, 200.0))]
    rows += [_row("k3", r, tpot) for r, tpot in enumerate((50.0, 100.0))]
    entry = next(e for e in ab_summary(rows, baseline="off") if e["arm"] == "k3")
    assert entry["median_tpot_ms_ratio_ci"] == pytest.approx([0.5, 0.5]) and entry["median_tpot_ms_ratio_pairs"] == 2
    assert not any(key.endswith("_ratio_note") for key in entry)


def test_a_zero_baseline_median_without_pairs_is_a_clear_error() -> None:
    rows = [_row("off", 0, 100.0, spec_acceptance_rate=0.0), _row("k3", 5, 70.0, spec_acceptance_rate=0.5)]
    with pytest.raises(ValueError, match=r"spec_acceptance_rate at max_concurrency 16 \('k3' / 'off'\): the "
                                         r"baseline's median is 0; the ratio is undefined"):
        ab_summary(rows, baseline="off")
