"""``oea compare`` (policies at matched T on a trace, quality proxy) and ``oea compare-quality`` (ΔCE on a model).

Parsers and output only; the work happens in ``oea.tuning.compare`` and ``oea.tuning.quality``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from oea.console import (
    add_batch_sizes_argument,
    check_plot_file,
    check_unique,
    format_interval,
    int_at_least,
    seed_value,
    wide_console,
)


def _compare(args: argparse.Namespace) -> int:
    from oea.routing import AdaptiveK0Config
    from oea.traces import load_trace
    from oea.tuning.compare import (
        DISAGREEMENT,
        PROXIES,
        check_compare_arguments,
        compare_policies,
        plot_comparison,
        proxy_of,
    )

    check_unique(args.batch_sizes, "--batch-sizes")
    if args.plot:
        check_plot_file(args.plot, "--plot")
    trace = load_trace(args.trace)
    check_compare_arguments(trace, args.k0, args.num_batches, args.layers)  # before the first batch size runs
    adaptive = AdaptiveK0Config(tuple(tuple(e) for e in args.adaptive)) if args.adaptive else None
    rows = []
    for batch_size in args.batch_sizes:
        rows += compare_policies(trace, batch_size, args.k0, args.ep, args.num_batches, args.layers, adaptive,
                                 args.seed)
    plots = []
    if args.plot:
        for batch_size in args.batch_sizes:
            path = pathlib.Path(args.plot)
            if len(args.batch_sizes) > 1:
                path = path.with_name(f"{path.stem}_B{batch_size}{path.suffix}")
            plot_comparison([r for r in rows if r.batch_size == batch_size], str(path), args.ep)
            plots.append(str(path))
    proxy = proxy_of(trace)
    if args.json:
        print(json.dumps({"trace": trace.name, "ep": args.ep, "proxy": proxy, "proxy_definition": PROXIES[proxy][1],
                          "proxy_note": DISAGREEMENT, "plots": plots, "rows": [r.as_dict() for r in rows]}, indent=2))
        return 0
    console = wide_console()
    console.print(comparison_table(trace.name, rows, args.ep, args.num_batches))
    console.print(f"{proxy} = {PROXIES[proxy][1]}; lower is better. Note: {DISAGREEMENT}.")
    for path in plots:
        console.print(f"wrote {path}")
    return 0


def comparison_table(name: str, rows: list[Any], ep: int, num_batches: int) -> Any:
    """The rich table of ``compare_policies`` rows (every mean ± its 95% interval over batches)."""
    from rich.table import Table

    from oea.tuning.compare import pareto_front

    front = {id(r) for b in {r.batch_size for r in rows}
             for r in pareto_front([r for r in rows if r.batch_size == b], "max_device_active_experts")}
    proxy = rows[0].proxy if rows else "lost_router_mass"
    table = Table(title=f"{name}: policies at matched T, EP={ep}, {num_batches} batches per B (± = 95% interval; "
                        f"* = Pareto-optimal in busiest-device T vs {proxy})")
    for col in ("B", "policy", "setting", "T", f"max T/device (EP={ep})", f"{proxy} (proxy)", "experts/token"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.batch_size), r.policy + (" *" if id(r) in front else ""), r.setting,
                      format_interval(r.mean_active_experts, r.ci("mean_active_experts")),
                      format_interval(r.max_device_active_experts, r.ci("max_device_active_experts"), 2),
                      format_interval(r.proxy_loss, r.ci("proxy_loss"), 4),
                      format_interval(r.mean_experts_per_token, r.ci("mean_experts_per_token"), 2))
    return table


def _compare_quality(args: argparse.Namespace) -> int:
    import torch

    from oea.tuning.quality import adaptive_quality, matched_t_quality

    check_unique(args.k0, "--k0")
    check_unique(args.batch_sizes, "--batch-sizes")
    check_unique(args.floors, "--floors")
    torch.set_num_threads(args.threads)
    options: dict[str, Any] = {"positions": args.positions, "generate_tokens": 0}
    if args.num_batches is not None:
        options["num_batches"] = args.num_batches
    result: dict[str, Any] = {}
    with _status(not args.json) as progress:
        if progress is not None:
            options["progress"] = progress
        if args.study in ("matched-t", "both"):
            result["matched_t"] = [row for b in (args.batch_sizes or [16])
                                   for row in matched_t_quality(args.model, b, args.k0, args.floors, **options)]
        if args.study in ("adaptive", "both"):
            result["adaptive"] = adaptive_quality(args.model, args.batch_sizes or [1, 4, 16, 64], **options)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    console = wide_console()
    if "matched_t" in result:
        console.print(matched_t_table(result["matched_t"]))
    if "adaptive" in result:
        console.print(adaptive_table(result["adaptive"]))
    console.print("± = 95% interval; ΔCE paired per document against vanilla; verdict: paired t-test (oea eval).")
    return 0


class _status:
    """A rich status line on stderr that ``oea.eval.evaluate`` updates per run (``progress(text)``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        from rich.console import Console

        self.status = Console(stderr=True).status("evaluating")
        self.status.__enter__()
        return lambda text: self.status.update(f"evaluating {text}")

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.status.__exit__(*exc)


def matched_t_table(rows: list[dict[str, Any]]) -> Any:
    """ΔCE of every policy at matched T (``matched_t_quality`` rows)."""
    from rich.table import Table

    table = Table(title="ΔCE at matched T (budget / subtractive get OEA's measured T as their target; a budget "
                        "with XShare's per-token floor gets the budget whose T is nearest OEA's)")
    for col in ("B", "policy", "k0 / target T", "T", "ΔCE vs vanilla", "verdict (paired)"):
        table.add_column(col, justify="left" if col in ("policy", "verdict (paired)") else "right")
    for r in rows:
        setting = "-" if r["k0"] is None and r.get("target_T") is None else (
            f"T={r['target_T']}" if r.get("target_T") is not None else str(r["k0"]))
        if r.get("floor"):
            setting += f" (budget {r['budget']})"
        table.add_row(str(r["batch_size"]), r["policy"], setting,
                      format_interval(r["mean_active_experts"], r["mean_active_experts_ci"]),
                      format_interval(r["delta_ce"], r["delta_ce_ci"], 4, signed=True), r["verdict"])
    return table


def adaptive_table(result: dict[str, Any]) -> Any:
    """Calibrated k0(B) schedules against fixed k0, each a point averaged over the batch sizes."""
    from rich.table import Table

    table = Table(title=f"adaptive vs fixed k0: mean over B ∈ {result['batch_sizes']}")
    for col in ("k0 / schedule (B ≤ max: k0)", "mean ΔCE", "mean T", "dominates fixed k0", "dominated by"):
        table.add_column(col, justify="right")
    for tolerance, point in result["adaptive"].items():
        schedule = " ".join(f"≤{b}:{k0}" for b, k0 in point["schedule"])
        table.add_row(f"tolerance {tolerance}: {schedule}", format_interval(point["delta_ce"], point["delta_ce_ci"], 4),
                      format_interval(point["mean_active_experts"], point["mean_active_experts_ci"]),
                      ", ".join(map(str, point["dominates_fixed_k0"])) or "-",
                      ", ".join(map(str, point["dominated_by_fixed_k0"])) or "none")
    for k0, point in result["fixed"].items():
        table.add_row(f"fixed k0={k0}", format_interval(point["delta_ce"], point["delta_ce_ci"], 4),
                      format_interval(point["mean_active_experts"], point["mean_active_experts_ci"]), "", "")
    return table


def register(commands: argparse._SubParsersAction) -> None:
    c = commands.add_parser(
        "compare", help="every policy side by side at matched T and under expert parallelism (quality proxy)",
        description="Policies at matched mean T on a routing trace: vanilla, pruned, OEA, EP-aware OEA, budget and "
        "subtractive at OEA's T, adaptive. Quality is a proxy (lost_router_mass or lost_topk_share), not ΔCE: "
        "use `oea compare-quality` for ΔCE on a model.")
    c.add_argument("--trace", default="qwen3-30b-a3b", help="bundled trace name or trace file")
    add_batch_sizes_argument(c, [16], "decode batch sizes B (mixed batches)", legacy_alias=True)
    c.add_argument("--k0", type=int_at_least(1), nargs="+", default=[1, 2, 3, 4, 5, 6, 7], metavar="K0",
                   help="k0 values for pruned, OEA and EP-aware OEA, each in 1..top_k")
    c.add_argument("--ep", type=int_at_least(1), default=8,
                   help="expert-parallel devices: contiguous placement for EP-aware OEA and the busiest-device T "
                        "(must divide the trace's expert count)")
    c.add_argument("--adaptive", type=int_at_least(1), nargs=2, action="append", metavar=("MAX_BATCH", "K0"),
                   help="add an adaptive-k0 schedule entry (repeatable; default: no adaptive row)")
    c.add_argument("--layers", type=int_at_least(0), nargs="+", metavar="LAYER",
                   help="MoE layer indices to use, in 0..L-1 (default: all)")
    c.add_argument("--num-batches", type=int_at_least(2), default=16, help="batches per batch size")
    c.add_argument("--seed", type=seed_value, default=0, help="seeds batch formation")
    c.add_argument("--plot", metavar="PATH", help="write a PNG of the proxy vs T and vs busiest-device T "
                                                  "(one per batch size, suffixed _B<B>, when several)")
    c.add_argument("--json", action="store_true", help="print the rows as JSON")
    c.set_defaults(handler=_compare)

    q = commands.add_parser(
        "compare-quality", help="ΔCE of every policy on a real model (matched T; adaptive vs fixed k0)",
        description="Teacher-forced lock-step decode of held-out text (as `oea eval`): matched-t evaluates vanilla, "
        "pruned and OEA at each k0, then budget (with each --floors per-token floor) and subtractive at OEA's "
        "measured T; adaptive compares "
        "calibrated k0(B) schedules with fixed k0 over batch sizes.")
    q.add_argument("study", choices=["matched-t", "adaptive", "both"], help="which study to run")
    q.add_argument("--model", metavar="PATH", help="local HF MoE checkpoint with its tokenizer (default: the "
                                                   "embedded model)")
    add_batch_sizes_argument(q, None, "decode batch sizes (default: 16 for matched-t, 1 4 16 64 for adaptive)",
                             legacy_alias=True)
    q.add_argument("--k0", type=int_at_least(1), nargs="+", default=[2, 3, 4, 5], metavar="K0",
                   help="k0 values for matched-t, each in 1..top_k")
    q.add_argument("--floors", type=int_at_least(0), nargs="+", default=[0, 1, 2], metavar="F",
                   help="matched-t: the budget comparator's per-token floors (XShare's top_per_token; 0 = the budget "
                        "alone), each evaluated at the k0 values above it (default: 0 1 2)")
    q.add_argument("--positions", type=int_at_least(1), default=32, help="decode steps (scored tokens) per window")
    q.add_argument("--num-batches", type=int_at_least(1), help="batches per B (default: ceil(16 / B))")
    q.add_argument("--threads", type=int_at_least(1), default=1, help="torch.set_num_threads")
    q.add_argument("--json", action="store_true", help="print the rows and points as JSON")
    q.set_defaults(handler=_compare_quality)
