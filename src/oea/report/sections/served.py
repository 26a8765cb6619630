"""Report section: quality and speed measured on the served system (``oea eval serve`` and ``oea bench serve``).

Shown only when ``oea report --served-quality FILE`` names an ``oea eval serve --output-file`` (``--served-speed``
adds an ``oea bench serve --output-file`` of the same arms and concurrencies): the paired summary of every arm
against the baseline, and the "does it pay" rows and plot (TPOT ratio beside the quality difference). The rows
are read and summarised by the same code as ``oea eval serve --summarize`` (``load_served``, called by the driver
before any other work so that a bad file fails at once, naming its flag).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oea.console import format_interval
from oea.report.context import ReportContext, md_table


def load_served(quality: Path | None, speed: Path | None) -> dict[str, Any] | None:
    """``{"quality_file", "speed_file", "summary", "pay"}`` from the two files (``pay`` None without ``speed``), or
    None without ``quality``; ``ValueError`` naming ``--served-quality`` / ``--served-speed`` for a file that is
    missing, not JSON lines, holds no such rows, or (speed) shares no (arm, concurrency) with the quality run."""
    from oea.eval.serve_main import ROW_FIELDS, read_rows
    from oea.eval.serve_summary import summary_rows

    if quality is None:
        if speed is not None:
            raise ValueError("--served-speed is shown beside a quality run: give --served-quality too")
        return None
    summary = summary_rows(read_rows(str(quality), "--served-quality", ROW_FIELDS))
    pay = None
    if speed is not None:
        from oea.eval.serve_pay import pay_rows

        speed_rows = read_rows(str(speed), "--served-speed", ("arm", "max_concurrency", "round", "median_tpot_ms"))
        pay = pay_rows(speed_rows, summary, flag="--served-speed")
    return {"quality_file": str(quality), "speed_file": None if speed is None else str(speed), "summary": summary,
            "pay": pay}


def section_served(ctx: ReportContext) -> str:
    """The served-system section, or "" (no section) when the report was not given a quality run."""
    from oea.eval.serve_main import SUMMARY_COLUMNS, summary_cells

    served = ctx.served
    if served is None:
        return ""
    ctx.results["served"] = served
    summary = served["summary"]
    lines = [
        "## On the served system (oea eval serve)",
        "",
        f"Quality rows: `{served['quality_file']}` (`oea eval serve --output-file`), summarised as `oea eval serve "
        f"--summarize` does: each arm against the baseline arm, paired over the items every arm answered. ± = 95% "
        f"interval; p: exact McNemar for pass/fail scores, paired t-test for graded ones; the smallest difference "
        f"the run detects (80% power) stands beside every verdict. An arm whose OEA metrics show no rewritten "
        f"decode step is not a test of OEA, whatever its score.",
        "",
        md_table(SUMMARY_COLUMNS, [summary_cells(r) for r in summary]),
        "",
    ]
    pay = served["pay"]
    if pay:
        from oea.eval.serve_pay import plot_pay

        lines += [
            f"### Does it pay ({pay[0]['metric']})",
            "",
            f"Speed rows: `{served['speed_file']}` (`oea bench serve --output-file`): the median TPOT ratio to the "
            f"baseline over rounds, with its paired bootstrap interval (below 1: faster), beside the quality "
            f"difference of the same arm and concurrency.",
            "",
            md_table(["arm", "C", "TPOT ratio", "speed rounds", "Δ quality", "verdict", "items"],
                     [[r["arm"], r["max_concurrency"], format_interval(r["tpot_ratio"], r["tpot_ratio_ci"], 3),
                       r["speed_rounds"], format_interval(r["delta"], r["delta_ci"], 3, signed=True), r["verdict"],
                       r["n_items"]] for r in pay]),
            "",
            ctx.plot(plot_pay(pay, ctx.out / "served_pay.png", title="speed gain vs quality change")),
        ]
    return "\n".join(lines)

