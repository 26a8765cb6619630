"""``oea inflate``: write a Qwen3-MoE-style checkpoint whose experts have a real model's byte size
(parser only; the work happens in ``oea.models.inflate``)."""

from __future__ import annotations

import argparse
import json

from oea.console import progress_bar, seed_value


def _inflate(args: argparse.Namespace) -> int:
    from oea.models.inflate import write_inflated

    if (args.like is None) == (args.moe_intermediate_size is None):
        raise ValueError("give exactly one of --like PRESET and --moe-intermediate-size N")
    with progress_bar(f"oea inflate: writing {args.out}", not args.json) as update:
        summary = write_inflated(args.out, args.model, like=args.like,
                                 moe_intermediate_size=args.moe_intermediate_size, seed=args.seed, progress=update)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"wrote {summary['out_dir']}: moe_intermediate_size {summary['base_size']} -> {summary['size']} "
              f"({summary['num_moe_layers']} layers x {summary['num_experts']} experts, "
              f"{summary['expert_bytes'] / 2**20:.2f} MiB per expert, {summary['bytes_written'] / 2**30:.2f} GiB)")
    return 0


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    from oea.presets import model_preset_names

    p = commands.add_parser(
        "inflate",
        help="widen a MoE checkpoint's experts to a real model's byte size (same function, same text)",
        description=(
            "Writes a Hugging Face checkpoint (vLLM and transformers load it) whose routed experts have the "
            "per-expert byte size of --like PRESET (or --moe-intermediate-size N), computing exactly the base "
            "model's function: the added intermediate channels get random gate/up rows and zero down-projection "
            "columns (dense weights). Disk and memory are checked before anything is written."
        ),
    )
    p.add_argument("--like", metavar="PRESET",
                   help=f"match this model preset's per-expert bytes: one of {', '.join(model_preset_names())}")
    p.add_argument("--moe-intermediate-size", type=int, metavar="N", help="explicit expert intermediate size")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist or be empty)")
    p.add_argument("--model", metavar="DIR", help="base checkpoint (default: the embedded model)")
    p.add_argument("--seed", type=seed_value, default=0, help="seed of the padding gate/up rows")
    p.add_argument("--json", action="store_true", help="print the inflation summary as JSON")
    p.set_defaults(handler=_inflate)
