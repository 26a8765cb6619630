"""Handler of ``oea eval serve``: every input checked before a server is contacted or started, then the run
(``oea.eval.serve_run``), the paired summary (``oea.eval.serve_summary``), and with ``--speed-file`` the "does it
pay" rows and plot (``oea.eval.serve_pay``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROW_FIELDS = ("kind", "arm", "task", "max_concurrency", "round")  # item rows and cell rows both have them


def read_rows(path: str, flag: str, needed: tuple[str, ...]) -> list[dict[str, Any]]:
    """JSON lines of an earlier run; ``ValueError`` naming ``flag`` for a missing file, a folder, bad JSON or rows
    without ``needed``. A last line cut by an interrupted run is skipped with a warning."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{flag} {file} is a directory; give the JSONL file an earlier --output-file wrote")
    if not file.is_file():
        raise ValueError(f"{flag}: no such file: {file}")
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                print(f"oea eval serve: warning: {file}: last line cut (an interrupted run?), skipped", file=sys.stderr)
                continue
            raise ValueError(f"{flag}: {file} line {number} is not JSON ({err})") from None
    wanted = [r for r in rows if set(needed) <= set(r)]
    if not wanted:
        raise ValueError(f"{flag}: {file} has no rows with {', '.join(needed)}")
    return wanted


def _plan(args: argparse.Namespace) -> Any:
    from oea.eval.serve_run import EvalPlan, bundled_runner
    from oea.eval.serve_tasks import BUNDLED_TASK

    if args.task == BUNDLED_TASK:
        if args.include_path:
            raise ValueError(f"--include-path is for lm-eval tasks; --task {BUNDLED_TASK} is bundled")
        runner = bundled_runner(args.task, args.num_items, args.seed, args.timeout)
    else:
        from oea.eval.serve_lm_eval import lm_eval_runner

        runner = lm_eval_runner(args.task, args.include_path, args.num_items, args.timeout)
    return EvalPlan(args.task, runner, tuple(args.max_concurrency), args.rounds)


def _check_baseline(names: list[str], baseline: str | None) -> None:
    if baseline is not None and baseline not in names:
        raise ValueError(f"--baseline-arm must be one of the arms ({', '.join(names)}), got {baseline!r}")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of a new run (checks first: arms, flags, task, output file; then servers)."""
    from oea.bench.serve.ab import parse_arms, parse_engine_metrics, parse_serve_arms
    from oea.console import check_output_file
    from oea.eval.serve_run import run_restarted, run_running, served_models

    output_file = Path(args.output_file) if args.output_file else None
    if output_file is not None:
        check_output_file(output_file, "--output-file", create_folders=True)
    server_args = [a for a in args.server_args if a != "--"] if args.server_args[:1] == ["--"] else args.server_args
    if args.serve_arm:
        if args.arm or args.engine_metrics:
            raise ValueError("--serve-arm (restart mode) cannot be combined with --arm or --engine-metrics "
                             "(restart mode sets OEA_METRICS_FILE per arm)")
        serve_arms = parse_serve_arms(args.serve_arm)
        _check_baseline(list(serve_arms), args.baseline_arm)
        plan = _plan(args)
        out_dir = Path(args.engine_metrics_dir or (output_file.parent if output_file else Path("oea-eval-serve")))
        return run_restarted(serve_arms, list(args.server_args), plan, out_dir, output_file, args.python,
                             args.health_timeout, args.engine, progress=not args.no_progress,
                             server_nice=args.server_nice)
    if server_args:
        raise ValueError("server arguments after '--' are only used with --serve-arm (restart mode)")
    if args.server_nice is not None:
        raise ValueError("--server-nice sets the priority of the servers restart mode starts: use it with "
                         "--serve-arm (a running server keeps the priority it was started with)")
    arms = parse_arms(argparse.Namespace(base_url=None, base_url_a=None, base_url_b=None, arm=args.arm))
    if not arms:
        raise ValueError("--arm: give the servers to compare (--arm NAME=URL, twice or more), or --serve-arm NAME=ENV "
                         "... -- <server args>")
    _check_baseline([a.name for a in arms], args.baseline_arm)
    metrics_files = parse_engine_metrics(args.engine_metrics)
    unknown = sorted(set(metrics_files) - {a.name for a in arms})
    if unknown:
        raise ValueError(f"--engine-metrics names no arm: {', '.join(unknown)}")
    plan = _plan(args)
    from oea.bench.serve.ab import check_running_engine

    models = served_models(arms)
    check_running_engine(arms, args.engine)
    return run_running(arms, plan, models, metrics_files, output_file, progress=not args.no_progress)


def main(args: argparse.Namespace) -> int:
    """Handler of ``oea eval serve``; returns the exit code."""
    from oea.console import check_plot_file
    from oea.eval.serve_summary import summary_rows

    if args.plot:
        check_plot_file(args.plot)
        if not args.speed_file:
            raise ValueError("--plot draws speed against quality: give --speed-file too")
    speed = read_rows(args.speed_file, "--speed-file", ("arm", "max_concurrency", "round", "median_tpot_ms")) \
        if args.speed_file else None
    if args.summarize:
        if args.arm or args.serve_arm or args.output_file:
            raise ValueError("--summarize reads an earlier run: it cannot be combined with --arm, --serve-arm or "
                             "--output-file")
        rows = read_rows(args.summarize, "--summarize", ROW_FIELDS)
    else:
        rows = run(args)
    summary = summary_rows(rows, args.baseline_arm)
    pay = None
    if speed is not None:
        from oea.eval.serve_pay import pay_rows, plot_pay

        pay = pay_rows(speed, summary, args.metric, args.baseline_arm)
        if args.plot:
            plot_pay(pay, args.plot, title=Path(args.summarize).name if args.summarize else "")
    if args.json:
        document: dict[str, Any] = {"summary": summary}
        if pay is not None:
            document["pay"] = pay
        print(json.dumps(document, indent=1))
        return 0
    print_summary(summary)
    if pay is not None:
        print_pay(pay)
    return 0


SUMMARY_COLUMNS: tuple[str, ...] = (
    "task / metric", "C", "round", "arm", "n (err, dropped)", "score", "Δ vs baseline", "p", "verdict",
    "min. detectable Δ", "identical outputs", "1st diff. token", "steps rewritten / seen", "experts / stock")


def summary_cells(r: dict[str, Any]) -> list[str]:
    """One summary row as the text of ``SUMMARY_COLUMNS`` (95% intervals in brackets), for the terminal table and
    the report's."""
    from oea.console import format_interval, format_p_value

    mdd = r["min_detectable_delta"]
    return [
        f"{r['task']} / {r['metric']}", str(r["max_concurrency"]), str(r["round"]), r["arm"],
        f"{r['n_items']} ({r['errors']}, {r['dropped_items']})", format_interval(r["score"], r["score_ci"], 3),
        "-" if r["delta"] is None else format_interval(r["delta"], r["delta_ci"], 3, signed=True),
        format_p_value(r["p_value"]), r["verdict"], "-" if mdd is None else f"{mdd:.3f}",
        "-" if r["agreement"] is None else format_interval(100 * r["agreement"], [100 * v for v in r["agreement_ci"]],
                                                           0),
        "-" if r["first_difference_token"] is None else f"{r['first_difference_token']:.1f}",
        "-" if r["decode_steps"] is None else f"{r['rewritten_steps']} / {r['decode_steps']}",
        "-" if r["active_experts_ratio"] is None else f"{r['active_experts_ratio']:.3f}"]


def print_summary(summary: list[dict[str, Any]]) -> None:
    """The summary rows as a table (95% intervals in brackets)."""
    from rich.table import Table

    from oea.console import wide_console

    table = Table(title="oea eval serve: each arm vs the baseline, paired per item")
    for name in SUMMARY_COLUMNS:
        table.add_column(name, justify="left" if name in ("task / metric", "arm", "verdict") else "right")
    for r in summary:
        table.add_row(*summary_cells(r))
    console = wide_console()
    console.print(table)
    console.print("[...] = 95% interval. Δ: arm - baseline, paired over the items every arm answered (n). p: exact "
                  "McNemar for pass/fail scores, paired t-test for graded ones. min. detectable Δ: the smallest "
                  "difference this run detects with 80% power, beside every 'no significant difference'. An arm "
                  "whose OEA metrics show no rewritten decode step is not a test of OEA.")


def print_pay(pay: list[dict[str, Any]]) -> None:
    """The "does it pay" rows: TPOT ratio beside the quality difference."""
    from oea.console import format_interval, wide_console

    console = wide_console()
    console.print(f"does it pay ({pay[0]['metric']}): TPOT ratio (< 1: faster) beside Δ quality, 95% intervals")
    for r in pay:
        ratio = format_interval(r["tpot_ratio"], r["tpot_ratio_ci"], 3)
        console.print(f"  {r['arm']} c={r['max_concurrency']}: TPOT x{ratio}"
                      f"  Δ {format_interval(r['delta'], r['delta_ci'], 3, signed=True)} ({r['verdict']}, "
                      f"{r['n_items']} items)", soft_wrap=True)
