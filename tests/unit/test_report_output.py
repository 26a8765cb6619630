"""``oea report``: headings numbered in order by the driver, and an --out that is a file is refused before any work."""

from __future__ import annotations

import pathlib

import pytest

from oea.cli import main
from oea.report.build import check_output_folder, number_headings


def test_headings_are_numbered_in_order_without_gaps() -> None:
    text = "# Title\n\nintro\n\n## A\n\n### a1\n\n### a2\n\n```\n## not a heading\n```\n\n## B\n\n### b1"
    assert number_headings(text).splitlines() == [
        "# Title", "", "intro", "", "## 1. A", "", "### 1.1 a1", "", "### 1.2 a2", "", "```", "## not a heading",
        "```", "", "## 2. B", "", "### 2.1 b1"]


def test_an_existing_file_as_out_is_refused_and_nothing_is_written(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "report.txt"
    target.write_text("keep me")
    assert main(["report", "--quick", "--out", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "not a folder" in err[0] and "Traceback" not in err[0]
    assert target.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["report.txt"]
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output_folder(target / "inside")
    check_output_folder(tmp_path / "new")  # a folder that does not exist yet is fine


def test_the_docs_name_report_sections_that_exist() -> None:
    """A doc that points into the report names a section by its title (numbers move as sections are added)."""
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    sources = "\n".join(p.read_text() for p in (root / "src" / "oea" / "report" / "sections").glob("*.py"))
    titles = set(re.findall(r'"## ([^"{]+)"', sources))
    cited = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = " ".join(doc.read_text().split())
        assert not re.search(r"`oea report`[^.]*\(section \d+\)", text), f"{doc.name} cites a report section by number"
        cited += [(doc.name, name) for name in re.findall(r'`oea report`[^.]*in its section "([^"]+)"', text)]
    assert ("beyond.md", "Beyond the paper: every policy at matched T, expert parallelism, adaptive k0") in cited
    assert all(name in titles for _, name in cited), (cited, titles)


def _step_rows(model: str, gpu: str, tp: int, ep: int, batch_sizes: tuple[int, ...] = (1, 4, 16)) -> list[dict]:
    """Roofline rows (``oea.sim.roofline.roofline_from_table``) from a hand-made T table of a 128-expert top-8 trace:
    OEA k0=3 at 45-55% of vanilla T, intervals included."""
    from oea.sim.roofline import TraceRef, roofline_from_table

    table = {}
    for b in batch_sizes:
        vanilla = 8.0 if b == 1 else 128 * (1 - (1 - 8 / 128) ** b) * 0.8
        oea = 8.0 if b == 1 else max(8.0, vanilla / 2)
        table[("vanilla", None, b)] = {"T": vanilla, "T_ci": [vanilla - 1, vanilla + 1], "ratio_ci": None,
                                       "T_device": None, "experts_per_token": 8.0}
        table[("oea", 3, b)] = {"T": oea, "T_ci": [oea - 0.5, oea + 0.5],
                                "ratio_ci": [oea / vanilla * 0.95, oea / vanilla * 1.05], "T_device": None,
                                "experts_per_token": 8.0}
    return roofline_from_table(model, gpu, tp, ep, list(batch_sizes), [3], table, TraceRef("trace", 128, 8))


def _table_cells(markdown: str) -> list[dict[str, str]]:
    rows = [line.strip("|").split(" | ") for line in markdown.splitlines() if line.startswith("| ")]
    header = [h.strip() for h in rows[0]]
    return [dict(zip(header, (c.strip() for c in row), strict=True)) for row in rows[1:]]


def test_the_latency_section_shows_the_whole_step_beside_the_layer_with_its_assumptions() -> None:
    from oea.console import format_interval
    from oea.report.sections.latency import STEP_DEPLOYMENT, step_lines

    assert STEP_DEPLOYMENT == ("qwen3-30b-a3b", "h100-sxm", 1, 1)  # the report's default model and accelerator
    rows = _step_rows(*STEP_DEPLOYMENT)
    text = "\n".join(step_lines(rows, [3]))
    assert text.startswith("### The whole decode step (qwen3-30b-a3b on h100-sxm)")
    for assumption in ("2048 cached tokens per request", "no all-reduce (TP1)", "datasheet peaks", "no overlap",
                       "upper bounds"):
        assert assumption in text
    cells = _table_cells(text)
    assert [int(c["B"]) for c in cells] == [1, 4, 16]
    for row, cell in zip(rows, cells, strict=True):
        assert cell["step µs (vanilla)"] == format_interval(row["step_latency_vanilla_us"],
                                                            row["step_latency_vanilla_us_ci"], 0)
        assert cell["routed experts µs"] == f"{row['step_routed_experts_vanilla_us']:.0f}"
        assert cell["MoE share"] == f"{100 * row['moe_share_of_step']:.0f}%"
        assert cell["step µs OEA k0=3"] == format_interval(row["step_latency_oea_k0_3_us"],
                                                           row["step_latency_oea_k0_3_us_ci"], 0)
        layer, step = (float(cell[name].split(" ")[0]) for name in ("layer gain k0=3", "step gain k0=3"))
        assert layer == round(100 * row["predicted_gain_k0_3"]) and step == round(100 * row["predicted_step_gain_k0_3"])
        parts = sum(float(cell[name]) for name in ("attention µs", "KV cache µs", "dense+shared MLP µs",
                                                   "all-reduce µs", "lm_head µs", "routed experts µs"))
        assert abs(parts - row["step_latency_vanilla_us"]) <= 6  # the parts add up to the step (each rounded)
    assert 0 < rows[-1]["predicted_step_gain_k0_3"] < rows[-1]["predicted_gain_k0_3"]  # the rest of the step dilutes


def test_the_step_table_names_its_link_under_tp_and_says_why_there_is_none_under_ep() -> None:
    from oea.report.sections.latency import step_lines

    text = "\n".join(step_lines(_step_rows("qwen3-235b-a22b", "h100-sxm", 8, 1, (16,)), [3]))
    assert "(qwen3-235b-a22b on h100-sxm TP8)" in text and "450 GB/s, 5 µs per all-reduce" in text
    assert float(_table_cells(text)[0]["all-reduce µs"]) > 0
    text = "\n".join(step_lines(_step_rows("deepseek-v3", "h200", 1, 8, (16,)), [3]))
    assert "tensor parallelism only" in text and "| B |" not in text
