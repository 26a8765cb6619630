"""``oea presets``: the built-in model and accelerator presets (and a user preset file, validated)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from oea.sim.preset_file import add_model_preset_file_argument


def model_row(preset: Any) -> dict[str, Any]:
    """One model preset as a JSON row (its fields plus the derived per-expert bytes)."""
    row = dataclasses.asdict(preset)
    row["expert_megabytes"] = preset.expert_bytes / 1e6
    return row


def gpu_row(preset: Any) -> dict[str, Any]:
    """One accelerator preset as a JSON row (the ``cpu`` fit flattened)."""
    row = {key: value for key, value in dataclasses.asdict(preset).items() if key != "fit"}
    row["measured"] = preset.measured
    return row


def _presets(args: argparse.Namespace) -> int:
    from oea.presets import MODEL_PRESETS, gpu_presets
    from oea.sim.preset_file import load_model_preset_file

    models = [model_row(preset) for preset in MODEL_PRESETS.values()]
    for row in models:
        row["origin"] = "built-in"
    if args.model_preset_file:
        loaded = load_model_preset_file(args.model_preset_file)
        row = model_row(loaded.model)
        row.update(origin=loaded.path, tp=loaded.tp, ep=loaded.ep)
        models.append(row)
    gpus = [gpu_row(preset) for preset in gpu_presets().values()]
    if args.json:
        print(json.dumps({"models": models, "gpus": gpus}, indent=1))
        return 0
    from rich.table import Table

    from oea.console import wide_console

    console = wide_console()
    table = Table(title="model presets (--model-preset NAME, or --model-preset-file FILE)")
    for column in ("name", "N", "top-k", "hidden", "expert intermediate", "MoE layers", "bytes/weight", "scoring",
                   "MB/expert", "origin"):
        table.add_column(column, justify="right")
    for row in models:
        table.add_row(row["name"], str(row["num_experts"]), str(row["top_k"]), str(row["hidden_size"]),
                      str(row["moe_intermediate_size"]), str(row["num_moe_layers"]), f"{row['bytes_per_weight']:g}",
                      row["scoring"], f"{row['expert_megabytes']:.2f}", row["origin"])
    console.print(table)
    table = Table(title="accelerator presets (--gpu NAME)")
    for column in ("name", "GB/s", "TF bf16", "TF fp8", "TF fp4", "fixed µs", "interconnect GB/s", "measured"):
        table.add_column(column, justify="right")

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:g}"

    for row in gpus:
        table.add_row(row["name"], number(row["hbm_bandwidth_GBps"]), number(row["peak_tflops_bf16"]),
                      number(row["peak_tflops_fp8"]), number(row["peak_tflops_fp4"]),
                      number(row["launch_overhead_us"]), number(row["interconnect_GBps"]),
                      "yes" if row["measured"] else "no")
    console.print(table)
    console.print("Sources: `oea presets --json` (field 'source'). Your own model: docs/presets.md.")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("presets", help="list the built-in model and accelerator presets (or check a preset file)")
    add_model_preset_file_argument(p)
    p.add_argument("--json", action="store_true", help="print {\"models\": [...], \"gpus\": [...]} as JSON")
    p.set_defaults(handler=_presets)
