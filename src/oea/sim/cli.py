"""``oea simulate`` and ``oea roofline`` (parsers only; work happens in ``oea.sim``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from oea.console import (
    add_batch_sizes_argument,
    check_unique,
    float_between,
    format_interval,
    int_at_least,
    wide_console,
)
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

    Values are parsed as JSON when they parse, else kept as strings. An unknown policy or key is a
    ``ValueError`` naming it and the allowed ones.
    """
    from oea.routing import policy_names, policy_options

    options: dict[str, dict[str, Any]] = {}
    for item in items or []:
        policy, sep, assignment = item.partition(":")
        key, eq, raw = assignment.partition("=")
        if not sep or not eq or not policy or not key:
            raise ValueError(f"--policy-option must look like POLICY:KEY=VALUE, got {item!r}")
        if policy not in policy_names():
            raise ValueError(f"--policy-option {item!r}: unknown policy {policy!r}; policies: {policy_names()}")
        allowed = policy_options(policy)
        if allowed is not None and key not in allowed:
            raise ValueError(f"--policy-option {item!r}: policy {policy!r} has no option {key!r}; its options: "
                             f"{', '.join(allowed) or 'none'}")
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

    for values, flag in ((args.policies, "--policies"), (args.k0, "--k0"), (args.batch_sizes, "--batch-sizes")):
        check_unique(values, flag)
    policy_options = parse_policy_options(args.policy_option)
    torch.set_num_threads(args.threads)
    preset = resolve_model_preset(args.model_preset, args.model_preset_file)
    tp, ep = parallel_degrees(preset, args.tp, args.ep)
    args.ep = ep
    trace = load_trace(args.trace)
    with _progress_bar(f"simulating {trace.name}", not args.json and sys.stderr.isatty()) as update:
        rows = simulate(
            trace, policies=args.policies, k0s=args.k0, batch_sizes=args.batch_sizes, mode=args.mode,
            seed=args.seed, num_batches=args.num_batches, model_preset=preset.model if preset else None,
            gpu=args.gpu, tp=tp, ep=ep, progress=update, policy_options=policy_options,
            precision=args.precision, max_batches=args.max_batches, dp=args.dp,
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    console = wide_console()
    console.print(simulation_table(trace.name, args, rows))
    for line in simulation_notes(rows, args.num_batches is None) + union_notes(rows):
        console.print(line)
    return 0


def simulation_table(name: str, args: argparse.Namespace, rows: list[dict[str, Any]]) -> Any:
    """The rich table of ``simulate`` rows (every mean with its 95% interval)."""
    from rich.table import Table

    counts = sorted({r["num_batches"] for r in rows})
    batches = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    how = f"auto for ±{100 * args.precision:g}% on T" if args.num_batches is None else "fixed"
    table = Table(title=f"{name} ({args.mode}, {batches} batches per B ({how}), seed {args.seed}; "
                        f"± = 95% interval over batches)")
    dp = args.dp > 1
    columns = ["policy", "k0", "B/rank" if dp else "B", *(["union"] if dp else []), "batches", "T mean", "p50",
               "p95", "T / vanilla", "experts/token", "kept top-k", "kept mass"]
    if dp:
        columns.append(f"T per rank (dp={args.dp})")
    if args.ep:
        columns.append(f"max T/device (ep={args.ep})")
    latency = rows[0].get("latency_model") if rows else None
    if latency:
        columns.append(f"latency µs ({latency})")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        cells = [row["policy"], _fmt(row["k0"]), str(row["batch_size"]), *([row["union"]] if dp else []),
                 str(row["num_batches"]),
                 format_interval(row["mean_active_experts"], row["mean_active_experts_ci"]),
                 _fmt(row["p50_active_experts"]), _fmt(row["p95_active_experts"]),
                 format_interval(row["active_ratio_vs_vanilla"], row["active_ratio_vs_vanilla_ci"], 2),
                 format_interval(row["mean_experts_per_token"], row["mean_experts_per_token_ci"], 2),
                 format_interval(row["kept_topk_share"], row["kept_topk_share_ci"], 3),
                 format_interval(row["kept_mass"], row["kept_mass_ci"], 3)]
        if dp:
            cells.append(format_interval(row["per_rank_active_experts"], row["per_rank_active_experts_ci"]))
        if args.ep:
            cells.append(format_interval(row.get("max_device_active_experts"),
                                         row.get("max_device_active_experts_ci")))
        if latency:
            cells.append(format_interval(row["predicted_latency_us"], row["predicted_latency_us_ci"]))
        table.add_row(*cells)
    return table


def simulation_notes(rows: list[dict[str, Any]], auto: bool) -> list[str]:
    """The replay note, and the rows whose T interval is wider than asked (batch count capped)."""
    if not rows:
        return ["no rows"]
    lines = [f"note: {rows[0]['note']}"]
    capped = [r for r in rows if r.get("t_ci_target_met") is False]
    if capped:
        wide = ", ".join(f"{_label(r)} (±{100 * r['t_ci_relative_half_width']:.1f}%)" for r in capped)
        lines.append(f"T's interval is wider than ±{100 * capped[0]['t_ci_target']:g}% of the mean after "
                     f"{capped[0]['num_batches']} batches (--max-batches) for: {wide}")
    elif not auto:
        widest = max(rows, key=lambda r: r["t_ci_relative_half_width"])
        lines.append(f"widest T interval: ±{100 * widest['t_ci_relative_half_width']:.1f}% of the mean "
                     f"({_label(widest)}); omit --num-batches for ±1%")
    return lines


def union_notes(rows: list[dict[str, Any]]) -> list[str]:
    """With ``--dp``: what the global union buys over the local one at each (policy, k0, B)."""
    from oea.sim.scaleout import union_comparison

    lines = []
    for item in union_comparison(rows):
        proxy = item["proxy"]
        device = ""
        if "local_max_device_active_experts" in item:
            device = (f", busiest device {item['local_max_device_active_experts']:.2f} -> "
                      f"{item['global_max_device_active_experts']:.2f}")
        lines.append(f"global vs local union, {item['policy']} k0={item['k0']} B={item['batch_size']}/rank x "
                     f"dp={item['dp']}: {proxy} {item[f'local_{proxy}']:.3f} -> {item[f'global_{proxy}']:.3f} "
                     f"({item[f'delta_{proxy}']:+.3f}), T {item['local_mean_active_experts']:.1f} -> "
                     f"{item['global_mean_active_experts']:.1f}{device}")
    return lines


def _label(row: dict[str, Any]) -> str:
    k0 = "" if row["k0"] is None else f" k0={row['k0']}"
    return f"{row['policy']}{k0} B={row['batch_size']}"


def _roofline(args: argparse.Namespace) -> int:
    import torch

    from oea.sim.preset_file import parallel_degrees, resolve_model_preset
    from oea.sim.roofline import roofline

    check_unique(args.k0, "--k0")
    check_unique(args.batch_sizes, "--batch-sizes")
    torch.set_num_threads(args.threads)
    default = None if args.model_preset_file else "qwen3-30b-a3b"
    preset = resolve_model_preset(args.model or default, args.model_preset_file, name_flag="--model")
    assert preset is not None
    if args.k0 is None:
        args.k0 = [k0 for k0 in (3, 5) if k0 <= preset.model.top_k] or [preset.model.top_k]
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
    table = Table(title="MoE layer roofline per batch size (trace T: mean ± 95% interval over batches)")
    columns = ["B", "T uniform", f"T vanilla ({first['trace'] or 'no trace'})", "FLOP/byte", "bound",
               "vanilla µs"]
    for k0 in args.k0:
        columns += [f"T OEA k0={k0}", f"OEA k0={k0} µs", "gain"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        cells = [str(row["batch_size"]), _fmt(row["uniform_active_experts"]),
                 format_interval(row["trace_vanilla_active_experts"], row["trace_vanilla_active_experts_ci"]),
                 _fmt(row["arithmetic_intensity"]), row["bound"],
                 format_interval(row["latency_vanilla_us"], row["latency_vanilla_us_ci"])]
        for k0 in args.k0:
            gain, gain_ci = row[f"predicted_gain_k0_{k0}"], row[f"predicted_gain_k0_{k0}_ci"]
            cells += [format_interval(row[f"oea_k0_{k0}_active_experts"], row[f"oea_k0_{k0}_active_experts_ci"]),
                      format_interval(row[f"latency_oea_k0_{k0}_us"], row[f"latency_oea_k0_{k0}_us_ci"]),
                      "-" if gain is None else format_interval(100 * gain, None if gain_ci is None else
                                                               [100 * g for g in gain_ci], 0) + "%"]
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
                   help="policy names from oea.routing.policy_names(): vanilla pruned oea ep-oea budget "
                        "subtractive adaptive (budget, subtractive, adaptive need --policy-option)")
    p.add_argument("--k0", type=int_at_least(1), nargs="+", default=[3], metavar="K0",
                   help="k0 values for the policies that take one, each in 1..top_k")
    add_batch_sizes_argument(p, [1, 4, 16, 64], "batch sizes B (each at most the trace's pool or requests)")
    p.add_argument("--mode", choices=["mixed", "lockstep"], default="mixed",
                   help="mixed: B random tokens of the pool; lockstep: B requests at the same position")
    p.add_argument("--num-batches", type=int_at_least(2), default=None,
                   help="batches per batch size (default: as many as T's 95%% interval needs to be within "
                        "--precision of the mean, at most --max-batches)")
    p.add_argument("--precision", type=float_between(0, 1, low_open=True), default=0.01,
                   help="target half-width of T's 95%% interval, relative to the mean, when --num-batches is "
                        "not given")
    p.add_argument("--max-batches", type=int_at_least(32), default=1024,
                   help="most batches per batch size drawn for --precision")
    p.add_argument("--seed", type=int, default=0, help="seeds batch formation (every policy sees the same batches)")
    p.add_argument("--model-preset", default=None,
                   help="built-in model preset for latency (`oea presets`; default: the trace's)")
    add_model_preset_file_argument(p)
    p.add_argument("--gpu", default=None, help="accelerator preset for predicted latency (`oea presets`; "
                                               "default: no latency)")
    p.add_argument("--tp", type=int_at_least(1), default=None, help="tensor-parallel degree for latency (default 1)")
    p.add_argument("--ep", type=int_at_least(1), default=None,
                   help="expert-parallel degree: report the busiest device's active experts, and place "
                        "ep-oea's experts on N devices (contiguous blocks; default: no EP)")
    p.add_argument("--dp", type=int_at_least(1), default=1,
                   help="data-parallel ranks: B rows per rank (--batch-sizes), each policy routed with a local "
                        "union per rank and a global one over all ranks; T and max T/device over all ranks")
    p.add_argument("--policy-option", nargs="+", default=None, metavar="POLICY:KEY=VALUE",
                   help="extra policy options, e.g. budget:budget=40 (VALUE parsed as JSON when possible)")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch.set_num_threads")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(handler=_simulate)

    r = commands.add_parser("roofline", help="memory- vs compute-bound analysis and OEA's theoretical gain")
    r.add_argument("--model", default=None, help="built-in model preset (default: qwen3-30b-a3b; `oea presets`)")
    add_model_preset_file_argument(r)
    r.add_argument("--gpu", default="h100-sxm", help="accelerator preset (`oea presets`)")
    r.add_argument("--tp", type=int_at_least(1), default=None, help="tensor-parallel degree (default 1)")
    r.add_argument("--ep", type=int_at_least(1), default=None, help="expert-parallel degree (default 1)")
    add_batch_sizes_argument(r, [1, 4, 16, 64, 256, 1024], "decode batch sizes B")
    r.add_argument("--k0", type=int_at_least(1), nargs="+", default=None, metavar="K0",
                   help="OEA k0 values, each in 1..top_k of the model (default: 3 5, those within top_k)")
    r.add_argument("--trace", default="qwen3-30b-a3b",
                   help="bundled trace or trace file for real T ('none' for uniform routing only)")
    r.add_argument("--num-batches", type=int_at_least(2), default=16,
                   help="simulated batches per batch size for the trace's T")
    r.add_argument("--seed", type=int, default=0, help="seeds batch formation")
    r.add_argument("--threads", type=int_at_least(1), default=1, help="torch.set_num_threads")
    r.add_argument("--json", action="store_true", help="print the rows as JSON")
    r.set_defaults(handler=_roofline)
