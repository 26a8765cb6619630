"""``oea simulate`` and ``oea roofline`` (parsers only; work happens in ``oea.sim``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from oea.console import wide_console
from oea.sim import presets_cli
from oea.sim.preset_file import add_model_preset_file_argument


@contextlib.contextmanager
def _progress_bar(description: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """Yields a rich progress callback ``(done, total)`` on stderr, or ``None`` when disabled."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn(description), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = progress.add_task(description, total=None)
    with progress:
        yield lambda done, total: progress.update(task, completed=done, total=total)


def parse_policy_options(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``["budget:budget=40", "adaptive:schedule=[[1,3],[16,5]]"]`` -> ``{"budget": {"budget": 40}, ...}``.

    Values are parsed as JSON when they parse, else kept as strings.
    """
    options: dict[str, dict[str, Any]] = {}
    for item in items or []:
        policy, sep, assignment = item.partition(":")
        key, eq, raw = assignment.partition("=")
        if not sep or not eq or not policy or not key:
            raise ValueError(f"--policy-option must look like POLICY:KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        options.setdefault(policy, {})[key] = value
    return options


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _simulate(args: argparse.Namespace) -> int:
    import torch

    from oea.sim.preset_file import parallel_degrees, resolve_model_preset
    from oea.sim.simulate import simulate
    from oea.traces import load_trace

    torch.set_num_threads(max(1, args.threads))
    preset = resolve_model_preset(args.model_preset, args.model_preset_file)
    tp, ep = parallel_degrees(preset, args.tp, args.ep)
    args.ep = ep
    trace = load_trace(args.trace)
    with _progress_bar(f"simulating {trace.name}", not args.json and sys.stderr.isatty()) as update:
        rows = simulate(
            trace, policies=args.policies, k0s=args.k0, batch_sizes=args.batch_sizes, mode=args.mode,
            seed=args.seed, num_batches=args.num_batches, model_preset=preset.model if preset else None,
            gpu=args.gpu, tp=tp, ep=ep, progress=update, policy_options=parse_policy_options(args.policy_option),
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    table = Table(title=f"{trace.name} ({args.mode}, {args.num_batches} batches per B, seed {args.seed})")
    columns = ["policy", "k0", "B", "T mean", "p50", "p95", "T/vanilla", "experts/token", "kept top-k",
               "kept mass"]
    if args.ep:
        columns.append(f"max T/device (ep={args.ep})")
    if rows and rows[0]["predicted_latency_us"] is not None:
        columns.append("latency µs")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        cells = [row["policy"], _fmt(row["k0"]), str(row["batch_size"]), _fmt(row["mean_active_experts"]),
                 _fmt(row["p50_active_experts"]), _fmt(row["p95_active_experts"]),
                 _fmt(row["active_ratio_vs_vanilla"], 2), _fmt(row["mean_experts_per_token"], 2),
                 _fmt(row["kept_topk_share"], 3), _fmt(row["kept_mass"], 3)]
        if args.ep:
            cells.append(_fmt(row.get("max_device_active_experts")))
        if row["predicted_latency_us"] is not None:
            cells.append(_fmt(row["predicted_latency_us"]))
        table.add_row(*cells)
    console = wide_console()
    console.print(table)
    console.print(f"note: {rows[0]['note']}" if rows else "no rows")
    return 0


def _roofline(args: argparse.Namespace) -> int:
    import torch

    from oea.sim.preset_file import parallel_degrees, resolve_model_preset
    from oea.sim.roofline import roofline

    torch.set_num_threads(max(1, args.threads))
    default = None if args.model_preset_file else "qwen3-30b-a3b"
    preset = resolve_model_preset(args.model or default, args.model_preset_file, name_flag="--model")
    assert preset is not None
    args.tp, ep = parallel_degrees(preset, args.tp, args.ep)
    args.ep = ep or 1
    trace = None if args.trace == "none" else args.trace
    with _progress_bar("simulating trace T", not args.json and sys.stderr.isatty()) as update:
        rows = roofline(
            preset.model, args.gpu, tp=args.tp, ep=args.ep, batch_sizes=args.batch_sizes, k0s=args.k0,
            trace=trace, num_batches=args.num_batches, seed=args.seed, progress=update,
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    first = rows[0]
    console = wide_console()
    console.print(
        f"[bold]{first['model']}[/] on [bold]{first['gpu']}[/] tp={args.tp} ep={args.ep}: "
        f"b = {first['expert_load_us']:.2f} µs per active expert (weight load), "
        f"a = {first['token_compute_us']:.4f} µs per token slot (compute), "
        f"ridge point {first['ridge_point_flops_per_byte']:.0f} FLOP/byte"
    )
    table = Table(title="MoE layer roofline per batch size")
    columns = ["B", "T uniform", f"T vanilla ({first['trace'] or 'no trace'})", "FLOP/byte", "bound",
               "vanilla µs"]
    for k0 in args.k0:
        columns += [f"T OEA k0={k0}", f"OEA k0={k0} µs", "gain"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        cells = [str(row["batch_size"]), _fmt(row["uniform_active_experts"]),
                 _fmt(row["trace_vanilla_active_experts"]), _fmt(row["arithmetic_intensity"]), row["bound"],
                 _fmt(row["latency_vanilla_us"])]
        for k0 in args.k0:
            gain = row[f"predicted_gain_k0_{k0}"]
            cells += [_fmt(row[f"oea_k0_{k0}_active_experts"]), _fmt(row[f"latency_oea_k0_{k0}_us"]),
                      "-" if gain is None else f"{100 * gain:.0f}%"]
        table.add_row(*cells)
    console.print(table)
    console.print(
        "Memory-bound while FLOP/byte < ridge point: latency ≈ fixed + b·T, so OEA's gain follows the drop "
        "in T. Trace T is scaled to the model by T_uniform(model)·T_trace/T_uniform(trace) when N or k "
        "differ. Datasheet peaks make absolute times optimistic; the ratios are the robust output."
    )
    return 0


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    presets_cli.register(commands)
    p = commands.add_parser("simulate", help="replay a routing trace through policies (what-if T, latency)")
    p.add_argument("--trace", default="qwen3-30b-a3b", metavar="NAME_OR_PATH",
                   help="bundled trace name or trace file (default: qwen3-30b-a3b)")
    p.add_argument("--policies", nargs="+", default=["vanilla", "pruned", "oea"], metavar="POLICY",
                   help="policy names (see oea.routing.policy_names())")
    p.add_argument("--k0", type=int, nargs="+", default=[3], metavar="K0")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64], metavar="B")
    p.add_argument("--mode", choices=["mixed", "lockstep"], default="mixed",
                   help="mixed: B random tokens of the pool; lockstep: B requests at the same position")
    p.add_argument("--num-batches", type=int, default=32, help="batches per batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-preset", default=None,
                   help="built-in model preset for latency (`oea presets`; default: the trace's)")
    add_model_preset_file_argument(p)
    p.add_argument("--gpu", default=None, help="accelerator preset for predicted latency")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree for latency (default 1)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel degree: report the busiest device's active experts")
    p.add_argument("--policy-option", nargs="+", default=None, metavar="POLICY:KEY=VALUE",
                   help="extra policy options, e.g. budget:budget=40 (VALUE parsed as JSON when possible)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(handler=_simulate)

    r = commands.add_parser("roofline", help="memory- vs compute-bound analysis and OEA's theoretical gain")
    r.add_argument("--model", default=None, help="built-in model preset (default: qwen3-30b-a3b; `oea presets`)")
    add_model_preset_file_argument(r)
    r.add_argument("--gpu", default="h100-sxm", help="accelerator preset")
    r.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default 1)")
    r.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default 1)")
    r.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024], metavar="B")
    r.add_argument("--k0", type=int, nargs="+", default=[3, 5], metavar="K0")
    r.add_argument("--trace", default="qwen3-30b-a3b",
                   help="bundled trace for real T ('none' for uniform routing only)")
    r.add_argument("--num-batches", type=int, default=16)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--json", action="store_true")
    r.set_defaults(handler=_roofline)
