"""``oea calibrate``: batch-size-adaptive and per-layer k0 from a routing trace."""

from __future__ import annotations

import argparse
import json


def _calibrate(args: argparse.Namespace) -> int:
    from oea.traces import load_trace
    from oea.tuning.calibrate import adaptive_schedule, layer_schedule, measure_proxy, proxy_name

    trace = load_trace(args.trace)
    top_k = trace.spec.top_k
    k0s = args.k0 or list(range(1, top_k + 1))
    bad = [k for k in k0s if not 1 <= k <= top_k]
    if bad:
        raise ValueError(f"--k0 values must be in 1..{top_k} (the trace's top_k), got {bad}")
    if args.what == "adaptive":
        points = measure_proxy(trace, args.batch_sizes, k0s, num_batches=args.num_batches, seed=args.seed)
        cfg = adaptive_schedule(points, args.tolerance, top_k)
        result = {"trace": trace.name, "proxy": proxy_name(trace), "tolerance": args.tolerance,
                  "schedule": [list(entry) for entry in cfg.schedule]}
    else:
        points = measure_proxy(trace, [args.batch_size], k0s, num_batches=args.num_batches, seed=args.seed)
        schedule = layer_schedule(trace, points, args.tolerance, args.batch_size)
        result = {"trace": trace.name, "proxy": proxy_name(trace), "tolerance": args.tolerance,
                  "k0": list(schedule.k0)}
        if args.out:
            schedule.save(args.out)
            result["written"] = args.out
    if args.out and args.what == "adaptive":
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        result["written"] = args.out
    print(json.dumps(result, indent=2) if args.json else _summary(result))
    return 0


def _summary(result: dict) -> str:
    lines = [f"trace {result['trace']} · proxy {result['proxy']} · tolerance {result['tolerance']}"]
    if "schedule" in result:
        lines += [f"  batch size <= {b:>4}: k0 = {k0}" for b, k0 in result["schedule"]]
    else:
        lines += [f"  per-layer k0: {result['k0']}"]
    if "written" in result:
        lines.append(f"written to {result['written']}")
    return "\n".join(lines)


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
    p = commands.add_parser("calibrate", help="calibrate batch-size-adaptive or per-layer k0 from a trace")
    p.add_argument("what", choices=["adaptive", "layers"], help="adaptive: k0(B); layers: one k0 per layer")
    p.add_argument("--trace", default="embedded", help="bundled trace name or path (default: embedded)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="for 'adaptive'")
    p.add_argument("--batch-size", type=int, default=16, help="for 'layers'")
    p.add_argument("--k0", type=int, nargs="+", help="candidate k0 values (default 1..top_k)")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest mean proxy loss (1 - kept mass)")
    p.add_argument("--num-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the schedule (JSON; for 'layers' the OEA_LAYER_K0_FILE format)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_calibrate)

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
