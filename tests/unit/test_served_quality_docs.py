"""The served-quality figures in ``docs/eval.md`` are what ``oea eval serve --summarize`` recomputes from the rows
kept in ``docs/benchmarks-quality/``: each table line of the docs is rebuilt here from the rows (``table_lines``)
and must appear there word for word, and every measured file has its table in the docs."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROWS = sorted((ROOT / "docs" / "benchmarks-quality").glob("*.jsonl"))
DOC = ROOT / "docs" / "eval.md"


def _ci(values: list[float] | None, digits: int, scale: float = 1.0) -> str:
    return "–" if values is None else f"[{values[0] * scale:.{digits}f}, {values[1] * scale:.{digits}f}]"


def table_lines(path: pathlib.Path) -> list[str]:
    """The docs table of one measured file: per concurrency, arm and metric, score, paired difference, p, verdict,
    smallest detectable difference, identical outputs, first differing token, steps rewritten / seen, experts vs
    stock routing."""
    from oea.eval.serve_main import ROW_FIELDS, read_rows
    from oea.eval.serve_summary import summary_rows

    lines = []
    for r in summary_rows(read_rows(str(path), "--summarize", ROW_FIELDS)):
        delta = "–" if r["delta"] is None else f"{r['delta']:+.4f} {_ci(r['delta_ci'], 4)}"
        mdd = "–" if r["min_detectable_delta"] is None else f"{r['min_detectable_delta']:.4f}"
        p = "–" if r["p_value"] is None else f"{r['p_value']:.2f}"
        first = "–" if r["first_difference_token"] is None else f"{r['first_difference_token']:.1f}"
        ratio = "–" if r["active_experts_ratio"] is None else f"{r['active_experts_ratio']:.3f}"
        lines.append(
            f"| {r['max_concurrency']} | {r['arm']} | {r['metric']} | {r['n_items']} | {r['score']:.4f} "
            f"{_ci(r['score_ci'], 4)} | {delta} | {p} | {r['verdict']} | {mdd} | {r['agreement']:.3f} "
            f"{_ci(r['agreement_ci'], 3)} | {first} | {r['rewritten_steps']} / {r['decode_steps']} | {ratio} |")
    return lines


def test_there_are_measured_rows() -> None:
    assert ROWS, "docs/benchmarks-quality/ holds no measured oea eval serve rows"


@pytest.mark.parametrize("path", ROWS, ids=[p.name for p in ROWS])
def test_each_documented_line_is_what_summarize_recomputes(path: pathlib.Path) -> None:
    doc = DOC.read_text()
    assert f"benchmarks-quality/{path.name}" in doc, f"docs/eval.md does not cite {path.name}"
    missing = [line for line in table_lines(path) if line not in doc]
    assert not missing, "docs/eval.md lacks (or has other figures for):\n" + "\n".join(missing[:5])


def _cells(path: pathlib.Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "cell"]


@pytest.mark.parametrize("path", ROWS, ids=[p.name for p in ROWS])
def test_the_measured_runs_have_at_least_500_items_per_cell_and_no_error(path: pathlib.Path) -> None:
    cells = _cells(path)
    assert {c["arm"] for c in cells} >= {"off", "k5", "k3"} and {c["max_concurrency"] for c in cells} >= {1, 4, 16}
    from oea.eval.serve_main import ROW_FIELDS, read_rows
    from oea.eval.serve_summary import summary_rows

    assert all(r["n_items"] >= 500 and r["errors"] == 0
               for r in summary_rows(read_rows(str(path), "--summarize", ROW_FIELDS)))
