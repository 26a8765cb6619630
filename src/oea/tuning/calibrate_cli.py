"""``oea calibrate adaptive|layers``: k0 per batch-size range (and per layer) from a trace, with predicted
T and latency gain per range, written as the ``OEA_LAYER_K0_FILE`` the engine plugins read."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from oea.console import seed_value
from oea.sim.preset_file import add_model_preset_file_argument

DEFAULT_BATCH_SIZES = (1, 4, 16, 64)
DEFAULT_GPU = "h100-sxm"


def _batch_sizes(args: argparse.Namespace) -> tuple[list[int], bool]:
    """The batch sizes to calibrate and whether k0 may differ between ranges (``batch_k0``)."""
    if args.what == "adaptive":
        if args.batch_size is not None:
            raise ValueError("--batch-size applies to `oea calibrate layers`; `oea calibrate adaptive` takes "
                             "--batch-sizes B1 B2 ... (one k0 per batch-size range)")
        sizes, ranged = args.batch_sizes or list(DEFAULT_BATCH_SIZES), True
    elif args.batch_size is not None and args.batch_sizes is not None:
        raise ValueError("give --batch-size B (one k0 per layer for every batch size) or --batch-sizes B1 B2 ... "
                         "(one k0 per layer and batch-size range), not both")
    elif args.batch_sizes is not None:
        sizes, ranged = args.batch_sizes, True
    else:
        sizes, ranged = [16 if args.batch_size is None else args.batch_size], False
    bad = [b for b in sizes if b < 1]
    if bad:
        raise ValueError(f"--batch-sizes/--batch-size values must be integers >= 1, got {bad}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"--batch-sizes must not repeat a value, got {sizes}")
    return sorted(sizes), ranged


def _check_numbers(args: argparse.Namespace) -> None:
    if not (math.isfinite(args.tolerance) and 0.0 <= args.tolerance <= 1.0):
        raise ValueError(f"--tolerance must be in [0, 1] (the largest mean proxy loss: 1 - kept router mass, or "
                         f"1 - share of the top-k kept), got {args.tolerance:g}")
    if args.num_batches < 2:
        raise ValueError(f"--num-batches must be >= 2 (the intervals need two batches), got {args.num_batches}")
    if args.min_batch < 0:
        raise ValueError(f"--min-batch must be an integer >= 0, got {args.min_batch}")


def _cost_model(args: argparse.Namespace, trace: Any) -> tuple[Any | None, str]:
    """The latency model (``None`` when no model preset is known) and a line saying which it is."""
    from oea.presets import get_gpu_preset, get_model_preset
    from oea.sim.costmodel import CostModel, check_parallel
    from oea.sim.preset_file import parallel_degrees, parallel_names, resolve_model_preset

    preset = resolve_model_preset(args.model_preset, args.model_preset_file)
    tp, ep = parallel_degrees(preset, args.tp, args.ep)
    model = preset.model if preset is not None else None
    if model is None and trace.meta.get("model_preset"):
        model = get_model_preset(trace.meta["model_preset"])
    if model is None:
        if args.gpu is not None:
            raise ValueError(f"trace {trace.name!r} names no model preset; pass --model-preset or "
                             f"--model-preset-file to predict latency on --gpu {args.gpu}")
        return None, ("latency: not predicted (the trace names no model preset: pass --model-preset NAME or "
                      "--model-preset-file FILE, and --gpu)")
    check_parallel(model, tp, ep or 1, *parallel_names(preset, args.tp, args.ep))
    cost = CostModel(model, get_gpu_preset(args.gpu or DEFAULT_GPU), tp=tp, ep=ep or 1)
    line = f"latency: cost model, {model.name} on {cost.gpu.name} tp={cost.tp} ep={cost.ep} (datasheet peaks)"
    if cost.ep > 1:
        line += "; EP assumes balanced devices (T/ep): `oea simulate --ep` measures the busiest one"
    if (model.num_experts, model.top_k) != (trace.spec.num_experts, trace.spec.top_k):
        line += (f"; the preset's N={model.num_experts}, k={model.top_k} differ from the trace's "
                 f"N={trace.spec.num_experts}, k={trace.spec.top_k}: the trace's T is used as is")
    return cost, line


def _calibrate(args: argparse.Namespace) -> int:
    import pathlib

    import torch

    from oea.config import write_layer_k0_file
    from oea.traces import load_trace
    from oea.tuning.calibrate import proxy_name
    from oea.tuning.recommend import measure_samples, range_rows, recommend

    torch.set_num_threads(max(1, args.threads))
    _check_numbers(args)
    sizes, ranged = _batch_sizes(args)
    trace = load_trace(args.trace)
    top_k = trace.spec.top_k
    k0s = sorted(set(args.k0 or range(1, top_k + 1)) | {top_k})
    bad = [k for k in k0s if not 1 <= k <= top_k]
    if bad:
        raise ValueError(f"--k0 values must be in 1..{top_k} (the trace's top_k), got {bad}")
    skipped = [b for b in sizes if b < args.min_batch]
    calibrated = [b for b in sizes if b not in skipped]
    if not calibrated:
        raise ValueError(f"every batch size {sizes} is below --min-batch={args.min_batch} (OEA leaves such "
                         f"batches vanilla); give batch sizes >= {args.min_batch}")
    cost, latency_line = _cost_model(args, trace)
    out = pathlib.Path(args.out) if args.out else None
    if out is not None and out.is_dir():
        raise ValueError(f"--out must name a file (the OEA_LAYER_K0_FILE to write), got the directory {out}")
    if out is not None:
        from oea.console import check_output_file

        check_output_file(out, "--out")
    samples = measure_samples(trace, calibrated, k0s, num_batches=args.num_batches, seed=args.seed, mode=args.mode)
    schedule, chosen = recommend(trace, samples, args.tolerance, per_layer=args.what == "layers",
                                 min_batch=args.min_batch)
    if not ranged:  # one k0 per layer, the same at every batch size
        from dataclasses import replace

        schedule = replace(schedule, k0=chosen[calibrated[0]], batch_k0=None)
    rows = range_rows(samples, chosen, cost, per_layer=args.what == "layers")
    if not ranged:
        rows[0]["batch_sizes"] = [args.min_batch, None]
    result: dict[str, Any] = {
        "trace": trace.name, "proxy": proxy_name(trace), "tolerance": args.tolerance, "mode": args.mode,
        "num_batches": args.num_batches, "seed": args.seed, "min_batch": args.min_batch,
        "per_layer": args.what == "layers", "skipped_batch_sizes": skipped, "latency": latency_line,
        "vanilla_batch_sizes": [1, calibrated[0] - 1] if ranged and calibrated[0] > 1 else None,
        "ranges": rows, "k0": list(schedule.k0), "file": schedule.to_json(),
    }
    if args.what == "adaptive":
        result["schedule"] = [[entry["max_batch"], entry["k0"][0]] for entry in schedule.to_json().get(
            "batch_k0", [{"max_batch": calibrated[-1], "k0": list(schedule.k0)}])]
    if out is not None:
        try:
            write_layer_k0_file(schedule, out)
        except OSError as err:
            raise ValueError(f"--out {out}: cannot write ({err})") from None
        result["written"] = str(out)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0


def _cell(value: dict | None, digits: int, percent: bool = False) -> str:
    """``mean ± half-width`` of a t interval (symmetric), in percent when asked."""
    if value is None:
        return "-"
    scale = 100.0 if percent else 1.0
    half = scale * (value["ci"][1] - value["ci"][0]) / 2.0
    unit = "%" if percent else ""
    return f"{scale * value['mean']:.{digits}f}{unit} ± {half:.{digits}f}"


def _print(result: dict) -> None:
    from rich.table import Table

    from oea.console import wide_console

    console = wide_console()
    console.print(f"trace {result['trace']} · proxy {result['proxy']} (loss = 1 - proxy) · tolerance "
                  f"{result['tolerance']:g} · {result['mode']} batches, {result['num_batches']} per size, seed "
                  f"{result['seed']} · mean ± 95% t interval over batches")
    console.print(result["latency"])
    table = Table(title="recommended k0 per batch-size range (router call rows M)")
    for column in ("batch sizes", "k0", "proxy loss", "T vanilla", "T OEA", "T OEA/vanilla", "latency vanilla µs",
                   "latency OEA µs", "latency gain"):
        table.add_column(column, justify="right")
    if result["vanilla_batch_sizes"]:
        low, high = result["vanilla_batch_sizes"]
        table.add_row(f"{low}–{high}", "vanilla", "0", "-", "-", "1", "-", "-", "0% (uncalibrated)")
    for row in result["ranges"]:
        low, high = row["batch_sizes"]
        k0 = row["k0"] if isinstance(row["k0"], int) else "per layer"
        table.add_row(f"{low}–{high}" if high is not None else f"{low}+", str(k0), _cell(row["proxy_loss"], 4),
                      _cell(row["vanilla_active_experts"], 1), _cell(row["oea_active_experts"], 1),
                      _cell(row["active_ratio"], 2), _cell(row["predicted_latency_vanilla_us"], 1),
                      _cell(row["predicted_latency_oea_us"], 1), _cell(row["latency_gain"], 1, percent=True))
    console.print(table)
    for row in result["ranges"]:
        if not isinstance(row["k0"], int):
            console.print(f"k0 per layer at B={row['calibrated_at']}: {' '.join(map(str, row['k0']))}")
    if result["skipped_batch_sizes"]:
        console.print(f"skipped batch sizes {result['skipped_batch_sizes']}: below --min-batch={result['min_batch']}, "
                      f"OEA leaves them vanilla")
    if "written" in result:
        console.print(f"written to {result['written']}: serve with OEA_LAYER_K0_FILE={result['written']}")


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "calibrate", help="recommend k0 per batch-size range (adaptive) or per layer (layers) from a trace",
        description="Recommend k0 from a routing trace (bundled, recorded or `oea traces import`-ed): the smallest "
                    "k0 whose mean quality-proxy loss is within --tolerance, per batch-size range (adaptive) or per "
                    "layer (layers; with --batch-sizes per layer and range). Prints T and the predicted latency gain "
                    "per range and writes the OEA_LAYER_K0_FILE the engine plugins read (--out).",
    )
    p.add_argument("what", choices=["adaptive", "layers"],
                   help="adaptive: one k0 per batch-size range; layers: one k0 per layer (per range with "
                        "--batch-sizes)")
    p.add_argument("--trace", default="embedded", help="bundled trace name or trace file (default: embedded)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, metavar="B",
                   help=f"calibrated batch sizes; B's k0 covers B up to the next size (default for adaptive: "
                        f"{' '.join(map(str, DEFAULT_BATCH_SIZES))})")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="layers only: one k0 per layer calibrated at B and used at every batch size (default 16)")
    p.add_argument("--k0", type=int, nargs="+", help="candidate k0 values (default 1..top_k)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="largest mean proxy loss, in [0, 1] (default 0.05)")
    p.add_argument("--mode", choices=["mixed", "lockstep"], default="mixed",
                   help="how batches are formed, as in `oea simulate` (lockstep needs request ids and positions)")
    p.add_argument("--min-batch", type=int, default=2,
                   help="OEA leaves smaller batches vanilla; smaller batch sizes are not calibrated (default 2)")
    p.add_argument("--num-batches", type=int, default=32, help="batches per batch size (default 32)")
    p.add_argument("--seed", type=seed_value, default=0, help="seeds batch formation (default 0)")
    p.add_argument("--model-preset", default=None,
                   help="built-in model preset for latency (default: the trace's, when it names one)")
    add_model_preset_file_argument(p)
    p.add_argument("--gpu", default=None, help=f"accelerator preset for latency (default {DEFAULT_GPU} when a "
                                               f"model preset is known)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree for latency (default 1)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree for latency (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--out", help="write the recommendation as an OEA_LAYER_K0_FILE (JSON)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=_calibrate)
