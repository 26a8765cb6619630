"""``oea eval serve`` against servers an engine module already runs (no server of its own: ``make test``'s time
budget): ``run_eval_serve`` sends the bundled task through the real command line with ``--arm NAME=URL`` (and the
arms' ``--engine-metrics``) and hands back the rows it wrote and its summary; ``recompute`` rebuilds an arm's
verdict from the per-item rows with ``oea.stats`` alone, so a test does not trust the tool's own word."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

ITEMS = 16  # held-out lines per cell
CONCURRENCIES = (1, 16)  # 1: below OEA_MIN_BATCH (2), OEA leaves every step alone; 16: co-batched decode


def run_eval_serve(arms: dict[str, str], metrics: dict[str, Path], out_dir: Path, engine: str) -> dict[str, Any]:
    """Run ``oea eval serve`` (arm order as given, the first the baseline) and return ``rows`` (the
    ``--output-file``), ``summary`` (its ``--json``) and ``code`` (exit status; None when it raised, the error
    then in ``stdout``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / f"eval-serve-{engine}.jsonl"
    argv = ["eval", "serve", "--engine", engine, "--num-items", str(ITEMS), "--max-concurrency",
            *map(str, CONCURRENCIES), "--timeout", "300", "--output-file", str(output), "--no-progress", "--json"]
    for name, url in arms.items():
        argv += ["--arm", f"{name}={url}"]
    for name, path in metrics.items():
        argv += ["--engine-metrics", f"{name}={path}"]
    return _run(argv, output)


def _run(argv: list[str], output: Path) -> dict[str, Any]:
    """Run the command line ``argv`` in this process; ``code``, the ``rows`` it wrote to ``output``, ``summary``
    (its ``--json``) and ``stdout``."""
    from oea.cli import main

    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = main(argv)
    except Exception as err:  # kept for the eval_serve tests to report; the fixture's other tests still run
        return {"code": None, "rows": [], "summary": [], "stdout": f"{stdout.getvalue()}\n{err!r}"}
    rows = [json.loads(line) for line in output.read_text().splitlines()] if output.exists() else []
    return {"code": code, "rows": rows, "summary": json.loads(stdout.getvalue())["summary"] if code == 0 else [],
            "stdout": stdout.getvalue()}


LM_EVAL_ITEMS = 8  # documents of the local lm-eval task (tests/support/lm_eval_task.py)


def run_lm_eval_task(arms: dict[str, str], out_dir: Path, engine: str) -> dict[str, Any]:
    """``oea eval serve --task oea_lines --include-path DIR`` (a local YAML task through lm-eval's
    ``local-completions``) against running servers, at concurrency 4; the same fields as ``run_eval_serve``."""
    from lm_eval_task import TASK, write_task

    include = write_task(out_dir / "lm_eval_tasks", LM_EVAL_ITEMS)
    output = out_dir / f"eval-serve-lm-eval-{engine}.jsonl"
    argv = ["eval", "serve", "--task", TASK, "--include-path", str(include), "--num-items", str(LM_EVAL_ITEMS),
            "--max-concurrency", "4", "--timeout", "300", "--output-file", str(output), "--no-progress", "--json"]
    for name, url in arms.items():
        argv += ["--arm", f"{name}={url}"]
    return _run(argv, output)


def check_lm_eval_task(result: dict[str, Any], arm: str, baseline: str) -> None:
    """Every document answered by both arms through lm-eval, ``arm`` (k0 = top_k) word for word the baseline's,
    and each arm's exact-match score the mean of its per-item scores."""
    assert result["code"] == 0, result["stdout"]
    for name in (baseline, arm):
        mine = items(result["rows"], name, 4)
        assert len(mine) == LM_EVAL_ITEMS and not any(r["error"] for r in mine.values()), mine
        row = summary_row(result["summary"], name, 4, "exact_match")
        assert row["n_items"] == LM_EVAL_ITEMS and row["errors"] == 0, row
        assert row["score"] == pytest.approx(sum(r["scores"]["exact_match"] for r in mine.values()) / LM_EVAL_ITEMS)
    base, mine = items(result["rows"], baseline, 4), items(result["rows"], arm, 4)
    assert {i: r["output"] for i, r in mine.items()} == {i: r["output"] for i, r in base.items()}
    assert any(r["output"] for r in base.values()), "the server answered nothing"


def items(rows: list[dict[str, Any]], arm: str, concurrency: int) -> dict[str, dict[str, Any]]:
    """{item id: item row} of one arm at one concurrency (round 0)."""
    return {r["item"]: r for r in rows
            if r["kind"] == "item" and r["arm"] == arm and r["max_concurrency"] == concurrency and r["round"] == 0}


def summary_row(summary: list[dict[str, Any]], arm: str, concurrency: int, metric: str) -> dict[str, Any]:
    return next(r for r in summary if r["arm"] == arm and r["max_concurrency"] == concurrency and r["round"] == 0
                and r["metric"] == metric)


def recompute(rows: list[dict[str, Any]], arm: str, baseline: str, concurrency: int, metric: str) -> Any:
    """``oea.stats.compare_items`` of ``arm`` against ``baseline`` on the items both answered without error."""
    from oea.stats import compare_items

    mine, base = items(rows, arm, concurrency), items(rows, baseline, concurrency)
    kept = [i for i in base if i in mine and not mine[i]["error"] and not base[i]["error"]]
    return compare_items([mine[i]["scores"][metric] for i in kept], [base[i]["scores"][metric] for i in kept])


METRICS = ("exact_match", "similarity")


def check_identical(result: dict[str, Any], arm: str, baseline: str, concurrencies: tuple[int, ...]) -> None:
    """``arm`` wrote byte-identical outputs to ``baseline``'s at ``concurrencies``: agreement exactly 1, every
    difference exactly 0 (with its power stated)."""
    for concurrency in concurrencies:
        base, mine = items(result["rows"], baseline, concurrency), items(result["rows"], arm, concurrency)
        assert len(base) == ITEMS and not any(r["error"] for r in (*base.values(), *mine.values()))
        assert [mine[i]["output"] for i in base] == [base[i]["output"] for i in base]
        for metric in METRICS:
            row = summary_row(result["summary"], arm, concurrency, metric)
            assert row["agreement"] == 1.0 and row["delta"] == 0.0 and row["delta_ci"] == [0.0, 0.0], row
            assert row["min_detectable_delta"] > 0


def check_scores_well_above_zero(result: dict[str, Any], baseline: str) -> None:
    """The embedded model finishes held-out lines: its similarity's interval lies well above 0."""
    row = summary_row(result["summary"], baseline, 1, "similarity")
    assert row["score_ci"][0] > 0.1, row


def check_untouched_below_min_batch(result: dict[str, Any], arm: str) -> None:
    """At concurrency 1 (below OEA_MIN_BATCH) the OEA arm's server rewrote no step: the outputs are the
    baseline's and the verdict says the arm was no test of OEA (never "no loss")."""
    row = summary_row(result["summary"], arm, 1, "exact_match")
    assert row["agreement"] == 1.0 and row["delta"] == 0.0, row
    assert row["decode_steps"] > 0 and row["rewritten_steps"] == 0, row
    assert row["verdict"].startswith("not a test of OEA"), row


def check_low_k0(result: dict[str, Any], arm: str, baseline: str) -> None:
    """At concurrency 16 a low k0 rewrote steps, loaded fewer experts than the stock routing, changed some outputs;
    the verdict of each metric is the one recomputed here from the per-item rows."""
    concurrency = max(CONCURRENCIES)
    row = summary_row(result["summary"], arm, concurrency, "similarity")
    assert row["rewritten_steps"] > 0 and row["active_experts_ratio"] < 1.0, row
    assert row["agreement"] < 1.0 and row["first_difference_token"] is not None, row
    for metric in METRICS:
        row = summary_row(result["summary"], arm, concurrency, metric)
        mine = recompute(result["rows"], arm, baseline, concurrency, metric)
        assert row["verdict"] == mine.verdict and row["n_items"] == mine.n, row
        assert row["p_value"] == pytest.approx(mine.p_value) and row["delta"] == pytest.approx(mine.delta.estimate)
