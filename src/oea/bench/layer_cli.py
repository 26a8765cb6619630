"""``oea bench layer``: parser only; the work happens in ``oea.bench.layer``."""

from __future__ import annotations

import argparse

DEFAULT_FIT = "cpu-preset"  # resolved to oea.sim.presets.CPU_FIT_PATH by the handler


def _layer(args: argparse.Namespace) -> int:
    from oea.bench.layer import main

    return main(args)


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "layer",
        help="MoE-layer decode latency A/B (vanilla / pruned / OEA) and a sweep over exact active-expert counts",
        description="Times a real-size MoE layer (only active experts computed) under routings from a trace "
        "and under synthetic routings with an exact number of active experts T; fits latency = b·T + a·B·k + c.",
    )
    p.add_argument("--preset", default="qwen3-30b-a3b", help="model preset (oea.sim.presets), e.g. qwen3-30b-a3b, "
                   "olmoe-1b-7b, glm-5 (with --tp 8)")
    p.add_argument("--batch-size", type=int, default=16, help="B, decode tokens per layer call")
    p.add_argument("--k0", type=int, nargs="+", default=[3], help="baseline experts per token for pruned and oea")
    p.add_argument("--policies", nargs="+", default=["vanilla", "pruned", "oea"],
                   help="policy rows to time (vanilla, pruned, oea)")
    p.add_argument("--trace", default=None, metavar="NAME_OR_PATH",
                   help="bundled trace or trace file for the policy rows; 'random' = Gaussian logits; "
                   "default: the trace bundled for the preset, else random")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds (each times every variant once)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (bf16), float16 (fp16) or float32 (fp32)")
    p.add_argument("--t-sweep", type=int, nargs="*", default=None, metavar="T",
                   help="exact active-expert counts for the synthetic sweep (default: 5 values from k to "
                   "min(N, B·k); give the flag with no value for no sweep)")
    p.add_argument("--impl", default="auto", choices=["auto", "loop", "grouped"],
                   help="expert computation: per-expert loop or torch._grouped_mm (auto: grouped where it works)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel slice: intermediate size / tp")
    p.add_argument("--weight-copies", type=int, default=None,
                   help="independent layer copies rotated over (default: enough for 256 MiB, memory permitting)")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of latency vs T")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-fit", nargs="?", const=DEFAULT_FIT, default=None, metavar="PATH",
                   help="write the fit for the cost model (no PATH: the cpu preset's "
                   "src/oea/sim/data/cpu_layer_fit.json)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(handler=_layer)
