"""Experts a MoE kernel loads for a CUDA-graph-padded decode batch, under four treatments of the padding rows.

SGLang (and vLLM) replay the graph captured for the next larger batch size: a decode batch of ``--real`` rows
runs as ``--graph`` rows, the extra ones holding stale inputs that route to real experts. At plain TP the MoE
kernel runs every row, so the experts it loads are the union over all of them. Per batch (``--real`` + padding
tokens drawn from a bundled trace; padding rows modelled as other tokens of the same traffic):

* ``stock``: the engine's routing on every row (what a server without OEA loads);
* ``joined``: OEA over every row, padding rows joining the union (a hook that cannot tell padding apart);
* ``stock_padding``: OEA over the real rows, padding rows keeping the engine's ids (the oea plugins today at
  plain TP: the union they compute excludes padding rows, but the kernel still loads those rows' experts);
* ``real_only``: OEA over the real rows, padding rows adding no expert (the ideal: e.g. padding rows given
  zero-weight copies of ids already in the union).

Usage: ``python scripts/sglang_padding_union.py --real 13 --graph 16 --k0 3`` (means with 95% intervals).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

TREATMENTS: tuple[str, ...] = ("stock", "joined", "stock_padding", "real_only")


def padded_union(logits: torch.Tensor, spec: object, k0: int, real: int, max_rank: int | None = None) -> dict[str, int]:
    """Active experts of one padded batch ([graph, E] router logits, the first ``real`` rows real) per treatment."""
    import oea

    cfg = oea.OEAConfig(k0, max_rank=max_rank)
    rows = logits.shape[0]
    stock = oea.route(logits, spec, None)
    joined = oea.route(logits, spec, cfg)
    ours = oea.route(logits, spec, cfg, torch.arange(rows) < real)  # rows past `real` keep the stock routing
    count = lambda ids, weights: int(oea.active_experts(ids, weights))  # noqa: E731
    return {"stock": count(*stock), "joined": count(*joined), "stock_padding": count(*ours),
            "real_only": count(ours[0][:real], ours[1][:real])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="qwen3-30b-a3b", help="bundled trace or trace file")
    parser.add_argument("--real", type=int, default=13, help="real rows of the decode batch")
    parser.add_argument("--graph", type=int, default=16, help="rows of the captured graph it replays in")
    parser.add_argument("--k0", type=int, default=3)
    parser.add_argument("--num-batches", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.real <= args.graph:
        parser.error(f"--real must be in 1..--graph ({args.graph}), got {args.real}")
    if args.num_batches < 2:
        parser.error(f"--num-batches must be >= 2, got {args.num_batches}")
    from oea.sim.simulate import router_inputs
    from oea.stats import mean_interval
    from oea.traces import load_trace

    torch.set_num_threads(1)
    trace = load_trace(args.trace)
    if args.graph > trace.num_tokens:
        parser.error(f"--graph {args.graph} is larger than the trace's {trace.num_tokens} tokens")
    generator = torch.Generator().manual_seed(args.seed)
    layers = [router_inputs(trace, layer) for layer in range(trace.num_layers)]
    max_rank = None if trace.has_logits else trace.spec.top_k  # id-only traces: piggyback within the top-k
    found: dict[str, list[float]] = {name: [] for name in TREATMENTS}
    for _ in range(args.num_batches):
        layer = int(torch.randint(trace.num_layers, (1,), generator=generator))
        tokens = torch.randperm(trace.num_tokens, generator=generator)[:args.graph]
        logits, spec, _ = layers[layer]
        for name, value in padded_union(logits[tokens], spec, args.k0, args.real, max_rank).items():
            found[name].append(float(value))
    out = {"trace": trace.name, "real": args.real, "graph": args.graph, "k0": args.k0, "num_batches": args.num_batches}
    for name, values in found.items():
        interval = mean_interval(values)
        out[name] = interval.estimate
        out[f"{name}_ci"] = [interval.low, interval.high]
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{trace.name}: {args.real} real rows replayed in the graph of {args.graph}, OEA k0={args.k0}, "
          f"{args.num_batches} batches; experts the MoE kernel loads (mean [95% interval]):")
    for name in TREATMENTS:
        print(f"  {name:14s} {out[name]:6.1f} [{out[name + '_ci'][0]:.1f}, {out[name + '_ci'][1]:.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
