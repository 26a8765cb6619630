"""``oea roofline``: parser and printing only; the figures come from ``oea.sim.roofline``."""

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
from oea.sim.preset_file import add_model_preset_file_argument


def _pct(gain: float | None, ci: list[float] | None) -> str:
    if gain is None:
        return "-"
    return format_interval(100 * gain, None if ci is None else [100 * g for g in ci], 0) + "%"


def _roofline(args: argparse.Namespace) -> int:
    import torch

    from oea.presets import get_gpu_preset
    from oea.sim.preset_file import parallel_degrees, resolve_model_preset
    from oea.sim.roofline import roofline
    from oea.sim.step import resolve_interconnect

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
    link = resolve_interconnect(get_gpu_preset(args.gpu), args.interconnect, args.interconnect_gbps,
                                args.interconnect_latency_us)
    trace = None if args.trace == "none" else args.trace
    with progress_bar("oea roofline: simulating trace T", not args.json) as update:
        rows = roofline(
            preset.model, args.gpu, tp=args.tp, ep=args.ep, batch_sizes=args.batch_sizes, k0s=args.k0,
            trace=trace, num_batches=args.num_batches, seed=args.seed, progress=update,
            context_len=args.context_len, interconnect=link,
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    console = wide_console()
    first = rows[0]
    console.print(
        f"[bold]{first['model']}[/] on [bold]{first['gpu']}[/] tp={args.tp} ep={args.ep}: "
        f"b = {first['expert_load_us']:.2f} µs per active expert (weight load), "
        f"a = {first['token_compute_us']:.4f} µs per token slot (compute), "
        f"ridge point {first['ridge_point_flops_per_byte']:.0f} FLOP/byte"
    )
    console.print(_layer_table(rows, args.k0))
    console.print(
        "Memory-bound while FLOP/byte < ridge point: latency ≈ fixed + b·T, so OEA's gain follows the drop "
        "in T. Trace T is scaled to the model by T_uniform(model)·T_trace/T_uniform(trace) when N or k "
        "differ. Datasheet peaks make absolute times optimistic; the ratios are the robust output."
    )
    if first["step_note"] is not None:
        console.print(first["step_note"])
        return 0
    console.print(_step_table(rows, args.k0))
    link_text = f"{first['interconnect']}: {first['interconnect_GBps']:g} GB/s, {first['interconnect_latency_us']:g} µs"
    console.print(
        f"Decode step per TP rank, all layers, context {first['context_len']} tokens per request, all-reduce over "
        f"{link_text} (--interconnect, --interconnect-gbps, --interconnect-latency-us). step = L·(attention + KV) "
        "+ L_dense·dense MLP + L_moe·(shared + routed experts) + 2·L·all-reduce + lm_head; OEA changes only the "
        "routed experts, so step gain ≈ MoE share × layer gain (formula and assumptions: docs/simulate.md)."
    )
    return 0


def _layer_table(rows: list[dict[str, Any]], k0s: list[int]) -> Any:
    from rich.table import Table

    first = rows[0]
    table = Table(title="MoE layer roofline per batch size (trace T: mean ± 95% interval over batches)")
    columns = ["B", "T uniform", f"T vanilla ({first['trace'] or 'no trace'})", "FLOP/byte", "bound",
               "vanilla µs"]
    for k0 in k0s:
        columns += [f"T OEA k0={k0}", f"OEA k0={k0} µs", "gain"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        cells = [str(row["batch_size"]), format_value(row["uniform_active_experts"]),
                 format_interval(row["trace_vanilla_active_experts"], row["trace_vanilla_active_experts_ci"]),
                 format_value(row["arithmetic_intensity"]), row["bound"],
                 format_interval(row["latency_vanilla_us"], row["latency_vanilla_us_ci"])]
        for k0 in k0s:
            cells += [format_interval(row[f"oea_k0_{k0}_active_experts"], row[f"oea_k0_{k0}_active_experts_ci"]),
                      format_interval(row[f"latency_oea_k0_{k0}_us"], row[f"latency_oea_k0_{k0}_us_ci"]),
                      _pct(row[f"predicted_gain_k0_{k0}"], row[f"predicted_gain_k0_{k0}_ci"])]
        table.add_row(*cells)
    return table


def _step_table(rows: list[dict[str, Any]], k0s: list[int]) -> Any:
    from rich.table import Table

    table = Table(title="Whole decode step per batch size (µs per TP rank, summed over layers; vanilla routing)")
    columns = ["B", "attention", "KV cache", "dense+shared MLP", "all-reduce", "lm_head", "routed experts",
               "step", "MoE share"]
    for k0 in k0s:
        columns += [f"step OEA k0={k0}", "step gain"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        parts_us = (row["step_attention_us"], row["step_kv_cache_us"],
                    row["step_dense_mlp_us"] + row["step_shared_experts_us"], row["step_all_reduce_us"],
                    row["step_lm_head_us"], row["step_routed_experts_vanilla_us"])
        cells = [str(row["batch_size"]), *(format_value(us, 0) for us in parts_us),
                 format_interval(row["step_latency_vanilla_us"], row["step_latency_vanilla_us_ci"], 0),
                 f"{100 * row['moe_share_of_step']:.0f}%"]
        for k0 in k0s:
            cells += [format_interval(row[f"step_latency_oea_k0_{k0}_us"], row[f"step_latency_oea_k0_{k0}_us_ci"], 0),
                      _pct(row[f"predicted_step_gain_k0_{k0}"], row[f"predicted_step_gain_k0_{k0}_ci"])]
        table.add_row(*cells)
    return table


def register(commands: argparse._SubParsersAction) -> None:
    from oea.sim.step import interconnect_names

    r = commands.add_parser("roofline", help="memory- vs compute-bound analysis and OEA's theoretical gain, "
                                             "per MoE layer and for the whole decode step")
    r.add_argument("--model", "--model-preset", dest="model", default=None,  # --model-preset: simulate's name
                   help="built-in model preset (default: qwen3-30b-a3b; `oea presets`)")
    add_model_preset_file_argument(r)
    r.add_argument("--gpu", default="h100-sxm", help="accelerator preset (`oea presets`)")
    r.add_argument("--tp", type=int_at_least(1), default=None,
                   help="tensor-parallel degree (default 1); must split the model's heads and MLP widths evenly")
    r.add_argument("--ep", type=int_at_least(1), default=None, help="expert-parallel degree (default 1)")
    add_batch_sizes_argument(r, [1, 4, 16, 64, 256, 1024], "decode batch sizes B")
    r.add_argument("--k0", type=int_at_least(1), nargs="+", default=None, metavar="K0",
                   help="OEA k0 values, each in 1..top_k of the model (default: 3 5, those within top_k)")
    r.add_argument("--trace", default="qwen3-30b-a3b",
                   help="bundled trace or trace file for real T ('none' for uniform routing only)")
    r.add_argument("--num-batches", type=int_at_least(2), default=16,
                   help="simulated batches per batch size for the trace's T")
    r.add_argument("--context-len", type=int_at_least(1), default=2048,
                   help="step level: cached tokens each decode token attends to (prompt + output so far)")
    r.add_argument("--interconnect", choices=interconnect_names(), default=None,
                   help="step level and TP all-reduce: the device link (default: the --gpu preset's own)")
    r.add_argument("--interconnect-gbps", type=float_between(0, low_open=True), default=None,
                   help="the link's per-direction bandwidth, GB/s (overrides --interconnect's)")
    r.add_argument("--interconnect-latency-us", type=float_between(0), default=None,
                   help="the latency floor of one all-reduce, µs (overrides --interconnect's)")
    r.add_argument("--seed", type=seed_value, default=0, help="seeds batch formation")
    r.add_argument("--threads", type=int_at_least(1), default=1, help="torch.set_num_threads")
    r.add_argument("--json", action="store_true", help="print the rows as JSON")
    r.set_defaults(handler=_roofline)
