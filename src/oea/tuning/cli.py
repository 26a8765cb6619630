"""``oea calibrate`` (``calibrate_cli``), ``oea compare`` and ``oea compare-quality``."""

from __future__ import annotations

import argparse
import json

from oea.tuning import calibrate_cli


def _compare(args: argparse.Namespace) -> int:
    from oea.routing import AdaptiveK0Config
    from oea.traces import load_trace
    from oea.tuning.compare import compare_policies, pareto_front, plot_comparison

    trace = load_trace(args.trace)
    adaptive = AdaptiveK0Config(tuple(tuple(e) for e in args.adaptive)) if args.adaptive else None
    layers = None if args.layers is None else args.layers
    rows = compare_policies(trace, args.batch_size, args.k0, args.ep, args.num_batches, layers, adaptive, args.seed)
    if args.plot:
        plot_comparison(rows, args.plot, args.ep)
    if args.json:
        print(json.dumps({"trace": trace.name, "ep": args.ep, "rows": [r.as_dict() for r in rows]}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    front = {id(r) for r in pareto_front(rows, "max_device_active_experts")}
    table = Table(title=f"{trace.name}: policies at matched T, B={args.batch_size}, EP={args.ep} "
                  f"(* = Pareto-optimal in busiest-device T vs quality loss)")
    for col in ("policy", "setting", "T", f"max T/device (EP={args.ep})", "quality loss", "experts/token"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.policy + (" *" if id(r) in front else ""), r.setting, f"{r.mean_active_experts:.1f}",
                      f"{r.max_device_active_experts:.2f}", f"{r.quality_loss:.4f}", f"{r.mean_experts_per_token:.2f}")
    Console().print(table)
    return 0


def _compare_quality(args: argparse.Namespace) -> int:
    from oea.tuning.quality import adaptive_quality, matched_t_quality

    options = {"positions": args.positions, "generate_tokens": 0}
    if args.num_batches is not None:
        options["num_batches"] = args.num_batches
    result: dict = {}
    if args.study in ("matched-t", "both"):
        result["matched_t"] = matched_t_quality(args.model, args.batch_size, args.k0, **options)
    if args.study in ("adaptive", "both"):
        result["adaptive"] = adaptive_quality(args.model, args.batch_sizes, **options)
    print(json.dumps(result, indent=2, default=str))
    return 0


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    calibrate_cli.register(commands)

    c = commands.add_parser("compare", help="every policy side by side at matched T and under expert parallelism")
    c.add_argument("--trace", default="qwen3-30b-a3b", help="bundled trace name or path")
    c.add_argument("--batch-size", type=int, default=16)
    c.add_argument("--k0", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
    c.add_argument("--ep", type=int, default=8, help="expert-parallel devices (contiguous placement)")
    c.add_argument("--adaptive", type=int, nargs=2, action="append", metavar=("MAX_BATCH", "K0"),
                   help="add an adaptive-k0 schedule entry (repeatable)")
    c.add_argument("--layers", type=int, nargs="+", help="MoE layers to use (default: all)")
    c.add_argument("--num-batches", type=int, default=16)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--plot", help="write a PNG of quality loss vs T and vs busiest-device T")
    c.add_argument("--json", action="store_true")
    c.set_defaults(handler=_compare)

    q = commands.add_parser("compare-quality",
                            help="ΔCE of every policy on a real model (matched T; adaptive vs fixed k0)")
    q.add_argument("study", choices=["matched-t", "adaptive", "both"])
    q.add_argument("--model", help="local HF MoE checkpoint (default: the embedded model)")
    q.add_argument("--batch-size", type=int, default=16, help="for matched-t")
    q.add_argument("--k0", type=int, nargs="+", default=[2, 3, 4, 5], help="for matched-t")
    q.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="for adaptive")
    q.add_argument("--positions", type=int, default=32)
    q.add_argument("--num-batches", type=int)
    q.set_defaults(handler=_compare_quality)
