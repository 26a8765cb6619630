"""``oea bench layer``: the parser and its handler; the measurement lives in ``oea.bench.layer.run``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from oea.bench.passive_wait import launched_from_shell, reexec_passive, start_note
from oea.console import (
    add_batch_sizes_argument,
    check_output_file,
    check_plot_file,
    check_unique,
    int_at_least,
    seed_value,
)

if TYPE_CHECKING:
    from oea.bench.layer.inputs import LayerBenchConfig

DEFAULT_FIT = "cpu-preset"  # resolved to oea.presets.CPU_FIT_PATH by the handler
COMMAND = ("bench", "layer")


def config_from_args(args: argparse.Namespace) -> LayerBenchConfig:
    """``argparse.Namespace`` of ``oea bench layer`` -> ``LayerBenchConfig``."""
    from oea.bench.layer.inputs import LayerBenchConfig

    return LayerBenchConfig(
        preset=args.preset, batch_size=args.batch_sizes[0], k0s=tuple(args.k0), policies=tuple(args.policies),
        trace=args.trace, repeats=args.repeats, warmup=args.warmup, threads=args.threads, device=args.device,
        dtype=args.dtype, t_sweep=None if args.t_sweep is None else tuple(args.t_sweep), seed=args.seed,
        impl=args.impl, tp=args.tp, weight_copies=args.weight_copies,
    )


def _layer(args: argparse.Namespace) -> int:
    """Handler of ``oea bench layer``."""
    from oea.bench.layer.fit import write_fit
    from oea.bench.layer.output import plot_result, render_table
    from oea.bench.layer.run import check_config, run_layer_bench

    check_unique(args.policies, "--policies")
    check_unique(args.k0, "--k0")
    config = config_from_args(args)
    check_config(config)  # bad flags fail here, in one line, before the re-run below
    if args.plot:
        check_plot_file(args.plot)
    if args.write_fit and args.write_fit != DEFAULT_FIT:
        check_output_file(args.write_fit, "--write-fit")
    many_cpu_threads = config.device == "cpu" and config.threads > 1
    reexec_passive(COMMAND, many_cpu_threads)
    note = start_note("oea bench layer", many_cpu_threads)
    progress = None
    if not args.json:
        from rich.console import Console

        console = Console(stderr=True)

        def progress(done: int, total: int) -> None:
            nonlocal note
            if note is not None:  # the measurement has started: every argument passed its checks
                console.print(note, highlight=False)
                note = None
            if done == total or done % max(1, total // 10) == 0:
                console.print(f"  round {done}/{total}", highlight=False)

    result = run_layer_bench(config, progress)
    result["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    from_shell = launched_from_shell(COMMAND)
    result["command"] = " ".join(["oea", *sys.argv[1:]]) if from_shell else "oea bench layer (called in-process)"
    if args.plot:
        result["plot"] = str(plot_result(result, args.plot))
    if args.write_fit:
        from oea.presets import CPU_FIT_PATH

        target = CPU_FIT_PATH if args.write_fit == DEFAULT_FIT else args.write_fit
        result["fit_file"] = str(write_fit(result, target))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render_table(result)
        for key in ("plot", "fit_file"):
            if key in result:
                print(f"wrote {result[key]}")
    return 0


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "layer",
        help="MoE-layer decode latency A/B (vanilla / pruned / OEA) and a sweep over exact active-expert counts",
        description="Times a real-size MoE layer (only active experts computed) under routings from a trace "
        "and under synthetic routings with an exact number of active experts T; fits latency = b·T + a·B·k + c.",
    )
    p.add_argument("--preset", default="qwen3-30b-a3b", help="model preset (oea.presets), e.g. qwen3-30b-a3b, "
                   "olmoe-1b-7b, glm-5 (with --tp 8)")
    add_batch_sizes_argument(p, [16], "B, decode tokens per layer call (one batch size per run)", single=True,
                             legacy_alias=True)
    p.add_argument("--k0", type=int_at_least(1), nargs="+", default=[3],
                   help="baseline experts per token for pruned and oea, each in 1..top_k")
    p.add_argument("--policies", nargs="+", default=["vanilla", "pruned", "oea"],
                   help="policy rows to time (vanilla, pruned, oea)")
    p.add_argument("--trace", default=None, metavar="NAME_OR_PATH",
                   help="bundled trace or trace file for the policy rows; 'random' = Gaussian logits; "
                   "default: the trace bundled for the preset, else random")
    p.add_argument("--repeats", type=int_at_least(1), default=20, help="timed rounds (each times every variant once)")
    p.add_argument("--warmup", type=int_at_least(0), default=2, help="untimed rounds first")
    p.add_argument("--threads", type=int_at_least(1), default=2, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the layer runs")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (bf16), float16 (fp16) or float32 (fp32)")
    p.add_argument("--t-sweep", type=int_at_least(1), nargs="*", default=None, metavar="T",
                   help="exact active-expert counts for the synthetic sweep (default: 5 values from k to "
                   "min(N, B·k); give the flag with no value for no sweep)")
    p.add_argument("--impl", default="auto", choices=["auto", "loop", "grouped"],
                   help="expert computation: per-expert loop or torch._grouped_mm (auto: grouped where it works)")
    p.add_argument("--tp", type=int_at_least(1), default=1, help="tensor-parallel slice: intermediate size / tp")
    p.add_argument("--weight-copies", type=int_at_least(1), default=None,
                   help="independent layer copies rotated over (default: enough for 256 MiB, memory permitting)")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of latency vs T")
    p.add_argument("--seed", type=seed_value, default=0, help="seeds the weights, random logits and trace batches")
    p.add_argument("--write-fit", nargs="?", const=DEFAULT_FIT, default=None, metavar="PATH",
                   help="write the fit for the cost model (no PATH: the cpu preset's "
                   "src/oea/presets/data/cpu_layer_fit.json)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(handler=_layer)
