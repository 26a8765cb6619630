"""``oea eval serve`` against stand-in OpenAI servers on 127.0.0.1 (``eval_serve_fakes``): the pairing, the
verdicts recomputed from the item rows, errors dropped and counted, OEA's metrics in the rows, bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from eval_serve_fakes import WRONG, answers
from fake_servers import serving

from oea.cli import main
from oea.eval.serve_tasks import BUNDLED_TASK, line_items, score_answer
from oea.stats import compare_items

ITEMS = "24"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict | str]:
    code = main(["eval", "serve", "--no-progress", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 and "--json" in argv else err)


@pytest.fixture()
def servers() -> Iterator[dict[str, str]]:
    """Base URLs: ``good`` (a perfect model), ``same`` (the same), ``lossy`` (every third prompt length wrong)."""
    with ExitStack() as stack:
        yield {name: stack.enter_context(serving(handler)) for name, handler in
               (("good", answers()), ("same", answers()), ("lossy", answers(wrong_every=3)))}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_bundled_task_scores_a_perfect_answer_1_and_a_wrong_one_0() -> None:
    items = line_items(50, 0)
    assert len({i.item_id for i in items}) == 50 and all(i.target.strip() for i in items)
    assert items == line_items(50, 0)  # the same items in every arm, concurrency and round
    item = items[0]
    assert score_answer(item.target + "\n", item.target) == {"exact_match": 1.0, "similarity": 1.0}
    wrong = score_answer(WRONG, item.target)
    assert wrong["exact_match"] == 0.0 and wrong["similarity"] < 1.0


def test_identical_arms_agree_exactly_and_a_lossy_arm_is_worse(servers: dict[str, str], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "quality.jsonl"
    code, report = _run(["--arm", f"off={servers['good']}", "--arm", f"same={servers['same']}", "--arm",
                         f"lossy={servers['lossy']}", "--num-items", ITEMS, "--max-concurrency", "1", "4",
                         "--rounds", "2", "--output-file", str(out), "--json"], capsys)
    assert code == 0
    summary = [r for r in report["summary"] if r["metric"] == "exact_match"]
    assert {(r["max_concurrency"], r["round"]) for r in summary} == {(c, r) for c in (1, 4) for r in (0, 1, "all")}
    for row in (r for r in summary if r["arm"] == "same"):
        assert (row["agreement"] if row["round"] != "all" else 1.0) == 1.0
        assert row["delta"] == 0.0 and row["delta_ci"] == [0.0, 0.0] and row["verdict"] == "no significant difference"
        assert row["min_detectable_delta"] > 0
    rows = _rows(out)
    items = [r for r in rows if r["kind"] == "item"]
    # each cell: arms in alternating order per round (off same lossy, lossy same off, ...)
    cells = [(r["max_concurrency"], r["round"], r["arm"]) for r in rows if r["kind"] == "cell"]
    assert cells[:6] == [(1, 0, "off"), (1, 0, "same"), (1, 0, "lossy"), (1, 1, "lossy"), (1, 1, "same"),
                         (1, 1, "off")]
    for row in (r for r in summary if r["arm"] == "lossy" and r["round"] != "all"):
        cell = [r for r in items if r["max_concurrency"] == row["max_concurrency"] and r["round"] == row["round"]]
        mine = {r["item"]: r["scores"]["exact_match"] for r in cell if r["arm"] == "lossy"}
        base = {r["item"]: r["scores"]["exact_match"] for r in cell if r["arm"] == "off"}
        recomputed = compare_items([mine[i] for i in base], list(base.values()))  # the verdict from the item rows
        assert row["verdict"] == recomputed.verdict == "worse"
        assert row["p_value"] == pytest.approx(recomputed.p_value) and row["delta"] < 0
        assert row["agreement"] < 1.0 and row["first_difference_token"] == 0.0
        assert row["n_items"] == int(ITEMS) and row["errors"] == 0 and row["dropped_items"] == 0
    baseline = next(r for r in summary if r["arm"] == "off" and r["round"] == 0)
    assert baseline["verdict"] == "baseline" and baseline["score"] == 1.0  # the stand-in answers every line right
    # the rows of the run summarise to the same figures
    code, again = _run(["--summarize", str(out), "--json"], capsys)
    assert code == 0 and again["summary"] == report["summary"]


def test_an_item_that_fails_in_one_arm_is_counted_and_dropped_from_every_arm(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.jsonl"
    with serving(answers()) as good, serving(answers(fail_every=4)) as flaky:
        code, report = _run(["--arm", f"a={good}", "--arm", f"b={flaky}", "--num-items", ITEMS,
                             "--max-concurrency", "2", "--output-file", str(out), "--json"], capsys)
    assert code == 0
    failed = {r["item"] for r in _rows(out) if r["kind"] == "item" and r["error"]}
    assert failed and all(r["arm"] == "b" for r in _rows(out) if r["kind"] == "item" and r["error"])
    for row in report["summary"]:
        assert row["dropped_items"] == len(failed)
        assert row["n_items"] == int(ITEMS) - len(failed)
        assert row["errors"] == (len(failed) if row["arm"] == "b" else 0)


def test_oea_metrics_in_the_rows_and_an_arm_that_never_rewrote_is_not_a_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stock, oea = tmp_path / "stock.metrics.jsonl", tmp_path / "oea.metrics.jsonl"
    out = tmp_path / "q.jsonl"
    with (serving(answers()) as off, serving(answers(metrics_file=str(stock))) as idle,
          serving(answers(metrics_file=str(oea), rewrites=True)) as k0):
        code, report = _run(["--arm", f"off={off}", "--arm", f"idle={idle}", "--arm", f"k0={k0}",
                             "--engine-metrics", f"idle={stock}", "--engine-metrics", f"k0={oea}",
                             "--num-items", "12", "--max-concurrency", "1", "--output-file", str(out), "--json"],
                            capsys)
    assert code == 0
    assert _run(["--summarize", str(out), "--json"], capsys)[1]["summary"] == report["summary"]  # cells re-read
    rows = {r["arm"]: r for r in report["summary"] if r["metric"] == "exact_match"}
    assert rows["off"]["decode_steps"] is None  # no metrics file for that arm
    assert rows["idle"]["decode_steps"] == 12 and rows["idle"]["rewritten_steps"] == 0
    assert rows["idle"]["oea_rewrote"] is False and rows["idle"]["verdict"].startswith("not a test of OEA")
    assert rows["idle"]["paired_verdict"] == "no significant difference"
    assert rows["k0"]["rewritten_steps"] == 12 and rows["k0"]["active_experts_ratio"] == pytest.approx(0.5)
    assert rows["k0"]["verdict"] == "no significant difference"


def test_an_interrupted_run_is_summarised(servers: dict[str, str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.jsonl"
    assert _run(["--arm", f"a={servers['good']}", "--arm", f"b={servers['lossy']}", "--num-items", "8",
                 "--max-concurrency", "1", "--output-file", str(out)], capsys)[0] == 0
    cut = tmp_path / "cut.jsonl"
    cut.write_text(out.read_text()[:-40])  # the run killed while writing its last row
    code, report = _run(["--summarize", str(cut), "--json"], capsys)
    assert code == 0 and {r["arm"] for r in report["summary"]} == {"a", "b"}


@pytest.mark.parametrize(("argv", "flag"), [
    (["--task", "no-such-task"], "--task no-such-task: an lm-eval task needs --include-path"),
    (["--task", "mytask", "--include-path", "/nonexistent/tasks"], "--include-path /nonexistent/tasks: no such"),
    (["--baseline-arm", "zz"], "--baseline-arm must be one of the arms (a, b)"),
    (["--engine-metrics", "zz=/tmp/m.jsonl"], "--engine-metrics names no arm: zz"),
])
def test_bad_input_is_one_line_naming_the_flag_before_any_request(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    handler = answers()
    with serving(handler) as url:
        code, err = _run(["--arm", f"a={url}", "--arm", f"b={url}", *argv], capsys)
    assert code == 2 and flag in err and len(err.strip().splitlines()) == 1
    assert handler.requests == []


def test_servers_that_are_not_openai_or_serve_other_models_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(answers()) as good, serving(answers(model="other")) as other:
        code, err = _run(["--arm", f"a={good}", "--arm", f"b={other}"], capsys)
        assert code == 2 and "--arm: the arms serve different models (a=m, b=other)" in err
        code, err = _run(["--arm", f"a={good}", "--arm", "b=http://127.0.0.1:9/"], capsys)
        assert code == 2 and "--arm b=http://127.0.0.1:9/: not an OpenAI-compatible server" in err


def test_restart_mode_checks_the_baseline_before_starting_a_server(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(["--serve-arm", "off=", "--serve-arm", "k3=OEA_K0=3", "--baseline-arm", "k5",
                      "--python", str(tmp_path / "no-python"), "--", "--model", "m"], capsys)
    assert code == 2 and "--baseline-arm must be one of the arms (off, k3), got 'k5'" in err


def test_the_default_task_is_the_bundled_one() -> None:
    from oea.cli import build_parser

    args = build_parser().parse_args(["eval", "serve", "--arm", "a=http://x"])
    assert args.task == BUNDLED_TASK and args.max_concurrency == [1, 4, 16]
