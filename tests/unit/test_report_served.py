"""``oea report --served-quality / --served-speed``: the served system's section (``oea.report.sections.served``)
from an ``oea eval serve`` run against stand-in servers (``eval_serve_fakes``) and ``oea bench serve``-shaped speed
rows; bad files refused before any report work, naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_serve_fakes import answers
from fake_servers import serving
from rich.console import Console

from oea.cli import main
from oea.report import build
from oea.report.context import QUICK, ReportContext
from oea.report.sections.served import load_served, section_served


def _speed_row(arm: str, rnd: int, tpot: float) -> dict:
    return {"arm": arm, "max_concurrency": 4, "round": rnd, "median_tpot_ms": tpot, "mean_tpot_ms": tpot,
            "output_throughput": 1000 / tpot, "mean_ttft_ms": 5.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A quality run (off: right answers; k3: every third item wrong) and speed rows (k3's TPOT 9 vs off's 11 in
    median over three rounds)."""
    folder = tmp_path_factory.mktemp("served")
    quality = folder / "quality.jsonl"
    with serving(answers()) as off, serving(answers(wrong_every=3)) as k3:
        assert main(["eval", "serve", "--arm", f"off={off}", "--arm", f"k3={k3}", "--num-items", "12",
                     "--max-concurrency", "4", "--output-file", str(quality), "--no-progress", "--json"]) == 0
    speed = folder / "speed.jsonl"
    speed.write_text("".join(json.dumps(_speed_row(arm, r, tpot)) + "\n" for r in range(3)
                             for arm, tpot in (("off", 10.0 + r), ("k3", 8.0 + r))))
    return quality, speed


def _context(out: Path, served: dict | None) -> ReportContext:
    return ReportContext(out=out, sizes=QUICK, seed=0, console=Console(stderr=True), quick=True, served=served)


def test_the_section_shows_the_paired_summary_and_does_it_pay(runs: tuple[Path, Path], tmp_path: Path) -> None:
    from oea.eval.serve_summary import summary_rows

    quality, speed = runs
    served = load_served(quality, speed)
    rows = [json.loads(line) for line in quality.read_text().splitlines()]
    assert served["summary"] == summary_rows(rows)  # what oea eval serve --summarize computes
    ctx = _context(tmp_path, served)
    text = section_served(ctx)
    k3 = next(r for r in served["summary"] if r["arm"] == "k3" and r["metric"] == "exact_match")
    assert k3["delta"] < 0
    line = next(line for line in text.splitlines() if "| k3 |" in line and "exact_match" in line)
    assert k3["verdict"] in line and f"{k3['delta']:+.3f}" in line
    assert "### Does it pay (exact_match)" in text
    pay = ctx.results["served"]["pay"]
    assert [(p["arm"], p["max_concurrency"]) for p in pay] == [("k3", 4)]
    assert pay[0]["tpot_ratio"] == pytest.approx(9.0 / 11.0)
    assert ctx.plots == ["served_pay.png"] and (tmp_path / "served_pay.png").stat().st_size > 0
    without_speed = _context(tmp_path / "q", load_served(quality, None))
    assert "Does it pay" not in section_served(without_speed) and without_speed.plots == []


def test_the_report_has_the_section_only_when_given_rows(runs: tuple[Path, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver leaves out a section that returns "" (the report's other sections stand in as one line)."""
    monkeypatch.setattr(build, "SECTIONS", [("overview", lambda ctx: "## Overview\n\nok"), ("served", section_served)])
    plain = build.build_report(tmp_path / "plain", quick=True)
    text = (tmp_path / "plain" / "report.md").read_text()
    assert "served system" not in text and "served" not in plain.results
    assert text.startswith("## 1. Overview\n\nok\n\n---\nSection run times")  # no empty part between them
    build.build_report(tmp_path / "with", quick=True, served=load_served(*runs))
    report = (tmp_path / "with" / "report.md").read_text()
    assert "## 2. On the served system (oea eval serve)" in report and "![served_pay](served_pay.png)" in report


def test_bad_served_files_are_refused_before_any_work(runs: tuple[Path, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    quality, _ = runs
    out = tmp_path / "report"
    cases = [
        (["--served-quality", str(tmp_path / "nope.jsonl")], "--served-quality: no such file"),
        (["--served-quality", str(tmp_path)], "--served-quality"),
        (["--served-speed", str(quality)], "--served-speed is shown beside a quality run: give --served-quality"),
        (["--served-quality", str(quality), "--served-speed", str(quality)], "--served-speed"),
    ]
    other = tmp_path / "other-speed.jsonl"
    other.write_text(json.dumps({**_speed_row("off", 0, 1.0), "max_concurrency": 8}) + "\n")
    cases.append((["--served-quality", str(quality), "--served-speed", str(other)],
                  "--served-speed: its bench serve rows share no (arm, max_concurrency)"))
    for flags, message in cases:
        assert main(["report", "--quick", "--out", str(out), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("oea report: error: ") and message in err, (flags, err)
        assert not (out / "report.md").exists()


def test_a_speed_run_of_one_round_gives_a_ratio_without_interval_and_a_plot(runs: tuple[Path, Path],
                                                                           tmp_path: Path) -> None:
    """bench serve gives a ratio resting on one round no interval; the pay rows keep it null and the plot draws
    the point without a speed error bar."""
    quality, _ = runs
    speed = tmp_path / "one-round.jsonl"
    speed.write_text("".join(json.dumps(_speed_row(arm, 0, tpot)) + "\n" for arm, tpot in (("off", 10.0), ("k3", 8.0))))
    ctx = _context(tmp_path, load_served(quality, speed))
    text = section_served(ctx)
    pay = ctx.results["served"]["pay"]
    assert pay[0]["tpot_ratio"] == pytest.approx(0.8) and pay[0]["tpot_ratio_ci"] is None
    assert (tmp_path / "served_pay.png").stat().st_size > 0 and "| k3 | 4 | 0.800 (n=1) | 1 |" in text
