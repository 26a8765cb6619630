"""``oea simulate`` (parsers only; work happens in ``oea.sim``); registers ``oea presets`` and ``oea roofline``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from oea.console import (
    add_batch_sizes_argument,
    check_unique,
    float_between,
    format_interval,
    format_value,
    int_at_least,
    progress_bar,
    seed_value,
    wide_console,
)
from oea.sim import presets_cli, roofline_cli
from oea.sim.preset_file import add_model_preset_file_argument


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


def _simulate(args: argparse.Namespace) -> int:
    import torch

    from oea.presets import get_model_preset
    from oea.sim.costmodel import check_parallel
    from oea.sim.preset_file import parallel_degrees, parallel_names, resolve_model_preset
    from oea.sim.simulate import simulate
    from oea.traces import load_trace

    for values, flag in ((args.policies, "--policies"), (args.k0, "--k0"), (args.batch_sizes, "--batch-sizes")):
        check_unique(values, flag)
    policy_options = parse_policy_options(args.policy_option)
    ignored = [flag for flag, value in (("--model-preset", args.model_preset), ("--tp", args.tp)) if value is not None]
    if args.gpu is None and ignored:  # they only set the latency model, which --gpu turns on
        verb = "sets" if len(ignored) == 1 else "set"
        raise ValueError(f"{' and '.join(ignored)} {verb} the latency model, which needs --gpu (an accelerator "
                         "preset, `oea presets`): add --gpu, or leave them out")
    torch.set_num_threads(args.threads)
    preset = resolve_model_preset(args.model_preset, args.model_preset_file)
    tp, ep = parallel_degrees(preset, args.tp, args.ep)
    trace = load_trace(args.trace)
    model = preset.model if preset is not None else trace.meta.get("model_preset")
    if args.gpu is not None and model is not None:  # the latency model's degrees, checked before any work
        check_parallel(get_model_preset(model) if isinstance(model, str) else model, tp, ep or 1,
                       *parallel_names(preset, args.tp, args.ep))
    if ep is not None and trace.spec.num_experts % ep:  # the busiest-device count's blocks
        raise ValueError(f"{parallel_names(preset, args.tp, args.ep)[1]} must divide the trace's num_experts="
                         f"{trace.spec.num_experts}, got {ep}")
    whole = [b for b in args.batch_sizes if args.mode == "mixed" and b * args.dp == trace.num_tokens]
    if whole:  # every mixed batch would be the same one: a mean over copies with a zero-width interval
        raise ValueError(f"--batch-sizes {whole[0]}{f' x --dp {args.dp}' if args.dp > 1 else ''} takes the whole "
                         f"pool of trace {trace.name!r} ({trace.num_tokens} tokens): every mixed batch would be the "
                         f"same one and an interval needs two different batches; use batch sizes < "
                         f"{trace.num_tokens // args.dp}")
    args.ep = ep
    with progress_bar(f"oea simulate: simulating {trace.name}", not args.json) as update:
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
        cells = [row["policy"], format_value(row["k0"]), str(row["batch_size"]), *([row["union"]] if dp else []),
                 str(row["num_batches"]),
                 format_interval(row["mean_active_experts"], row["mean_active_experts_ci"]),
                 format_value(row["p50_active_experts"]), format_value(row["p95_active_experts"]),
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
    """The replay note, the batch sizes whose every distinct lockstep batch is used, and the rows whose T
    interval is wider than asked (batch count capped)."""
    if not rows:
        return ["no rows"]
    lines = [f"note: {rows[0]['note']}"]
    exhausted = [r for r in rows if r.get("distinct_batches") == r["num_batches"]]
    if exhausted:
        counts = dict.fromkeys((r["batch_size"], r["num_batches"]) for r in exhausted)
        sizes = ", ".join(f"B={b}: {n}" for b, n in counts)
        lines.append(f"every distinct lockstep batch of the trace is used, each once ({sizes}); the intervals count "
                     "these batches, and more batches would only repeat them")
    capped = [r for r in rows if r.get("t_ci_target_met") is False and r not in exhausted]
    if capped:
        wide = ", ".join(f"{_label(r)} (±{100 * r['t_ci_relative_half_width']:.1f}%)" for r in capped)
        lines.append(f"T's interval is wider than ±{100 * capped[0]['t_ci_target']:g}% of the mean after "
                     f"{capped[0]['num_batches']} batches (--max-batches) for: {wide}")
    elif not auto and len(exhausted) < len(rows):
        widest = max((r for r in rows if r not in exhausted), key=lambda r: r["t_ci_relative_half_width"])
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
    p.add_argument("--seed", type=seed_value, default=0,
                   help="seeds batch formation (every policy sees the same batches)")
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

    roofline_cli.register(commands)
