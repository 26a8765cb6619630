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
